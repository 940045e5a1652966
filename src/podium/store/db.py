"""`Store` is the only code that runs queries. Every task state change goes through
`transition` (or `transition_many` for a batch): one compare-and-set statement with an explicit
`from` per task; the dispatch batch is the same compare-and-set applied to many rows at once.

This module must never decide policy (which node, requeue or lose): callers decide, the store makes
the decision durable or refuses it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ParamSpec, Protocol, TypeAlias, TypeVar

import asyncpg
import orjson

from podium import metrics, reasons
from podium.errors import (
    Ambiguous,
    Conflict,
    Contention,
    NotFound,
    PreconditionFailed,
    ProfileRevisionMismatch,
    StoreUnavailable,
)
from podium.spec import TaskSpec
from podium.states import AttemptState, TaskState, is_allowed
from podium.store.migrate import migrate
from podium.store.queries import queries
from podium.store.rows import (
    AbandonedReleaseRow,
    AttemptRow,
    AuditRow,
    ClaimedTaskRow,
    LogChunkRow,
    NamedSpecRow,
    NodeCredentialRow,
    NodeEventRow,
    NodeRoomRow,
    NodeRow,
    NodeSessionRow,
    NodeTaskRow,
    OutboxRow,
    ReleasingRow,
    SealedSecretRow,
    SecretRow,
    TaskEventRow,
    TaskFactsRow,
    TaskRow,
    TokenCheckRow,
    TokenRow,
    UnresolvedRow,
)

log = logging.getLogger(__name__)

# A driver record as the store's own code reads it, by column name. Private to the store: every
# public method turns records into `rows.py`'s types (or plain values) before returning.
_Record: TypeAlias = Mapping[str, Any]

# Before the first task in the newest-first order: the first page's keyset cursor.
_TASKS_START = (datetime.max.replace(tzinfo=UTC), uuid.UUID(int=(1 << 128) - 1))
# How many candidates an ambiguous prefix names.
CANDIDATES = 10

# Errors that mean "the database went away or the connection was killed": nothing was written.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,  # pg_terminate_backend, shutdown, cancel
    asyncpg.exceptions.InterfaceError,
    asyncpg.exceptions.InternalClientError,  # a connection left mid-operation by a killed backend
    asyncpg.exceptions.TooManyConnectionsError,
    ConnectionError,
    OSError,
    TimeoutError,
)


# Errors that mean "another transaction got in the way": the whole transaction was rolled back, and
# doing it again is the answer. The store's writes do it again themselves, a bounded number of times
# (`serialization_retry_limit`, see `_retried`); past that they fail with Contention.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.DeadlockDetectedError,
    asyncpg.exceptions.SerializationError,
    asyncpg.exceptions.LockNotAvailableError,
)

# The seed's SerializationRetryLimit: how many times one store operation is run again after a
# serialization failure, deadlock or lock timeout before it fails with Contention.
DEFAULT_SERIALIZATION_RETRY_LIMIT = 5
# A node's limit on concurrent provisioning operations (pulls, creates) when its agent does not say.
DEFAULT_MAX_OPERATIONS = 4
# The most Assigns a dispatch pass sends before its write (`Store._early_assigns`): as many as the
# gateway queues on its streams at once (a larger pass's go after its write, as they always did).
EARLY_ASSIGNS_MAX = 16
# Backoff before retry n (from 0): a uniformly random wait up to min(CAP, BASE * 2**n). Random, so
# two writers that collided once do not collide again on the same beat.
RETRY_BACKOFF_BASE = 0.01
RETRY_BACKOFF_CAP = 0.5


class _Refused(StoreUnavailable):
    """A transaction PostgreSQL rolled back for contention; `_retried` runs the operation again.
    A StoreUnavailable, so code that is not retried treats it as before: nothing was written."""


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _retried(op: Callable[_P, Awaitable[_T]]) -> Callable[_P, Awaitable[_T]]:
    """Run a Store operation again (the whole transaction) when PostgreSQL refused it for
    contention, at most the store's `serialization_retry_limit` times, each after a jittered
    backoff; then fail with Contention naming the operation and the contention. Only the outermost
    operation retries: an inner one's Contention is not `_Refused`, so it is never retried twice over."""

    @functools.wraps(op)
    async def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        store = args[0]
        limit = store.serialization_retry_limit  # type: ignore[attr-defined]
        retries = 0
        while True:
            try:
                return await op(*args, **kwargs)
            except _Refused as e:
                if retries >= limit:
                    metrics.SERIALIZATION_GIVEUPS.labels(op.__name__).inc()
                    raise Contention(
                        f"{op.__name__} was refused by PostgreSQL for contention with concurrent writes "
                        f"{retries + 1} times (serialization failure, deadlock or lock timeout; the "
                        f"serialization retry limit is {limit}); nothing was written. Last refusal: {e.__cause__}"
                    ) from e
                metrics.SERIALIZATION_RETRIES.labels(op.__name__).inc()
                await asyncio.sleep(random.uniform(0, min(RETRY_BACKOFF_CAP, RETRY_BACKOFF_BASE * 2**retries)))
                retries += 1

    return run


@dataclass(frozen=True, slots=True)
class Transition:
    """An accepted transition. A rejected one is None."""

    task_id: uuid.UUID
    fencing_token: int | None


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """An audit-log entry about a change's task, written by its actor in the change's own transaction:
    it exists exactly when the change does (a process killed between two commits would keep one)."""

    action: str
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Change:
    """One compare-and-set to make: `Store.transition`'s argument; a batch of them for `transition_many`."""

    task_id: uuid.UUID
    from_: TaskState | str
    to: TaskState | str
    actor: str
    reason: str | None = None
    fencing_token: int | None = None
    node_id: str | None = None
    exit_code: int | None = None
    lease_seconds: float | None = None
    end_attempt: AttemptState | str | None = None
    attempt_state: AttemptState | str | None = None
    stop: bool = False
    failure_class: str | None = None  # the class of an end (podium.failures), written with it
    detail: str | None = None  # the words beside the reason: a node's, an engine's, a registry's
    backend_ref: str | None = None  # the backend's reference to what runs, recorded on the attempt
    release: bool = False  # free a container attempt's capacity with its end, without a proof
    revision: int | None = None  # the assignment revision the caller read; another one refuses the change
    # A state passed through on the way, in this one change: a short command's `running` read in one
    # batch with its end (`ReportBatcher`). Its own event and the attempt's start are recorded too.
    via: TaskState | str | None = None

    def row(self) -> tuple[Any, ...]:
        if self.via is None:
            if not is_allowed(self.from_, self.to):
                raise ValueError(f"transition {self.from_} → {self.to} is not allowed")
        elif TaskState(self.via) != TaskState.RUNNING or self.end_attempt is None:
            raise ValueError(f"a change may pass through running on its way to an end only, not {self.via} → {self.to}")
        elif not (is_allowed(self.from_, TaskState.RUNNING) and is_allowed(TaskState.RUNNING, self.to)):
            raise ValueError(f"transition {self.from_} → {self.via} → {self.to} is not allowed")
        return (
            self.task_id, str(self.from_), str(self.to), self.reason, self.fencing_token, self.node_id,
            self.exit_code, self.lease_seconds, None if self.end_attempt is None else str(self.end_attempt),
            None if self.attempt_state is None else str(self.attempt_state), self.stop, self.actor,
            None if self.failure_class is None else str(self.failure_class), self.detail, self.backend_ref or None,
            self.release, self.revision, None if self.via is None else str(self.via),
        )  # fmt: skip


@dataclass(slots=True)
class PlacementDecision:
    task_id: uuid.UUID
    node_id: str
    cpu_millis: int
    memory_bytes: int
    disk_bytes: int
    gpus: int
    gpu_indexes: tuple[int, ...] = ()
    # the node as placement saw it (labels, capabilities, arch, backends, ...), kept on the attempt
    snapshot: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class DispatchOutcome:
    claimed: int = 0
    assigned: list[tuple[uuid.UUID, str, int]] = field(default_factory=list)  # (task, node, token)
    unplaced: dict[uuid.UUID, str] = field(default_factory=dict)  # task → reason
    lost_races: int = 0  # placements whose node filled up under another scheduler
    # a claim that came up short passed over a queued task another transaction holds (SKIP LOCKED):
    # the queue is not drained, though the claim found no more of it
    held: bool = False
    limit: int = 0  # how many tasks this batch could claim
    reasons_written: int = 0  # queued tasks whose waiting reason changed (rows written for it)
    window_full: bool = False  # nothing claimed: too many assignments wait for their nodes already
    # Assigns marked delivered by this dispatch (their nodes' streams are the caller's): to push now
    delivered: list[OutboxRow] = field(default_factory=list)
    # every one of `delivered` was taken by the dispatch's `before_commit`, which sent them before the
    # COMMIT was known: the caller pushes nothing of them
    pushed: bool = False
    # the fencing tokens of the Assigns offered to `before_commit` (each once, taken or not), and of
    # those it took: the caller pushes the rows of `delivered` it did not take (`untaken`)
    offered: set[int] = field(default_factory=set)
    taken: set[int] = field(default_factory=set)
    # the tasks of each submission given to the pass, stored in its transaction (empty: none were,
    # the window was full and the pass ended before its transaction)
    submitted: list[dict[uuid.UUID, TaskRow]] = field(default_factory=list)
    # the fencing tokens whose acceptance (`accept_before_commit`'s changes) this pass made in its
    # own transaction: recorded once it commits, never before
    accepted: list[int] = field(default_factory=list)
    # acceptances taken before the write (`accepted_before_write`) that it did not make itself: made
    # with the others after it; and the tokens whose acceptance was waited for before it (not again)
    acceptances: list[Change] = field(default_factory=list)
    asked: set[int] = field(default_factory=set)

    @property
    def untaken(self) -> list[OutboxRow]:
        """The Assigns of `delivered` that `before_commit` did not send: the caller's to push."""
        return [r for r in self.delivered if r.fencing_token not in self.taken]


@dataclass(frozen=True, slots=True)
class Submissions:
    """Submissions ready to store (`Store.submissions`): the tasks' ids, the insert's columns, who
    submitted them and the named spec they came from (if any)."""

    ids: tuple[uuid.UUID, ...]
    # insert_tasks' rows, each in its order: id, name, spec (JSON text), priority, cpu, memory, disk,
    # gpus, timeout, max_attempts, requeue_on_node_loss, idempotency_key, spec name, spec revision
    rows: list[
        tuple[uuid.UUID, str | None, str, int, int, int, int, int, float | None, int, bool, str | None, str | None, int | None]
    ]
    actor: str

    @property
    def specs(self) -> list[str]:
        return [r[2] for r in self.rows]


@dataclass(frozen=True, slots=True)
class NodeHello:
    """What recording a Hello decided."""

    row: NodeSessionRow | None  # None: the node was removed from the fleet (or the instance refused)
    superseded: str | None = None  # the instance this Hello took the node from
    refused_by: str | None = None  # this instance was superseded before, by that one: not recorded
    materializations_before: list[dict[str, Any]] = field(default_factory=list)  # the node's, before this Hello


class DispatchPlan(Protocol):
    """What places one dispatch pass's claims (the dispatcher's side of `Store.dispatch`): told what
    the nodes are now, it says how many queued tasks to claim, and places each batch it is given in
    claim order, reserving as it goes."""

    def begin(self, changed: list[NodeRow], room: list[NodeRoomRow], horizon: int, operations: dict[str, int]) -> None:
        """The node rows changed since the caller's horizon (whole), the reservations of the nodes
        nothing else of changed since, the new horizon, and the provisioning operations per node now."""

    def want(self, claimed: int, limit: int) -> int:
        """How many more queued tasks to claim now, `claimed` being claimed already (0: stop)."""

    def place(self, tasks: list[ClaimedTaskRow]) -> tuple[list[PlacementDecision], dict[uuid.UUID, str]]:
        """Placements for these claimed tasks, and the queued reason of each one not placed."""

    def foresee(self, tasks: list[ClaimedTaskRow]) -> list[PlacementDecision]:
        """Placements for new tasks this pass is about to store, given in the order its claim will
        return them if nothing queued comes first, made before its transaction (their Assigns go out
        while it runs). If its first claim then returns them first and in that order, `place` gives
        them the same placements; otherwise it places everything it claims as if none had been
        foreseen, and a task may then land elsewhere (its foreseen Assign is for an attempt never made)."""


class RefillPlan(Protocol):
    """What places queued tasks on the room a group commit of ends freed, in that commit (the
    dispatcher's side of `Store.transition_decided`'s `refill`): told the freed nodes as they are now,
    it says how many queued tasks to claim and places them on those nodes alone."""

    def begin(self, room: list[NodeRoomRow], operations: dict[str, int]) -> None:
        """The reservations of the nodes whose attempts this commit ended (those that may be given
        work), read under their locks, and their capacity operations now."""

    def want(self, claimed: int, limit: int) -> int:
        """How many more queued tasks to claim now, `claimed` being claimed already (0: stop)."""

    def place(self, tasks: list[ClaimedTaskRow]) -> tuple[list[PlacementDecision], dict[uuid.UUID, str]]:
        """Placements for these claimed tasks on the freed nodes; the others stay queued as they were."""

    def room_left(self) -> bool:
        """Whether the freed nodes could still take a task after these placements."""


#: The payload of a `podium_dispatch` notification sent only because capacity was freed: no task was
#: queued by the commit that sent it (transition_tasks, release_proofs, wake_dispatch). A dispatcher
#: whose last look found the queue drained need not look for room no task waits for; any other
#: notification (a task queued, a node changed) is a pass's to look at.
ROOM_FREED = "room"


@dataclass(slots=True)
class Refill:
    """Queued tasks placed on the room a group commit of ends frees, in that commit's transaction
    (`Store.transition_decided`): a node's next task is assigned in the commit that records its last
    one's end, where a dispatch pass woken by that commit was a transaction of its own after it. The
    same write as a pass's (`assign_tasks`: a conditional reservation on each node, a compare-and-set
    on each claimed task), on the freed nodes only; a task they cannot take is left queued with the
    reason it had (a pass that sees every node gives it its true one). `outcome` is what the
    committed try made (None: nothing was freed, or no freed node may be given work)."""

    plan: RefillPlan
    claim_limit: int
    accept_seconds: float
    lease_seconds: float
    actor: str
    reconcile_seconds: float
    # the horizon of the dispatcher's last read of the nodes: a node whose facts changed since is not
    # placed on (the plan's snapshot of it may be out of date), but for its room
    horizon: int
    assign_window: int | None = None
    outcome: DispatchOutcome | None = None
    # the committed try left room on a freed node, or could not read one (see `transition_decided`)
    room_left: bool = False


class _Conn(Protocol):
    """What the store's methods use of a pooled connection, typed: rows are `_Record`s."""

    async def fetch(self, query: str, *args: Any) -> list[_Record]: ...
    async def fetchrow(self, query: str, *args: Any) -> _Record | None: ...
    async def fetchval(self, query: str, *args: Any) -> Any: ...
    async def execute(self, query: str, *args: Any) -> str: ...
    def transaction(self) -> asyncpg.transaction.Transaction: ...


async def _light_reset(_conn: asyncpg.Connection) -> None:
    """What a pooled connection needs between uses beyond asyncpg's own rollback of an open
    transaction: nothing. Pool connections never LISTEN (listeners have their own), never SET and
    never keep an advisory lock, so the default reset's four statements would be a round trip of
    pure overhead on every query."""


@dataclass(frozen=True, slots=True)
class Notification:
    channel: str
    payload: str


class Subscription:
    """A LISTEN: a connection of its own that only the store touches, and the notifications it heard."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
        self._queue: asyncio.Queue[Notification | None] = asyncio.Queue()
        # a lost connection wakes whoever waits on the queue, so no one waits on a dead LISTEN for ever
        conn.add_termination_listener(lambda _c: self._queue.put_nowait(None))

    def _listener(self, channel: str, callback: Callable[[str], None] | None) -> Callable[..., None]:
        def heard(_conn: object, _pid: int, _channel: str, payload: str) -> None:
            if callback is not None:
                callback(payload)
            else:
                self._queue.put_nowait(Notification(channel, payload))

        return heard

    @property
    def closed(self) -> bool:
        return bool(self._conn.is_closed())

    def is_closed(self) -> bool:
        return self.closed

    async def get(self) -> Notification:
        """The next notification (of a channel with no callback); StoreUnavailable once the
        connection is lost (a missed notification only delays: every listener also sweeps)."""
        while True:
            if self._queue.empty() and self.closed:
                raise StoreUnavailable("the LISTEN connection to PostgreSQL was lost")
            n = await self._queue.get()
            if n is not None:
                return n

    def pending(self) -> bool:
        """Whether a notification heard waits to be taken."""
        return any(n is not None for n in self._queue._queue)  # type: ignore[attr-defined]

    def drain(self) -> list[Notification]:
        """Every notification already heard, without waiting."""
        out: list[Notification] = []
        while not self._queue.empty():
            n = self._queue.get_nowait()
            if n is not None:
                out.append(n)
        return out

    async def close(self) -> None:
        if not self._conn.is_closed():
            try:
                await self._conn.close()
            except CONNECTION_ERRORS:
                self._conn.terminate()


def _json_default(value: Any) -> Any:
    # orjson writes uuid.UUID itself, not the subclass asyncpg reads uuid columns into
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


# jsonb's binary format: a version byte, then the JSON text. Binary, not text: asyncpg decodes a
# composite value (a whole `tasks` row, as insert_tasks_claiming returns a submission's) only if
# every column's codec is binary, and the text is the same either way.
_JSONB_VERSION = b"\x01"


def _jsonb_encode(value: Any) -> bytes:
    return _JSONB_VERSION + orjson.dumps(value, default=_json_default)


def _jsonb_decode(data: bytes) -> Any:
    if data[:1] != _JSONB_VERSION:
        raise ValueError(f"jsonb in a binary format this client does not know (version byte {bytes(data[:1])!r})")
    return _json_decode(data[1:])


def _json_decode(text: str | bytes) -> Any:
    # orjson: the store decodes a spec per task row it reads, and the standard library's decoder was
    # the largest single cost of a submission (profiled). What it refuses (a lone surrogate escape,
    # a number past a double) goes to the standard library. It would read an integer past 64 bits
    # as a float; none is stored: every integer of a spec is bounded by its model, and the rest of
    # the jsonb columns hold what the server writes.
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def _init_connection(conn: asyncpg.Connection) -> Any:
    return conn.set_type_codec("jsonb", encoder=_jsonb_encode, decoder=_jsonb_decode, schema="pg_catalog", format="binary")


class Store:
    def __init__(
        self, pool: asyncpg.Pool, dsn: str, *, serialization_retry_limit: int = DEFAULT_SERIALIZATION_RETRY_LIMIT
    ) -> None:
        self.pool = pool
        self.dsn = dsn
        self.q = queries()
        self.serialization_retry_limit = serialization_retry_limit

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 2,
        max_size: int = 10,
        serialization_retry_limit: int = DEFAULT_SERIALIZATION_RETRY_LIMIT,
        keyed: bool = False,
        generic_plans: bool = False,
    ) -> Store:
        """A store on a new pool. `keyed`: the pool runs only statements that find their rows by key
        (a batch of task ids, a node's id), so its sessions never plan a sequential scan while an index
        serves (`enable_seqscan = off`). Such a statement is prepared once per connection and, after a
        few runs, PostgreSQL keeps its generic plan until the table's statistics change: planned while
        the table was small (a new server's first seconds), that plan reads the whole table on every
        run as it grows — 300+ scans of `tasks` reading ~1 M rows for a 3,000-task burst (issue 17).
        The statements name their keys as an index condition too (`id = ANY(...)`), so that refusing
        the scan does not leave a whole index read in its place (`tests/integration/test_plans.py`).
        Nor a bitmap scan (`enable_bitmapscan = off`): the dispatch claim, planned on statistics that
        still counted a few dozen queued tasks, read the whole queue through a bitmap and sorted it for
        the 512 at its head (27 ms at 20,000 queued, an 8 MB sort on disk at 15,000 in a benchmark's
        backlog; 1 ms by the queue's index, read in its order and stopped at the limit). A key lookup
        loses nothing by it: a batch of ids is an index scan of the same keys.

        `generic_plans`: its sessions plan each prepared statement once (`plan_cache_mode =
        force_generic_plan`), for a pool whose statements' generic plans are known to be lookups by
        key (the same test). PostgreSQL otherwise plans anew on every run a statement whose custom
        plan it estimates cheaper: a batch of log chunks cost 0.41 ms to plan and 0.21 to run."""
        settings = {"enable_seqscan": "off", "enable_bitmapscan": "off"} if keyed else {}
        if generic_plans:
            settings["plan_cache_mode"] = "force_generic_plan"
        try:
            pool = await asyncpg.create_pool(
                dsn, min_size=min_size, max_size=max_size, init=_init_connection, reset=_light_reset, command_timeout=60,
                server_settings=settings or None,
            )  # fmt: skip
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable(f"cannot connect to PostgreSQL: {e}") from e
        except asyncpg.exceptions.InvalidCatalogNameError as e:
            raise StoreUnavailable(f"the database does not exist: {e}") from e
        assert pool is not None
        return cls(pool, dsn, serialization_retry_limit=serialization_retry_limit)

    async def close(self) -> None:
        await self.pool.close()

    async def migrate(self) -> list[str]:
        async with self.pool.acquire() as conn:
            return await migrate(conn)

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[_Conn]:
        try:
            async with self.pool.acquire() as conn:
                yield conn
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable(f"lost the connection to PostgreSQL: {e}") from e
        except TRANSIENT_ERRORS as e:
            raise _Refused(f"the database refused a conflicting write ({e}); nothing was written") from e

    async def listen(
        self,
        channel: str,
        callback: Callable[[str], None] | None = None,
        also: dict[str, Callable[[str], None] | None] | None = None,
    ) -> Subscription:
        """LISTEN on `channel` (and on every channel in `also`: one connection, not one per channel).
        A channel given a callback has it called with each payload as it arrives; the others'
        notifications wait in the subscription's queue (`Subscription.get`). The caller owns the
        subscription and closes it; a lost connection closes it (`closed`), and `get` then raises
        StoreUnavailable."""
        try:
            conn = await asyncpg.connect(self.dsn)
        except CONNECTION_ERRORS as e:
            raise StoreUnavailable(f"cannot LISTEN on {channel}: {e}") from e
        sub = Subscription(conn)
        try:
            for ch, cb in {channel: callback, **(also or {})}.items():
                await conn.add_listener(ch, sub._listener(ch, cb))
        except CONNECTION_ERRORS as e:
            await sub.close()
            raise StoreUnavailable(f"cannot LISTEN on {channel}: {e}") from e
        return sub

    # ---- tasks ----------------------------------------------------------------------------------

    async def submit(
        self,
        spec: TaskSpec,
        *,
        idempotency_key: str | None = None,
        actor: str = "api",
        spec_name: str | None = None,
        spec_revision: int | None = None,
    ) -> tuple[TaskRow, bool]:
        """Store a new queued task (with its first event and its audit entry). With an idempotency
        key already used, return that task instead (created=False); the same key with a different
        spec is a Conflict."""
        return (await self.submit_many([(spec, idempotency_key)], actor=actor, spec_name=spec_name, spec_revision=spec_revision))[0]

    @staticmethod
    def _same_submission(existing: TaskRow | None, key: str | None, spec_json: Any) -> TaskRow:
        if existing is None:  # the first submit's row was pruned between the two statements
            raise Conflict(f"idempotency key {key!r} was used by a task that no longer exists")
        if existing.spec != spec_json:
            raise Conflict(
                f"idempotency key {key!r} was already used for a different spec "
                f"(task {existing.id}); use a new key for a new task"
            )
        return existing

    @staticmethod
    def submissions(
        items: Sequence[tuple[TaskSpec, str | None]],
        *,
        actor: str,
        ids: Sequence[uuid.UUID] | None = None,
        spec_name: str | None = None,
        spec_revision: int | None = None,
    ) -> Submissions:
        """Tasks ready to be stored by `submit_many` or by a dispatch pass (`dispatch(submissions=…)`):
        their ids chosen now, so that storing them again after a failure can tell whether the first
        try was committed."""
        # the specs go as the JSON text pydantic writes, cast to jsonb in the statement: no decoding
        # into dicts here only to encode them again
        specs = [spec.model_dump_json() for spec, _key in items]
        keys = [key for _spec, key in items]
        dup = {k for k in keys if k is not None and keys.count(k) > 1}
        if dup:
            raise Conflict(f"idempotency keys {sorted(dup)} appear more than once in this batch")
        ids = list(ids) if ids is not None else [uuid.uuid4() for _ in items]
        if len(ids) != len(items):
            raise ValueError(f"{len(ids)} task ids for {len(items)} submissions")
        rows = [
            (tid, s.name, spec_text, s.priority, s.resources.cpu, s.resources.memory, s.resources.disk,
             s.resources.gpus, s.timeout, s.max_attempts, s.requeue_on_node_loss, key, spec_name, spec_revision)
            for tid, (s, key), spec_text in zip(ids, items, specs, strict=True)
        ]  # fmt: skip
        return Submissions(tuple(ids), rows, actor)

    async def _insert_tasks(self, conn: _Conn, sub: Submissions, *, wake_dispatch: bool = True) -> dict[uuid.UUID, TaskRow]:
        rows = await conn.fetch(self.q["insert_tasks"], sub.rows, reasons.WAITING, sub.actor, wake_dispatch)
        return {r.id: r for r in TaskRow.many(rows)}

    @_retried
    async def submit_many(
        self,
        items: Sequence[tuple[TaskSpec, str | None]],
        *,
        actor: str,
        spec_name: str | None = None,
        spec_revision: int | None = None,
        ids: Sequence[uuid.UUID] | None = None,
    ) -> list[tuple[TaskRow, bool]]:
        """Many submissions in one statement and one commit; per item the same answer `submit` gives.
        The whole batch is refused (nothing stored) if any item reuses a key for a different spec.

        With `ids`, the tasks get those ids; if a dispatch pass that was given the same submission
        failed after committing it, its tasks are returned as they are now (created=True: it was this
        submission that made them)."""
        sub = self.submissions(items, actor=actor, ids=ids, spec_name=spec_name, spec_revision=spec_revision)
        keys = [key for _spec, key in items]
        if all(k is None for k in keys):
            # Without idempotency keys nothing can conflict, and the one statement is atomic by
            # itself: no BEGIN and COMMIT round trips around it.
            async with self._conn() as conn:
                try:
                    by_id = await self._insert_tasks(conn, sub)
                except asyncpg.UniqueViolationError as e:
                    if ids is None or e.constraint_name != "tasks_pkey":
                        raise
                    by_id = {r.id: r for r in TaskRow.many(await conn.fetch(self.q["tasks_by_ids"], list(sub.ids)))}
                    if set(by_id) != set(sub.ids):  # one transaction stored them all, or none
                        raise
            return [(by_id[i], True) for i in sub.ids]
        async with self._conn() as conn, conn.transaction():
            inserted = await self._insert_tasks(conn, sub)
            missing = [k for i, k in zip(sub.ids, keys, strict=True) if i not in inserted]
            existing = (
                {r.idempotency_key: r for r in TaskRow.many(await conn.fetch(self.q["tasks_by_idempotency_keys"], missing))}
                if missing
                else {}
            )
            out = []
            for tid, key, spec_text in zip(sub.ids, keys, sub.specs, strict=True):
                if tid in inserted:
                    out.append((inserted[tid], True))
                else:
                    out.append((self._same_submission(existing.get(key), key, _json_decode(spec_text)), False))
        return out

    # ---- named specs ----------------------------------------------------------------------------

    @_retried
    async def put_named_spec(self, name: str, spec: TaskSpec, actor: str) -> NamedSpecRow:
        spec_json = json.loads(spec.model_dump_json())
        for _ in range(5):
            try:
                async with self._conn() as conn:
                    return NamedSpecRow.of(_returned(await conn.fetchrow(self.q["put_named_spec"], name, spec_json, actor)))
            except asyncpg.UniqueViolationError:
                continue  # another writer took that revision number: take the next one
        raise Conflict(f"spec {name!r} is being changed by someone else; try again")

    async def named_spec(self, name: str, revision: int | None = None) -> NamedSpecRow:
        async with self._conn() as conn:
            if revision is None:
                row = await conn.fetchrow(self.q["latest_named_spec"], name)
            else:
                row = await conn.fetchrow(self.q["named_spec_revision"], name, revision)
        if row is None:
            raise NotFound(f"no spec named {name!r}" + (f" at revision {revision}" if revision is not None else ""))
        return NamedSpecRow.of(row)

    async def list_named_specs(self) -> list[NamedSpecRow]:
        async with self._conn() as conn:
            return NamedSpecRow.many(await conn.fetch(self.q["list_named_specs"]))

    async def submit_named(
        self, name: str, revision: int | None, *, idempotency_key: str | None, actor: str
    ) -> tuple[TaskRow, bool]:
        """Submit the latest revision of a named spec; a pin to any other revision is refused, so a
        client never runs a spec it has not seen."""
        latest = await self.named_spec(name)
        if revision is not None and revision != latest.revision:
            raise ProfileRevisionMismatch(
                f"profile revision mismatch: spec {name!r} is at revision {latest.revision}, but this submission is "
                f"pinned to revision {revision}; read the current spec (`podium spec show {name}`) and, if it is what "
                f"you want, run it pinned to it (`podium spec run {name} --revision {latest.revision}`)"
            )
        spec = TaskSpec.model_validate(latest.spec)
        return await self.submit(
            spec, idempotency_key=idempotency_key, actor=actor, spec_name=name, spec_revision=latest.revision
        )

    @_retried
    async def transition(self, change: Change, *, audit: AuditEntry | None = None) -> Transition | None:
        """Make one change (one compare-and-set), or do nothing and return None.

        `fencing_token` and `node_id` are given when a node is the actor: a stale token or another
        node's task is rejected like a wrong `from`. `end_attempt` closes the current attempt with that
        state and frees its capacity; `attempt_state` moves it forward instead. `lease_seconds` sets the
        lease from the database clock (negative: no lease of its own, held by node health). `stop`
        asks the node to stop the attempt. `failure_class` and `detail` are written with an end, in the
        same statement; a container attempt's end frees its capacity only with a recorded release
        proof, or with `release` (the node-loss policy gave up on its node). `revision` (If-Match)
        refuses the change unless the task is still at that assignment revision; every accepted
        change bumps it. `audit` is written only if the change is made, in its transaction.
        """
        async with self._conn() as c:
            if audit is None:
                row = await c.fetchrow(self.q["transition_tasks"], [change.row()], True)
            else:
                async with c.transaction():
                    row = await c.fetchrow(self.q["transition_tasks"], [change.row()], True)
                    if row is not None:
                        await c.execute(self.q["audit"], change.actor, audit.action, str(change.task_id), audit.detail)
        if row is None:
            return None
        return Transition(row["id"], row["fencing_token"])

    async def transition_task(
        self,
        task_id: uuid.UUID,
        from_: TaskState | str,
        to: TaskState | str,
        *,
        actor: str,
        reason: str | None = None,
        fencing_token: int | None = None,
        node_id: str | None = None,
        exit_code: int | None = None,
        lease_seconds: float | None = None,
        end_attempt: AttemptState | str | None = None,
        attempt_state: AttemptState | str | None = None,
        stop: bool = False,
        failure_class: str | None = None,
        detail: str | None = None,
        backend_ref: str | None = None,
        release: bool = False,
        revision: int | None = None,
    ) -> Transition | None:
        """`transition` with the change's fields as arguments."""
        return await self.transition(Change(
            task_id, from_, to, actor=actor, reason=reason, fencing_token=fencing_token, node_id=node_id,
            exit_code=exit_code, lease_seconds=lease_seconds, end_attempt=end_attempt,
            attempt_state=attempt_state, stop=stop, failure_class=failure_class, detail=detail,
            backend_ref=backend_ref, release=release, revision=revision,
        ))  # fmt: skip

    @_retried
    async def transition_many(self, changes: Sequence[Change]) -> list[Transition | None]:
        """Many compare-and-sets in one transaction and one commit (a group commit), each with the
        answer it would get alone. A task may have several changes, made in the order given, each from
        the state the one before it left (see `_made_in_layers`). The rows are locked first — the tasks
        in id order, then their nodes in id order — the order a single change and placement take them in."""
        if not changes:
            return []
        rows = [c.row() for c in changes]  # refuses a change that is not allowed before anything is sent
        ids = list({c.task_id: None for c in changes})
        async with self._conn() as conn, conn.transaction():
            await conn.execute(self.q["lock_tasks"], ids)
            await conn.execute(self.q["lock_nodes_of_tasks"], ids)
            results, _operations_freed = await self._made_in_layers(conn, changes, rows)
            return results

    @_retried
    async def transition_expected(self, changes: Sequence[Change]) -> list[Transition | None]:
        """Compare-and-sets decided on what each task's row is expected to hold, without reading it:
        one statement, committed on its own (no BEGIN, no read, no COMMIT of its own: one round trip
        where `transition_decided` takes four). Each change checks what it was decided on itself —
        its `from`, its token, its node — and a row holding anything else refuses it (None) and is
        left exactly as it was; the caller decides those again on a read. At most one change per task.

        Only for changes that free nothing: an end frees its node's capacity, and a node's row is
        locked in id order before any of its tasks' ends is written (`transition_decided`). The rows
        are given in id order, the order every batch takes its tasks in; should PostgreSQL still find
        a deadlock with another writer, it refuses this statement and it is run again."""
        if not changes:
            return []
        if any(c.end_attempt is not None for c in changes):
            raise ValueError("an end frees its node's capacity: it is made under the node's lock (transition_decided)")
        if len({c.task_id for c in changes}) != len(changes):
            raise ValueError("one change per task: a task's later change depends on whether its first was made")
        # `transition_tasks` takes its rows (`Change.row`) as one jsonb array of arrays
        rows = sorted((c.row() for c in changes), key=lambda r: r[0])
        async with self._conn() as conn:
            made = {r["id"]: r for r in await conn.fetch(self.q["transition_tasks"], rows, True)}
        return [
            None if (r := made.get(c.task_id)) is None else Transition(r["id"], r["fencing_token"])
            for c in changes
        ]

    async def end_expected(
        self, change: Change, *, logs: Sequence[tuple[uuid.UUID, int, str, int, int, bytes, str]] = ()
    ) -> Transition | None:
        """One end decided on what its task's row is expected to hold (its task running, or
        provisioning and passing through `running` in the same change, on this node under this token),
        made without reading it, with `logs` (as `insert_logs` takes them) stored in the same statement,
        committed on its own: one round trip where `transition_decided` takes four. The change checks
        what it was decided on itself; a row holding anything else refuses it (None), and the caller
        decides it again on a read. The chunks are stored either way (before the end, never after it).

        One end alone: its task's row is locked before its node's, as every single change takes them,
        so it needs no lock of its node taken first (`transition_expected` makes no end: a batch of them
        in one statement could take their nodes in another order than a group commit does). It wakes
        the dispatchers for the room it frees, as any change does: the caller places nothing on it."""
        if change.end_attempt is None:
            raise ValueError("end_expected makes an end; other changes go through transition_expected")
        cols = [list(c) for c in zip(*logs, strict=True)] if logs else [[] for _ in range(7)]
        async with self._conn() as conn:
            got = await conn.fetch(self.q["transition_tasks_storing_logs"], [change.row()], True, *cols)
        made = [r for r in got if r["id"] is not None]
        return Transition(made[0]["id"], made[0]["fencing_token"]) if made else None

    @_retried
    async def transition_decided(
        self,
        task_ids: Sequence[uuid.UUID],
        decide: Callable[[Mapping[uuid.UUID, TaskFactsRow]], Sequence[Change]],
        *,
        ending: Collection[uuid.UUID] = (),
        logs: Sequence[tuple[uuid.UUID, int, str, int, int, bytes, str]] = (),
        refill: Refill | None = None,
    ) -> tuple[list[Change], list[Transition | None]]:
        """Lock these tasks and read them, and lock the nodes of those in `ending` (the tasks whose
        changes may free a node's capacity: the caller's reported ends), in one statement; let
        `decide` turn what it read into changes, and make them as `transition_many` does — one
        transaction, one commit. What a change is decided on cannot move before it is made (the rows
        stay locked), so a change is refused only for what it checks itself (its token, its node). A
        change that frees a node not locked with the read has it locked before the first write. `decide`
        runs again, on a fresh read, when the transaction is retried: it must only compute. Returns the
        changes of the last `decide` and each one's answer. A task absent from the database is absent
        from the read.

        `logs` are output chunks (as `insert_logs` takes them) stored in the same transaction, by the
        statement that locks and reads the tasks (`lock_task_facts_storing_logs`: no round trip of their
        own): the output a node sent before an end is committed with that end, not in a commit before it.

        With `refill`, the nodes whose attempts the changes ended (their rows locked already) are read
        again once the changes are made, and queued tasks are placed on the room they have now, in the
        same transaction (see `Refill`; its `outcome` says what was placed, and which Assigns to push)."""
        async with self._conn() as conn, conn.transaction():
            if refill is not None:
                refill.outcome, refill.room_left = None, False  # a retried transaction places again, on what it reads then
            if logs:
                # stored by the statement that locks and reads the tasks: one round trip for both
                got = await conn.fetch(self.q["lock_task_facts_storing_logs"], list(task_ids), list(ending),
                                       *[list(c) for c in zip(*logs, strict=True)])  # fmt: skip
                read = TaskFactsRow.many([r for r in got if r["id"] is not None])
            else:
                read = TaskFactsRow.many(await conn.fetch(self.q["lock_task_facts"], list(task_ids), list(ending)))
            changes = list(decide({r.id: r for r in read}))
            if not changes:
                return [], []
            rows = [c.row() for c in changes]
            if stray := {c.task_id for c in changes} - {r.id for r in read}:
                raise ValueError(f"changes to tasks that were not read and locked: {sorted(map(str, stray))}")
            locked = {r.id for r in read if r.id in ending}
            unlocked = any(c.end_attempt is not None and c.task_id not in locked for c in changes)
            results, operations_freed = await self._made_in_layers(
                conn, changes, rows, lock_nodes=unlocked, wake_dispatch=refill is None
            )
            if refill is not None:
                # every node an end was made on is locked by now (`_made_in_layers`, or the read)
                freed = sorted({c.node_id for c, r in zip(changes, results, strict=True)
                                if r is not None and c.end_attempt is not None and c.node_id is not None})  # fmt: skip
                if freed:
                    refill.outcome = await self._refill(conn, refill, freed)
                # A pass is woken only for what these placements left: room on a freed node (the
                # queue drained, or its head fits none of them), a freed node they could not read, a
                # task they left queued (or whose node refused it), or a task these changes queued
                # (which a pass places seeing every node), or one its claim passed over because another
                # transaction held it (whose commit may say nothing). Woken by every such commit,
                # passes ran a burst long to find no room.
                out = refill.outcome
                queued = any(r is not None and c.to == TaskState.QUEUED for c, r in zip(changes, results, strict=True))
                waiting = out is not None and bool(out.window_full or out.unplaced or out.lost_races or out.held)
                if queued or waiting:
                    await conn.execute(self.q["wake_dispatch"], "")  # a task waits: any dispatcher looks
                elif (freed and (out is None or refill.room_left)) or operations_freed:
                    # (a start that freed an operation on a node whose operations bind: these placements
                    # were on the ended attempts' nodes only)
                    await conn.execute(self.q["wake_dispatch"], ROOM_FREED)
            return changes, results

    async def _refill(self, conn: _Conn, refill: Refill, nodes: list[str]) -> DispatchOutcome | None:
        """Place queued tasks on `nodes` (locked by this transaction) as they are now: their room read
        under those locks, the window counted, the claim and the write as a dispatch pass makes them."""
        window = refill.assign_window or 0
        rows = await conn.fetch(self.q["refill_room"], nodes, window, refill.horizon)
        refill.room_left = len(rows) < len(nodes)  # a node left out is a pass's to place on
        if not rows:
            return None  # none of them may be given work (draining, gone, revoked, changed since the plan's read)
        out = DispatchOutcome(limit=refill.claim_limit)
        if window:
            out.limit = min(out.limit, window - rows[0]["in_flight"])
            if out.limit <= 0:
                out.window_full = True
                return out
        refill.plan.begin(NodeRoomRow.many(rows), {r["room_node"]: r["operations"] for r in rows})
        try:
            return await self._claim_and_assign(conn, out, refill.accept_seconds, refill.lease_seconds, refill.plan,
                                                refill.actor, refill.reconcile_seconds, [r["room_node"] for r in rows],
                                                nodes_locked=True, write_reasons=False)  # fmt: skip
        finally:
            refill.room_left = refill.room_left or refill.plan.room_left()

    async def _made_in_layers(
        self,
        conn: asyncpg.Connection,
        changes: Sequence[Change],
        rows: Sequence[tuple[Any, ...]],
        *,
        lock_nodes: bool = False,
        wake_dispatch: bool = True,
    ) -> tuple[list[Transition | None], bool]:
        """Make `changes` (their `Change.row`s given) on a connection whose transaction holds their
        tasks' locks: one statement per layer — the first change of every task, then the second of
        those whose first was made, … (a node's `running` and its end, read in one batch) — each from
        the state the one before it left. A later change of a task whose earlier one was refused is
        not tried (None). With `lock_nodes`, the nodes of the changes that end attempts are locked, in
        id order, just before the first layer that holds one (a `running` layer is written before
        them): the caller holds the nodes' locks already otherwise. Without `wake_dispatch`, no
        dispatcher is woken for the capacity the changes free or the tasks they queue: the caller
        places on that room itself, and wakes them if that leaves anything (`transition_decided`); the
        second answer says whether a start freed a provisioning operation on a node whose operations
        bind before its slots (a dispatcher must then look, as the statement says when it wakes them)."""
        layers: list[list[int]] = []  # indexes into `changes`, one layer per rank of a task's changes
        rank: dict[uuid.UUID, int] = {}
        for i, c in enumerate(changes):
            k = rank.get(c.task_id, 0)
            rank[c.task_id] = k + 1
            if k == len(layers):
                layers.append([])
            layers[k].append(i)
        out: list[Transition | None] = [None] * len(changes)
        operations_freed = False
        made: set[uuid.UUID] = set(rank)  # tasks whose every change so far was made
        for layer in layers:
            todo = [i for i in layer if changes[i].task_id in made]
            if not todo:
                break
            if lock_nodes and any(changes[i].end_attempt is not None for i in todo):
                lock_nodes = False  # every ending change's node at once, in one ordered statement
                await conn.execute(self.q["lock_nodes_of_tasks"], [c.task_id for c in changes if c.end_attempt is not None])
            done = {r["id"]: r for r in await conn.fetch(self.q["transition_tasks"], [rows[i] for i in todo], wake_dispatch)}
            operations_freed = operations_freed or any(r["operations_freed"] for r in done.values())
            made = set()
            for i in todo:
                r = done.get(changes[i].task_id)
                if r is not None:
                    out[i] = Transition(r["id"], r["fencing_token"])
                    made.add(changes[i].task_id)
        return out, operations_freed

    async def get_task(self, task_id: uuid.UUID) -> TaskRow:
        async with self._conn() as conn:
            row = await conn.fetchrow(self.q["get_task"], task_id)
        if row is None:
            raise NotFound(f"no task {task_id}")
        return TaskRow.of(row)

    async def task_detail(self, task_id: uuid.UUID) -> tuple[TaskRow, list[AttemptRow], list[TaskEventRow]]:
        async with self._conn() as conn:
            task = await conn.fetchrow(self.q["get_task"], task_id)
            if task is None:
                raise NotFound(f"no task {task_id}")
            attempts = await conn.fetch(self.q["task_attempts"], task_id)
            events = await conn.fetch(self.q["task_events"], task_id)
        return TaskRow.of(task), AttemptRow.many(attempts), TaskEventRow.many(events)

    async def last_attempt_nodes(self, task_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, tuple[str, str | None]]:
        """task → (node id, node name) of its latest attempt; tasks never placed are left out."""
        if not task_ids:
            return {}
        async with self._conn() as conn:
            rows = await conn.fetch(self.q["last_attempt_nodes"], list(task_ids))
        return {r["task_id"]: (r["node_id"], r["node_name"]) for r in rows}

    async def list_tasks(
        self,
        *,
        state: str | None = None,
        node_id: str | None = None,
        name: str | None = None,
        limit: int = 100,
        after: tuple[datetime, uuid.UUID] | None = None,
    ) -> list[TaskRow]:
        """One page of tasks, newest first (created_at, id descending), strictly after the keyset
        cursor `after` (the last row of the page before)."""
        at, tid = after or _TASKS_START
        async with self._conn() as conn:
            if state is not None and node_id is None and name is None:
                rows = await conn.fetch(self.q["list_tasks_in_state"], state, at, tid, limit)
            else:
                rows = await conn.fetch(self.q["list_tasks"], state, node_id, name, at, tid, limit)
        return TaskRow.many(rows)

    async def count_tasks_after(
        self,
        *,
        state: str | None = None,
        node_id: str | None = None,
        name: str | None = None,
        after: tuple[datetime, uuid.UUID] | None = None,
        cap: int = 10_000,
    ) -> int:
        """How many tasks follow the cursor, counted up to `cap` (a bounded scan, whatever the table holds)."""
        at, tid = after or _TASKS_START
        async with self._conn() as conn:
            return int(await conn.fetchval(self.q["count_tasks_after"], state, node_id, name, at, tid, cap))

    async def resolve_task(self, prefix: str) -> uuid.UUID:
        """The one task whose id starts with these hex digits (dashes ignored): a range scan of the
        primary key. NotFound if none, Ambiguous (naming some) if several."""
        digits = prefix.replace("-", "").lower()
        lo = uuid.UUID(digits.ljust(32, "0"))
        hi = uuid.UUID(digits.ljust(32, "f"))
        async with self._conn() as conn:
            rows = await conn.fetch(self.q["tasks_by_prefix"], lo, hi, CANDIDATES + 1)
        if not rows:
            raise NotFound(f"no task id starts with {prefix!r}")
        if len(rows) > 1:
            ids = [str(r["id"]) for r in rows[:CANDIDATES]]
            more = " and more" if len(rows) > CANDIDATES else ""
            raise Ambiguous(
                f"{prefix!r} is the start of more than one task id: {', '.join(ids)}{more}; type more of the id",
                candidates=ids,
            )
        found: uuid.UUID = rows[0]["id"]
        return found

    async def task_events(self, task_id: uuid.UUID, after: int, limit: int) -> list[TaskEventRow]:
        """One page of a task's events in the order they happened, after event id `after`."""
        async with self._conn() as conn:
            if await conn.fetchrow(self.q["get_task"], task_id) is None:
                raise NotFound(f"no task {task_id}")
            return TaskEventRow.many(await conn.fetch(self.q["task_events_page"], task_id, after, limit))

    async def read_logs(
        self,
        task_id: uuid.UUID,
        *,
        after: tuple[int, int, str] | None = None,
        stream: str | None = None,
        attempt: int | None = None,
        offset: int = 0,
        limit: int = 1000,
    ) -> list[LogChunkRow]:
        """A task's output in the order it was written, from just after the position `after`
        (fencing token, seq, stream) of a chunk the reader has; `stream`/`attempt` narrow it, and
        chunks ending at or before byte `offset` of their stream are left out."""
        token, seq, name = after if after is not None else (-1, -1, "")
        async with self._conn() as conn:
            rows = await conn.fetch(self.q["read_logs"], task_id, token, seq, name, stream, attempt, offset, limit)
        return LogChunkRow.many(rows)

    async def log_position(self, task_id: uuid.UUID, chunk_id: int) -> tuple[int, int, str] | None:
        """(fencing token, seq, stream) of the task's chunk with this id, or None."""
        async with self._conn() as conn:
            row = await conn.fetchrow(self.q["log_position"], task_id, chunk_id)
        return None if row is None else (row["fencing_token"], row["seq"], row["stream"])

    async def insert_logs(self, chunks: Sequence[tuple[uuid.UUID, int, str, int, int, bytes, str]]) -> None:
        """(task, fencing token, stream, seq, byte offset, data, node) chunks, from any nodes, in one
        statement, with NOTIFY podium_logs naming the tasks given new chunks (their followers wake).
        Idempotent: a chunk stored before is left as it is."""
        if not chunks:
            return
        cols = list(zip(*chunks, strict=True))
        async with self._conn() as conn:
            await conn.execute(self.q["insert_logs"], *[list(c) for c in cols])

    # ---- placement ------------------------------------------------------------------------------

    @_retried
    async def dispatch(
        self,
        *,
        claim_limit: int,
        accept_seconds: float,
        lease_seconds: float,
        plan: DispatchPlan,
        actor: str,
        assign_window: int | None = None,
        nodes_since: int | None = None,
        reconcile_seconds: float = 30.0,
        deliver_here: Collection[str] = (),
        submissions: Sequence[Submissions] = (),
        before_commit: Callable[[list[OutboxRow]], bool] | None = None,
        accept_before_commit: Callable[[list[OutboxRow]], Awaitable[Sequence[Change]]] | None = None,
        accepted_before_write: Callable[[list[int]], Awaitable[Sequence[Change]]] | None = None,
        foresee: Callable[[], bool] | None = None,
    ) -> DispatchOutcome:
        """Claim up to `claim_limit` queued tasks, as many as `plan` wants, let it place them, and make
        the result durable in one transaction: reservations, attempts, fencing tokens, leases, events,
        reasons, notifies.

        With an `assign_window`, at most that many assignments may wait for their node's acceptance:
        the claim is cut to the room left in it, and a full window claims nothing (`window_full`).

        `deliver_here` are the nodes whose streams the caller holds: their attempts are marked delivered
        in the same statement and returned as `DispatchOutcome.delivered` for the caller to push at
        once (no NOTIFY, no outbox take); every other node that got work is notified.

        `plan.begin` is given the node rows changed by transactions at or after `nodes_since` (every
        row placement may read, connected or not; all of them when it is None) — whole, or only their
        reservations when nothing else of them changed — and the horizon to pass as `nodes_since`
        next time. The claim then goes in chunks, in claim order (priority, then
        age), for as long as `plan.want` asks: a pass that can place only a few tasks locks only a few
        rows instead of the backlog's whole head.

        `submissions` are new tasks to store first, in the same transaction, where the claim sees them:
        a task submitted to an idle dispatcher is stored and placed in one commit. They are stored
        only with a claim (`DispatchOutcome.submitted`); a full window stores nothing of them.

        `before_commit` is given the `delivered` Assigns once everything is written and before the
        COMMIT is sent; True means it took them (`DispatchOutcome.pushed`). Whatever it sends travels
        while the commit does, so it must send nothing a node may act on before the commit is known
        (see `Gateway.push_before_commit`); if it raises, nothing of the pass is committed. A small
        pass whose Assigns need nothing the write makes but their fencing tokens (`_early_assigns`)
        draws those with its nodes' locks and offers its Assigns then, before the write: they travel
        while it is made. One whose node another scheduler filled first is then not written, and its
        node, told nothing more, has its report of it refused as a stale attempt's once the commit is
        known, as for a pass that fails.

        While `foresee` says so (the caller believes nothing else is queued: asked before the first
        read, which then draws their tokens, and again once it is back), a few `submissions` are placed
        before the transaction, on the nodes as the first read found them, and their Assigns offered
        to `before_commit` then (`_present`): they travel to their nodes, and the acceptances come back,
        while the pass stores, claims and writes. The claim decides as always: a task it places
        elsewhere (a queued one came first) gets a new token, and its first Assign is a stale attempt's.

        `accepted_before_write` answers with the acceptances the nodes of Assigns sent before the write
        return (their fencing tokens given), waited for before it: the write makes them with the
        assignments (`assign_tasks`), one round trip fewer than a statement of their own after it (a
        node's round trip was on its way meanwhile; the wait is the one the pass made after its write
        before). One that does not come in that wait is decided by a group commit once this one is
        known. `accept_before_commit` waits, after the write, for the acceptances of Assigns offered
        only then.

        A pass is six round trips when it places anything (the window, horizon, operations and
        changed nodes in one read, BEGIN, a claim per chunk, the nodes' locks (and tokens), the
        reservations and assignments in one write, COMMIT), seven with acceptances made after its
        write. A task handed to an idle fleet's dispatcher is five with its insert: the first read
        (its token), BEGIN, the insert with the claim (`insert_tasks_claiming`: one submission is
        stored by the first claim's statement; and the node's lock), the write (its acceptance),
        COMMIT — its node's round trip under way meanwhile. On an idle fleet a task's way to its node is
        mostly these."""
        out = DispatchOutcome()
        try:
            return await self._dispatch(
                out, claim_limit, assign_window, accept_seconds, lease_seconds, plan, actor, nodes_since,
                reconcile_seconds, sorted(deliver_here), submissions, before_commit, accept_before_commit,
                accepted_before_write, foresee,
            )
        except asyncpg.UniqueViolationError as e:
            # Nothing of this batch was written; the next tick places it again on fresh state. Either
            # another scheduler handed out one of the same GPU indexes first, or a submission given
            # to this pass was stored by its handler first (it stopped waiting for this pass): the
            # pass answers that it stored nothing of it, which the handler's own insert already did.
            if e.constraint_name == "tasks_pkey":
                log.info("dispatch batch: a submission it was given was stored by its handler first; retrying")
            else:
                log.info("dispatch batch lost a GPU race to another scheduler; retrying")
            return DispatchOutcome(claimed=out.claimed, lost_races=out.claimed, limit=out.limit)

    async def _dispatch(
        self,
        out: DispatchOutcome,
        claim_limit: int,
        assign_window: int | None,
        accept_seconds: float,
        lease_seconds: float,
        plan: DispatchPlan,
        actor: str,
        nodes_since: int | None,
        reconcile_seconds: float,
        deliver_here: list[str],
        submissions: Sequence[Submissions],
        before_commit: Callable[[list[OutboxRow]], bool] | None,
        accept_before_commit: Callable[[list[OutboxRow]], Awaitable[Sequence[Change]]] | None,
        accepted_before_write: Callable[[list[int]], Awaitable[Sequence[Change]]] | None,
        foresee: Callable[[], bool] | None,
    ) -> DispatchOutcome:
        async with self._conn() as conn:
            # new tasks this pass may place before its transaction, their Assigns sent while it runs
            foreseen = (self._foreseeable(submissions)
                        if foresee is not None and before_commit is not None and deliver_here and foresee() else [])  # fmt: skip
            # the horizon (whatever commits after it is read again next time), the window, the
            # operations and the nodes changed since the last horizon, and a fencing token for each
            # foreseen task: one read, outside the transaction (it locks nothing, and its one snapshot
            # is what the horizon says it is)
            rows = await conn.fetch(self.q["dispatch_facts"], assign_window or 0, nodes_since, len(foreseen))
            facts = next(r for r in rows if r["operation_nodes"] is not None)  # the first row (dispatch_facts)
            out.limit = claim_limit
            if assign_window is not None:
                out.limit = min(claim_limit, assign_window - facts["in_flight"])
                if out.limit <= 0:
                    out.window_full = True
                    return out  # no node was read: the horizon stays where it was
            nodes = NodeRow.many([r for r in rows if r["id"] is not None])
            room = NodeRoomRow.many([r for r in rows if r["id"] is None and r["room_node"] is not None])
            operations = dict(zip(facts["operation_nodes"], facts["operations"], strict=True))
            plan.begin(nodes, room, facts["horizon"], operations)
            if not submissions and plan.want(0, out.limit) <= 0:
                # nothing to store and no room to place in: no transaction to open and commit (a pass
                # woken by a commit of ends whose room that commit placed on already, `Refill`)
                return out
            presented: dict[uuid.UUID, tuple[str, int]] = {}
            if foreseen and foresee is not None and foresee():  # still believed, the read back
                assert before_commit is not None
                presented = self._present(out, plan, foreseen, facts["tokens"], deliver_here, before_commit)
            async with conn.transaction():
                # new tasks first, visible to the claim below: stored and placed in one commit. No
                # dispatcher is woken for them: this pass claims them, and one that cannot place
                # them now is woken again by what frees room, as for any queued task. One submission
                # is stored by the pass's first claim, in its statement (`_claim_and_assign`)
                storing = submissions[0] if len(submissions) == 1 else None
                if storing is None:
                    out.submitted = [await self._insert_tasks(conn, sub, wake_dispatch=False) for sub in submissions]
                await self._claim_and_assign(conn, out, accept_seconds, lease_seconds, plan, actor, reconcile_seconds,
                                             deliver_here, before_commit, presented=presented,
                                             accepted_before_write=accepted_before_write, storing=storing)  # fmt: skip
                if before_commit is not None and out.delivered:
                    # what was not offered before the write (`_claim_and_assign`) or the transaction, now
                    self._offer(out, out.delivered, before_commit)
                    out.pushed = not out.untaken
                    sent = [r for r in out.delivered if r.fencing_token in out.taken and r.fencing_token not in out.asked]
                    if sent and accept_before_commit is not None:
                        accepting = [*out.acceptances, *await accept_before_commit(sent)]
                        out.accepted += await self._accept_in_pass(conn, accepting)
                    elif out.acceptances:
                        out.accepted += await self._accept_in_pass(conn, out.acceptances)
                return out

    @staticmethod
    def _foreseeable(submissions: Sequence[Submissions]) -> list[ClaimedTaskRow]:
        """The new tasks a pass may place before its transaction (`DispatchPlan.foresee`), as its claim
        would return them (stored by one transaction, they share its `now()` as their age: by priority,
        then id): all of them, or none when they are many (`EARLY_ASSIGNS_MAX`), or one asks for GPUs
        (their indexes are drawn by the write) or names an image (claimed once it is resolved)."""
        rows = [r for sub in submissions for r in sub.rows]
        if not rows or len(rows) > EARLY_ASSIGNS_MAX:
            return []
        if any(r[7] or json.loads(r[2]).get("image") is not None for r in rows):
            return []
        return [ClaimedTaskRow(r[0], r[2], r[4], r[5], r[6], r[7], None, None, None, 0)
                for r in sorted(rows, key=lambda r: (-r[3], r[0]))]  # fmt: skip

    def _present(
        self,
        out: DispatchOutcome,
        plan: DispatchPlan,
        foreseen: list[ClaimedTaskRow],
        tokens: list[int],
        deliver_here: list[str],
        before_commit: Callable[[list[OutboxRow]], bool],
    ) -> dict[uuid.UUID, tuple[str, int]]:
        """Place a pass's new tasks before its transaction (`DispatchPlan.foresee`), each with a token
        drawn by its first read, and offer the Assigns of those on nodes whose streams the caller holds:
        they travel to their nodes, and the acceptances come back, while the pass stores, claims and
        writes (one task at a time, a node's round trip had been on its way after the write). Safe for
        the reason an Assign sent before the COMMIT is (`Gateway.push_before_commit`): a node starts
        nothing before its acceptance is recorded, which the pass's commit decides. The placements
        made, by task: the pass writes a task placed on the same node with the same token."""
        placed = plan.foresee(foreseen)
        token_of = dict(zip((t.id for t in foreseen), tokens, strict=True))
        spec_of = {t.id: t.spec for t in foreseen}
        here = set(deliver_here)
        assigns = sorted((OutboxRow("assign", p.node_id, p.task_id, token_of[p.task_id], 1, [], spec_of[p.task_id])
                          for p in placed if p.node_id in here), key=lambda o: (o.node_id, o.fencing_token))  # fmt: skip
        if assigns:
            self._offer(out, assigns, before_commit)
        return {p.task_id: (p.node_id, token_of[p.task_id]) for p in placed}

    @staticmethod
    def _offer(out: DispatchOutcome, rows: list[OutboxRow], before_commit: Callable[[list[OutboxRow]], bool]) -> None:
        """Offer `before_commit` the Assigns of `rows` it was not offered yet (`DispatchOutcome.offered`)."""
        rows = [r for r in rows if r.fencing_token not in out.offered]
        if not rows:
            return
        out.offered.update(r.fencing_token for r in rows)
        if before_commit(rows):
            out.taken.update(r.fencing_token for r in rows)

    @staticmethod
    def _foldable(c: Change) -> bool:
        """Whether the write can make this acceptance itself (`assign_tasks`): a node's plain word that it
        took its assignment, which moves the task and its attempt to `provisioning` and nothing else."""
        return (c.from_ == TaskState.ASSIGNED and c.to == TaskState.PROVISIONING and c.end_attempt is None
                and c.attempt_state == AttemptState.PROVISIONING and c.fencing_token is not None and c.node_id is not None
                and c.reason is None and c.detail is None and c.failure_class is None and c.exit_code is None
                and not c.backend_ref and not c.stop and not c.release and c.revision is None and c.via is None)  # fmt: skip

    async def _accept_in_pass(self, conn: _Conn, changes: Sequence[Change]) -> list[int]:
        """Acceptances of a pass's own assignments, made in its transaction: the fencing tokens made.
        Their times (`provisioning_at`, the lease's start) are the transaction's, as for every row
        the pass writes: a few milliseconds before the node's word came."""
        if not changes:
            return []
        if any(c.from_ != TaskState.ASSIGNED or c.to != TaskState.PROVISIONING or c.end_attempt is not None
               or c.fencing_token is None or c.node_id is None for c in changes):  # fmt: skip
            raise ValueError("a pass makes only acceptances of its own assignments (assigned → provisioning, by their node)")
        rows = sorted((c.row() for c in changes), key=lambda r: r[0])
        return [r["fencing_token"] for r in await conn.fetch(self.q["transition_tasks"], rows, True)]

    async def _claim_and_assign(
        self,
        conn: _Conn,
        out: DispatchOutcome,
        accept_seconds: float,
        lease_seconds: float,
        plan: DispatchPlan | RefillPlan,
        actor: str,
        reconcile_seconds: float,
        deliver_here: list[str],
        before_write: Callable[[list[OutboxRow]], bool] | None = None,
        *,
        nodes_locked: bool = False,
        write_reasons: bool = True,
        presented: Mapping[uuid.UUID, tuple[str, int]] | None = None,
        accepted_before_write: Callable[[list[int]], Awaitable[Sequence[Change]]] | None = None,
        storing: Submissions | None = None,
    ) -> DispatchOutcome:
        """Claim, place and write (see `dispatch`). `nodes_locked`: every node `plan` may place on is
        locked by this transaction already. Without `write_reasons`, a claimed task left unplaced keeps the
        reason it had (`plan` saw only some of the nodes: it does not know the true one). `presented`:
        the tasks placed before the transaction (`_present`), each with its node and fencing token: one
        placed on that node again is written with that token. `accepted_before_write`: see `dispatch`.
        `storing`: a submission this transaction stores first (`out.submitted`), by the first claim's
        statement (`insert_tasks_claiming`) when there is one, one round trip less."""
        claim_limit = out.limit
        claimed: list[uuid.UUID] = []
        claimed_rows: list[ClaimedTaskRow] = []
        placements: list[PlacementDecision] = []
        unplaced: dict[uuid.UUID, str] = {}
        want = min(plan.want(0, claim_limit), claim_limit)
        # the nodes of the tasks placed before the transaction, locked by the first claim if it finds
        # nothing else to place (`claim_queued`)
        foreseen = sorted({node for node, _token in presented.values()}) if presented else []
        locked: set[str] = set()
        if storing is not None and want <= 0:
            out.submitted = [await self._insert_tasks(conn, storing, wake_dispatch=False)]
        while want > 0:
            if storing is not None and not claimed:
                got = await conn.fetch(self.q["insert_tasks_claiming"], want, claimed, foreseen, list(presented or ()),
                                       storing.rows, reasons.WAITING, storing.actor)  # fmt: skip
                out.submitted = [{r.id: r for r in TaskRow.many([g["stored"] for g in got if g["held"] is None])}]
                got = [g for g in got if g["held"] is not None]
            else:
                # rows this transaction locked already are not skipped by SKIP LOCKED: name them
                got = await conn.fetch(self.q["claim_queued"], want, claimed, [] if claimed else foreseen,
                                       list(presented or ()))  # fmt: skip
            if got and got[0]["locked"] == len(foreseen) > 0 and not claimed:
                locked = set(foreseen)
            if got and got[-1]["held"]:
                out.held = True  # the marker of a short claim that passed over a held task (not a task)
                got = got[:-1]
            tasks = ClaimedTaskRow.many(got)
            claimed.extend(t.id for t in tasks)
            claimed_rows.extend(tasks)
            placed, waiting = plan.place(tasks)
            placements.extend(placed)
            unplaced.update(waiting)
            if len(tasks) < want:
                break  # nothing more is queued that this pass may claim
            want = min(plan.want(len(claimed), claim_limit), claim_limit - len(claimed))
        out.claimed = len(claimed)
        out.unplaced = unplaced
        if placements:
            per_node: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
            for p in placements:
                acc = per_node[p.node_id]
                acc[0] += p.cpu_millis
                acc[1] += p.memory_bytes
                acc[2] += p.disk_bytes
                acc[3] += p.gpus
                acc[4] += 1
            ids = sorted(per_node)
            # a task placed where it was placed before the transaction keeps the token its Assign carried
            tokens = {p.task_id: x[1] for p in placements
                      if presented and (x := presented.get(p.task_id)) is not None and x[0] == p.node_id}  # fmt: skip
            rest = [p for p in placements if p.task_id not in tokens]
            early = self._early_assigns(rest, claimed_rows, deliver_here) if before_write is not None else None
            if early is None:
                # its own statement: the assignment's snapshot must begin after these locks are held
                # (the claim's, when it took them)
                if not nodes_locked and not locked.issuperset(ids):
                    await conn.execute(self.q["lock_nodes"], ids)
            else:
                drawn = await conn.fetchrow(self.q["lock_nodes_drawing_tokens"], ids, len(early))
                assert drawn is not None
                tokens.update(zip((p.task_id for p, _t in early), drawn["tokens"], strict=True))
                assigns = sorted((OutboxRow("assign", p.node_id, p.task_id, tokens[p.task_id], t.attempts + 1, [], t.spec)
                                  for p, t in early), key=lambda o: (o.node_id, o.fencing_token))  # fmt: skip
                assert before_write is not None
                self._offer(out, assigns, before_write)
            # the acceptances of the Assigns sent before this write, waited for before it and made by it
            folded: list[tuple[int, str, str, float | None]] = []
            if accepted_before_write is not None and (sent := sorted(out.taken & set(tokens.values()))):
                out.asked.update(sent)
                for c in await accepted_before_write(sent):
                    if self._foldable(c):
                        assert c.fencing_token is not None and c.node_id is not None
                        folded.append((c.fencing_token, c.node_id, c.actor, c.lease_seconds))
                    else:
                        out.acceptances.append(c)
            got = await conn.fetch(
                self.q["assign_tasks"],
                [(p.task_id, p.node_id, ",".join(map(str, p.gpu_indexes)), p.snapshot, tokens.get(p.task_id))
                 for p in placements],
                accept_seconds,
                lease_seconds,
                actor,
                reconcile_seconds,
                deliver_here,
                ids,
                *([per_node[i][k] for i in ids] for k in range(5)),
                folded,
            )
            reserved = {r["reserved"] for r in got if r["reserved"] is not None}
            rows = [r for r in got if r["id"] is not None]
            kept = sum(1 for p in placements if p.node_id in reserved)
            # claimed under FOR UPDATE, so every task placed on a reserved node must still have been
            # queued (raising here rolls the reservations back with everything else)
            assert len(rows) == kept, "a claimed task changed state under its row lock"
            out.lost_races = len(placements) - kept
            out.assigned = [(r["id"], r["node_id"], r["fencing_token"]) for r in rows]
            out.accepted = [r["fencing_token"] for r in rows if r["accepted"]]
            out.delivered = sorted(
                (OutboxRow("assign", r["node_id"], r["id"], r["fencing_token"], r["attempt"], list(r["gpu_indexes"]),
                           r["spec"]) for r in rows if r["here"]),
                key=lambda o: (o.node_id, o.fencing_token),
            )  # fmt: skip
            elsewhere = sorted({r["node_id"] for r in rows if not r["here"]})
            if elsewhere:
                await conn.execute(self.q["notify_nodes"], elsewhere)
        if unplaced and write_reasons:
            status = await conn.execute(self.q["set_queued_reasons"], list(unplaced), list(unplaced.values()))
            out.reasons_written = int(status.rsplit(" ", 1)[-1])
        return out

    @staticmethod
    def _early_assigns(
        placements: list[PlacementDecision], claimed: list[ClaimedTaskRow], deliver_here: list[str]
    ) -> list[tuple[PlacementDecision, ClaimedTaskRow]] | None:
        """A pass's placements whose Assigns may be sent before its write (the reservations, attempts
        and events), each with its claimed row: when the pass is small, every placement is on a node
        whose stream the caller holds, and no Assign needs what only the write knows (GPU indexes
        claimed, a container image pinned to its digest). None otherwise."""
        if not placements or len(placements) > EARLY_ASSIGNS_MAX:
            return None
        here = set(deliver_here)
        by_id = {t.id: t for t in claimed}
        early = []
        for p in placements:
            t = by_id[p.task_id]
            if p.node_id not in here or p.gpu_indexes or t.gpus or t.image_digest is not None:
                return None
            early.append((p, t))
        return early

    # ---- nodes ----------------------------------------------------------------------------------

    async def node_hello(self, **facts: Any) -> NodeSessionRow | None:
        """Record a (re)connecting node and give it a new session. None if the node was revoked."""
        return (await self.instance_hello(**facts)).row

    @_retried
    async def instance_hello(
        self,
        *,
        node_id: str,
        name: str,
        pool: str,
        arch: str,
        labels: dict[str, str],
        capabilities: list[str],
        backends: list[str],
        artifacts: list[str],
        protocol_min: int,
        protocol_max: int,
        gpu_indexes: list[int],
        cpu_millis: int,
        memory_bytes: int,
        disk_bytes: int,
        gpus: int,
        slots: int,
        gateway_id: str,
        agent_version: str,
        instance_id: str = "",
        peer: str = "",
        handover_after: float = 0.0,
        egress_contexts: Sequence[str] = ("open",),
        enforces_limits: bool = False,
        hello_tokens: Sequence[int] = (),
        max_operations: int = DEFAULT_MAX_OPERATIONS,
        materializations: Sequence[dict[str, Any]] = (),
    ) -> NodeHello:
        """Record a (re)connecting agent instance and give the node a new session (`row` is None if
        the node was revoked). With an instance id: an instance superseded before is refused (`refused_by` names
        its successor, nothing is written); another instance than the node's current one supersedes
        it, and the attempts the old one may still run are the node's until its last recorded
        heartbeat plus `handover_after` seconds (`superseded` names the old instance)."""
        async with self._conn() as conn, conn.transaction():
            prev = None
            if instance_id:
                prev = await conn.fetchrow(self.q["node_instance_lock"], node_id)
                gone = await conn.fetchrow(self.q["instance_superseded_by"], node_id, instance_id)
                if gone is not None:
                    return NodeHello(None, refused_by=gone["superseded_by"])
            row = await conn.fetchrow(
                self.q["node_hello"],
                node_id, name, pool, arch, labels, capabilities, backends, artifacts,
                protocol_min, protocol_max, gpu_indexes, cpu_millis, memory_bytes, disk_bytes,
                gpus, slots, gateway_id, agent_version, instance_id, peer, list(egress_contexts), enforces_limits,
            )  # fmt: skip
            if row is None:
                return NodeHello(None)
            session = NodeSessionRow.of(row)
            # what the reconcile loop checks attempts against, and the node's operations and runtimes
            before = await conn.fetchval(
                self.q["hello_facts"], node_id, sorted(set(hello_tokens)), max_operations, list(materializations)
            )
            if not instance_id:
                return NodeHello(session, materializations_before=before)
            await conn.execute(self.q["instance_seen"], node_id, instance_id, peer)
            old = prev["instance_id"] if prev is not None else None
            if not old or old == instance_id:
                return NodeHello(session, materializations_before=before)
            assert prev is not None  # `old` came from it
            old_peer = prev["instance_peer"] or "unknown peer"
            message = f"instance {instance_id} ({peer or 'unknown peer'}) superseded instance {old} ({old_peer})"
            await conn.fetchrow(
                self.q["supersede_instance"], node_id, old, instance_id, prev["last_heartbeat_at"], handover_after,
                message, prev["instance_peer"] or "", peer,
            )  # fmt: skip
            return NodeHello(session, superseded=old, materializations_before=before)

    @_retried
    async def defer_node_loss(self, node_id: str, tokens: Sequence[int]) -> bool:
        """Keep these attempts on the node until its handover deadline; False if it has passed."""
        async with self._conn() as conn:
            return await conn.fetchrow(self.q["defer_node_loss"], node_id, list(tokens)) is not None

    async def undelivered_on_node(self, node_id: str) -> set[int]:
        async with self._conn() as conn:
            return {r["fencing_token"] for r in await conn.fetch(self.q["undelivered_on_node"], node_id)}

    async def handover_due(self, limit: int) -> list[TaskFactsRow]:
        async with self._conn() as conn:
            return TaskFactsRow.many(await conn.fetch(self.q["handover_due"], limit))

    @_retried
    async def handover_done(self) -> None:
        async with self._conn() as conn:
            await conn.execute(self.q["handover_done"])

    async def node_event(self, node_id: str, kind: str, message: str, detail: dict[str, Any] | None = None) -> None:
        async with self._conn() as conn:
            await conn.execute(self.q["node_event"], node_id, kind, message, detail or {})

    async def node_events(self, node_id: str, after: int = 0, limit: int = 1000) -> list[NodeEventRow]:
        async with self._conn() as conn:
            return NodeEventRow.many(await conn.fetch(self.q["node_events"], node_id, after, limit))

    @_retried
    async def heartbeats(self, beats: Sequence[tuple[str, int]], gateway_id: str) -> set[str]:
        """Record heartbeats; returns the nodes recorded (not those whose session is no longer current,
        nor removed nodes)."""
        if not beats:
            return set()
        async with self._conn() as conn:
            rows = await conn.fetch(self.q["heartbeats"], [b[0] for b in beats], [b[1] for b in beats], gateway_id)
        return {r["id"] for r in rows}

    @_retried
    async def node_disconnected(self, node_id: str, session: int) -> None:
        async with self._conn() as conn:
            await conn.execute(self.q["node_disconnected"], node_id, session)

    @_retried
    async def release_gateway(self, gateway_id: str) -> None:
        async with self._conn() as conn:
            await conn.execute(self.q["release_gateway"], gateway_id)

    async def tasks_on_node(self, node_id: str) -> list[NodeTaskRow]:
        async with self._conn() as conn:
            return NodeTaskRow.many(await conn.fetch(self.q["tasks_on_node"], node_id))

    @_retried
    async def redeliver(self, tokens: Sequence[int]) -> None:
        if tokens:
            async with self._conn() as conn:
                await conn.execute(self.q["redeliver"], list(tokens))

    @_retried
    async def give_back_assigns(self, tokens: Sequence[int]) -> None:
        """Assigns a dispatch marked delivered that could not be pushed (the node's stream went away
        meanwhile): undelivered again, and the replica that holds each node now is woken to take them."""
        if tokens:
            async with self._conn() as conn:
                await conn.execute(self.q["give_back_assigns"], list(tokens))

    @_retried
    async def request_stop(self, node_id: str, tokens: Sequence[int]) -> None:
        if tokens:
            async with self._conn() as conn:
                await conn.execute(self.q["request_stop"], list(tokens), node_id)

    @_retried
    async def take_outbox(self, node_ids: Sequence[str]) -> list[OutboxRow]:
        """What the nodes are owed (Assigns, stops), marked sent; ordered by node, then token."""
        async with self._conn() as conn:
            return OutboxRow.many(await conn.fetch(self.q["take_outbox"], list(node_ids)))

    async def nodes_with_outbox(self) -> list[str]:
        async with self._conn() as conn:
            return [r["node_id"] for r in await conn.fetch(self.q["node_outbox_pending"])]

    async def list_nodes(self) -> list[NodeRow]:
        async with self._conn() as conn:
            return NodeRow.many(await conn.fetch(self.q["list_nodes"]))

    async def list_nodes_page(self, *, limit: int, after: tuple[str, str] | None = None) -> list[NodeRow]:
        """One page of nodes by (name, id), strictly after the keyset cursor `after`."""
        name, nid = after or (None, None)
        async with self._conn() as conn:
            return NodeRow.many(await conn.fetch(self.q["list_nodes_page"], name, nid, limit))

    async def count_nodes_after(self, *, after: tuple[str, str] | None = None, cap: int = 10_000) -> int:
        name, nid = after or (None, None)
        async with self._conn() as conn:
            return int(await conn.fetchval(self.q["count_nodes_after"], name, nid, cap))

    async def get_node(self, ref: str) -> NodeRow:
        """A node by id or by name, else by the start of one (as git takes a commit's); a name two
        nodes share, or a prefix several start with, is refused naming them."""
        async with self._conn() as conn:
            rows = await conn.fetch(self.q["get_node"], ref)
            if not rows:
                rows = await conn.fetch(self.q["nodes_by_prefix"], ref, CANDIDATES + 1)
                if len(rows) > 1:
                    names = [f"{r['name']} ({r['id']})" for r in rows[:CANDIDATES]]
                    more = " and more" if len(rows) > CANDIDATES else ""
                    raise Ambiguous(
                        f"{ref!r} is the start of more than one node's id or name: {', '.join(names)}{more}; "
                        "type more of it",
                        candidates=[r["id"] for r in rows[:CANDIDATES]],
                    )
        if not rows:
            raise NotFound(f"no node {ref!r} (by id, name, or the start of either)")
        if len(rows) > 1 and rows[0]["id"] != ref:
            raise Conflict(f"more than one node is named {ref!r}; use its id")
        return NodeRow.of(rows[0])

    @_retried
    async def set_labels(self, node_id: str, labels: dict[str, str], if_revision: int | None = None) -> None:
        """Replace a node's labels; with `if_revision`, only if the node is still at that revision
        (else PreconditionFailed naming both)."""
        async with self._conn() as conn:
            row = await conn.fetchrow(self.q["set_labels"], node_id, labels, if_revision)
            current = None if row is not None else await conn.fetchval(self.q["node_revision"], node_id)
        if row is None and current is None:
            raise NotFound(f"no node {node_id!r}")
        if row is None:
            raise PreconditionFailed(
                f"node {node_id} is at revision {current}, not revision {if_revision} as this request expects; "
                f"read its labels again (`podium nodes`) and decide again"
            )

    async def placement_nodes(self) -> list[NodeRow]:
        async with self._conn() as conn:
            return NodeRow.many(await conn.fetch(self.q["placement_nodes"]))

    @_retried
    async def set_draining(self, node_id: str, draining: bool, deadline: float | None = None) -> None:
        """Drain (or undrain) a node; `deadline` seconds from now, what still runs there goes
        through the node-loss policy (the watchdog's `drain_overdue`)."""
        async with self._conn() as conn:
            row = await conn.fetchrow(self.q["set_draining"], node_id, draining, deadline)
        if row is None:
            raise NotFound(f"no node {node_id!r}")

    # ---- sandboxes: resolved images, release proofs, inventories ---------------------------------

    async def claim_unresolved(self, limit: int, lease_seconds: float) -> list[UnresolvedRow]:
        """Up to `limit` queued container tasks due for resolving their image, each held for
        `lease_seconds` against other resolvers: (id, image, resolve_tries)."""
        async with self._conn() as conn:
            return UnresolvedRow.many(await conn.fetch(self.q["claim_unresolved"], limit, lease_seconds))

    async def set_resolved(self, digests: Sequence[tuple[uuid.UUID, str]]) -> set[uuid.UUID]:
        """Pin tasks' images to these digests; the tasks written (still queued and unresolved)."""
        if not digests:
            return set()
        async with self._conn() as conn:
            rows = await conn.fetch(self.q["set_resolved"], [d[0] for d in digests], [d[1] for d in digests], reasons.WAITING)
        return {r["id"] for r in rows}

    async def set_unresolved(self, rows: Sequence[tuple[uuid.UUID, str | None, float]]) -> None:
        """(task, the registry's words, seconds until the next try): the registry cannot be reached."""
        if rows:
            async with self._conn() as conn:
                await conn.execute(
                    self.q["set_unresolved"], [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                    reasons.REGISTRY_UNREACHABLE,
                )  # fmt: skip

    async def release_proofs(
        self, proofs: Sequence[tuple[uuid.UUID, int, str, str, float]]
    ) -> list[tuple[uuid.UUID, int, bool]]:
        """Record nodes' release proofs: (task, fencing token, node, backend reference, released at in
        unix seconds by the node's clock). Returns the proofs accepted, each with whether it freed the
        capacity now (False: the attempt's end is not recorded yet, and will free it). A proof not in
        the answer was refused and changed nothing."""
        if not proofs:
            return []
        tasks = sorted({p[0] for p in proofs})
        nodes = sorted({p[2] for p in proofs})
        async with self._conn() as conn, conn.transaction():
            # the order every other change takes its rows in: tasks, then nodes, each in id order
            await conn.execute(self.q["lock_tasks"], tasks)
            await conn.execute(self.q["lock_nodes"], nodes)
            rows = await conn.fetch(
                self.q["release_proofs"],
                [p[0] for p in proofs], [p[1] for p in proofs], [p[2] for p in proofs], [p[3] for p in proofs],
                [p[4] for p in proofs],
            )  # fmt: skip
        return [(r["task_id"], r["fencing_token"], r["released"]) for r in rows]

    async def release_abandoned(self, limit: int) -> list[AbandonedReleaseRow]:
        """Release the ended container attempts waiting for a proof on nodes that are offline or
        removed: the node-loss policy has given up on them, and says so in the proof."""
        async with self._conn() as conn:
            rows = await conn.fetch(self.q["release_abandoned"], limit, reasons.NODE_REVOKED, reasons.NODE_LOST)
        return AbandonedReleaseRow.many(rows)

    async def nodes_releasing(self, node_ids: Sequence[str]) -> dict[str, ReleasingRow]:
        """Per node, the capacity ended attempts still hold until their release proof."""
        if not node_ids:
            return {}
        async with self._conn() as conn:
            return {r.node_id: r for r in ReleasingRow.many(await conn.fetch(self.q["nodes_releasing"], list(node_ids)))}

    async def set_artifacts(self, node_id: str, session: int, artifacts: Sequence[str]) -> bool:
        """A node's inventory of image digests, from its current session. False if not written (an
        old session, a removed node, or nothing changed)."""
        async with self._conn() as conn:
            return await conn.fetchrow(self.q["set_artifacts"], node_id, session, sorted(set(artifacts))) is not None

    async def drain_overdue(self, limit: int) -> list[TaskFactsRow]:
        async with self._conn() as conn:
            return TaskFactsRow.many(await conn.fetch(self.q["drain_overdue"], limit))

    # ---- security -------------------------------------------------------------------------------

    async def insert_token(self, token_id: str, name: str, role: str, secret_hash: bytes, created_by: str) -> TokenRow:
        async with self._conn() as conn:
            row = await conn.fetchrow(self.q["insert_token"], token_id, name, role, secret_hash, created_by)
        return TokenRow.of(_returned(row))

    async def get_token(self, token_id: str) -> TokenCheckRow | None:
        async with self._conn() as conn:
            row = await conn.fetchrow(self.q["get_token"], token_id)
        return None if row is None else TokenCheckRow.of(row)

    async def list_tokens(self) -> list[TokenRow]:
        async with self._conn() as conn:
            return TokenRow.many(await conn.fetch(self.q["list_tokens"]))

    async def revoke_token(self, token_id: str) -> TokenRow:
        """Revoke the active token with this id, or the one whose id starts with it."""
        async with self._conn() as conn:
            row = await conn.fetchrow(self.q["revoke_token"], token_id)
            if row is None:
                rows = await conn.fetch(self.q["tokens_by_prefix"], token_id, CANDIDATES + 1)
                if len(rows) > 1:
                    ids = [f"{r['id']} ({r['name']})" for r in rows[:CANDIDATES]]
                    more = " and more" if len(rows) > CANDIDATES else ""
                    raise Ambiguous(
                        f"{token_id!r} is the start of more than one active token id: {', '.join(ids)}{more}; "
                        "type more of it",
                        candidates=[r["id"] for r in rows[:CANDIDATES]],
                    )
                if rows:
                    row = await conn.fetchrow(self.q["revoke_token"], rows[0]["id"])
        if row is None:
            raise NotFound(f"no active token {token_id!r} (by id or the start of one)")
        return TokenRow.of(row)

    async def active_tokens(self, role: str) -> int:
        async with self._conn() as conn:
            return int(await conn.fetchval(self.q["active_token_count"], role))

    async def put_secret(self, name: str, nonce: bytes, ciphertext: bytes, actor: str) -> SecretRow:
        async with self._conn() as conn:
            return SecretRow.of(_returned(await conn.fetchrow(self.q["put_secret"], name, nonce, ciphertext, actor)))

    async def list_secrets(self) -> list[SecretRow]:
        async with self._conn() as conn:
            return SecretRow.many(await conn.fetch(self.q["list_secrets"]))

    async def delete_secret(self, name: str) -> None:
        async with self._conn() as conn:
            if await conn.fetchrow(self.q["delete_secret"], name) is None:
                raise NotFound(f"no secret {name!r}")

    async def get_secrets(self, names: Sequence[str]) -> list[SealedSecretRow]:
        async with self._conn() as conn:
            return SealedSecretRow.many(await conn.fetch(self.q["get_secrets"], list(names)))

    async def audit(self, actor: str, action: str, target: str | None, detail: dict[str, Any] | None = None) -> None:
        async with self._conn() as conn:
            await conn.execute(self.q["audit"], actor, action, target, detail or {})

    async def read_audit(self, limit: int, before: int | None = None) -> list[AuditRow]:
        """One page of the audit log, newest first, of entries older than entry `before`."""
        async with self._conn() as conn:
            return AuditRow.many(await conn.fetch(self.q["read_audit"], limit, before))

    async def count_audit_after(self, before: int | None = None, cap: int = 10_000) -> int:
        async with self._conn() as conn:
            return int(await conn.fetchval(self.q["count_audit_after"], cap, before))

    async def node_credential(self, node_id: str) -> NodeCredentialRow | None:
        async with self._conn() as conn:
            row = await conn.fetchrow(self.q["node_credential"], node_id)
        return None if row is None else NodeCredentialRow.of(row)

    async def enrol_node(self, node_id: str, credential_hash: bytes, instance_id: str = "") -> bool:
        """Enrol a node (its credential's hash): only one not enrolled yet, or one the same agent
        instance enrolled and has not presented its credential since."""
        async with self._conn() as conn:
            return await conn.fetchrow(self.q["set_node_credential"], node_id, credential_hash, instance_id) is not None

    async def confirm_node_credential(self, node_id: str) -> None:
        """The node presented its credential: no join token may enrol it again."""
        async with self._conn() as conn:
            await conn.execute(self.q["confirm_node_credential"], node_id)

    @_retried
    async def revoke_node(self, node_id: str) -> None:
        async with self._conn() as conn:
            if await conn.fetchrow(self.q["revoke_node"], node_id) is None:
                raise NotFound(f"no node {node_id!r} (or it was already removed)")

    # ---- watchdog -------------------------------------------------------------------------------

    @_retried
    async def mark_unreachable(self, after: float) -> list[str]:
        async with self._conn() as conn:
            return [r["id"] for r in await conn.fetch(self.q["mark_unreachable"], after)]

    @_retried
    async def mark_offline(self, after: float) -> list[str]:
        async with self._conn() as conn:
            return [r["id"] for r in await conn.fetch(self.q["mark_offline"], after)]

    async def overdue_accepts(self, limit: int) -> list[TaskFactsRow]:
        async with self._conn() as conn:
            return TaskFactsRow.many(await conn.fetch(self.q["watch_overdue_accept"], limit))

    async def timed_out(self, limit: int) -> list[TaskFactsRow]:
        async with self._conn() as conn:
            return TaskFactsRow.many(await conn.fetch(self.q["watch_timeouts"], limit))

    async def cancel_grace_expired(self, grace: float, limit: int) -> list[TaskFactsRow]:
        async with self._conn() as conn:
            return TaskFactsRow.many(await conn.fetch(self.q["watch_cancel_grace"], grace, limit))

    @_retried
    async def prune_finished(self, older_than: float, limit: int) -> int:
        """Delete up to `limit` tasks that ended more than `older_than` seconds ago, with their
        attempts, events and logs."""
        async with self._conn() as conn:
            return int(await conn.fetchval(self.q["prune_finished"], older_than, limit))

    async def lost_tasks(self, limit: int) -> list[TaskFactsRow]:
        async with self._conn() as conn:
            return TaskFactsRow.many(await conn.fetch(self.q["watch_lost"], limit))


def _returned(row: _Record | None) -> _Record:
    """The row an INSERT … RETURNING gave back (one always comes back)."""
    assert row is not None
    return row
