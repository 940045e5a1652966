"""Placement: which node runs a task, or the one sentence that says why none can.

Pure business logic, after Nomad's scheduler: it reads node snapshots (and, for future rules, a
`now` the caller passes in) and returns a decision or a reason. It must never do I/O, touch the
store, gRPC or asyncio, read a clock, draw a random number, or import any other podium module than
`podium.reasons`. Same inputs, same answer — including when the snapshots arrive in another order.

    select_node  one task, reference semantics (select.py)
    explain      "why not node X?" for every node (select.py)
    Placer       a dispatch tick's batch, same answers as select_node, indexed (index.py)

See README.md in this folder for the pipeline and which file holds which step.
"""

from .filters import placeable_at_most
from .index import Derived, Placer
from .model import (
    BINPACK,
    POLICIES,
    SPREAD,
    NodeSnapshot,
    NodeVerdict,
    Placement,
    Requirements,
    Resources,
    Unplaceable,
)
from .select import explain, select_node

__all__ = [
    "BINPACK",
    "POLICIES",
    "Derived",
    "SPREAD",
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
