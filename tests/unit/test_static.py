"""Static checks join the suite: mypy over src/podium, as configured in pyproject.toml (strict on
placement, the policy and the store; checked everywhere else). Nothing is skipped: a type error
anywhere fails this test, with mypy's own report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_passes() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--no-incremental"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, f"mypy found problems:\n{run.stdout}{run.stderr}"
