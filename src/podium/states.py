"""The states a task and a node can be in, and which task transitions are allowed at all.

The store enforces each transition as a compare-and-set with an explicit `from`; this table is what
decides whether a pair is legal in the first place, so that a bug elsewhere is refused loudly instead
of writing a backward step into history.
"""

from __future__ import annotations

from enum import StrEnum


class TaskState(StrEnum):
    QUEUED = "queued"              # waiting for placement; carries a reason
    ASSIGNED = "assigned"          # an attempt is written and pushed; the node has not yet accepted
    PROVISIONING = "provisioning"  # the node accepted and is preparing (workdir, image pull)
    RUNNING = "running"            # the command runs on the node
    CANCELLING = "cancelling"      # a stop was sent; waiting for the node or CancelGrace
    SUCCEEDED = "succeeded"        # exit code 0
    FAILED = "failed"              # exit ≠ 0, timeout, not accepted, no lease, no attempts left
    CANCELLED = "cancelled"        # an operator's cancel took effect
    LOST = "lost"                  # the node went away and the spec does not allow a requeue


TERMINAL = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED, TaskState.LOST})
# States in which the task occupies a node: an attempt exists and capacity is reserved.
ON_NODE = frozenset({TaskState.ASSIGNED, TaskState.PROVISIONING, TaskState.RUNNING, TaskState.CANCELLING})
ACTIVE = frozenset(TaskState) - TERMINAL

_S = TaskState
ALLOWED: frozenset[tuple[TaskState, TaskState]] = frozenset(
    {
        (_S.QUEUED, _S.ASSIGNED),
        (_S.QUEUED, _S.CANCELLED),
        (_S.QUEUED, _S.FAILED),  # e.g. cannot ever be placed, or an invariant check
        (_S.ASSIGNED, _S.PROVISIONING),
        (_S.ASSIGNED, _S.RUNNING),  # a node may report running without a separate provisioning
        (_S.PROVISIONING, _S.RUNNING),
    }
    | {(s, _S.QUEUED) for s in (_S.ASSIGNED, _S.PROVISIONING, _S.RUNNING)}  # revoked / node lost / retry
    | {(s, t) for s in (_S.ASSIGNED, _S.PROVISIONING, _S.RUNNING) for t in (_S.SUCCEEDED, _S.FAILED, _S.LOST)}
    | {(s, _S.CANCELLING) for s in (_S.ASSIGNED, _S.PROVISIONING, _S.RUNNING)}
    | {(_S.CANCELLING, t) for t in (_S.CANCELLED, _S.FAILED, _S.SUCCEEDED, _S.LOST)}
)


# the same pairs as the states' values: a check needs no conversion of its strings to members (four
# enum calls for each change a group commit makes, in the server's hottest loop)
_ALLOWED_VALUES = frozenset((a.value, b.value) for a, b in ALLOWED)


def is_allowed(from_: TaskState | str, to: TaskState | str) -> bool:
    """Whether `from_` → `to` is a transition of the lifecycle; False for a string that is no state."""
    return (str(from_), str(to)) in _ALLOWED_VALUES


class NodeHealth(StrEnum):
    ONLINE = "online"            # heartbeating
    UNREACHABLE = "unreachable"  # silent past UnreachableAfter; its tasks keep running
    OFFLINE = "offline"          # silent past OfflineAfter, or disconnected; its leases are expired


class AttemptState(StrEnum):
    ASSIGNED = "assigned"
    PROVISIONING = "provisioning"
    RUNNING = "running"
    EXITED = "exited"       # the node reported an exit code
    REVOKED = "revoked"     # the server took it back (not accepted in time, or stale)
    LOST = "lost"           # the node went away with it
    STOPPED = "stopped"     # cancelled or timed out, the end written by the node or by CancelGrace
    FAILED = "failed"       # the node reported an error that ended the run


ATTEMPT_LIVE = frozenset({AttemptState.ASSIGNED, AttemptState.PROVISIONING, AttemptState.RUNNING})
