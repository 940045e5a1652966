"""Timings for podium.placement: `python bench/bench_placement.py [--quick]`.

The dispatch loop's budget is 4,000 placements a second on a 5,000-node fleet, in batches of up to
~512 claimed tasks, each batch placed by a fresh `Placer` built from that tick's snapshots. This
script builds a fleet that looks like a real one (a few pools and machine sizes, zone and tier
labels, cached images, some draining or offline nodes, nodes part-full already) and a task mix to
match, then times:

* one `select_node` (the reference scan) on 1,000 and 10,000 nodes;
* one `Placer` batch of 256 tasks on 1,000 and 10,000 nodes, build and placing apart;
* 4,000 tasks on 5,000 nodes in batches of 512, a fresh Placer per batch built from the snapshots
  the previous batch left, as the scheduler will run it — under both policies;
* the same with a per-node `host` label (a label no task asks for, on every node);
* a saturated fleet, where every task is queued and the reason is what costs.

The fleet and tasks come from a fixed seed, so two runs time the same work.
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from podium.placement import (  # noqa: E402
    BINPACK,
    SPREAD,
    Derived,
    NodeSnapshot,
    Placement,
    Placer,
    Requirements,
    Resources,
    select_node,
)

GIB = 1 << 30
SEED = 20240501
IMAGES = [f"sha256:{i:064x}" for i in range(12)]

#: (weight, pool, allocatable)
SIZES = [
    (40, "default", Resources(4_000, 16 * GIB, 100 * GIB, 0, 8)),
    (30, "default", Resources(16_000, 64 * GIB, 500 * GIB, 0, 16)),
    (15, "batch", Resources(64_000, 256 * GIB, 2_000 * GIB, 0, 32)),
    (10, "gpu", Resources(32_000, 128 * GIB, 1_000 * GIB, 4, 8)),
    (5, "default", Resources(8_000, 32 * GIB, 200 * GIB, 0, 8)),
]


def make_fleet(count: int, rnd: random.Random, host_labels: bool = False) -> list[NodeSnapshot]:
    weights = [w for w, _, _ in SIZES]
    fleet = []
    for i in range(count):
        _, pool, size = rnd.choices(SIZES, weights)[0]

        def part(total: int) -> int:
            return int(total * rnd.uniform(0.0, 0.6))

        slots = part(size.slots)
        gpus = part(size.gpus)
        labels = {"zone": rnd.choice("abc"), "tier": rnd.choice(["prod", "prod", "dev"])}
        if host_labels:
            labels["host"] = f"host-{i:05d}"
        health = rnd.choices(["online", "unreachable", "offline"], [97, 1, 2])[0]
        fleet.append(
            NodeSnapshot(
                id=f"node-{i:05d}",
                connected=rnd.random() > 0.01,
                health=health,
                draining=rnd.random() < 0.03,
                pool=pool,
                arch="arm64" if rnd.random() < 0.15 else "x86_64",
                labels=labels,
                capabilities=frozenset({"nvme"}) if rnd.random() < 0.3 else frozenset(),
                backends=frozenset({"process", "docker"}) if rnd.random() < 0.7 else frozenset({"process"}),
                allocatable=size,
                reserved=Resources(part(size.cpu_millis), part(size.memory_bytes), part(size.disk_bytes), gpus, slots),
                artifacts=frozenset(rnd.sample(IMAGES, rnd.randint(0, 4))),
                gpu_free=tuple(range(gpus, size.gpus)),
            )
        )
    return fleet


def make_tasks(count: int, rnd: random.Random, fleet: Sequence[NodeSnapshot]) -> list[Requirements]:
    small = Resources(500, 1 * GIB, 5 * GIB, 0, 1)
    medium = Resources(2_000, 4 * GIB, 20 * GIB, 0, 1)
    kinds: list[tuple[int, Callable[[], Requirements]]] = [
        (50, lambda: Requirements(resources=small)),
        (15, lambda: Requirements(resources=medium, pool="batch")),
        (10, lambda: Requirements(resources=small, labels={"zone": rnd.choice("abc"), "tier": "prod"})),
        (5, lambda: Requirements(resources=Resources(4_000, 16 * GIB, 50 * GIB, 1, 1), pool="gpu")),
        (10, lambda: Requirements(resources=small, backend="docker", preferred_artifacts=(rnd.choice(IMAGES),))),
        (4, lambda: Requirements(resources=small, arch="arm64", capabilities=frozenset({"nvme"}))),
        (4, lambda: Requirements(resources=medium, protocol=1, backend="docker")),
        (2, lambda: Requirements(resources=small, home_node=rnd.choice(fleet).id)),
    ]
    weights = [w for w, _ in kinds]
    return [rnd.choices(kinds, weights)[0][1]() for _ in range(count)]


def clock(fn: Callable[[], object], repeat: int) -> float:
    """clock is the median wall time of fn over repeat runs, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_batches(
    fleet: list[NodeSnapshot], tasks: list[Requirements], batch: int, policy: str, keep_derived: bool = True
) -> tuple[float, float, int]:
    """run_batches places tasks as the dispatch loop would: per batch, a fresh Placer built from
    the snapshots the previous batch left, with what earlier placers derived from the snapshots
    that did not change (`derived`, as the dispatcher keeps it; not with keep_derived=False).
    Returns (build seconds, place seconds, placed)."""
    build = place = 0.0
    placed = 0
    current = list(fleet)
    derived: dict[str, Derived] | None = {} if keep_derived else None
    for first in range(0, len(tasks), batch):
        start = time.perf_counter()
        placer = Placer(current, policy=policy, derived=derived)
        built = time.perf_counter()
        for req in tasks[first : first + batch]:
            if isinstance(placer.place(req), Placement):
                placed += 1
        done = time.perf_counter()
        build += built - start
        place += done - built
        current = [placer.snapshot(node.id) for node in current]
    return build, place, placed


def main(quick: bool) -> None:
    rnd = random.Random(SEED)
    repeat = 3 if quick else 7
    rows: list[tuple[str, str, str]] = []

    for nodes in (1_000, 10_000):
        fleet = make_fleet(nodes, rnd)
        tasks = make_tasks(256, rnd, fleet)
        gc.collect()
        singles = [clock(lambda t=t, fleet=fleet: select_node(t, fleet), 3) for t in tasks[:20]]  # type: ignore[misc]
        rows.append((f"select_node, 1 task, {nodes:,} nodes", ms(statistics.median(singles)), "median over 20 tasks of the mix"))
        gc.collect()
        build = clock(lambda fleet=fleet: Placer(fleet), repeat)
        gc.collect()
        total = clock(lambda fleet=fleet, tasks=tasks: [p.place(t) for p in [Placer(fleet)] for t in tasks], repeat)
        rows.append((f"Placer build, {nodes:,} nodes", ms(build), ""))
        rows.append(
            (
                f"Placer batch of 256, {nodes:,} nodes",
                ms(total),
                f"{(total - build) / len(tasks) * 1e6:6.1f} µs/task placing, {len(tasks) / total:7,.0f} tasks/s with build",
            )
        )
        if nodes == 1_000:
            gc.collect()
            naive = clock(lambda fleet=fleet, tasks=tasks: select_all(fleet, tasks), 1)
            rows.append(("256 x select_node, 1,000 nodes (no index)", ms(naive), f"{len(tasks) / naive:7,.0f} tasks/s"))

    for label, host_labels in (("", False), (", host label", True)):
        fleet = make_fleet(5_000, rnd, host_labels)
        tasks = make_tasks(4_000, rnd, fleet)
        for policy, keep in ((SPREAD, True), (SPREAD, False), (BINPACK, True)):
            gc.collect()
            build, place, placed = run_batches(fleet, tasks, 512, policy, keep)
            rows.append(
                (
                    f"4,000 tasks / 5,000 nodes, {policy}{label}{'' if keep else ', nothing kept between batches'}",
                    ms(build + place),
                    f"{len(tasks) / (build + place):7,.0f} tasks/s (build {build * 1e3:.0f} ms for 8 batches, "
                    f"{place / len(tasks) * 1e6:.1f} µs/task placing; {placed:,} placed)",
                )
            )

    fleet = [replace(n, reserved=n.allocatable) for n in make_fleet(5_000, rnd)]
    tasks = make_tasks(512, rnd, fleet)
    gc.collect()
    saturated = clock(lambda: [p.place(t) for p in [Placer(fleet)] for t in tasks], repeat)
    rows.append(("512 tasks, 5,000 full nodes (all queued)", ms(saturated), f"{len(tasks) / saturated:7,.0f} tasks/s with build"))

    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  {'time':>11}  notes")
    print("-" * (width + 2 + 11 + 2 + 60))
    for name, took, notes in rows:
        print(f"{name:<{width}}  {took:>11}  {notes}")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f} ms"


def select_all(fleet: list[NodeSnapshot], tasks: list[Requirements]) -> None:
    """select_all is the batch done the slow way: select_node per task on updated snapshots."""
    current = list(fleet)
    position = {n.id: i for i, n in enumerate(fleet)}
    for req in tasks:
        result = select_node(req, current)
        if isinstance(result, Placement):
            i = position[result.node_id]
            current[i] = current[i].reserving(req.resources, result.gpu_indexes)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
