"""Task commands: `run`, `submit`, `ls`, `show`, `logs`, `cancel`, `explain`. Each is a client of
the server's API and must never start anything or touch the database."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.text import Text

from podium.cli import render
from podium.cli.base import (
    EXIT_CANCELLED,
    EXIT_NO_RUNNER,
    EXIT_OTHER,
    EXIT_TIMEOUT,
    CliError,
    JsonOpt,
    ServerOpt,
    app,
    connect,
    err,
    labels,
    out,
    parse,
    read_spec,
    validate,
)  # fmt: skip
from podium.cli.contract import print_attempt_record
from podium.units import format_cpu, format_size, parse_cpu, parse_duration, parse_size

if TYPE_CHECKING:
    from podium.client import Client, LogChunk


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    command: Annotated[list[str] | None, typer.Argument(help="the command and its arguments, after --; with --image, "
                                                             "the container's command (none: the image's own)")] = None,
    image: Annotated[str | None, typer.Option(help="run this container image (registry/team/app:1.4) instead of a process")] = None,
    egress: Annotated[str | None, typer.Option(help="the network the task needs: none or open")] = None,
    cpu: Annotated[str | None, typer.Option(help="CPU: cores (0.5, 2) or millicores (500m)")] = None,
    memory: Annotated[str | None, typer.Option(help="memory: 512Mi, 2G, or bytes")] = None,
    label: Annotated[list[str], typer.Option("--label", "-l", help="a node label the task requires, key=value")] = [],  # noqa: B006
    disk: Annotated[str | None, typer.Option(help="scratch disk: 10Gi, 500M, or bytes")] = None,
    gpus: Annotated[int | None, typer.Option(help="how many GPUs (exposed through CUDA_VISIBLE_DEVICES)", min=0)] = None,
    pool: Annotated[str | None, typer.Option(help="run only on nodes of this pool")] = None,
    arch: Annotated[str | None, typer.Option(help="run only on nodes of this architecture (x86_64, aarch64)")] = None,
    capability: Annotated[list[str], typer.Option("--capability", help="a capability the node must have; repeatable")] = [],  # noqa: B006
    prefer: Annotated[list[str], typer.Option("--prefer", help="an artifact (image digest) to prefer nodes holding; repeatable")] = [],  # noqa: B006
    home_node: Annotated[str | None, typer.Option(help="run only on this node (by id), never elsewhere")] = None,
    priority: Annotated[int | None, typer.Option(help="higher runs first (-1000..1000)")] = None,
    no_requeue: Annotated[bool, typer.Option("--no-requeue", help="if its node is lost, end the task as lost instead of retrying")] = False,
    timeout: Annotated[str | None, typer.Option(help="stop the task after this long: 30s, 5m, 1h30m")] = None,
    attempts: Annotated[int | None, typer.Option(help="how many nodes may try it (default 3)")] = None,
    name: Annotated[str | None, typer.Option(help="a name for the task")] = None,
    env: Annotated[list[str], typer.Option("--env", "-e", help="an environment variable NAME=value; repeatable")] = [],  # noqa: B006
    secret: Annotated[list[str], typer.Option("--secret", help="a stored secret as an env var: NAME or NAME:ENV; repeatable")] = [],  # noqa: B006
    idempotency_key: Annotated[str | None, typer.Option(help="submitting twice with the same key gives the same task")] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="print the task id and return")] = False,
    server: ServerOpt = None,
) -> None:
    """Run a command (or a container image) on the fleet, stream its output, and exit with its exit code."""
    body: dict[str, Any] = {"command": list(command or [])}
    if image is not None:
        body.update(backend="container", image=image)
    if egress is not None:
        body["egress"] = egress
    if cpu is not None:
        body.setdefault("resources", {})["cpu"] = parse(parse_cpu, cpu, "--cpu")
        body["resources"]["cpu"] = f"{body['resources']['cpu']}m"
    if memory is not None:
        body.setdefault("resources", {})["memory"] = parse(parse_size, memory, "--memory")
    if label:
        body["labels"] = labels(label)
    if disk is not None:
        body.setdefault("resources", {})["disk"] = parse(parse_size, disk, "--disk")
    if gpus is not None:
        body.setdefault("resources", {})["gpus"] = gpus
    for key, value in (("pool", pool), ("arch", arch), ("home_node", home_node), ("priority", priority)):
        if value is not None:
            body[key] = value
    if capability:
        body["capabilities"] = list(capability)
    if prefer:
        body["preferred_artifacts"] = list(prefer)
    if no_requeue:
        body["requeue_on_node_loss"] = False
    if timeout is not None:
        body["timeout"] = parse(parse_duration, timeout, "--timeout")
    if attempts is not None:
        body["max_attempts"] = attempts
    if name:
        body["name"] = name
    if env:
        body["env"] = dict(_split_env(e) for e in env)
    if secret:
        body["secrets"] = [_secret_ref(x) for x in secret]
    if idempotency_key:
        body["idempotency_key"] = idempotency_key
    client = connect(server)
    tid = client.submit(spec=validate(body)).id
    if detach:
        print(tid)
        return
    raise typer.Exit(attach(client, tid))


def _secret_ref(text: str) -> dict[str, str]:
    name, _, env_name = text.partition(":")
    return {"name": name, "env": env_name or name.upper().replace("-", "_").replace(".", "_")}


def _split_env(pair: str) -> tuple[str, str]:
    if "=" not in pair:
        raise CliError(f"--env {pair!r} must be written NAME=value")
    k, v = pair.split("=", 1)
    return k, v


def _write_output(c: LogChunk) -> None:
    """A chunk's bytes exactly as the task wrote them (no decoding), on the stream it wrote them to."""
    f = sys.stdout if c.stream == "stdout" else sys.stderr
    f.flush()
    buf = getattr(f, "buffer", None)
    if buf is None:
        f.write(c.data)
    else:
        buf.write(c.raw)
        buf.flush()


def attach(client: Client, tid: str) -> int:
    """Stream a task's output until it ends (the server's log stream, resumed where it broke off
    if the connection or the server goes away); Ctrl-C cancels it. Returns the exit code to use."""
    from podium.client import LogChunk, TaskEnd  # loaded already: `client` is one

    end = TaskEnd("", None, None)
    try:
        for item in client.follow(tid):
            if isinstance(item, LogChunk):
                _write_output(item)
            else:
                end = item
    except KeyboardInterrupt:
        err.print(f"cancelling task {tid} …")
        client.cancel(tid)
        for item in client.follow(tid):
            if isinstance(item, TaskEnd):
                end = item
    state, code = end.state or None, end.exit_code
    if state == "succeeded":
        return 0
    reason = end.reason or ""
    err.print(f"task {tid} {state}" + (f": {reason}" if reason else "") + (f" (exit code {code})" if code is not None else ""),
              markup=False)  # fmt: skip
    if state == "failed" and code is not None and reason != "timeout":
        return int(code) if 0 < int(code) < 256 else EXIT_OTHER
    if state == "cancelled":
        return EXIT_CANCELLED
    if reason == "timeout":
        return EXIT_TIMEOUT
    return EXIT_OTHER


@app.command()
def submit(
    file: Annotated[str, typer.Argument(help="a YAML or JSON spec file, or - for standard input")],
    check: Annotated[bool, typer.Option("--check", help=(
        "store nothing: say whether any node of the fleet could ever run this spec, and why not each node; "
        f"exits {EXIT_NO_RUNNER} when none could"))] = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Submit a task from a spec file; prints its id."""
    body = read_spec(file)
    if check:
        _check(connect(server).check(validate(body)), json_out)
        return
    task = connect(server).submit(spec=validate(body))
    if json_out:
        render.print_json({"task": task.raw, "created": task.created})
    else:
        print(task.id)


def _check(resp: dict[str, Any], json_out: bool) -> None:
    if json_out:
        render.print_json(resp)
    else:
        # one line per node, never truncated: the explanation is the point
        for n in resp["nodes"]:
            verdict = "could run it" if n["fits"] else f"could never run it: {n['failed']}"
            out.print(f"{n['node_id']} ({n['name']}, {n['health']} now): {verdict}", markup=False, soft_wrap=True, highlight=False)
        out.print("some node of the fleet can run this spec" if resp["runnable"] else resp["reason"], markup=False)
    if not resp["runnable"]:
        raise typer.Exit(EXIT_NO_RUNNER)


@app.command("ls")
def ls(
    state: Annotated[str | None, typer.Option(help="only tasks in this state")] = None,
    node: Annotated[str | None, typer.Option(help="only tasks on this node")] = None,
    limit: Annotated[int, typer.Option(min=1, help="show this many (any number: the CLI pages through them)")] = 50,
    all_: Annotated[bool, typer.Option("--all", help="show every task")] = False,
    wide: Annotated[bool, typer.Option("--wide", help="full task ids")] = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List tasks, newest first; a last line says how many more there are."""
    listing = connect(server).tasks(state=state, node=node, limit=None if all_ else limit)
    rows = [t.raw for t in listing]
    short = render.short_ids([r["id"] for r in rows], wide)
    render.show(
        rows, json_out, ("ID", "NAME", "STATE", "EXIT", "NODE", "ATTEMPTS", "CREATED", "REASON"),
        lambda r: (short[r["id"]], r["name"] or "", render.state(r["state"]), "" if r["exit_code"] is None else str(r["exit_code"]),
                   r["node_id"] or (r["terminal"] and r.get("last_node_id")) or "",
                   f"{r['attempts']}/{r['max_attempts']}", render.when(r["created_at"]), r["reason"] or ""),
        listing.remaining, no_wrap=("ID",),
    )  # fmt: skip


@app.command()
def show(task_id: str, server: ServerOpt = None, json_out: JsonOpt = False) -> None:
    """A task: its state and reason, every attempt and the full event history."""
    d = connect(server).task(task_id).raw
    if json_out:
        render.print_json(d)
        return
    out.print(f"[bold]{d['id']}[/] {escape(d['name'] or '')}")
    out.print(Text.assemble("  state:    ", render.state(d["state"]), f" — {d['reason']}" if d["reason"] else ""))
    # where it runs, or (once ended, when it holds no node) where its last attempt ran
    node = d["node_id"] or (d["terminal"] and d.get("last_node_id"))
    if node:
        name = d.get("last_node_name") if d.get("last_node_id") == node else None
        where = f"{escape(name)} ({escape(node)})" if name else escape(node)
        out.print(f"  {'node:' if d['node_id'] else 'ran on:':<9} {where}", highlight=False)
    if d.get("reason_detail"):
        out.print(f"  detail:   {d['reason_detail']}", markup=False, highlight=False)
    if d["exit_code"] is not None:
        out.print(f"  exit:     {d['exit_code']}")
    spec = d["spec"]
    if d.get("image"):
        out.print(f"  image:    {d['image']}", markup=False, highlight=False)
        out.print(f"  digest:   {d.get('image_digest') or 'not resolved yet'}", markup=False, highlight=False)
    cmd = " ".join(spec.get("command") or []) or ("(the image's own)" if d.get("image") else "")
    out.print(f"  command:  {cmd}", markup=False, highlight=False)
    res = spec.get("resources", {})
    out.print(f"  needs:    cpu {format_cpu(parse_cpu(res.get('cpu', '0m')))}, memory {format_size(int(res.get('memory', 0)))}"
              + (f", labels {spec['labels']}" if spec.get("labels") else "")
              + (f", timeout {spec['timeout']}s" if spec.get("timeout") else ""), markup=False, highlight=False)  # fmt: skip
    out.print(f"  attempts: {d['attempts']} of {d['max_attempts']}")
    if d["attempt_list"]:
        out.print(render.table(
            ("#", "NODE", "TOKEN", "STATE", "CLASS", "ASSIGNED", "STARTED", "FINISHED", "EXIT", "REASON"),
            ((str(a["attempt"]), a["node_id"], str(a["fencing_token"]), a["state"], a.get("failure_class") or "",
              render.when(a["assigned_at"], clock=True), render.when(a["started_at"], clock=True),
              render.when(a["finished_at"], clock=True), "" if a["exit_code"] is None else str(a["exit_code"]), a["reason"] or "")
             for a in d["attempt_list"]),
            title="attempts",
        ))  # fmt: skip
        for a in d["attempt_list"]:
            # the node's or engine's own words, beside the reason rather than in it
            if a.get("failure_detail"):
                out.print(f"  attempt {a['attempt']}: {a['failure_detail']}", markup=False, highlight=False)
            if a.get("finished_at") and not a.get("released", True):
                out.print(f"  attempt {a['attempt']}: its capacity is held until its sandbox is proven removed")
            print_attempt_record(out, a)
    out.print(render.table(
        ("AT", "FROM", "TO", "TOKEN", "BY", "CLASS", "REASON"),
        ((render.when(e["at"], clock=True), e["from_state"] or "", e["to_state"],
          "" if e["fencing_token"] is None else str(e["fencing_token"]), e["actor"], e.get("failure_class") or "", e["reason"] or "")
         for e in d["events"]),
        title="events",
    ))  # fmt: skip


@app.command()
def logs(
    task_id: str,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the task ends")] = False,
    server: ServerOpt = None,
) -> None:
    """A task's output (stdout and stderr, every attempt)."""
    for c in connect(server).logs(task_id, follow=follow):
        _write_output(c)


@app.command()
def cancel(
    task_id: str,
    if_revision: Annotated[int | None, typer.Option(
        "--if-revision", min=1, help="only if the task is still at this revision (`podium show --json`): refused if it changed")] = None,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Cancel a task (a running one gets SIGTERM, then SIGKILL after the grace)."""
    r = connect(server).cancel(task_id, if_revision).raw
    if json_out:
        render.print_json(r)
    else:
        out.print(f"{r['id']} {r['state']}")


@app.command()
def explain(task_id: str, server: ServerOpt = None, json_out: JsonOpt = False) -> None:
    """Why is my task still queued? Every node with the first check it fails, or its score."""
    d = connect(server).explain(task_id)
    if json_out:
        render.print_json(d)
        return
    out.print(Text.assemble(f"task {d['task_id']} is ", render.state(d["state"]), f" — {d['reason']}" if d["reason"] else ""))
    out.print(render.table(
        ("NODE", "NAME", "HEALTH", "FITS", "SCORE", "FIRST CHECK FAILED"),
        ((n["node_id"], n["name"], render.health(n.get("health") or ""),
          Text("yes", style="green") if n["fits"] else Text("no", style="red"),
          "" if n["score"] is None else f"{n['score']:.2f}" + (" (avoided: failed there before)" if n["avoided"] else "")
          + (f" (holds {n['holds'][0][:19]}…: tried first)" if n.get("holds") and n["score"] is not None else ""),
          n["failed"] or "") for n in d["nodes"]),
    ))  # fmt: skip


