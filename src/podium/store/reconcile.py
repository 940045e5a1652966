"""The store's statements for the reconcile loop (queries/reconcile.sql). Kept beside `Store` rather
than in it, like `store/ui.py`: it runs queries only through the store's pool, error translation and
bounded retries, and decides nothing (scheduler/policy.py decides, scheduler/reconcile.py applies)."""

from __future__ import annotations

from collections.abc import Sequence

from podium.store.db import Store, _retried
from podium.store.rows import ReconcileClaimRow


class ReconcileStore:
    def __init__(self, store: Store) -> None:
        self.store = store
        # `_retried` reads the limit from its first argument
        self.serialization_retry_limit = store.serialization_retry_limit

    @_retried
    async def claim(self, owner: str, limit: int, claim_seconds: float) -> list[ReconcileClaimRow]:
        """Claim up to `limit` live attempts due for a check for `owner`, until `claim_seconds` from
        now, each with its task's and its node's facts as they are now."""
        async with self.store._conn() as conn:
            rows = await conn.fetch(self.store.q["claim_reconcile"], owner, limit, claim_seconds)
        return ReconcileClaimRow.many(rows)

    @_retried
    async def finish(self, owner: str, results: Sequence[tuple[int, str, float]]) -> set[int]:
        """(fencing token, result sentence, seconds until the next check) per attempt: recorded and
        released where `owner` still holds the claim. Returns the tokens recorded."""
        if not results:
            return set()
        async with self.store._conn() as conn:
            rows = await conn.fetch(
                self.store.q["finish_reconcile"], [r[0] for r in results], owner, [r[1] for r in results],
                [r[2] for r in results],
            )  # fmt: skip
        return {r["fencing_token"] for r in rows}

    @_retried
    async def runtime_changed(self, node_id: str, kinds: Sequence[str], message: str, detail: dict[str, object]) -> None:
        """The node's runtime changed for these backends: its live attempts on them are checked now,
        and a `runtime_changed` node event says so."""
        async with self.store._conn() as conn:
            await conn.execute(self.store.q["runtime_changed"], node_id, list(kinds), message, detail)

    async def operations_in_flight(self) -> dict[str, int]:
        """Per node, the provisioning operations it runs now (attempts assigned or provisioning)."""
        async with self.store._conn() as conn:
            return {r["node_id"]: r["n"] for r in await conn.fetch(self.store.q["operations_in_flight"])}
