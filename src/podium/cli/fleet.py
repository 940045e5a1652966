"""Node commands: `nodes`, `node-history`, `drain`, `undrain`, `label`, `revoke`. Clients of the API
only."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.markup import escape

from podium.cli import render
from podium.cli.base import CliError, JsonOpt, ServerOpt, app, connect, labels, out, parse
from podium.cli.contract import print_node_record
from podium.units import format_cpu, format_size, parse_duration


@app.command()
def nodes(
    node: Annotated[str | None, typer.Argument(help="one node (id, name, or the start of either): its whole record")] = None,
    limit: Annotated[int, typer.Option(min=1, help="show this many (any number: the CLI pages through them)")] = 1000,
    all_: Annotated[bool, typer.Option("--all", help="show every node")] = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List nodes with their health and capacity (or one node's whole record)."""
    if node is not None:
        d = connect(server).node(node).raw
        if json_out:
            render.print_json(d)
        else:
            print_node_record(out, d)
        return
    listing = connect(server).nodes(None if all_ else limit)
    rows = [n.raw for n in listing]
    # The sandbox columns only when some node has something to say in them: a fleet of plain process
    # nodes keeps the table narrow enough for a terminal (a cut-off cell would hide what it says).
    extra = {
        # capacity still held by ended attempts whose sandboxes are not proven removed yet
        "RELEASING": lambda n: (f"{n['releasing']['slots']} ({format_cpu(n['releasing']['cpu_millis'])}, "
                                f"{format_size(n['releasing']['memory_bytes'])})") if (n.get("releasing") or {}).get("slots") else "",
        "BACKENDS": lambda n: ",".join(n.get("backends") or []),
        "EGRESS": lambda n: ",".join(n.get("egress_contexts") or []),
        "LIMITS": lambda n: "enforced" if n.get("enforces_limits") else "",
    }  # fmt: skip
    plain = {"BACKENDS": "process", "EGRESS": "open"}
    shown = [c for c, cell in extra.items() if any(cell(n) not in ("", plain.get(c)) for n in rows)]

    def cells(n: dict[str, Any]) -> tuple[Any, ...]:
        a, r = n["allocatable"], n["reserved"]
        # health beside connected: a connected node is not a healthy one (a frozen agent's stream stays open)
        return (n["id"], n["name"], render.health(n["health"]), "yes" if n["connected"] else "no",
                "" if n.get("drain_phase", "active") == "active" else n.get("drain_phase", "draining"),
                f"{format_cpu(r['cpu_millis'])}/{format_cpu(a['cpu_millis'])}",
                f"{format_size(r['memory_bytes'])}/{format_size(a['memory_bytes'])}", f"{r['slots']}/{a['slots']}",
                *(extra[c](n) for c in shown),
                ",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())))  # fmt: skip

    columns = ("ID", "NAME", "HEALTH", "CONNECTED", "DRAIN", "CPU", "MEMORY", "SLOTS", *shown, "LABELS")
    render.show(rows, json_out, columns, cells, listing.remaining)


@app.command("node-history")
def node_history(node: str, server: ServerOpt = None, json_out: JsonOpt = False) -> None:
    """What happened to a node: agent processes that took its identity over, attempts handed over."""
    client = connect(server)
    rows: list[dict[str, Any]] = []
    while page := client.node_events(node, rows[-1]["id"] if rows else 0):
        rows += page
    if json_out:
        render.print_json(rows)
        return
    if not rows:
        out.print(f"nothing has happened to node {escape(node)} yet")
        return
    for e in rows:
        out.print(f"{render.when(e['at'])}  {escape(e['kind']):<10}  {escape(e['message'])}", soft_wrap=True, highlight=False)


@app.command()
def drain(
    node: str,
    deadline: Annotated[str | None, typer.Option(
        help="e.g. 10m: past it, what still runs there is requeued or lost by each task's node-loss policy")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="return only when the node is drained (nothing left on it)")] = False,
    server: ServerOpt = None,
) -> None:
    """Stop placing new work on a node; what it runs finishes (or, past --deadline, is requeued or lost)."""
    if deadline is not None:
        parse(parse_duration, deadline, "--deadline")
    client = connect(server)
    n = client.drain(node, True, deadline).raw
    out.print(f"node {n['name']} ({n['id']}) is {n.get('drain_phase', 'draining')}", markup=False)
    if not wait:
        return
    # Polled, not followed: a GET per second is nothing to the server, and survives a reconnect.
    while n.get("drain_phase") != "drained":
        if n.get("drain_phase") == "active":
            raise CliError(f"node {n['name']} was undrained while waiting for it to drain")
        time.sleep(1.0)
        n = client.node(n["id"]).raw
    out.print(f"node {n['name']} ({n['id']}) is drained: nothing runs there, safe to power off", markup=False)


@app.command()
def undrain(node: str, server: ServerOpt = None) -> None:
    """Let a drained node take new work again."""
    n = connect(server).drain(node, False).raw
    out.print(f"node {n['name']} ({n['id']}) takes work again", markup=False)


@app.command()
def label(
    node: str,
    changes: Annotated[list[str], typer.Argument(help="key=value to set, key- to remove")],
    server: ServerOpt = None,
) -> None:
    """Change a node's labels (kubectl style: zone=eu-1 sets, zone- removes)."""
    client = connect(server)
    current = dict(client.node(node).labels)
    for change in changes:
        if change.endswith("-") and "=" not in change:
            current.pop(change[:-1], None)
        else:
            current.update(labels([change]))
    n = client.set_labels(node, current).raw
    out.print(f"node {n['name']} ({n['id']}): " + (",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())) or "no labels"),
              markup=False)  # fmt: skip


@app.command()
def revoke(node: str, server: ServerOpt = None) -> None:
    """Remove a node from the fleet for good: its stream is closed and it can never rejoin."""
    n = connect(server).revoke_node(node).raw
    out.print(f"node {n['name']} ({n['id']}) removed", markup=False)
