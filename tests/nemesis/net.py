"""Network namespaces for the fleet: a bridge in the root namespace, and per agent host a namespace
joined to it by a veth pair, with its own address. Faults are real: the host's link set down, or
packets dropped one way by iptables inside the host's namespace.

Every name carries the harness's pid (`pdmn<pid>…`), so a run removes what a crashed earlier run
left behind (its pid no longer alive) and never touches anything another live run made, nor any
namespace or interface it did not create. It must never route beyond the bridge it made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import subprocess
from dataclasses import dataclass

PREFIX = "pdmn"
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-h\d+$")
_LINK_RE = re.compile(rf"^{PREFIX}(\d+)[bh]\d*$")


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(log: callable = print) -> int:  # type: ignore[valid-type]
    """Remove namespaces and links of earlier runs whose harness process is gone."""
    removed = 0
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if m and not _alive(int(m.group(1))):
            # whatever still runs in it (an agent, its tasks) goes first: it was that run's
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            sh("ip", "netns", "del", name, check=False)
            removed += 1
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = _LINK_RE.match(name)
        if m and not _alive(int(m.group(1))):
            sh("ip", "link", "del", name, check=False)
            removed += 1
    if removed:
        log(f"net: removed {removed} namespaces/links left by earlier runs")
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    used = sh("ip", "-4", "-o", "addr", "show", check=False).stdout
    start = os.getpid() % 200
    for k in range(200):
        net = ipaddress.IPv4Network(f"10.213.{(start + k) % 200 + 20}.0/24")
        if f"10.213.{(start + k) % 200 + 20}." not in used:
            return net
    raise RuntimeError("no free 10.213.x.0/24 subnet for the fleet's bridge")


@dataclass
class HostNet:
    ns: str
    veth: str
    ip: str


class Net:
    def __init__(self, log: callable = print) -> None:  # type: ignore[valid-type]
        self.log = log
        self.run = str(os.getpid())
        self.bridge = f"{PREFIX}{self.run}b"
        self.subnet = _free_subnet()
        hosts = list(self.subnet.hosts())
        self.gateway = str(hosts[0])
        self._addrs = [str(h) for h in hosts[9:]]
        self.hosts: list[HostNet] = []

    def up(self) -> Net:
        cleanup_stale(self.log)
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        return self

    def add_host(self) -> HostNet:
        i = len(self.hosts)
        h = HostNet(f"{PREFIX}-{self.run}-h{i}", f"{PREFIX}{self.run}h{i}", self._addrs[i])
        self.hosts.append(h)
        sh("ip", "netns", "add", h.ns)
        sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
        sh("ip", "link", "set", h.veth, "master", self.bridge)
        sh("ip", "link", "set", h.veth, "up")
        self.ns(h, "ip", "link", "set", "lo", "up")
        self.ns(h, "ip", "addr", "add", f"{h.ip}/{self.subnet.prefixlen}", "dev", "eth0")
        self.ns(h, "ip", "link", "set", "eth0", "up")
        return h

    def ns(self, h: HostNet, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return sh("ip", "netns", "exec", h.ns, *args, check=check)

    # ---- faults --------------------------------------------------------------------------------

    def link(self, h: HostNet, up: bool) -> None:
        self.ns(h, "ip", "link", "set", "eth0", "up" if up else "down")

    def drop(self, h: HostNet, direction: str) -> None:
        """Drop packets one way between the host and the servers: `in` (servers → host) or `out`."""
        if direction == "in":
            self.ns(h, "iptables", "-I", "INPUT", "-s", self.gateway, "-j", "DROP")
        else:
            self.ns(h, "iptables", "-I", "OUTPUT", "-d", self.gateway, "-j", "DROP")

    def undrop(self, h: HostNet) -> None:
        # the rules live only in the host's own namespace, so flushing them touches nothing else
        self.ns(h, "iptables", "-F", "INPUT", check=False)
        self.ns(h, "iptables", "-F", "OUTPUT", check=False)

    def down(self) -> None:
        for h in self.hosts:
            sh("ip", "netns", "del", h.ns, check=False)  # takes the veth pair with it
            sh("ip", "link", "del", h.veth, check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        self.hosts = []
