"""Unit tests for podium.placement: every filter, every reason, and the ranking rules, table-driven.

Each reason is produced by the smallest fleet that can produce it, through all three entry points
(select_node, the batch Placer and explain), because the scheduler, the API and the CLI each use a
different one and an operator must read the same sentence from all of them.
"""

from __future__ import annotations

import ast
import random
from dataclasses import fields, replace
from pathlib import Path

import pytest

import podium.placement as placement
from podium import reasons
from podium.placement import (
    BINPACK,
    SPREAD,
    NodeSnapshot,
    NodeVerdict,
    Placement,
    Placer,
    Requirements,
    Resources,
    Unplaceable,
    explain,
    select_node,
)
from podium.placement import index as placement_index
from podium.placement.filters import first_failure, group_key
from podium.placement.index import shape_key

GIB = 1 << 30
BIG = Resources(cpu_millis=4000, memory_bytes=8 * GIB, disk_bytes=100 * GIB, gpus=2, slots=4)
TASK = Resources(cpu_millis=1000, memory_bytes=1 * GIB, disk_bytes=1 * GIB, slots=1)


def node(node_id: str = "n1", **overrides: object) -> NodeSnapshot:
    """node is a healthy, empty, 4-core node with two free GPUs, unless told otherwise."""
    fields: dict[str, object] = {"allocatable": BIG, "gpu_free": (0, 1)}
    fields.update(overrides)
    return NodeSnapshot(id=node_id, **fields)  # type: ignore[arg-type]


def req(**overrides: object) -> Requirements:
    fields: dict[str, object] = {"resources": TASK}
    fields.update(overrides)
    return Requirements(**fields)  # type: ignore[arg-type]


def place_all_ways(r: Requirements, fleet: list[NodeSnapshot], policy: str = SPREAD) -> Placement | Unplaceable:
    """place_all_ways asks select_node and a fresh Placer, and insists they agree."""
    expected = select_node(r, fleet, policy=policy)
    assert Placer(fleet, policy=policy).place(r) == expected
    return expected


# --- every reason from a minimal case ------------------------------------------------------------------

REASON_CASES = [
    # (case id, fleet, requirements, expected reason)
    ("empty fleet", [], req(), reasons.NO_NODES),
    ("disconnected", [node(connected=False)], req(), reasons.NO_NODES),
    ("offline", [node(health="offline")], req(), reasons.NO_NODES),
    ("offline and disconnected", [node("a", health="offline"), node("b", connected=False)], req(), reasons.NO_NODES),
    ("unreachable", [node(health="unreachable")], req(), reasons.UNREACHABLE),
    ("unreachable and offline", [node("a", health="unreachable"), node("b", health="offline")], req(), reasons.UNREACHABLE),
    ("home unreachable", [node("home", health="unreachable"), node("other")], req(home_node="home"), reasons.UNREACHABLE),
    ("home absent", [node()], req(home_node="ghost"), reasons.HOME_UNAVAILABLE),
    ("home offline", [node("home", health="offline"), node("other")], req(home_node="home"), reasons.HOME_UNAVAILABLE),
    ("home disconnected", [node("home", connected=False), node("other")], req(home_node="home"), reasons.HOME_UNAVAILABLE),
    ("home and fleet offline", [node("home", health="offline")], req(home_node="home"), reasons.NO_NODES),
    ("pool", [node(pool="default")], req(pool="gpu"), reasons.NO_POOL),
    ("arch", [node(arch="x86_64")], req(arch="arm64"), reasons.NO_ARCH),
    ("backend", [node(backends=frozenset({"process"}))], req(backend="docker"), reasons.NO_BACKEND),
    ("protocol too new", [node(protocol_min=1, protocol_max=2)], req(protocol=3), reasons.NO_PROTOCOL),
    ("protocol too old", [node(protocol_min=2, protocol_max=3)], req(protocol=1), reasons.NO_PROTOCOL),
    ("label value", [node(labels={"zone": "b"})], req(labels={"zone": "a"}), reasons.NO_LABELS),
    ("label missing", [node()], req(labels={"zone": "a"}), reasons.NO_LABELS),
    ("capability", [node(capabilities=frozenset({"sgx"}))], req(capabilities=frozenset({"nvme"})), reasons.NO_CAPABILITY),
    ("egress none", [node(egress_contexts=frozenset({"open"}))], req(egress="none"), reasons.NO_EGRESS),
    ("egress open", [node(egress_contexts=frozenset({"none"}))], req(egress="open"), reasons.NO_EGRESS),
    ("egress declared by nobody", [node(egress_contexts=frozenset())], req(egress="open"), reasons.NO_EGRESS),
    ("draining", [node(draining=True)], req(), reasons.ALL_DRAINING),
    ("too large: cpu", [node()], req(resources=replace(TASK, cpu_millis=4001)), reasons.TOO_LARGE),
    ("too large: memory", [node()], req(resources=replace(TASK, memory_bytes=9 * GIB)), reasons.TOO_LARGE),
    ("too large: disk", [node()], req(resources=replace(TASK, disk_bytes=101 * GIB)), reasons.TOO_LARGE),
    ("too large: gpus", [node()], req(resources=replace(TASK, gpus=3)), reasons.TOO_LARGE),
    ("too large: slots", [node()], req(resources=replace(TASK, slots=5)), reasons.TOO_LARGE),
    ("no room: cpu", [node(reserved=Resources(cpu_millis=3500))], req(), reasons.NO_ROOM),
    ("no room: memory", [node(reserved=Resources(memory_bytes=7 * GIB + 1))], req(), reasons.NO_ROOM),
    ("no disk", [node(reserved=Resources(disk_bytes=100 * GIB))], req(), reasons.NO_DISK),
    ("no gpu: none listed free", [node(gpu_free=())], req(resources=replace(TASK, gpus=1)), reasons.NO_GPU),
    ("no gpu: all reserved", [node(reserved=Resources(gpus=2))], req(resources=replace(TASK, gpus=1)), reasons.NO_GPU),
    ("no gpu: one of two", [node(gpu_free=(1,))], req(resources=replace(TASK, gpus=2)), reasons.NO_GPU),
    ("full", [node(reserved=Resources(slots=4))], req(), reasons.FULL),
    ("operations busy", [node(max_operations=2, operations=2)], req(), reasons.OPERATIONS_BUSY),
    ("home fails its own check", [node("home", reserved=Resources(slots=4)), node("other")], req(home_node="home"), reasons.FULL),
    ("unreachable and full", [node(health="unreachable", reserved=Resources(slots=4))], req(), reasons.UNREACHABLE),
    ("home is draining", [node("home", draining=True), node("other")], req(home_node="home"), reasons.ALL_DRAINING),
]


@pytest.mark.parametrize("fleet, r, reason", [c[1:] for c in REASON_CASES], ids=[c[0] for c in REASON_CASES])
@pytest.mark.parametrize("policy", [SPREAD, BINPACK])
def test_each_reason_from_a_minimal_case(fleet: list[NodeSnapshot], r: Requirements, reason: str, policy: str) -> None:
    assert place_all_ways(r, fleet, policy) == Unplaceable(reason)
    assert reason in reasons.QUEUED_REASONS


def test_every_queued_reason_has_a_minimal_case() -> None:
    assert {case[3] for case in REASON_CASES} == set(reasons.QUEUED_REASONS)


STAGED_CASES = [
    # The reason is the stage at which the candidate set became empty: the latest any node reached.
    ("pool beats offline", [node("a", health="offline"), node("b", pool="x")], req(pool="y"), reasons.NO_POOL),
    ("full beats wrong pool", [node("a", pool="x"), node("b", reserved=Resources(slots=4))], req(pool="default"), reasons.FULL),
    ("egress beats capabilities", [node("a", capabilities=frozenset({"x"})), node("b")],
     req(capabilities=frozenset({"x"}), egress="none"), reasons.NO_EGRESS),
    ("draining beats egress", [node("a", draining=True, egress_contexts=frozenset({"none"})), node("b")],
     req(egress="none"), reasons.ALL_DRAINING),
    ("draining beats labels", [node("a", labels={"z": "1"}, draining=True), node("b")], req(labels={"z": "1"}), reasons.ALL_DRAINING),
    ("no room beats too large", [node("a", reserved=Resources(cpu_millis=4000)), node("b", allocatable=replace(BIG, cpu_millis=500))],
     req(), reasons.NO_ROOM),
    ("full beats no gpu", [node("a", gpu_free=()), node("b", reserved=Resources(slots=4))],
     req(resources=replace(TASK, gpus=1)), reasons.FULL),
    ("home hides the others", [node("home", pool="x"), node("other")], req(home_node="home", pool="y"), reasons.NO_POOL),
    # an unreachable node that could not run the task anyway is not the reason it waits
    ("pool beats unreachable", [node("a", health="unreachable", pool="x")], req(pool="y"), reasons.NO_POOL),
    ("labels beat unreachable", [node("a", health="unreachable")], req(labels={"z": "1"}), reasons.NO_LABELS),
    # a draining node will not take it when it answers again: for it, draining is the truth ...
    ("draining beats unreachable on one node", [node("a", health="unreachable", draining=True)], req(), reasons.ALL_DRAINING),
    # ... and when the only other candidate is frozen, waiting for that one is
    ("unreachable beats draining elsewhere", [node("a", draining=True), node("b", health="unreachable")], req(), reasons.UNREACHABLE),
    ("operations busy beats full", [node("a", reserved=Resources(slots=4)), node("b", operations=4)], req(), reasons.OPERATIONS_BUSY),
    ("full beats unreachable elsewhere", [node("a", reserved=Resources(slots=4)), node("b", health="unreachable")], req(), reasons.FULL),
]


@pytest.mark.parametrize("fleet, r, reason", [c[1:] for c in STAGED_CASES], ids=[c[0] for c in STAGED_CASES])
def test_the_most_specific_reason_wins(fleet: list[NodeSnapshot], r: Requirements, reason: str) -> None:
    assert place_all_ways(r, fleet) == Unplaceable(reason)
    assert place_all_ways(r, list(reversed(fleet))) == Unplaceable(reason)


# --- every filter lets through what it should ---------------------------------------------------------

PASS_CASES = [
    ("any pool", node(pool="batch"), req(pool=None)),
    ("same pool", node(pool="batch"), req(pool="batch")),
    ("any arch", node(arch="arm64"), req(arch=None)),
    ("same arch", node(arch="arm64"), req(arch="arm64")),
    ("one of several backends", node(backends=frozenset({"process", "docker"})), req(backend="docker")),
    ("protocol at the bottom of the range", node(protocol_min=2, protocol_max=4), req(protocol=2)),
    ("protocol at the top of the range", node(protocol_min=2, protocol_max=4), req(protocol=4)),
    ("extra node labels are fine", node(labels={"zone": "a", "rack": "7"}), req(labels={"zone": "a"})),
    ("extra capabilities are fine", node(capabilities=frozenset({"nvme", "sgx"})), req(capabilities=frozenset({"nvme"}))),
    ("no egress requirement", node(egress_contexts=frozenset()), req(egress=None)),
    ("one of the egress contexts", node(egress_contexts=frozenset({"none", "open"})), req(egress="none")),
    ("a silent node gives an open network", node(), req(egress="open")),
    ("exactly the free cpu", node(reserved=Resources(cpu_millis=3000)), req()),
    ("exactly the free memory", node(reserved=Resources(memory_bytes=7 * GIB)), req()),
    ("exactly the free disk", node(reserved=Resources(disk_bytes=99 * GIB)), req()),
    ("exactly the free gpus", node(reserved=Resources(gpus=0)), req(resources=replace(TASK, gpus=2))),
    ("the last slot", node(reserved=Resources(slots=3)), req()),
    ("a zero request on a full node", node(reserved=Resources(slots=4)), req(resources=Resources())),
]


@pytest.mark.parametrize("n, r", [c[1:] for c in PASS_CASES], ids=[c[0] for c in PASS_CASES])
def test_each_filter_passes_a_compatible_node(n: NodeSnapshot, r: Requirements) -> None:
    assert first_failure(r, n) is None
    result = place_all_ways(r, [n])
    assert isinstance(result, Placement) and result.node_id == n.id


def test_group_key_covers_every_static_field_but_labels() -> None:
    """The placer runs the static checks once per group; a field left out of the key would let two
    nodes that a check tells apart share one verdict. Labels are matched per node, by an index."""
    base = node()
    for field_name, value in [
        ("pool", "x"),
        ("arch", "arm64"),
        ("backends", frozenset({"docker"})),
        ("protocol_min", 0),
        ("protocol_max", 9),
        ("capabilities", frozenset({"c"})),
        ("draining", True),
        ("health", "unreachable"),
        ("egress_contexts", frozenset({"none"})),
    ]:
        assert group_key(replace(base, **{field_name: value})) != group_key(base), field_name
    assert group_key(replace(base, labels={"host": "h1"})) == group_key(base)


def test_an_unreachable_node_is_never_chosen_and_says_so() -> None:
    fleet = [node("frozen", health="unreachable"), node("busy", reserved=Resources(cpu_millis=3500))]
    assert place_all_ways(req(), fleet) == Unplaceable(reasons.NO_ROOM)
    small = place_all_ways(req(resources=replace(TASK, cpu_millis=100)), fleet)
    assert isinstance(small, Placement) and small.node_id == "busy"
    rows = {v.node_id: v.failed for v in explain(req(), fleet)}
    assert rows == {"frozen": reasons.UNREACHABLE, "busy": reasons.NO_ROOM}
    thawed = [replace(fleet[0], health="online"), fleet[1]]
    result = place_all_ways(req(), thawed)
    assert isinstance(result, Placement) and result.node_id == "frozen"


def test_labels_are_matched_per_node_within_a_group() -> None:
    fleet = [
        node("a", labels={"host": "a", "zone": "1"}),
        node("b", labels={"host": "b", "zone": "2"}, draining=True),
        node("c", labels={"host": "c", "zone": "2"}),
    ]
    result = place_all_ways(req(labels={"zone": "2"}), fleet)
    assert isinstance(result, Placement) and result.node_id == "c"
    assert place_all_ways(req(labels={"zone": "2", "host": "b"}), fleet) == Unplaceable(reasons.ALL_DRAINING)
    assert place_all_ways(req(labels={"zone": "3"}), fleet) == Unplaceable(reasons.NO_LABELS)
    assert place_all_ways(req(labels={"zone": "1"}, pool="x"), fleet) == Unplaceable(reasons.NO_POOL)


def test_shape_key_covers_every_static_requirement() -> None:
    base = req()
    for field_name, value in [
        ("pool", "x"),
        ("arch", "arm64"),
        ("backend", "docker"),
        ("protocol", 2),
        ("labels", {"a": "b"}),
        ("capabilities", frozenset({"c"})),
        ("egress", "none"),
    ]:
        assert shape_key(replace(base, **{field_name: value})) != shape_key(base), field_name


# --- home node ---------------------------------------------------------------------------------------


def test_home_node_is_the_only_node_a_pinned_task_sees() -> None:
    busy_home = node("home", reserved=Resources(cpu_millis=2000, slots=2))
    fleet = [node("a"), busy_home, node("z")]
    result = place_all_ways(req(home_node="home"), fleet)
    assert isinstance(result, Placement) and result.node_id == "home"
    # Without the pin, the emptier node wins.
    assert place_all_ways(req(), fleet) == Placement("a", (), 1.0)


def test_explain_marks_the_other_nodes_invisible_to_a_pinned_task() -> None:
    fleet = [node("home"), node("other"), node("gone", health="offline")]
    rows = {v.node_id: v.failed for v in explain(req(home_node="home"), fleet)}
    assert rows == {"home": None, "other": reasons.HOME_UNAVAILABLE, "gone": reasons.NO_NODES}


# --- ranking: locality, policy, tie-break ----------------------------------------------------------------


def test_locality_beats_free_capacity() -> None:
    fleet = [node("empty"), node("cached", reserved=Resources(cpu_millis=2000, slots=2), artifacts=frozenset({"img"}))]
    result = place_all_ways(req(preferred_artifacts=("img",)), fleet)
    assert isinstance(result, Placement) and result.node_id == "cached"
    result = place_all_ways(req(preferred_artifacts=("img",)), fleet, BINPACK)
    assert isinstance(result, Placement) and result.node_id == "cached"


def test_more_preferred_artifacts_win() -> None:
    fleet = [
        node("one", artifacts=frozenset({"a"})),
        node("two", artifacts=frozenset({"a", "b"}), reserved=Resources(slots=3)),
        node("none"),
    ]
    result = place_all_ways(req(preferred_artifacts=("a", "b")), fleet)
    assert isinstance(result, Placement) and result.node_id == "two"


def test_locality_gives_way_when_the_cached_node_cannot_fit() -> None:
    fleet = [node("cached", artifacts=frozenset({"img"}), reserved=Resources(slots=4)), node("b"), node("a")]
    result = place_all_ways(req(preferred_artifacts=("img",)), fleet)
    assert isinstance(result, Placement) and result.node_id == "a"


def test_locality_ignores_incompatible_nodes() -> None:
    fleet = [node("cached", artifacts=frozenset({"img"}), pool="other"), node("plain")]
    result = place_all_ways(req(preferred_artifacts=("img",), pool="default"), fleet)
    assert isinstance(result, Placement) and result.node_id == "plain"


POLICY_CASES = [
    # (policy, expected node): "half" is half used, "empty" is empty; both fit.
    (SPREAD, "empty"),
    (BINPACK, "half"),
]


@pytest.mark.parametrize("policy, expected", POLICY_CASES)
def test_spread_prefers_the_emptiest_binpack_the_fullest(policy: str, expected: str) -> None:
    fleet = [node("half", reserved=Resources(cpu_millis=2000, memory_bytes=4 * GIB, slots=2)), node("empty")]
    result = place_all_ways(req(), fleet, policy)
    assert isinstance(result, Placement) and result.node_id == expected


def test_binpack_skips_the_fullest_node_when_it_does_not_fit() -> None:
    fleet = [node("full", reserved=Resources(slots=4)), node("half", reserved=Resources(slots=2)), node("empty")]
    result = place_all_ways(req(), fleet, BINPACK)
    assert isinstance(result, Placement) and result.node_id == "half"


def test_scores_say_higher_is_better_under_both_policies() -> None:
    fleet = [node("n", reserved=Resources(cpu_millis=1000, memory_bytes=2 * GIB, slots=1))]
    spread = select_node(req(), fleet, policy=SPREAD)
    binpack = select_node(req(), fleet, policy=BINPACK)
    assert isinstance(spread, Placement) and spread.score == pytest.approx(0.75)
    assert isinstance(binpack, Placement) and binpack.score == pytest.approx(0.25)


@pytest.mark.parametrize("policy", [SPREAD, BINPACK])
def test_ties_are_broken_by_node_id_whatever_the_input_order(policy: str) -> None:
    ids = ["c", "a", "b", "aa"]
    for order in (ids, sorted(ids), list(reversed(ids))):
        result = place_all_ways(req(), [node(i) for i in order], policy)
        assert isinstance(result, Placement) and result.node_id == "a"


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        select_node(req(), [node()], policy="random")
    with pytest.raises(ValueError, match="policy"):
        Placer([node()], policy="random")
    with pytest.raises(ValueError, match="policy"):
        explain(req(), [node()], policy="random")


def test_duplicate_node_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        select_node(req(), [node("a"), node("a")])
    with pytest.raises(ValueError, match="twice"):
        Placer([node("a"), node("a")])


def test_plain_sets_are_accepted_where_frozensets_are_expected() -> None:
    n = NodeSnapshot("a", capabilities={"nvme"}, backends={"process"}, artifacts={"img"}, allocatable=BIG)  # type: ignore[arg-type]
    r = Requirements(capabilities={"nvme"}, preferred_artifacts=["img"])  # type: ignore[arg-type]
    assert isinstance(n.capabilities, frozenset) and isinstance(r.preferred_artifacts, tuple)
    assert place_all_ways(r, [n]) == Placement("a", (), 1.0)


def test_a_required_label_is_compared_exactly_as_the_check_reads_it() -> None:
    fleet = [node("a", labels={"zone": "1"}), node("b")]
    assert explain(req(labels={"zone": "1"}), fleet)[1].failed == reasons.NO_LABELS
    assert place_all_ways(req(labels={"zone": "1"}), fleet) == Placement("a", (), 1.0)


def test_negative_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        Requirements(resources=Resources(cpu_millis=-1))


# --- GPUs ----------------------------------------------------------------------------------------------


def test_gpus_are_the_lowest_free_indexes() -> None:
    fleet = [node(allocatable=replace(BIG, gpus=4), gpu_free=(3, 1, 2))]
    assert place_all_ways(req(resources=replace(TASK, gpus=2)), fleet) == Placement("n1", (1, 2), 1.0)
    assert place_all_ways(req(resources=replace(TASK, gpus=0)), fleet) == Placement("n1", (), 1.0)


def test_placer_hands_out_each_gpu_once() -> None:
    placer = Placer([node(allocatable=replace(BIG, gpus=4, slots=8), gpu_free=(2, 0, 3, 1))])
    one = Resources(gpus=1, slots=1)
    got = [placer.place(req(resources=one)) for _ in range(5)]
    assert [p.gpu_indexes for p in got[:4] if isinstance(p, Placement)] == [(0,), (1,), (2,), (3,)]
    assert got[4] == Unplaceable(reasons.NO_GPU)
    assert placer.snapshot("n1").gpu_free == ()
    assert placer.snapshot("n1").reserved == Resources(gpus=4, slots=4)


# --- Placer bookkeeping ------------------------------------------------------------------------------------


def test_placer_snapshot_shows_the_reservations_and_leaves_inputs_alone() -> None:
    fleet = [node("a"), node("b", health="offline")]
    placer = Placer(fleet)
    assert placer.place(req()) == Placement("a", (), 1.0)
    assert placer.snapshot("a").reserved == TASK
    assert placer.snapshot("b") == fleet[1]
    assert fleet[0].reserved == Resources()
    with pytest.raises(KeyError):
        placer.snapshot("ghost")


def test_reserving_is_what_a_placement_leaves_behind() -> None:
    n = node(gpu_free=(1, 0))
    after = n.reserving(replace(TASK, gpus=1), (0,))
    assert after.reserved == replace(TASK, gpus=1)
    assert after.gpu_free == (1,)
    assert n.reserved == Resources()


def test_reserving_keeps_every_other_field() -> None:
    n = NodeSnapshot(
        id="x",
        name="named",
        connected=False,
        health="unreachable",
        draining=True,
        pool="p",
        arch="arm64",
        labels={"k": "v"},
        capabilities=frozenset({"c"}),
        backends=frozenset({"docker"}),
        protocol_min=2,
        protocol_max=5,
        allocatable=BIG,
        reserved=TASK,
        artifacts=frozenset({"a"}),
        gpu_free=(1, 0),
        egress_contexts=frozenset({"none"}),
        max_operations=7,
        operations=2,
    )
    after = n.reserving(TASK, (1,))
    assert after == replace(n, reserved=TASK + TASK, gpu_free=(0,), operations=3)
    assert n.using(BIG, (), 0) == replace(n, reserved=BIG, gpu_free=(), operations=0)
    # A new field fails here first: give it a non-default value above, and add it to using().
    assert [f.name for f in fields(NodeSnapshot)] == [
        "id", "name", "connected", "health", "draining", "pool", "arch", "labels", "capabilities",
        "backends", "protocol_min", "protocol_max", "allocatable", "reserved", "artifacts", "gpu_free",
        "egress_contexts", "max_operations", "operations",
    ]  # fmt: skip


def test_a_node_preparing_as_many_tasks_as_it_allows_takes_no_more() -> None:
    busy = node("a", max_operations=2, operations=2)
    assert place_all_ways(req(), [busy]) == Unplaceable(reasons.OPERATIONS_BUSY)
    # room and slots are not the problem, so the sentence is the operations', not "full"
    assert first_failure(req(), busy) == reasons.OPERATIONS_BUSY
    # one operation free: one placement takes it, and the batch's next task is told why it waits
    placer = Placer([node("a", max_operations=2, operations=1)])
    assert isinstance(placer.place(req()), Placement)
    assert placer.snapshot("a").operations == 2
    assert placer.place(req()) == Unplaceable(reasons.OPERATIONS_BUSY)
    # another node with an operation free is used instead, by both placers alike
    assert place_all_ways(req(), [busy, node("b", max_operations=1)]) == select_node(req(), [node("b", max_operations=1)])
    # a full node is told as full even while it is also busy preparing
    assert first_failure(req(), node("c", max_operations=1, operations=1, reserved=BIG)) == reasons.NO_ROOM


def test_a_burst_never_exceeds_the_operations_limit_in_one_batch() -> None:
    fleet = [node("a", max_operations=3), node("b", max_operations=1)]
    placer = Placer(fleet)
    got = [placer.place(req(resources=replace(TASK, cpu_millis=10, memory_bytes=1))) for _ in range(6)]
    placed = [p.node_id for p in got if isinstance(p, Placement)]
    assert sorted(placed) == ["a", "a", "a", "b"]
    assert got[4:] == [Unplaceable(reasons.OPERATIONS_BUSY)] * 2


def test_placer_tells_a_saturated_backlog_the_same_reason_each_time() -> None:
    placer = Placer([node("a", allocatable=replace(BIG, slots=1)), node("b", allocatable=replace(BIG, slots=1))])
    got = [placer.place(req()) for _ in range(5)]
    assert [getattr(p, "node_id", None) for p in got[:2]] == ["a", "b"]
    assert got[2:] == [Unplaceable(reasons.FULL)] * 3


def test_placer_reason_follows_the_batch() -> None:
    """A task that failed for want of a slot fails for want of CPU once a smaller task of the same
    shape has taken that CPU: a cached reason must not outlive the placement that changed it."""
    fleet = [node(allocatable=replace(BIG, slots=1), reserved=Resources(slots=1))]
    big = req(resources=Resources(cpu_millis=3000, slots=1))
    small = req(resources=Resources(cpu_millis=2000, slots=0))
    placer = Placer(fleet)
    assert placer.place(big) == Unplaceable(reasons.FULL)
    assert isinstance(placer.place(small), Placement)
    assert placer.place(big) == Unplaceable(reasons.NO_ROOM)
    assert select_node(big, [placer.snapshot("n1")]) == Unplaceable(reasons.NO_ROOM)


@pytest.mark.parametrize("policy", [SPREAD, BINPACK])
@pytest.mark.parametrize("block", [1, 3, 64])
def test_placer_matches_select_node_on_a_larger_fleet(policy: str, block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hundreds of nodes and tasks, with block sizes that force many splits and empty blocks, since
    the property tests' small fleets fit in a single block."""
    monkeypatch.setattr(placement_index, "BLOCK", block)
    rng = random.Random(7)  # a fixed seed: the fleet is arbitrary, the test is deterministic
    sizes = [Resources(2000, 4 * GIB, 50 * GIB, 0, 4), Resources(8000, 32 * GIB, 200 * GIB, 2, 8)]
    fleet = []
    for i in range(150):
        size = rng.choice(sizes)
        fleet.append(
            NodeSnapshot(
                id=f"node-{i:03d}",
                pool=rng.choice(["default", "default", "batch"]),
                labels={"zone": rng.choice("ab")},
                draining=rng.random() < 0.05,
                health=rng.choice(["online"] * 20 + ["offline"]),
                allocatable=size,
                reserved=Resources(rng.randrange(0, size.cpu_millis, 250), 0, 0, 0, rng.randrange(0, 3)),
                gpu_free=tuple(range(size.gpus)),
                artifacts=frozenset(rng.sample(["i1", "i2", "i3"], rng.randrange(0, 3))),
            )
        )
    shapes = [
        req(),
        req(pool="batch"),
        req(labels={"zone": "a"}, resources=replace(TASK, cpu_millis=3000)),
        req(resources=replace(TASK, gpus=1)),
        req(preferred_artifacts=("i1", "i2")),
        req(home_node="node-007"),
    ]
    placer = Placer(fleet, policy=policy)
    current = list(fleet)
    position = {n.id: i for i, n in enumerate(fleet)}
    for _ in range(400):
        r = rng.choice(shapes)
        expected = select_node(r, current, policy=policy)
        assert placer.place(r) == expected
        if isinstance(expected, Placement):
            i = position[expected.node_id]
            current[i] = current[i].reserving(r.resources, expected.gpu_indexes)
    assert [placer.snapshot(n.id) for n in current] == current


def test_placeable_at_most_counts_free_slots_and_operations_of_nodes_that_take_work() -> None:
    fleet = [
        node("a"),  # 4 slots free
        node("b", reserved=Resources(slots=3)),  # 1
        node("c", max_operations=2),  # 4 slots, but 2 operations
        node("d", operations=4),  # operations all in use: 0
        node("e", draining=True),
        node("f", health="unreachable"),
        node("g", connected=False),
        node("h", reserved=Resources(slots=5)),  # over-reserved (a bug upstream): 0, not -1
    ]
    assert placement.placeable_at_most(fleet) == 4 + 1 + 2
    assert placement.placeable_at_most([]) == 0


def test_placeable_at_most_counts_cpu_and_memory_in_tasks_of_the_smallest_size() -> None:
    fleet = [
        node("a", allocatable=Resources(cpu_millis=1050, memory_bytes=2**34, slots=32), max_operations=32),  # 10 by CPU
        node("b", allocatable=Resources(cpu_millis=8000, memory_bytes=2**30, slots=32), max_operations=32),  # 4 by memory
        node("c", allocatable=Resources(cpu_millis=8000, memory_bytes=2**34, slots=3), max_operations=32),  # 3 by slots
    ]
    assert placement.placeable_at_most(fleet) == 32 + 32 + 3
    assert placement.placeable_at_most(fleet, Resources(cpu_millis=100, memory_bytes=2**28)) == 10 + 4 + 3
    assert placement.placeable_at_most(fleet, Resources(cpu_millis=0, memory_bytes=0)) == 32 + 32 + 3


@pytest.mark.parametrize("seed", range(5))
def test_no_batch_of_tasks_places_more_than_placeable_at_most(seed: int) -> None:
    """The dispatcher claims no more tasks than this bound while nothing else could be placed, so it
    must never be below what any sequence of tasks actually gets placed."""
    rng = random.Random(seed)
    sizes = [Resources(2000, 4 * GIB, 50 * GIB, 0, 4), Resources(8000, 32 * GIB, 200 * GIB, 2, 8)]
    fleet = [
        NodeSnapshot(
            id=f"node-{i:02d}",
            pool=rng.choice(["default", "batch"]),
            draining=rng.random() < 0.1,
            health=rng.choice(["online"] * 8 + ["offline", "unreachable"]),
            allocatable=(size := rng.choice(sizes)),
            reserved=Resources(0, 0, 0, 0, rng.randrange(0, size.slots + 1)),
            gpu_free=tuple(range(size.gpus)),
            max_operations=rng.randrange(1, 6),
            operations=rng.randrange(0, 3),
        )
        for i in range(30)
    ]
    bound = placement.placeable_at_most(fleet)
    shapes = [req(), req(pool="batch"), req(resources=replace(TASK, gpus=1)), req(resources=replace(TASK, cpu_millis=250))]
    placer = Placer(fleet)
    placed = sum(isinstance(placer.place(rng.choice(shapes)), Placement) for _ in range(400))
    assert 0 < placed <= bound
    tiny = Placer(fleet)  # the smallest task fills every slot and operation the bound counts
    assert sum(isinstance(tiny.place(req(resources=Resources(slots=1))), Placement) for _ in range(400)) == bound


# --- explain -----------------------------------------------------------------------------------------------


def test_explain_gives_one_row_per_node_sorted_by_id() -> None:
    fleet = [
        node("c", draining=True),
        node("a", reserved=Resources(cpu_millis=2000, memory_bytes=4 * GIB, slots=2)),
        node("d", connected=False),
        node("b", pool="other"),
        node("e", reserved=Resources(slots=4)),
    ]
    assert explain(req(pool="default"), fleet) == [
        NodeVerdict("a", None, 0.5),
        NodeVerdict("b", reasons.NO_POOL, None),
        NodeVerdict("c", reasons.ALL_DRAINING, None),
        NodeVerdict("d", reasons.NO_NODES, None),
        NodeVerdict("e", reasons.FULL, None),
    ]
    assert explain(req(), []) == []


# --- the public surface and the purity rule ------------------------------------------------------------------


def test_public_surface() -> None:
    assert sorted(placement.__all__) == sorted(
        [
            "BINPACK",
            "POLICIES",
            "SPREAD",
            "Derived",
            "NodeSnapshot",
            "NodeVerdict",
            "Placement",
            "Placer",
            "Requirements",
            "Resources",
            "Unplaceable",
            "explain",
            "placeable_at_most",
            "select_node",
        ]
    )
    for name in placement.__all__:
        assert getattr(placement, name) is not None
    assert (SPREAD, BINPACK) == ("spread", "binpack")


FORBIDDEN_MODULES = {"asyncio", "time", "datetime", "random", "os", "socket", "threading", "uuid", "secrets"}


def test_placement_imports_nothing_impure() -> None:
    """Placement is pure: no I/O, no clock, no randomness, and no podium module but the reasons."""
    package = Path(placement.__file__).parent
    for source in sorted(package.glob("*.py")):
        for stmt in ast.walk(ast.parse(source.read_text())):
            if isinstance(stmt, ast.Import):
                names = [alias.name for alias in stmt.names]
            elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0:
                names = [stmt.module or ""]
                if stmt.module == "podium":
                    names = [f"podium.{alias.name}" for alias in stmt.names]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN_MODULES, (source.name, name)
                assert not name.startswith("podium") or name == "podium.reasons", (source.name, name)


def test_nodes_an_earlier_attempt_failed_on_come_last_but_are_still_used() -> None:
    from podium.placement import NodeSnapshot, Placer, Requirements, Resources, select_node

    big = Resources(cpu_millis=4000, memory_bytes=2**33, slots=4)
    nodes = [NodeSnapshot(id="a", allocatable=big), NodeSnapshot(id="b", allocatable=big)]
    plain = Requirements(resources=Resources(slots=1))
    retry = Requirements(resources=Resources(slots=1), avoid_nodes=frozenset({"a"}))
    assert select_node(plain, nodes).node_id == "a"  # type: ignore[union-attr]
    assert select_node(retry, nodes).node_id == "b"  # type: ignore[union-attr]
    assert Placer(nodes).place(retry).node_id == "b"  # type: ignore[union-attr]
    only_a = [nodes[0]]
    assert select_node(retry, only_a).node_id == "a"  # type: ignore[union-attr]
    assert Placer(only_a).place(retry).node_id == "a"  # type: ignore[union-attr]


def test_explain_names_the_egress_a_node_cannot_give() -> None:
    """"Why not node X?" for a task that must run without a network: only a node whose sandboxes can
    cut it off fits; the others fail the egress check, and the task's reason is that check."""
    fleet = [
        node("open-only", egress_contexts=frozenset({"open"})),
        node("isolating", egress_contexts=frozenset({"none", "open"}), reserved=Resources(slots=4)),
        node("silent"),
    ]
    r = req(egress="none")
    verdicts = {v.node_id: v.failed for v in explain(r, fleet)}
    assert verdicts == {"open-only": reasons.NO_EGRESS, "isolating": reasons.FULL, "silent": reasons.NO_EGRESS}
    assert place_all_ways(r, fleet) == Unplaceable(reasons.FULL)
    assert place_all_ways(r, [fleet[0], fleet[2]]) == Unplaceable(reasons.NO_EGRESS)
    free = replace(fleet[1], reserved=Resources())
    assert place_all_ways(r, [fleet[0], free, fleet[2]]) == Placement("isolating", (), 1.0)
    # no requirement: every node's network will do
    assert {v.node_id for v in explain(req(), fleet) if v.failed is None} == {"open-only", "silent"}
