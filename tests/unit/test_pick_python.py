"""scripts/pick-python: which interpreter scripts/install makes .venv with.

The candidates are stand-ins (shell scripts on a PATH this test makes) that answer the script's probe
as a build of each kind would: the choice is the script's logic, whatever interpreters this machine
has. The last test runs the probe on the real interpreter running the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PICK = ROOT / "scripts" / "pick-python"
BASH = "/bin/bash"


def _python(d: Path, name: str, *, real: str, version: str, fast: bool, full: str, venv: bool = True) -> None:
    """A stand-in interpreter: answers the probe (`-c <probe>`) with one line, and the venv check."""
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text(
        "#!/bin/sh\n"
        'case "$2" in\n'
        f"  'import venv, ensurepip') exit {0 if venv else 1} ;;\n"
        f"  *) echo '{real} {version} {int(fast)} {full}' ;;\n"
        "esac\n"
    )
    p.chmod(0o755)


def _pick(path: list[Path], python: str | None = None) -> subprocess.CompletedProcess[str]:
    # only the stand-ins: the script uses nothing but bash's builtins, and this machine's own
    # interpreters must not be candidates
    env = {"PATH": os.pathsep.join(map(str, path)), "HOME": os.environ.get("HOME", "/")}
    if python is not None:
        env["PYTHON"] = python
    return subprocess.run([BASH, str(PICK)], env=env, capture_output=True, text=True, timeout=30, check=True)


def test_a_slow_python3_gives_way_to_a_fast_build_of_its_version_further_on_path(tmp_path: Path) -> None:
    _python(tmp_path / "a", "python3", real="/opt/slow/python3.11", version="3.11", fast=False, full="3.11.7")
    _python(tmp_path / "b", "python3.12", real="/opt/new/python3.12", version="3.12", fast=True, full="3.12.1")
    _python(tmp_path / "c", "python3.11", real="/opt/fast/python3.11", version="3.11", fast=True, full="3.11.2")
    r = _pick([tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    assert r.stdout.strip() == "/opt/fast/python3.11"  # the real path the build gave
    assert "python3 is /opt/slow/python3.11 (Python 3.11.7), a shared-library build" in r.stderr
    assert "using /opt/fast/python3.11 (Python 3.11.2), a faster build of the same version" in r.stderr
    assert "PYTHON=python3 scripts/install keeps the first" in r.stderr


def test_a_fast_python3_is_kept_and_nothing_is_said(tmp_path: Path) -> None:
    _python(tmp_path / "a", "python3", real="/opt/fast/python3.11", version="3.11", fast=True, full="3.11.2")
    _python(tmp_path / "b", "python3.11", real="/opt/other/python3.11", version="3.11", fast=True, full="3.11.9")
    r = _pick([tmp_path / "a", tmp_path / "b"])
    assert (r.stdout.strip(), r.stderr) == ("python3", "")


def test_no_other_version_and_no_build_without_venv_is_taken(tmp_path: Path) -> None:
    _python(tmp_path / "a", "python3", real="/opt/slow/python3.11", version="3.11", fast=False, full="3.11.7")
    _python(tmp_path / "b", "python3", real="/opt/new/python3.12", version="3.12", fast=True, full="3.12.1")
    _python(tmp_path / "c", "python3.11", real="/opt/bare/python3.11", version="3.11", fast=True, full="3.11.2", venv=False)
    r = _pick([tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    assert (r.stdout.strip(), r.stderr) == ("python3", "")


def test_python_set_is_taken_as_it_is(tmp_path: Path) -> None:
    _python(tmp_path / "a", "python3", real="/opt/slow/python3.11", version="3.11", fast=False, full="3.11.7")
    _python(tmp_path / "c", "python3.11", real="/opt/fast/python3.11", version="3.11", fast=True, full="3.11.2")
    r = _pick([tmp_path / "a", tmp_path / "c"], python="/opt/mine/python3")
    assert (r.stdout.strip(), r.stderr) == ("/opt/mine/python3", "")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="the probe reads /proc/self/maps (Linux)")
def test_the_probe_describes_the_interpreter_it_runs_in() -> None:
    """The probe, as the script holds it, run by this suite's interpreter: its path, its version, and
    whether libpython is mapped into it, as /proc says."""
    text = PICK.read_text()
    probe = text.split("probe='", 1)[1].split("'\n", 1)[0]
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True)
    path, version, fast, full = out.stdout.split()
    assert path == os.path.realpath(sys.executable)
    assert version == f"{sys.version_info[0]}.{sys.version_info[1]}" and full == sys.version.split()[0]
    shared = any("libpython" in line for line in Path("/proc/self/maps").read_text().splitlines())
    optimised = "--enable-optimizations" in (sysconfig.get_config_var("CONFIG_ARGS") or "")
    assert fast == str(int(not shared or optimised))
