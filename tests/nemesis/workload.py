"""The campaign's clients: submissions (half with idempotency keys), cancels and drains, sent to
either replica and retried on errors as a real client would. Every answer a client got is recorded;
the checker holds the servers to those answers.

The command of every task writes its own ground truth (start, pid, node, attempt, fencing token,
a tick every 100 ms while it lives, its end and exit code) into a directory no server is told of.
"""

from __future__ import annotations

import random
import ssl
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.nemesis.fleet import Fleet

# Runs on the node as the task. The token comes from PODIUM_FENCING_TOKEN when the agent sets it,
# else from the attempt's work directory (HOME = <state>/<task id>-<token>).
TRUTH_SCRIPT = r"""
import os, sys, time
tid = os.environ["PODIUM_TASK_ID"]
tok = os.environ.get("PODIUM_FENCING_TOKEN") or os.path.basename(os.environ["HOME"]).rsplit("-", 1)[1]
f = open(os.path.join(os.environ["NEMESIS_TRUTH"], tid + "." + tok), "a", buffering=1)
f.write("start %.6f %d %s %s %s\n" % (time.time(), os.getpid(), os.environ["PODIUM_NODE_ID"], os.environ["PODIUM_ATTEMPT"], tok))
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    time.sleep(0.1)
    f.write("tick %.6f\n" % time.time())
f.write("end %.6f %s\n" % (time.time(), sys.argv[2]))
f.close()
sys.exit(int(sys.argv[2]))
"""


@dataclass
class Submitted:
    task_id: str
    key: str | None
    exit_code: int
    acked_at: float


@dataclass
class Record:
    acks: list[Submitted] = field(default_factory=list)
    unacked: list[tuple[str | None, str]] = field(default_factory=list)  # (key, why) of submissions never answered
    cancels: dict[str, float] = field(default_factory=dict)  # task id → when a cancel was first sent
    ops: Counter[str] = field(default_factory=Counter)


class Workload:
    def __init__(self, fleet: Fleet, seed: int, rate: float = 3.0, log: Any = print) -> None:
        self.fleet = fleet
        self.rng = random.Random(seed)
        self.rate = rate
        self.log = log
        self.rec = Record()
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nemesis-workload", daemon=True)
        ctx = ssl.create_default_context(cafile=str(fleet.root / "pki" / "ca.pem"))
        self.clients = [httpx.Client(base_url=r.api, verify=ctx, timeout=5,
                                     headers={"Authorization": f"Bearer {fleet.admin_token}"}) for r in fleet.replicas]  # fmt: skip
        self.drained: dict[str, float] = {}  # node id → when to undrain

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_ev.set()
        self.thread.join(60)

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def _call(self, method: str, path: str, json: Any = None, tries: int = 6) -> httpx.Response | None:
        """Try the replicas in turn, as a client with two addresses would; None if nobody answered."""
        start = self.rng.randrange(len(self.clients))
        for i in range(tries):
            c = self.clients[(start + i) % len(self.clients)]
            try:
                r = c.request(method, path, json=json)
            except httpx.HTTPError:
                self.rec.ops["client errors"] += 1
                time.sleep(0.3)
                continue
            if r.status_code == 429 or r.status_code >= 500:
                self.rec.ops[f"http {r.status_code}"] += 1
                time.sleep(float(r.headers.get("Retry-After", "0.3")) if r.status_code == 429 else 0.3)
                continue
            return r
        return None

    def submit(self) -> None:
        keyed = self.rng.random() < 0.5
        key = f"nem-{uuid.UUID(int=self.rng.getrandbits(128)).hex}" if keyed else None
        # mostly short tasks; some long enough that a partition or a stopped agent catches them running
        dur = round(self.rng.uniform(0.3, 4.0) if self.rng.random() < 0.85 else self.rng.uniform(5.0, 15.0), 2)
        code = 0 if self.rng.random() < 0.85 else 3
        requeue = self.rng.random() < 0.8
        spec: dict[str, Any] = {
            "command": [sys.executable, "-I", "-c", TRUTH_SCRIPT, str(dur), str(code)],
            "env": {"NEMESIS_TRUTH": str(self.fleet.truth)},
            "resources": {"cpu": "100m", "memory": "32Mi"},
            "name": f"nem-{'k' if keyed else 'n'}-{code}",
            "requeue_on_node_loss": requeue,
        }
        if keyed:
            spec["idempotency_key"] = key
        # A client without a key retries too: it may create a second task it was never told of, and
        # that is its own choice; the checker holds the servers only to what they acknowledged.
        r = self._call("POST", "/v1/tasks", spec)
        self.rec.ops["submit (keyed)" if keyed else "submit"] += 1
        if r is not None and r.status_code in (200, 201):
            t = r.json()["task"]
            self.rec.acks.append(Submitted(t["id"], key, code, time.time()))
        else:
            self.rec.unacked.append((key, "no answer" if r is None else f"{r.status_code} {r.text[:200]}"))

    def cancel(self) -> None:
        live = [a for a in self.rec.acks[-40:] if a.task_id not in self.rec.cancels]
        if not live:
            return
        a = self.rng.choice(live)
        # recorded before it is sent: a cancel whose answer was lost may still have taken effect
        self.rec.cancels[a.task_id] = time.time()
        r = self._call("POST", f"/v1/tasks/{a.task_id}/cancel")
        self.rec.ops["cancel"] += 1
        if r is None or r.status_code != 200:
            self.rec.ops["cancel unanswered"] += 1

    def drain(self) -> None:
        ids = [h.node_id() for h in self.fleet.hosts]
        free = [i for i in ids if i and i not in self.drained]
        if not free or len(self.drained) >= len(ids) - 1:
            return  # always leave one node taking work
        node = self.rng.choice(free)
        if (r := self._call("POST", f"/v1/nodes/{node}/drain")) is not None and r.status_code == 200:
            self.drained[node] = time.monotonic() + self.rng.uniform(2, 6)
        self.rec.ops["drain"] += 1

    def undrain_due(self, everything: bool = False) -> None:
        for node, when in list(self.drained.items()):
            if (everything or time.monotonic() >= when) and (
                (r := self._call("POST", f"/v1/nodes/{node}/undrain", tries=20)) is not None and r.status_code == 200
            ):
                    del self.drained[node]
                    self.rec.ops["undrain"] += 1

    def _run(self) -> None:
        while not self.stop_ev.is_set():
            self.undrain_due()
            x = self.rng.random()
            if x < 0.75:
                self.submit()
            elif x < 0.92:
                self.cancel()
            else:
                self.drain()
            self.stop_ev.wait(self.rng.expovariate(self.rate))


def read_truth(d: Path) -> dict[str, list[dict[str, Any]]]:
    """Per task, every attempt that really started: token, pid, node, attempt, start, last sign of
    life, and its exit code if it ran to its end."""
    out: dict[str, list[dict[str, Any]]] = {}
    for p in sorted(d.iterdir()):
        tid, _, tok = p.name.partition(".")
        a: dict[str, Any] = {"token": int(tok), "end_code": None}
        for line in p.read_text().splitlines():
            w = line.split()
            if not w:
                continue
            if w[0] == "start" and len(w) >= 6:
                a.update(start=float(w[1]), pid=int(w[2]), node=w[3], attempt=int(w[4]), last=float(w[1]))
            elif w[0] == "tick" and len(w) == 2:
                a["last"] = float(w[1])
            elif w[0] == "end" and len(w) == 3:
                a["last"] = float(w[1])
                a["end_code"] = int(w[2])
        if "start" in a:
            out.setdefault(tid, []).append(a)
    for v in out.values():
        v.sort(key=lambda a: a["start"])
    return out
