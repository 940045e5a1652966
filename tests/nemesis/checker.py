"""The judge of a campaign, run once every fault is healed and the fleet has settled. It believes the
nodes (what each task's own process wrote down) and the clients (what they were told), and holds
the servers' story (PostgreSQL's rows) to both. It must never heal, retry or change anything.

Anomaly kinds (each a broken promise):
  acknowledged-missing     a submission a client was told about does not exist
  idempotency-broken       one key, two tasks (or a task other than the one acknowledged)
  ran-unknown              a process ran for a task the database does not have
  concurrent-attempts      two attempts of one task were alive at the same moment
  stale-token-ran          an attempt with an older fencing token started after a newer one
  token-order              the database's attempts/events of a task carry tokens out of order
  not-settled              a task still on a node (or assigned) after the fleet settled
  queued-untrue            a task still queued while the reason it gives is not true
  succeeded-untrue         `succeeded` but its attempt did not exit 0 (or never ran)
  exit-code-untrue         `failed` for a non-zero exit, but the exit code is not what the node saw
  cancelled-without-cancel `cancelled` but no client asked
  lost-while-running       `lost` while one of its attempts was still alive
  still-running            a task in a final state whose process is still alive
  capacity-leak            reserved capacity not back to zero, or an ended attempt still holding it
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from podium import reasons
from tests.nemesis.workload import Record

TERMINAL = {"succeeded", "failed", "cancelled", "lost"}
EPS = 0.001  # the files' timestamps have microseconds; a tick and a start a microsecond apart are not an overlap


@dataclass
class Verdict:
    anomalies: list[tuple[str, str]] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)
    states: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    attempts_run: int = 0

    def bad(self, kind: str, detail: str) -> None:
        self.anomalies.append((kind, detail))

    def by_kind(self) -> Counter[str]:
        return Counter(k for k, _ in self.anomalies)


def _pid_runs(pid: int, tid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                return False
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"NEMESIS_TRUTH" in cmd and f"PODIUM_TASK_ID={tid}".encode() in f.read()
    except OSError:
        return False


async def check(conn: asyncpg.Connection, rec: Record, truth: dict[str, list[dict[str, Any]]]) -> Verdict:
    v = Verdict()
    tasks = {str(r["id"]): dict(r) for r in await conn.fetch(
        "SELECT id, state, reason, fencing_token, exit_code, idempotency_key, finished_at, cancel_requested_at, "
        "node_id, attempts FROM tasks")}  # fmt: skip
    attempts: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in await conn.fetch("SELECT task_id, attempt, fencing_token, state, released, exit_code FROM attempts ORDER BY task_id, attempt"):
        attempts[str(r["task_id"])].append(dict(r))
    events: dict[str, list[int]] = defaultdict(list)
    for r in await conn.fetch("SELECT task_id, fencing_token FROM task_events WHERE fencing_token IS NOT NULL ORDER BY task_id, id"):
        events[str(r["task_id"])].append(r["fencing_token"])
    nodes = [dict(r) for r in await conn.fetch("SELECT id, name, health, connected, draining, res_slots, res_cpu_millis, "
                                               "res_memory_bytes, alloc_slots FROM nodes")]  # fmt: skip
    for t in tasks.values():
        v.states[t["state"]] += 1
        if t["state"] in ("failed", "lost", "queued"):
            v.reasons[f"{t['state']}: {t['reason']}"] += 1

    # 1. what clients were told exists, once
    by_key: dict[str, set[str]] = defaultdict(set)
    for a in rec.acks:
        if a.task_id not in tasks:
            v.bad("acknowledged-missing", f"task {a.task_id} (key {a.key}) was acknowledged at {a.acked_at:.3f} and does not exist")
        if a.key:
            by_key[a.key].add(a.task_id)
    db_by_key: dict[str, list[str]] = defaultdict(list)
    for tid, t in tasks.items():
        if t["idempotency_key"]:
            db_by_key[t["idempotency_key"]].append(tid)
    for key, ids in by_key.items():
        if len(ids) > 1 or db_by_key.get(key, []) != list(ids):
            v.bad("idempotency-broken", f"key {key}: acknowledged {sorted(ids)}, stored {db_by_key.get(key)}")
    acked = {a.task_id for a in rec.acks}
    unacked = [tid for tid in tasks if tid not in acked]
    if unacked:
        v.notes.append(("unacknowledged-tasks", f"{len(unacked)} tasks exist that no client was told of (retries without a key)"))

    # 2. the nodes' word against the store's
    for tid, runs in truth.items():
        v.attempts_run += len(runs)
        t = tasks.get(tid)
        if t is None:
            v.bad("ran-unknown", f"{len(runs)} attempt(s) ran for task {tid}, which the database does not have")
            continue
        for i, a in enumerate(runs):
            for b in runs[i + 1:]:
                if b["start"] < a["last"] - EPS:
                    v.bad("concurrent-attempts", f"task {tid}: token {b['token']} on {b['node']} started at {b['start']:.3f} "
                          f"while token {a['token']} on {a['node']} was alive until {a['last']:.3f}")  # fmt: skip
                if b["token"] < a["token"]:
                    v.bad("stale-token-ran", f"task {tid}: token {b['token']} started at {b['start']:.3f}, after token {a['token']}")
        db_tokens = {x["fencing_token"] for x in attempts.get(tid, [])}
        for a in runs:
            if a["token"] not in db_tokens:
                v.bad("ran-unknown", f"task {tid}: token {a['token']} ran on {a['node']}; no such attempt is stored")
        alive = [a for a in runs if _pid_runs(a["pid"], tid)]
        if t["state"] in TERMINAL and alive:
            v.bad("still-running", f"task {tid} is {t['state']} but token {alive[0]['token']} (pid {alive[0]['pid']}) is alive")
        if t["state"] == "lost" and t["finished_at"] is not None:
            fin = t["finished_at"].timestamp()
            late = [a for a in runs if a["last"] > fin + EPS]
            if late:
                v.bad("lost-while-running", f"task {tid} was written lost at {fin:.3f}; token {late[0]['token']} on "
                      f"{late[0]['node']} was alive at {late[0]['last']:.3f}")  # fmt: skip
        if t["state"] == "cancelled" and t["finished_at"] is not None:
            fin = t["finished_at"].timestamp()
            late = [a for a in runs if a["last"] > fin + EPS]
            if late:
                # the server may write `cancelled` after CancelGrace without the node (by design);
                # noted, and the process must still be gone by now (still-running above)
                v.notes.append(("cancelled-before-stopped",
                                f"task {tid}: written cancelled {late[0]['last'] - fin:.2f}s before its process stopped"))

    # 3. every task's state and reason against the truth
    free_nodes = [n for n in nodes if n["health"] == "online" and n["connected"] and not n["draining"]
                  and n["res_slots"] < n["alloc_slots"]]  # fmt: skip
    for tid, t in tasks.items():
        s, runs = t["state"], truth.get(tid, [])
        final = [a for a in runs if a["token"] == t["fencing_token"]]
        tokens = [x["fencing_token"] for x in attempts.get(tid, [])]
        if tokens != sorted(tokens) or len(set(tokens)) != len(tokens):
            v.bad("token-order", f"task {tid}: attempts by number carry tokens {tokens}")
        ev = events.get(tid, [])
        if ev != sorted(ev):
            v.bad("token-order", f"task {tid}: events were accepted with tokens in the order {ev}")
        if s == "queued":
            if t["reason"] not in reasons.QUEUED_REASONS:
                v.bad("queued-untrue", f"task {tid} is queued with reason {t['reason']!r}, not a queued reason")
            elif free_nodes:
                v.bad("queued-untrue", f"task {tid} is queued ({t['reason']!r}) while {free_nodes[0]['name']} is online with a free slot")
        elif s not in TERMINAL:
            v.bad("not-settled", f"task {tid} is still {s} on {t['node_id']} after the fleet settled")
        elif s == "succeeded":
            if not final or final[0]["end_code"] != 0:
                v.bad("succeeded-untrue", f"task {tid} succeeded with token {t['fencing_token']}; the node saw "
                      f"{'no run' if not final else 'exit ' + str(final[0]['end_code'])}")  # fmt: skip
        elif s == "failed" and t["reason"] == reasons.EXITED_NONZERO:
            if not final or final[0]["end_code"] != t["exit_code"]:
                v.bad("exit-code-untrue", f"task {tid} failed with exit {t['exit_code']}; the node saw "
                      f"{'no run' if not final else 'exit ' + str(final[0]['end_code'])}")  # fmt: skip
        elif s == "cancelled" and tid not in rec.cancels:
            v.bad("cancelled-without-cancel", f"task {tid} is cancelled ({t['reason']!r}); no client cancelled it")

    # 4. capacity
    on_node = {tid for tid, t in tasks.items() if t["state"] not in TERMINAL and t["state"] != "queued"}
    if not on_node:
        for n in nodes:
            if n["res_slots"] or n["res_cpu_millis"] or n["res_memory_bytes"]:
                v.bad("capacity-leak", f"node {n['name']} still reserves {n['res_slots']} slots, {n['res_cpu_millis']}m CPU, "
                      f"{n['res_memory_bytes']} bytes with no task on it")  # fmt: skip
    for tid, rows in attempts.items():
        if tasks[tid]["state"] in TERMINAL:
            for x in rows:
                if not x["released"]:
                    v.bad("capacity-leak", f"task {tid} is {tasks[tid]['state']} but its attempt {x['attempt']} still holds capacity")
    return v
