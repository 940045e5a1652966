"""The values placement reads and returns: a node as the scheduler last saw it, what a task needs,
and the answer.

Every type is frozen: a snapshot is a fact about one instant, and the batch placer's own running
view is built from new snapshots (`NodeSnapshot.reserving`), never by mutating the caller's.
This module must never import anything that does I/O; it is shared by the scheduler, the API and
the CLI's "why is this queued?" view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: Policy: put the task where the most capacity is left, so load and failures spread out.
SPREAD = "spread"
#: Policy: put the task on the fullest node that still fits, so whole nodes stay free for big tasks.
BINPACK = "binpack"
#: Every policy `select_node`, `explain` and `Placer` accept.
POLICIES = (SPREAD, BINPACK)


@dataclass(frozen=True, slots=True)
class Resources:
    """Resources is one amount per dimension; a request, a node's capacity and its reservations
    all use it so that "does it fit" is the same comparison everywhere."""

    cpu_millis: int = 0  # 1000 = one core
    memory_bytes: int = 0
    disk_bytes: int = 0
    gpus: int = 0
    slots: int = 0  # concurrent tasks

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu_millis + other.cpu_millis,
            self.memory_bytes + other.memory_bytes,
            self.disk_bytes + other.disk_bytes,
            self.gpus + other.gpus,
            self.slots + other.slots,
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            self.cpu_millis - other.cpu_millis,
            self.memory_bytes - other.memory_bytes,
            self.disk_bytes - other.disk_bytes,
            self.gpus - other.gpus,
            self.slots - other.slots,
        )

    def fits_in(self, other: Resources) -> bool:
        """fits_in is true when no dimension of self exceeds the same dimension of other."""
        return (
            self.cpu_millis <= other.cpu_millis
            and self.memory_bytes <= other.memory_bytes
            and self.disk_bytes <= other.disk_bytes
            and self.gpus <= other.gpus
            and self.slots <= other.slots
        )

    def is_negative(self) -> bool:
        """is_negative catches a request that would *free* capacity when reserved, which is always
        a bug upstream and would silently over-commit a node."""
        return min(self.cpu_millis, self.memory_bytes, self.disk_bytes, self.gpus, self.slots) < 0


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """NodeSnapshot is everything placement may know about a node, read once per dispatch tick, so
    that the decision depends on these values and nothing else."""

    id: str
    name: str = ""
    connected: bool = True  # holds a stream to some server
    health: str = "online"  # "online" | "unreachable" | "offline"
    draining: bool = False
    pool: str = "default"
    arch: str = "x86_64"
    labels: Mapping[str, str] = field(default_factory=dict)  # treat as read-only
    capabilities: frozenset[str] = frozenset()
    backends: frozenset[str] = frozenset({"process"})
    protocol_min: int = 1
    protocol_max: int = 1
    allocatable: Resources = Resources()
    reserved: Resources = Resources()
    artifacts: frozenset[str] = frozenset()
    gpu_free: tuple[int, ...] = ()  # free GPU device indexes on this node
    # The network egress contexts the node can give a task ("none", "open"). A node that declares
    # nothing provides what any plain process has: an open network.
    egress_contexts: frozenset[str] = frozenset({"open"})
    # Capacity operations (seed Capacity.Operations): how many provisioning operations (pulls,
    # creates) the node runs at once, and how many it runs now (attempts assigned or provisioning).
    max_operations: int = 4
    operations: int = 0

    def __post_init__(self) -> None:
        # The placer hashes these; a plain set from a caller would break it but not select_node.
        if type(self.capabilities) is not frozenset:
            object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        if type(self.egress_contexts) is not frozenset:
            object.__setattr__(self, "egress_contexts", frozenset(self.egress_contexts))
        if type(self.backends) is not frozenset:
            object.__setattr__(self, "backends", frozenset(self.backends))
        if type(self.artifacts) is not frozenset:
            object.__setattr__(self, "artifacts", frozenset(self.artifacts))

    def capability_snapshot(self) -> dict[str, object]:
        """What placement knew of the node's capabilities when it chose it, as plain JSON: an
        assignment keeps it, so a placement can be audited after the node has changed."""
        return {
            "pool": self.pool,
            "arch": self.arch,
            "labels": dict(self.labels),
            "capabilities": sorted(self.capabilities),
            "backends": sorted(self.backends),
            "egress_contexts": sorted(self.egress_contexts),
            "protocol": [self.protocol_min, self.protocol_max],
            "max_operations": self.max_operations,
        }

    def reserving(self, resources: Resources, gpu_indexes: tuple[int, ...] = ()) -> NodeSnapshot:
        """reserving is this node after a placement, so a caller (and the batch placer) can ask the
        next question against exactly what the previous answer left behind."""
        gpu_free = self.gpu_free
        if gpu_indexes:
            taken = set(gpu_indexes)
            gpu_free = tuple(i for i in gpu_free if i not in taken)
        # every placement is one more operation until its attempt runs
        return self.using(self.reserved + resources, gpu_free, self.operations + 1)

    def using(self, reserved: Resources, gpu_free: tuple[int, ...], operations: int) -> NodeSnapshot:
        """using is this node with these reservations, free GPUs and operations, every other field
        as it is: after a placement, or as the database says it is now when nothing else changed.

        Spelt out rather than dataclasses.replace(), which costs several times more and runs once
        per placement in the batch placer and once per changed node in every dispatch pass. A new
        field must be added here too (a test checks that every other field survives)."""
        return NodeSnapshot(
            self.id,
            self.name,
            self.connected,
            self.health,
            self.draining,
            self.pool,
            self.arch,
            self.labels,
            self.capabilities,
            self.backends,
            self.protocol_min,
            self.protocol_max,
            self.allocatable,
            reserved,
            self.artifacts,
            gpu_free,
            self.egress_contexts,
            self.max_operations,
            operations,
        )


@dataclass(frozen=True, slots=True)
class Requirements:
    """Requirements are the hard constraints of one task plus its soft wishes: locality, and
    staying away from the nodes its earlier attempts failed on."""

    resources: Resources = Resources(slots=1)
    labels: Mapping[str, str] = field(default_factory=dict)  # every one must match exactly
    pool: str | None = None
    arch: str | None = None
    capabilities: frozenset[str] = frozenset()
    backend: str = "process"
    protocol: int = 1  # must be within [protocol_min, protocol_max]
    preferred_artifacts: tuple[str, ...] = ()
    home_node: str | None = None
    # Nodes an earlier attempt of this task was lost on, revoked from or failed on. A soft wish:
    # they rank after every other fitting node, and are still used when nothing else fits (a
    # one-node fleet must still be able to retry).
    avoid_nodes: frozenset[str] = frozenset()
    # The network egress the task needs ("none", "open"), or None for no requirement.
    egress: str | None = None

    def __post_init__(self) -> None:
        if type(self.avoid_nodes) is not frozenset:
            object.__setattr__(self, "avoid_nodes", frozenset(self.avoid_nodes))
        if type(self.capabilities) is not frozenset:
            object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        if type(self.preferred_artifacts) is not tuple:
            object.__setattr__(self, "preferred_artifacts", tuple(self.preferred_artifacts))
        if self.resources.is_negative():
            raise ValueError(f"requirements ask for a negative amount: {self.resources}")


@dataclass(frozen=True, slots=True)
class Placement:
    """Placement is a successful answer; the scheduler reserves exactly these GPU indexes."""

    node_id: str
    gpu_indexes: tuple[int, ...] = ()  # the lowest free indexes, len == resources.gpus
    score: float = 0.0


@dataclass(frozen=True, slots=True)
class Unplaceable:
    """Unplaceable carries the sentence stored on the queued task; it is always one of
    `podium.reasons.QUEUED_REASONS`, compared by equality."""

    reason: str


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    """NodeVerdict answers "why not this node?" for one node."""

    node_id: str
    failed: str | None  # the reason of the first check this node failed, or None if it fits
    score: float | None  # its score when it fits
    # the preferred artifacts (the task's pinned image digest first) this node holds: placement
    # tries such nodes before any other (locality), whatever their score
    holds: tuple[str, ...] = ()




def check_policy(policy: str) -> None:
    """check_policy fails loudly on a misspelt policy rather than quietly spreading."""
    if policy not in POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; expected one of {POLICIES}")
