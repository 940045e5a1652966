"""A model-based test of a task's whole life, against real PostgreSQL (embedded and 15), the real
store statements and the real Scheduler (policy + service, no fakes).

Hypothesis writes a program for a small fleet (2–3 nodes, some with GPUs, up to six tasks) and runs
it step by step: submissions, dispatch ticks, node reports applied the way the gateway applies them
(with the task's current fencing token, an older one, a made-up one, or from the wrong node),
operator cancels, nodes going silent or disconnecting, coming back (perhaps having forgotten their
tasks, which the gateway's reconcile handles), draining, removal from the fleet, deadlines made to
pass by moving the stored times an hour back, watchdog sweeps, and races of two of these at once (as
two servers, or a server and a node, would run them).

After every step the stored truth is read back and checked:

* a task never holds two live (unreleased) attempts; a task on a node holds exactly one, whose
  fencing token and node are the task's; a queued or ended task holds none and names no node;
* every node's reservation is exactly the sum over its live attempts, never negative, never more
  than it offers; GPU claims are exactly the indexes live attempts hold, no index held twice;
* a task's history is one unbroken chain of allowed transitions that never leaves an ended state
  and ends in the task's state; its attempts are numbered in order, counted, within max_attempts,
  and their fencing tokens strictly increase; a queued task has attempts left;
* nothing is stranded: on a node-state the task names its node, `assigned` has an accept deadline,
  `cancelling` has the time the stop was asked for; an attempt the server took back carries a stop.

Each step (outside races) also checks its own promise: a refused report changes nothing at all; a
current one the policy has a step for goes through; a cancel ends a queued task and stops one on a
node; a removed node keeps no task and is not let back in; and right after a sweep no deadline that
has passed (by the database clock) is left unacted upon.

Each example runs on an event loop of its own with a Store of its own on the test's database, which
it empties first. A failing example prints as the numbered list of steps it ran, with what each did.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from podium import protocol, reasons
from podium.errors import Contention
from podium.scheduler import policy
from podium.scheduler.apply import change, facts
from podium.scheduler.service import Scheduler
from podium.spec import TaskSpec
from podium.states import ALLOWED, ATTEMPT_LIVE, ON_NODE, TERMINAL, TaskState
from podium.store import Store
from podium.store.db import DispatchOutcome
from podium.store.rows import TaskFactsRow
from podium.timing import DEFAULT_TIMING

S = TaskState
T = DEFAULT_TIMING
MAX_TASKS = 6
STEPS = 60
NODE_IDS = ("n1", "n2", "n3")
GiB = 2**30


def _rows(records: list[Any]) -> list[dict[str, Any]]:
    return [dict(r) for r in records]


class World:
    """Everything stored, read in one go."""

    def __init__(self, now: Any, tasks: list[dict], attempts: list[dict], events: list[dict], nodes: list[dict],
                 gpu_claims: list[dict]) -> None:  # fmt: skip
        self.now = now
        self.tasks = {t["id"]: t for t in tasks}
        self.attempts: dict[uuid.UUID, list[dict]] = defaultdict(list)
        for a in attempts:
            self.attempts[a["task_id"]].append(a)
        self.events: dict[uuid.UUID, list[dict]] = defaultdict(list)
        for e in events:
            self.events[e["task_id"]].append(e)
        self.nodes = {n["id"]: n for n in nodes}
        self.gpu_claims = {(g["node_id"], g["gpu_index"], g["fencing_token"]) for g in gpu_claims}
        self.raw = (tasks, attempts, events, nodes, gpu_claims)


async def read_world(store: Store) -> World:
    async with store.pool.acquire() as c, c.transaction(isolation="repeatable_read", readonly=True):
        now = await c.fetchval("SELECT now()")
        tasks = _rows(await c.fetch("SELECT * FROM tasks ORDER BY id"))
        attempts = _rows(await c.fetch("SELECT * FROM attempts ORDER BY task_id, attempt"))
        events = _rows(await c.fetch("SELECT * FROM task_events ORDER BY task_id, id"))
        nodes = _rows(await c.fetch("SELECT * FROM nodes ORDER BY id"))
        gpu_claims = _rows(await c.fetch("SELECT * FROM gpu_claims ORDER BY node_id, gpu_index"))
    return World(now, tasks, attempts, events, nodes, gpu_claims)


def check_invariants(w: World) -> None:  # noqa: C901 - one list of promises, read top to bottom
    for tid, t in w.tasks.items():
        st_ = TaskState(t["state"])
        atts = w.attempts.get(tid, [])
        live = [a for a in atts if not a["released"]]
        where = f"task {tid} ({st_})"

        # ---- attempts: at most one live, and the task's own -----------------------------------------
        assert len(live) <= 1, f"{where} has {len(live)} live attempts: {[a['fencing_token'] for a in live]}"
        if st_ in ON_NODE:
            assert len(live) == 1, f"{where} is on a node but holds no live attempt"
            a = live[0]
            assert t["node_id"] is not None, f"{where} is on a node-state with no node_id"
            assert t["fencing_token"] is not None, f"{where} is on a node-state with no fencing token"
            assert a["fencing_token"] == t["fencing_token"], (
                f"{where}: live attempt token {a['fencing_token']} != task token {t['fencing_token']}"
            )
            assert a["node_id"] == t["node_id"], f"{where}: live attempt on {a['node_id']}, task on {t['node_id']}"
            want = {S.ASSIGNED: "assigned", S.PROVISIONING: "provisioning", S.RUNNING: "running"}.get(st_)
            if want is not None:
                assert a["state"] == want, f"{where}: its attempt is {a['state']}"
        else:
            assert not live, f"{where} still holds live attempt {live[0]['fencing_token']} on {live[0]['node_id']}"
            assert t["node_id"] is None, f"{where} still names node {t['node_id']}"
        if st_ == S.QUEUED:
            # a task is only ever requeued with attempts left: queued means it will be placed again
            assert t["attempts"] < t["max_attempts"], f"{where} is queued with {t['attempts']}/{t['max_attempts']} attempts used"
        for a in atts:
            if a["released"]:
                assert a["state"] not in ATTEMPT_LIVE and a["finished_at"] is not None, f"{where}: released attempt {a}"
            else:
                assert a["state"] in ATTEMPT_LIVE, f"{where}: unreleased attempt in state {a['state']}"
            if a["state"] in ("revoked", "lost"):
                # taken back by the server: the node, wherever it is, must be told to drop it
                assert a["stop_requested_at"] is not None, f"{where}: attempt {a['fencing_token']} {a['state']} without a stop"
        if st_ == S.SUCCEEDED:
            assert t["exit_code"] == 0 and atts and atts[-1]["state"] == "exited" and atts[-1]["exit_code"] == 0, (
                f"{where}: succeeded without a clean exit (task exit {t['exit_code']}, attempts {atts})"
            )

        # ---- nothing stranded ------------------------------------------------------------------------
        if st_ == S.ASSIGNED:
            assert t["accept_deadline"] is not None, f"{where} has no accept deadline"
        if st_ == S.CANCELLING:
            assert t["cancel_requested_at"] is not None, f"{where} has no cancel_requested_at: CancelGrace never fires"
            assert t["cancel_reason"] in (reasons.CANCELLED, reasons.TIMEOUT), f"{where}: cancel_reason {t['cancel_reason']!r}"
        if st_ in TERMINAL:
            assert t["finished_at"] is not None, f"{where} has no finished_at"

        # ---- attempts in order, counted, within budget --------------------------------------------
        assert [a["attempt"] for a in atts] == list(range(1, len(atts) + 1)), f"{where}: attempt numbers {atts}"
        tokens = [a["fencing_token"] for a in atts]
        assert all(x < y for x, y in zip(tokens, tokens[1:], strict=False)), f"{where}: fencing tokens do not increase: {tokens}"
        assert t["attempts"] == len(atts), f"{where}: attempts={t['attempts']} but {len(atts)} attempt rows"
        assert t["attempts"] <= t["max_attempts"], f"{where}: {t['attempts']} attempts > max_attempts {t['max_attempts']}"
        if atts:
            assert t["fencing_token"] == tokens[-1], f"{where}: token {t['fencing_token']} is not its last attempt's"

        # ---- history: one chain of allowed steps that never leaves an end ------------------------
        evs = w.events.get(tid, [])
        assert evs, f"{where} has no history"
        assert (evs[0]["from_state"], evs[0]["to_state"]) == (None, "queued"), f"{where}: first event {evs[0]}"
        for prev, ev in zip(evs, evs[1:], strict=False):
            assert prev["to_state"] not in TERMINAL, (
                f"{where}: history leaves the end {prev['to_state']} → {ev['to_state']} ({ev['actor']}, {ev['reason']})"
            )
            assert ev["from_state"] == prev["to_state"], (
                f"{where}: event {ev['from_state']} → {ev['to_state']} follows one that ended in {prev['to_state']}"
            )
            assert (TaskState(ev["from_state"]), TaskState(ev["to_state"])) in ALLOWED, f"{where}: disallowed event {ev}"
        assert evs[-1]["to_state"] == st_, f"{where}: history ends in {evs[-1]['to_state']}"
        assign_tokens = [e["fencing_token"] for e in evs if e["to_state"] == "assigned"]
        assert assign_tokens == tokens, f"{where}: assignments {assign_tokens} vs attempts {tokens}"
        for e in evs:
            if e["from_state"] in ON_NODE:
                # a step off a node-state is taken under the attempt's token, and the latest one
                assert e["fencing_token"] in tokens, (
                    f"{where}: event {e['from_state']} → {e['to_state']} carries token {e['fencing_token']}"
                )
        ev_tokens = [e["fencing_token"] for e in evs if e["fencing_token"] is not None]
        assert ev_tokens == sorted(ev_tokens), f"{where}: history goes back to an older token: {ev_tokens}"

    # ---- every attempt belongs to a task --------------------------------------------------------
    assert set(w.attempts) <= set(w.tasks), "attempts of unknown tasks"

    # ---- reservations: exactly the live attempts, within allocatable --------------------------------
    held: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for atts in w.attempts.values():
        for a in atts:
            if not a["released"]:
                h = held[a["node_id"]]
                for i, k in enumerate(("cpu_millis", "memory_bytes", "disk_bytes", "gpus")):
                    h[i] += a[k]
                h[4] += 1
    for nid, n in w.nodes.items():
        res = [n["res_cpu_millis"], n["res_memory_bytes"], n["res_disk_bytes"], n["res_gpus"], n["res_slots"]]
        alloc = [n["alloc_cpu_millis"], n["alloc_memory_bytes"], n["alloc_disk_bytes"], n["alloc_gpus"], n["alloc_slots"]]
        assert res == held[nid], f"node {nid}: reserved {res} but its live attempts hold {held[nid]}"
        assert all(0 <= r <= al for r, al in zip(res, alloc, strict=True)), f"node {nid}: reserved {res} > allocatable {alloc}"
    assert set(held) <= set(w.nodes), f"live attempts on unknown nodes {set(held) - set(w.nodes)}"

    # ---- GPU indexes: each held by one live attempt at most, and claimed exactly while held -------
    holding: set[tuple[str, int, int]] = set()
    for atts in w.attempts.values():
        for a in atts:
            if a["released"]:
                continue
            idx = list(a["gpu_indexes"])
            assert len(idx) == a["gpus"], f"attempt {a['fencing_token']} asks {a['gpus']} GPUs, holds indexes {idx}"
            on_node = set(w.nodes[a["node_id"]]["gpu_indexes"])
            assert set(idx) <= on_node, f"attempt {a['fencing_token']}: GPUs {idx} not on its node"
            for g in idx:
                clash = [h for h in holding if h[:2] == (a["node_id"], g)]
                assert not clash, f"GPU {g} on {a['node_id']} is held by attempts {clash[0][2]} and {a['fencing_token']}"
                holding.add((a["node_id"], g, a["fencing_token"]))
    assert w.gpu_claims == holding, f"GPU claims {sorted(w.gpu_claims)} but live attempts hold {sorted(holding)}"


def check_nothing_overdue(w: World, now: datetime) -> None:
    """Right after a sweep that started at `now` (the database clock): every deadline that had passed
    by then has been acted upon. (Not the time of reading `w`: a deadline may pass in between.)"""
    for nid, n in w.nodes.items():
        silent = now - n["last_heartbeat_at"]
        if silent > timedelta(seconds=T.offline_after):
            assert n["health"] == "offline", f"node {nid} silent {silent} is still {n['health']}"
        elif silent > timedelta(seconds=T.unreachable_after):
            assert n["health"] != "online", f"node {nid} silent {silent} is still online"
    for tid, t in w.tasks.items():
        st_ = t["state"]
        where = f"task {tid} ({st_})"
        if st_ == "assigned":
            assert t["accept_deadline"] >= now, f"{where}: accept deadline passed and the sweep left it assigned"
        if st_ in ("assigned", "provisioning", "running"):
            node = w.nodes[t["node_id"]]
            assert node["health"] != "offline", f"{where} is still on offline node {t['node_id']} after a sweep"
            assert t["lease_expires_at"] is None or t["lease_expires_at"] >= now, f"{where}: its lease expired"
        if st_ == "running" and t["timeout_seconds"] is not None:
            assert t["started_at"] + timedelta(seconds=t["timeout_seconds"]) >= now, f"{where}: timed out, still running"
        if st_ == "cancelling":
            asked = t["cancel_requested_at"]  # None is the invariants' to report
            assert asked is None or asked >= now - timedelta(seconds=T.cancel_grace), f"{where}: CancelGrace passed"


async def hello(store: Store, node_id: str, slots: int, gpus: int, cpu: int = 2000) -> Any:
    """A node's Hello, as the gateway records it. None if the node was removed from the fleet."""
    return await store.node_hello(
        node_id=node_id, name=node_id, pool="default", arch="x86_64", labels={}, capabilities=[],
        backends=["process"], artifacts=[], protocol_min=1, protocol_max=1, gpu_indexes=list(range(gpus)),
        cpu_millis=cpu, memory_bytes=4 * GiB, disk_bytes=10 * GiB, gpus=gpus, slots=slots, gateway_id="model",
        agent_version="model", max_operations=max(slots, 4),  # the model is about slots, not operations
    )  # fmt: skip


# ---- the actions ------------------------------------------------------------------------------------
# Each is a small value that prints as what it does, so a failing example reads as a script. `#k`
# picks a task (or `node#k` a node) among those the action applies to, modulo how many there are;
# each step's note names the task it picked (t0 is the first submitted) and what happened.


@dataclass(frozen=True)
class Submit:
    cpu: int
    gpus: int
    max_attempts: int
    requeue: bool
    timeout: float | None

    def __repr__(self) -> str:
        gpus = f", gpus={self.gpus}" if self.gpus else ""
        return f"Submit(cpu={self.cpu}m{gpus}, max_attempts={self.max_attempts}, requeue={self.requeue}, timeout={self.timeout})"


@dataclass(frozen=True)
class Dispatch:
    def __repr__(self) -> str:
        return "Dispatch()"


@dataclass(frozen=True)
class Sweep:
    def __repr__(self) -> str:
        return "Sweep()"


@dataclass(frozen=True)
class Report:
    task: int
    kind: str
    code: int
    signer: str  # current | stale | bogus | wrong_node
    other: int  # which older attempt / which other node

    def __repr__(self) -> str:
        code = f"({self.code})" if self.kind == protocol.EXITED else ""
        return f"Report(#{self.task}, {self.kind}{code}, signed={self.signer}/{self.other})"


@dataclass(frozen=True)
class Cancel:
    task: int

    def __repr__(self) -> str:
        return f"Cancel(#{self.task})"


@dataclass(frozen=True)
class DeadlinePasses:
    """One of the deadlines that matter in a task's state passes (its time is moved an hour back)."""

    task: int
    which: int  # which of the deadlines that matter in the task's state
    then_sweep: bool

    def __repr__(self) -> str:
        return f"DeadlinePasses(#{self.task}/{self.which}{', then Sweep' if self.then_sweep else ''})"


@dataclass(frozen=True)
class NodeTrouble:
    node: int
    how: str  # unreachable | offline | disconnect

    def __repr__(self) -> str:
        return f"NodeTrouble(node#{self.node}, {self.how})"


@dataclass(frozen=True)
class NodeBack:
    node: int
    slots: int
    forgot: bool

    def __repr__(self) -> str:
        return f"NodeBack(node#{self.node}, slots={self.slots}{', forgot its tasks' if self.forgot else ''})"


@dataclass(frozen=True)
class Drain:
    node: int
    draining: bool

    def __repr__(self) -> str:
        return f"Drain(node#{self.node}, {self.draining})"


@dataclass(frozen=True)
class Revoke:
    """An operator removes a node from the fleet, as the API does: revoke, then the node-loss policy."""

    node: int

    def __repr__(self) -> str:
        return f"Revoke(node#{self.node})"


@dataclass(frozen=True)
class Race:
    """Two things at once, as two servers (or a server and a node) would do them: each runs on its own
    pooled connection and the event loop interleaves them wherever they wait on the database. Only
    the invariants are checked after a race; either may win."""

    first: Any
    second: Any

    def __repr__(self) -> str:
        return f"Race({self.first!r} ∥ {self.second!r})"


# The stored times the watchdog reads, by the state in which moving each back makes it act. Names
# from this table are the only ones ever put into SQL.
DEADLINES = {
    "assigned": ("accept_deadline", "lease_expires_at"),
    "provisioning": ("lease_expires_at",),
    "running": ("started_at", "lease_expires_at"),  # the timeout, then the lease (both only with a timeout)
    "cancelling": ("cancel_requested_at",),
}


def _deadlines(task: dict[str, Any]) -> list[str]:
    no_timeout = task["timeout_seconds"] is None
    return [c for c in DEADLINES.get(task["state"], ()) if task[c] is not None and not (c == "started_at" and no_timeout)]


# what a node reports, weighted towards the ones that move a task forward
KINDS = (protocol.PROVISIONING,) * 2 + (protocol.RUNNING,) * 3 + (protocol.EXITED,) * 2 + (protocol.FAILED_RETRYABLE, protocol.NOT_RUNNING)
# how a report is signed: the task's current token from its own node (most of the time), an older
# token of the task, a token that never existed, or the current token from a node that does not hold it
SIGNERS = ("current",) * 6 + ("stale", "bogus", "wrong_node")

_task = st.integers(0, MAX_TASKS - 1)
_node = st.integers(0, len(NODE_IDS) - 1)
_submit = st.builds(Submit, st.sampled_from([250, 500, 1000, 1000, 1500, 2500]), st.sampled_from([0, 0, 1]),
                    st.integers(1, 3), st.booleans(),
                    st.sampled_from([None, 600.0, 600.0]))  # fmt: skip
_report = st.builds(Report, _task, st.sampled_from(KINDS), st.sampled_from([0, 1, 137]), st.sampled_from(SIGNERS),
                    st.integers(0, 2))  # fmt: skip
_deadline = st.builds(DeadlinePasses, _task, st.integers(0, 1), st.booleans())
# How often each happening is drawn (by repetition: sampled_from is near-uniform over positions and
# shrinks towards the first, a dispatch tick, the most harmless thing to happen). Reports are what
# moves tasks along; node trouble is rarer than recovery.
WEIGHTED = (
    ["dispatch"] * 3 + ["submit"] * 3 + ["report"] * 9 + ["cancel"] * 2 + ["sweep"] * 2 + ["deadline"] * 2
    + ["trouble"] + ["back"] + ["drain"] + ["revoke"]
)  # fmt: skip
PARAMS: dict[str, st.SearchStrategy[Any]] = {
    "dispatch": st.just(Dispatch()),
    "submit": _submit,
    "report": _report,
    "cancel": st.builds(Cancel, _task),
    "sweep": st.just(Sweep()),
    "deadline": _deadline,
    "trouble": st.builds(NodeTrouble, _node, st.sampled_from(["unreachable", "offline", "disconnect"])),
    "back": st.builds(NodeBack, _node, st.integers(1, 3), st.booleans()),
    "drain": st.builds(Drain, _node, st.booleans()),
    "revoke": st.builds(Revoke, _node),
}
_racer = st.one_of(
    st.just(Dispatch()), st.just(Sweep()),
    st.builds(Report, _task, st.sampled_from(KINDS), st.sampled_from([0, 1]), st.just("current"), st.just(0)),
    st.builds(Cancel, _task), st.builds(NodeBack, _node, st.integers(1, 3), st.just(True)), st.builds(Revoke, _node),
)  # fmt: skip
PARAMS["race"] = st.builds(Race, _racer, _racer)
WEIGHTED += ["race"] * 2
ACTION = st.sampled_from(WEIGHTED).flatmap(PARAMS.__getitem__)
# long enough to reach deep states: hypothesis's lists otherwise average a handful of elements
PROGRAM = st.lists(ACTION, min_size=STEPS // 3, max_size=STEPS)
FLEET = st.lists(st.tuples(st.integers(1, 3), st.integers(0, 2)), min_size=2, max_size=3)  # (slots, GPUs) per node


class Model:
    """One example: a fresh Store on the test's database, emptied, its own event loop."""

    def __init__(self, db_url: str, loop: asyncio.AbstractEventLoop) -> None:
        self.db_url = db_url
        self.loop = loop
        self.store: Store = self.run(Store.connect(db_url, min_size=1, max_size=4))
        self.sched = Scheduler(self.store, T, server_id="model")
        self.other = Scheduler(self.store, T, server_id="other")  # a second server, for races
        self.tasks: list[uuid.UUID] = []
        self.nodes: list[str] = []
        self.gpus: dict[str, int] = {}
        self.revoked: set[str] = set()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self.store.close())

    def world(self) -> World:
        return self.run(read_world(self.store))

    def sql(self, query: str, *args: Any) -> None:
        async def go() -> None:
            async with self.store.pool.acquire() as c:
                await c.execute(query, *args)

        self.run(go())

    def task(self, i: int) -> uuid.UUID | None:
        return self.tasks[i % len(self.tasks)] if self.tasks else None

    def label(self, tid: uuid.UUID) -> str:
        return f"t{self.tasks.index(tid)}"

    def node(self, i: int) -> str:
        return self.nodes[i % len(self.nodes)]

    # ---- setup -------------------------------------------------------------------------------------

    def start(self, fleet: list[tuple[int, int]]) -> None:
        self.sql("TRUNCATE tasks, attempts, task_events, log_chunks, nodes CASCADE")
        for nid, (slots, gpus) in zip(NODE_IDS, fleet, strict=False):
            assert self.run(hello(self.store, nid, slots, gpus)) is not None
            self.nodes.append(nid)
            self.gpus[nid] = gpus

    # ---- one action, with its own promise checked ---------------------------------------------

    def do(self, a: Any) -> str:
        match a:
            case Submit():
                return self.submit(a)
            case Dispatch():
                return self.dispatch()
            case Sweep():
                return self.sweep()
            case Report():
                return self.report(a)
            case Cancel():
                return self.cancel(a)
            case DeadlinePasses():
                return self.deadline_passes(a)
            case NodeTrouble():
                return self.node_trouble(a)
            case NodeBack():
                return self.node_back(a)
            case Drain():
                return self.drain(a)
            case Revoke():
                return self.revoke(a)
            case Race():
                return self.race(a)
        raise AssertionError(f"unknown action {a!r}")

    def submit(self, a: Submit) -> str:
        if len(self.tasks) >= MAX_TASKS:
            return "skipped: enough tasks"
        spec = TaskSpec(command=["true"], resources={"cpu": f"{a.cpu}m", "memory": "64Mi", "gpus": a.gpus},
                        max_attempts=a.max_attempts, requeue_on_node_loss=a.requeue, timeout=a.timeout)  # fmt: skip
        row, created = self.run(self.store.submit(spec))
        assert created and row.state == "queued"
        self.tasks.append(row.id)
        return f"{self.label(row.id)} = {row.id}"

    def dispatch(self) -> str:
        before = self.world()
        out = self.run(self.sched.dispatch_once())
        queued = {tid for tid, t in before.tasks.items() if t["state"] == "queued"}
        placed = [x[0] for x in out.assigned]
        assert len(placed) == len(set(placed)) and set(placed) <= queued, f"placed {placed}, queued were {queued}"
        assert out.lost_races == 0, "a dispatcher alone lost a race for capacity"
        return "assigned " + ", ".join(f"{self.label(t)} → {n} (token {tok})" for t, n, tok in out.assigned)

    def sweep(self) -> str:
        started = self.world().now
        self.run(self.sched.sweep())
        check_nothing_overdue(self.world(), started)
        return "swept"

    def report(self, a: Report) -> str:
        """A node's report applied exactly as the gateway applies it: read the task, ask the policy,
        compare-and-set with the token (and node) the report carries."""
        before = self.world()
        # only a task that was placed at least once has a token some node could sign with; the ones on
        # a node now are where reports matter, so they are picked when there are any
        placed = [t for t in self.tasks if before.attempts.get(t)]
        on_node = [t for t in placed if before.tasks[t]["state"] in ON_NODE]
        if not placed:
            return "skipped: no task was ever placed"
        tid = (on_node or placed)[a.task % len(on_node or placed)]
        row = before.tasks[tid]
        atts = before.attempts[tid]
        token, node = row["fencing_token"], row["node_id"] or atts[-1]["node_id"]
        if a.signer == "stale":
            older = [x for x in atts if x["fencing_token"] != row["fencing_token"]]
            if older:
                x = older[a.other % len(older)]
                token, node = x["fencing_token"], x["node_id"]
            else:
                token -= 1
        elif a.signer == "bogus":
            token += 10_000
        elif a.signer == "wrong_node":
            others = [n for n in self.nodes if n != node]
            node = others[a.other % len(others)]
        if a.kind == protocol.PROVISIONING:
            # the gateway's acceptance first: decided on the row it expects, made without reading it
            assigned = policy.TaskFacts(state=S.ASSIGNED)
            accept = policy.on_node_event(assigned, a.kind, None, T)
            assert accept is not None
            [made] = self.run(self.store.transition_expected(
                [change(tid, S.ASSIGNED, accept, actor=f"node:{node}", fencing_token=token, node_id=node)]
            ))  # fmt: skip
            as_expected = a.signer == "current" and row["node_id"] is not None and row["state"] == S.ASSIGNED
            assert (made is not None) == as_expected, f"{a!r} (token {token} from {node}) on a {row['state']} task: {made}"
            if made is not None:
                assert self.world().tasks[tid]["state"] == accept.to
                return f"{self.label(tid)}: assigned → {accept.to} as expected (token {token} from {node})"
            assert self.world().raw == before.raw, f"a refused acceptance {a!r} changed the database"
            # refused: decided on the row as read, as every other report is
        f = facts(TaskFactsRow.of(row))  # the world's row is a plain dict
        step = policy.on_node_event(f, a.kind, a.code if a.kind == protocol.EXITED else None, T)
        done = self.run(self.sched.applier.apply(tid, f.state, step, actor=f"node:{node}", fencing_token=token, node_id=node))
        after = self.world()
        if a.signer != "current" or row["node_id"] is None:
            assert done is None, f"{a!r} (token {token} from {node}) was accepted on a {f.state} task"
            assert after.raw == before.raw, f"a refused {a!r} changed the database"
        else:
            assert (done is not None) == (step is not None), f"{a!r} on a {f.state} task: step {step}, result {done}"
            if step is not None:
                assert after.tasks[tid]["state"] == step.to
        what = "" if done else ", refused/no-op"
        return f"{self.label(tid)}: {f.state} → {after.tasks[tid]['state']} (token {token} from {node}{what})"

    def cancel(self, a: Cancel) -> str:
        if not self.tasks:
            return "skipped: no task"
        w = self.world()
        # mostly a task that has not ended (cancelling an ended one is checked, but once is plenty)
        alive = [t for t in self.tasks if w.tasks[t]["state"] not in TERMINAL]
        pool = alive if alive and a.task % 4 else self.tasks
        tid = pool[a.task % len(pool)]
        before = TaskState(w.tasks[tid]["state"])
        after = TaskState(self.run(self.sched.cancel(tid, "operator")).state)
        if before == S.QUEUED:
            assert after == S.CANCELLED, f"cancelling a queued task left it {after}"
        elif before in (S.ASSIGNED, S.PROVISIONING, S.RUNNING):
            assert after == S.CANCELLING, f"cancelling a {before} task left it {after}"
        else:
            assert after == before, f"cancelling a {before} task moved it to {after}"
        return f"{self.label(tid)}: {before} → {after}"

    def deadline_passes(self, a: DeadlinePasses) -> str:
        # only a time that means something in the task's state: moving any other would be a no-op
        w = self.world()
        having = [t for t in self.tasks if _deadlines(w.tasks[t])]
        if not having:
            return "skipped: no task has a deadline that matters"
        tid = having[a.task % len(having)]
        columns = _deadlines(w.tasks[tid])
        column = columns[a.which % len(columns)]
        assert column in ("accept_deadline", "lease_expires_at", "started_at", "cancel_requested_at")
        self.sql(f"UPDATE tasks SET {column} = now() - interval '1 hour' WHERE id = $1", tid)
        return f"{self.label(tid)}.{column} moved an hour back" + ("; " + self.sweep() if a.then_sweep else "")

    def node_trouble(self, a: NodeTrouble) -> str:
        nid = self.node(a.node)
        if a.how == "disconnect":
            self.run(self.store.node_disconnected(nid, self.world().nodes[nid]["session"]))
        else:
            ago = 2 * T.unreachable_after if a.how == "unreachable" else 10 * T.offline_after
            self.sql("UPDATE nodes SET last_heartbeat_at = now() - make_interval(secs => $2) WHERE id = $1", nid, ago)
        return nid

    def node_back(self, a: NodeBack) -> str:
        """A Hello again, perhaps offering fewer slots. A node that lost its state reports nothing: the
        gateway's reconcile then redelivers what is `assigned` and applies the node-loss policy to the rest."""
        nid = self.node(a.node)
        row = self.run(hello(self.store, nid, a.slots, self.gpus[nid]))
        if nid in self.revoked:
            assert row is None, f"removed node {nid} was let back in"
            return f"{nid} refused: removed from the fleet"
        assert row is not None
        if not a.forgot:
            return nid
        for r in self.run(self.store.tasks_on_node(nid)):
            if r.state == S.ASSIGNED:
                self.run(self.store.redeliver([r.fencing_token]))
                continue
            f = facts(self.run(self.store.get_task(r.id)))
            step = policy.on_node_loss(f, reasons.NODE_FORGOT)
            done = self.run(self.sched.applier.apply(r.id, f.state, step, actor=f"node:{nid}",
                                             fencing_token=r.fencing_token, node_id=nid))  # fmt: skip
            assert (done is not None) == (step is not None), f"NODE_FORGOT on a {f.state} task: step {step}, result {done}"
        return nid

    def drain(self, a: Drain) -> str:
        nid = self.node(a.node)
        self.run(self.store.set_draining(nid, a.draining))
        return nid

    def revoke(self, a: Revoke) -> str:
        nid = self.node(a.node)
        if nid in self.revoked:
            return f"skipped: {nid} already removed"
        if len(self.revoked) + 1 == len(self.nodes):
            return f"skipped: {nid} is the last node in the fleet"
        self.run(self.store.revoke_node(nid))
        self.revoked.add(nid)
        self.run(self.sched.node_removed(nid))
        left = self.run(self.store.tasks_on_node(nid))
        assert not left, f"tasks still on removed node {nid}: {[(r.id, r.state) for r in left]}"
        return nid

    # ---- races ----------------------------------------------------------------------------------

    def race(self, a: Race) -> str:
        w = self.world()
        ops = [self._racer(x, w, sched) for x, sched in ((a.first, self.sched), (a.second, self.other))]
        if any(op is None for op in ops):
            return "skipped: nothing to race on"

        async def both() -> list[Any]:
            return await asyncio.gather(*(op() for op in ops if op is not None), return_exceptions=True)

        results = self.run(both())
        for r in results:
            if isinstance(r, Contention) and "kept changing state" in str(r):
                continue  # an operator's cancel that lost ten races in a row says so (a 503): allowed
            if isinstance(r, BaseException):
                raise r
        return " ∥ ".join(self._said(r) for r in results)

    def _said(self, r: Any) -> str:
        if isinstance(r, DispatchOutcome):
            return "dispatch assigned " + (", ".join(f"{self.label(t)} → {n}" for t, n, _tok in r.assigned) or "nothing")
        return "swept" if r is None else str(r)

    def _racer(self, a: Any, w: World, sched: Scheduler) -> Callable[[], Awaitable[Any]] | None:
        """What starts doing `a` (targets chosen now, from `w`), or None if there is nothing to do."""
        match a:
            case Dispatch():
                return sched.dispatch_once
            case Sweep():
                return sched.sweep
            case Cancel():
                tid = self.task(a.task)
                return None if tid is None else (lambda: sched.cancel(tid, "operator"))
            case Report():
                on_node = [t for t in self.tasks if w.tasks[t]["state"] in ON_NODE]
                if not on_node:
                    return None
                tid = on_node[a.task % len(on_node)]
                row = w.tasks[tid]
                return lambda: self._gateway_event(sched, tid, row["fencing_token"], row["node_id"], a.kind, a.code)
            case NodeBack():
                nid = self.node(a.node)
                return None if nid in self.revoked else (lambda: self._hello_forgetting(sched, nid, a.slots))
            case Revoke():
                nid = self.node(a.node)
                if nid in self.revoked or len(self.revoked) + 1 == len(self.nodes):
                    return None
                return lambda: self._revoke(sched, nid)
        raise AssertionError(f"cannot race {a!r}")

    async def _gateway_event(self, sched: Scheduler, tid: uuid.UUID, token: int, node: str, kind: str, code: int) -> str:
        """What the gateway's report batcher does with a node's report: an acceptance first as expected
        (one compare-and-set that the task is assigned to this node under this token, no read); else,
        or if the row refuses it, read, refuse a stale token or a foreign node, decide, compare-and-set;
        read again if the task moved in between."""
        if kind == protocol.PROVISIONING:
            assigned = policy.TaskFacts(state=S.ASSIGNED)
            step = policy.on_node_event(assigned, kind, None, T)
            assert step is not None
            [made] = await self.store.transition_expected(
                [change(tid, S.ASSIGNED, step, actor=f"node:{node}", fencing_token=token, node_id=node)]
            )
            if made is not None:
                return f"{kind}: assigned → {step.to} (as expected)"
        for _ in range(5):
            row = await self.store.get_task(tid)
            if row.fencing_token != token or row.node_id != node:
                return f"{kind} refused (stale)"
            f = facts(row)
            step = policy.on_node_event(f, kind, code if kind == protocol.EXITED else None, T)
            if step is None:
                return f"{kind}: nothing to do in {f.state}"
            if await sched.applier.apply(tid, f.state, step, actor=f"node:{node}", fencing_token=token, node_id=node):
                return f"{kind}: {f.state} → {step.to}"
        return f"{kind}: lost five races"

    async def _hello_forgetting(self, sched: Scheduler, nid: str, slots: int) -> str:
        """A node back without its tasks, through the gateway's reconcile."""
        if await hello(self.store, nid, slots, self.gpus[nid]) is None:
            return f"{nid} refused"
        for r in await self.store.tasks_on_node(nid):
            if r.state == S.ASSIGNED:
                await self.store.redeliver([r.fencing_token])
                continue
            f = facts(await self.store.get_task(r.id))
            await sched.applier.apply(r.id, f.state, policy.on_node_loss(f, reasons.NODE_FORGOT), actor=f"node:{nid}",
                              fencing_token=r.fencing_token, node_id=nid)  # fmt: skip
        return f"{nid} back"

    async def _revoke(self, sched: Scheduler, nid: str) -> str:
        if nid in self.revoked or len(self.revoked) + 1 == len(self.nodes):
            return f"{nid} kept: the last node in the fleet"  # the other racer removed one first
        self.revoked.add(nid)
        await self.store.revoke_node(nid)
        await sched.node_removed(nid)
        return f"{nid} removed"


def run_program(db_url: str, fleet: list[tuple[int, int]], first: list[Submit], program: list[Any]) -> None:
    """The fleet says hello, the `first` tasks are submitted and placed by one dispatch tick (so the
    program starts with work on the nodes), then the program runs, checked after every step."""
    loop = asyncio.new_event_loop()
    try:
        model = Model(db_url, loop)
        try:
            model.start(fleet)
            check_invariants(model.world())
            prologue = [*first, Dispatch()] if first else []
            for i, action in enumerate(prologue + program, start=-len(prologue)):
                outcome = model.do(action)
                note(f"{i:2d}. {action!r}: {outcome}")
                check_invariants(model.world())
        finally:
            model.close()
    finally:
        loop.close()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(fleet=FLEET, first=st.lists(_submit, max_size=4), program=PROGRAM)
def test_task_lifecycle_model(db_url: str, fleet: list[tuple[int, int]], first: list[Submit], program: list[Any]) -> None:
    run_program(db_url, fleet, first, program)
