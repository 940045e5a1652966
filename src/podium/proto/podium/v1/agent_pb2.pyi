from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentMessage(_message.Message):
    __slots__ = ("hello", "heartbeat", "event", "log", "released", "inventory", "batch")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    INVENTORY_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    heartbeat: Heartbeat
    event: TaskEvent
    log: LogChunk
    released: ReleaseProof
    inventory: Inventory
    batch: AgentBatch
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., event: _Optional[_Union[TaskEvent, _Mapping]] = ..., log: _Optional[_Union[LogChunk, _Mapping]] = ..., released: _Optional[_Union[ReleaseProof, _Mapping]] = ..., inventory: _Optional[_Union[Inventory, _Mapping]] = ..., batch: _Optional[_Union[AgentBatch, _Mapping]] = ...) -> None: ...

class AgentBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[AgentMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[AgentMessage, _Mapping]]] = ...) -> None: ...

class Resources(_message.Message):
    __slots__ = ("cpu_millis", "memory_bytes", "disk_bytes", "gpus", "slots")
    CPU_MILLIS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    cpu_millis: int
    memory_bytes: int
    disk_bytes: int
    gpus: int
    slots: int
    def __init__(self, cpu_millis: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., gpus: _Optional[int] = ..., slots: _Optional[int] = ...) -> None: ...

class RunningTask(_message.Message):
    __slots__ = ("task_id", "fencing_token", "phase")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    fencing_token: int
    phase: str
    def __init__(self, task_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., phase: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node_id", "name", "credential", "labels", "capacity", "backends", "pool", "arch", "capabilities", "artifacts", "protocol_min", "protocol_max", "tasks", "gpu_indexes", "agent_version", "instance_id", "egress_contexts", "enforces_limits", "max_operations", "materializations", "batches")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MIN_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MAX_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEXES_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EGRESS_CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    ENFORCES_LIMITS_FIELD_NUMBER: _ClassVar[int]
    MAX_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    MATERIALIZATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    name: str
    credential: str
    labels: _containers.ScalarMap[str, str]
    capacity: Resources
    backends: _containers.RepeatedScalarFieldContainer[str]
    pool: str
    arch: str
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    artifacts: _containers.RepeatedScalarFieldContainer[str]
    protocol_min: int
    protocol_max: int
    tasks: _containers.RepeatedCompositeFieldContainer[RunningTask]
    gpu_indexes: _containers.RepeatedScalarFieldContainer[int]
    agent_version: str
    instance_id: str
    egress_contexts: _containers.RepeatedScalarFieldContainer[str]
    enforces_limits: bool
    max_operations: int
    materializations: _containers.RepeatedCompositeFieldContainer[MaterializationSnapshot]
    batches: bool
    def __init__(self, node_id: _Optional[str] = ..., name: _Optional[str] = ..., credential: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., capacity: _Optional[_Union[Resources, _Mapping]] = ..., backends: _Optional[_Iterable[str]] = ..., pool: _Optional[str] = ..., arch: _Optional[str] = ..., capabilities: _Optional[_Iterable[str]] = ..., artifacts: _Optional[_Iterable[str]] = ..., protocol_min: _Optional[int] = ..., protocol_max: _Optional[int] = ..., tasks: _Optional[_Iterable[_Union[RunningTask, _Mapping]]] = ..., gpu_indexes: _Optional[_Iterable[int]] = ..., agent_version: _Optional[str] = ..., instance_id: _Optional[str] = ..., egress_contexts: _Optional[_Iterable[str]] = ..., enforces_limits: _Optional[bool] = ..., max_operations: _Optional[int] = ..., materializations: _Optional[_Iterable[_Union[MaterializationSnapshot, _Mapping]]] = ..., batches: _Optional[bool] = ...) -> None: ...

class MaterializationSnapshot(_message.Message):
    __slots__ = ("backend_kind", "architecture", "runtime_digest", "toolchain_digest", "digest")
    BACKEND_KIND_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOOLCHAIN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    backend_kind: str
    architecture: str
    runtime_digest: str
    toolchain_digest: str
    digest: str
    def __init__(self, backend_kind: _Optional[str] = ..., architecture: _Optional[str] = ..., runtime_digest: _Optional[str] = ..., toolchain_digest: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "running")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    seq: int
    running: int
    def __init__(self, seq: _Optional[int] = ..., running: _Optional[int] = ...) -> None: ...

class TaskEvent(_message.Message):
    __slots__ = ("task_id", "fencing_token", "kind", "exit_code", "message", "failure_class", "backend_ref")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[TaskEvent.Kind]
        PROVISIONING: _ClassVar[TaskEvent.Kind]
        RUNNING: _ClassVar[TaskEvent.Kind]
        EXITED: _ClassVar[TaskEvent.Kind]
        FAILED_RETRYABLE: _ClassVar[TaskEvent.Kind]
        NOT_RUNNING: _ClassVar[TaskEvent.Kind]
    KIND_UNSPECIFIED: TaskEvent.Kind
    PROVISIONING: TaskEvent.Kind
    RUNNING: TaskEvent.Kind
    EXITED: TaskEvent.Kind
    FAILED_RETRYABLE: TaskEvent.Kind
    NOT_RUNNING: TaskEvent.Kind
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_CLASS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_REF_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    fencing_token: int
    kind: TaskEvent.Kind
    exit_code: int
    message: str
    failure_class: str
    backend_ref: str
    def __init__(self, task_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., kind: _Optional[_Union[TaskEvent.Kind, str]] = ..., exit_code: _Optional[int] = ..., message: _Optional[str] = ..., failure_class: _Optional[str] = ..., backend_ref: _Optional[str] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("task_id", "fencing_token", "stream", "seq", "data", "offset")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    fencing_token: int
    stream: str
    seq: int
    data: bytes
    offset: int
    def __init__(self, task_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., stream: _Optional[str] = ..., seq: _Optional[int] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class ReleaseProof(_message.Message):
    __slots__ = ("task_id", "fencing_token", "backend_ref", "released_at")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BACKEND_REF_FIELD_NUMBER: _ClassVar[int]
    RELEASED_AT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    fencing_token: int
    backend_ref: str
    released_at: float
    def __init__(self, task_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., backend_ref: _Optional[str] = ..., released_at: _Optional[float] = ...) -> None: ...

class Inventory(_message.Message):
    __slots__ = ("artifacts",)
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    artifacts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, artifacts: _Optional[_Iterable[str]] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("welcome", "assign", "cancel", "ack", "drain", "heartbeat_ack", "accepted", "log_ack", "superseded", "batch")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_ACK_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOG_ACK_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    assign: Assign
    cancel: Cancel
    ack: Ack
    drain: Drain
    heartbeat_ack: HeartbeatAck
    accepted: Accepted
    log_ack: LogAck
    superseded: Superseded
    batch: ServerBatch
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., assign: _Optional[_Union[Assign, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., heartbeat_ack: _Optional[_Union[HeartbeatAck, _Mapping]] = ..., accepted: _Optional[_Union[Accepted, _Mapping]] = ..., log_ack: _Optional[_Union[LogAck, _Mapping]] = ..., superseded: _Optional[_Union[Superseded, _Mapping]] = ..., batch: _Optional[_Union[ServerBatch, _Mapping]] = ...) -> None: ...

class ServerBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ServerMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ServerMessage, _Mapping]]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("node_id", "server_id", "heartbeat_seconds", "kill_grace_seconds", "node_credential", "fence_after_seconds", "batches")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KILL_GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODE_CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    FENCE_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    server_id: str
    heartbeat_seconds: float
    kill_grace_seconds: float
    node_credential: str
    fence_after_seconds: float
    batches: bool
    def __init__(self, node_id: _Optional[str] = ..., server_id: _Optional[str] = ..., heartbeat_seconds: _Optional[float] = ..., kill_grace_seconds: _Optional[float] = ..., node_credential: _Optional[str] = ..., fence_after_seconds: _Optional[float] = ..., batches: _Optional[bool] = ...) -> None: ...

class SecretValue(_message.Message):
    __slots__ = ("env", "value")
    ENV_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    env: str
    value: str
    def __init__(self, env: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class RegistryCredential(_message.Message):
    __slots__ = ("registry", "username", "password")
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    registry: str
    username: str
    password: str
    def __init__(self, registry: _Optional[str] = ..., username: _Optional[str] = ..., password: _Optional[str] = ...) -> None: ...

class Assign(_message.Message):
    __slots__ = ("task_id", "attempt", "fencing_token", "spec_json", "secrets", "registries", "gpu_indexes")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    SECRETS_FIELD_NUMBER: _ClassVar[int]
    REGISTRIES_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEXES_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    attempt: int
    fencing_token: int
    spec_json: str
    secrets: _containers.RepeatedCompositeFieldContainer[SecretValue]
    registries: _containers.RepeatedCompositeFieldContainer[RegistryCredential]
    gpu_indexes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, task_id: _Optional[str] = ..., attempt: _Optional[int] = ..., fencing_token: _Optional[int] = ..., spec_json: _Optional[str] = ..., secrets: _Optional[_Iterable[_Union[SecretValue, _Mapping]]] = ..., registries: _Optional[_Iterable[_Union[RegistryCredential, _Mapping]]] = ..., gpu_indexes: _Optional[_Iterable[int]] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("task_id", "fencing_token", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    fencing_token: int
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("task_id", "fencing_token")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    fencing_token: int
    def __init__(self, task_id: _Optional[str] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("task_id", "fencing_token")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    fencing_token: int
    def __init__(self, task_id: _Optional[str] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class LogAck(_message.Message):
    __slots__ = ("task_id", "fencing_token", "stream", "seq")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    fencing_token: int
    stream: str
    seq: int
    def __init__(self, task_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., stream: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class Superseded(_message.Message):
    __slots__ = ("reason", "instance_id")
    REASON_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    reason: str
    instance_id: str
    def __init__(self, reason: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...
