"""Delivering an Assign: its secrets are read just before it is sent, and each way that can go wrong
is told as what it is. Real PostgreSQL; the gateway's own delivery loop; a stream stood in for by
the gateway's `Session` (what it would write to the node is read from its queue)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from podium import reasons
from podium.gateway.outbox import PUSH_NOW_MAX
from podium.gateway.service import Gateway
from podium.gateway.sessions import Session
from podium.scheduler.apply import Applier
from podium.security.secretbox import SecretBox
from podium.security.service import Security
from podium.store import Store
from podium.timing import DEFAULT_TIMING
from tests.integration.helpers import Statements, add_node, filled_under_a_pass, looping, place, scheduler, submit


async def _eventually(cond: Any, timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        v = await cond()
        if v:
            return v
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextlib.asynccontextmanager
async def delivering(store: Store, security: Security) -> AsyncIterator[tuple[Gateway, Session]]:
    """A gateway running its delivery loop for one node "n1" whose stream is `Session`."""
    gw = Gateway(store, Applier(store, actor="gateway:test"), DEFAULT_TIMING, server_id="test", security=security)
    s = Session("n1", 1)
    gw.sessions["n1"] = s
    loop = asyncio.create_task(gw.outbox.deliver_loop())
    gw.outbox.due("n1")
    try:
        yield gw, s
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


def sent(s: Session, kind: str) -> list[Any]:
    """The messages of `kind` queued on the stream, taken from it; the others stay queued, in order (a
    Cancel the group commit queued while a test looked for its Assign is still there to be looked for)."""
    msgs, others = [], []
    while not s.out.empty():
        m = s.out.get_nowait()
        if m is not None and m.WhichOneof("kind") == kind:
            msgs.append(getattr(m, kind))
        else:
            others.append(m)
    for m in others:
        s.out.put_nowait(m)
    return msgs


async def assigned_task(store: Store, **spec: Any) -> uuid.UUID:
    await add_node(store, "n1")
    tid = await submit(store, **spec)
    out = await place(store)
    assert [a[0] for a in out.assigned] == [tid]
    return tid


async def audit_of(store: Store, tid: uuid.UUID) -> list[Any]:
    return [a for a in await store.read_audit(100) if a.target == str(tid) and a.action == "task.undeliverable"]


async def test_a_secret_sealed_with_another_key_is_told_as_undecryptable_not_missing(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    ours, theirs = SecretBox(os.urandom(32)), SecretBox(os.urandom(32))
    await Security(store, theirs).set_secret("db", b"hunter2", "test")  # a replica with another key
    tid = await assigned_task(store, secrets=[{"name": "db", "env": "DB"}])
    with caplog.at_level(logging.ERROR, logger="podium.gateway.outbox"):
        async with delivering(store, Security(store, ours)) as (_gw, s):
            t = await _eventually(lambda: _ended(store, tid), what="the task to end")
            # the audit entry is written in the failure's own transaction: there as soon as the end is
            audits = await audit_of(store, tid)
    assert (t.state, t.reason) == ("failed", reasons.SECRET_UNREADABLE)
    assert t.reason != reasons.SECRET_MISSING
    _, attempts, _ = await store.task_detail(tid)
    assert [(a.state, a.reason) for a in attempts] == [("revoked", reasons.SECRET_UNREADABLE)]
    assert sent(s, "assign") == []
    # the detail beside the reason: which secret, and this server's key
    (entry,) = audits
    assert entry.detail["secret"] == "db" and entry.detail["key_id"] == ours.key_id != theirs.key_id
    assert entry.detail["reason"] == reasons.SECRET_UNREADABLE
    # and a line for the operator that names the secret and the key, never the value
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("'db'" in m and ours.key_id in m for m in errors), errors
    assert not any("hunter2" in r.getMessage() for r in caplog.records)


async def test_a_deleted_secret_is_still_told_as_missing(store: Store) -> None:
    box = SecretBox(os.urandom(32))
    sec = Security(store, box)
    await sec.set_secret("db", b"v", "test")
    tid = await assigned_task(store, secrets=[{"name": "db", "env": "DB"}])
    await store.delete_secret("db")  # after the submission, before the delivery
    async with delivering(store, sec) as (_gw, s):
        t = await _eventually(lambda: _ended(store, tid), what="the task to end")
        audits = await audit_of(store, tid)
    assert (t.state, t.reason) == ("failed", reasons.SECRET_MISSING)
    assert sent(s, "assign") == []
    (entry,) = audits
    assert entry.detail["secret"] == "db" and "key_id" not in entry.detail


async def test_a_readable_secret_is_sent(store: Store) -> None:
    box = SecretBox(os.urandom(32))
    sec = Security(store, box)
    await sec.set_secret("db", b"v4lue", "test")
    tid = await assigned_task(store, secrets=[{"name": "db", "env": "DB"}])
    async with delivering(store, sec) as (_gw, s):
        got = await _eventually(lambda: _sent_async(s, "assign"), what="the Assign")
    assert [(a.task_id, [(v.env, v.value) for v in a.secrets]) for a in got] == [(str(tid), [("DB", "v4lue")])]
    assert (await store.get_task(tid)).state == "assigned"


async def _ended(store: Store, tid: uuid.UUID) -> Any:
    t = await store.get_task(tid)
    return t if t.state in ("succeeded", "failed", "cancelled", "lost", "queued") else None


async def _sent_async(s: Session, kind: str) -> list[Any]:
    return sent(s, kind)


# --- the store going away while the secrets are read ---------------------------------------------------


class Proxy:
    """A TCP relay in front of PostgreSQL that can be cut (every connection dropped, new ones
    refused) and restored on the same port: the database going away, as the driver sees it."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_w))

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            w.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        self._writers.difference_update((writer, up_w))


async def test_a_store_outage_while_reading_secrets_retries_and_neither_fails_nor_loses_the_task(
    e2e_db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = urlsplit(e2e_db_url)
    assert url.hostname and url.port, "needs PostgreSQL over TCP"
    proxy = Proxy(url.hostname, url.port)
    await proxy.open()
    proxied = urlunsplit(url._replace(netloc=f"{url.username}@127.0.0.1:{proxy.port}"))
    store = await Store.connect(e2e_db_url, min_size=1, max_size=5)
    # the gateway reads secrets over a pool of its own, as the server wires it
    secrets_store = await Store.connect(proxied, min_size=1, max_size=2)
    try:
        box = SecretBox(os.urandom(32))
        await Security(store, box).set_secret("db", b"v4lue", "test")
        tid = await assigned_task(store, secrets=[{"name": "db", "env": "DB"}])
        await proxy.cut()
        with caplog.at_level(logging.WARNING, logger="podium.gateway.outbox"):
            async with delivering(store, Security(secrets_store, box)) as (_gw, s):

                async def tried_twice() -> bool:
                    return sum("cannot be read now" in r.getMessage() for r in caplog.records) >= 2

                await _eventually(tried_twice, what="two tries against the unavailable store")
                t = await store.get_task(tid)
                assert (t.state, t.reason) == ("assigned", None)
                assert sent(s, "assign") == []
                await proxy.open()  # the database is back
                got = await _eventually(lambda: _sent_async(s, "assign"), what="the Assign after the outage")
        assert [(a.task_id, [(v.env, v.value) for v in a.secrets]) for a in got] == [(str(tid), [("DB", "v4lue")])]
        t = await store.get_task(tid)
        assert (t.state, t.reason, t.attempts) == ("assigned", None, 1)
        assert not [r for r in caplog.records if reasons.SECRET_MISSING in r.getMessage()]
    finally:
        await secrets_store.close()
        await store.close()
        with contextlib.suppress(Exception):
            await proxy.cut()


# --- Assigns pushed by the dispatch that placed them ------------------------------------------------------


async def _attempt_times(store: Store, tid: uuid.UUID) -> Any:
    async with store.pool.acquire() as c:
        return await c.fetchrow("SELECT assigned_at, delivered_at FROM attempts WHERE task_id = $1", tid)


@contextlib.asynccontextmanager
async def dispatching_here(store: Store) -> AsyncIterator[tuple[Gateway, Any]]:
    """A gateway and a scheduler wired as the server wires them: Assigns for the nodes whose streams
    the gateway holds are handed from the dispatch to the outbox. No sweep and no `due`: an Assign
    sent here came from the push, never from an outbox take."""
    sec = Security(store, SecretBox(os.urandom(32)))
    gw = Gateway(store, Applier(store, actor="gateway:test"), DEFAULT_TIMING, server_id="test", security=sec)
    sched = scheduler(store)
    sched.deliver_through(gw.sessions.keys, gw.outbox.push)
    yield gw, sched


async def _delivering(gw: Gateway) -> AsyncIterator[None]:
    loop = asyncio.create_task(gw.outbox.deliver_loop())
    try:
        yield
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


async def test_a_placement_on_a_node_held_here_is_delivered_by_its_own_transaction_and_pushed_without_a_take(
    store: Store,
) -> None:
    await add_node(store, "n1", labels={"at": "n1"})
    await add_node(store, "n2", labels={"at": "n2"})
    async with dispatching_here(store) as (gw, sched):
        s = Session("n1", 1)
        gw.sessions["n1"] = s  # n2's stream is held by another replica (or none)
        here = await submit(store, command=["echo", "here"], labels={"at": "n1"})
        away = await submit(store, command=["echo", "away"], labels={"at": "n2"})
        nudges = await store.listen("podium_node")
        try:
            out = await sched.dispatch_once()
            assert sorted((str(t), n) for t, n, _tok in out.assigned) == sorted([(str(here), "n1"), (str(away), "n2")])
            # marked delivered in the placement's transaction (now() is the transaction's start)
            t_here = await _attempt_times(store, here)
            assert t_here["delivered_at"] == t_here["assigned_at"]
            # the node held elsewhere goes the old way: undelivered, its holder woken
            assert (await _attempt_times(store, away))["delivered_at"] is None
            assert (await asyncio.wait_for(nudges.get(), 10)).payload == "n2"
            async for _ in _delivering(gw):
                got = await _eventually(lambda: _sent_async(s, "assign"), what="the pushed Assign")
        finally:
            await nudges.close()
    assert [(a.task_id, a.attempt, json.loads(a.spec_json)["command"]) for a in got] == [(str(here), 1, ["echo", "here"])]
    assert [r.task_id for r in await store.take_outbox(["n1"])] == []  # nothing left for a take to send twice


async def test_a_pushed_assign_that_needs_no_secret_is_on_its_stream_when_the_pass_returns(store: Store) -> None:
    # Queued on the stream by the push itself, with no turn of the delivery loop between (none runs
    # here); one whose secret must be read first waits for the loop, which reads it.
    await add_node(store, "n1")
    async with dispatching_here(store) as (gw, sched):
        s = Session("n1", 1)
        gw.sessions["n1"] = s
        plain = await submit(store, command=["echo", "plain"])
        await sched.dispatch_once()
        assert [a.task_id for a in sent(s, "assign")] == [str(plain)]
        await gw.outbox.security.set_secret("db", b"hunter2", "test")
        secret = await submit(store, command=["echo", "secret"], secrets=[{"name": "db", "env": "DB"}])
        await sched.dispatch_once()
        assert sent(s, "assign") == []
        async for _ in _delivering(gw):
            got = await _eventually(lambda: _sent_async(s, "assign"), what="the Assign with its secret")
    assert [(a.task_id, [(v.env, v.value) for v in a.secrets]) for a in got] == [(str(secret), [("DB", "hunter2")])]


async def test_a_pass_that_places_many_leaves_their_assigns_to_the_delivery_loop(store: Store) -> None:
    # Building them all in the push would hold the next pass; the loop builds them meanwhile
    await add_node(store, "n1", slots=PUSH_NOW_MAX + 1, cpu=100_000, memory=64 * 2**30)
    async with dispatching_here(store) as (gw, sched):
        s = Session("n1", 1)
        gw.sessions["n1"] = s
        tids = [await submit(store, command=["echo", str(i)]) for i in range(PUSH_NOW_MAX + 1)]
        out = await sched.dispatch_once()
        assert len(out.assigned) == PUSH_NOW_MAX + 1
        assert sent(s, "assign") == []
        got: list[Any] = []

        async def all_sent() -> bool:
            got.extend(sent(s, "assign"))
            return len(got) == len(tids)

        async for _ in _delivering(gw):
            await _eventually(all_sent, what="every Assign of the pass")
    assert sorted(a.task_id for a in got) == sorted(map(str, tids))


async def test_an_assign_whose_stream_ended_before_its_push_is_handed_back_to_whoever_holds_the_node(store: Store) -> None:
    await add_node(store, "n1")
    async with dispatching_here(store) as (gw, sched):
        s = Session("n1", 1)
        gw.sessions["n1"] = s

        def push_after_the_stream_ended(rows: list[Any]) -> None:
            del gw.sessions["n1"]  # the stream ended while the pass committed
            gw.outbox.push(rows)

        sched.deliver_through(gw.sessions.keys, push_after_the_stream_ended)
        tid = await submit(store)
        nudges = await store.listen("podium_node")
        try:
            out = await sched.dispatch_once()
            assert [t for t, _n, _tok in out.assigned] == [tid]
            assert (await _attempt_times(store, tid))["delivered_at"] is not None
            async for _ in _delivering(gw):
                assert (await asyncio.wait_for(nudges.get(), 10)).payload == "n1"
        finally:
            await nudges.close()
    assert sent(s, "assign") == []
    assert (await _attempt_times(store, tid))["delivered_at"] is None
    # the replica that holds the node now takes it from the outbox, as any Assign placed elsewhere
    assert [(r.kind, r.task_id) for r in await store.take_outbox(["n1"])] == [("assign", tid)]
    assert (await store.get_task(tid)).state == "assigned"


# --- Assigns sent while their pass commits -----------------------------------------------------------


@contextlib.asynccontextmanager
async def dispatching_before_commit(store: Store) -> AsyncIterator[tuple[Gateway, Any, Session]]:
    """As the server wires them: the dispatch offers its Assigns to the gateway before its COMMIT,
    and the gateway's report batcher runs. One node "n1", whose stream is the `Session`."""
    async with dispatching_here(store) as (gw, sched):
        sched.deliver_through(gw.sessions.keys, gw.outbox.push, gw)
        s = Session("n1", 1)
        gw.sessions["n1"] = s
        async with looping(gw.reports.loop()):
            yield gw, sched, s


def _provisioning(task_id: str, token: int) -> Any:
    from podium.proto.podium.v1 import agent_pb2 as pb

    return pb.TaskEvent(task_id=task_id, fencing_token=token, kind=pb.TaskEvent.Kind.PROVISIONING)


async def test_an_assign_that_needs_nothing_from_the_store_is_on_its_stream_before_its_pass_commits(store: Store) -> None:
    # (That the offer comes before the COMMIT, inside the pass's transaction, the next test but one
    # shows: an offer that raises leaves nothing of the pass committed.)
    await add_node(store, "n1")
    async with dispatching_before_commit(store) as (gw, sched, s):
        offer = gw.push_before_commit
        offers: list[tuple[int, bool]] = []  # (messages on the stream once offered, taken)

        def offered(rows: list[Any]) -> bool:
            taken = offer(rows)
            offers.append((s.out.qsize(), taken))
            return taken

        gw.push_before_commit = offered  # type: ignore[method-assign]
        tid = await submit(store)
        out = await sched.dispatch_once()
        assert out.pushed and [t for t, _n, _tok in out.assigned] == [tid]
        assert offers == [(1, True)], "the offer queued the Assign on its stream"
        assert [a.task_id for a in sent(s, "assign")] == [str(tid)], "sent once: not pushed again after the commit"

        # one whose secret must be read first is declined, and goes the old way: after the commit,
        # through the delivery loop (none runs here)
        await gw.outbox.security.set_secret("db", b"hunter2", "test")
        secret = await submit(store, command=["echo", "secret"], secrets=[{"name": "db", "env": "DB"}])
        out = await sched.dispatch_once()
        assert not out.pushed and [t for t, _n, _tok in out.assigned] == [secret]
        assert offers[1:] == [(0, False)] and sent(s, "assign") == []
        async for _ in _delivering(gw):
            got = await _eventually(lambda: _sent_async(s, "assign"), what="the Assign with its secret")
        assert [a.task_id for a in got] == [str(secret)]


async def test_a_report_of_an_assign_sent_before_its_commit_waits_until_the_commit_is_known(store: Store) -> None:
    await add_node(store, "n1")
    async with dispatching_before_commit(store) as (gw, _sched, s):
        tid = await submit(store)
        held, other = 4242, 4243  # neither is an attempt of the task: both are refused once decided
        gw.reports.hold([held])
        await gw.reports.enqueue(s, _provisioning(str(tid), held))
        await gw.reports.enqueue(s, _provisioning(str(tid), other))
        # (no turn of the loop between: the batcher has not taken the other one yet)
        assert [p.event.fencing_token for p in s.events] == [other], "the held one was queued for a decision"

        async def told_to_stop() -> set[int]:
            told.update(c.fencing_token for c in sent(s, "cancel") if c.reason == "stale attempt")
            return told

        told: set[int] = set()
        await _eventually(told_to_stop, what="the other attempt's Cancel")
        await asyncio.sleep(0.2)  # time for a wrong decision on the held one, which must not come
        assert await told_to_stop() == {other}
        gw.reports.release([held])
        await _eventually(lambda: _both(told_to_stop, {held, other}), what="the held attempt's Cancel")


async def _both(read: Any, want: set[int]) -> bool:
    return await read() == want


async def test_a_pass_that_fails_after_sending_its_assigns_commits_nothing_and_their_node_is_told_to_stop_them(
    store: Store,
) -> None:
    await add_node(store, "n1")
    async with dispatching_before_commit(store) as (gw, sched, s):
        offer = gw.push_before_commit
        tokens: list[int] = []

        def offered_then_failed(rows: list[Any]) -> bool:
            assert offer(rows)
            tokens.extend(r.fencing_token for r in rows)
            raise RuntimeError("the pass failed after its Assigns were sent")

        gw.push_before_commit = offered_then_failed  # type: ignore[method-assign]
        tid = await submit(store)
        with pytest.raises(RuntimeError, match="after its Assigns were sent"):
            await sched.dispatch_once()
        [assign] = sent(s, "assign")
        assert (assign.task_id, assign.fencing_token) == (str(tid), tokens[0])
        t = await store.get_task(tid)
        assert (t.state, t.node_id, t.fencing_token, t.attempts) == ("queued", None, None, 0)
        # the node accepts the Assign it was sent: the attempt does not exist, so nothing is recorded
        # and the node is told to stop it (it starts nothing before an Accepted, which never comes)
        await gw.reports.enqueue(s, _provisioning(str(tid), tokens[0]))

        async def told() -> list[Any]:
            return [m for m in sent(s, "cancel") if m.fencing_token == tokens[0]]

        [cancel] = await _eventually(told, what="the Cancel of the attempt that was never committed")
        assert cancel.reason == "stale attempt"
        assert sent(s, "accepted") == []
        assert (await store.get_task(tid)).state == "queued"


async def test_an_assign_sent_before_its_commit_on_a_stream_that_ended_meanwhile_is_handed_back(store: Store) -> None:
    # Sent on a stream that ended while the commit was on its way: it went nowhere, and the node's
    # next Hello may have been read before the commit. Handed back once committed, as one pushed
    # after the commit to a stream that had ended.
    await add_node(store, "n1")
    async with dispatching_before_commit(store) as (gw, sched, s):
        offer = gw.push_before_commit

        def offered_then_the_stream_ended(rows: list[Any]) -> bool:
            taken = offer(rows)
            del gw.sessions["n1"]
            return taken

        gw.push_before_commit = offered_then_the_stream_ended  # type: ignore[method-assign]
        tid = await submit(store)
        nudges = await store.listen("podium_node")
        try:
            out = await sched.dispatch_once()
            assert out.pushed and [t for t, _n, _tok in out.assigned] == [tid]
            async for _ in _delivering(gw):
                assert (await asyncio.wait_for(nudges.get(), 10)).payload == "n1"
        finally:
            await nudges.close()
    assert [a.task_id for a in sent(s, "assign")] == [str(tid)]  # on the stream that ended
    assert (await _attempt_times(store, tid))["delivered_at"] is None
    assert [(r.kind, r.task_id) for r in await store.take_outbox(["n1"])] == [("assign", tid)]
    assert (await store.get_task(tid)).state == "assigned"


# --- acceptances made by the pass that sent their Assigns ---------------------------------------------


def _answering(gw: Gateway, s: Session) -> list[int]:
    """The node on `s` answers each Assign sent before its pass's COMMIT with its `provisioning`, as
    an agent does, while that pass is still open: the tokens it answered."""
    offer = gw.push_before_commit
    answered: list[int] = []

    def offered(rows: list[Any]) -> bool:
        taken = offer(rows)
        for r in rows:
            answered.append(r.fencing_token)
            asyncio.get_running_loop().create_task(gw.reports.enqueue(s, _provisioning(str(r.task_id), r.fencing_token)))
        return taken

    gw.push_before_commit = offered  # type: ignore[method-assign]
    return answered


async def _unwritten_and_told_stale(store: Store, s: Session, tid: uuid.UUID, token: int) -> None:
    """The task is still queued with no attempt, and the node its Assign went to is told the attempt
    is stale once its report is decided, and never told to start it."""
    t = await store.get_task(tid)
    assert (t.state, t.node_id, t.fencing_token, t.attempts) == ("queued", None, None, 0)

    async def told() -> list[Any]:
        return [m for m in sent(s, "cancel") if m.fencing_token == token]

    [cancel] = await _eventually(told, what="the Cancel of the attempt that was never written")
    assert cancel.reason == "stale attempt"
    assert sent(s, "accepted") == []


async def _event_transactions(store: Store, tid: uuid.UUID) -> dict[str, int]:
    """The transaction that wrote each of the task's events, by the state it moved to."""
    async with store.pool.acquire() as c:
        rows = await c.fetch("SELECT to_state, xmin::text::bigint AS tx FROM task_events WHERE task_id = $1", tid)
    return {r["to_state"]: r["tx"] for r in rows}


async def test_an_acceptance_that_comes_while_its_pass_is_open_is_committed_with_the_assignment_then_answered(
    store: Store,
) -> None:
    await add_node(store, "n1")
    async with dispatching_here(store) as (gw, sched):
        # as the server wires them, but with no report batcher running: only the pass can make it
        sched.deliver_through(gw.sessions.keys, gw.outbox.push, gw)
        s = gw.sessions["n1"] = Session("n1", 1)
        answered = _answering(gw, s)
        accept = gw.accepted_before_write
        before_commit: list[int] = []  # messages on the node's stream when the pass took its acceptance

        async def taken(tokens: list[int]) -> Any:
            changes = await accept(tokens)
            before_commit.append(s.out.qsize())
            return changes

        gw.accepted_before_write = taken  # type: ignore[method-assign]
        tid = await submit(store)
        out = await sched.dispatch_once()
        assert [t for t, _n, _tok in out.assigned] == [tid] and out.accepted == answered
        assert before_commit == [1], "the Assign alone: no Accepted before the commit"
        t = await store.get_task(tid)
        assert (t.state, t.fencing_token) == ("provisioning", answered[0])
        tx = await _event_transactions(store, tid)
        assert tx["assigned"] == tx["provisioning"], "the assignment and its acceptance are one commit"
        [acc] = sent(s, "accepted")
        assert (acc.task_id, acc.fencing_token) == (str(tid), answered[0])
        assert gw.reports.backlog == 0 and not s.events, "nothing left for a group commit to decide"


async def test_an_acceptance_taken_by_a_pass_that_then_fails_is_refused_as_stale_and_never_accepted(store: Store) -> None:
    await add_node(store, "n1")
    async with dispatching_before_commit(store) as (gw, sched, s):
        answered = _answering(gw, s)
        made = store._claim_and_assign

        async def made_then_failed(*args: Any, **kwargs: Any) -> Any:
            out = await made(*args, **kwargs)
            assert out.accepted == answered, "made in the pass (by its write), not committed yet"
            raise RuntimeError("the pass failed after making the acceptance")

        store._claim_and_assign = made_then_failed  # type: ignore[method-assign]
        tid = await submit(store)
        with pytest.raises(RuntimeError, match="after making the acceptance"):
            await sched.dispatch_once()
        # the acceptance goes back to the group commits, which find no such attempt
        await _unwritten_and_told_stale(store, s, tid, answered[0])


async def test_a_pass_does_not_wait_for_acceptances_while_other_reports_wait_for_a_group_commit(store: Store) -> None:
    await add_node(store, "n1")
    async with dispatching_here(store) as (gw, sched):
        sched.deliver_through(gw.sessions.keys, gw.outbox.push, gw)
        s = gw.sessions["n1"] = Session("n1", 1)
        answered = _answering(gw, s)
        await gw.reports.enqueue(s, _provisioning(str(uuid.uuid4()), 4242))  # another attempt's report, queued
        tid = await submit(store)
        out = await sched.dispatch_once()
        assert [t for t, _n, _tok in out.assigned] == [tid] and out.accepted == []
        assert (await store.get_task(tid)).state == "assigned"
        # its acceptance waits for the next group commit, behind the other report, as before
        assert [p.event.fencing_token for p in s.events] == [4242, *answered]
        assert sent(s, "accepted") == []


# --- Assigns sent before their pass's write ---------------------------------------------------------


async def test_a_small_passs_assigns_go_out_before_its_write_with_the_tokens_the_write_then_gives(store: Store) -> None:
    await add_node(store, "n1")
    order: list[str] = []
    async with dispatching_before_commit(store) as (gw, sched, s):
        store.q = Statements(store.q, order)
        offer = gw.push_before_commit

        def offered(rows: list[Any]) -> bool:
            order.append("offer")
            return offer(rows)

        gw.push_before_commit = offered  # type: ignore[method-assign]
        tid = await submit(store)
        out = await sched.dispatch_once()
    assert out.pushed and [t for t, _n, _tok in out.assigned] == [tid]
    steps = [o for o in order if o in ("lock_nodes_drawing_tokens", "offer", "assign_tasks")]
    assert steps == ["lock_nodes_drawing_tokens", "offer", "assign_tasks"], order
    [assign] = sent(s, "assign")
    t = await store.get_task(tid)
    assert (assign.task_id, assign.fencing_token, assign.attempt) == (str(tid), t.fencing_token, 1)
    assert (t.state, t.node_id, t.attempts) == ("assigned", "n1", 1)
    assert json.loads(assign.spec_json)["command"] == ["true"]


async def test_an_assign_sent_before_a_write_that_lost_its_node_to_another_scheduler_is_refused_as_stale(
    store: Store, db_url: str
) -> None:
    await add_node(store, "n1", slots=1)
    async with dispatching_before_commit(store) as (gw, sched, s):
        answered = _answering(gw, s)
        tid = await submit(store)
        out = await filled_under_a_pass(store, db_url, ["n1"], sched.dispatch_once)
        assert out.lost_races == 1 and out.assigned == [] and out.accepted == []
        [assign] = sent(s, "assign")  # sent with the tokens drawn under the lock, before the write
        assert assign.fencing_token == answered[0]
        await _unwritten_and_told_stale(store, s, tid, answered[0])
    assert await store.take_outbox(["n1"]) == [], "nothing handed back for an attempt that does not exist"
