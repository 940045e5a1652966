"""Plot a latency run: submit → Assign-received p50/p95/p99 against the offered load.

    python bench/plot.py [bench/results/latency.json] [--out docs/bench-latency.png]

Reads the `offered N/s` phases of a `bench/run.py --scenario latency` results file. The x axis is the
offered load; each point is labelled with the rate the server actually accepted, because an
overloaded server accepts less than is offered (the load generator then starts late, which the
results file counts as late starts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: write the file only
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="?", type=Path, default=ROOT / "bench" / "results" / "latency.json")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench-latency.png")
    args = p.parse_args()

    res = json.loads(args.results.read_text())
    phases = [
        ph for ph in res["phases"]
        if ph.get("kind") == "load" and isinstance(ph.get("offered_rate_per_s"), (int, float))
        and ph["name"].startswith("offered")
    ]  # fmt: skip
    if not phases:
        raise SystemExit(f"{args.results} has no fixed-rate phases: run `bench/run.py --scenario latency` first")
    phases.sort(key=lambda ph: ph["offered_rate_per_s"])
    x = [ph["offered_rate_per_s"] for ph in phases]

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for key, style in (("p50", "o-"), ("p95", "s--"), ("p99", "^:")):
        ax.plot(x, [ph["submit_to_assign_ms"][key] for ph in phases], style, label=key)
    for ph in phases:
        top = ph["submit_to_assign_ms"]["p99"]
        ax.annotate(f"accepted {ph['submit']['submit_rate_per_s']:.0f}/s", (ph["offered_rate_per_s"], top),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)  # fmt: skip
    ax.set_xlabel("offered load (tasks/s, POST /v1/tasks)")
    ax.set_ylabel("submit → Assign received (ms)")
    ax.set_yscale("log")
    ax.margins(x=0.08, y=0.2)  # room for the labels above the p99 points
    ax.set_xticks(x)
    ax.grid(True, which="both", alpha=0.3)
    m = res["machine"]
    cfg = res["config"]
    ax.set_title(f"Podium submit→Assign latency, {cfg['nodes']} nodes", fontsize=11)
    fig.text(0.01, 0.01,
             f"{m['nproc']} cores, {m['memory_gib']} GiB, {m['cpu_model']}, Python {m['python']}, {m['postgresql']}; "
             f"load average {m['loadavg_at_start'][0]}→{m['loadavg_at_end'][0]} (shared machine)",
             fontsize=6.5, color="0.35")  # fmt: skip
    ax.legend()
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
