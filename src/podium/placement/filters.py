"""The hard-compatibility checks, one tiny function per reason, in the order `QUEUED_REASONS` lists
them: cheapest first, and the first one a node fails is the answer to "why not this node?".

The checks are split in two because the batch placer treats them differently:

* the *static* checks (pool … draining, reachable) read fields that many nodes share, so the
  placer runs them once per group of alike nodes (`group_key`) and requirement shape, not once per
  node;
* the *resource* checks read what is free, which changes with every placement in a batch.

Both `select_node` and the `Placer` call these same functions, which is what keeps the two exactly
equal. Nothing here may read a clock, do I/O or depend on the order of its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from podium import reasons

from .model import NodeSnapshot, Requirements, Resources

#: STAGE maps each queued reason to its position in the pipeline; when nothing fits, the reason is
#: the latest stage any node reached, i.e. the stage at which the candidate set became empty.
STAGE: dict[str, int] = {reason: i for i, reason in enumerate(reasons.QUEUED_REASONS)}

ONLINE = "online"
UNREACHABLE = "unreachable"


def is_available(node: NodeSnapshot) -> bool:
    """is_available is the NO_NODES stage: a node nobody holds a stream to, or that is offline,
    is not part of the fleet placement can talk about. A connected node that has merely stopped
    heartbeating (unreachable) passes here and fails the later UNREACHABLE stage, so that a frozen
    fleet is told as frozen, not as absent."""
    return node.connected and node.health in (ONLINE, UNREACHABLE)


# --- static checks: each returns True when the node passes ------------------------------------------


def _in_pool(req: Requirements, node: NodeSnapshot) -> bool:
    return req.pool is None or node.pool == req.pool


def _has_arch(req: Requirements, node: NodeSnapshot) -> bool:
    return req.arch is None or node.arch == req.arch


def _offers_backend(req: Requirements, node: NodeSnapshot) -> bool:
    return req.backend in node.backends


def _speaks_protocol(req: Requirements, node: NodeSnapshot) -> bool:
    return node.protocol_min <= req.protocol <= node.protocol_max


def _carries_labels(req: Requirements, node: NodeSnapshot) -> bool:
    labels = node.labels
    return all(labels.get(key) == value for key, value in req.labels.items())


def _has_capabilities(req: Requirements, node: NodeSnapshot) -> bool:
    return req.capabilities <= node.capabilities


def _provides_egress(req: Requirements, node: NodeSnapshot) -> bool:
    return req.egress is None or req.egress in node.egress_contexts


def _not_draining(req: Requirements, node: NodeSnapshot) -> bool:
    return not node.draining


def _reachable(req: Requirements, node: NodeSnapshot) -> bool:
    # After draining on purpose: a node that is draining will not take the task even when it
    # answers again, so "draining" is the truer sentence for it; and before the resource checks,
    # whose sentences speak of online nodes.
    return node.health == ONLINE


#: STATIC_CHECKS is the static half of the pipeline, in reason order. Every field these read but
#: the labels is part of `group_key`, which is what lets the placer check a whole group at once.
STATIC_CHECKS: tuple[tuple[str, Callable[[Requirements, NodeSnapshot], bool]], ...] = (
    (reasons.NO_POOL, _in_pool),
    (reasons.NO_ARCH, _has_arch),
    (reasons.NO_BACKEND, _offers_backend),
    (reasons.NO_PROTOCOL, _speaks_protocol),
    (reasons.NO_LABELS, _carries_labels),
    (reasons.NO_CAPABILITY, _has_capabilities),
    (reasons.NO_EGRESS, _provides_egress),
    (reasons.ALL_DRAINING, _not_draining),
    (reasons.UNREACHABLE, _reachable),
)

GroupKey = tuple[str, str, frozenset[str], int, int, frozenset[str], bool, str, frozenset[str]]


def group_key(node: NodeSnapshot) -> GroupKey:
    """group_key groups nodes that every static check but the label check treats identically.

    Labels are left out on purpose: fleets often label each node with something unique (its host
    name), which would make every node its own group; the placer matches labels through an index
    instead. If a new static check reads another field, that field must be added here too, or the
    placer will disagree with select_node.
    """
    return (
        node.pool,
        node.arch,
        node.backends,
        node.protocol_min,
        node.protocol_max,
        node.capabilities,
        node.draining,
        node.health,
        node.egress_contexts,
    )


def static_failure(req: Requirements, node: NodeSnapshot, skip_labels: bool = False) -> str | None:
    """static_failure is the first static check the node fails, or None; with skip_labels, the
    label check is left to the caller (see `group_key`)."""
    for reason, passes in STATIC_CHECKS:
        if skip_labels and passes is _carries_labels:
            continue
        if not passes(req, node):
            return reason
    return None


# --- resource checks ---------------------------------------------------------------------------------

#: Free is (cpu_millis, memory_bytes, disk_bytes, gpus, slots, operations), a plain tuple because
#: the placer compares it millions of times per second. Operations are the node's provisioning
#: operations (pulls, creates) not in use: every task needs one until its attempt runs.
Free = tuple[int, int, int, int, int, int]


def free_of(node: NodeSnapshot) -> Free:
    """free_of is what is left on the node. A negative reservation (a bookkeeping bug upstream) is
    read as zero so that "fits in what is free" always implies "fits in the node at all": the
    TOO_LARGE stage then never hides behind a later one. (Written out without max() because the
    placer calls it for every node of every tick.)"""
    a, r = node.allocatable, node.reserved
    gpu_free = node.gpu_free
    gpus = a.gpus - (r.gpus if r.gpus > 0 else 0)
    listed = len(set(gpu_free)) if gpu_free else 0
    return (
        a.cpu_millis - (r.cpu_millis if r.cpu_millis > 0 else 0),
        a.memory_bytes - (r.memory_bytes if r.memory_bytes > 0 else 0),
        a.disk_bytes - (r.disk_bytes if r.disk_bytes > 0 else 0),
        listed if listed < gpus else gpus,
        a.slots - (r.slots if r.slots > 0 else 0),
        node.max_operations - (node.operations if node.operations > 0 else 0),
    )


def placeable_at_most(nodes: Iterable[NodeSnapshot], smallest: Resources | None = None) -> int:
    """placeable_at_most bounds how many tasks these nodes can take now, whatever the tasks ask:
    every placement takes one slot and one provisioning operation (`need_of`) of a node that passes
    the availability, draining and reachability checks. The dispatcher claims no more queued tasks
    than this (plus those no such node could run at all), so the bound must never be low.

    With `smallest`, the bound is for tasks that ask at least that much CPU and memory: a node whose
    CPU binds before its slots do (the usual case: 100m a task, slots set high) takes only as many.
    For a task asking less than `smallest` it may be low: the caller says when that is acceptable."""
    cpu = smallest.cpu_millis if smallest is not None and smallest.cpu_millis > 0 else 0
    mem = smallest.memory_bytes if smallest is not None and smallest.memory_bytes > 0 else 0
    total = 0
    for node in nodes:
        if node.connected and node.health == ONLINE and not node.draining:
            free = free_of(node)
            room = free[4] if free[4] < free[5] else free[5]
            if cpu and free[0] // cpu < room:
                room = free[0] // cpu
            if mem and free[1] // mem < room:
                room = free[1] // mem
            if room > 0:
                total += room
    return total


def need_of(resources: Resources) -> Free:
    """need_of is a request in the same shape as `free_of`."""
    return (
        resources.cpu_millis,
        resources.memory_bytes,
        resources.disk_bytes,
        resources.gpus,
        resources.slots,
        1,  # one provisioning operation
    )


def fits(need: Free, free: Free) -> bool:
    """fits is the whole resource half of the pipeline in one comparison; it is true exactly when
    `resource_failure` is None (given `free_of`'s clamping)."""
    return (
        need[0] <= free[0]
        and need[1] <= free[1]
        and need[2] <= free[2]
        and need[3] <= free[3]
        and need[4] <= free[4]
        and need[5] <= free[5]
    )


def resource_failure(need: Free, node: NodeSnapshot, free: Free) -> str | None:
    """resource_failure is the first resource stage the node fails, or None."""
    a = node.allocatable
    if not (
        need[0] <= a.cpu_millis
        and need[1] <= a.memory_bytes
        and need[2] <= a.disk_bytes
        and need[3] <= a.gpus
        and need[4] <= a.slots
    ):
        return reasons.TOO_LARGE
    if need[0] > free[0] or need[1] > free[1]:
        return reasons.NO_ROOM
    if need[2] > free[2]:
        return reasons.NO_DISK
    if need[3] > free[3]:
        return reasons.NO_GPU
    if need[4] > free[4]:
        return reasons.FULL
    if need[5] > free[5]:
        return reasons.OPERATIONS_BUSY
    return None


def first_failure(req: Requirements, node: NodeSnapshot) -> str | None:
    """first_failure runs the whole pipeline on one node: the reason of the first check it fails,
    or None when the task may run there."""
    if not is_available(node):
        return reasons.NO_NODES
    if req.home_node is not None and node.id != req.home_node:
        return reasons.HOME_UNAVAILABLE
    failed = static_failure(req, node)
    if failed is not None:
        return failed
    return resource_failure(need_of(req.resources), node, free_of(node))


def lowest_gpus(node: NodeSnapshot, count: int) -> tuple[int, ...]:
    """lowest_gpus picks the lowest free device indexes, so the choice is reproducible and the
    same devices are handed out first on every node."""
    if count <= 0:
        return ()
    return tuple(sorted(set(node.gpu_free))[:count])
