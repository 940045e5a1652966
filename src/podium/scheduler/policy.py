"""What each thing that happens to a task means, as pure functions of what is stored.

Nothing here reads a clock, a database or a socket. Each function returns a `Step` — the transition
to attempt, with its reason and what happens to the attempt — or None when the happening changes
nothing. A step that ends an attempt also says what class of end it was (`podium.failures`), so the
class is written in the same compare-and-set as the end. `scheduler.apply.Applier` applies a Step
with the `from` it read, so two deciders racing on one task give one accepted transition and one
rejected no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

from podium import failures, reasons
from podium.failures import FailureClass
from podium.protocol import EXITED, FAILED_RETRYABLE, NOT_RUNNING, PROVISIONING, RUNNING
from podium.states import AttemptState, TaskState
from podium.timing import Timing

HELD_BY_NODE_HEALTH = -1.0  # lease_seconds meaning "no lease of its own: held while the node is healthy"


@dataclass(frozen=True, slots=True)
class Step:
    to: TaskState
    reason: str | None = None
    end_attempt: AttemptState | None = None  # close the current attempt, freeing its capacity
    attempt_state: AttemptState | None = None  # or move it forward
    lease_seconds: float | None = None  # None: keep; HELD_BY_NODE_HEALTH: clear; else now() + this
    stop: bool = False  # tell the node to stop the attempt
    exit_code: int | None = None
    failure_class: FailureClass | None = None  # what kind of end this is; None for a success
    detail: str | None = None  # the node's or engine's own words, stored beside the reason
    # The node-loss policy gives up on the node: free a container attempt's capacity with its end,
    # without waiting for a release proof that can no longer come.
    release: bool = False


@dataclass(frozen=True, slots=True)
class TaskFacts:
    """What the deciders need to know about a task, as read from its row."""

    state: TaskState
    attempts: int = 1
    max_attempts: int = 1
    requeue_on_node_loss: bool = True
    timeout: float | None = None
    cancel_reason: str | None = None

    @property
    def attempts_left(self) -> bool:
        return self.attempts < self.max_attempts



_LIVE = (TaskState.ASSIGNED, TaskState.PROVISIONING, TaskState.RUNNING)


#: The node-loss reasons under which the node is known to hold nothing of the attempt any more: it is
#: offline (and fenced), removed from the fleet, said itself that it has no such attempt, or the agent
#: process that ran it was replaced and its fence deadline has passed (a replacement on another host
#: could never prove its predecessor's sandbox removed). A lease that merely expired on a node still
#: talking is not one: its sandbox may still be there.
_GONE = frozenset({reasons.NODE_LOST, reasons.NODE_REVOKED, reasons.NODE_FORGOT, reasons.INSTANCE_REPLACED})


def on_node_event(
    task: TaskFacts,
    kind: str,
    exit_code: int | None,
    timing: Timing,
    *,
    failure_class: str = "",
    message: str = "",
) -> Step | None:
    """A node's report about the attempt it holds (its fencing token already checked), with the
    node's class for an end and its words about it."""
    st = task.state
    if kind == PROVISIONING:
        if st == TaskState.ASSIGNED:
            return Step(TaskState.PROVISIONING, attempt_state=AttemptState.PROVISIONING, lease_seconds=timing.lease_ttl)
        return None
    if kind == RUNNING:
        if st in (TaskState.ASSIGNED, TaskState.PROVISIONING):
            # Once running, the lease is the task's own timeout plus grace; with no timeout it is held
            # for as long as the node stays healthy (node health expires it).
            lease = task.timeout + timing.lease_grace if task.timeout else HELD_BY_NODE_HEALTH
            return Step(TaskState.RUNNING, attempt_state=AttemptState.RUNNING, lease_seconds=lease)
        return None
    if kind in (EXITED, NOT_RUNNING):
        if st in _LIVE:
            if kind == NOT_RUNNING:
                return on_node_loss(task, reasons.NODE_FORGOT)
            return _exited(exit_code, failures.from_node(failure_class), failures.detail(message))
        if st == TaskState.CANCELLING:
            return _stopped(task, exit_code, detail=failures.detail(message))
        return None
    if kind == FAILED_RETRYABLE:
        if st in _LIVE:
            return on_retryable(task, failure_class, message)
        if st == TaskState.CANCELLING:
            return _stopped(task, None, detail=failures.detail(message))
        return None
    raise ValueError(f"unknown event kind {kind!r}")


def _exited(exit_code: int | None, cls: FailureClass | None, detail: str | None) -> Step:
    """An end the node reports as final: the node's class names it when it has one (an OOM kill, a
    sandbox it could not prepare), else the exit code does."""
    if cls == failures.OOM:
        return Step(TaskState.FAILED, reasons.OOM, end_attempt=AttemptState.EXITED, exit_code=exit_code, failure_class=cls, detail=detail)
    if cls == failures.PROVISIONING:
        return Step(TaskState.FAILED, reasons.PROVISIONING_FAILED, end_attempt=AttemptState.FAILED, exit_code=exit_code,
                    failure_class=cls, detail=detail)  # fmt: skip
    if cls == failures.INTERNAL:
        return Step(
            TaskState.FAILED, reasons.NODE_ERROR, end_attempt=AttemptState.FAILED, exit_code=exit_code, failure_class=cls, detail=detail
        )
    if exit_code == 0:
        return Step(TaskState.SUCCEEDED, end_attempt=AttemptState.EXITED, exit_code=0, detail=detail)
    return Step(TaskState.FAILED, reasons.EXITED_NONZERO, end_attempt=AttemptState.EXITED, exit_code=exit_code,
                failure_class=failures.EXIT, detail=detail)  # fmt: skip


def on_retryable(task: TaskFacts, failure_class: str = "", message: str = "") -> Step:
    """The node is finished with the task either way; the attempt budget decides if anybody else tries.
    A sandbox the node could not prepare (a pull, a create) is `provisioning`; anything else it could
    not do is `internal`."""
    cls = failures.from_node(failure_class)
    if cls == failures.PROVISIONING:
        reason = reasons.PROVISIONING_FAILED
    elif cls == failures.OOM:
        reason = reasons.OOM
    else:
        cls, reason = failures.INTERNAL, reasons.RETRYABLE_ERROR
    to = TaskState.QUEUED if task.attempts_left else TaskState.FAILED
    return Step(to, reason, end_attempt=AttemptState.FAILED, failure_class=cls, detail=failures.detail(message))


def on_node_loss(task: TaskFacts, reason: str) -> Step | None:
    """The node-loss policy: requeue if the spec allows it and attempts remain, else lost."""
    gone = reason in _GONE
    if task.state == TaskState.CANCELLING:
        # A task being stopped whose node is gone is stopped: that is what the cancel asked for.
        return _stopped(task, None, end=AttemptState.LOST, release=gone)
    if task.state not in _LIVE:
        return None
    to = TaskState.QUEUED if task.requeue_on_node_loss and task.attempts_left else TaskState.LOST
    return Step(to, reason, end_attempt=AttemptState.LOST, stop=True, failure_class=failures.NODE_LOST, release=gone)


def on_accept_overdue(task: TaskFacts) -> Step | None:
    """The node did not say "provisioning" before the accept deadline: revoke the assignment."""
    if task.state != TaskState.ASSIGNED:
        return None
    to = TaskState.QUEUED if task.attempts_left else TaskState.FAILED
    return Step(to, reasons.NOT_ACCEPTED, end_attempt=AttemptState.REVOKED, stop=True, failure_class=failures.NOT_ACCEPTED)


def on_cancel(task: TaskFacts, reason: str = reasons.CANCELLED) -> Step | None:
    """An operator's cancel (or the timeout, with reason TIMEOUT)."""
    if task.state == TaskState.QUEUED:
        if reason == reasons.TIMEOUT:
            return None
        return Step(TaskState.CANCELLED, reason, failure_class=failures.CANCELLED)
    if task.state in _LIVE:
        return Step(TaskState.CANCELLING, reason, stop=True)
    return None


def on_cancel_grace(task: TaskFacts) -> Step | None:
    """The node did not confirm a stop within CancelGrace: the server writes the end itself."""
    if task.state != TaskState.CANCELLING:
        return None
    return _stopped(task, None)


# Why an Assign could not be sent, as the gateway names it (the policy says what it means).
SECRET_GONE = "secret_gone"  # a secret the spec names was deleted after the submission
SECRET_UNREADABLE = "secret_unreadable"  # a stored secret cannot be decrypted with this server's key
STORE_UNAVAILABLE = "store_unavailable"  # the secrets could not be read at all: nothing is known


def on_undeliverable(task: TaskFacts, problem: str) -> Step | None:
    """An Assign whose secrets could not be resolved just before it was to be sent.

    Only a secret that is gone may be told as missing. A store that could not be asked says nothing
    about the secret: no step, the gateway sends the Assign again once it can read (the task must
    neither fail nor lose its attempt over a blip). A value this server cannot decrypt is told as
    what it is, and fails the task like a missing one: the key is the operator's to fix, every
    replica must hold the same one, and no retry here can decrypt it (docs/decisions.md).
    """
    if problem == STORE_UNAVAILABLE:
        return None
    if problem not in (SECRET_GONE, SECRET_UNREADABLE):
        raise ValueError(f"unknown delivery problem {problem!r}")
    if task.state != TaskState.ASSIGNED:
        return None  # the attempt moved on (cancelled, revoked): nothing left to fail
    reason = reasons.SECRET_MISSING if problem == SECRET_GONE else reasons.SECRET_UNREADABLE
    # The Assign never left the server, so nothing of the attempt exists on the node to prove
    # removed: its capacity is released with the end.
    return Step(TaskState.FAILED, reason, end_attempt=AttemptState.REVOKED, failure_class=failures.PROVISIONING,
                release=True)  # fmt: skip


def on_image_unresolvable(task: TaskFacts, reason: str, words: str | None) -> Step | None:
    """The image's registry answered that there is no such image, or refused the credentials (the
    error's `reason`, its words beside it): asking again will not change that, so the queued task fails."""
    if task.state != TaskState.QUEUED:
        return None
    return Step(TaskState.FAILED, reason, failure_class=failures.PROVISIONING, detail=failures.detail(words))


def on_invariant_broken() -> Step:
    """A task on a node-state with no node or no token: nothing a node or operator did; fail it."""
    return Step(TaskState.FAILED, reasons.NO_LEASE, end_attempt=AttemptState.LOST, stop=True, failure_class=failures.INTERNAL)


#: Why the watchdog found a task on a node it can no longer count on, as the store names it.
_LOST_WHY = {"offline": reasons.NODE_LOST, "revoked": reasons.NODE_REVOKED, "lease": reasons.LEASE_EXPIRED}


def on_lost(task: TaskFacts, why: str | None) -> Step | None:
    """The watchdog found the task's node offline or removed, or its lease expired: the node-loss
    policy. With no such cause (`why` None) the task is on a node-state with no node and no lease: an
    invariant broken somewhere."""
    reason = _LOST_WHY.get(why) if why is not None else None
    if reason is None:
        return on_invariant_broken()
    return on_node_loss(task, reason)


def _stopped(
    task: TaskFacts, exit_code: int | None, end: AttemptState = AttemptState.STOPPED, *, detail: str | None = None, release: bool = False
) -> Step:
    if task.cancel_reason == reasons.TIMEOUT:
        return Step(TaskState.FAILED, reasons.TIMEOUT, end_attempt=end, exit_code=exit_code, failure_class=failures.TIMEOUT,
                    detail=detail, release=release)  # fmt: skip
    return Step(TaskState.CANCELLED, reasons.CANCELLED, end_attempt=end, exit_code=exit_code, failure_class=failures.CANCELLED,
                detail=detail, release=release)  # fmt: skip


# ---- the reconcile loop ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReconcileFacts:
    """One claimed attempt, its task and its node, as read by the claim."""

    task: TaskFacts
    current: bool  # the attempt is its task's current one (same fencing token, task on a node)
    attempt_state: str  # assigned, provisioning, running
    node_removed: bool
    node_health: str  # online, unreachable, offline
    node_connected: bool
    in_handover: bool  # another agent instance took the node over and the old one's fence deadline has not passed
    # the node said "provisioning" for it before its last Hello, so that Hello had to list it
    before_hello: bool
    in_hello: bool  # the node's last Hello listed it
    runtime_changed: bool = False  # the node's runtime for its backend is not the one it was assigned under


@dataclass(frozen=True, slots=True)
class Reconciled:
    result: str  # one of the reasons.RECONCILED_* sentences
    step: Step | None  # the transition to make, if any (a compare-and-set from the state read)
    next_in: float  # seconds until it is checked again


def on_reconcile(f: ReconcileFacts, timing: Timing) -> Reconciled:
    """What one check of an attempt against what its node last said decides. Node loss goes through
    the same node-loss policy the watchdog and the gateway use; anything in doubt waits (it is
    checked again soon) rather than giving an attempt away that may still run."""
    soon = timing.reconcile / 3
    if not f.current or f.task.state not in (*_LIVE, TaskState.CANCELLING):
        return Reconciled(reasons.RECONCILED_NOT_CURRENT, None, timing.reconcile)
    if f.node_removed:
        return Reconciled(reasons.RECONCILED_NODE_REMOVED, on_node_loss(f.task, reasons.NODE_REVOKED), soon)
    if f.node_health == "offline":
        return Reconciled(reasons.RECONCILED_NODE_OFFLINE, on_node_loss(f.task, reasons.NODE_LOST), soon)
    if f.in_handover:
        # the old instance may still run it: only its fence deadline may give it away (the watchdog's handover)
        return Reconciled(reasons.RECONCILED_HANDOVER, None, soon)
    if not f.node_connected:
        return Reconciled(reasons.RECONCILED_DISCONNECTED, None, soon)
    if f.node_health == "unreachable":
        return Reconciled(reasons.RECONCILED_UNREACHABLE, None, soon)
    if f.before_hello and not f.in_hello and f.attempt_state in (AttemptState.PROVISIONING, AttemptState.RUNNING):
        # it had the attempt when it last said Hello and did not list it: it no longer has it
        return Reconciled(reasons.RECONCILED_NODE_FORGOT, on_node_loss(f.task, reasons.NODE_FORGOT), soon)
    if f.runtime_changed:
        return Reconciled(reasons.RECONCILED_RUNTIME_CHANGED, None, timing.reconcile)
    return Reconciled(reasons.RECONCILED_CONSISTENT, None, timing.reconcile)


def runtime_changes(before: list[dict[str, str]], after: list[dict[str, str]]) -> list[tuple[str, str, str]]:
    """(backend kind, old runtime digest, new one) for every backend whose runtime a node's Hello says
    changed since its last one. A backend new to the node (or gone from it) is no change of runtime:
    nothing was assigned under one that it had before."""
    old = {m.get("backend_kind", ""): m.get("runtime_digest", "") for m in before}
    new = {m.get("backend_kind", ""): m.get("runtime_digest", "") for m in after}
    return [(k, old[k], new[k]) for k in sorted(old.keys() & new.keys()) if old[k] and new[k] and old[k] != new[k]]
