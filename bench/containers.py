"""Issue-13 figures: the container backend beside the process backend on one node, image present.

    .venv/bin/python bench/containers.py [--tasks 200] [--slots 4]

One embedded-PostgreSQL server, one agent offering both backends against the suite's podman service
(tests/engine.py) and an image pushed to a local registry (tests/registry.py), pulled once before
the run and submitted pinned by digest (so no registry is asked during the run). For each backend,
`--tasks` `true` tasks are submitted at once; submit → running comes from the database clock
(task_events.at), throughput is tasks ended per second from the first submit to the last end.
Needs root and podman, as the test suite does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.engine import running_engine  # noqa: E402
from tests.harness import Agent, Api, Server, cli  # noqa: E402
from tests.registry import RegistryServer, busybox_image  # noqa: E402

ENDED = ("succeeded", "failed", "cancelled", "lost")


def run_batch(api: Api, n: int, spec: dict[str, Any]) -> dict[str, float]:
    t0 = time.monotonic()
    ids = [api.submit(**spec)["id"] for _ in range(n)]
    pending = set(ids)
    while pending:
        rows = api.http.get("/v1/tasks", params={"limit": 1000}).json()
        for r in rows:
            if r["id"] in pending and r["state"] in ENDED:
                pending.discard(r["id"])
        time.sleep(0.05)
    wall = time.monotonic() - t0
    to_running = []
    failed = 0
    for tid in ids:
        t = api.task(tid)
        failed += t["state"] != "succeeded"
        at = {e["to_state"]: datetime.fromisoformat(e["at"]).timestamp() for e in t["events"]}
        if "running" in at and "queued" in at:
            to_running.append(at["running"] - at["queued"])
    return {
        "tasks": n,
        "failed": failed,
        "submit_to_running_p50_ms": 1000 * statistics.median(to_running),
        "submit_to_running_p90_ms": 1000 * statistics.quantiles(to_running, n=10)[-1],
        "throughput_per_s": n / wall,
        "wall_s": wall,
        "load_avg_1m": os.getloadavg()[0],
    }


def engine_breakdown(client: Any, image: str, runs: int = 20) -> dict[str, float]:
    """Where a container's time goes, straight through the engine's API (no Podium): the median of
    each step over `runs` sequential `true` containers."""
    steps: dict[str, list[float]] = {"create_ms": [], "start_ms": [], "wait_ms": [], "remove_ms": []}
    api = client.api
    for _ in range(runs):
        t0 = time.monotonic()
        cid = api.create_container(image, command=["true"])["Id"]
        t1 = time.monotonic()
        api.start(cid)
        t2 = time.monotonic()
        api.wait(cid)
        t3 = time.monotonic()
        api.remove_container(cid, force=True)
        t4 = time.monotonic()
        for k, v in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            steps[k].append(1000 * v)
    return {k: statistics.median(v) for k, v in steps.items()} | {"load_avg_1m": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, running_engine() as engine:
        tmp = Path(d)
        registry = RegistryServer(tmp / "registry").start()
        srv = Server(tmp, None, data_dir=tmp / "data").start()
        agent = Agent(tmp, [srv.grpc], "bench", slots=args.slots, extra_args=[
            "--backend", "process", "--backend", "container", "--container-host", engine.url]).start()  # fmt: skip
        api = Api(srv.api)
        try:
            user, password = registry.credentials
            assert cli(srv.api, "registry", "login", registry.host, "-u", user, input=password).returncode == 0
            repo = registry.unique_repo("bench/true")
            digest = registry.push(repo, "1", busybox_image("bench"))
            image = f"{registry.host}/{repo}@{digest}"
            engine.client.api.pull(f"{registry.host}/{repo}", tag=digest, auth_config={"username": user, "password": password})  # type: ignore[attr-defined]
            api.wait_node("bench", 60, connected=True)
            wait = time.monotonic() + 60
            while "container" not in next(n for n in api.nodes() if n["name"] == "bench")["backends"]:
                assert time.monotonic() < wait, "the agent never offered containers"
                time.sleep(0.2)
            # a few of each first, so neither side pays for a cold start in the figures
            run_batch(api, 5, {"command": ["true"]})
            run_batch(api, 5, {"backend": "container", "image": image, "command": ["true"]})
            results = {
                "process": run_batch(api, args.tasks, {"command": ["true"]}),
                "container": run_batch(api, args.tasks, {"backend": "container", "image": image, "command": ["true"]}),
                "engine_breakdown": engine_breakdown(engine.client, image),
                "engine": engine.mode,
                "slots": args.slots,
            }
        finally:
            agent.stop()
            srv.stop()
            registry.stop()
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
