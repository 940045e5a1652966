"""The store's own row types: what every public method of `Store`, `UiStore` and `ReconcileStore`
returns, instead of the driver's records (nothing above the store knows the driver).

Each is a frozen dataclass read by attribute, and mirrors the columns of the queries that return it
(tests/integration/test_rows.py prepares each of those queries and compares). A query may return a
column its row does not have (a `pg_notify` result, a counter no caller reads): it is left out. A
field with a default is one some of the row's queries do not select.
"""

from __future__ import annotations

import dataclasses
import operator
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

_R = TypeVar("_R", bound="Row")


class Row:
    __slots__ = ()

    @classmethod
    def of(cls: type[_R], record: Any) -> _R:
        """From one driver record (or a mapping): the columns the row has, by name; the rest keep
        their defaults. A required column the record lacks is a TypeError naming it."""
        return _maker(cls, tuple(record.keys()), isinstance(record, Mapping))(record)

    @classmethod
    def many(cls: type[_R], records: Sequence[Any]) -> list[_R]:
        """`of` for every record of one query's answer (they share its columns, so the columns are
        matched to the fields once, not once per record: a listing page stays cheap)."""
        if not records:
            return []
        make = _maker(cls, tuple(records[0].keys()), isinstance(records[0], Mapping))
        return [make(r) for r in records]


_MAKERS: dict[tuple[type[Row], tuple[str, ...], bool], Callable[[Any], Any]] = {}


def _maker(cls: type[_R], columns: tuple[str, ...], by_name: bool) -> Callable[[Any], _R]:
    """`_make`, made once per row type and query (the same columns)."""
    key = (cls, columns, by_name)
    make = _MAKERS.get(key)
    if make is None:
        make = _MAKERS[key] = _make(cls, columns, by_name)
    return make


def _make(cls: type[_R], columns: tuple[str, ...], by_name: bool) -> Callable[[Any], _R]:
    """How to build `cls` from a record with these columns: the values picked by one C-level
    itemgetter (by position from a driver record, by name from a mapping), then passed positionally
    when they are the leading fields in order, else by keyword."""
    assert dataclasses.is_dataclass(cls)
    fields = dataclasses.fields(cls)
    missing = [
        f.name for f in fields
        if f.name not in columns and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]  # fmt: skip
    if missing:
        raise TypeError(
            f"{cls.__name__} needs the column(s) {', '.join(missing)}, which the query does not select "
            f"(it selects {', '.join(columns)})"
        )
    names = tuple(f.name for f in fields if f.name in columns)
    keys: tuple[Any, ...] = names if by_name else tuple(columns.index(n) for n in names)
    if len(keys) == 1:
        only, key = names[0], keys[0]
        return lambda r: cls(**{only: r[key]})
    pick = operator.itemgetter(*keys)
    if names == tuple(f.name for f in fields[: len(names)]):
        return lambda r: cls(*pick(r))
    return lambda r: cls(**dict(zip(names, pick(r), strict=True)))


# ---- tasks ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskRow(Row):
    """A task as stored (get_task, the listings, a submission)."""

    id: uuid.UUID
    name: str | None
    spec: dict[str, Any]
    state: str
    reason: str | None
    priority: int
    cpu_millis: int
    memory_bytes: int
    disk_bytes: int
    gpus: int
    timeout_seconds: float | None
    max_attempts: int
    requeue_on_node_loss: bool
    attempts: int
    node_id: str | None
    fencing_token: int | None
    lease_expires_at: datetime | None
    accept_deadline: datetime | None
    started_at: datetime | None
    cancel_requested_at: datetime | None
    cancel_reason: str | None
    exit_code: int | None
    idempotency_key: str | None
    submitted_by: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    spec_name: str | None
    spec_revision: int | None
    image: str | None
    image_digest: str | None
    resolved_at: datetime | None
    resolve_tries: int
    resolve_after: datetime | None
    reason_detail: str | None
    revision: int


@dataclass(frozen=True, slots=True)
class TaskSummaryRow(Row):
    """A task as the UI's task table shows it (ui_tasks_page): `labels` are its spec's."""

    id: uuid.UUID
    name: str | None
    state: str
    reason: str | None
    node_id: str | None
    attempts: int
    max_attempts: int
    exit_code: int | None
    created_at: datetime
    finished_at: datetime | None
    labels: dict[str, str] | None


@dataclass(frozen=True, slots=True)
class ClaimedTaskRow(Row):
    """A queued task the dispatcher claimed, with what placement reads of it (`avoid`: the nodes its
    earlier attempts were lost on)."""

    id: uuid.UUID
    spec: str  # the JSON text: the dispatcher decodes a spec it has not seen before only
    cpu_millis: int
    memory_bytes: int
    disk_bytes: int
    gpus: int
    reason: str | None
    image_digest: str | None
    avoid: list[str] | None
    attempts: int = 0  # made so far: the next one is numbered this plus one


@dataclass(frozen=True, slots=True)
class UnresolvedRow(Row):
    """A queued container task whose image the resolver pins to a digest."""

    id: uuid.UUID
    image: str
    resolve_tries: int


@dataclass(frozen=True, slots=True)
class TaskFactsRow(Row):
    """A task as a decision about it needs it: its state and current attempt, and what the policy
    reads (`podium.scheduler.apply.facts`). Queries that need less leave the rest at defaults."""

    id: uuid.UUID
    state: str
    fencing_token: int | None = None
    node_id: str | None = None
    attempts: int = 1
    max_attempts: int = 1
    requeue_on_node_loss: bool = True
    timeout_seconds: float | None = None
    cancel_reason: str | None = None
    why: str | None = None  # the watchdog's lost tasks: why the node can no longer be counted on


@dataclass(frozen=True, slots=True)
class NodeTaskRow(Row):
    """A task live on a node (assigned to it, or provisioning, running or cancelling there), with the
    fencing token of its attempt there."""

    id: uuid.UUID
    state: str
    fencing_token: int


@dataclass(frozen=True, slots=True)
class AttemptRow(Row):
    """One attempt of a task (task_attempts)."""

    task_id: uuid.UUID
    attempt: int
    fencing_token: int
    node_id: str
    state: str
    cpu_millis: int
    memory_bytes: int
    disk_bytes: int
    gpus: int
    gpu_indexes: list[int]
    released: bool
    assigned_at: datetime
    accept_deadline: datetime
    delivered_at: datetime | None
    provisioning_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    stop_requested_at: datetime | None
    stop_sent_at: datetime | None
    exit_code: int | None
    reason: str | None
    failure_class: str | None
    failure_detail: str | None
    backend_kind: str
    backend_ref: str | None
    release_proof: dict[str, Any] | None
    released_at: datetime | None
    reconcile_owner: str | None
    reconcile_claim_expires_at: datetime | None
    next_reconcile_at: datetime | None
    last_reconciled_at: datetime | None
    last_reconciled_by: str | None
    last_reconcile_result: str | None
    capability_snapshot: dict[str, Any] | None
    retry_count: int
    retry_limit: int


@dataclass(frozen=True, slots=True)
class TaskEventRow(Row):
    """One recorded state change of a task."""

    id: int
    task_id: uuid.UUID
    at: datetime
    from_state: str | None
    to_state: str
    reason: str | None
    actor: str
    fencing_token: int | None
    failure_class: str | None
    detail: str | None
    txid: int


@dataclass(frozen=True, slots=True)
class LogChunkRow(Row):
    """A chunk of a task's output (read_logs); `byte_offset` is where it starts in its stream."""

    id: int
    fencing_token: int
    attempt: int
    stream: str
    seq: int
    byte_offset: int
    data: bytes
    at: datetime


@dataclass(frozen=True, slots=True)
class OutboxRow(Row):
    """One thing a node is owed: an Assign (`kind` "assign": attempt, gpu indexes, spec as JSON text)
    or a stop (`kind` "stop", with its reason)."""

    kind: str
    node_id: str
    task_id: uuid.UUID
    fencing_token: int
    attempt: int | None = None
    gpu_indexes: list[int] | None = None
    spec: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class ReconcileClaimRow(Row):
    """A live attempt the reconcile loop claimed, with its task's and its node's facts as they are now."""

    task_id: uuid.UUID
    fencing_token: int
    node_id: str
    attempt_state: str
    provisioning_at: datetime | None
    backend_kind: str
    capability_snapshot: dict[str, Any] | None
    reconcile_claim_expires_at: datetime | None
    state: str
    task_token: int | None
    attempts: int
    max_attempts: int
    requeue_on_node_loss: bool
    timeout_seconds: float | None
    cancel_reason: str | None
    health: str
    connected: bool
    node_removed: bool
    materializations: list[dict[str, Any]]
    in_handover: bool
    before_hello: bool
    in_hello: bool


@dataclass(frozen=True, slots=True)
class AbandonedReleaseRow(Row):
    """A container attempt the store released without a proof (its node is offline or removed)."""

    task_id: uuid.UUID
    fencing_token: int
    node_id: str


# ---- nodes ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeRow(Row):
    """A node as stored (not its credential's hash)."""

    id: str
    name: str
    pool: str
    arch: str
    labels: dict[str, str]
    capabilities: list[str]
    backends: list[str]
    artifacts: list[str]
    protocol_min: int
    protocol_max: int
    gpu_indexes: list[int]
    alloc_cpu_millis: int
    alloc_memory_bytes: int
    alloc_disk_bytes: int
    alloc_gpus: int
    alloc_slots: int
    res_cpu_millis: int
    res_memory_bytes: int
    res_disk_bytes: int
    res_gpus: int
    res_slots: int
    health: str
    draining: bool
    connected: bool
    gateway_id: str | None
    session: int
    last_heartbeat_at: datetime | None
    connected_at: datetime | None
    revoked_at: datetime | None
    labels_overridden: bool
    agent_version: str
    created_at: datetime
    updated_at: datetime
    instance_id: str | None
    instance_peer: str | None
    handover_until: datetime | None
    handover_tokens: list[int]
    egress_contexts: list[str]
    enforces_limits: bool
    drain_deadline: datetime | None
    revision: int
    hello_tokens: list[int]
    max_operations: int
    materializations: list[dict[str, Any]]
    # placement's reads add gpus_in_use, the listings drain_phase (in this order: placement's rows,
    # read every dispatch tick, are then the leading fields, built positionally)
    gpus_in_use: list[int] | None = None
    drain_phase: str | None = None


@dataclass(frozen=True, slots=True)
class NodeRoomRow(Row):
    """What a dispatch pass reads of a node whose reservations alone changed since its last read:
    those, and the GPU indexes the node's attempts hold."""

    room_node: str
    room_cpu_millis: int
    room_memory_bytes: int
    room_disk_bytes: int
    room_gpus: int
    room_slots: int
    gpus_in_use: list[int]


@dataclass(frozen=True, slots=True)
class NodeSessionRow(Row):
    """What recording a Hello gave the node: its new session."""

    id: str
    session: int
    draining: bool


@dataclass(frozen=True, slots=True)
class NodeEventRow(Row):
    """One recorded event of a node (a supersession, a runtime change, a drain)."""

    id: int
    at: datetime
    kind: str
    message: str
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ReleasingRow(Row):
    """The capacity a node's ended attempts hold until their release proofs."""

    node_id: str
    cpu_millis: int
    memory_bytes: int
    disk_bytes: int
    gpus: int
    slots: int


@dataclass(frozen=True, slots=True)
class NodeCredentialRow(Row):
    """A node's enrolment: the hash of its credential (None: not enrolled), and whether it was revoked."""

    id: str
    credential_hash: bytes | None = field(repr=False)
    revoked_at: datetime | None
    enrolled_by_instance: str | None  # set until the enrolling agent instance presents its credential


# ---- specs, tokens, secrets, audit, UI sessions ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class NamedSpecRow(Row):
    name: str
    revision: int
    spec: dict[str, Any]
    created_at: datetime
    created_by: str


@dataclass(frozen=True, slots=True)
class TokenRow(Row):
    """An API token as it is listed: never its secret's hash."""

    id: str
    name: str
    role: str
    created_at: datetime
    created_by: str
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class TokenCheckRow(TokenRow):
    """An API token with the hash of its secret: what checking a presented token needs (get_token)."""

    secret_hash: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class SecretRow(Row):
    """A stored secret's metadata: never its value."""

    name: str
    version: int
    created_at: datetime
    updated_at: datetime
    updated_by: str


@dataclass(frozen=True, slots=True)
class SealedSecretRow(Row):
    """A secret's value as stored: sealed (security/secretbox.py opens it)."""

    name: str
    nonce: bytes = field(repr=False)
    ciphertext: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class AuditRow(Row):
    id: int
    at: datetime
    actor: str
    action: str
    target: str | None
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class UiSessionRow(Row):
    """A live UI session: its token and that token's name and role, and its CSRF secret."""

    token_id: str
    csrf: str = field(repr=False)
    name: str
    role: str


@dataclass(frozen=True, slots=True)
class StreamEventRow(Row):
    """One entry of the event stream (events_after): a task's state change (`kind` "task") or a
    node's (`kind` "node"); the other kind's fields are None. `txid` is text: an xid8."""

    kind: str
    id: int
    txid: str
    at: datetime
    task_id: uuid.UUID | None
    task_name: str | None
    from_state: str | None
    state: str | None
    reason: str | None
    actor: str | None
    fencing_token: int | None
    attempt: int | None
    node_id: str | None
    health: str | None
    connected: bool | None
    draining: bool | None
    revoked: bool | None
    labels: dict[str, str] | None
    task_created_at: datetime | None
