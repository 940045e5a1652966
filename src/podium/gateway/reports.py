"""Node reports, group-committed: the report batcher and its backlog, and the release proofs.

A stream's reader only queues a report here and goes on reading (so its heartbeats never wait behind
its reports). `ReportBatcher.loop` takes every queued report — round robin over the streams, each
task's in arrival order (its `running` and its end together, see `take_round_robin`) — reads those
tasks under their locks in one statement, lets the policy decide each, and applies them in the same
transaction (`Store.transition_decided`: one commit). A batch that ends attempts stores in that
transaction, first, every output chunk the log flusher holds: an attempt's output is committed with
its end, never after it.

A batch's acceptances (a task's lone `provisioning`: the node waits for its Accepted before it starts
the task) do not wait for that read: each is decided on what its row is expected to hold — the task
assigned to this node under this token — and made by one compare-and-set that checks exactly that
(`Store.transition_expected`: one round trip and its commit, beside the rest of the batch). So is a
task's lone `running` whose Assign this stream carried (the task provisioning on this node under
this token; its lease needs the task's timeout, which the stream kept from that Assign): a short
command's end, which waits for its `running` to be committed, is committed that much sooner. What a
row does not confirm is decided again on a read, as every other report is.

A batch that ends attempts, while the dispatcher says tasks wait for room (`Refiller.refill`), also
places queued tasks on the room its ends free, in its own transaction (`Store.transition_decided`'s
`refill`): a node's next task is assigned by the commit of its last one's end, and its Assign is
pushed once that commits, with the end's Ack.

An acceptance of an Assign sent before its dispatch's COMMIT (its reports are held until that commit
is known) may not come here at all: while the gateway has nothing else waiting for a group commit,
that dispatch waits a few milliseconds for it and makes it in its own transaction
(`acceptances_in_pass`), so that the assignment and its acceptance are one commit and the node's
`Accepted` follows it. Nothing changes for the node: it is told only once the commit is known.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

from podium import metrics, protocol
from podium.errors import StoreUnavailable
from podium.gateway.liveness import LogFlusher, LogRow
from podium.gateway.sessions import ACCEPTED, Pending, Session, Sessions, accepted
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.scheduler import policy
from podium.scheduler.apply import change, facts
from podium.scheduler.policy import TaskFacts
from podium.states import TaskState
from podium.store import Change, Store
from podium.store.db import Refill
from podium.store.rows import OutboxRow, TaskFactsRow
from podium.timing import Timing

log = logging.getLogger(__name__)

PERSIST_FOR = 30.0  # seconds a node's report is retried against an unavailable database
# Node reports applied in one transaction (one commit) at most. A group commit is six round trips
# whatever its size, each waiting its turn on a busy event loop: on a 1,000-node fleet a commit of
# 1,000 reports took ~215 ms and one of ~1,540 ~315 ms, and with batches capped at 1,000 the reports
# waited 2–3.5 s behind one another (the lifecycle benchmark). A commit holds its tasks' rows for as
# long (~0.3 s at this size, where an accept deadline is 15 s), their nodes' only while its ends are written.
EVENT_BATCH = 4000
EVENT_TRIES = 5  # a report whose task keeps moving between read and write is given up after this
SESSION_BACKLOG = 4096  # reports one stream may have waiting before its reader stops reading
# the most Assigns of one dispatch whose acceptances it waits for and makes itself (`acceptances_in_pass`)
ACCEPT_IN_PASS_MAX = 4
# A second group commit is begun beside the one being applied once this many reports wait behind it
# (`ReportBatcher.loop`). On 5,000 nodes placing a backlog, acceptances of ~1,500 a commit were what
# held placement back (its window of unaccepted Assigns filled), and one commit at a time left the
# database's second core idle for the commit's round trips; a burst of real agents, ~45 reports a
# commit, never begins one: two small commits cost more CPU than one of both, on a machine whose
# CPU is what bounds it (docs/benchmarks.md, thirty-eighth session).
SECOND_COMMIT_BACKLOG = 256
_KIND = {v: k for k, v in pb.TaskEvent.Kind.items()}


class Refiller(Protocol):
    """Who places queued tasks on the room a group commit of ends frees, in that commit (the
    dispatcher): `refill` gives the commit what to place with (None: nothing now), `refilled` is told
    once it has committed."""

    def refill(self) -> Refill | None: ...

    def refilled(self, refill: Refill) -> None: ...


@dataclasses.dataclass(slots=True)
class _Plan:
    """A batch's decisions: the changes to make, the reports each answers (aligned: one, or a `running`
    and the end made with it in one change), and what the nodes are told of the reports that change
    nothing (run once the batch is committed)."""

    changes: list[Change] = dataclasses.field(default_factory=list)
    planned: list[list[tuple[Session, Pending]]] = dataclasses.field(default_factory=list)
    answers: list[Callable[[], object]] = dataclasses.field(default_factory=list)


class ReportBatcher:
    def __init__(
        self, store: Store, sessions: Sessions, timing: Timing, *, logs: LogFlusher
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.timing = timing
        # "store an attempt's output no later than its end": what the log flusher holds is stored in
        # the transaction of a batch of ends
        self.logs = logs
        # sessions with reports waiting, in the order they are served (round robin)
        self._event_sessions: dict[Session, None] = {}
        self._events_ready = asyncio.Event()
        self.backlog = 0  # node reports received and not yet applied (admission reads it)
        self._lag = 0.0  # age of the oldest report in the last batch, when it was committed
        # Attempts whose Assign went out while the dispatch that wrote them was committing
        # (`Gateway.push_before_commit`), by fencing token: their reports wait here, in arrival order,
        # until that commit is known (`hold`).
        self._held: dict[int, list[tuple[Session, pb.TaskEvent]]] = {}
        # set when any report arrives while a dispatch waits for its acceptances (`acceptances_in_pass`);
        # the acceptances it took, by token, until its commit is known
        self._waiting: set[asyncio.Event] = set()
        self._taken: dict[int, tuple[Session, Pending]] = {}
        # The tasks of the group commits being applied (one, or two: `loop`). A task's later report
        # is not taken while one of its reports is being applied: two commits never hold one task,
        # and its reports are still made in the order they came.
        self._committing: set[uuid.UUID] = set()
        self._commits = 0  # group commits being applied
        self._second_due = asyncio.Event()  # set when a second commit may be begun
        # The dispatcher, when this server runs one: a batch that ends attempts places queued tasks
        # on the room it frees, in its own commit, and their Assigns go to `push` (the outbox) once
        # it has committed (`place_on_ends`).
        self.refiller: Refiller | None = None
        self.push: Callable[[list[OutboxRow]], None] = lambda rows: None

    def place_on_ends(self, refiller: Refiller, push: Callable[[list[OutboxRow]], None]) -> None:
        """From now on, a batch that ends attempts places queued tasks on the room it frees (what
        `refiller` gives it), and hands their Assigns to `push` once it has committed."""
        self.refiller = refiller
        self.push = push

    def drop(self, s: Session) -> None:
        """A stream ended: what it reported and was not applied yet goes with it (a reconnecting node
        reports its attempts again, and re-sends every end not acknowledged)."""
        self._backlog_add(-len(s.events))
        s.events.clear()
        self._event_sessions.pop(s, None)

    def behind(self) -> float:
        """Seconds the group commits are behind: how long the oldest report of the last batch had
        waited when it was committed, 0 while nothing waits. The dispatcher holds new placements
        while this is a large share of the accept deadline: every Assign it adds now would have its
        acceptance queued behind these (`scheduler.dispatch.HOLD_SHARE`)."""
        return self._lag if self.backlog > 0 else 0.0

    def _backlog_add(self, n: int) -> None:
        self.backlog += n
        metrics.NODE_REPORT_BACKLOG.inc(n)

    def hold(self, tokens: list[int]) -> None:
        """Hold the reports of these attempts until `release`, which queues them for the next group
        commit in the order they came. The dispatch that wrote the attempts releases them once its
        commit is known, committed or not: a `provisioning` decided before that would find no such
        attempt (a task stored by the same pass is not even visible), and be refused as a stale one,
        its node told to stop an assignment that is about to be real."""
        for t in tokens:
            self._held.setdefault(t, [])

    def release(self, tokens: list[int], *, accepted: Collection[int] = ()) -> None:
        """The commit of the dispatch that held these attempts' reports is known. An acceptance that
        dispatch took and made in its own transaction (`accepted`: committed) is answered now; one it
        did not make goes back ahead of its attempt's later reports, and all are queued in order."""
        made = 0
        for t in tokens:
            taken = self._taken.pop(t, None)
            if taken is not None:
                s, p = taken
                if t in accepted:
                    made += 1
                    metrics.NODE_REPORTS.labels("applied").inc()
                    self._answer(s, p, applied=True)
                else:
                    self._held.setdefault(t, []).insert(0, (s, p.event))
            for s, ev in self._held.pop(t, ()):
                if self.sessions.get(s.node_id) is s:  # a stream that ended takes its reports with it
                    self._queue(s, ev)
        if made:
            metrics.NODE_REPORT_BATCH.observe(made)  # their dispatch's commit was their group commit

    async def acceptances_in_pass(self, tokens: list[int], wait: float) -> list[Change]:
        """The acceptances of these held attempts (their Assigns went out before their dispatch's
        COMMIT), for that dispatch to make in its own transaction: an assignment and its acceptance
        in one commit, where the acceptance was otherwise a commit of its own after it, between the
        node and its start. Waited for up to `wait` seconds, and only while nothing else waits for
        a group commit (a busy gateway does not hold a dispatch's transaction open): those that came
        in time are taken from the held reports, each its attempt's first report and an acceptance.
        `release` answers them once the commit is known (Accepted only if it committed)."""
        if self.backlog or len(tokens) > ACCEPT_IN_PASS_MAX or any(t not in self._held for t in tokens):
            return []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        arrived = asyncio.Event()
        self._waiting.add(arrived)
        try:
            # until each has its first report, or another report waits for a group commit (the
            # gateway is busy: what came so far is taken, the rest decided after the commit)
            while not self.backlog and any(not self._held.get(t) for t in tokens) and (left := deadline - loop.time()) > 0:
                arrived.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await arrived.wait()
        finally:
            self._waiting.discard(arrived)
        changes = []
        for t in tokens:
            held = self._held.get(t)
            if not held or _KIND.get(held[0][1].kind) != protocol.PROVISIONING:
                continue
            s, ev = held[0]
            if self.sessions.get(s.node_id) is not s:
                continue
            p = self._pending(s, ev)
            if p is None:
                continue
            del held[0]
            self._taken[t] = (s, p)
            changes.append(self._expected_change(s, p))
        return changes

    async def enqueue(self, s: Session, ev: pb.TaskEvent) -> None:
        """Queue a report for the next group commit, and go on reading the stream (its heartbeats
        must not wait behind its reports). A node that reports faster than the store takes it is
        slowed by gRPC flow control: its reader waits while its backlog is full."""
        held = self._held.get(ev.fencing_token) if self._held else None
        if held is not None:
            held.append((s, ev))
            self._arrived()
            return
        while len(s.events) >= SESSION_BACKLOG:
            s.room.clear()
            await s.room.wait()
        self._queue(s, ev)

    def _pending(self, s: Session, ev: pb.TaskEvent) -> Pending | None:
        try:
            task_id = uuid.UUID(ev.task_id)
        except ValueError:
            log.warning("node %s sent an event for a malformed task id %r", s.node_id, ev.task_id)
            return None
        return Pending(ev, task_id, _KIND.get(ev.kind, ""), received=asyncio.get_running_loop().time())

    def _queue(self, s: Session, ev: pb.TaskEvent) -> None:
        p = self._pending(s, ev)
        if p is None:
            return
        s.events.append(p)
        self._backlog_add(1)
        self._event_sessions.setdefault(s, None)
        self._events_ready.set()
        if self._commits and self.backlog >= SECOND_COMMIT_BACKLOG:
            self._second_due.set()
        self._arrived()

    def _arrived(self) -> None:
        for e in self._waiting:
            e.set()

    async def loop(self) -> None:
        """Apply node reports in batches: every report that arrived while the last batch was being
        committed goes into the next one, so a busy fleet costs a commit per batch, not per report.
        Each report is still its own compare-and-set, decided from the row just read.

        A second batch is committed beside the first only while SECOND_COMMIT_BACKLOG reports wait
        behind it, on its own connections, with none of the first's tasks (`_committing`). Their rows
        are locked as every writer locks them (tasks in id order, then nodes in id order), and a
        batch of ends stores the output chunks held for it under the log flusher's lock, which the
        other batch's ends wait for: no output commits after the end it came before."""
        async with asyncio.TaskGroup() as commits:
            commits.create_task(self._commit_loop(second=False))
            commits.create_task(self._commit_loop(second=True))

    async def _commit_loop(self, *, second: bool) -> None:
        delay = 0.05
        down_since: float | None = None
        loop = asyncio.get_running_loop()
        ready = self._second_due if second else self._events_ready
        while True:
            await ready.wait()
            ready.clear()
            while (not second or (self._commits and self.backlog >= SECOND_COMMIT_BACKLOG)) and (batch := self._take_batch()):
                try:
                    with metrics.NODE_REPORT_BATCH_SECONDS.time():
                        await self._apply_committing(batch)
                    self._lag = loop.time() - min(p.received for _s, p in batch)
                    metrics.NODE_REPORT_LAG.set(self._lag)
                except StoreUnavailable as e:
                    self._put_back(batch)
                    now = loop.time()
                    down_since = now if down_since is None else down_since
                    if now - down_since > PERSIST_FOR:
                        # a node whose reports cannot be stored for this long reconnects and reports again
                        log.warning("node reports not stored for %.0fs (%s); closing the streams that sent them", now - down_since, e)
                        for sess in list(self._event_sessions):
                            sess.close()
                        down_since = None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # A bug, or a write the database refused for good: it must not take the other
                    # nodes' reports (or the server) with it. The streams that sent this batch are
                    # closed; on reconnect their nodes report their attempts again, as after any loss.
                    log.exception("applying %d node reports failed; closing the streams that sent them", len(batch))
                    for sess in {s for s, _p in batch}:
                        sess.close()
                    continue
                delay, down_since = 0.05, None

    async def _apply_committing(self, batch: list[tuple[Session, Pending]]) -> None:
        """Apply `batch`, its tasks held out of any other batch until it is done, however it ends."""
        tasks = {p.task_id for _s, p in batch}
        self._committing |= tasks
        self._commits += 1
        try:
            await self._apply_batch(batch)
        finally:
            self._committing -= tasks
            self._commits -= 1
            self._events_ready.set()  # reports of its tasks left behind may be taken now

    def _take_batch(self) -> list[tuple[Session, Pending]]:
        """Up to EVENT_BATCH reports, round robin over the streams (see `take_round_robin`), none of
        a task in a batch being applied."""
        batch, served = take_round_robin(list(self._event_sessions), EVENT_BATCH, self._committing)
        self._backlog_add(-len(batch))
        for s in served:
            self._requeue_session(s)
        return batch

    def _requeue_session(self, s: Session) -> None:
        """Move a stream to the back of the service order (or out of it when it has nothing left)."""
        self._event_sessions.pop(s, None)
        if len(s.events) < SESSION_BACKLOG:
            s.room.set()
        if s.events and self.sessions.get(s.node_id) is s:
            self._event_sessions[s] = None

    def _put_back(self, items: list[tuple[Session, Pending]]) -> None:
        """Reports that must be tried again go back to the front of their stream's queue, in order."""
        for s, p in reversed(items):
            if self.sessions.get(s.node_id) is s:
                s.events.appendleft(p)
                self._backlog_add(1)
                self._event_sessions.setdefault(s, None)
        if items:
            self._events_ready.set()

    async def _apply_batch(self, batch: list[tuple[Session, Pending]]) -> None:
        expected, rest = _acceptances(batch)
        if not any(p.final for _s, p in rest):
            await self._apply_both(expected, rest, [])
            return
        # An attempt's output arrived before its end on the same stream: it is committed with the end
        # (every chunk received so far, in the same transaction), so whoever follows the logs of an
        # ended task has all of them, and the node, told its end is recorded, forgets no output that
        # is not. One commit, where a flush of its own before the batch was another.
        async with self.logs.taken() as chunks:
            if not expected and (end := self._expected_end(rest)) is not None:
                await self._end_expected(rest, end, chunks)
            else:
                await self._apply_both(expected, rest, chunks)

    def _expected_end(self, batch: list[tuple[Session, Pending]]) -> Change | None:
        """The change of a batch that is one task's success and nothing else — its end with exit code
        0 and no failure class, alone or after the lone `running` whose Assign this stream carried (a
        command run one at a time on an idle fleet) — decided on what its row is expected to hold: the
        task running on this node under this token (provisioning, passing through `running`, with its
        `running`). None for anything else, and while the dispatcher would place a queued task on the
        room it frees (`Refill`: a commit of its own). A row holding anything else (a cancel asked
        meanwhile) refuses it, and the batch is decided on a read."""
        if len({p.task_id for _s, p in batch}) != 1 or any(p.tries for _s, p in batch):
            return None
        s, end = batch[-1]
        ev = end.event
        if end.kind != protocol.EXITED or ev.exit_code != 0 or ev.failure_class or any(t is not s for t, _p in batch):
            return None
        if self.refiller is not None and self.refiller.refill() is not None:
            return None
        step = policy.on_node_event(TaskFacts(state=TaskState.RUNNING), end.kind, 0, self.timing,
                                    failure_class=ev.failure_class, message=ev.message)  # fmt: skip
        if step is None or step.to != TaskState.SUCCEEDED:
            return None
        c = change(end.task_id, TaskState.RUNNING, step, actor=f"node:{s.node_id}", fencing_token=ev.fencing_token,
                   node_id=s.node_id, backend_ref=ev.backend_ref)  # fmt: skip
        if len(batch) == 1:
            return c
        if len(batch) != 2:
            return None
        _s, first = batch[0]
        if first.kind != protocol.RUNNING or first.event.fencing_token != ev.fencing_token or ev.fencing_token not in s.timeouts:
            return None
        return _through_running(self._expected_change(s, first), c)

    async def _end_expected(self, batch: list[tuple[Session, Pending]], end: Change, logs: list[LogRow]) -> None:
        """The batch's one end made as expected (`_expected_end`), with the output chunks received so
        far, in one statement committed on its own (`Store.end_expected`); decided on a read in the
        next batch if its row refused it."""
        made = await self.store.end_expected(end, logs=logs)
        metrics.NODE_REPORT_BATCH.observe(len(batch))
        if made is None:
            for _s, p in batch:
                p.tries += 1  # not as expected: read next time
            self._put_back(batch)
            return
        metrics.NODE_REPORTS.labels("applied").inc(len(batch))
        for s, p in batch:
            self._answer(s, p, applied=True)

    async def _apply_both(
        self, expected: list[tuple[Session, Pending]], rest: list[tuple[Session, Pending]], logs: list[LogRow]
    ) -> None:
        if not expected:
            await self._apply_read(rest, logs)
            return
        # on two connections at once: the acceptances are other tasks' rows than the rest's
        accepted, read = await asyncio.gather(self._accept_expected(expected), self._apply_read(rest, logs), return_exceptions=True)
        for failed in (accepted, read):
            if isinstance(failed, BaseException):
                # Both have ended: the caller puts the whole batch back. What either made is refused
                # when it comes back, and decided again on its row: an acceptance already recorded is
                # accepted again, an end already recorded acknowledged.
                raise failed
        assert isinstance(accepted, list)
        self._put_back(accepted)  # what its row did not confirm: read in the next batch

    async def _accept_expected(self, batch: list[tuple[Session, Pending]]) -> list[tuple[Session, Pending]]:
        """Acceptances and `running`s decided on the row each expects (its task assigned to this node
        under this token, or provisioning there), made without reading it. Returns those their rows
        refused, to be decided on a read."""
        results = await self.store.transition_expected([self._expected_change(s, p) for s, p in batch])
        metrics.NODE_REPORT_BATCH.observe(len(batch))
        refused: list[tuple[Session, Pending]] = []
        for (s, p), done in zip(batch, results, strict=True):
            if done is None:
                p.tries += 1  # not as expected: read next time
                refused.append((s, p))
                continue
            metrics.NODE_REPORTS.labels("applied").inc()
            self._answer(s, p, applied=True)
        return refused

    def _expected_change(self, s: Session, p: Pending) -> Change:
        """The change a lone acceptance, or a lone `running` whose Assign this stream carried, makes on
        the row it expects: its task assigned to this node under this token, or provisioning there."""
        if p.kind == protocol.PROVISIONING:
            expected = TaskFacts(state=TaskState.ASSIGNED)
        else:  # a `running` whose Assign this stream carried (`_acceptances`)
            expected = TaskFacts(state=TaskState.PROVISIONING, timeout=s.timeouts[p.event.fencing_token])
        step = policy.on_node_event(expected, p.kind, None, self.timing)
        assert step is not None, f"the policy accepts a {p.kind} of a {expected.state} task"
        return change(p.task_id, expected.state, step, actor=f"node:{s.node_id}", fencing_token=p.event.fencing_token,
                      node_id=s.node_id, backend_ref=p.event.backend_ref)  # fmt: skip

    async def _apply_read(self, batch: list[tuple[Session, Pending]], logs: list[LogRow]) -> None:
        """Reports decided on their tasks as read under their locks, and made in the same transaction
        (with `logs`, the output chunks to store in it first)."""
        if not batch:
            return
        plan: _Plan | None = None

        def decide(rows: Mapping[uuid.UUID, TaskFactsRow]) -> list[Change]:
            nonlocal plan
            plan = self._decide(batch, rows)
            return plan.changes

        # read under the locks the changes are written under: the tasks in one statement, then one per
        # layer. The nodes of the ends are locked just before the first layer that holds an end, not
        # with the read (`ending`): a dispatch pass takes the nodes' locks too, and on a 1,000-node
        # fleet waited 18–137 ms a pass for a group commit holding them through its read and decisions
        # (the lifecycle benchmark, four pairs: +4 to +34 % with them taken late, for one round trip more)
        refiller = self.refiller
        refill = refiller.refill() if refiller is not None and any(p.final for _s, p in batch) else None
        _changes, results = await self.store.transition_decided(
            list({p.task_id: None for _s, p in batch}), decide, logs=logs, refill=refill
        )
        assert plan is not None
        if refill is not None and refill.outcome is not None:
            assert refiller is not None
            # the next tasks' Assigns first: their nodes wait for them, and for nothing else here
            if refill.outcome.delivered:
                self.push(refill.outcome.delivered)
            refiller.refilled(refill)
        metrics.NODE_REPORT_BATCH.observe(len(batch))
        for answer in plan.answers:  # what the node hears of the reports that changed nothing
            answer()
        again: list[tuple[Session, Pending]] = []
        refused: set[uuid.UUID] = set()  # tasks whose change in this batch was not made
        for reports, done in zip(plan.planned, results, strict=True):
            if done is not None:
                metrics.NODE_REPORTS.labels("applied").inc(len(reports))
                for s, p in reports:
                    self._answer(s, p, applied=True)
                continue
            s, p = reports[0]
            if p.task_id in refused:
                again.extend(reports)  # not tried: its task's earlier report was refused; decided anew
                continue
            refused.add(p.task_id)
            # refused by what the change checks itself: decide again on a fresh read (each report on its own)
            p.tries += 1
            if p.tries < EVENT_TRIES:
                again.extend(reports)
            else:
                for s, p in reports:
                    log.warning("node %s: %s for task %s kept losing races; dropped", s.node_id, p.kind, p.task_id)
                    metrics.NODE_REPORTS.labels("dropped").inc()
                    self._answer(s, p, applied=False)
        self._put_back(again)

    def _decide(self, batch: list[tuple[Session, Pending]], rows: Mapping[uuid.UUID, TaskFactsRow]) -> _Plan:
        """What the batch's reports mean, decided on the tasks as read under their locks: the changes
        to make (with the reports they answer) and what to tell the nodes of the others once the
        batch is committed. Only computes: it runs again when the transaction is retried."""
        plan = _Plan()
        # a task's facts as its reports earlier in this batch will have left them (its `running` and
        # its end, read together, are decided one after the other and made in one commit), and the
        # index of its last change in the plan
        ahead: dict[uuid.UUID, TaskFacts] = {}
        last: dict[uuid.UUID, int] = {}
        for s, p in batch:
            ev = p.event
            row = rows.get(p.task_id)
            if row is None or row.fencing_token != ev.fencing_token or row.node_id != s.node_id:
                if not (row is not None and p.final and row.fencing_token == ev.fencing_token):
                    # a stale or foreign attempt: refuse it, and make sure the node stops it
                    plan.answers.append(functools.partial(self._reject, s, p, row))
                else:
                    plan.answers.append(functools.partial(metrics.NODE_REPORTS.labels("settled").inc))
                # (an end already recorded, sent again after a reconnect, is only acknowledged)
                plan.answers.append(functools.partial(self._answer, s, p, applied=False))
                continue
            f = ahead.get(p.task_id) or facts(row)
            step = policy.on_node_event(
                f, p.kind, ev.exit_code if p.kind == protocol.EXITED else None, self.timing,
                failure_class=ev.failure_class, message=ev.message,
            )  # fmt: skip
            if step is None:
                if p.kind == protocol.PROVISIONING and f.state in ACCEPTED:
                    plan.answers.append(functools.partial(accepted, s, ev.task_id, ev.fencing_token))  # a repeat: it was recorded
                plan.answers.append(functools.partial(metrics.NODE_REPORTS.labels("settled").inc))
                plan.answers.append(functools.partial(self._answer, s, p, applied=False))
                continue
            c = change(
                p.task_id, f.state, step, actor=f"node:{s.node_id}", fencing_token=ev.fencing_token, node_id=s.node_id,
                backend_ref=ev.backend_ref,
            )  # fmt: skip
            i = last.get(p.task_id)
            if i is not None and (merged := _through_running(plan.changes[i], c)) is not None:
                # its `running` and this end in one change: the task row written once, one statement
                plan.changes[i] = merged
                plan.planned[i].append((s, p))
            else:
                last[p.task_id] = len(plan.changes)
                plan.changes.append(c)
                plan.planned.append([(s, p)])
            ahead[p.task_id] = dataclasses.replace(f, state=step.to)
        return plan

    def _reject(self, s: Session, p: Pending, row: TaskFactsRow | None) -> None:
        metrics.NODE_REPORTS.labels("rejected").inc()
        ev = p.event
        log.warning(
            "node %s: rejected %s for task %s with fencing token %d (the task is %s, token %s, on node %s)",
            s.node_id, p.kind, ev.task_id, ev.fencing_token, None if row is None else row.state,
            None if row is None else row.fencing_token, None if row is None else row.node_id,
        )  # fmt: skip
        if not p.final:
            s.send(pb.ServerMessage(cancel=pb.Cancel(task_id=ev.task_id, fencing_token=ev.fencing_token, reason="stale attempt")))

    def _answer(self, s: Session, p: Pending, *, applied: bool) -> None:
        """What the node hears once its report is settled: Accepted when its provisioning was just
        recorded (it may start the attempt), and an Ack for every end (it may forget it)."""
        if applied and p.kind == protocol.PROVISIONING:
            accepted(s, p.event.task_id, p.event.fencing_token)
        if p.kind == protocol.RUNNING or p.final:
            s.timeouts.pop(p.event.fencing_token, None)  # its `running` is settled: never decided on it again
        if p.final:
            s.send(pb.ServerMessage(ack=pb.Ack(task_id=p.event.task_id, fencing_token=p.event.fencing_token)))


def _acceptances(batch: list[tuple[Session, Pending]]) -> tuple[list[tuple[Session, Pending]], list[tuple[Session, Pending]]]:
    """The batch's acceptances, and `running`s whose Assign the stream carried, to make as expected
    (a task's only report in the batch, its first try), and the rest. A task with several reports
    here, or one its row already refused once, is read: what follows depends on what it holds."""
    per_task: dict[uuid.UUID, int] = {}
    for _s, p in batch:
        per_task[p.task_id] = per_task.get(p.task_id, 0) + 1
    expected: list[tuple[Session, Pending]] = []
    rest: list[tuple[Session, Pending]] = []
    for s, p in batch:
        lone = per_task[p.task_id] == 1 and p.tries == 0 and (
            p.kind == protocol.PROVISIONING or (p.kind == protocol.RUNNING and p.event.fencing_token in s.timeouts)
        )
        (expected if lone else rest).append((s, p))
    return expected, rest


def _through_running(first: Change, then: Change) -> Change | None:
    """One change for a task's `running` and the end that follows it in the same batch (a command
    that ended before its start was committed), or None if `first` is not such a plain `running`."""
    if not (
        first.to == TaskState.RUNNING and first.via is None and first.end_attempt is None and not first.stop
        and first.reason is None and first.failure_class is None and first.detail is None
        and then.from_ == TaskState.RUNNING and then.end_attempt is not None and then.revision is None
        and then.fencing_token == first.fencing_token and then.node_id == first.node_id
    ):  # fmt: skip
        return None
    return dataclasses.replace(then, from_=first.from_, via=TaskState.RUNNING, backend_ref=then.backend_ref or first.backend_ref)


def take_round_robin(
    sessions: list[Session], limit: int, committing: Collection[uuid.UUID] = ()
) -> tuple[list[tuple[Session, Pending]], list[Session]]:
    """Take up to `limit` reports from the streams' queues for one group commit: a round takes one
    report from each stream in turn, so no stream waits behind another's backlog.

    A task's reports keep their order. Several of one task go in one batch when its stream sent them
    one after the other for the same attempt and none but the last is an end (a short command's
    `running` and its end: they are made in order in one commit, instead of the end waiting a whole
    group commit behind its `running`). Anything else of a task already in the batch — another
    stream's report, another attempt's, one after an end — waits for the next batch, and so do that
    task's later reports; so does every report of a task in `committing` (a batch being applied).
    Reports of *other* tasks do not wait behind one that must: a node given fourteen tasks at once
    reports PROVISIONING, RUNNING, PROVISIONING, RUNNING, … and every PROVISIONING goes in the first
    batch. Taking a stream's queue strictly in order instead stopped it at its first RUNNING, so its
    last acceptance waited a batch per task it was given and, on a busy server, past its 15 s accept
    deadline. Only a task's own order matters: each report is a compare-and-set on its own task.

    Returns the batch and the streams it took from (in the order served); the taken reports are
    removed from their queues, the rest stay in arrival order."""
    batch: list[tuple[Session, Pending]] = []
    # per task in the batch: the stream and the last report taken of it
    last: dict[uuid.UUID, tuple[Session, Pending]] = {}
    # per stream: where its scan is, and the tasks whose next report stays behind (not taken)
    at: dict[Session, int] = {}
    held: dict[Session, set[uuid.UUID]] = {}
    taken: dict[Session, list[int]] = {}
    active = [s for s in sessions if s.events]
    while active and len(batch) < limit:
        again = []
        for s in active:
            if len(batch) >= limit:
                break
            events, i, wait = s.events, at.get(s, 0), held.setdefault(s, set())
            while i < len(events):
                p = events[i]
                i += 1
                before = last.get(p.task_id)
                if p.task_id in wait or p.task_id in committing or (before is not None and not _follows(before, s, p)):
                    wait.add(p.task_id)  # it stays, and its task's later reports stay behind it
                    continue
                last[p.task_id] = (s, p)
                batch.append((s, p))
                taken.setdefault(s, []).append(i - 1)
                again.append(s)
                break
            at[s] = i
        active = again
    for s, idx in taken.items():
        if len(idx) == 1 and idx[0] == 0:
            s.events.popleft()
        else:
            gone = set(idx)
            kept = [p for j, p in enumerate(s.events) if j not in gone]
            s.events.clear()
            s.events.extend(kept)
    return batch, list(taken)


def _follows(before: tuple[Session, Pending], s: Session, p: Pending) -> bool:
    """May `p` go in the same batch right after its task's report `before`?"""
    bs, bp = before
    return bs is s and not bp.final and bp.event.fencing_token == p.event.fencing_token


class ReleaseProofs:
    def __init__(self, store: Store) -> None:
        self.store = store
        # release proofs received and not yet recorded: (task, token, node, backend ref, released at)
        self._proofs: list[tuple[uuid.UUID, int, str, str, float]] = []
        self._proofs_ready = asyncio.Event()

    async def loop(self) -> None:
        """Record nodes' release proofs: every proof received since the last pass in one statement.
        A proof is a compare-and-set on its attempt (task, token, node), so recording one twice, or
        after the node-loss policy released the attempt, changes nothing."""
        delay = 0.05
        while True:
            await self._proofs_ready.wait()
            self._proofs_ready.clear()
            pending, self._proofs = self._proofs, []
            if not pending:
                continue
            try:
                accepted = await self.store.release_proofs(pending)
            except StoreUnavailable as e:
                log.warning("%d release proofs not recorded yet: %s", len(pending), e)
                self._proofs = pending + self._proofs
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                self._proofs_ready.set()
                continue
            delay = 0.05
            metrics.RELEASE_PROOFS.labels("accepted").inc(len(accepted))
            metrics.RELEASE_PROOFS.labels("refused").inc(len(pending) - len(accepted))
            taken = {(t, tok) for t, tok, _freed in accepted}
            for tid, tok, node_id, _ref, _at in pending:
                if (tid, tok) not in taken:
                    log.info("node %s: release proof for task %s token %d refused (not its attempt, or already released)",
                             node_id, tid, tok)  # fmt: skip

    def add(self, s: Session, proof: pb.ReleaseProof) -> None:
        try:
            tid = uuid.UUID(proof.task_id)
        except ValueError:
            log.warning("node %s sent a release proof for a malformed task id %r", s.node_id, proof.task_id)
            return
        # the node's clock is only recorded, never compared; a value that is no time at all is dropped
        at = proof.released_at if math.isfinite(proof.released_at) and 0 <= proof.released_at < 1e11 else 0.0
        self._proofs.append((tid, proof.fencing_token, s.node_id, proof.backend_ref, at))
        self._proofs_ready.set()
