"""A slow disk under the campaign's own PostgreSQL, made by the kernel: the block layer's throttle
(cgroup v1 `blkio.throttle.*`) on every process of the cluster, for the disk its data directory is on.

Why this and not another way: there is no dm-delay here (no device-mapper target to put under a
directory), and no netem. The blkio controller is mounted writable, and a throttled group really
waits in the block layer: PostgreSQL's WAL flushes (`fdatasync`), its checkpoints' `fsync`s and any
read that misses the page cache queue behind the limit, so commits take as long as they would on a
disk that slow. Lifting the limit (writing 0) heals it at once; nothing of it survives the run.

What it is not: a latency per I/O (dm-delay) but a rate limit (I/Os and bytes a second), so the
first I/Os of a burst may pass before the limit bites; and under cgroup v1 the kernel's own
background writeback of dirty pages is not charged to the group, only the I/O the PostgreSQL
processes issue themselves (the flushes and fsyncs a commit or a checkpoint waits for — which is
what makes a database slow).

The group is named after the harness's pid (`pdmn-<pid>-pg`); a group left by a crashed run (its pid
gone) is emptied into the root group and removed by the next run. It must never throttle a process
that is not the run's own PostgreSQL.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

from tests.nemesis.net import _alive

BLKIO = Path("/sys/fs/cgroup/blkio")
PREFIX = "pdmn-"
_GROUP_RE = re.compile(rf"^{PREFIX}(\d+)-pg$")
_LIMITS = ("read_iops_device", "write_iops_device", "read_bps_device", "write_bps_device")


def disk_of(path: Path) -> str | None:
    """The whole disk ("major:minor") the file system holding `path` is on, None if it is not on a
    block device (tmpfs, overlay): the throttle applies to whole disks, not partitions."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sysdev = Path("/sys/dev/block") / dev
    if os.major(st.st_dev) == 0 or not sysdev.exists():
        return None
    if (sysdev / "partition").exists():
        dev = (sysdev.resolve().parent / "dev").read_text().strip()
    return dev


def unavailable(path: Path) -> str | None:
    """Why a slow disk cannot be made under `path` here, or None if it can."""
    if not (BLKIO / "blkio.throttle.write_iops_device").exists():
        return f"no cgroup v1 blkio throttle at {BLKIO}"
    if not os.access(BLKIO, os.W_OK):
        return f"{BLKIO} is not writable (root is needed)"
    if disk_of(path) is None:
        return f"{path} is not on a block device"
    return None


def _own_group() -> Path:
    """The blkio group this process is in: where the processes it started were, and go back to."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "blkio" in controllers.split(","):
            return BLKIO / path.lstrip("/")
    return BLKIO


def _move(pids: list[int], group: Path) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile (a backend that ended)
            (group / "cgroup.procs").write_text(f"{pid}\n")


def _procs(group: Path) -> list[int]:
    try:
        return [int(x) for x in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _remove(group: Path, to: Path) -> None:
    _move(_procs(group), to)
    with contextlib.suppress(OSError):
        group.rmdir()


def cleanup_stale(log: Any = print) -> None:
    if not BLKIO.is_dir():
        return
    for g in BLKIO.iterdir():
        m = _GROUP_RE.match(g.name)
        if m and g.is_dir() and not _alive(int(m.group(1))):
            _remove(g, BLKIO)
            log(f"disk: removed the blkio group {g.name}, left by an earlier run")


def cluster_pids(data_dir: Path) -> list[int]:
    """The postmaster of the cluster in `data_dir` and every process it started (backends, WAL
    writer, checkpointer, I/O workers); what they start later inherits the group from the postmaster."""
    try:
        postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    pids = [postmaster]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == postmaster:
            pids.append(int(stat.parent.name))
    return pids


class SlowDisk:
    def __init__(self, data_dir: Path, log: Any = print) -> None:
        why = unavailable(data_dir)
        if why:
            raise RuntimeError(f"no slow disk: {why}")
        self.data_dir = data_dir
        self.dev = disk_of(data_dir)
        self.group = BLKIO / f"{PREFIX}{os.getpid()}-pg"
        self.home = _own_group()
        self.log = log

    def slow(self, iops: int, bps: int) -> int:
        """Throttle every process of the cluster to `iops` I/Os and `bps` bytes a second, each way.
        Returns how many processes it throttled. The cluster's processes are looked up each time:
        a restart of PostgreSQL makes new ones."""
        self.group.mkdir(exist_ok=True)
        pids = cluster_pids(self.data_dir)
        _move(pids, self.group)
        for name, value in zip(_LIMITS, (iops, iops, bps, bps), strict=True):
            (self.group / f"blkio.throttle.{name}").write_text(f"{self.dev} {value}\n")
        return len(pids)

    def heal(self) -> None:
        """No limit any more (0 lifts it); the processes may stay in the group, which limits nothing."""
        if not self.group.is_dir():
            return
        for name in _LIMITS:
            with contextlib.suppress(OSError):
                (self.group / f"blkio.throttle.{name}").write_text(f"{self.dev} 0\n")

    def remove(self) -> None:
        self.heal()
        if self.group.is_dir():
            _remove(self.group, self.home)
