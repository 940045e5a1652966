"""Plot latency runs: submit → Assign-received p50 and p99 against the offered load.

    python bench/plot.py [RESULTS.json ...] [--out docs/bench-latency.png]

Reads the `offered N/s` phases of `bench/run.py --scenario latency [--batch N]` results files (default:
bench/results/latency.json and, if present, bench/results/latency-batch10.json), one pair of lines
per file. Each point is labelled with the rate the server actually accepted, because an overloaded
server accepts less than is offered (the load generator then starts late, which the results file
counts as late starts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: write the file only
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def series_label(res: dict) -> str:
    batch = res["config"].get("batch") or 1
    return "one POST per task" if batch == 1 else f"batches of {batch}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="*", type=Path)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench-latency.png")
    args = p.parse_args()
    files = args.results or [f for f in (ROOT / "bench" / "results" / "latency.json",
                                         ROOT / "bench" / "results" / "latency-batch10.json") if f.exists()]  # fmt: skip
    if not files:
        raise SystemExit("no results: run `bench/run.py --scenario latency` first")

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    ticks: set[float] = set()
    res: dict = {}
    for n, path in enumerate(files):
        res = json.loads(path.read_text())
        phases = [
            ph for ph in res["phases"]
            if ph.get("kind") == "load" and isinstance(ph.get("offered_rate_per_s"), (int, float))
            and ph["name"].startswith("offered")
        ]  # fmt: skip
        if not phases:
            raise SystemExit(f"{path} has no fixed-rate phases: run `bench/run.py --scenario latency` first")
        phases.sort(key=lambda ph: ph["offered_rate_per_s"])
        x = [ph["offered_rate_per_s"] for ph in phases]
        ticks.update(x)
        color = f"C{n}"
        label = series_label(res)
        for key, style in (("p50", "o-"), ("p99", "^:")):
            ax.plot(x, [ph["submit_to_assign_ms"][key] for ph in phases], style, color=color, label=f"{label}: {key}")
        for ph in phases:
            top = ph["submit_to_assign_ms"]["p99"]
            ax.annotate(f"{ph['submit']['submit_rate_per_s']:.0f}/s", (ph["offered_rate_per_s"], top), color=color,
                        textcoords="offset points", xytext=(0, 6 + 9 * n), ha="center", fontsize=7)  # fmt: skip
    ax.axhline(10, color="0.5", lw=0.8, ls="--")
    ax.axhline(50, color="0.5", lw=0.8, ls="-.")
    ax.text(min(ticks), 10, " target p50", fontsize=7, color="0.4", va="bottom")
    ax.text(min(ticks), 50, " target p99", fontsize=7, color="0.4", va="bottom")
    ax.set_xlabel("offered load (tasks/s); labels: tasks/s the API accepted")
    ax.set_ylabel("submit → Assign received (ms)")
    ax.set_yscale("log")
    ax.margins(x=0.08, y=0.2)  # room for the labels above the p99 points
    ax.set_xticks(sorted(ticks))
    ax.grid(True, which="both", alpha=0.3)
    m = res["machine"]
    ax.set_title(f"Podium submit→Assign latency, {res['config']['nodes']} simulated nodes", fontsize=11)
    fig.text(0.01, 0.01,
             f"{m['nproc']} cores, {m['memory_gib']} GiB, {m['cpu_model']}, Python {m['python']}, {m['postgresql']}; "
             f"load average {m['loadavg_at_start'][0]}→{m['loadavg_at_end'][0]} (shared machine)",
             fontsize=6.5, color="0.35")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
