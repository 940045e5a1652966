"""`podium bench`: run real commands through a server and its fleet and print how fast they went
(podium.benchmark does the work; this is its command line)."""

from __future__ import annotations

import json
import shlex
from typing import Annotated, Any

import typer
from rich.text import Text

from podium.cli import render
from podium.cli.base import CliError, JsonOpt, ServerOpt, app, out


@app.command()
def bench(
    tasks: Annotated[int, typer.Option("--tasks", "-n", min=0, help="tasks in the burst (0: no burst)")] = 1000,
    batch: Annotated[int, typer.Option(min=1, max=1000, help="tasks per batch submission")] = 100,
    serial: Annotated[int, typer.Option(min=0, help="then this many tasks one at a time")] = 0,
    command: Annotated[str | None, typer.Option(
        "--command", "-c",
        help="the command, split as a shell splits words, run without a shell (default: true; one at a time: date +%s.%N)",
    )] = None,
    warmup: Annotated[int, typer.Option(min=0, help="untimed tasks first, so every node has started one")] = 10,
    timeout: Annotated[float, typer.Option(min=1, help="seconds each mode may take")] = 600.0,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Submit real commands (`true` by default), wait for every one to end, and print tasks per second
    and submit → running / succeeded latencies (p50, p99) as the API reports them. With --serial, one
    at a time, also submit → the command's first instruction, read from the timestamp it writes."""
    from podium.benchmark import Bench
    from podium.client import PodiumError

    if tasks == 0 and serial == 0:
        raise CliError("nothing to run: give --tasks N and/or --serial K")
    try:
        words = shlex.split(command) if command is not None else None
    except ValueError as e:
        raise CliError(f"--command {command!r} cannot be split into words: {e}") from None
    if words == []:
        raise CliError("--command is empty; give a command such as --command 'sleep 1'")
    try:
        b = Bench(server, command=words, timeout=timeout)
    except PodiumError as e:
        raise CliError(str(e)) from None
    results: list[dict[str, Any]] = []
    try:
        b.warm_up(warmup)
        if tasks:
            results.append(b.burst(tasks, batch))
            _show(results[-1], json_out)
        if serial:
            results.append(b.serial(serial))
            _show(results[-1], json_out)
    except PodiumError as e:
        raise CliError(str(e)) from None
    finally:
        b.close()


def _show(r: dict[str, Any], json_out: bool) -> None:
    if json_out:
        print(json.dumps(r), flush=True)
        return
    title = (f"{r['tasks']} tasks in batches of {r['batch']}" if r["mode"] == "burst" else f"{r['tasks']} tasks one at a time")
    figures = (("submit_to_running_ms", "submit → running (ms)"), ("submit_to_succeeded_ms", "submit → succeeded (ms)"),
               ("submit_to_first_instruction_ms", "submit → first instruction (ms)"))  # fmt: skip
    out.print(render.table(
        ("FIGURE", "P50", "P99"),
        ((label, _fmt(r[key]["p50"]), _fmt(r[key]["p99"])) for key, label in figures if key in r),
        title=f"{title}: {' '.join(r['command'])}",
    ))
    ends = ", ".join(f"{n} {state}" for state, n in sorted(r["ends"].items()))
    out.print(Text(f"{r['tasks_per_s']:,} tasks/s ({r['seconds']:.2f} s; {ends})"))
    if r["mode"] == "burst" and r.get("after_first_end_per_s") is not None:
        out.print(Text(f"the first task ended {r['first_end_ms']:,.1f} ms after the first submit; "
                       f"from then on {r['after_first_end_per_s']:,} tasks/s, the longest pause between "
                       f"two ends {r['longest_pause_ms']:,.1f} ms"))
    if r.get("stream_lost"):
        out.print(Text(f"note: {r['stream_lost']}; the rest was polled, so its times are the polls'"))


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:,.1f}"
