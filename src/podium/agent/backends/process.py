"""The process backend behind the driver interface: a thin adapter over agent/process_backend.py's
ProcessRun (its own process group, its own working directory, killed with the agent by the fence keeper).

It adds only what the interface asks for: why a stop happened, a release proof that the group is
empty, and an honest `recover` (nothing survives an agent: the fence keeper kills its groups). It must
never run a command through a shell or outlive the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from podium.agent.backends.base import (
    EGRESS_OPEN,
    FAILURE_EXIT,
    Backend,
    ExitResult,
    Fingerprint,
    Handle,
    OutputSink,
    Recovered,
    RegistryAuth,
    ReleaseProof,
    RunSpec,
    StartFailed,
)
from podium.agent.process_backend import ProcessRun

if TYPE_CHECKING:
    from podium.agent.fence import FenceKeeper

KIND = "process"
# how long destroy waits for a SIGKILLed group to leave the process table
GONE_TIMEOUT = 10.0  # seconds
_GONE_POLL = 0.02  # seconds


@dataclass
class _State:
    run: ProcessRun
    stopped_as: str | None = None


class ProcessBackend(Backend):
    kind = KIND
    uses_workdir = True  # the attempt's cwd and HOME, made by the agent (agent/workdirs.py)

    def run_spec(
        self, attempt: RunSpec, spec: Mapping[str, Any], ids: Mapping[str, str], secret_env: Mapping[str, str],
        gpus: list[int], logins: list[RegistryAuth], workdir: Path,
    ) -> tuple[RunSpec, dict[str, str]]:
        # a process gets a plain environment (PATH, its own HOME) unless the spec inherits the agent's
        env = dict(os.environ) if spec.get("inherit_env") else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        env.update({"HOME": str(workdir), **ids})
        env.update(spec.get("env") or {})
        env.update(secret_env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        return dataclasses.replace(attempt, command=tuple(spec["command"])), env

    def fence(self, keeper: FenceKeeper, handle: Handle, task_id: str, token: int) -> dict[str, Any]:
        keeper.add(int(handle.ref), task_id, token, handle.state.run.identity)  # its process group
        return {"pid": int(handle.ref)}

    def unfence(self, keeper: FenceKeeper, handle: Handle) -> None:
        keeper.remove(int(handle.ref))

    async def fingerprint(self) -> Fingerprint:
        # processes share the node's network and are not confined to their resources
        return Fingerprint(kind=KIND, available=True, detail="process groups", egress=(EGRESS_OPEN,))

    async def start(self, spec: RunSpec, env: Mapping[str, str], workdir: Path) -> Handle:
        run = ProcessRun(list(spec.command), dict(env), workdir)
        try:
            await run.start()
        except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
            # the command is not there (or not runnable) on this node: the exit a shell would give
            msg = f"cannot start {spec.command[0]!r}: {e.strerror}"
            raise StartFailed(FAILURE_EXIT, msg, exit_code=127 if isinstance(e, FileNotFoundError) else 126) from e
        assert run.pid is not None
        return Handle(kind=KIND, ref=str(run.pid), task_id=spec.task_id, token=spec.token, state=_State(run))

    async def wait(self, handle: Handle, sink: OutputSink) -> ExitResult:
        st: _State = handle.state
        code = await st.run.wait(sink)
        if st.stopped_as is not None:
            return ExitResult(code, st.stopped_as, f"stopped ({st.stopped_as})")
        return ExitResult(code, None if code == 0 else FAILURE_EXIT)

    async def stop(self, handle: Handle, kill_grace: float, failure_class: str = "cancelled") -> None:
        st: _State = handle.state
        if st.stopped_as is None:
            st.stopped_as = failure_class
        await st.run.stop(kill_grace)

    async def destroy(self, handle: Handle) -> ReleaseProof:
        st: _State = handle.state
        pgid = int(handle.ref)
        await st.run.stop(0)  # a no-op once stopped; otherwise SIGKILL to the whole group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GONE_TIMEOUT
        while _group_alive(pgid):
            if loop.time() > deadline:
                raise RuntimeError(f"process group {pgid} still has members {GONE_TIMEOUT:g}s after SIGKILL")
            await asyncio.sleep(_GONE_POLL)
        return ReleaseProof(ref=handle.ref, at=datetime.now(UTC))

    async def recover(self) -> list[Recovered]:
        # every task's group gets SIGKILL from the fence keeper when the agent dies: there is
        # nothing of an earlier instance to re-attach to
        return []


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie leader still counts as a member until reaped; ProcessRun.wait reaps it
    return True
