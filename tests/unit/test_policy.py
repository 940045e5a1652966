"""The pure decisions of the scheduler: what every happening means for a task."""

import pytest

from podium import protocol, reasons
from podium.scheduler import policy
from podium.scheduler.policy import HELD_BY_NODE_HEALTH, TaskFacts
from podium.states import ALLOWED, AttemptState, TaskState
from podium.timing import DEFAULT_TIMING

S = TaskState
T = DEFAULT_TIMING


def f(state: TaskState, **kw: object) -> TaskFacts:
    return TaskFacts(state=state, **kw)  # type: ignore[arg-type]


def test_provisioning_then_running_set_the_leases() -> None:
    s = policy.on_node_event(f(S.ASSIGNED), protocol.PROVISIONING, None, T)
    assert s and s.to == S.PROVISIONING and s.lease_seconds == T.lease_ttl
    s = policy.on_node_event(f(S.PROVISIONING, timeout=100.0), protocol.RUNNING, None, T)
    assert s and s.to == S.RUNNING and s.lease_seconds == 100 + T.lease_grace
    s = policy.on_node_event(f(S.PROVISIONING), protocol.RUNNING, None, T)
    assert s and s.lease_seconds == HELD_BY_NODE_HEALTH


def test_exit_codes() -> None:
    ok = policy.on_node_event(f(S.RUNNING), protocol.EXITED, 0, T)
    assert ok and ok.to == S.SUCCEEDED and ok.end_attempt == AttemptState.EXITED and ok.exit_code == 0
    bad = policy.on_node_event(f(S.RUNNING), protocol.EXITED, 3, T)
    assert bad and bad.to == S.FAILED and bad.exit_code == 3 and bad.reason == reasons.EXITED_NONZERO


def test_an_exit_while_cancelling_is_a_cancel_or_a_timeout() -> None:
    c = policy.on_node_event(f(S.CANCELLING, cancel_reason=reasons.CANCELLED), protocol.EXITED, 143, T)
    assert c and c.to == S.CANCELLED
    t = policy.on_node_event(f(S.CANCELLING, cancel_reason=reasons.TIMEOUT), protocol.EXITED, 143, T)
    assert t and t.to == S.FAILED and t.reason == reasons.TIMEOUT


def test_late_events_change_nothing_after_the_end() -> None:
    for st in (S.SUCCEEDED, S.FAILED, S.CANCELLED, S.LOST, S.QUEUED):
        for kind in (protocol.PROVISIONING, protocol.RUNNING, protocol.EXITED, protocol.FAILED_RETRYABLE):
            assert policy.on_node_event(f(st), kind, 0, T) is None


@pytest.mark.parametrize("requeue,attempts,expected", [(True, 1, S.QUEUED), (True, 3, S.LOST), (False, 1, S.LOST)])
def test_node_loss_policy(requeue: bool, attempts: int, expected: TaskState) -> None:
    s = policy.on_node_loss(f(S.RUNNING, attempts=attempts, max_attempts=3, requeue_on_node_loss=requeue), reasons.NODE_LOST)
    assert s and s.to == expected and s.end_attempt == AttemptState.LOST and s.stop


def test_accept_deadline_requeues_then_fails() -> None:
    s = policy.on_accept_overdue(f(S.ASSIGNED, attempts=1, max_attempts=2))
    assert s and s.to == S.QUEUED and s.reason == reasons.NOT_ACCEPTED and s.stop
    s = policy.on_accept_overdue(f(S.ASSIGNED, attempts=2, max_attempts=2))
    assert s and s.to == S.FAILED and s.reason == reasons.NOT_ACCEPTED
    assert policy.on_accept_overdue(f(S.PROVISIONING)) is None


def test_cancel() -> None:
    q = policy.on_cancel(f(S.QUEUED))
    assert q and q.to == S.CANCELLED
    r = policy.on_cancel(f(S.RUNNING))
    assert r and r.to == S.CANCELLING and r.stop
    assert policy.on_cancel(f(S.SUCCEEDED)) is None
    assert policy.on_cancel(f(S.CANCELLING)) is None
    g = policy.on_cancel_grace(f(S.CANCELLING, cancel_reason=reasons.CANCELLED))
    assert g and g.to == S.CANCELLED


def test_retryable_errors_spend_the_attempt_budget() -> None:
    s = policy.on_retryable(f(S.RUNNING, attempts=1, max_attempts=2))
    assert s.to == S.QUEUED
    s = policy.on_retryable(f(S.RUNNING, attempts=2, max_attempts=2))
    assert s.to == S.FAILED


def test_only_a_missing_secret_is_told_as_missing() -> None:
    gone = policy.on_undeliverable(f(S.ASSIGNED), policy.SECRET_GONE)
    assert gone and (gone.to, gone.reason, gone.end_attempt) == (S.FAILED, reasons.SECRET_MISSING, AttemptState.REVOKED)
    unreadable = policy.on_undeliverable(f(S.ASSIGNED), policy.SECRET_UNREADABLE)
    assert unreadable and unreadable.reason == reasons.SECRET_UNREADABLE != reasons.SECRET_MISSING
    assert (unreadable.to, unreadable.end_attempt) == (S.FAILED, AttemptState.REVOKED)
    # a store that could not be asked says nothing about the secret: no step, the Assign is sent again
    assert policy.on_undeliverable(f(S.ASSIGNED), policy.STORE_UNAVAILABLE) is None
    # an attempt that moved on while the secrets were being read is left alone
    for st in (S.QUEUED, S.CANCELLING, S.CANCELLED, S.FAILED):
        assert policy.on_undeliverable(f(st), policy.SECRET_GONE) is None
    with pytest.raises(ValueError):
        policy.on_undeliverable(f(S.ASSIGNED), "something else")


def test_every_step_any_decider_returns_is_an_allowed_transition() -> None:
    deciders = [
        lambda x: policy.on_node_event(x, protocol.PROVISIONING, None, T),
        lambda x: policy.on_node_event(x, protocol.RUNNING, None, T),
        lambda x: policy.on_node_event(x, protocol.EXITED, 0, T),
        lambda x: policy.on_node_event(x, protocol.EXITED, 1, T),
        lambda x: policy.on_node_event(x, protocol.NOT_RUNNING, None, T),
        lambda x: policy.on_node_event(x, protocol.FAILED_RETRYABLE, None, T),
        lambda x: policy.on_node_loss(x, reasons.NODE_LOST),
        policy.on_accept_overdue,
        policy.on_cancel,
        lambda x: policy.on_cancel(x, reasons.TIMEOUT),
        policy.on_cancel_grace,
        lambda x: policy.on_undeliverable(x, policy.SECRET_GONE),
        lambda x: policy.on_undeliverable(x, policy.SECRET_UNREADABLE),
        lambda x: policy.on_undeliverable(x, policy.STORE_UNAVAILABLE),
    ]
    for st in TaskState:
        for attempts in (1, 3):
            for d in deciders:
                step = d(f(st, attempts=attempts, max_attempts=3))
                if step is not None:
                    assert (st, step.to) in ALLOWED, (st, step)


# ---- failure classes: every end says what kind of end it was -----------------------------------------

from podium import failures  # noqa: E402


@pytest.mark.parametrize(
    "state,decide,to,cls,reason",
    [
        (S.RUNNING, lambda x: policy.on_node_event(x, protocol.EXITED, 3, T), S.FAILED, failures.EXIT, reasons.EXITED_NONZERO),
        (S.RUNNING, lambda x: policy.on_node_event(x, protocol.EXITED, 0, T), S.SUCCEEDED, None, None),
        (S.CANCELLING, lambda x: policy.on_node_event(f(S.CANCELLING, cancel_reason=reasons.TIMEOUT), protocol.EXITED, 143, T),
         S.FAILED, failures.TIMEOUT, reasons.TIMEOUT),
        (S.CANCELLING, lambda x: policy.on_node_event(x, protocol.EXITED, 143, T), S.CANCELLED, failures.CANCELLED, reasons.CANCELLED),
        (S.CANCELLING, policy.on_cancel_grace, S.CANCELLED, failures.CANCELLED, reasons.CANCELLED),
        (S.QUEUED, policy.on_cancel, S.CANCELLED, failures.CANCELLED, reasons.CANCELLED),
        (S.RUNNING, lambda x: policy.on_node_loss(x, reasons.NODE_LOST), S.QUEUED, failures.NODE_LOST, reasons.NODE_LOST),
        (S.RUNNING, lambda x: policy.on_node_event(x, protocol.NOT_RUNNING, None, T), S.QUEUED, failures.NODE_LOST,
         reasons.NODE_FORGOT),
        (S.ASSIGNED, policy.on_accept_overdue, S.QUEUED, failures.NOT_ACCEPTED, reasons.NOT_ACCEPTED),
        (S.RUNNING, lambda x: policy.on_node_event(x, protocol.EXITED, 137, T, failure_class="oom"), S.FAILED, failures.OOM,
         reasons.OOM),
        (S.PROVISIONING, lambda x: policy.on_node_event(x, protocol.FAILED_RETRYABLE, None, T, failure_class="provisioning"),
         S.QUEUED, failures.PROVISIONING, reasons.PROVISIONING_FAILED),
        (S.PROVISIONING, lambda x: policy.on_node_event(x, protocol.EXITED, 1, T, failure_class="provisioning"),
         S.FAILED, failures.PROVISIONING, reasons.PROVISIONING_FAILED),
        (S.RUNNING, lambda x: policy.on_node_event(x, protocol.FAILED_RETRYABLE, None, T), S.QUEUED, failures.INTERNAL,
         reasons.RETRYABLE_ERROR),
        (S.RUNNING, lambda x: policy.on_node_event(x, protocol.EXITED, 1, T, failure_class="internal"), S.FAILED,
         failures.INTERNAL, reasons.NODE_ERROR),
        # a node may not call its own end a timeout or a node loss, nor a class this server does not know
        (S.RUNNING, lambda x: policy.on_node_event(x, protocol.EXITED, 1, T, failure_class="timeout"), S.FAILED,
         failures.INTERNAL, reasons.NODE_ERROR),
        (S.RUNNING, lambda x: policy.on_node_event(x, protocol.EXITED, 1, T, failure_class="cosmic-ray"), S.FAILED,
         failures.INTERNAL, reasons.NODE_ERROR),
        (S.RUNNING, lambda x: policy.on_invariant_broken(), S.FAILED, failures.INTERNAL, reasons.NO_LEASE),
        (S.ASSIGNED, lambda x: policy.on_undeliverable(x, policy.SECRET_GONE), S.FAILED, failures.PROVISIONING, reasons.SECRET_MISSING),
    ],
)
def test_each_end_carries_its_class(state: TaskState, decide, to: TaskState, cls, reason) -> None:  # type: ignore[no-untyped-def]
    step = decide(f(state, attempts=1, max_attempts=3))
    assert step is not None and (step.to, step.failure_class, step.reason) == (to, cls, reason)


def test_the_nodes_words_go_beside_the_reason() -> None:
    s = policy.on_node_event(f(S.RUNNING), protocol.EXITED, 137, T, failure_class="oom", message=" OOMKilled: memory limit 64MiB ")
    assert s and s.reason == reasons.OOM and s.detail == "OOMKilled: memory limit 64MiB"
    long = policy.on_node_event(f(S.RUNNING), protocol.FAILED_RETRYABLE, None, T, message="x" * 10_000)
    assert long and long.detail is not None and len(long.detail) == failures.DETAIL_LIMIT
    assert policy.on_node_event(f(S.RUNNING), protocol.EXITED, 2, T, message="").detail is None  # type: ignore[union-attr]


def test_only_a_node_known_gone_releases_a_sandbox_without_its_proof() -> None:
    """The node-loss policy frees a container's capacity with its end only when the node holds
    nothing any more (offline and fenced, removed, or it said so); an expired lease on a node that
    still talks does not, nor does any other end."""
    for why, release in ((reasons.NODE_LOST, True), (reasons.NODE_REVOKED, True), (reasons.NODE_FORGOT, True),
                         (reasons.LEASE_EXPIRED, False)):  # fmt: skip
        s = policy.on_node_loss(f(S.RUNNING, attempts=1, max_attempts=2), why)
        assert s and s.release is release, why
        c = policy.on_node_loss(f(S.CANCELLING, cancel_reason=reasons.CANCELLED), why)
        assert c and c.release is release and c.failure_class == failures.CANCELLED, why
    for step in (policy.on_node_event(f(S.RUNNING), protocol.EXITED, 0, T), policy.on_accept_overdue(f(S.ASSIGNED)),
                 policy.on_cancel_grace(f(S.CANCELLING))):  # fmt: skip
        assert step is not None and not step.release
    # an Assign that never left the server (its secret is gone) left nothing on the node to prove removed
    assert policy.on_undeliverable(f(S.ASSIGNED), policy.SECRET_GONE).release  # type: ignore[union-attr]


def test_what_the_watchdog_finds_lost_goes_through_the_node_loss_policy() -> None:
    for why, reason in (("offline", reasons.NODE_LOST), ("revoked", reasons.NODE_REVOKED), ("lease", reasons.LEASE_EXPIRED)):
        s = policy.on_lost(f(S.RUNNING, max_attempts=2), why)
        assert s and s.to == S.QUEUED and s.reason == reason and s.end_attempt == AttemptState.LOST
    # on no node and holding no lease: nothing a node did; the invariant's own failure
    for why in (None, "something else"):
        s = policy.on_lost(f(S.RUNNING, max_attempts=2), why)
        assert s and s.to == S.FAILED and s.reason == reasons.NO_LEASE and s.failure_class == failures.INTERNAL


def test_an_image_the_registry_refuses_fails_only_a_queued_task() -> None:
    s = policy.on_image_unresolvable(f(S.QUEUED), reasons.IMAGE_NOT_FOUND, "manifest unknown")
    assert s and s.to == S.FAILED and s.reason == reasons.IMAGE_NOT_FOUND and s.failure_class == failures.PROVISIONING
    assert s.detail == "manifest unknown" and s.end_attempt is None
    assert policy.on_image_unresolvable(f(S.CANCELLED), reasons.REGISTRY_REFUSED, None) is None


def rf(**kw: object) -> policy.ReconcileFacts:
    base: dict[str, object] = dict(
        task=f(S.RUNNING, attempts=1, max_attempts=2), current=True, attempt_state="running", node_removed=False,
        node_health="online", node_connected=True, in_handover=False, before_hello=True, in_hello=True,
    )
    base.update(kw)
    return policy.ReconcileFacts(**base)  # type: ignore[arg-type]


def test_reconcile_a_consistent_attempt_is_checked_again_after_the_interval() -> None:
    r = policy.on_reconcile(rf(), T)
    assert (r.result, r.step, r.next_in) == (reasons.RECONCILED_CONSISTENT, None, T.reconcile)
    # assigned after the node's last Hello: that Hello could not list it
    assert policy.on_reconcile(rf(before_hello=False, in_hello=False), T).step is None


def test_reconcile_a_lost_node_applies_the_node_loss_policy() -> None:
    for kw, result, why in (
        ({"node_removed": True}, reasons.RECONCILED_NODE_REMOVED, reasons.NODE_REVOKED),
        ({"node_health": "offline", "node_connected": False}, reasons.RECONCILED_NODE_OFFLINE, reasons.NODE_LOST),
        ({"in_hello": False}, reasons.RECONCILED_NODE_FORGOT, reasons.NODE_FORGOT),
    ):
        r = policy.on_reconcile(rf(**kw), T)
        assert r.result == result and r.step == policy.on_node_loss(f(S.RUNNING, attempts=1, max_attempts=2), why)
        assert r.step is not None and r.step.to == S.QUEUED


def test_reconcile_in_doubt_waits() -> None:
    for kw, result in (
        ({"in_handover": True, "in_hello": False}, reasons.RECONCILED_HANDOVER),
        ({"node_connected": False}, reasons.RECONCILED_DISCONNECTED),
        ({"node_health": "unreachable"}, reasons.RECONCILED_UNREACHABLE),
        ({"current": False}, reasons.RECONCILED_NOT_CURRENT),
        ({"runtime_changed": True}, reasons.RECONCILED_RUNTIME_CHANGED),
    ):
        r = policy.on_reconcile(rf(**kw), T)
        assert (r.result, r.step) == (result, None)
    # an assignment not yet accepted is redelivered on reconnect, not lost for missing from a Hello
    assert policy.on_reconcile(rf(attempt_state="assigned", in_hello=False), T).step is None


def test_runtime_changes_are_the_backends_kept_on_another_runtime() -> None:
    def m(kind: str, runtime: str) -> dict[str, str]:
        return {"backend_kind": kind, "runtime_digest": runtime}

    before = [m("process", "sha256:a"), m("container", "sha256:c")]
    assert policy.runtime_changes(before, before) == []
    assert policy.runtime_changes(before, [m("process", "sha256:b"), m("container", "sha256:c")]) == [("process", "sha256:a", "sha256:b")]
    # a backend that came or went is not a changed runtime; nor is a first Hello
    assert policy.runtime_changes(before, [m("process", "sha256:a")]) == []
    assert policy.runtime_changes([], before) == []
