"""Target 5 of the benchmarks issue: with 1,000,000 queued tasks, claiming the next batch stays as
fast as with 1,000. Fills a fresh database on the embedded PostgreSQL with N queued tasks (plus
finished ones, as a real table would hold), then times the dispatch claim and shows its plan.

    .venv/bin/python bench/claim_scale.py [--sizes 1000,1000000] [--finished 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from podium.store import Store  # noqa: E402
from podium.store.embedded import EmbeddedPostgres  # noqa: E402

FILL = """
INSERT INTO tasks (id, name, spec, state, reason, priority, cpu_millis, memory_bytes, timeout_seconds,
                   max_attempts, requeue_on_node_loss, created_at, finished_at)
SELECT gen_random_uuid(), 'bench', '{"command": ["true"]}'::jsonb, $2, 'waiting', 0, 100, 67108864, NULL, 3, true,
       now() - make_interval(secs => g), CASE WHEN $2 = 'queued' THEN NULL ELSE now() END
FROM generate_series(1, $1) g
"""


async def measure(store: Store, claim_limit: int, repeats: int) -> tuple[list[float], str]:
    """Each claim runs in a transaction that is rolled back, so its row locks never outlive it and
    every repetition claims the same head of the queue."""
    q = store.q["claim_queued"]
    times = []
    async with store.pool.acquire() as conn:
        for _ in range(repeats):
            tr = conn.transaction()
            await tr.start()
            t0 = time.perf_counter()
            await conn.fetch(q, claim_limit, [], [], [])
            times.append(time.perf_counter() - t0)
            await tr.rollback()
        tr = conn.transaction()
        await tr.start()
        plan = await conn.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + q, claim_limit, [], [], [])
        await tr.rollback()
    return times, plan


def plan_summary(plan_json: str) -> str:
    plan = json.loads(plan_json)[0]["Plan"]
    nodes = []

    def walk(p: dict) -> None:
        nodes.append(p["Node Type"] + (f" using {p['Index Name']}" if "Index Name" in p else ""))
        for c in p.get("Plans", []):
            walk(c)

    walk(plan)
    return " → ".join(nodes)


async def main(sizes: list[int], finished: int, claim_limit: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        emb = EmbeddedPostgres(Path(d))
        url = emb.start()
        await emb.ensure_database(url)
        store = await Store.connect(url, min_size=1, max_size=2)
        try:
            await store.migrate()
            async with store.pool.acquire() as conn:
                await conn.execute(FILL, finished, "succeeded")
            have = 0
            for n in sizes:
                async with store.pool.acquire() as conn:
                    t0 = time.perf_counter()
                    await conn.execute(FILL, n - have, "queued")
                    await conn.execute("VACUUM ANALYZE tasks")
                    fill = time.perf_counter() - t0
                have = n
                times, plan = await measure(store, claim_limit, 30)
                print(f"{n:>9,} queued (+{finished:,} finished; filled in {fill:.1f}s): claim of {claim_limit} "
                      f"median {statistics.median(times) * 1000:.2f} ms, max {max(times) * 1000:.2f} ms; "
                      f"plan: {plan_summary(plan)}")  # fmt: skip
        finally:
            await store.close()
            emb.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000,1000000")
    ap.add_argument("--finished", type=int, default=200_000)
    ap.add_argument("--claim-limit", type=int, default=512)
    a = ap.parse_args()
    asyncio.run(main([int(x) for x in a.sizes.split(",")], a.finished, a.claim_limit))
