"""Several Podium servers on one PostgreSQL: real `podium server` replicas sharing one database on
the system PostgreSQL 15, real agents spread across them (each lists every replica and fails over),
fast timers (PODIUM_TEST_FAST_TIMERS=1: heartbeat 1s, unreachable 3s, offline 12s, accept 1.5s).

Every test checks the same promises, from two sides:
- the database's story: every task `succeeded`, exactly one `succeeded` event and one `exited`
  attempt per task, every reservation given back, no CHECK violation or dead loop ever logged;
- the agents' ground truth (their journals): no task started twice, never two attempts of a task at
  once, and never more processes running on a node than it has slots.

The tests: three replicas and twenty agents running 2,000 tasks (placement by several replicas,
delivery across replicas); a replica SIGKILLed and another SIGSTOPped between its read and its write
mid-run; the sharp form of that pause (stopped right after pushing an Assign); replicas whose clocks
are ten minutes off (libfaketime); an idempotent submit retried on another replica.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import httpx
import psutil
import pytest

from podium import reasons
from podium.timing import timing_from_env
from tests import harness
from tests.acceptance.conftest import Cluster
from tests.conftest import PG15_URL
from tests.harness import (
    Agent,
    Server,
    assert_at_most_one_attempt_at_once,
    attempt_intervals,
    wait_for,
)

T = timing_from_env({"PODIUM_TEST_FAST_TIMERS": "1"})
TERMINAL = ("succeeded", "failed", "cancelled", "lost")
SERVER_ID = re.compile(r"Podium server (\S+): API on")
NODE_CONNECTED = re.compile(r"node (\S+) \((\S+)\) connected, session (\d+)")
AGENT_CONNECTED = re.compile(r"connected to (\S+) \(server (\S+)\)")


# ---- the API's token, and the database read directly (2,000 tasks one by one over REST is slow) ----


def auth(api: str) -> dict[str, str]:
    """The admin's bearer token for a replica's API, when the server made one."""
    tok = getattr(harness, "ADMIN_TOKENS", {}).get(api)
    return {"Authorization": f"Bearer {tok}"} if tok else {}


def sql(url: str, query: str, *args: Any) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(url)
        try:
            return await conn.fetch(query, *args)
        finally:
            await conn.close()

    return asyncio.run(run())


def sql_val(url: str, query: str, *args: Any) -> Any:
    rows = sql(url, query, *args)
    return rows[0][0] if rows else None


# ---- submitting: fast, concurrent, and retried with the same key on the next replica ---------------


@dataclass
class Submitted:
    ids: dict[str, str] = field(default_factory=dict)  # idempotency key → task id
    retries: int = 0
    answered_by: Counter[str] = field(default_factory=Counter)  # API base → submissions it answered
    seconds: float = 0.0


def check_alive(servers: list[Server]) -> None:
    """Fail at once, with the reason, when a replica that should be running has died."""
    for s in servers:
        if not s.alive():
            tail = "\n".join(s.output().splitlines()[-15:])
            raise AssertionError(f"replica {s.log_path.name} died:\n{tail}")


def submit_all(apis: list[str], specs: list[dict[str, Any]], concurrency: int = 24, deadline: float = 120,
               live: Callable[[], None] | None = None) -> Submitted:  # fmt: skip
    """POST every spec (each has an idempotency_key) round-robin over the replicas' APIs. A request
    that fails (a killed or paused replica) is retried with the same key on the next replica: the
    client's view of "I don't know whether my submit landed"."""
    out = Submitted()

    async def main() -> None:
        clients = {a: httpx.AsyncClient(base_url=a, timeout=httpx.Timeout(5.0), headers=auth(a)) for a in apis}
        sem = asyncio.Semaphore(concurrency)
        stop_at = time.monotonic() + deadline

        async def one(i: int, spec: dict[str, Any]) -> None:
            async with sem:
                k = 0
                while True:
                    base = apis[(i + k) % len(apis)]
                    try:
                        r = await clients[base].post("/v1/tasks", json=spec)
                        if r.status_code in (200, 201):
                            out.ids[spec["idempotency_key"]] = r.json()["task"]["id"]
                            out.answered_by[base] += 1
                            return
                        # 503: that replica lost its database; 429: it is shedding load (nothing stored)
                        assert r.status_code in (429, 503), f"submit to {base}: {r.status_code} {r.text}"
                    except httpx.TransportError:
                        pass
                    if live is not None:
                        live()
                    if time.monotonic() > stop_at:
                        raise AssertionError(f"could not submit {spec['idempotency_key']} within {deadline}s")
                    out.retries += 1
                    k += 1
                    await asyncio.sleep(0.1)

        try:
            # a TaskGroup: one failure cancels the rest before the clients close
            async with asyncio.TaskGroup() as tg:
                for i, s in enumerate(specs):
                    tg.create_task(one(i, s))
        except ExceptionGroup as eg:
            raise eg.exceptions[0] from None
        finally:
            for c in clients.values():
                await c.aclose()

    t0 = time.monotonic()
    asyncio.run(main())
    out.seconds = time.monotonic() - t0
    return out


# ---- reading the processes' logs -----------------------------------------------------------------


def server_id(s: Server) -> str:
    m = wait_for(lambda: SERVER_ID.search(s.output()), 30, what="the server to log its id")
    return m.group(1)


def node_connections(servers: list[Server]) -> list[tuple[str, str, int]]:
    """(node id, server id, session) for every stream a replica accepted, from the servers' logs."""
    out = []
    for s in servers:
        sid = server_id(s)
        out += [(m.group(2), sid, int(m.group(3))) for m in NODE_CONNECTED.finditer(s.output())]
    return out


def agent_connections(a: Agent) -> list[tuple[str, str]]:
    """(address, server id) for every stream the agent opened, in order."""
    return [(m.group(1), m.group(2)) for m in AGENT_CONNECTED.finditer(a.output())]


def start_agents(cluster: Cluster, servers: list[Server], n: int, slots: int, prefix: str = "a",
                 extra_env: dict[str, str] | None = None, labels: dict[str, str] | None = None) -> list[Agent]:  # fmt: skip
    """Agent i's first address is replica i % len(servers); the others follow for failover."""
    agents = []
    for i in range(n):
        k = i % len(servers)
        agents.append(cluster.agent(f"{prefix}{i:02d}", servers=servers[k:] + servers[:k], slots=slots,
                                    extra_env=extra_env, labels=labels))  # fmt: skip
    url = cluster.db_url
    assert url is not None
    wait_for(lambda: sql_val(url, "SELECT count(*) FROM nodes WHERE connected AND health = 'online'") == n,
             90, interval=0.3, what=f"{n} agents to connect")  # fmt: skip
    return agents


def wait_live(cond: Callable[[], Any], timeout: float, live: list[Server], what: str) -> Any:
    """wait_for, but a replica that should live and died fails it at once."""

    def check() -> Any:
        if any(not x.alive() for x in live):
            return "dead"
        return cond()

    v = wait_for(check, timeout, interval=0.1, what=what)
    check_alive(live)
    return v


def wait_all_ended(url: str, n: int, timeout: float, live: list[Server] | None = None) -> None:
    """Wait for n tasks to reach an end state; fail at once if a replica that should live dies."""
    deadline = time.monotonic() + timeout
    ended = 0
    while time.monotonic() < deadline:
        check_alive(live or [])
        ended = sql_val(url, "SELECT count(*) FROM tasks WHERE state = ANY($1::text[])", list(TERMINAL))
        if ended == n:
            return
        time.sleep(0.5)
    states = dict(sql(url, "SELECT state, count(*) FROM tasks GROUP BY state"))
    raise AssertionError(f"timed out after {timeout}s waiting for all {n} tasks to end: {states}")


# ---- the promises ----------------------------------------------------------------------------------


def max_running_per_node(agents: list[Agent]) -> dict[str, int]:
    """From the journals: the most processes an agent ever had running at one instant."""
    out = {}
    for a in agents:
        intervals = attempt_intervals([a])
        edges = []
        for spans in intervals.values():
            for t0, t1, _tok, _node in spans:
                edges.append((t0, 1))
                edges.append((t1, -1))
        edges.sort(key=lambda e: (e[0], e[1]))  # at equal times, a stop before a start
        running = peak = 0
        for _t, d in edges:
            running += d
            peak = max(peak, running)
        out[a.name] = peak
    return out


def assert_invariants(cluster: Cluster, agents: list[Agent], slots: int, states: dict[str, int]) -> None:
    """The promises, checked from the database and from the agents' journals. `states` is the count
    of tasks expected in each end state; a succeeded task must have exactly one succeeded event, one
    exited attempt, and that attempt must be the only process the agents ever started for it."""
    url = cluster.db_url
    assert url is not None
    got = dict(sql(url, "SELECT state, count(*) FROM tasks GROUP BY state"))
    assert got == states, f"task states: {got}, expected {states}"
    bad_events = sql(url, """
        SELECT t.id, count(e.*) FILTER (WHERE e.to_state = 'succeeded') AS n
        FROM tasks t LEFT JOIN task_events e ON e.task_id = t.id WHERE t.state = 'succeeded' GROUP BY t.id
        HAVING count(e.*) FILTER (WHERE e.to_state = 'succeeded') <> 1""")  # fmt: skip
    assert not bad_events, f"tasks without exactly one succeeded event: {bad_events[:5]}"
    bad_attempts = sql(url, """
        SELECT t.id, count(a.*) FILTER (WHERE a.state = 'exited') AS n
        FROM tasks t LEFT JOIN attempts a ON a.task_id = t.id WHERE t.state = 'succeeded' GROUP BY t.id
        HAVING count(a.*) FILTER (WHERE a.state = 'exited') <> 1""")  # fmt: skip
    assert not bad_attempts, f"tasks without exactly one exited attempt: {bad_attempts[:5]}"
    # every reservation was given back, exactly once (the CHECK forbids going below zero)
    held = sql(url, """SELECT name, res_cpu_millis, res_memory_bytes, res_disk_bytes, res_gpus, res_slots FROM nodes
                       WHERE res_cpu_millis <> 0 OR res_memory_bytes <> 0 OR res_disk_bytes <> 0 OR res_gpus <> 0
                          OR res_slots <> 0""")  # fmt: skip
    assert not held, f"nodes still holding reservations: {held}"
    assert sql_val(url, "SELECT count(*) FROM attempts WHERE NOT released") == 0
    for s in cluster.servers:
        out = s.output()
        for line in out.splitlines():
            # a reservation that would break the CHECK, a claimed row that moved, a loop that died
            assert not re.search(r"violates check constraint|changed state under its row lock|stopping the server",
                                 line), f"{s.log_path.name}: {line}"  # fmt: skip

    # ground truth: what the agents actually ran
    succeeded = {str(r["task_id"]): r["fencing_token"] for r in sql(url, """
        SELECT a.task_id, a.fencing_token FROM attempts a JOIN tasks t ON t.id = a.task_id
        WHERE t.state = 'succeeded' AND a.state = 'exited'""")}  # fmt: skip
    starts: dict[str, list[int]] = defaultdict(list)
    for a in agents:
        for e in a.journal_entries():
            if e["ev"] == "start":
                starts[e["task"]].append(e["token"])
    twice = {t: toks for t, toks in starts.items() if len(toks) > 1}
    assert not twice, f"{len(twice)} tasks started more than once (task: tokens), e.g. {list(twice.items())[:5]}"
    never = set(succeeded) - set(starts)
    assert not never, f"{len(never)} tasks succeeded that no agent ever started, e.g. {sorted(never)[:5]}"
    wrong = {t for t in succeeded if starts[t] != [succeeded[t]]}
    assert not wrong, f"the attempt that ran is not the attempt recorded as exited: {sorted(wrong)[:5]}"
    assert_at_most_one_attempt_at_once(agents)
    peaks = max_running_per_node(agents)
    over = {n: p for n, p in peaks.items() if p > slots}
    assert not over, f"agents that ran more than their {slots} slots at once: {over}"


def placements(url: str) -> list[tuple[str, str, str]]:
    """(task id, placing server id, node id) for every assignment."""
    rows = sql(url, """
        SELECT e.task_id, e.actor, a.node_id FROM task_events e
        JOIN attempts a ON a.fencing_token = e.fencing_token
        WHERE e.to_state = 'assigned'""")  # fmt: skip
    return [(str(r["task_id"]), r["actor"].removeprefix("scheduler:"), r["node_id"]) for r in rows]


def true_specs(tag: str, n: int, command: list[str], **extra: Any) -> list[dict[str, Any]]:
    run = uuid.uuid4().hex[:8]
    return [{"command": command, "idempotency_key": f"{tag}-{run}-{i}", **extra} for i in range(n)]


# ---- the tests -----------------------------------------------------------------------------------

def test_three_replicas_twenty_agents(cluster: Cluster) -> None:
    url = cluster.db_url
    assert url is not None
    servers = [cluster.server() for _ in range(3)]
    sids = [server_id(s) for s in servers]
    assert len(set(sids)) == 3
    slots = 4
    agents = start_agents(cluster, servers, 20, slots)
    n = 2000
    t0 = time.monotonic()
    sub = submit_all([s.api for s in servers], true_specs("many", n, ["true"]), live=lambda: check_alive(servers))
    # one task per key, whichever replica answered (a timed-out POST is retried on the next one)
    assert len(set(sub.ids.values())) == n
    assert all(sub.answered_by[s.api] > 0 for s in servers)
    wait_all_ended(url, n, 180, live=servers)
    elapsed = time.monotonic() - t0

    assert_invariants(cluster, agents, slots, {"succeeded": n})

    # the agents were spread: each one's first stream went to the replica it lists first
    first = [agent_connections(a)[0][1] for a in agents]
    assert first == [sids[i % 3] for i in range(20)], first
    # every replica placed work, and work placed by one replica ran on nodes whose stream another
    # held (the servers' logs say which replica accepted which node's stream; a node that reconnected
    # during the run is left out, its holder at the time being ambiguous)
    conns = node_connections(servers)
    sessions = Counter(node for node, _sid, _sess in conns)
    holder = {node: sid for node, sid, _sess in conns if sessions[node] == 1}
    placed = placements(url)
    by_replica = Counter(sid for _t, sid, _n in placed)
    assert set(by_replica) <= set(sids)
    assert len(by_replica) >= 2, f"only one replica placed anything: {by_replica}"
    crossed = sum(1 for _t, sid, node in placed if node in holder and holder[node] != sid)
    assert crossed > 0, "no assignment was delivered by a replica other than the one that placed it"
    print(f"\n{n} tasks in {elapsed:.1f}s (submitted in {sub.seconds:.1f}s); placed by {dict(by_replica)}; "
          f"{crossed} delivered by another replica")  # fmt: skip


# ---- pausing a replica between its read and its write ---------------------------------------------

# The dispatch transaction reads (claim_queued, what it places) and then writes (lock_nodes, then
# assign_tasks with its reservations). A backend left 'idle in transaction' after that read is a
# replica stopped between its read and its write. (The nodes it places on were read just before, in
# the same round trip as the pass's facts, outside the transaction.)
READS = ("SKIP LOCKED",)
# the dispatch pass's node locks (lock_nodes, or lock_nodes_drawing_tokens for a pass that sends its
# Assigns before its write): both say so
LOCK_NODES = "Placement takes its nodes' rows in id order"
GATE = 1.0  # seconds the node rows are held at most for one try (heartbeats wait on them too)


PG_PORT = urlsplit(PG15_URL).port or 5432


def db_ports(pid: int) -> list[int]:
    """The local ports of a process's connections to PostgreSQL: pg_stat_activity.client_port."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return []
    return [c.laddr.port for c in conns if c.raddr and c.raddr.port == PG_PORT]


@dataclass
class Pause:
    caught: bool = False  # stopped with a dispatch transaction open after its read
    query: str = ""
    tries: int = 0
    seconds: float = 0.0


def pause_between_read_and_write(server: Server, url: str, seconds: float, search_for: float = 20.0,
                                 place: Callable[[], None] | None = None) -> Pause:  # fmt: skip
    """SIGSTOP `server` while one of its connections sits inside a dispatch transaction after a read,
    confirm it is still there once stopped, hold it `seconds`, SIGCONT. Misses (the transaction ended
    before the signal landed) are let go at once and tried again; if none is caught within
    `search_for` seconds the server is paused wherever it is. `place`, called once the node rows
    are held, makes `server` place a task (without waiting for it): see `gated`."""
    out = Pause()
    q = """SELECT pid, xact_start, query FROM pg_stat_activity
           WHERE client_port = ANY($1::int[]) AND state = 'idle in transaction'"""
    gated_q = """SELECT pid, xact_start, query FROM pg_stat_activity
                 WHERE client_port = ANY($1::int[]) AND state = 'active' AND wait_event_type = 'Lock'
                   AND strpos(query, $2) > 0"""

    async def gated() -> bool:
        """The sure way: hold every node row for up to GATE seconds, so the replica's next pass that
        claimed work waits in `lock_nodes` — inside its transaction, after its read, before any write.
        Stop it there, then let the rows go: its statement ends and its transaction stays open while
        it is stopped. (Polling for the moment between two statements instead is a race that a fast
        machine, whose passes are short, loses.) Held briefly: heartbeats wait on the same rows.

        A pass places only where it sees room, and room is freed by writing a node's row, which the
        held rows forbid: on a full fleet only a pass already on its way when the rows were taken
        could be caught, a race a fast machine loses too. So `place` gives it work for room that
        stays free (a node the rest of the work cannot use)."""
        conn, gate = await asyncpg.connect(url), await asyncpg.connect(url)
        try:
            stop_at = time.monotonic() + search_for
            while time.monotonic() < stop_at:
                waiting = []
                tr = gate.transaction()
                await tr.start()
                try:
                    await gate.execute("SELECT id FROM nodes ORDER BY id FOR NO KEY UPDATE")
                    if place is not None:
                        place()
                    until = time.monotonic() + GATE
                    while not waiting and time.monotonic() < until:
                        await asyncio.sleep(0.01)
                        waiting = await conn.fetch(gated_q, db_ports(server.pid), LOCK_NODES)
                    if waiting:
                        out.tries += 1
                        server.signal(signal.SIGSTOP)
                finally:
                    await tr.rollback()
                if not waiting:
                    await asyncio.sleep(GATE)  # the heartbeats catch up before the next try
                    continue
                t0 = time.monotonic()
                key = (waiting[0]["pid"], waiting[0]["xact_start"])
                while time.monotonic() - t0 < 1.0:
                    idle = [r for r in await conn.fetch(q, db_ports(server.pid)) if (r["pid"], r["xact_start"]) == key]
                    if idle:
                        out.caught, out.query = True, idle[0]["query"]
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(max(0.0, seconds - (time.monotonic() - t0)))
                server.signal(signal.SIGCONT)
                out.seconds = time.monotonic() - t0
                return out.caught
            return False
        finally:
            await gate.close()
            await conn.close()

    async def run() -> None:
        if await gated():
            return
        conn = await asyncpg.connect(url)
        try:
            stop_at = time.monotonic() + search_for
            while time.monotonic() < stop_at:
                ports = db_ports(server.pid)
                rows = [r for r in await conn.fetch(q, ports) if any(m in r["query"] for m in READS)]
                if not rows:
                    await asyncio.sleep(0.002)
                    continue
                out.tries += 1
                server.signal(signal.SIGSTOP)
                t0 = time.monotonic()
                await asyncio.sleep(0.05)
                still = {(r["pid"], r["xact_start"]) for r in await conn.fetch(q, ports)}
                hit = [r for r in rows if (r["pid"], r["xact_start"]) in still]
                if hit:
                    out.caught, out.query = True, hit[0]["query"]
                    await asyncio.sleep(max(0.0, seconds - (time.monotonic() - t0)))
                    server.signal(signal.SIGCONT)
                    out.seconds = time.monotonic() - t0
                    return
                server.signal(signal.SIGCONT)
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            server.signal(signal.SIGSTOP)
            await asyncio.sleep(seconds)
            server.signal(signal.SIGCONT)
            out.seconds = time.monotonic() - t0
        finally:
            await conn.close()

    try:
        asyncio.run(run())
    finally:
        server.signal(signal.SIGCONT)  # never leave it stopped
    return out


def count_state(url: str, state: str) -> int:
    return sql_val(url, "SELECT count(*) FROM tasks WHERE state = $1", state)


# The pause: 2s. Longer than the accept deadline (1.5s with fast timers), on purpose: a replica stopped
# between its read and its write must not, once it runs again, write what is stale by then (the rows it
# read, deadlines measured from before the pause), and the others must not give its delivered work away
# while it sleeps. Shorter than everything that lets the fleet *legitimately* act in its place: the
# node's fence (10s) and OfflineAfter (12s), so no node's work may be handed to another node. (Its nodes
# may briefly be marked unreachable, 3s after their last recorded heartbeat: that moves no task.)
PAUSE = 2.0


def test_replica_killed_and_another_paused_mid_run(cluster: Cluster) -> None:
    url = cluster.db_url
    assert url is not None
    servers = [cluster.server() for _ in range(3)]
    sids = [server_id(s) for s in servers]
    slots = 4
    # The work runs on the nine; "spare" keeps its room free for the tasks that pause replica 1 in its
    # placement (`pause_between_read_and_write`), and streams to it
    workers = start_agents(cluster, servers, 9, slots, labels={"fleet": "work"})
    agents = [*workers, cluster.agent("spare", servers=[servers[1], servers[2]], slots=slots, labels={"fleet": "spare"})]
    wait_for(lambda: sql_val(url, "SELECT count(*) FROM nodes WHERE connected AND health = 'online'") == 10, 90,
             interval=0.3, what="the spare agent to connect")  # fmt: skip
    n = 600
    specs = true_specs("faults", n, ["sleep", "0.8"], labels={"fleet": "work"})
    result: list[Submitted] = []
    errors: list[BaseException] = []

    # The second half is submitted only once the killed replica's nodes stream to the others: the pause
    # below needs queued work, and how long the reconnects take must not decide whether any is left.
    second_half = threading.Event()

    def submit() -> None:
        try:
            apis = [s.api for s in servers]
            result.append(submit_all(apis, specs[: n // 2], concurrency=12, live=lambda: check_alive(servers[1:])))
            if not second_half.wait(180):
                raise AssertionError("never told to submit the second half")
            result.append(submit_all(apis, specs[n // 2 :], concurrency=12, live=lambda: check_alive(servers[1:])))
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    submitter = threading.Thread(target=submit, name="submitter")
    submitter.start()

    # SIGKILL replica 0 once a quarter of the work is done; its agents listed it first
    wait_live(lambda: count_state(url, "succeeded") >= n // 4, 120, servers, "a quarter of the tasks to succeed")
    victims = [a for i, a in enumerate(workers) if i % 3 == 0]
    before = {a.name: len(agent_connections(a)) for a in victims}
    killed_at = time.monotonic()
    servers[0].kill()
    reconnected: dict[str, float] = {}

    def all_reconnected() -> bool:
        for a in victims:
            if a.name not in reconnected:
                conns = agent_connections(a)
                if len(conns) > before[a.name] and conns[-1][1] != sids[0]:
                    reconnected[a.name] = time.monotonic() - killed_at
        return len(reconnected) == len(victims)

    wait_live(all_reconnected, 30, servers[1:], "the killed replica's agents to reconnect to another replica")
    # "within seconds": the agent retries the next address at once; a loaded 2-core machine is slow
    assert max(reconnected.values()) < 10, f"reconnect times: {reconnected}"
    # every one of them now streams to a live replica, as the database says
    live = set(sids[1:])
    wait_for(lambda: {r["gateway_id"] for r in sql(url, "SELECT gateway_id FROM nodes")} <= live, 30, interval=0.2,
             what="every node's stream to be held by a live replica")  # fmt: skip

    # SIGSTOP replica 1 (now holding six agents) between its read and its write, while work is queued
    second_half.set()
    wait_live(lambda: count_state(url, "queued") > 0, 60, servers[1:], "the second half to be queued")
    # First in the queue, and only for the spare: handed to replica 1's dispatcher when it is idle
    # (placed by the pass that stores it), else stored and claimed by whichever dispatcher comes first
    spare_spec = {"command": ["true"], "labels": {"fleet": "spare"}, "priority": 100}
    spare_posts: list[threading.Thread] = []
    spare_answers: list[int | str] = []

    def post_spare() -> None:
        try:
            r = httpx.post(f"{servers[1].api}/v1/tasks", json=spare_spec, headers=auth(servers[1].api), timeout=60)
            spare_answers.append(r.status_code)
        except httpx.HTTPError as e:
            spare_answers.append(repr(e))

    def place() -> None:
        spare_posts.append(threading.Thread(target=post_spare, name="spare-submit"))
        spare_posts[-1].start()

    paused = pause_between_read_and_write(servers[1], url, PAUSE, place=place)
    for t in spare_posts:
        t.join(60)
    assert spare_answers == [201] * len(spare_posts), spare_answers
    assert paused.caught, f"never caught replica 1 inside a dispatch transaction ({paused.tries} tries)"

    submitter.join(180)
    assert not errors, errors
    sub = Submitted(ids={k: v for r in result for k, v in r.ids.items()}, retries=sum(r.retries for r in result))
    assert len(sub.ids) == n and len(set(sub.ids.values())) == n
    total = n + len(spare_posts)
    wait_all_ended(url, total, 180, live=servers[1:])
    # a retried submit never made a second task, whichever replica answered it
    assert sql_val(url, "SELECT count(*) FROM tasks") == total
    assert_invariants(cluster, agents, slots, {"succeeded": total})
    assert servers[1].alive() and servers[2].alive()
    print(f"\nkilled {sids[0]}: its agents reconnected after {sorted(round(v, 2) for v in reconnected.values())}s; "
          f"paused {sids[1]} for {paused.seconds:.2f}s, caught between read and write: {paused.caught} "
          f"(tries {paused.tries}; last statement: {paused.query.splitlines()[0] if paused.query else '-'}); "
          f"{sub.retries} submit retries")  # fmt: skip


# how long the nodes of the delivery-window test take to say "provisioning": the window it must hit
ANSWER_DELAY = 0.25


def test_assign_delivered_just_before_its_replica_pauses_runs_once(cluster: Cluster) -> None:
    """The sharp form of the pause: the replica holding a node's stream pushes an Assign and stops
    before it has recorded the node's "provisioning". The agent has the Assign (and may not start it
    before its `Accepted`); the other replica sees an attempt still `assigned` past its accept
    deadline. Whatever it does, the task must not run a second time elsewhere while a first process
    runs.

    The window is made wide on purpose: each node says "provisioning" ANSWER_DELAY after its Assign.
    A node that answers within a few milliseconds has its acceptance made by the very pass that placed
    the task (the assignment and its acceptance in one commit), so on a fast machine the window would
    never be seen at all, and the test would pass without testing anything."""
    url = cluster.db_url
    assert url is not None
    a, b = cluster.server(), cluster.server()
    slow = {"PODIUM_TEST_AGENT_ANSWER_DELAY": str(ANSWER_DELAY)}
    x = cluster.agent("x", servers=[a], slots=8, extra_env=slow)
    y = cluster.agent("y", servers=[b], slots=8, extra_env=slow)
    holder = {x.node_id(): a, y.node_id(): b}
    wait_for(lambda: sql_val(url, "SELECT count(*) FROM nodes WHERE connected AND health = 'online'") == 2, 60)
    hold = T.provisioning_deadline + 1.0  # past the accept deadline, short of unreachable/fence/offline
    q = """SELECT node_id, fencing_token FROM attempts
           WHERE task_id = $1 AND state = 'assigned' AND delivered_at IS NOT NULL AND provisioning_at IS NULL"""

    async def one_try(tid: uuid.UUID) -> bool:
        """Stop the stream's replica between the Assign leaving it and the node's answer landing."""
        conn = await asyncpg.connect(url)
        try:
            stop_at = time.monotonic() + 20
            while time.monotonic() < stop_at:
                rows = await conn.fetch(q, tid)
                if rows:
                    srv = holder[rows[0]["node_id"]]
                    srv.signal(signal.SIGSTOP)
                    try:
                        caught = bool(await conn.fetch(q, tid))
                        if caught:
                            await asyncio.sleep(hold)
                    finally:
                        srv.signal(signal.SIGCONT)
                    return caught
                if await conn.fetchval("SELECT provisioning_at IS NOT NULL FROM attempts WHERE task_id = $1 LIMIT 1", tid):
                    return False  # missed the window
                await asyncio.sleep(0.001)
            return False
        finally:
            await conn.close()

    caught = 0
    with httpx.Client(timeout=30, headers=auth(a.api)) as http:
        for i in range(8):
            r = http.post(f"{a.api}/v1/tasks", json={"command": ["sleep", "4"], "idempotency_key": f"window-{uuid.uuid4().hex}-{i}"})
            assert r.status_code == 201, r.text
            tid = uuid.UUID(r.json()["task"]["id"])
            if asyncio.run(one_try(tid)):
                caught += 1
                wait_for(lambda tid=tid: sql_val(url, "SELECT state FROM tasks WHERE id = $1", tid) in TERMINAL, 60, interval=0.2)
                if caught >= 2:
                    break
    assert caught, f"never stopped the replica inside the delivery window ({ANSWER_DELAY:g}s wide) in 8 tries"
    n = sql_val(url, "SELECT count(*) FROM tasks")
    wait_all_ended(url, n, 60, live=[a, b])
    assert_at_most_one_attempt_at_once([x, y])
    assert_invariants(cluster, [x, y], 8, {"succeeded": n})


# ---- a replica whose clock is minutes off ------------------------------------------------------------

def faketime_env(offset: str) -> dict[str, str]:
    """libfaketime (Debian's `faketime`) shifts the wall clock (time(), gettimeofday, clock_gettime
    REALTIME) of one process; the monotonic clock is left alone, as a real skewed clock would."""
    libs = sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1")) + sorted(Path("/usr/lib").glob("faketime/libfaketimeMT.so.1"))
    assert libs, "the faketime binary is installed but not libfaketimeMT.so.1"
    return {"LD_PRELOAD": str(libs[0]), "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def log_clock_offset(s: Server) -> float:
    """How far the server's wall clock is from ours: its log lines carry its own time."""
    m = wait_for(lambda: re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*Podium server", s.output(), re.MULTILINE), 30)
    logged = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return logged - s.log_path.stat().st_mtime  # the log was written at about that instant, by our clock


@pytest.mark.skipif(shutil.which("faketime") is None, reason="needs the faketime binary (apt-get install -y faketime)")
def test_skewed_replica_clock_changes_nothing(cluster: Cluster) -> None:
    url = cluster.db_url
    assert url is not None
    # A on the true clock, B ten minutes ahead (its own clock would expire every lease and deadline at
    # once), C ten minutes behind (its own clock would make every heartbeat it records look stale)
    # libfaketime's thread-safe build makes every clock read of a preloaded process take a lock, and
    # the gRPC core reads clocks from many threads: on a busy machine B's and C's nodes then missed the
    # tenfold-shortened accept deadline (1.5 s), which is speed, not skew. Timers three times faster
    # here (a 5 s deadline) in every process, so what is asserted below is only what the skew does.
    gentler = {"PODIUM_TEST_TIMER_DIVISOR": "3"}
    a = cluster.server(extra_env=gentler)
    b = cluster.server(extra_env={**gentler, **faketime_env("+10m")})
    c = cluster.server(extra_env={**gentler, **faketime_env("-10m")})
    servers = [a, b, c]
    assert 590 < log_clock_offset(b) < 610 and -610 < log_clock_offset(c) < -590, "libfaketime did not take"
    slots = 4
    agents = start_agents(cluster, servers, 6, slots, prefix="s", extra_env=gentler)

    # watch node health the whole time: nothing may ever leave online
    seen: set[tuple[str, str, bool]] = set()
    watching = threading.Event()

    def watch() -> None:
        async def run() -> None:
            conn = await asyncpg.connect(url)
            try:
                while not watching.is_set():
                    for r in await conn.fetch("SELECT name, health, connected FROM nodes"):
                        seen.add((r["name"], r["health"], r["connected"]))
                    await asyncio.sleep(0.1)
            finally:
                await conn.close()

        asyncio.run(run())

    watcher = threading.Thread(target=watch, name="health-watch")
    watcher.start()
    try:
        n = 36  # 1.5 waves on 24 slots: every replica's watchdog sweeps running tasks for seconds
        specs = true_specs("skew", n, ["sleep", "4"], timeout="20s")
        sub = submit_all([s.api for s in servers], specs, concurrency=6, live=lambda: check_alive(servers))
        # and one that must time out after 3s by the database clock — not at once, not minutes late
        slow = submit_all([b.api], [{"command": ["sleep", "60"], "timeout": "3s", "idempotency_key": f"skew-slow-{uuid.uuid4().hex}"}])
        slow_id = next(iter(slow.ids.values()))
        wait_all_ended(url, n + 1, 120, live=servers)
    finally:
        watching.set()
        watcher.join(10)

    assert {h for _n, h, _c in seen} == {"online"} and {c for _n, _h, c in seen} == {True}, (
        f"a node left online: {sorted(x for x in seen if x[1] != 'online' or not x[2])}")
    for s in servers:
        assert not re.search(r"is unreachable|is offline", s.output()), f"{s.log_path.name} saw a node go silent"
    assert_invariants(cluster, agents, slots, {"succeeded": n, "failed": 1})
    # No deadline fired early. Every task ran once, on its first attempt, with no lease or node lost;
    # the one thing a busy machine may add is an assignment revoked because its node's "provisioning"
    # came past the accept window (speed, not skew: CI once saw two on server B's nodes). Such an
    # attempt must have been given its whole window by the database clock (a deadline set from a
    # replica's own clock would sit ten minutes off its assignment), been revoked no sooner than that
    # deadline, and never started; its task ran on the next attempt.
    window = timing_from_env({"PODIUM_TEST_FAST_TIMERS": "1", **gentler}).provisioning_deadline
    ended = sql(url, """SELECT task_id, attempt, node_id, state, reason, assigned_at, delivered_at, accept_deadline,
                               provisioning_at, started_at, finished_at
                        FROM attempts ORDER BY task_id, attempt""")
    last = {r["task_id"]: r["attempt"] for r in ended}
    revoked = [r for r in ended if r["attempt"] < last[r["task_id"]]]
    for r in revoked:
        given = (r["accept_deadline"] - r["assigned_at"]).total_seconds()
        assert (r["state"], r["reason"], r["started_at"]) == ("revoked", reasons.NOT_ACCEPTED, None), dict(r)
        assert window <= given < window + 5 and r["finished_at"] >= r["accept_deadline"], dict(r)
    assert len(last) == n + 1  # every task has its attempts, and its last one is the one that ran
    assert set(sub.ids.values()) == {str(r["id"]) for r in sql(url, "SELECT id FROM tasks WHERE state = 'succeeded'")}
    reasons_seen = {r["reason"] for r in sql(url, "SELECT DISTINCT reason FROM task_events WHERE reason IS NOT NULL")}
    t = sql(url, "SELECT state, reason, started_at FROM tasks WHERE id = $1", uuid.UUID(slow_id))[0]
    assert (t["state"], t["reason"]) == ("failed", "timeout"), dict(t)
    assert reasons_seen <= {"timeout"} | ({reasons.NOT_ACCEPTED} if revoked else set()), f"unexpected reasons: {reasons_seen}"
    ev = {r["to_state"]: r["at"] for r in sql(url, "SELECT to_state, at FROM task_events WHERE task_id = $1", uuid.UUID(slow_id))}
    ran_for = (ev["cancelling"] - ev["running"]).total_seconds()
    assert 3.0 <= ran_for < 3.0 + 5.0, f"the 3s timeout fired after {ran_for:.2f}s"
    placed = Counter(sid for _t, sid, _n in placements(url))
    print(f"\nplaced by {dict(placed)}; timeout fired after {ran_for:.2f}s by the database clock; "
          f"{len(revoked)} assignments revoked in time")


# ---- idempotency across replicas -------------------------------------------------------------------


def test_idempotent_retry_lands_on_another_replica(cluster: Cluster) -> None:
    url = cluster.db_url
    assert url is not None
    a, b = cluster.server(), cluster.server()
    spec = {"command": ["echo", "once"], "idempotency_key": f"retry-{uuid.uuid4().hex}"}
    with httpx.Client(timeout=30, headers=auth(a.api)) as ca, httpx.Client(timeout=30, headers=auth(b.api)) as cb:
        first = ca.post(f"{a.api}/v1/tasks", json=spec)
        assert first.status_code == 201 and first.json()["created"] is True, first.text
        # the client timed out waiting for A and retries on B
        again = cb.post(f"{b.api}/v1/tasks", json=spec)
        assert again.status_code == 200, again.text
        assert again.json()["created"] is False and again.json()["task"]["id"] == first.json()["task"]["id"]
        # the same key with another spec is a different request: refused, whichever replica sees it
        other = cb.post(f"{b.api}/v1/tasks", json={**spec, "command": ["echo", "twice"]})
        assert other.status_code == 409, other.text

    # both replicas at once, 25 keys, each sent to both: one task per key, one `created` per key
    keys = [f"race-{uuid.uuid4().hex}" for _ in range(25)]

    async def race() -> list[tuple[str, str, bool]]:
        async with httpx.AsyncClient(timeout=30, headers=auth(a.api)) as xa, httpx.AsyncClient(timeout=30, headers=auth(b.api)) as xb:
            async def one(client: httpx.AsyncClient, base: str, key: str) -> tuple[str, str, bool]:
                r = await client.post(f"{base}/v1/tasks", json={"command": ["true"], "idempotency_key": key})
                assert r.status_code in (200, 201), r.text
                return key, r.json()["task"]["id"], r.json()["created"]

            return await asyncio.gather(*(one(cl, base, k) for k in keys for cl, base in ((xa, a.api), (xb, b.api))))

    answers = asyncio.run(race())
    by_key: dict[str, set[str]] = defaultdict(set)
    created: Counter[str] = Counter()
    for key, tid, was_created in answers:
        by_key[key].add(tid)
        created[key] += was_created
    assert all(len(ids) == 1 for ids in by_key.values()), {k: v for k, v in by_key.items() if len(v) > 1}
    assert all(created[k] == 1 for k in keys), created
    assert sql_val(url, "SELECT count(*) FROM tasks") == 1 + len(keys)
    assert sql_val(url, "SELECT count(*) FROM task_events WHERE to_state = 'queued'") == 1 + len(keys)
