"""What the API returns. Built from store rows here and nowhere else."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from podium.security.tokens import Role
from podium.spec import MAX_BATCH, SubmitRequest, validate_labels
from podium.states import TERMINAL, TaskState
from podium.store.rows import AttemptRow, NamedSpecRow, NodeRow, ReleasingRow, TaskEventRow, TaskRow


class AttemptOut(BaseModel):
    attempt: int
    node_id: str
    fencing_token: int
    state: str
    assigned_at: datetime
    accept_deadline: datetime
    provisioning_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    exit_code: int | None
    reason: str | None
    gpu_indexes: list[int]
    failure_class: str | None  # exit, timeout, cancelled, node_lost, not_accepted, provisioning, oom, internal
    failure_detail: str | None  # the node's or engine's own words about the end
    backend_kind: str  # process or container
    backend_ref: str | None  # the process group or container id it ran as
    released: bool  # its capacity is given back (a container's only once proven removed)
    released_at: datetime | None
    release_proof: dict[str, Any] | None  # by the node (backend_ref, released_at) or the server (reason)
    # What it was decided on (seed DurableAssignment): the node as placement saw it (pool, arch,
    # labels, capabilities, backends, egress contexts, protocol, its materializations), and its place
    # in the retry budget: retry `retry_count` of at most `retry_limit`. The operation deadline is
    # when the node had to have accepted it (its accept deadline).
    capability_snapshot: dict[str, Any] | None = None
    retry_count: int = 0
    retry_limit: int = 0
    operation_deadline: datetime | None = None
    # The reconcile loop: who holds its claim now and until when, when it is due next, and its last
    # check (when, by which server replica, and what it found).
    reconcile_owner: str | None = None
    reconcile_claim_expires_at: datetime | None = None
    next_reconcile_at: datetime | None = None
    last_reconciled_at: datetime | None = None
    last_reconciled_by: str | None = None
    last_reconcile_result: str | None = None


class EventOut(BaseModel):
    at: datetime
    from_state: str | None
    to_state: str
    reason: str | None
    actor: str
    fencing_token: int | None
    failure_class: str | None
    detail: str | None


class TaskOut(BaseModel):
    id: uuid.UUID
    name: str | None
    state: str
    reason: str | None
    terminal: bool
    exit_code: int | None
    node_id: str | None
    fencing_token: int | None
    attempts: int
    max_attempts: int
    priority: int
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    lease_expires_at: datetime | None
    accept_deadline: datetime | None
    idempotency_key: str | None
    spec_name: str | None
    spec_revision: int | None
    spec: dict[str, Any]
    # The assignment revision: bumped by every change of state, node or attempt (also the ETag);
    # `If-Match: <revision>` on cancel refuses to act on a task that changed since (412).
    revision: int = 1
    # Where the latest attempt ran or runs, also once the task has ended (node_id is then None: the
    # task holds no node). Filled by the task listing and the task detail; None if never placed.
    last_node_id: str | None = None
    last_node_name: str | None = None
    reason_detail: str | None  # words beside the reason: a registry's, a node's
    image: str | None  # as submitted (a tag, or already a digest)
    image_digest: str | None  # what the tag was resolved to; every attempt runs image@digest
    resolved_at: datetime | None


class TaskDetail(TaskOut):
    attempt_list: list[AttemptOut]
    events: list[EventOut]


class SubmitResponse(BaseModel):
    task: TaskOut
    created: bool


class LogChunkOut(BaseModel):
    """One piece of a task's output. `GET /v1/tasks/{id}/logs` returns chunks in the order the
    output was written (attempt by attempt; within one, in the order the node read its stdout and
    stderr), each stored once however often its node sent it.

    Checking and resuming: `offset` is the byte offset of this chunk within its attempt's stream and
    `length` its size in bytes, so per (attempt, stream) each chunk starts where the one before it
    ended (a gap means the node had to drop output it could not deliver). Resume after a chunk with
    `?cursor=<its cursor>`, or a stream at a byte with `?stream=stdout&offset=N` (of the task's latest
    attempt unless `attempt` is given; a chunk holding byte N comes back cut to start at N)."""

    id: int = Field(description="the chunk's row id; `?after=<id>` resumes after it (the first API's cursor)")
    attempt: int
    fencing_token: int
    stream: str = Field(description='"stdout" or "stderr"')
    seq: int = Field(description="the chunk's place in its attempt's output, over both streams, from 0")
    offset: int = Field(description="byte offset of `data` within this attempt's stream")
    length: int = Field(description="size of `data` in bytes, before any encoding")
    cursor: str = Field(description="pass as `?cursor=` to read what comes after this chunk")
    data: str = Field(description="the bytes: UTF-8 with invalid bytes replaced, or base64 with `?encoding=base64`")


class LogsOut(BaseModel):
    """A page of a task's output. Follow it with `?cursor=<next_cursor>` (or `?after=<next_after>`)
    until a page has no chunks; `terminal` says whether more can still come."""

    chunks: list[LogChunkOut]
    next_after: int = Field(description="the id of the last chunk returned (or the `after` given)")
    next_cursor: str | None = Field(description="the cursor of the last chunk returned (or the one given)")
    task_state: str
    terminal: bool


class ResourcesOut(BaseModel):
    cpu_millis: int
    memory_bytes: int
    disk_bytes: int
    gpus: int
    slots: int


class NodeOut(BaseModel):
    id: str
    name: str
    health: str
    connected: bool
    draining: bool
    # active (takes work), draining (no new work; some still on it) or drained (nothing on it: safe to power off)
    drain_phase: str = "active"
    # past it, what still runs on the draining node is requeued or lost by its node-loss policy
    drain_deadline: datetime | None = None
    # counts the operator's changes (labels, drain); also the ETag. If-Match on a label change.
    revision: int = 1
    pool: str
    arch: str
    labels: dict[str, str]
    capabilities: list[str]
    backends: list[str]
    allocatable: ResourcesOut
    reserved: ResourcesOut
    last_heartbeat_at: datetime | None
    agent_version: str
    artifacts: list[str]
    protocol_min: int
    protocol_max: int
    gpu_indexes: list[int]
    egress_contexts: list[str]
    enforces_limits: bool  # its sandboxes enforce CPU and memory as limits
    releasing: ResourcesOut  # held by ended attempts until their sandboxes are proven gone (within reserved)
    instance_id: str | None = None  # the agent process that presents this node now
    # how many tasks it prepares (pulls, creates) at once: an attempt is one until it runs
    max_operations: int = 4
    # per backend, what the node would materialize a task with (seed MaterializationSnapshot):
    # backend_kind, architecture, runtime_digest, toolchain_digest, digest (of the artifacts held)
    materializations: list[dict[str, str]] = []



class NodeEventOut(BaseModel):
    """Something that happened to a node: an agent instance superseded, attempts handed over."""

    id: int  # increasing: pass the last one seen as `after` for the next page
    at: datetime
    kind: str
    message: str
    detail: dict[str, Any]


class VerdictOut(BaseModel):
    node_id: str
    name: str
    fits: bool
    failed: str | None  # the first check this node fails for the task
    score: float | None  # higher is better, when it fits
    avoided: bool  # an earlier attempt of this task failed there
    health: str | None = None  # online | unreachable | offline, as the node's heartbeats say
    holds: list[str] = []  # the preferred artifacts (its pinned image digest first) the node holds: tried first


class ExplainOut(BaseModel):
    task_id: uuid.UUID
    state: str
    reason: str | None
    node_id: str | None
    nodes: list[VerdictOut]


class CheckOut(BaseModel):
    """A dry run's answer: could any node of the fleet ever run this spec (nothing is stored)."""

    runnable: bool
    reason: str | None  # reasons.NO_COMPATIBLE_RUNNER when no node ever could
    # every node, judged as if online, undrained and empty: `failed` is the first hard check it
    # fails; `health` is what it is now
    nodes: list[VerdictOut]


class LabelsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    labels: dict[str, str]

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return validate_labels(v)


class NamedSpecOut(BaseModel):
    name: str
    revision: int
    spec: dict[str, Any]
    created_at: datetime
    created_by: str


class SubmitNamedIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    revision: int | None = Field(default=None, ge=1, description="refuse unless this is the current revision")
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)


class BatchIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks: list[SubmitRequest] = Field(min_length=1, max_length=MAX_BATCH)


class TokenIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    role: Role


class TokenOut(BaseModel):
    id: str
    name: str
    role: str
    created_at: datetime
    created_by: str
    revoked_at: datetime | None


class TokenCreated(TokenOut):
    token: str  # shown once


class SecretIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: str = Field(min_length=1, max_length=64 * 1024)


class RegistryLoginIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    username: str = Field(min_length=1, max_length=256)
    password: str = Field(min_length=1, max_length=4096)


class SecretOut(BaseModel):
    name: str
    version: int
    created_at: datetime
    updated_at: datetime
    updated_by: str


class AuditOut(BaseModel):
    id: int
    at: datetime
    actor: str
    action: str
    target: str | None
    detail: dict[str, Any]


class ErrorOut(BaseModel):
    error: str
    candidates: list[str] | None = None  # an ambiguous id prefix (409): the ids it could mean


def task_out(r: TaskRow, last_node: tuple[str, str | None] | None = None) -> TaskOut:
    """A task row as the API shows it; `last_node` is (id, name) of its latest attempt's node."""
    return TaskOut(
        id=r.id, name=r.name, state=r.state, reason=r.reason, terminal=TaskState(r.state) in TERMINAL,
        exit_code=r.exit_code, node_id=r.node_id, fencing_token=r.fencing_token, attempts=r.attempts,
        max_attempts=r.max_attempts, priority=r.priority, created_at=r.created_at, updated_at=r.updated_at,
        finished_at=r.finished_at, lease_expires_at=r.lease_expires_at, accept_deadline=r.accept_deadline,
        idempotency_key=r.idempotency_key, spec_name=r.spec_name, spec_revision=r.spec_revision, spec=r.spec,
        last_node_id=last_node[0] if last_node else None, last_node_name=last_node[1] if last_node else None,
        reason_detail=r.reason_detail, image=r.image, image_digest=r.image_digest, resolved_at=r.resolved_at,
        revision=r.revision,
    )  # fmt: skip


def attempt_out(r: AttemptRow) -> AttemptOut:
    # the operation deadline is the attempt's accept deadline under the seed's name
    return AttemptOut.model_validate(r, from_attributes=True).model_copy(update={"operation_deadline": r.accept_deadline})


def event_out(r: TaskEventRow) -> EventOut:
    return EventOut.model_validate(r, from_attributes=True)


def node_out(r: NodeRow, releasing: ReleasingRow | None = None) -> NodeOut:
    held = (
        ResourcesOut(cpu_millis=0, memory_bytes=0, disk_bytes=0, gpus=0, slots=0)
        if releasing is None
        else ResourcesOut.model_validate(releasing, from_attributes=True)
    )
    return NodeOut(
        id=r.id, name=r.name, health=r.health, connected=r.connected, draining=r.draining,
        pool=r.pool, arch=r.arch, labels=r.labels, capabilities=list(r.capabilities),
        backends=list(r.backends),
        allocatable=ResourcesOut(cpu_millis=r.alloc_cpu_millis, memory_bytes=r.alloc_memory_bytes,
                                 disk_bytes=r.alloc_disk_bytes, gpus=r.alloc_gpus, slots=r.alloc_slots),
        reserved=ResourcesOut(cpu_millis=r.res_cpu_millis, memory_bytes=r.res_memory_bytes,
                              disk_bytes=r.res_disk_bytes, gpus=r.res_gpus, slots=r.res_slots),
        last_heartbeat_at=r.last_heartbeat_at, agent_version=r.agent_version, artifacts=list(r.artifacts),
        protocol_min=r.protocol_min, protocol_max=r.protocol_max, gpu_indexes=list(r.gpu_indexes),
        egress_contexts=list(r.egress_contexts), enforces_limits=r.enforces_limits,
        releasing=held,
        instance_id=r.instance_id,
        drain_phase=r.drain_phase or ("draining" if r.draining else "active"),
        drain_deadline=r.drain_deadline, revision=r.revision,
        max_operations=r.max_operations, materializations=list(r.materializations),
    )  # fmt: skip


def named_spec_out(r: NamedSpecRow) -> NamedSpecOut:
    return NamedSpecOut.model_validate(r, from_attributes=True)
