"""The batch placer: one index over a tick's snapshots, then one cheap answer per claimed task.

`select_node` scans every node for every task; at thousands of tasks a second over thousands of
nodes that scan is the whole budget. The `Placer` instead

1. groups the connected nodes by everything the static checks read except labels
   (`filters.group_key`), so a requirement shape is checked once per group, not once per node,
   and matches labels through a (key, value) → nodes index built the first time a task asks;
2. keeps, per requirement *shape* (everything but resources, home node and locality), one
   ordered structure of the compatible nodes, sorted by the policy's rank, built the first time
   the shape is seen and updated in place after every placement;
3. per shape and set of preferred artifacts, the same structure per locality level, so locality
   costs nothing when no task asks for it and one lookup per level when one does.

Each ordered structure (`_Ranked`) is a sorted list cut into blocks that remember an upper bound
of the free amounts inside them and the needs they were searched for in vain, so a search skips
whole blocks of nodes that cannot fit (full nodes at the front under BINPACK, small nodes under
SPREAD) instead of walking past them.

Correctness rule: `Placer.place` returns exactly what `select_node` returns on the snapshots as
updated by the previous placements. It can, because it reuses the same checks (filters.py) and the
same rank (select.py), and a placement only ever *removes* capacity within a batch, which keeps
every block bound an upper bound and every remembered failure a failure. Never read a clock or do I/O here, and never let the iteration
order of a set decide anything: the sets here are only ever filtered and then sorted by rank.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

from podium import reasons

from .filters import (
    STAGE,
    Free,
    GroupKey,
    fits,
    free_of,
    group_key,
    is_available,
    lowest_gpus,
    need_of,
    resource_failure,
    static_failure,
)
from .model import SPREAD, NodeSnapshot, Placement, Requirements, Resources, Unplaceable, check_policy
from .select import check_unique, rank_of, score_of, utilisation

#: Nodes per block of a `_Ranked`. Small enough that a block scan is cheap, large enough that a
#: search over 10,000 nodes visits at most a few hundred block bounds.
BLOCK = 64

_LAST = len(reasons.QUEUED_REASONS) - 1  # no stage is later
_LABELS = STAGE[reasons.NO_LABELS]
_NOBODY: frozenset[Any] = frozenset()
_UNBOUNDED = float("inf")
#: How many needs a block remembers failing; a batch has few distinct task sizes.
_MEMO = 8

#: A requirement shape: the fields the static checks read. Tasks with the same shape see the
#: same compatible nodes, so they share one ordered structure.
ShapeKey = tuple[str | None, str | None, str, int, frozenset[tuple[str, str]], frozenset[str], str | None]

#: A rank key: (rank, node id, node). Ids are unique, so two keys never compare their nodes.
Key = tuple[float, str, "_Node"]  # (sort score, node id, the node)

#: What a placer derives from one snapshot alone: (the snapshot, its free amounts, its utilisation,
#: its group key). A snapshot never changes, so while a node's snapshot is the same object these are
#: the same: a caller that keeps snapshots between ticks keeps these beside them (`Placer`'s
#: `derived`), and a tick's placer computes them only for the nodes whose snapshot is new.
Derived = tuple[NodeSnapshot, Free, float, GroupKey]


class _Node:
    """_Node is the placer's running view of one connected, not offline node."""

    __slots__ = ("snap", "free", "util", "key", "structures", "group")

    def __init__(self, snap: NodeSnapshot, policy: str, group: int, free: Free, util: float) -> None:
        self.structures: list[_Ranked] = []  # every structure that holds this node, to move it in
        self.group = group
        self.snap = snap
        self.free = free
        self.util = util
        self.key: Key = (rank_of(util, policy), snap.id, self)

    def set(self, snap: NodeSnapshot, policy: str) -> None:
        self.snap = snap
        self.free = free_of(snap)
        self.util = utilisation(snap)
        self.key = (rank_of(self.util, policy), snap.id, self)


def _bounds(block: list[Key]) -> list[float]:
    """_bounds is the largest free amount per dimension in a block (exact when computed)."""
    return [max(dim) for dim in zip(*(key[2].free for key in block), strict=False)]


class _Ranked:
    """_Ranked holds nodes in rank order and answers "the best one that fits this need".

    It is a sorted list cut into blocks, and each block remembers two things that let a search
    skip it without looking at its nodes:

    * an upper bound of each free amount in it. Bounds start unknown (infinite) and are computed
      the first time a search scans the block in vain; a node moved in raises them. They never
      understate what is free, so a block whose bound is too small holds no node that fits.
    * the needs it was searched for in vain. Within a batch a node's free amounts only shrink, so
      a block that could not serve a need cannot serve it, or anything larger, later — unless a
      node that can is moved in, which `move` checks. This is what keeps BINPACK fast: its best
      ranked nodes are the fullest, and per-dimension bounds alone rarely rule a block of them
      out, because one node's spare CPU and another's spare memory add up to a bound that passes.
    """

    __slots__ = ("_blocks", "_last", "_bounds", "_failed", "version")

    def __init__(self, nodes: list[_Node]) -> None:
        keys = [node.key for node in nodes]
        keys.sort()
        self._blocks = [keys[i : i + BLOCK] for i in range(0, len(keys), BLOCK)]
        self._last = [block[-1] for block in self._blocks]  # for bisecting to a key's block
        self._bounds = [[_UNBOUNDED] * 6 for _ in self._blocks]
        self._failed: list[list[Free]] = [[] for _ in self._blocks]
        self.version = 0  # bumped on every move, so a cached "nothing fits" knows it is stale
        for node in nodes:
            node.structures.append(self)

    def __iter__(self) -> Iterator[_Node]:
        for block in self._blocks:
            for key in block:
                yield key[2]

    def nodes(self) -> set[_Node]:
        return {key[2] for block in self._blocks for key in block}

    def first_fit(self, need: Free) -> _Node | None:
        """first_fit is the best-ranked node whose free amounts cover need, or None."""
        c0, c1, c2, c3, c4, c5 = need
        blocks, bounds, failed = self._blocks, self._bounds, self._failed
        for i, b in enumerate(bounds):
            if b[0] < c0 or b[1] < c1 or b[2] < c2 or b[3] < c3 or b[4] < c4 or b[5] < c5:
                continue
            if any(f[0] <= c0 and f[1] <= c1 and f[2] <= c2 and f[3] <= c3 and f[4] <= c4 and f[5] <= c5 for f in failed[i]):
                continue
            block = blocks[i]
            for key in block:
                f = key[2].free
                if c0 <= f[0] and c1 <= f[1] and c2 <= f[2] and c3 <= f[3] and c4 <= f[4] and c5 <= f[5]:
                    return key[2]
            # Searched in vain: remember it, so that the next search skips this block.
            bounds[i] = _bounds(block)
            memo = failed[i]
            if len(memo) >= _MEMO:
                del memo[0]  # forgetting only costs a scan; it never skips a fit
            memo.append(need)
        return None

    def first_fit_avoiding(self, need: Free, avoid: frozenset[str]) -> _Node | None:
        """first_fit_avoiding is first_fit that passes over the avoided nodes. A plain scan, and it
        learns nothing for the memo: only retried tasks carry an avoid set, and they are few."""
        c0, c1, c2, c3, c4, c5 = need
        for block in self._blocks:
            for key in block:
                node = key[2]
                f = node.free
                if (c0 <= f[0] and c1 <= f[1] and c2 <= f[2] and c3 <= f[3] and c4 <= f[4] and c5 <= f[5]
                        and node.snap.id not in avoid):
                    return node
        return None

    def move(self, old: Key, new: Key, free: Free) -> None:
        """move re-files a node whose rank (and free amounts) changed after a placement."""
        blocks, last, bounds, failed = self._blocks, self._last, self._bounds, self._failed
        i = bisect_left(last, old)
        block = blocks[i]
        del block[bisect_left(block, old)]
        if not block:
            del blocks[i], last[i], bounds[i], failed[i]
        else:
            last[i] = block[-1]
        self.version += 1
        if not blocks:
            blocks.append([new])
            last.append(new)
            bounds.append([*free])
            failed.append([])
            return
        i = min(bisect_left(last, new), len(blocks) - 1)
        block = blocks[i]
        insort(block, new)
        last[i] = block[-1]
        b = bounds[i]
        for d in range(6):
            if free[d] > b[d]:
                b[d] = free[d]
        if failed[i]:
            # A need the newcomer can serve is no longer one this block fails.
            failed[i] = [f for f in failed[i] if not fits(f, free)]
        if len(block) > 2 * BLOCK:
            half = len(block) // 2
            low, high = block[:half], block[half:]
            blocks[i : i + 1] = [low, high]
            last[i : i + 1] = [low[-1], high[-1]]
            bounds[i : i + 1] = [_bounds(low), _bounds(high)]
            failed[i : i + 1] = [failed[i], list(failed[i])]  # each half fails what the whole did


class _Shape:
    """_Shape is what the placer knows about one requirement shape."""

    __slots__ = ("ranked", "worst", "_members")

    def __init__(self, ranked: _Ranked, worst: int) -> None:
        self.ranked = ranked  # the compatible, non-draining, reachable nodes
        self.worst = worst  # the latest static stage any other connected node reached
        self._members: set[_Node] | None = None

    def members(self) -> set[_Node]:
        """members is the compatible nodes as a set, for filtering the artifact index."""
        if self._members is None:
            self._members = self.ranked.nodes()
        return self._members


def shape_key(req: Requirements) -> ShapeKey:
    """shape_key must cover every requirement field a static check reads (filters.STATIC_CHECKS)."""
    return (
        req.pool,
        req.arch,
        req.backend,
        req.protocol,
        frozenset(req.labels.items()),
        req.capabilities,
        req.egress,
    )


class Placer:
    """Batch placement for one dispatch tick: built once from the snapshots, then place() is
    called for each claimed task in order; each successful place() reserves the resources (and
    GPU indexes) in the Placer's own copy so later tasks in the same batch see them taken.

    It gives exactly the same answers as calling `select_node` against the snapshots updated after
    each placement (`NodeSnapshot.reserving`), at a fraction of the cost: see the module docstring.
    A Placer is for one tick; build a new one from fresh snapshots for the next. `derived`, kept by
    the caller from tick to tick, holds what earlier placers derived from each node's snapshot
    (`Derived`): read where the snapshot is the very same object, filled in for the rest. Building
    over 5,000 nodes spent half its time deriving them again, each tick, for the nodes that had not
    changed (docs/benchmarks.md, twenty-third session).
    """

    def __init__(
        self,
        snapshots: Sequence[NodeSnapshot],
        now: float | None = None,
        policy: str = SPREAD,
        derived: dict[str, Derived] | None = None,
    ) -> None:
        check_policy(policy)
        self._policy = policy
        self._now = now  # kept for parity with select_node; no rule reads time yet
        self._snaps: dict[str, NodeSnapshot] = {snap.id: snap for snap in snapshots}
        if len(self._snaps) != len(snapshots):
            check_unique(snapshots)
        self._nodes: dict[str, _Node] = {}
        self._groups: list[list[_Node]] = []  # a group's first node stands for all of it
        number: dict[GroupKey, int] = {}
        for snap in snapshots:
            if not is_available(snap):
                continue  # offline nodes only ever contribute NO_NODES, the earliest stage
            # (an unreachable node is kept: its group fails the UNREACHABLE static check, which
            # is how a fleet of frozen nodes gets its own sentence)
            d = derived.get(snap.id) if derived is not None else None
            if d is None or d[0] is not snap:
                d = (snap, free_of(snap), utilisation(snap), group_key(snap))
                if derived is not None:
                    derived[snap.id] = d
            group = number.setdefault(d[3], len(number))
            if group == len(self._groups):
                self._groups.append([])
            node = _Node(snap, policy, group, d[1], d[2])
            self._nodes[snap.id] = node
            self._groups[group].append(node)
        self._by_label: dict[str, dict[str | None, set[_Node]]] = {}
        self._by_artifact: dict[str, list[_Node]] | None = None
        self._shapes: dict[ShapeKey, _Shape] = {}
        self._localities: dict[tuple[ShapeKey, frozenset[str]], list[_Ranked]] = {}
        self._unplaceable: dict[tuple[ShapeKey, Resources], tuple[int, str]] = {}

    def snapshot(self, node_id: str) -> NodeSnapshot:
        """snapshot is the node as this batch has left it: the scheduler writes these reservations
        back, and a test compares them with `select_node`'s input."""
        return self._snaps[node_id]

    def place(self, req: Requirements) -> Placement | Unplaceable:
        """place answers for one task and, on success, takes its resources for the rest of the
        batch."""
        need = need_of(req.resources)
        if req.home_node is not None:
            return self._place_home(req, need)
        key = shape_key(req)
        shape = self._shape(key, req)
        node = None
        if req.avoid_nodes:
            # the same order as the normal search, with the avoided nodes held back to the end
            if req.preferred_artifacts:
                for ranked in self._locality(key, shape, frozenset(req.preferred_artifacts)):
                    node = ranked.first_fit_avoiding(need, req.avoid_nodes)
                    if node is not None:
                        break
            if node is None:
                node = shape.ranked.first_fit_avoiding(need, req.avoid_nodes)
        if node is None and req.preferred_artifacts:
            for ranked in self._locality(key, shape, frozenset(req.preferred_artifacts)):
                node = ranked.first_fit(need)
                if node is not None:
                    break
        if node is None:
            # Any node with locality that fits was found above, so the best fit here has none.
            node = shape.ranked.first_fit(need)
        if node is None:
            return Unplaceable(self._reason(key, shape, req.resources, need))
        return self._commit(node, req.resources)

    def _place_home(self, req: Requirements, need: Free) -> Placement | Unplaceable:
        """_place_home looks at the home node alone: every other node is invisible to the task, so
        they can only ever say HOME_UNAVAILABLE (or NO_NODES, if they are offline too)."""
        assert req.home_node is not None
        node = self._nodes.get(req.home_node)
        if node is None:
            return Unplaceable(reasons.HOME_UNAVAILABLE if self._nodes else reasons.NO_NODES)
        failed = static_failure(req, node.snap) or resource_failure(need, node.snap, node.free)
        if failed is not None:
            return Unplaceable(failed)
        return self._commit(node, req.resources)

    def _shape(self, key: ShapeKey, req: Requirements) -> _Shape:
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = self._new_shape(req)
        return shape

    def _new_shape(self, req: Requirements) -> _Shape:
        """_new_shape runs the static checks once per group. The label check sits between the
        protocol and capability checks, so a group that fails an earlier check fails it whatever
        its labels, and one that fails a later check fails NO_LABELS instead on nodes that lack a
        label."""
        worst = STAGE[reasons.NO_NODES]
        carriers = self._carriers(req) if req.labels else None
        members: list[_Node] = []
        for group, nodes in enumerate(self._groups):
            failed = static_failure(req, nodes[0].snap, skip_labels=True)
            if failed is not None and STAGE[failed] < _LABELS:
                worst = max(worst, STAGE[failed])
                continue
            passing = nodes if carriers is None else carriers.get(group, [])
            if len(passing) < len(nodes):
                worst = max(worst, _LABELS)
            if not passing:
                continue
            if failed is not None:
                worst = max(worst, STAGE[failed])
                continue
            members.extend(passing)
        return _Shape(_Ranked(members), worst)

    def _carriers(self, req: Requirements) -> dict[int, list[_Node]]:
        """_carriers is, per group, the nodes carrying every label the task requires. The index
        is built per label key on first use, so a label nobody asks for (a host name) costs
        nothing."""
        sets = sorted((self._labelled(key).get(value, _NOBODY) for key, value in req.labels.items()), key=len)
        by_group: dict[int, list[_Node]] = defaultdict(list)
        for node in sets[0].intersection(*sets[1:]):
            by_group[node.group].append(node)
        return by_group

    def _labelled(self, key: str) -> dict[str | None, set[_Node]]:
        index = self._by_label.get(key)
        if index is None:
            index = self._by_label[key] = defaultdict(set)
            for node in self._nodes.values():
                # Filed under .get(key) exactly as the label check reads it, missing included.
                index[node.snap.labels.get(key)].add(node)
        return index

    def _locality(self, key: ShapeKey, shape: _Shape, wanted: frozenset[str]) -> list[_Ranked]:
        """_locality is one structure per locality level, best level first, holding only the
        compatible nodes with at least one wanted artifact."""
        levels = self._localities.get((key, wanted))
        if levels is None:
            if self._by_artifact is None:
                self._by_artifact = defaultdict(list)
                for node in self._nodes.values():
                    for artifact in node.snap.artifacts:
                        self._by_artifact[artifact].append(node)
            members = shape.members()
            by_level: dict[int, list[_Node]] = defaultdict(list)
            if len(wanted) == 1:  # the common case: one image, one level
                (artifact,) = wanted
                by_level[1] = [node for node in self._by_artifact.get(artifact, ()) if node in members]
            else:
                candidates = {node for artifact in wanted for node in self._by_artifact.get(artifact, ())}
                for node in candidates & members:
                    by_level[len(wanted & node.snap.artifacts)].append(node)
            levels = [_Ranked(by_level[level]) for level in sorted(by_level, reverse=True) if by_level[level]]
            self._localities[(key, wanted)] = levels
        return levels

    def _reason(self, key: ShapeKey, shape: _Shape, resources: Resources, need: Free) -> str:
        """_reason is the latest stage any node reached. It scans the shape's nodes, so the answer
        is cached until one of them changes: a saturated fleet answers a backlog of identical
        tasks with one scan, not one per task."""
        cached = self._unplaceable.get((key, resources))
        if cached is not None and cached[0] == shape.ranked.version:
            return cached[1]
        worst = shape.worst
        for node in shape.ranked:
            failed = resource_failure(need, node.snap, node.free)
            if failed is not None and STAGE[failed] > worst:
                worst = STAGE[failed]
                if worst == _LAST:
                    break  # no stage is later
        reason = reasons.QUEUED_REASONS[worst]
        self._unplaceable[(key, resources)] = (shape.ranked.version, reason)
        return reason

    def _commit(self, node: _Node, resources: Resources) -> Placement:
        snap = node.snap
        gpus = lowest_gpus(snap, resources.gpus)
        placement = Placement(snap.id, gpus, score_of(node.util, self._policy))
        updated = snap.reserving(resources, gpus)
        self._snaps[snap.id] = updated
        old = node.key
        node.set(updated, self._policy)
        for ranked in node.structures:
            ranked.move(old, node.key, node.free)
        return placement
