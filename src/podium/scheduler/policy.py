"""What each thing that happens to a task means, as pure functions of what is stored.

Nothing here reads a clock, a database or a socket. Each function returns a `Step` — the transition
to attempt, with its reason and what happens to the attempt — or None when the happening changes
nothing. The service applies a Step through `Store.transition_task` with the `from` it read, so two
deciders racing on one task give one accepted transition and one rejected no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

from podium import reasons
from podium.states import AttemptState, TaskState
from podium.timing import Timing

S = TaskState
A = AttemptState

NO_LEASE = -1.0  # lease_seconds meaning "no lease of its own: held while the node is healthy"


@dataclass(frozen=True, slots=True)
class Step:
    to: TaskState
    reason: str | None = None
    end_attempt: AttemptState | None = None  # close the current attempt, freeing its capacity
    attempt_state: AttemptState | None = None  # or move it forward
    lease_seconds: float | None = None  # None: keep; NO_LEASE: clear; else now() + this
    stop: bool = False  # tell the node to stop the attempt
    exit_code: int | None = None


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


# Event kinds as the node sends them (podium.v1 TaskEvent.Kind), by name.
PROVISIONING = "PROVISIONING"
RUNNING = "RUNNING"
EXITED = "EXITED"
FAILED_RETRYABLE = "FAILED_RETRYABLE"
NOT_RUNNING = "NOT_RUNNING"

_LIVE = (S.ASSIGNED, S.PROVISIONING, S.RUNNING)


def on_node_event(task: TaskFacts, kind: str, exit_code: int | None, timing: Timing) -> Step | None:
    """A node's report about the attempt it holds (its fencing token already checked)."""
    st = task.state
    if kind == PROVISIONING:
        if st == S.ASSIGNED:
            return Step(S.PROVISIONING, attempt_state=A.PROVISIONING, lease_seconds=timing.lease_ttl)
        return None
    if kind == RUNNING:
        if st in (S.ASSIGNED, S.PROVISIONING):
            # Once running, the lease is the task's own timeout plus grace; with no timeout it is held
            # for as long as the node stays healthy (node health expires it).
            lease = task.timeout + timing.lease_grace if task.timeout else NO_LEASE
            return Step(S.RUNNING, attempt_state=A.RUNNING, lease_seconds=lease)
        return None
    if kind in (EXITED, NOT_RUNNING):
        if st in _LIVE:
            if kind == NOT_RUNNING:
                return on_node_loss(task, reasons.NODE_FORGOT)
            if exit_code == 0:
                return Step(S.SUCCEEDED, end_attempt=A.EXITED, exit_code=0)
            return Step(S.FAILED, reasons.EXITED_NONZERO, end_attempt=A.EXITED, exit_code=exit_code)
        if st == S.CANCELLING:
            return _stopped(task, exit_code)
        return None
    if kind == FAILED_RETRYABLE:
        if st in _LIVE:
            return on_retryable(task)
        if st == S.CANCELLING:
            return _stopped(task, None)
        return None
    raise ValueError(f"unknown event kind {kind!r}")


def on_retryable(task: TaskFacts) -> Step:
    """The node is finished with the task either way; the attempt budget decides if anybody else tries."""
    if task.attempts_left:
        return Step(S.QUEUED, reasons.RETRYABLE_ERROR, end_attempt=A.FAILED)
    return Step(S.FAILED, reasons.RETRYABLE_ERROR, end_attempt=A.FAILED)


def on_node_loss(task: TaskFacts, reason: str) -> Step | None:
    """The node-loss policy: requeue if the spec allows it and attempts remain, else lost."""
    if task.state == S.CANCELLING:
        # A task being stopped whose node is gone is stopped: that is what the cancel asked for.
        return _stopped(task, None, end=A.LOST)
    if task.state not in _LIVE:
        return None
    if task.requeue_on_node_loss and task.attempts_left:
        return Step(S.QUEUED, reason, end_attempt=A.LOST, stop=True)
    return Step(S.LOST, reason, end_attempt=A.LOST, stop=True)


def on_accept_overdue(task: TaskFacts) -> Step | None:
    """The node did not say "provisioning" before the accept deadline: revoke the assignment."""
    if task.state != S.ASSIGNED:
        return None
    to = S.QUEUED if task.attempts_left else S.FAILED
    return Step(to, reasons.NOT_ACCEPTED, end_attempt=A.REVOKED, stop=True)


def on_cancel(task: TaskFacts, reason: str = reasons.CANCELLED) -> Step | None:
    """An operator's cancel (or the timeout, with reason TIMEOUT)."""
    if task.state == S.QUEUED:
        if reason == reasons.TIMEOUT:
            return None
        return Step(S.CANCELLED, reason)
    if task.state in _LIVE:
        return Step(S.CANCELLING, reason, stop=True)
    return None


def on_cancel_grace(task: TaskFacts) -> Step | None:
    """The node did not confirm a stop within CancelGrace: the server writes the end itself."""
    if task.state != S.CANCELLING:
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
    return Step(TaskState.FAILED, reason, end_attempt=AttemptState.REVOKED)


def _stopped(task: TaskFacts, exit_code: int | None, end: AttemptState = A.STOPPED) -> Step:
    if task.cancel_reason == reasons.TIMEOUT:
        return Step(S.FAILED, reasons.TIMEOUT, end_attempt=end, exit_code=exit_code)
    return Step(S.CANCELLED, reasons.CANCELLED, end_attempt=end, exit_code=exit_code)
