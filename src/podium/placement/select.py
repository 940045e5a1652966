"""Choosing among the nodes that fit, and the one-task entry points `select_node` and `explain`.

`select_node` is the reference: a plain scan over every snapshot, written to be obviously right.
The batch `Placer` (index.py) must return exactly what it returns, so the ranking lives here once
and both use it. Nothing here may read a clock, do I/O, draw a random number or let the order of
the snapshots change the answer.

Ranking among the nodes that fit, best first:

1. not a node an earlier attempt of the task failed on (`avoid_nodes`);
2. locality: more of the task's preferred artifacts already on the node;
3. the policy's score (see `utilisation`);
4. node id, so equal nodes always resolve the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from podium import reasons

from .filters import STAGE, first_failure, lowest_gpus
from .model import SPREAD, NodeSnapshot, NodeVerdict, Placement, Requirements, Unplaceable, check_policy


def utilisation(node: NodeSnapshot) -> float:
    """utilisation is the mean of the reserved fractions of CPU, memory and slots, over the
    dimensions the node has at all.

    It is the node's load *before* the task, on purpose: it does not depend on the request, so the
    batch placer can keep nodes sorted by it and find the best one without a scan. Because it is a
    mean (linear), for nodes of the same size it orders them exactly as "load after placing the
    task" would (the task adds the same amount to each); the maximum over dimensions would not.
    Kubernetes' LeastAllocated/MostAllocated scores are the same mean.
    """
    a, r = node.allocatable, node.reserved
    total = 0.0
    dims = 0
    if a.cpu_millis > 0:
        total += (r.cpu_millis if r.cpu_millis > 0 else 0) / a.cpu_millis
        dims += 1
    if a.memory_bytes > 0:
        total += (r.memory_bytes if r.memory_bytes > 0 else 0) / a.memory_bytes
        dims += 1
    if a.slots > 0:
        total += (r.slots if r.slots > 0 else 0) / a.slots
        dims += 1
    return total / dims if dims else 0.0


def rank_of(util: float, policy: str) -> float:
    """rank_of orders nodes within a locality level: lower is better."""
    return util if policy == SPREAD else -util


def score_of(util: float, policy: str) -> float:
    """score_of is what an operator sees: higher is better under either policy (the free fraction
    under SPREAD, the used fraction under BINPACK)."""
    return 1.0 - util if policy == SPREAD else util


def check_unique(snapshots: Sequence[NodeSnapshot]) -> None:
    """check_unique refuses two snapshots of one node: which one "wins" would depend on their
    order, and the answer must not."""
    if len({node.id for node in snapshots}) == len(snapshots):
        return
    seen: set[str] = set()
    for node in snapshots:
        if node.id in seen:
            raise ValueError(f"node {node.id!r} appears twice in the snapshots")
        seen.add(node.id)


def select_node(
    req: Requirements,
    snapshots: Sequence[NodeSnapshot],
    now: float | None = None,
    policy: str = SPREAD,
) -> Placement | Unplaceable:
    """select_node places one task, or says why it cannot be placed.

    When nothing fits, the reason is the latest pipeline stage any node reached: the stage at
    which the candidate set became empty, hence the most specific true sentence. An empty or
    entirely offline fleet is NO_NODES — even for a task with a home node, since "no node is
    connected" is the bigger and truer problem.

    `now` is accepted so that a future time-based rule reads the caller's clock, never its own;
    health is already folded into the snapshots today.
    """
    check_policy(policy)
    check_unique(snapshots)
    wanted = frozenset(req.preferred_artifacts)
    worst = STAGE[reasons.NO_NODES]
    best: NodeSnapshot | None = None
    best_key: tuple[bool, int, float, str] | None = None
    best_util = 0.0
    for node in snapshots:
        failed = first_failure(req, node)
        if failed is not None:
            worst = max(worst, STAGE[failed])
            continue
        util = utilisation(node)
        key = (node.id in req.avoid_nodes, -len(wanted & node.artifacts), rank_of(util, policy), node.id)
        if best_key is None or key < best_key:
            best, best_key, best_util = node, key, util
    if best is None:
        return Unplaceable(reasons.QUEUED_REASONS[worst])
    return Placement(best.id, lowest_gpus(best, req.resources.gpus), score_of(best_util, policy))


def explain(
    req: Requirements,
    snapshots: Sequence[NodeSnapshot],
    now: float | None = None,
    policy: str = SPREAD,
) -> list[NodeVerdict]:
    """explain answers "why not node X?" for every node, sorted by node id: the first check each
    one failed, or its score if it fits. `select_node`'s reason is always the latest of these."""
    check_policy(policy)
    check_unique(snapshots)
    verdicts = []
    for node in sorted(snapshots, key=lambda n: n.id):
        failed = first_failure(req, node)
        score = None if failed is not None else score_of(utilisation(node), policy)
        holds = tuple(a for a in req.preferred_artifacts if a in node.artifacts)
        verdicts.append(NodeVerdict(node.id, failed, score, holds))
    return verdicts
