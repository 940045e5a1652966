"""The load generator: tasks submitted one by one through the real REST API (`POST /v1/tasks`), with
a bounded number in flight over httpx connection pools (4 connections each), at a fixed offered rate or as fast as the
server answers.

Each submission records its CLOCK_MONOTONIC time taken just before the POST (the `submit time` that
latency is measured from), the time the answer arrived, the HTTP status and the task id the server
gave. At a fixed rate the i-th submission is due at start + i/rate (open loop); if every worker is
busy it starts late, and `late` counts how many started more than 10 ms after they were due, so a
load generator that could not keep up is visible rather than silently lowering the offered load.

    PODIUM_TOKEN=pdm_… python bench/load.py --api http://127.0.0.1:8642 --tasks 1000 --rate 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

LATE_AFTER = 0.010  # seconds behind schedule that count as a late start
PER_POOL = 4  # connections per httpx pool


def default_spec(name: str = "bench") -> dict[str, Any]:
    # the process backend's smallest real task; the fleet never runs it
    return {"name": name, "command": ["true"]}


@dataclass
class Submission:
    task_id: str | None
    t_submit: float  # monotonic, just before the POST
    t_done: float  # monotonic, the answer arrived
    status: int  # HTTP status, 0 for a transport error
    due: float | None = None  # when an open-loop schedule wanted it sent


@dataclass
class LoadResult:
    started: float
    ended: float
    submissions: list[Submission] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    shed: int = 0  # POSTs the server refused with 429 (each sent again after its Retry-After)

    @property
    def ok(self) -> list[Submission]:
        return [s for s in self.submissions if s.task_id is not None]

    def submit_times(self) -> dict[str, float]:
        return {s.task_id: s.t_submit for s in self.submissions if s.task_id is not None}

    def summary(self) -> dict[str, Any]:
        ok = self.ok
        wall = max(1e-9, self.ended - self.started)
        rtts = sorted(s.t_done - s.t_submit for s in ok)
        late = [s for s in self.submissions if s.due is not None and s.t_submit - s.due > LATE_AFTER]
        return {
            "submitted": len(self.submissions),
            "accepted": len(ok),
            "failed": len(self.submissions) - len(ok),
            "errors": self.errors,
            "shed_429": self.shed,
            "wall_s": round(wall, 3),
            "submit_rate_per_s": round(len(ok) / wall, 1),
            "post_rtt_ms": percentiles(rtts, scale=1000.0),
            "late_starts": len(late),
            "max_lateness_ms": round(max((s.t_submit - s.due for s in late), default=0.0) * 1000.0, 1),
        }


def percentiles(sorted_values: list[float], scale: float = 1.0, ps: tuple[float, ...] = (50, 95, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles of an already sorted list, plus max and mean."""
    out: dict[str, float | None] = {}
    n = len(sorted_values)
    for p in ps:
        if n == 0:
            out[f"p{int(p)}"] = None
            continue
        k = max(0, min(n - 1, int(-(-p * n // 100)) - 1))  # ceil(p*n/100) - 1
        out[f"p{int(p)}"] = round(sorted_values[k] * scale, 3)
    out["max"] = round(sorted_values[-1] * scale, 3) if n else None
    out["mean"] = round(sum(sorted_values) / n * scale, 3) if n else None
    out["n"] = n
    return out


class LoadGenerator:
    def __init__(self, api: str, *, concurrency: int = 32, spec: dict[str, Any] | None = None, timeout: float = 30.0,
                 token: str | None = None, batch: int = 1) -> None:  # fmt: skip
        # batch > 1: POST /v1/tasks/batch with this many tasks per request (one transaction each)
        self.batch = max(1, batch)
        if not api.startswith(("http://127.0.0.1", "http://localhost")):
            raise ValueError("the load generator only talks to a server on this machine (127.0.0.1)")
        self.api = api
        self.concurrency = concurrency
        self.spec = spec or default_spec()
        self.body = json.dumps(self.spec).encode()
        self.batch_body = json.dumps({"tasks": [self.spec] * max(1, batch)}).encode()
        # One httpx pool of 32 connections costs ~3 ms of client CPU per request here (its pool
        # scans and locks grow with its size); pools of PER_POOL connections, one per group of
        # workers, cost ~1.2 ms. On a 2-core machine that CPU is taken from the server measured.
        n_pools = max(1, (concurrency + PER_POOL - 1) // PER_POOL)
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self.clients = [
            httpx.AsyncClient(
                base_url=api,
                timeout=timeout,
                limits=httpx.Limits(max_connections=PER_POOL, max_keepalive_connections=PER_POOL),
                headers=headers,
            )
            for _ in range(n_pools)
        ]

    async def close(self) -> None:
        for c in self.clients:
            await c.aclose()

    async def run(self, *, count: int, rate: float | None = None, seconds: float | None = None) -> LoadResult:
        """Submit up to `count` tasks, at `rate` per second (None: as fast as possible), stopping early
        after `seconds` of submitting. Bounded: every worker stops at the count or the time limit."""
        res = LoadResult(started=time.monotonic(), ended=0.0)
        start = res.started
        deadline = start + seconds if seconds else None
        next_i = 0

        async def post(client: httpx.AsyncClient, path: str, body: bytes) -> httpx.Response:
            """POST, and when the server sheds it (429) wait its Retry-After and send it again, as a
            well-behaved client does; the task's submit time stays the first attempt's."""
            while True:
                r = await client.post(path, content=body)
                if r.status_code != 429 or (deadline is not None and time.monotonic() >= deadline):
                    return r
                res.shed += 1
                await asyncio.sleep(min(10.0, float(r.headers.get("Retry-After", "1"))))

        async def worker(client: httpx.AsyncClient) -> None:
            nonlocal next_i
            while True:
                i = next_i
                if i >= count:
                    return
                n = min(self.batch, count - i)
                next_i += n
                due = None
                if rate:
                    due = start + i / rate
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                if deadline is not None and time.monotonic() >= deadline:
                    return
                t0 = time.monotonic()
                try:
                    if self.batch > 1:
                        body = self.batch_body if n == self.batch else json.dumps({"tasks": [self.spec] * n}).encode()
                        r = await post(client, "/v1/tasks/batch", body)
                        t1 = time.monotonic()
                        if r.status_code == 200:
                            for item in r.json():
                                res.submissions.append(Submission(item["task"]["id"], t0, t1, r.status_code, due))
                            continue
                        tid = None
                    else:
                        r = await post(client, "/v1/tasks", self.body)
                        t1 = time.monotonic()
                        tid = r.json()["task"]["id"] if r.status_code in (200, 201) else None
                    if tid is None:
                        key = f"HTTP {r.status_code}"
                        res.errors[key] = res.errors.get(key, 0) + 1
                    res.submissions.append(Submission(tid, t0, t1, r.status_code, due))
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    t1 = time.monotonic()
                    key = type(e).__name__
                    res.errors[key] = res.errors.get(key, 0) + 1
                    res.submissions.append(Submission(None, t0, t1, 0, due))

        workers = max(1, self.concurrency)
        await asyncio.gather(*(worker(self.clients[w // PER_POOL]) for w in range(workers)))
        res.ended = time.monotonic()
        return res


async def _main(args: argparse.Namespace) -> None:
    gen = LoadGenerator(args.api, concurrency=args.concurrency, token=os.environ.get("PODIUM_TOKEN") or None)
    try:
        res = await gen.run(count=args.tasks, rate=None if args.max else args.rate, seconds=args.seconds)
    finally:
        await gen.close()
    print(json.dumps(res.summary(), indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--api", default="http://127.0.0.1:8642")
    p.add_argument("--tasks", type=int, default=1000)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rate", type=float, default=100.0, help="tasks per second offered")
    g.add_argument("--max", action="store_true", help="as fast as the server answers")
    p.add_argument("--seconds", type=float, default=None, help="stop submitting after this long")
    p.add_argument("--concurrency", type=int, default=32, help="submissions in flight at once")
    asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    main()
