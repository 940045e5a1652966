"""Identity and audit commands: `token create|ls|revoke`, `secret set|ls|rm`, `registry login`,
`audit`. Clients of the API only; a secret's value is read from a file or standard input, never
from the command line, and is never printed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from podium.cli import render
from podium.cli.base import CliError, JsonOpt, ServerOpt, app, connect, err, out, registry_app, secret_app, token_app


@token_app.command("create")
def token_create(
    name: str,
    role: Annotated[str, typer.Option(help="admin, operator, viewer, or join (for agents)")] = "operator",
    server: ServerOpt = None,
) -> None:
    """Create a token; it is printed once and never shown again."""
    if role not in ("admin", "operator", "viewer", "join"):
        raise CliError(f"--role must be admin, operator, viewer or join, not {role!r}")
    r = connect(server).create_token(name, role)
    err.print(f"token {r['id']} ({r['role']}) created; it is shown only now:", markup=False)
    print(r["token"])


@token_app.command("ls")
def token_ls(server: ServerOpt = None, json_out: JsonOpt = False) -> None:
    """Tokens (ids, names, roles; never values)."""
    render.show(
        connect(server).tokens(), json_out, ("ID", "NAME", "ROLE", "CREATED", "BY", "REVOKED"),
        lambda r: (r["id"], r["name"], r["role"], render.when(r["created_at"]), r["created_by"], render.when(r["revoked_at"])),
    )  # fmt: skip


@token_app.command("revoke")
def token_revoke(token_id: str, server: ServerOpt = None) -> None:
    """Revoke a token; it stops working at once."""
    r = connect(server).revoke_token(token_id)
    out.print(f"token {r['id']} ({r['name']}) revoked", markup=False)


def _from_stdin(prompt: str) -> str:
    """A value typed at a prompt that does not echo it, or piped in."""
    if sys.stdin.isatty():
        import getpass

        return getpass.getpass(prompt)
    return sys.stdin.read()


@secret_app.command("set")
def secret_set(
    name: str,
    from_file: Annotated[Path | None, typer.Option("--from-file", help="read the value from this file")] = None,
    server: ServerOpt = None,
) -> None:
    """Store a secret. The value comes from standard input or --from-file, never from the command line."""
    if from_file is not None:
        try:
            value = from_file.read_text()
        except OSError as e:
            raise CliError(f"cannot read {from_file}: {e.strerror}") from None
    else:
        value = _from_stdin(f"value for {name}: ")
    value = value.removesuffix("\n")
    if not value:
        raise CliError("the secret value is empty")
    r = connect(server).set_secret(name, value)
    out.print(f"secret {r['name']} is at version {r['version']}", markup=False)


@secret_app.command("ls")
def secret_ls(server: ServerOpt = None, json_out: JsonOpt = False) -> None:
    """Secrets: names, versions and times; never values."""
    render.show(
        connect(server).secrets(), json_out, ("NAME", "VERSION", "UPDATED", "BY"),
        lambda r: (r["name"], str(r["version"]), render.when(r["updated_at"]), r["updated_by"]),
    )  # fmt: skip


@secret_app.command("rm")
def secret_rm(name: str, server: ServerOpt = None) -> None:
    """Delete a secret."""
    connect(server).delete_secret(name)
    out.print(f"secret {name} deleted", markup=False)


@registry_app.command("login")
def registry_login(
    host: str,
    username: Annotated[str, typer.Option("--username", "-u")],
    server: ServerOpt = None,
) -> None:
    """Store a registry login; the password comes from standard input. Sent only with tasks whose
    image comes from that registry."""
    password = _from_stdin(f"password for {username}@{host}: ").removesuffix("\n")
    if not password:
        raise CliError("the password is empty")
    connect(server).registry_login(host, username, password)
    out.print(f"login for {host} stored", markup=False)


@app.command()
def audit(
    limit: Annotated[int, typer.Option(min=1, help="show this many (any number: the CLI pages through them)")] = 50,
    all_: Annotated[bool, typer.Option("--all", help="show the whole log")] = False,
    server: ServerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Who did what, newest first (admin)."""
    listing = connect(server).audit(None if all_ else limit)
    render.show(
        listing, json_out, ("AT", "ACTOR", "ACTION", "TARGET"),
        lambda r: (render.when(r["at"]), r["actor"], r["action"], r["target"] or ""), listing.remaining,
    )  # fmt: skip
