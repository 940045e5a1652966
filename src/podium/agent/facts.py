"""What a node reports about itself: identity, architecture, capacity. Read once at start."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

import psutil

from podium import lockfile

_ARCH = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


def node_id(state_dir: Path) -> str:
    """A stable node id, created on first start and kept in the state directory."""
    path = state_dir / "node-id"
    if path.exists():
        text = path.read_text().strip()
        if text:
            return text
    state_dir.mkdir(parents=True, exist_ok=True)
    nid = f"n-{uuid.uuid4().hex[:16]}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(nid + "\n")
    os.replace(tmp, path)
    return nid


def lock_state_dir(state_dir: Path) -> int:
    """Make this process the only agent on `state_dir` (its node id and credential) for as long as it
    lives; return the lock's descriptor, to keep open. Two agents on one state directory would be one
    node twice, each knocking the other off its stream. Raises lockfile.Busy naming the other's pid."""
    return lockfile.hold(state_dir / "agent.lock")


def arch() -> str:
    m = platform.machine().lower()
    return _ARCH.get(m, m)


def hostname() -> str:
    return socket.gethostname()


def cpu_millis() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return n * 1000


def memory_bytes() -> int:
    return int(psutil.virtual_memory().total)


def disk_bytes(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    return int(shutil.disk_usage(path).free)


def gpu_indexes() -> list[int]:
    """GPU device indexes from nvidia-smi, where present; none elsewhere."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return sorted(int(x) for x in out.split() if x.strip().isdigit())
