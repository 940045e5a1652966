"""The one small interface every way of running a task implements (the shape of Nomad's task driver
verbs): fingerprint, prepare, start, wait, stop, destroy, recover.

The agent's loop talks only to this interface, so it never knows whether a task is a process group
or a container. A backend owns its sandboxes and nothing else: it never decides a task's state, never
talks to the server, and never logs an environment value or a registry password (both carry secrets).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from podium.agent.fence import FenceKeeper

# Failure classes (the seed's FailureClass): why an attempt ended, one word each. The reason
# sentence stays one of podium.reasons; the class and the engine's own words sit beside it.
FAILURE_EXIT = "exit"  # the command ran and exited non-zero (or was killed by a signal it got elsewhere)
FAILURE_TIMEOUT = "timeout"  # stopped here because its time limit passed
FAILURE_CANCELLED = "cancelled"  # stopped here because someone cancelled it
FAILURE_NODE_LOST = "node_lost"  # the node stopped answering; the server gave up on it
FAILURE_NOT_ACCEPTED = "not_accepted"  # the node never accepted the assignment in time
FAILURE_PROVISIONING = "provisioning"  # the sandbox could not be made: pull or create failed
FAILURE_OOM = "oom"  # killed for using more memory than its limit
FAILURE_INTERNAL = "internal"  # the agent or the engine failed, not the task
FAILURE_CLASSES = frozenset(
    {
        FAILURE_EXIT,
        FAILURE_TIMEOUT,
        FAILURE_CANCELLED,
        FAILURE_NODE_LOST,
        FAILURE_NOT_ACCEPTED,
        FAILURE_PROVISIONING,
        FAILURE_OOM,
        FAILURE_INTERNAL,
    }
)
# the classes a caller may give `stop`: the backend reports them back from `wait`
STOP_CLASSES = frozenset({FAILURE_CANCELLED, FAILURE_TIMEOUT, FAILURE_NODE_LOST, FAILURE_INTERNAL})

# Egress contexts a sandbox can be started in.
EGRESS_NONE = "none"  # no network at all, not even to the node's loopback
EGRESS_OPEN = "open"  # the engine's default network


class OutputSink(Protocol):
    """Receives a task's output as it comes: (stream, data) with stream "stdout" or "stderr", each
    stream's chunks in the order they were written. Awaited, so a slow sink slows the reader."""

    async def __call__(self, stream: str, data: bytes, /) -> None: ...


@dataclass(frozen=True)
class RegistryAuth:
    """Credentials for one registry, used for that registry's images only. Never logged: repr hides
    the password."""

    registry: str  # host[:port], as in the image reference
    username: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class RunSpec:
    """What to run, in a backend's terms; the agent maps a task's spec to it."""

    task_id: str
    token: int
    attempt: int = 1
    command: tuple[str, ...] = ()  # for a container: the image's entrypoint is kept, this is its CMD
    image: str | None = None  # container backend: a reference, pinned `repo@sha256:…` in practice
    egress: str = EGRESS_OPEN
    cpu_millis: int | None = None  # limits, applied where the backend enforces them
    memory_bytes: int | None = None
    registry_auth: RegistryAuth | None = None


@dataclass(frozen=True)
class Fingerprint:
    """Whether a backend can run tasks here now, and what it offers."""

    kind: str  # "process" or "container"
    available: bool
    detail: str = ""  # why it is unavailable, or what answered (engine and version)
    enforces_limits: bool = False  # CPU and memory limits are enforced by the kernel
    egress: tuple[str, ...] = ()  # egress contexts it can provide
    artifacts: tuple[str, ...] = ()  # image digests held locally (sha256:…), sorted


@dataclass
class Handle:
    """One running (or finished, not yet destroyed) sandbox. `ref` is the backend's own name for it:
    the process group id, or the container id."""

    kind: str
    ref: str
    task_id: str
    token: int
    state: Any = field(default=None, repr=False)  # the backend's private bookkeeping


@dataclass(frozen=True)
class ExitResult:
    """How an attempt ended. exit_code is None when there is no code to give (the engine failed).
    failure_class is None for a clean exit 0, else one of FAILURE_CLASSES."""

    exit_code: int | None
    failure_class: str | None
    message: str = ""
    oom: bool = False


@dataclass(frozen=True)
class ReleaseProof:
    """The sandbox is gone (process group empty, container removed): its capacity may be freed."""

    ref: str
    at: datetime


@dataclass(frozen=True)
class Recovered:
    """A sandbox an earlier agent instance on this node left behind."""

    handle: Handle
    running: bool
    exit_code: int | None  # when it is no longer running
    instance: str  # the agent instance that started it
    labels: Mapping[str, str] = field(default_factory=dict)


class StartFailed(Exception):
    """The sandbox could not be started; `failure_class` says whose fault (provisioning for a pull or
    create the engine refused, exit for a command that is not there) and `message` carries the
    engine's or the OS's own words."""

    def __init__(self, failure_class: str, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.failure_class = failure_class
        self.message = message
        self.exit_code = exit_code


class Backend(abc.ABC):
    """The driver interface. Methods are coroutines; a backend with a blocking client runs it in
    threads so the agent's event loop (its heartbeats) never waits on an engine."""

    kind: str
    # What the agent does differently for this kind of sandbox, said by the backend, so the agent's
    # loop never asks which kind it runs: preparing may bring artifacts (images) the server should
    # hear of; the sandbox outlives its command, so its capacity is freed only by a release proof.
    holds_artifacts: bool = False
    proves_release: bool = False
    uses_workdir: bool = False  # its attempts run in the node's working directory made for them

    @abc.abstractmethod
    def run_spec(
        self, attempt: RunSpec, spec: Mapping[str, Any], ids: Mapping[str, str], secret_env: Mapping[str, str],
        gpus: list[int], logins: list[RegistryAuth], workdir: Path,
    ) -> tuple[RunSpec, dict[str, str]]:
        """The task's spec in this backend's terms (`attempt` names the task, token and attempt), and
        the environment the command runs with (`ids`: the PODIUM_* variables every task gets)."""

    @abc.abstractmethod
    def fence(self, keeper: FenceKeeper, handle: Handle, task_id: str, token: int) -> dict[str, Any]:
        """Give the started sandbox to the fence keeper (so it dies when the lease does); what the
        journal records of it."""

    @abc.abstractmethod
    def unfence(self, keeper: FenceKeeper, handle: Handle) -> None:
        """Take it back from the keeper once its command has ended."""

    @abc.abstractmethod
    async def fingerprint(self) -> Fingerprint:
        """Is it usable now, and what does it offer (limits, egress contexts, artifacts held)?"""

    async def prepare(self, spec: RunSpec, env: Mapping[str, str], workdir: Path) -> None:  # noqa: B027 - optional step
        """Get ready what `start` needs (pull the image, create the container) while the attempt is
        still provisioning, before the server's Accepted; raise StartFailed if it cannot be. Nothing
        runs yet."""

    async def discard(self, spec: RunSpec) -> ReleaseProof:
        """Remove what `prepare` made for an attempt that never started, and prove it gone (the ref
        is empty when nothing was made)."""
        return ReleaseProof(ref="", at=datetime.now(UTC))

    @abc.abstractmethod
    async def start(self, spec: RunSpec, env: Mapping[str, str], workdir: Path) -> Handle:
        """Make the sandbox and start the command; raise StartFailed with the reason if it cannot."""

    @abc.abstractmethod
    async def wait(self, handle: Handle, sink: OutputSink) -> ExitResult:
        """Stream output to `sink` until the sandbox's command ends; return how it ended."""

    @abc.abstractmethod
    async def stop(self, handle: Handle, kill_grace: float, failure_class: str = FAILURE_CANCELLED) -> None:
        """SIGTERM, then SIGKILL after `kill_grace` seconds; `wait` then reports `failure_class`."""

    @abc.abstractmethod
    async def destroy(self, handle: Handle) -> ReleaseProof:
        """Remove the sandbox (killing what still runs) and prove it is gone."""

    @abc.abstractmethod
    async def recover(self) -> list[Recovered]:
        """What earlier agent instances on this node left: their sandboxes, running or not."""

    async def close(self) -> None:  # noqa: B027 - optional step
        """Release the backend's own resources (connections); sandboxes are untouched."""
