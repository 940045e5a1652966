"""Which node reports go into one group commit (`take_round_robin`): each task's in its order — several
of one task only when its stream sent them back to back for one attempt and only the last is an end —
streams served in turn, and a stream's reports of other tasks never wait behind a report that must
(the overload scenario's late acceptances came from that wait)."""

from __future__ import annotations

import uuid

from podium.gateway.reports import EVENT_BATCH, take_round_robin
from podium.gateway.sessions import Pending, Session
from podium.proto.podium.v1 import agent_pb2 as pb

K = pb.TaskEvent.Kind


def report(task: uuid.UUID, kind: str, token: int = 1) -> Pending:
    ev = pb.TaskEvent(task_id=str(task), fencing_token=token, kind=getattr(K, kind))
    return Pending(ev, task, kind)  # the kind as the gateway names it (protocol.EXITED, …)


def stream(name: str, *reports: Pending) -> Session:
    s = Session(name, 1)
    s.events.extend(reports)
    return s


def kinds(batch: list[tuple[Session, Pending]]) -> list[tuple[str, uuid.UUID, str]]:
    return [(s.node_id, p.task_id, p.kind.lower()) for s, p in batch]


def test_every_acceptance_of_a_node_given_many_tasks_goes_in_the_first_batch() -> None:
    # a node given fourteen tasks at once that reports each one's start right behind its acceptance:
    # all of it goes in the first batch, each task's reports in their order
    tasks = [uuid.uuid4() for _ in range(14)]
    s = stream("n1", *[r for t in tasks for r in (report(t, "PROVISIONING"), report(t, "RUNNING"))])
    batch, served = take_round_robin([s], 1000)
    assert kinds(batch) == [("n1", t, k) for t in tasks for k in ("provisioning", "running")]
    assert served == [s]
    assert not s.events


def test_a_tasks_running_and_its_end_go_in_one_batch_in_their_order() -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    s = stream("n1", report(a, "PROVISIONING"), report(b, "PROVISIONING"))
    batch, _ = take_round_robin([s], 1000)
    assert kinds(batch) == [("n1", a, "provisioning"), ("n1", b, "provisioning")]
    # a short command: its running and its end arrive together and are committed together
    s.events.extend([report(a, "RUNNING"), report(b, "RUNNING"), report(a, "EXITED")])
    batch, _ = take_round_robin([s], 1000)
    assert kinds(batch) == [("n1", a, "running"), ("n1", b, "running"), ("n1", a, "exited")]
    assert not s.events


def test_nothing_of_a_task_goes_in_a_batch_after_its_end_or_from_another_attempt() -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    # an end sent again after a reconnect, and a report of the task's next attempt (token 2), wait
    s = stream("n1", report(a, "RUNNING"), report(a, "EXITED"), report(a, "EXITED"),
               report(b, "RUNNING"), report(b, "PROVISIONING", token=2), report(b, "RUNNING", token=2))  # fmt: skip
    rounds = []
    while s.events:
        batch, _ = take_round_robin([s], 1000)
        rounds.append([(p.task_id, p.kind.lower(), p.event.fencing_token) for _s, p in batch])
    assert rounds == [
        [(a, "running", 1), (a, "exited", 1), (b, "running", 1)],
        [(a, "exited", 1), (b, "provisioning", 2), (b, "running", 2)],
    ]


def test_a_report_held_back_keeps_its_tasks_later_reports_behind_it() -> None:
    # the other stream's report of task `a` is in the batch first; this stream's RUNNING of `a` must
    # wait, and so must its EXITED of `a`, even though nothing else of `a` is in the way
    a, b = uuid.uuid4(), uuid.uuid4()
    other = stream("n0", report(a, "NOT_RUNNING"))
    s = stream("n1", report(a, "RUNNING"), report(b, "PROVISIONING"), report(a, "EXITED"))
    batch, served = take_round_robin([other, s], 1000)
    assert kinds(batch) == [("n0", a, "not_running"), ("n1", b, "provisioning")]
    assert served == [other, s]
    assert [(p.task_id, p.kind.lower()) for p in s.events] == [(a, "running"), (a, "exited")]


def test_no_report_of_a_task_in_a_commit_being_applied_is_taken() -> None:
    # `a`'s acceptance is in the group commit being applied: its start and its end wait for that
    # commit (in their order), and the other tasks' reports around them go in this batch
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    s = stream("n1", report(a, "RUNNING"), report(b, "PROVISIONING"), report(a, "EXITED"), report(c, "PROVISIONING"))
    batch, served = take_round_robin([s], 1000, committing={a})
    assert kinds(batch) == [("n1", b, "provisioning"), ("n1", c, "provisioning")]
    assert served == [s]
    assert [(p.task_id, p.kind.lower()) for p in s.events] == [(a, "running"), (a, "exited")]
    # that commit done, they go in the next batch together
    batch, _ = take_round_robin([s], 1000)
    assert kinds(batch) == [("n1", a, "running"), ("n1", a, "exited")]


def test_streams_are_served_in_turn_within_the_limit() -> None:
    streams = [stream(f"n{i}", *[report(uuid.uuid4(), "PROVISIONING") for _ in range(5)]) for i in range(4)]
    batch, served = take_round_robin(streams, 6)
    # one from each stream before a second from any: no stream waits behind another's backlog
    assert [s.node_id for s, _p in batch] == ["n0", "n1", "n2", "n3", "n0", "n1"]
    assert served == streams
    assert [len(s.events) for s in streams] == [3, 3, 4, 4]
    # the reports left are the ones not taken, in their order
    for s in streams:
        assert all(p.kind.lower() == "provisioning" for p in s.events)


def test_a_busy_fleets_backlog_of_thousands_of_reports_goes_in_one_commit() -> None:
    # 1,000 nodes each reporting three tasks' acceptances (a lifecycle benchmark's backlog): one
    # group commit. Capped at 1,000, they waited 2–3.5 s behind one another, a commit's six round
    # trips costing nearly as much for 1,000 reports as for 1,500.
    streams = [stream(f"n{i}", *[report(uuid.uuid4(), "PROVISIONING") for _ in range(3)]) for i in range(1000)]
    batch, served = take_round_robin(streams, EVENT_BATCH)
    assert len(batch) == 3000 and served == streams
    assert not any(s.events for s in streams)
    # and the cap still holds: what is past it waits for the next commit
    more = [stream(f"m{i}", *[report(uuid.uuid4(), "PROVISIONING") for _ in range(5)]) for i in range(1000)]
    batch, _ = take_round_robin(more, EVENT_BATCH)
    assert len(batch) == EVENT_BATCH and sum(len(s.events) for s in more) == 5000 - EVENT_BATCH


def test_nothing_to_take() -> None:
    a = uuid.uuid4()
    empty = stream("n0")
    assert take_round_robin([empty], 1000) == ([], [])
    s = stream("n1", report(a, "RUNNING"))
    other = stream("n2", report(a, "EXITED"))
    batch, served = take_round_robin([s, other], 1000)
    assert kinds(batch) == [("n1", a, "running")]
    assert served == [s]
    assert [p.kind.lower() for p in other.events] == ["exited"]


def test_a_lone_acceptance_or_a_lone_running_whose_assign_the_stream_carried_is_made_as_expected() -> None:
    from podium.gateway.reports import _acceptances

    a, b, c, d, e = (uuid.uuid4() for _ in range(5))
    s = Session("n1", 1)
    s.carried(1, 600.0)  # the Assigns of a, c and d went out on this stream under token 1
    again = report(d, "RUNNING")
    again.tries = 1  # refused once already: read from now on
    batch = [(s, p) for p in (
        report(a, "PROVISIONING"),
        report(b, "RUNNING", token=2),  # an Assign this stream never carried: its timeout is unknown
        report(c, "RUNNING"), report(c, "EXITED"),  # a running with its end: read, made as one change
        again,
        report(e, "RUNNING"),
    )]  # fmt: skip
    expected, rest = _acceptances(batch)
    assert [(p.task_id, p.kind) for _s, p in expected] == [(a, "PROVISIONING"), (e, "RUNNING")]
    assert [(p.task_id, p.kind) for _s, p in rest] == [(b, "RUNNING"), (c, "RUNNING"), (c, "EXITED"), (d, "RUNNING")]


def test_a_stream_remembers_a_bounded_number_of_timeouts() -> None:
    from podium.gateway.sessions import MAX_TIMEOUTS_KEPT

    s = Session("n1", 1)
    for token in range(MAX_TIMEOUTS_KEPT):
        s.carried(token, None)
    assert len(s.timeouts) == MAX_TIMEOUTS_KEPT
    s.carried(MAX_TIMEOUTS_KEPT, 5.0)  # past the bound: the rest are forgotten (read instead)
    assert s.timeouts == {MAX_TIMEOUTS_KEPT: 5.0}
