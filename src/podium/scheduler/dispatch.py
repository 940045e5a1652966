"""The dispatch loop: claims queued tasks and places them, woken by its own tick or by the database
saying something placement cares about changed (a task queued, room freed, a node joined:
NOTIFY podium_dispatch).

It keeps what placement knows of the connected nodes between ticks (folding in only the rows changed
since its last read, and of a node whose reservations alone changed only those), lets the pure
`Placer` choose, and hands the choices to `Store.dispatch`, which makes them durable in one
transaction — each a compare-and-set on the queued task and a conditional reservation on its node.
It never transitions a task from what it remembers: the snapshots only choose, the store decides
whether the choice still holds.

A submission that reaches this server while its dispatcher is idle is handed to it
(`take_submission`): the pass it wakes stores the new tasks and places them in one transaction, one
commit fewer on a task's way to its node than a submission stored on its own and a pass woken by its
NOTIFY. A busy dispatcher takes none (its handler stores them, as before): in a burst, its passes are
what must not grow.

A pass claims (locks, decodes, asks the placer about) only as many queued tasks as the free room
could take, in claim order, and more only while the ones claimed could not use the room there is: a
burst of a thousand tasks on a full fleet no longer locks the backlog's head at every freed slot.
The room is counted in slots and provisioning operations, and in CPU and memory for tasks the size
of the smallest claimed since the last look at the whole window: on nodes whose CPU binds before
their slots (100m a task, slots set high) a count in slots alone made every pass claim the whole
window for the one task a freed slot let in. A task smaller than every one claimed since may then
wait for that look, a tick at most. The tasks behind the claimed ones keep the reason they were last
given; once per tick a pass looks at the whole window (`claim_limit`) as before, so every queued task
in it, a new one too, is told its true reason within a tick. A pass on a fleet with room claims up to
`place_limit` (twice the window): on a large fleet with a backlog, passes come back to back, and each
costs its round trips whatever its size.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from podium import metrics
from podium.errors import StoreUnavailable
from podium.placement import Derived, NodeSnapshot, Placer, Requirements, Resources, Unplaceable, placeable_at_most
from podium.scheduler.woken import WokenLoop
from podium.store import ROOM_FREED, Change, Store
from podium.store.db import DispatchOutcome, PlacementDecision, Refill, Submissions
from podium.store.rows import ClaimedTaskRow, NodeRoomRow, NodeRow, OutboxRow, TaskRow
from podium.timing import Timing

log = logging.getLogger(__name__)

WINDOW_POLL = 0.02  # seconds between looks at a full assignment window
# After a pass that leaves the fleet no room, the next starts no sooner than this: it can place only
# what ends free meanwhile, and each group commit of ends wakes it. Woken at once by each, a burst's
# passes placed ~16 tasks each on 64 slots (190 passes for 3,000 tasks), each paying a pass's fixed
# cost again (its facts, claim, node locks, commit; an Assign write to each node); settled, they place
# the ends of several group commits at once. A fleet with room is never held: a task submitted to it
# is placed at once.
SETTLE_WHEN_FULL = 0.01
# Requirements kept between passes, keyed by everything they are made of (the spec's text among it,
# so a changed spec is simply another key); dropped all at once past this many.
REQUIREMENTS_KEPT = 8192
FULL_NODE_READ_EVERY = 60.0  # seconds between reads of every node row (in between: changed rows only)
# New placements wait while this server's gateway is behind by more than this share of the accept
# deadline: on its node reports, or on its writes to the streams. The assignment window bounds how
# many Assigns wait for their acceptance, not how long: on an overloaded server a full window of them
# queued behind thousands of reports, or behind the writes of 5,000 streams, and some acceptances
# were recorded after their deadline — their tasks placed again for nothing. Holding placements while
# the gateway catches up costs no throughput (the acceptances are the bottleneck then).
HOLD_SHARE = 0.2


def node_snapshot(row: NodeRow) -> NodeSnapshot:
    in_use = set(row.gpus_in_use or ())
    return NodeSnapshot(
        id=row.id,
        name=row.name,
        connected=row.connected,
        health=row.health,
        draining=row.draining,
        pool=row.pool,
        arch=row.arch,
        labels=row.labels,
        capabilities=frozenset(row.capabilities),
        backends=frozenset(row.backends),
        protocol_min=row.protocol_min,
        protocol_max=row.protocol_max,
        allocatable=Resources(
            row.alloc_cpu_millis, row.alloc_memory_bytes, row.alloc_disk_bytes, row.alloc_gpus, row.alloc_slots
        ),
        reserved=Resources(
            row.res_cpu_millis, row.res_memory_bytes, row.res_disk_bytes, row.res_gpus, row.res_slots
        ),
        artifacts=frozenset(row.artifacts),
        gpu_free=tuple(g for g in sorted(row.gpu_indexes) if g not in in_use),
        egress_contexts=frozenset(row.egress_contexts),
        max_operations=row.max_operations,
    )


def with_room(snap: NodeSnapshot, room: NodeRoomRow, gpu_indexes: tuple[int, ...], operations: int) -> NodeSnapshot:
    """The snapshot with the node's reservations as read now (and the GPUs free of its `gpu_indexes`)
    and its provisioning operations as counted now, everything else as it was: nothing else of the
    node changed since it was read whole."""
    reserved = Resources(room.room_cpu_millis, room.room_memory_bytes, room.room_disk_bytes, room.room_gpus, room.room_slots)
    gpu_free = tuple(g for g in gpu_indexes if g not in room.gpus_in_use) if gpu_indexes else ()
    if reserved == snap.reserved and gpu_free == snap.gpu_free and operations == snap.operations:
        return snap
    return snap.using(reserved, gpu_free, operations)


def with_operations(snaps: dict[str, NodeSnapshot], operations: dict[str, int]) -> dict[str, NodeSnapshot]:
    """The snapshots with each node's provisioning operations as counted now. A node row does not
    change when an attempt starts running, so the count is read every tick rather than kept."""
    out = snaps
    for nid, snap in snaps.items():
        now = operations.get(nid, 0)
        if snap.operations != now:
            if out is snaps:
                out = dict(snaps)
            out[nid] = snap.using(snap.reserved, snap.gpu_free, now)
    return out


def requirements(
    spec: dict[str, Any], cpu: int, memory: int, disk: int, gpus: int, avoid: list[str] | None = None,
    image_digest: str | None = None,
) -> Requirements:
    # A node already holding the digest the task's image was pinned to comes first (locality).
    preferred = tuple(spec.get("preferred_artifacts") or ())
    if image_digest and image_digest not in preferred:
        preferred = (image_digest, *preferred)
    return Requirements(
        resources=Resources(cpu, memory, disk, gpus, 1),
        labels=spec.get("labels") or {},
        pool=spec.get("pool"),
        arch=spec.get("arch"),
        capabilities=frozenset(spec.get("capabilities") or ()),
        backend=spec.get("backend", "process"),
        protocol=spec.get("protocol", 1),
        preferred_artifacts=preferred,
        home_node=spec.get("home_node"),
        avoid_nodes=frozenset(avoid or ()),
        egress=spec.get("egress"),
    )


class _Placing(abc.ABC):
    """What a dispatch pass and a refill share (`Store`'s `DispatchPlan` and `RefillPlan` but for
    `begin`): a placer over some of the nodes as they are now, a bound on how many tasks it could
    still place, how many to claim, and whether the claim drained the queue."""

    def __init__(self, dispatcher: Dispatcher, *, whole_window: bool) -> None:
        self.dispatcher = dispatcher
        self.whole_window = whole_window
        self._placer: Placer | None = None
        self.room = 0  # at most this many more placements are possible in this pass
        self._asked = 0  # what the last `want` asked for
        self.drained = False  # a claim found fewer queued tasks than it asked for: none is left behind them

    @property
    @abc.abstractmethod
    def snaps(self) -> dict[str, NodeSnapshot]:
        """The nodes this placing sees, by id."""

    @property
    @abc.abstractmethod
    def placer(self) -> Placer:
        """The placer over `snaps`, built once."""

    def want(self, claimed: int, limit: int) -> int:
        asked = 0  # no task could be placed: the claimed ones, if any, already have their reason
        if self.room > 0:
            # First exactly what the room could take. If tasks the free nodes cannot run (another
            # pool, labels, GPUs) held part of it, claim on, at least as many as so far each time, so
            # that a long run of them costs a few round trips and the tasks behind them are reached.
            # `limit` is the store's bound for the pass (`Timing.place_limit`, less if the assignment
            # window is nearly full).
            asked = min(limit - claimed, max(self.room, claimed))
        if self.whole_window:
            # the window's head (`Timing.claim_limit`), whatever the room: each told its true reason
            asked = max(asked, min(limit, self.dispatcher.timing.claim_limit) - claimed)
        self._asked = asked
        return asked

    def leaves(self, t: ClaimedTaskRow) -> bool:
        """Whether this claimed task is left queued without being placed (its reason as it was)."""
        return False

    def place(self, tasks: list[ClaimedTaskRow]) -> tuple[list[PlacementDecision], dict[uuid.UUID, str]]:
        """Pure once the rows are read: the Placer sees the nodes (`snaps`) and reserves as it goes."""
        if len(tasks) < self._asked:
            self.drained = True
        placed, unplaced = self._placed(tasks)
        self.room -= len(placed)
        return placed, unplaced

    def _placed(self, tasks: list[ClaimedTaskRow]) -> tuple[list[PlacementDecision], dict[uuid.UUID, str]]:
        placed: list[PlacementDecision] = []
        unplaced: dict[uuid.UUID, str] = {}
        if not tasks:
            return placed, unplaced  # a claim that found nothing queued: no placer to build for it
        placer = self.placer
        snaps = self.snaps
        d = self.dispatcher
        for t in tasks:
            if self.leaves(t):
                unplaced[t.id] = t.reason or ""
                continue
            req = d.requirements_of(t)
            d._smaller(req.resources)
            result = placer.place(req)
            if isinstance(result, Unplaceable):
                unplaced[t.id] = result.reason
            else:
                placed.append(
                    PlacementDecision(
                        t.id, result.node_id, t.cpu_millis, t.memory_bytes, t.disk_bytes, t.gpus, result.gpu_indexes,
                        snaps[result.node_id].capability_snapshot(),
                    )
                )
        return placed, unplaced


class DispatchPass(_Placing):
    """One pass's side of `Store.dispatch`: every connected node (kept between ticks, with the rows
    changed since the last read folded in), and whether this pass looks at the whole window (for
    reasons) or only at what the free room could take."""

    def __init__(self, dispatcher: Dispatcher, *, whole_window: bool) -> None:
        super().__init__(dispatcher, whole_window=whole_window)
        # what `foresee` made of the pass's new tasks (their ids in claim order, their placements and
        # the reasons of those it could not place), for the first `place` to give again
        self._foreseen: tuple[list[uuid.UUID], list[PlacementDecision], dict[uuid.UUID, str]] | None = None

    def begin(self, changed: list[NodeRow], room: list[NodeRoomRow], horizon: int, operations: dict[str, int]) -> None:
        d = self.dispatcher
        # a retried transaction (`Store.dispatch`) begins again: nothing its rolled-back try claimed,
        # found, foresaw or reserved in its placer holds
        self._placer = None
        self._foreseen = None
        self.drained = False
        d._remember_nodes(changed, room, horizon, operations)
        d._snaps = with_operations(d._snaps, operations)
        if self.whole_window:
            d._smallest = None  # learnt again from the window's head, which this pass claims whole
        self.room = placeable_at_most(d._snaps.values(), d._smallest)

    def foresee(self, tasks: list[ClaimedTaskRow]) -> list[PlacementDecision]:
        # Placed now, on this pass's placer, as the claim will give them if nothing queued comes first:
        # the same placer state and the same order make the same choices then (placement is pure).
        placed, unplaced = self._placed(tasks)
        self._foreseen = ([t.id for t in tasks], placed, unplaced)
        return placed

    def place(self, tasks: list[ClaimedTaskRow]) -> tuple[list[PlacementDecision], dict[uuid.UUID, str]]:
        foreseen, self._foreseen = self._foreseen, None
        if foreseen is None:
            return super().place(tasks)
        ids, placed, unplaced = foreseen
        if [t.id for t in tasks[: len(ids)]] == ids:
            # as foreseen: the same placer, the same tasks first, in the same order
            more, waiting = self._placed(tasks[len(ids) :])
        else:
            # Queued tasks came first (stored by a busy moment's handlers, not yet heard of). The
            # foreseen placements stand only if every task claimed is placed beside them: then none
            # waits for room a newer one took. Otherwise, and if the claim left one of them out, every
            # claimed task is placed in claim order on the nodes as they were, as if none was foreseen
            # (a foreseen task placed elsewhere gets a new token: its first Assign is a stale attempt's).
            new = set(ids)
            kept = not unplaced and new <= {t.id for t in tasks}
            more, waiting = self._placed([t for t in tasks if t.id not in new]) if kept else ([], {})
            if not kept or waiting:
                self._placer = None
                return super().place(tasks)
        if len(tasks) < self._asked:
            self.drained = True
        placed = placed + more
        self.room -= len(placed)
        return placed, {**unplaced, **waiting}

    @property
    def snaps(self) -> dict[str, NodeSnapshot]:
        return self.dispatcher._snaps

    @property
    def placer(self) -> Placer:
        # Built when the first claimed task is placed: a pass on a full fleet claims nothing, and
        # need not index every node for it (over 5,000 nodes, ~5 % of the server's samples).
        if self._placer is None:
            snaps = self.dispatcher._snaps
            self._placer = Placer(
                [snaps[k] for k in sorted(snaps)], policy=self.dispatcher.policy_name, derived=self.dispatcher._derived
            )
        return self._placer


class RefillPass(_Placing):
    """The placing side of a `Refill` (`Store.transition_decided`): queued tasks placed, in a group
    commit of ends, on the nodes those ends freed and on nothing else. Their snapshots are the
    dispatcher's, with the room read under the nodes' locks in that commit (the store reads only
    nodes whose facts have not changed since the dispatcher read them); nothing of the dispatcher's
    own snapshots is changed: its next pass reads the nodes this one reserved on."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        super().__init__(dispatcher, whole_window=False)
        self._snaps: dict[str, NodeSnapshot] = {}
        self.looks = dispatcher._queue_looks  # made before its commit's claim (`Dispatcher._found_queue`)

    def begin(self, room: list[NodeRoomRow], operations: dict[str, int]) -> None:
        d = self.dispatcher
        self._placer = None
        self.drained = False
        try:
            self._snaps = {
                r.room_node: with_room(snap, r, d._gpus.get(r.room_node, ()), operations.get(r.room_node, 0))
                for r in room if (snap := d._snaps.get(r.room_node)) is not None
            }  # fmt: skip
            self.room = placeable_at_most(self._snaps.values(), d._smallest)
        except Exception:
            self._failed()
            self._snaps, self.room = {}, 0

    def place(self, tasks: list[ClaimedTaskRow]) -> tuple[list[PlacementDecision], dict[uuid.UUID, str]]:
        try:
            return super().place(tasks)
        except Exception:
            # nothing of it is written (the write comes after): the claimed tasks stay queued as they were
            self._failed()
            self.room = 0
            return [], {t.id: t.reason or "" for t in tasks}

    @staticmethod
    def _failed() -> None:
        # A fault in placing must not cost the commit its ends (nor close the streams that sent
        # them): that commit places nothing, and the pass its ends wake places as it always did.
        log.exception("placing queued tasks on the room a commit of ends freed failed; the next pass places them")

    def want(self, claimed: int, limit: int) -> int:
        # One claim, of what the room could take: a commit of ends does not claim on past tasks the
        # freed nodes cannot run (it holds its reports' answers meanwhile); the next pass does.
        self._asked = 0 if claimed or self.room <= 0 else min(limit, self.room)
        return self._asked

    def leaves(self, t: ClaimedTaskRow) -> bool:
        # A task whose earlier attempts were lost or failed on some nodes tries the others first:
        # among the freed nodes alone it might be put straight back on the one it just failed on
        # (whose end freed it). The next pass places it, seeing every node.
        return bool(t.avoid)

    def room_left(self) -> bool:
        return self.room > 0

    @property
    def snaps(self) -> dict[str, NodeSnapshot]:
        return self._snaps

    @property
    def placer(self) -> Placer:
        if self._placer is None:
            # a few nodes, each a new snapshot: nothing the dispatcher keeps derived would be reused
            self._placer = Placer([self._snaps[k] for k in sorted(self._snaps)], policy=self.dispatcher.policy_name)
        return self._placer


class EarlyPush(Protocol):
    """Where a dispatch's Assigns may go before its COMMIT (`Gateway`): `push_before_commit` sends them
    if it may (True); `accepted_before_write` answers with the acceptances their nodes send back
    while the dispatch waits before its write, for the write to make, and `accept_in_pass` with those
    of Assigns sent after the write, for the dispatch to make in its own transaction; and
    `commit_known` is told, with the same rows, once the commit is known, which of their attempts it
    committed and which acceptances it made."""

    def push_before_commit(self, rows: list[OutboxRow]) -> bool: ...

    async def accepted_before_write(self, tokens: list[int]) -> Sequence[Change]: ...

    async def accept_in_pass(self, rows: list[OutboxRow]) -> Sequence[Change]: ...

    def commit_known(self, rows: list[OutboxRow], committed: Collection[int], accepted: Collection[int] = ()) -> None: ...


def _nowhere(rows: list[OutboxRow]) -> None:
    raise AssertionError("Assigns marked delivered with no outbox to push them: streams_here needs push")


class Dispatcher:
    def __init__(
        self, store: Store, timing: Timing, *, actor: str, policy_name: str = "spread",
        behind: Callable[[], float] = lambda: 0.0,
    ) -> None:  # fmt: skip
        self.store = store
        self.timing = timing
        self.actor = actor
        self.policy_name = policy_name
        # how many seconds this server's gateway is behind, on its reports or its streams (`Gateway.behind`)
        self.behind = behind
        # The nodes whose streams this server holds, and how their Assigns reach them: the gateway's
        # outbox, given the rows this dispatch marked delivered, pushes them as soon as it commits.
        # With none (a scheduler without a gateway) every node is told by NOTIFY podium_node.
        self.streams_here: Callable[[], Collection[str]] = tuple
        self.push: Callable[[list[OutboxRow]], None] = _nowhere
        # offered the same Assigns before the COMMIT is sent (`Gateway.push_before_commit`)
        self.early: EarlyPush | None = None
        self.loop = WokenLoop("dispatch", store, "podium_dispatch", timing.tick, self._pass)
        # What placement knows of the connected nodes between ticks, and the snapshot horizon of the
        # read that brought it up to date (None: read them all next time).
        self._snaps: dict[str, NodeSnapshot] = {}
        self._gpus: dict[str, tuple[int, ...]] = {}  # each kept node's GPU indexes, in order (its snapshot keeps the free ones)
        # what the placers derived from each kept snapshot (`Placer`'s `derived`): a node whose
        # snapshot is the same object next pass is not derived again
        self._derived: dict[str, Derived] = {}
        self._horizon: int | None = None
        self._nodes_read_all_at = float("-inf")
        self._window_looked_at = float("-inf")  # the last pass that looked at the whole window
        self._requirements: dict[tuple[Any, ...], Requirements] = {}
        # The least CPU and the least memory any task claimed since the last look at the whole window
        # asked for: the room a pass claims for is counted in tasks that size (None: in slots only).
        self._smallest: Resources | None = None
        # submissions handed to the next pass, each with what its handler waits for
        self._handed: list[tuple[Submissions, asyncio.Future[dict[uuid.UUID, TaskRow] | None]]] = []
        self._left_full = False  # the last pass left no room on the fleet (`SETTLE_WHEN_FULL`)
        # Whether a queued task may be waiting for room: false once a claim drained the queue and
        # placed all it claimed (and nothing said otherwise meanwhile), true again after any other
        # pass or refill (one that claimed nothing knows nothing of the queue). A group commit of ends
        # places on the room it frees only while this holds (`refill`): otherwise its claim would find
        # nothing, a round trip in every commit. `_found_queue` keeps it.
        self._queued_maybe = True
        self._queue_looks = 0  # how many passes and refills have told what they found of the queue
        self.refills = True  # False once the loop is stopping: no commit of ends places anything then

    def take_submission(self, sub: Submissions) -> asyncio.Future[dict[uuid.UUID, TaskRow] | None] | None:
        """Take new tasks for the next pass, to store in its transaction before its claim, if this
        dispatcher is idle; None if it is not (the caller stores them itself).

        The future's result is the tasks as stored, by id; None when the pass stored nothing of them
        (it found the window full, or was held): the caller stores them. An exception when the pass
        failed, which may have been after its commit: the caller stores them again under the same
        ids, which finds them if they were stored."""
        if not self.loop.idle:
            return None
        handed: asyncio.Future[dict[uuid.UUID, TaskRow] | None] = asyncio.get_running_loop().create_future()
        self._handed.append((sub, handed))
        self.loop.poke()
        return handed

    def _answer_handed(self, handed: list[tuple[Submissions, asyncio.Future[dict[uuid.UUID, TaskRow] | None]]],
                       stored: list[dict[uuid.UUID, TaskRow]] | BaseException) -> None:  # fmt: skip
        for i, (_sub, fut) in enumerate(handed):
            if fut.done():
                continue  # its handler is gone (the request was cancelled)
            if isinstance(stored, BaseException) and not isinstance(stored, Exception):
                # the pass was stopped (the server is stopping), perhaps in its commit: its handler
                # stores the tasks itself, which finds them if they were stored
                fut.set_exception(StoreUnavailable(f"the dispatch pass was stopped ({type(stored).__name__})"))
            elif isinstance(stored, BaseException):
                fut.set_exception(stored)
            else:
                fut.set_result(stored[i] if i < len(stored) else None)

    def release_handed(self) -> None:
        """Leave the submissions handed to this dispatcher and not yet taken by a pass to their
        handlers: its pass is held, or its loop is stopping."""
        handed, self._handed = self._handed, []
        self._answer_handed(handed, [])

    async def _pass(self) -> float | None:
        if self._nothing_to_look_for():
            metrics.DISPATCH_SKIPPED.inc()
            return None
        outcome = await self.dispatch_once()
        if outcome.window_full:
            # Nodes are behind on accepting what they were given; nothing wakes us when they
            # catch up, so look again soon rather than at the next tick.
            return min(self.timing.tick, WINDOW_POLL)
        if outcome.lost_races:
            # Another scheduler filled a node this pass placed on: its tasks are still queued, and
            # nothing wakes us for them (that scheduler's commit freed nothing). Look again soon, at
            # the nodes as they are then, rather than at the next tick (soon, not at once: a node that
            # refused a placement its snapshot allowed, for a reason the snapshot never shows, would
            # otherwise have the dispatcher place on it again and again without a pause)
            return min(self.timing.tick, WINDOW_POLL)
        if self._left_full:
            # nothing more fits until something ends (its commit wakes us): not at once, though
            self.loop.settle(SETTLE_WHEN_FULL)
            return None
        if outcome.held:
            # The claim passed over a queued task another transaction holds, whose commit may say
            # nothing (a group commit that read it for a stale report): look again once it may have
            # let go, or sooner if woken (a wait, not a sleep: a submission is not held back by it).
            asyncio.get_running_loop().call_later(min(self.timing.tick, WINDOW_POLL), self.loop.poke)
        if outcome.claimed >= outcome.limit and outcome.assigned:
            return 0  # more may be waiting: don't sleep between full batches
        return None

    def _nothing_to_look_for(self) -> bool:
        """Whether the pass about to run would find nothing to place: it was woken only by capacity
        being freed (`ROOM_FREED`: a task's end, a release proof, a commit of ends whose placements
        left room), while this dispatcher's last look found the queue drained and placed all it
        claimed, no submission waits for it, and the look at the whole window is not due. Such a
        pass was a transaction of its own after every end on an idle fleet (a task run one at a time
        paid for it beside its own way, both cores being busy then). A task queued since woke it
        with another word (`''`: a submission, a requeue, a resolved image), as did a node's change;
        the tick is the backstop for anything else, as for a lost notification."""
        heard = self.loop.heard
        if heard is None or heard - {ROOM_FREED} or self._queued_maybe or self._handed:
            return False
        return asyncio.get_running_loop().time() - self._window_looked_at < self.timing.tick

    async def dispatch_once(self) -> DispatchOutcome:
        # (`_left_full` keeps the last pass's word until this one ends: a commit of ends asks it
        # meanwhile, `refill`, and a pass runs for a good share of a burst)
        if self.behind() > self.timing.provisioning_deadline * HOLD_SHARE:
            self._left_full = False
            self.release_handed()  # not placed now: their handlers store them at once
            metrics.DISPATCH_HELD.inc()
            return DispatchOutcome(window_full=True)  # looked at again soon, like a full window
        started = time.perf_counter()
        outcome = await self._dispatch()
        if outcome.window_full:
            metrics.DISPATCH_WINDOW_FULL.inc()
            return outcome
        metrics.DISPATCH_SECONDS.observe(time.perf_counter() - started)
        metrics.PLACEMENTS.inc(len(outcome.assigned))
        metrics.DISPATCH_CLAIMED.inc(outcome.claimed)
        metrics.DISPATCH_REASONS_WRITTEN.inc(outcome.reasons_written)
        return outcome

    def refill(self) -> Refill | None:
        """What a group commit of ends places on the room it frees, in its own transaction (`Refill`),
        or None when it should place nothing: this dispatcher is stopping, has not read the nodes
        yet, its last pass did not leave the fleet full (queued tasks wait for something other than
        room, which a few freed nodes would not give them), a claim since found the queue drained,
        or it holds its placements (the gateway is behind, as for a pass). A node's next task is then
        assigned by the commit of its last one's end, instead of by a pass that commit wakes, a
        transaction of its own after it."""
        if not (self.refills and self._left_full and self._queued_maybe) or self._horizon is None:
            return None
        if self.behind() > self.timing.provisioning_deadline * HOLD_SHARE:
            return None
        return Refill(
            plan=RefillPass(self), claim_limit=self.timing.claim_limit, accept_seconds=self.timing.provisioning_deadline,
            lease_seconds=self.timing.lease_ttl, actor=self.actor, reconcile_seconds=self.timing.reconcile,
            horizon=self._horizon, assign_window=self.timing.assign_window,
        )  # fmt: skip

    def refilled(self, refill: Refill) -> None:
        """A commit that placed on the room its ends freed (`refill`) has committed."""
        out = refill.outcome
        if out is None:
            return
        plan = refill.plan
        assert isinstance(plan, RefillPass)
        metrics.PLACEMENTS.inc(len(out.assigned))
        metrics.REFILL_PLACEMENTS.inc(len(out.assigned))
        metrics.DISPATCH_CLAIMED.inc(out.claimed)
        self._found_queue(plan.drained and not (out.unplaced or out.lost_races or out.held), since=plan.looks)

    def requirements_of(self, t: ClaimedTaskRow) -> Requirements:
        """The claimed row's requirements, decoded once per distinct row content: a queued task is
        claimed again at every look at the whole window, and decoding its spec was most of the cost."""
        avoid = tuple(t.avoid or ())
        key = (t.spec, t.cpu_millis, t.memory_bytes, t.disk_bytes, t.gpus, avoid, t.image_digest)
        req = self._requirements.get(key)
        if req is None:
            if len(self._requirements) >= REQUIREMENTS_KEPT:
                self._requirements.clear()
            req = self._requirements[key] = requirements(
                json.loads(t.spec), t.cpu_millis, t.memory_bytes, t.disk_bytes, t.gpus, list(avoid), t.image_digest
            )
        return req

    def _smaller(self, r: Resources) -> None:
        s = self._smallest
        if s is None:
            self._smallest = Resources(r.cpu_millis, r.memory_bytes, 0, 0, 1)
        elif r.cpu_millis < s.cpu_millis or r.memory_bytes < s.memory_bytes:
            self._smallest = Resources(min(r.cpu_millis, s.cpu_millis), min(r.memory_bytes, s.memory_bytes), 0, 0, 1)

    def plan(self, *, whole_window: bool) -> DispatchPass:
        return DispatchPass(self, whole_window=whole_window)

    async def _dispatch(self) -> DispatchOutcome:
        now = asyncio.get_running_loop().time()
        if now - self._nodes_read_all_at > FULL_NODE_READ_EVERY:
            self._horizon = None  # read every node again now and then: cheap insurance
        # Once a tick, the whole window: the bound on how long a queued task goes without its true
        # reason (a new one says only that it waits for the scheduler; a requeued one, why it was).
        whole = now - self._window_looked_at >= self.timing.tick
        looks = self._queue_looks  # before its claim (`_found_queue`)
        handed, self._handed = self._handed, []
        early = self.early
        offered: list[OutboxRow] = []
        committed: set[int] = set()  # the offered Assigns' tokens whose attempts the pass committed
        accepted: list[int] = []

        def before_commit(rows: list[OutboxRow]) -> bool:
            assert early is not None
            offered.extend(rows)  # told `commit_known` however the offer ends, by raising too
            return early.push_before_commit(rows)

        plan = self.plan(whole_window=whole)
        try:
            outcome = await self.store.dispatch(
                claim_limit=max(self.timing.place_limit, self.timing.claim_limit),
                assign_window=self.timing.assign_window,
                accept_seconds=self.timing.provisioning_deadline,
                lease_seconds=self.timing.lease_ttl,
                plan=plan,
                actor=self.actor,
                nodes_since=self._horizon,
                reconcile_seconds=self.timing.reconcile,
                deliver_here=self.streams_here(),
                submissions=[sub for sub, _fut in handed],
                before_commit=before_commit if early is not None else None,
                accept_before_commit=early.accept_in_pass if early is not None else None,
                accepted_before_write=early.accepted_before_write if early is not None else None,
                # new tasks placed before the transaction only while the last look found the queue
                # drained and nothing was heard since (a handler that stored tasks while this pass's
                # dispatcher was busy said so; asked again once the pass's first read is back): one
                # stored and not yet heard of may still come first, and the foreseen placements stand
                # then only if everything claimed fits beside them (`DispatchPass.place`)
                foresee=self._nothing_else_queued,
            )
            committed = {token for _t, _n, token in outcome.assigned}
            accepted = outcome.accepted
        except BaseException as e:
            self._answer_handed(handed, e)
            raise
        finally:
            # the commit is known, whichever way: the reports of Assigns sent before it may be decided
            if offered:
                assert early is not None
                early.commit_known(offered, committed, accepted)
        try:
            # The Assigns first: the gateway queues a few on their streams in this call (when they
            # need no secret read), so the streams' writers run before the submissions' handlers,
            # whose HTTP answers are not on the way to any task's start.
            if untaken := outcome.untaken:
                self.push(untaken)
        finally:
            self._answer_handed(handed, outcome.submitted)  # stored, whatever befalls the push
        if whole and not outcome.window_full and not outcome.lost_races:
            self._window_looked_at = now
        # no room left for a task of the smallest size claimed lately (a pass that found the window
        # full read no node: it says nothing of the room)
        self._left_full = not outcome.window_full and plan.room <= 0
        # a placement whose node another scheduler filled first leaves its task queued, as does a
        # task the claim passed over because another transaction held it: neither is a drained queue
        self._found_queue(plan.drained and not (outcome.unplaced or outcome.lost_races or outcome.held), since=looks)
        return outcome

    def _nothing_else_queued(self) -> bool:
        """Whether this dispatcher believes no task but the ones handed to it is queued: its last look
        found the queue drained, and no notification was heard since (`Store.dispatch`'s `foresee`)."""
        return not self._queued_maybe and self.loop.quiet and self.loop.nothing_pending()

    def _found_queue(self, drained: bool, *, since: int) -> None:
        """What a pass or a refill found of the queue, told once it has committed: `drained` if its
        claim found fewer tasks than it asked for and it placed them all. A task it found waiting is
        believed at once. A drained queue is believed only if nothing else told what it found since
        this one began (`since`, the count `_queue_looks` had then): a refill's commit ends after the
        pass that ran beside it, and that pass may have claimed a task stored after the refill's claim,
        or one the refill's claim skipped because the pass held it locked, and left it waiting for
        room. Believed anyway, every end's wake-up after it would be answered with no pass (only room
        freed, the queue "drained"), and a fleet with tasks waiting would idle until the tick: one
        burst of real agents in several stalled ~1 s, the machine half idle (docs/benchmarks.md)."""
        if not drained:
            self._queued_maybe = True
        elif since == self._queue_looks:
            self._queued_maybe = False
        self._queue_looks += 1

    def _remember_nodes(self, changed: list[NodeRow], room: list[NodeRoomRow], horizon: int, operations: dict[str, int]) -> None:
        """Fold the node rows changed since the last read into the snapshots kept between ticks: a
        row read whole replaces its node's snapshot, a node whose reservations alone changed keeps
        its snapshot with those (a node not kept is not connected, or was removed: still not placed on)."""
        if self._horizon is None:
            self._snaps = {}
            self._gpus = {}
            self._derived = {}
            self._nodes_read_all_at = asyncio.get_running_loop().time()
        for row in changed:
            if row.connected and row.revoked_at is None:
                self._snaps[row.id] = node_snapshot(row)
                self._gpus[row.id] = tuple(sorted(row.gpu_indexes))
            else:
                self._snaps.pop(row.id, None)
                self._gpus.pop(row.id, None)
                self._derived.pop(row.id, None)
        for r in room:
            snap = self._snaps.get(r.room_node)
            if snap is not None:
                self._snaps[r.room_node] = with_room(snap, r, self._gpus.get(r.room_node, ()), operations.get(r.room_node, 0))
        self._horizon = horizon
