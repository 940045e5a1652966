"""Generated code is never edited by hand: regenerating it must give exactly what is checked in."""

import filecmp
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(ROOT / "scripts" / "gen-proto"), str(tmp_path)], check=True, env=env, cwd=ROOT)
    checked_in = ROOT / "src" / "podium" / "proto" / "podium" / "v1"
    for name in ("agent_pb2.py", "agent_pb2_grpc.py", "agent_pb2.pyi"):
        assert filecmp.cmp(tmp_path / "podium" / "v1" / name, checked_in / name, shallow=False), (
            f"{name} is out of date: run scripts/gen-proto"
        )
