"""ruff, with the rules in pyproject.toml, finds nothing in the code, the tests, the benchmarks or
the scripts. A finding fails the suite with ruff's own report (file, line, rule, what is wrong)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    # the ruff pinned in requirements.lock, installed beside this interpreter by the dev extras
    here = Path(sys.executable).parent / "ruff"
    if here.exists():
        return [str(here)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed; install the dev extras: pip install -c requirements.lock -e '.[dev]'")
    return [found]


def test_ruff_finds_nothing() -> None:
    r = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", "src", "tests", "bench", "scripts"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_reads_the_projects_rules() -> None:
    """The check above means something only if ruff runs the rule set pyproject.toml names."""
    r = subprocess.run([*_ruff(), "check", "--show-settings", "src/podium/spec.py"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for rule in ("E501", "F401", "W291", "I001", "B006", "UP006", "SIM102"):
        assert rule in r.stdout, f"ruff does not run {rule}: is [tool.ruff.lint] in pyproject.toml?"
