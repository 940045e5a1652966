"""What a node's Hello says for the seed's contract beyond its capacity and labels: the attempts it
still holds (kept for the reconcile loop), its limit on provisioning operations, and its
materialization snapshots — and what the server does when a node's runtime changed under it.

A module of its own beside the stream handler, so the two change without treading on each other.
"""

from __future__ import annotations

import logging
from typing import Any

from podium.proto.podium.v1 import agent_pb2 as pb
from podium.scheduler import policy
from podium.store import Store
from podium.store.db import DEFAULT_MAX_OPERATIONS
from podium.store.reconcile import ReconcileStore

log = logging.getLogger(__name__)

MAX_MATERIALIZATIONS = 16  # snapshots one Hello may carry (one per backend: a handful)
MAX_FIELD = 256  # characters in one snapshot field
MAX_OPERATIONS = 1024  # the most provisioning operations a node may claim to run at once


def materialization(m: pb.MaterializationSnapshot) -> dict[str, str]:
    """One snapshot as stored and shown (the seed's names, in snake case)."""
    return {
        "backend_kind": m.backend_kind,
        "architecture": m.architecture,
        "runtime_digest": m.runtime_digest,
        "toolchain_digest": m.toolchain_digest,
        "digest": m.digest,
    }


def hello_facts(hello: pb.Hello) -> dict[str, Any]:
    """`Store.instance_hello`'s arguments for these facts. An agent too old to send them gets the
    defaults: the server's operations limit and no snapshots."""
    return {
        "hello_tokens": [rt.fencing_token for rt in hello.tasks],
        "max_operations": min(hello.max_operations, MAX_OPERATIONS) if hello.max_operations > 0 else DEFAULT_MAX_OPERATIONS,
        "materializations": [materialization(m) for m in hello.materializations[:MAX_MATERIALIZATIONS]],
    }


def check_materializations(hello: pb.Hello) -> str | None:
    """A Hello whose snapshots cannot be stored is refused with what is wrong (INVALID_ARGUMENT)."""
    if len(hello.materializations) > MAX_MATERIALIZATIONS:
        return f"Hello carries {len(hello.materializations)} materialization snapshots; at most {MAX_MATERIALIZATIONS} (one per backend)"
    for m in hello.materializations:
        for name, value in materialization(m).items():
            if len(value) > MAX_FIELD:
                return f"materialization snapshot field {name} is longer than {MAX_FIELD} characters"
    if hello.max_operations < 0:
        return "Hello's max_operations must be 0 (the server's default) or more"
    return None


async def revalidate(store: Store, node_id: str, before: list[dict[str, str]], hello: pb.Hello) -> list[tuple[str, str, str]]:
    """Revalidate a reconnecting node's materializations: a backend whose runtime digest changed is
    not trusted with the assumptions its attempts were assigned under — they are rechecked now by the
    reconcile loop — and a node event says what changed. Returns the changes."""
    changes = policy.runtime_changes(before, [materialization(m) for m in hello.materializations])
    if changes:
        message = "; ".join(f"backend {k} runtime changed from {old} to {new}" for k, old, new in changes)
        message += ": its attempts assigned under the old runtime are rechecked"
        log.warning("node %s: %s", node_id, message)
        await ReconcileStore(store).runtime_changed(
            node_id, [k for k, _o, _n in changes], message, {"changes": [{"backend_kind": k, "from": o, "to": n} for k, o, n in changes]}
        )
    return changes
