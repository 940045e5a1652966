"""Named spec commands: `spec put`, `spec show`, `spec ls`, `spec run`. Clients of the API only."""

from __future__ import annotations

from typing import Annotated

import typer

from podium.cli import render
from podium.cli.base import JsonOpt, ServerOpt, connect, out, read_spec, spec_app, validate
from podium.cli.tasks import attach


@spec_app.command("put")
def spec_put(name: str, file: Annotated[str, typer.Argument(help="a YAML or JSON spec, or -")], server: ServerOpt = None) -> None:
    """Store a new revision of a named spec."""
    body = read_spec(file)
    validate(body)
    r = connect(server).put_spec(name, body)
    out.print(f"spec {r['name']} is at revision {r['revision']}", markup=False)


@spec_app.command("show")
def spec_show(name: str, revision: Annotated[int | None, typer.Option(min=1)] = None, server: ServerOpt = None) -> None:
    """A named spec (the latest revision, or --revision N)."""
    render.print_json(connect(server).spec(name, revision))


@spec_app.command("ls")
def spec_ls(server: ServerOpt = None, json_out: JsonOpt = False) -> None:
    """Every named spec at its latest revision."""
    render.show(
        connect(server).specs(), json_out, ("NAME", "REVISION", "CREATED", "COMMAND"),
        lambda r: (r["name"], str(r["revision"]), render.when(r["created_at"]), " ".join(r["spec"].get("command") or [])),
    )  # fmt: skip


@spec_app.command("run")
def spec_run(
    name: str,
    revision: Annotated[int | None, typer.Option(help="refuse unless this is still the current revision", min=1)] = None,
    idempotency_key: Annotated[str | None, typer.Option()] = None,
    detach: Annotated[bool, typer.Option("--detach", "-d")] = False,
    server: ServerOpt = None,
) -> None:
    """Run a named spec; with --revision, only if nobody changed it since you read it."""
    client = connect(server)
    tid = client.submit_spec(name, revision, idempotency_key).id
    if detach:
        print(tid)
        return
    raise typer.Exit(attach(client, tid))
