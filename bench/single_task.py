"""Issue-2 figures: how long `podium dev` takes to run its first task, and submit → assign → exit
for one `true` task, sequentially, on the embedded default.

    .venv/bin/python bench/single_task.py [--runs 100] [--dev-runs 5]

Times inside the server come from the database clock (task_events.at); the client-side total is
time.monotonic() around submit → the API reporting `succeeded`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.harness import Agent, Api, Server, free_port  # noqa: E402


def machine() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "?")
    mem = int(next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))) // 2**20
    return f"{os.cpu_count()} cores ({model}), {mem} GiB, Python {platform.python_version()}, load {os.getloadavg()[0]:.2f}"


def dev_to_first_task(runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as d:
            port, gport = free_port(), free_port()
            env = dict(os.environ, PODIUM_TOKEN="")
            p = subprocess.Popen([sys.executable, "-m", "podium", "dev", "--demo", "--data-dir", f"{d}/data",
                                  "--port", str(port), "--grpc-port", str(gport)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
            assert p.stdout is not None
            deadline = time.monotonic() + 60
            for line in p.stdout:
                m = re.search(r"first output ([0-9.]+)s after", line)
                if m:
                    out.append(float(m.group(1)))
                    break
                if time.monotonic() > deadline:
                    break
            p.terminate()
            p.wait(60)
    return out


def sequential(runs: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        srv = Server(tmp, None, data_dir=tmp / "data").start()
        agent = Agent(tmp, [srv.grpc], "bench", slots=4).start()
        api = Api(srv.api)
        try:
            api.wait_node("bench", 30, connected=True)
            client, assign, run, total = [], [], [], []
            for _ in range(runs + 5):
                t0 = time.monotonic()
                tid = api.submit(command=["true"])["id"]
                while True:
                    t = api.task(tid)
                    if t["state"] in ("succeeded", "failed"):
                        break
                    time.sleep(0.002)
                client.append(time.monotonic() - t0)
                at = {e["to_state"]: e["at"] for e in t["events"]}
                from datetime import datetime

                ts = {k: datetime.fromisoformat(v).timestamp() for k, v in at.items()}
                assign.append(ts["assigned"] - ts["queued"])
                run.append(ts["running"] - ts["assigned"])
                total.append(ts["succeeded"] - ts["queued"])
            # the first few warm the caches and connections
            return {"client_submit_to_succeeded": client[5:], "queued_to_assigned": assign[5:],
                    "assigned_to_running": run[5:], "queued_to_succeeded": total[5:]}  # fmt: skip
        finally:
            api.close()
            agent.stop()
            srv.stop()


def summary(xs: list[float]) -> str:
    xs = sorted(xs)
    return (f"median {statistics.median(xs) * 1000:.1f} ms, p90 {xs[int(len(xs) * 0.9)] * 1000:.1f} ms, "
            f"min {xs[0] * 1000:.1f} ms, max {xs[-1] * 1000:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--dev-runs", type=int, default=5)
    args = ap.parse_args()
    print("machine:", machine())
    dev = dev_to_first_task(args.dev_runs)
    print(f"podium dev → first task output (fresh data dir, includes initdb), {len(dev)} runs: "
          f"median {statistics.median(dev):.2f} s, min {min(dev):.2f} s, max {max(dev):.2f} s")  # fmt: skip
    seq = sequential(args.runs)
    for k, v in seq.items():
        print(f"{k:28s} ({len(v)} sequential `true` tasks): {summary(v)}")
    Path(ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / "single_task.json").write_text(json.dumps({"machine": machine(), "dev": dev, **seq}, indent=1))


if __name__ == "__main__":
    main()
