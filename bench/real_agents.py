"""Real commands through real agents, with the CPU each process spent per task (issue 17).

    .venv/bin/python bench/real_agents.py [--tasks 1000] [--batch 100] [--serial 50] [--agents 4]
                                          [--slots 16] [--podium PATH] [--json]

Starts one `podium server` on a new embedded PostgreSQL and `--agents` real `podium agent`s on this
host (ordinary timers: PODIUM_TEST_FAST_TIMERS is removed), runs `podium bench`'s modes against them
(podium.benchmark: a burst of `true` in batches, then `--serial` tasks one at a time that write a
timestamp), and reads from /proc the CPU time (user + system) every process of the run spent during
the burst, by role: server, postgres, agent, fence (the agents' fence keepers), task (the commands
themselves and anything else under the run); and, apart from that total, what this process (the
bench's own client) spent, and what the commands the agents started and reaped spent (their own
CPU, which the agents' /proc records once they are waited for). Beside them, the whole machine over
the burst from /proc/stat: how much of its CPU was idle, and how many cores were busy outside every
process counted here (other load on the machine, and the kernel's own threads): a burst run beside
other work says so. `--podium PATH` runs another build's server and agents (e.g. a checkout of main)
with this checkout's client, for a before/after in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from podium.benchmark import Bench  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def role(cmd: str) -> str:
    if "postgres" in cmd:
        return "postgres"
    if "agent.fence" in cmd:
        return "fence"
    if "podium agent" in cmd:
        return "agent"
    if "podium server" in cmd:
        return "server"
    return "task"


COMMANDS = "commands"  # not a role: the agents' reaped children, kept out of the total


def cpu_ticks(mark: str) -> dict[str, int]:
    """Clock ticks of CPU (user + system) of every live process whose command line, or an ancestor's,
    names `mark` (the run's directory: the server's data dir, the agents' state dirs, the embedded
    PostgreSQL's data dir, which pg_ctl detaches from the server), by role. As in the peers' Podium
    benchmark, processes that ended (the tasks' commands) are not counted: only what the scheduler's
    own processes spent."""
    procs: dict[int, tuple[int, int, str]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        # utime and stime: fields 14 and 15 of stat, here 11 and 12 after the command's ")"; cutime and
        # cstime (16, 17): the children it has waited for
        procs[int(pid)] = (int(fields[1]), int(fields[11]) + int(fields[12]), cmd, int(fields[13]) + int(fields[14]))
    out: dict[str, int] = {}
    for pid, (_ppid, ticks, cmd, reaped) in procs.items():
        p, ours = pid, False
        while p in procs and p > 1 and not ours:
            ours = mark in procs[p][2]
            p = procs[p][0]
        if ours:
            r = role(cmd)
            out[r] = out.get(r, 0) + ticks
            if r == "agent":  # the tasks' commands, which an agent reaps
                out[COMMANDS] = out.get(COMMANDS, 0) + reaped
    return out


def machine_ticks() -> tuple[int, int]:
    """The whole machine's clock ticks since boot, all CPUs: (busy, idle), from /proc/stat's first line
    (idle and iowait are idle; everything else is busy, the time the host gave other guests (steal)
    too: a virtual machine's neighbours are other load)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, idle


class Run:
    """A server on a new embedded PostgreSQL and its agents, every one naming the run's directory."""

    def __init__(self, podium: list[str], agents: int, slots: int) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="podium-real-agents-"))
        self.port, self.gport = free_port(), free_port()
        env = dict(os.environ, XDG_CONFIG_HOME=str(self.tmp / "cfg"), XDG_DATA_HOME=str(self.tmp / "xdg"))
        for k in ("PODIUM_TEST_FAST_TIMERS", "PODIUM_DATABASE_URL", "PODIUM_TOKEN", "PODIUM_ADDR"):
            env.pop(k, None)
        self.env = env
        self.podium, self.agents, self.slots = podium, agents, slots
        self.procs: list[subprocess.Popen[bytes]] = []

    def _spawn(self, args: list[str], log: str, env: dict[str, str]) -> None:
        with open(self.tmp / log, "wb") as f:
            p = subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)

    def start(self) -> Bench:
        data = self.tmp / "data"
        self._spawn([*self.podium, "server", "--port", str(self.port), "--grpc-port", str(self.gport),
                     "--data-dir", str(data)], "server.log", self.env)  # fmt: skip
        deadline = time.monotonic() + 120
        while not ((data / "admin-token").exists() and (data / "join-token").exists()):
            if time.monotonic() > deadline or self.procs[0].poll() is not None:
                raise SystemExit(f"the server did not start:\n{(self.tmp / 'server.log').read_text()[-2000:]}")
            time.sleep(0.1)
        token, join = (data / "admin-token").read_text().strip(), (data / "join-token").read_text().strip()
        for i in range(self.agents):
            self._spawn([*self.podium, "agent", "--server", f"127.0.0.1:{self.gport}", "--name", f"n{i}",
                         "--slots", str(self.slots), "--state-dir", str(self.tmp / f"agent{i}")],
                        f"agent{i}.log", dict(self.env, PODIUM_JOIN_TOKEN=join))  # fmt: skip
        b = Bench(f"http://127.0.0.1:{self.port}", token)
        while sum(n.health == "online" and n.connected for n in _nodes(b)) < self.agents:
            if time.monotonic() > deadline:
                raise SystemExit("the agents did not all connect")
            time.sleep(0.1)
        return b

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _nodes(b: Bench) -> list:  # type: ignore[type-arg]
    try:
        return b.client.nodes()
    except Exception:  # noqa: BLE001 - the server is still starting
        return []


#: The dispatcher's own counters, read from the server's /metrics around each mode: passes (and the
#: wake-ups of freed room alone it answered with none, the queue being drained), rows it
#: claimed (locked and placed or given a reason), reasons it wrote, placements (and of those, the ones
#: a group commit of ends made on the room it freed). A build that has no such counter prints none.
DISPATCH_COUNTERS = {
    "passes": "podium_dispatch_seconds_count",
    "passes_skipped": "podium_dispatch_skipped_total",
    "claimed": "podium_dispatch_claimed_total",
    "reasons_written": "podium_dispatch_reasons_written_total",
    "placements": "podium_placements_total",
    "placed_with_ends": "podium_placements_with_ends_total",
    "dispatch_seconds": "podium_dispatch_seconds_sum",
    "report_commits": "podium_node_report_batch_seconds_count",
    "report_commit_seconds": "podium_node_report_batch_seconds_sum",
    "reports": "podium_node_report_batch_size_sum",
}


def dispatch_counters(url: str, token: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return {k: float(values[m]) for k, m in DISPATCH_COUNTERS.items() if m in values}


STAGES_SQL = """
WITH a AS (
    SELECT t.created_at AS submitted, a.node_id, a.assigned_at, a.delivered_at, a.provisioning_at, a.started_at,
           a.finished_at,
           (SELECT min(b.assigned_at) FROM attempts b
            WHERE b.node_id = a.node_id AND b.assigned_at >= a.finished_at) AS next_assigned
    FROM attempts a JOIN tasks t ON t.id = a.task_id
    WHERE t.created_at >= $1
)
SELECT stage, percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) AS p50,
       percentile_cont(0.9) WITHIN GROUP (ORDER BY ms) AS p90
FROM a, LATERAL (VALUES
    (1, 'submitted → assigned', extract(epoch FROM assigned_at - submitted) * 1000),
    (2, 'assigned → delivered (outbox take)', extract(epoch FROM delivered_at - assigned_at) * 1000),
    (3, 'delivered → provisioning recorded', extract(epoch FROM provisioning_at - delivered_at) * 1000),
    (4, 'provisioning → running recorded', extract(epoch FROM started_at - provisioning_at) * 1000),
    (5, 'running → end recorded', extract(epoch FROM finished_at - started_at) * 1000),
    (6, 'end recorded → the node''s next assignment', extract(epoch FROM next_assigned - finished_at) * 1000)
) v(n, stage, ms)
WHERE ms IS NOT NULL
GROUP BY n, stage ORDER BY n
"""


def stages(data: Path, since: float) -> dict[str, dict[str, float]]:
    """Where an attempt's time went, from the run's own database: each stage's p50/p90 in ms, by the
    statement times PostgreSQL recorded (a transaction's start, `now()`) for the tasks submitted
    after `since` (a Unix time). The last stage is how long a node waited, after an end was recorded,
    for its next assignment (a backlog keeps it short)."""
    import asyncio
    from datetime import UTC, datetime

    import asyncpg

    async def read() -> dict[str, dict[str, float]]:
        conn = await asyncpg.connect(host=str(data / "pg"), user="postgres", database="podium")
        try:
            rows = await conn.fetch(STAGES_SQL, datetime.fromtimestamp(since, UTC))
        finally:
            await conn.close()
        return {r["stage"]: {"p50": round(r["p50"], 1), "p90": round(r["p90"], 1)} for r in rows}

    return asyncio.run(read())


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--serial", type=int, default=50)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--podium", default=None, help="the podium executable to run (default: this checkout's)")
    ap.add_argument("--label", default="", help="a name for this build in the output")
    ap.add_argument("--json", action="store_true", help="one JSON line per mode")
    ap.add_argument("--stages", action="store_true", help="also where each mode's attempts spent their "
                    "time, stage by stage, read from the run's database")
    a = ap.parse_args()
    podium = [a.podium] if a.podium else [sys.executable, "-m", "podium"]
    run = Run(podium, a.agents, a.slots)
    out: list[dict] = []  # type: ignore[type-arg]
    try:
        b = run.start()
        b.warm_up(10 * a.agents)
        if a.tasks:
            counted = dispatch_counters(b.addr, b.token)
            load0, before, since, mine = load(), cpu_ticks(str(run.tmp)), time.time(), os.times()
            machine, wall = machine_ticks(), time.monotonic()
            r = b.burst(a.tasks, a.batch)
            after, mine_after = cpu_ticks(str(run.tmp)), os.times()
            machine_after, wall = machine_ticks(), time.monotonic() - wall
            r["dispatch"] = {k: round(v - counted[k], 3) for k, v in dispatch_counters(b.addr, b.token).items()}
            hz = os.sysconf("SC_CLK_TCK")
            per_task = {k: round((after.get(k, 0) - before.get(k, 0)) * 1000 / hz / a.tasks, 2) for k in sorted(after)}
            r["commands_cpu_ms_per_task"] = per_task.pop(COMMANDS, 0.0)
            r["cpu_ms_per_task"] = per_task
            r["cpu_ms_per_task"]["total"] = round(sum(r["cpu_ms_per_task"].values()), 2)
            # this process: the bench's own client (its submissions, its reading of the event stream),
            # left out of the total as the breakdown leaves it out, but sharing the same cores
            client = mine_after.user + mine_after.system - mine.user - mine.system
            r["client_cpu_ms_per_task"] = round(client * 1000 / a.tasks, 2)
            r["load"] = [load0, load()]
            # The machine as a whole: what the run's processes, its commands and this client spent, and
            # the rest of the busy time (other processes, the kernel's threads), in cores over the burst
            busy, idle = (machine_after[i] - machine[i] for i in (0, 1))
            ours = (sum(after.values()) - sum(before.values())) / hz + client
            r["machine"] = {
                "idle_pct": round(100 * idle / max(1, busy + idle), 1),
                "outside_cores": round(max(0.0, busy / hz - ours) / wall, 2),
            }
            if a.stages:
                r["stages_ms"] = stages(run.tmp / "data", since)
            out.append(r)
        if a.serial:
            counted = dispatch_counters(b.addr, b.token)
            load0, since = load(), time.time()
            r = b.serial(a.serial)
            r["dispatch"] = {k: round(v - counted[k], 3) for k, v in dispatch_counters(b.addr, b.token).items()}
            r["load"] = [load0, load()]
            if a.stages:
                r["stages_ms"] = stages(run.tmp / "data", since)
            out.append(r)
        b.close()
    finally:
        run.stop()
    for r in out:
        r["build"] = a.label or " ".join(podium)
        r["agents"], r["slots"] = a.agents, a.slots
        if a.json:
            print(json.dumps(r), flush=True)
        else:
            print(summary(r), flush=True)


def summary(r: dict) -> str:  # type: ignore[type-arg]
    def pr(key: str) -> str:
        v = r.get(key)
        return f"{v['p50']} / {v['p99']} ms" if v else "-"

    lines = [f"{r['build']} · {r['mode']} · {r['tasks']} tasks · {r['tasks_per_s']}/s · load {r['load'][0]} → {r['load'][1]}",
             f"  submit → running p50/p99 {pr('submit_to_running_ms')}; → succeeded {pr('submit_to_succeeded_ms')}"]  # fmt: skip
    if "submit_to_first_instruction_ms" in r:
        lines.append(f"  submit → first instruction p50/p99 {pr('submit_to_first_instruction_ms')}")
    if r.get("after_first_end_per_s") is not None:
        lines.append(f"  the first task ended {r['first_end_ms']} ms after the first submit; from then on {r['after_first_end_per_s']}/s, "
                     f"the longest pause between two ends {r['longest_pause_ms']} ms")
    if d := r.get("dispatch"):
        lines.append(f"  dispatcher over the {r['mode']} run: " + ", ".join(f"{k} {d[k]:g}" for k in list(DISPATCH_COUNTERS)[:6] if k in d))
        if d.get("passes"):
            lines[-1] += f", {d['dispatch_seconds'] * 1000 / d['passes']:.1f} ms a pass"
        if d.get("report_commits"):
            lines.append(f"  node report group commits: {d['report_commits']:g}, {d['reports'] / d['report_commits']:.1f} "
                         f"reports and {d['report_commit_seconds'] * 1000 / d['report_commits']:.1f} ms each")  # fmt: skip
    if "cpu_ms_per_task" in r:
        lines.append("  CPU ms per task: " + ", ".join(f"{k} {v}" for k, v in r["cpu_ms_per_task"].items()))
    if "client_cpu_ms_per_task" in r:
        lines.append(f"  and the bench's own client (not in the total): {r['client_cpu_ms_per_task']} ms per task")
    if "commands_cpu_ms_per_task" in r:
        lines.append(f"  and the commands themselves, reaped by the agents (not in the total): {r['commands_cpu_ms_per_task']} ms per task")
        # the same `true` every time: what it costs moves with the machine's speed as the rest does, so
        # two builds measured minutes apart compare by these ratios better than by milliseconds
        if (cmd := r["commands_cpu_ms_per_task"]) and "cpu_ms_per_task" in r:
            lines.append("  per task, in commands' CPU (a yardstick of this run's machine speed): "
                         + ", ".join(f"{k} {v / cmd:.3f}" for k, v in r["cpu_ms_per_task"].items()))
    if m := r.get("machine"):
        lines.append(f"  the machine over the burst: {m['idle_pct']} % idle; {m['outside_cores']} cores busy outside the run's "
                     "processes and this client (other load, the kernel's own threads)")  # fmt: skip
    for stage, v in r.get("stages_ms", {}).items():
        lines.append(f"    {stage}: p50 {v['p50']} / p90 {v['p90']} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
