"""The container backend: a task's image run as a container through the Docker Engine API (the
`docker` SDK), so it works against Docker Engine and podman's Docker-compatible service alike.

The SDK is blocking: control calls run in threads (asyncio.to_thread), and each container's output
is read by a thread of its own that hands chunks to the event loop in order. Containers carry labels
(podium.node, podium.task, podium.token, podium.instance) so a restarted agent finds its own.

It must never shell out to an engine's CLI, never log or write to disk a registry password or an
environment value (secrets travel in both), and never send credentials to any registry but the one
the image comes from.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import re
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import docker
import docker.auth
import docker.constants
import docker.errors
import requests.exceptions

from podium.agent.backends.base import (
    EGRESS_NONE,
    EGRESS_OPEN,
    FAILURE_EXIT,
    FAILURE_INTERNAL,
    FAILURE_OOM,
    FAILURE_PROVISIONING,
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

if TYPE_CHECKING:
    from podium.agent.fence import FenceKeeper

log = logging.getLogger(__name__)

KIND = "container"
LABEL_NODE = "podium.node"
LABEL_TASK = "podium.task"
LABEL_TOKEN = "podium.token"
LABEL_INSTANCE = "podium.instance"
# control calls (create, inspect, remove, …): an engine that does not answer in this time is down
CONTROL_TIMEOUT = 60.0  # seconds
# a pull may move gigabytes
PULL_TIMEOUT = 3600.0  # seconds
# what a container killed by SIGKILL exits with (128 + 9): an OOM kill looks like this
_SIGKILL_EXIT = 137
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]")


@dataclass
class _State:
    container_id: str
    memory_limited: bool
    stopped_as: str | None = None
    # set by start: the output stream attached before the container started, so nothing is missed
    stream: Any = None
    reader: threading.Thread | None = None
    chunks: asyncio.Queue[tuple[str, bytes] | None] | None = None
    reader_error: list[BaseException] = field(default_factory=list)


class ContainerBackend(Backend):
    """Containers on one engine. `host` is an explicit engine URL (unix:///…, tcp://…); without it
    the Docker environment is used (DOCKER_HOST and friends, else the default socket)."""

    kind = KIND
    holds_artifacts = True  # a pull brings an image the server should know this node holds
    proves_release = True  # a container outlives its command: removed, and proven removed

    def run_spec(
        self, attempt: RunSpec, spec: Mapping[str, Any], ids: Mapping[str, str], secret_env: Mapping[str, str],
        gpus: list[int], logins: list[RegistryAuth], workdir: Path,
    ) -> tuple[RunSpec, dict[str, str]]:
        # a container keeps its image's environment (PATH, HOME): nothing of this node's is passed in
        env = {**ids, **(spec.get("env") or {}), **secret_env}
        image = str(spec.get("image") or "")
        cpu, memory = _limits(spec)
        return dataclasses.replace(
            attempt, command=tuple(spec.get("command") or ()), image=image, egress=spec.get("egress") or EGRESS_OPEN,
            cpu_millis=cpu, memory_bytes=memory, registry_auth=_login_for(image, logins),
        ), env  # fmt: skip

    def fence(self, keeper: FenceKeeper, handle: Handle, task_id: str, token: int) -> dict[str, Any]:
        keeper.add_container(handle.ref, task_id, token)  # killed through the engine
        return {"container": handle.ref}

    def unfence(self, keeper: FenceKeeper, handle: Handle) -> None:
        keeper.remove_container(handle.ref)

    def __init__(self, node_id: str, instance_id: str, host: str | None = None) -> None:
        self.node_id = node_id
        self.instance_id = instance_id
        self.host = host
        self._control: docker.DockerClient | None = None
        # long-blocking calls (attach, wait, pull) go through a client without a read timeout: a
        # container silent for minutes is not an engine failure
        self._blocking: docker.DockerClient | None = None
        self._enforces_limits: bool | None = None
        # containers created while provisioning, by (task, token), until started or discarded
        self._prepared: dict[tuple[str, int], _State] = {}

    # ---- clients -------------------------------------------------------------------------------

    def _probe(self) -> None:
        """Connect to a unix socket engine afresh: raise OSError if nothing listens there now."""
        url = self.host or os.environ.get("DOCKER_HOST") or docker.constants.DEFAULT_UNIX_SOCKET
        path = url.removeprefix("http+unix://").removeprefix("unix://")
        if path != url:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(CONTROL_TIMEOUT)
                s.connect(path)

    def _client(self, timeout: float | None) -> docker.DockerClient:
        # the SDK asks the engine's version as it is made and, when the socket refuses, leaks the
        # socket it tried: try it ourselves first, and say plainly what is not there
        self._probe()
        if self.host:
            return docker.DockerClient(base_url=self.host, timeout=timeout)
        return docker.from_env(timeout=timeout)

    @property
    def control(self) -> docker.DockerClient:
        if self._control is None:
            self._control = self._client(CONTROL_TIMEOUT)
        return self._control

    @property
    def blocking(self) -> docker.DockerClient:
        if self._blocking is None:
            self._blocking = self._client(None)
        return self._blocking

    async def close(self) -> None:
        for c in (self._control, self._blocking):
            if c is not None:
                c.close()
        self._control = self._blocking = None

    # ---- fingerprint ---------------------------------------------------------------------------

    async def fingerprint(self) -> Fingerprint:
        try:
            return await asyncio.to_thread(self._fingerprint)
        except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as e:
            return Fingerprint(kind=KIND, available=False, detail=f"no container engine reachable: {e}")

    def _fingerprint(self) -> Fingerprint:
        # a fresh connection, not the pooled one: an engine whose socket is gone (stopped, moved) takes
        # no new work even while an old connection still answers
        try:
            self._probe()
        except OSError:
            # made anew once the engine is back; the blocking client is only dropped, not closed:
            # output streams of running containers may still be read through it
            if self._control is not None:
                self._control.close()
            self._control = self._blocking = None
            raise
        api = self.control.api
        api.ping()
        version = api.version()
        info = api.info()
        # Docker Engine's own answer to "are limits enforced": the kernel controllers it can use.
        # podman with cgroups disabled (or only a hugetlb cgroup2 controller) says False here.
        enforces = bool(info.get("MemoryLimit")) and bool(info.get("CpuCfsQuota"))
        self._enforces_limits = enforces
        digests: set[str] = set()
        for img in api.images():
            for rd in img.get("RepoDigests") or ():
                _, _, digest = rd.partition("@")
                if digest.startswith("sha256:"):
                    digests.add(digest)
        name = next((c.get("Name") for c in version.get("Components") or () if c.get("Name")), "engine")
        detail = f"{name} {version.get('Version', '?')} (API {version.get('ApiVersion', '?')})"
        if not enforces:
            detail += "; limits not enforced (the engine reports no memory/CPU cgroup controllers)"
        return Fingerprint(
            kind=KIND,
            available=True,
            detail=detail,
            enforces_limits=enforces,
            egress=(EGRESS_NONE, EGRESS_OPEN),
            artifacts=tuple(sorted(digests)),
        )

    async def enforces_limits(self) -> bool:
        if self._enforces_limits is None:
            await self.fingerprint()
        return bool(self._enforces_limits)

    @property
    def engine_url(self) -> str:
        """The engine as another process (the fence keeper) should reach it: the explicit URL, or
        "env" for DOCKER_HOST and the default socket, read there as here."""
        return self.host or "env"

    # ---- start ---------------------------------------------------------------------------------

    def _check(self, spec: RunSpec) -> None:
        if not spec.image:
            raise StartFailed(FAILURE_PROVISIONING, "a container task needs an image")
        if spec.egress not in (EGRESS_NONE, EGRESS_OPEN):
            raise StartFailed(FAILURE_PROVISIONING, f"unknown egress context {spec.egress!r}")

    async def prepare(self, spec: RunSpec, env: Mapping[str, str], workdir: Path) -> None:
        # the pull and the create: provisioning, done before the attempt may start; `start` then
        # only starts the container made here (`discard` removes it if it never starts)
        del workdir
        self._check(spec)
        limits = await self.enforces_limits()
        try:
            state = await asyncio.to_thread(self._create, spec, dict(env), limits)
        except (docker.errors.DockerException, requests.exceptions.RequestException, OSError) as e:
            raise StartFailed(FAILURE_PROVISIONING, f"pull {spec.image}: {_engine_words(e)}") from e
        self._prepared[(spec.task_id, spec.token)] = state

    async def discard(self, spec: RunSpec) -> ReleaseProof:
        state = self._prepared.pop((spec.task_id, spec.token), None)
        if state is None:
            return ReleaseProof(ref="", at=datetime.now(UTC))
        await asyncio.to_thread(self._remove, state.container_id)
        return ReleaseProof(ref=state.container_id, at=datetime.now(UTC))

    async def start(self, spec: RunSpec, env: Mapping[str, str], workdir: Path) -> Handle:
        # the sandbox has its own filesystem: the node's workdir is not mounted into it
        del workdir
        self._check(spec)
        state = self._prepared.pop((spec.task_id, spec.token), None)
        if state is None:
            limits = await self.enforces_limits()
            state = await asyncio.to_thread(self._create, spec, dict(env), limits)
        await asyncio.to_thread(self._start, state)
        state.chunks = asyncio.Queue()
        loop = asyncio.get_running_loop()
        state.reader = threading.Thread(
            target=self._read_output, args=(state, loop), name=f"podium-output-{spec.task_id}", daemon=True
        )
        state.reader.start()
        return Handle(kind=KIND, ref=state.container_id, task_id=spec.task_id, token=spec.token, state=state)

    def _ensure_image(self, spec: RunSpec) -> None:
        assert spec.image is not None
        api = self.control.api
        try:
            api.inspect_image(spec.image)
            return
        except docker.errors.ImageNotFound:
            pass
        except docker.errors.APIError as e:
            raise StartFailed(FAILURE_PROVISIONING, _engine_words(e)) from e
        auth = pull_auth(spec.image, spec.registry_auth)
        repo, tag = _split_for_pull(spec.image)
        error = None
        try:
            # the progress stream carries errors the HTTP status does not (a refused pull is a 200);
            # read to its end so the connection is released
            for ev in self.blocking.api.pull(repo, tag=tag, stream=True, decode=True, auth_config=auth):
                if isinstance(ev, dict) and ev.get("error") and error is None:
                    error = str(ev["error"])
        except docker.errors.APIError as e:
            raise StartFailed(FAILURE_PROVISIONING, f"pull {spec.image}: {_engine_words(e)}") from e
        if error is not None:
            raise StartFailed(FAILURE_PROVISIONING, f"pull {spec.image}: {error}")
        try:
            api.inspect_image(spec.image)
        except docker.errors.APIError as e:
            raise StartFailed(FAILURE_PROVISIONING, f"pull {spec.image}: {_engine_words(e)}") from e

    def _create(self, spec: RunSpec, env: dict[str, str], limits: bool) -> _State:
        assert spec.image is not None
        api = self.control.api
        self._ensure_image(spec)
        host_config: dict[str, Any] = {}
        if spec.egress == EGRESS_NONE:
            host_config["network_mode"] = "none"
        memory_limited = False
        if limits:
            if spec.cpu_millis:
                host_config["nano_cpus"] = spec.cpu_millis * 1_000_000
            if spec.memory_bytes:
                # no swap beyond the limit: a task over its memory is killed, not slowed to a crawl
                host_config["mem_limit"] = spec.memory_bytes
                host_config["memswap_limit"] = spec.memory_bytes
                memory_limited = True
        labels = {
            LABEL_NODE: self.node_id,
            LABEL_TASK: spec.task_id,
            LABEL_TOKEN: str(spec.token),
            LABEL_INSTANCE: self.instance_id,
        }
        name = _NAME_UNSAFE.sub("-", f"podium-{spec.task_id}-{spec.token}")
        try:
            created = api.create_container(
                spec.image,
                command=list(spec.command) or None,
                environment=env,
                labels=labels,
                name=name,
                stop_signal="SIGTERM",
                host_config=api.create_host_config(**host_config),
            )
        except docker.errors.APIError as e:
            raise StartFailed(FAILURE_PROVISIONING, f"create: {_engine_words(e)}") from e
        return _State(container_id=created["Id"], memory_limited=memory_limited)

    def _start(self, state: _State) -> None:
        api = self.control.api
        cid = state.container_id
        try:
            # attached before start, so the first line a container writes is not lost
            state.stream = self.blocking.api.attach(cid, stdout=True, stderr=True, stream=True, logs=True, demux=True)
            api.start(cid)
        except docker.errors.APIError as e:
            self._close_stream(state)
            with contextlib.suppress(docker.errors.APIError):
                api.remove_container(cid, force=True)
            raise StartFailed(FAILURE_PROVISIONING, f"start: {_engine_words(e)}") from e

    # ---- output --------------------------------------------------------------------------------

    def _read_output(self, state: _State, loop: asyncio.AbstractEventLoop) -> None:
        assert state.chunks is not None
        q = state.chunks
        try:
            for out, err in state.stream:
                if out:
                    loop.call_soon_threadsafe(q.put_nowait, ("stdout", out))
                if err:
                    loop.call_soon_threadsafe(q.put_nowait, ("stderr", err))
        except BaseException as e:  # noqa: BLE001 - reported by wait, not lost in a thread
            state.reader_error.append(e)
        finally:
            self._close_stream(state)
            with contextlib.suppress(RuntimeError):  # the loop may be closed already
                loop.call_soon_threadsafe(q.put_nowait, None)

    @staticmethod
    def _close_stream(state: _State) -> None:
        stream = state.stream
        state.stream = None
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()
            # CancellableStream.close shuts the socket but leaves the response's reader holding its
            # file descriptor until garbage collection; close the response too
            response = getattr(stream, "_response", None)
            if response is not None:
                with contextlib.suppress(Exception):
                    response.close()

    # ---- wait / stop / destroy -----------------------------------------------------------------

    async def wait(self, handle: Handle, sink: OutputSink) -> ExitResult:
        state: _State = handle.state
        if state.chunks is not None:
            while (item := await state.chunks.get()) is not None:
                await sink(*item)
        try:
            result = await asyncio.to_thread(self.blocking.api.wait, state.container_id)
            inspected = await asyncio.to_thread(self.control.api.inspect_container, state.container_id)
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            return ExitResult(None, FAILURE_INTERNAL, f"lost the container: {_engine_words(e)}")
        code = int(result.get("StatusCode", inspected["State"].get("ExitCode", -1)))
        engine_error = (result.get("Error") or {}).get("Message") or inspected["State"].get("Error") or ""
        if state.stopped_as is not None:
            return ExitResult(code, state.stopped_as, f"stopped ({state.stopped_as})")
        if inspected["State"].get("OOMKilled"):
            return ExitResult(code, FAILURE_OOM, "killed for exceeding its memory limit (the engine says OOMKilled)", oom=True)
        if code == _SIGKILL_EXIT and state.memory_limited:
            # Some engines (podman 4.3 with cgroups v1) enforce the limit but do not report the kill.
            # A SIGKILL nobody here sent, to a container under a memory limit, is that limit.
            return ExitResult(code, FAILURE_OOM, "killed by SIGKILL under its memory limit (taken as out of memory)", oom=True)
        if state.reader_error:
            log.warning("output of %s ended early: %s", handle.task_id, state.reader_error[0])
        if code == 0:
            return ExitResult(0, None, engine_error)
        return ExitResult(code, FAILURE_EXIT, engine_error)

    async def stop(self, handle: Handle, kill_grace: float, failure_class: str = "cancelled") -> None:
        state: _State = handle.state
        if state.stopped_as is None:
            state.stopped_as = failure_class
        # the engine sends the stop signal (SIGTERM) and SIGKILL after the grace; it takes whole seconds
        grace = max(0, math.ceil(kill_grace))
        try:
            await asyncio.to_thread(self.blocking.api.stop, state.container_id, timeout=grace)
        except docker.errors.NotFound:
            pass  # already removed
        except docker.errors.APIError as e:
            # a stop that failed must not leave the container running: kill it outright
            log.warning("stop of %s failed (%s); killing it", handle.task_id, _engine_words(e))
            with contextlib.suppress(docker.errors.APIError):
                await asyncio.to_thread(self.control.api.kill, state.container_id, "SIGKILL")

    async def destroy(self, handle: Handle) -> ReleaseProof:
        state: _State = handle.state
        cid = state.container_id if state is not None else handle.ref
        await asyncio.to_thread(self._remove, cid)
        if state is not None:
            self._close_stream(state)
        return ReleaseProof(ref=cid, at=datetime.now(UTC))

    def _remove(self, cid: str) -> None:
        api = self.control.api
        try:
            api.remove_container(cid, force=True, v=True)
        except docker.errors.APIError as e:
            if not _no_such_container(e):
                raise
        # the proof is the engine saying it no longer knows the container
        try:
            api.inspect_container(cid)
        except docker.errors.APIError as e:
            if _no_such_container(e):
                return
            raise
        raise RuntimeError(f"container {cid[:12]} still exists after removal")

    # ---- recover -------------------------------------------------------------------------------

    async def recover(self) -> list[Recovered]:
        return await asyncio.to_thread(self._recover)

    def _recover(self) -> list[Recovered]:
        api = self.control.api
        found = []
        for c in api.containers(all=True, filters={"label": f"{LABEL_NODE}={self.node_id}"}):
            labels = c.get("Labels") or {}
            try:
                token = int(labels.get(LABEL_TOKEN, ""))
            except ValueError:
                continue  # not one of ours in the shape we write
            try:
                st = api.inspect_container(c["Id"])["State"]
            except docker.errors.NotFound:
                continue  # removed meanwhile
            running = bool(st.get("Running"))
            handle = Handle(
                kind=KIND,
                ref=c["Id"],
                task_id=labels.get(LABEL_TASK, ""),
                token=token,
                state=_State(container_id=c["Id"], memory_limited=False),
            )
            found.append(
                Recovered(
                    handle=handle,
                    running=running,
                    exit_code=None if running else st.get("ExitCode"),
                    instance=labels.get(LABEL_INSTANCE, ""),
                    labels=dict(labels),
                )
            )
        return found


def pull_auth(image: str, auth: RegistryAuth | None) -> dict[str, str] | None:
    """The auth_config for pulling `image`: the credentials only when they are for the image's own
    registry (passed per call: the SDK neither logs nor stores them), else none at all."""
    if auth is None:
        return None
    registry, _ = docker.auth.resolve_repository_name(_repository(image))
    if not _same_registry(auth.registry, registry):
        return None
    return {"username": auth.username, "password": auth.password, "serveraddress": registry}


def _no_such_container(e: docker.errors.APIError) -> bool:
    """The engine no longer knows the container: a 404, or podman's 500 "no such container" while
    another removal of it is under way."""
    return isinstance(e, docker.errors.NotFound) or "no such container" in _engine_words(e).lower()


def _engine_words(e: BaseException) -> str:
    """The engine's own message, without the SDK's HTTP wrapping."""
    explanation = getattr(e, "explanation", None)
    if explanation:
        return str(explanation.decode() if isinstance(explanation, bytes) else explanation)
    return str(e)


def _repository(image: str) -> str:
    """`host/team/app` from `host/team/app:tag` or `host/team/app@sha256:…`."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    return name


def _split_for_pull(image: str) -> tuple[str, str | None]:
    """(repository, tag or digest) as the pull call wants them."""
    if "@" in image:
        repo, digest = image.split("@", 1)
        return _repository(repo), digest
    repo = _repository(image)
    tag = image[len(repo) + 1 :] or None
    return repo, tag


def _same_registry(a: str, b: str) -> bool:
    def norm(r: str) -> str:
        r = r.lower().removeprefix("https://").removeprefix("http://").rstrip("/")
        return "docker.io" if r in ("index.docker.io", "registry-1.docker.io") else r

    return norm(a) == norm(b)


def _limits(spec: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(CPU millicores, memory bytes) the spec asks for, as the server validated them."""
    from podium.spec import ResourceSpec

    try:
        r = ResourceSpec.model_validate(spec.get("resources") or {})
    except ValueError:
        return None, None
    return r.cpu or None, r.memory or None


def _login_for(image: str, logins: list[RegistryAuth]) -> RegistryAuth | None:
    """The login for the image's own registry, if the server sent one; no other goes with a pull."""
    from podium.images import parse_image

    try:
        registry = parse_image(image).registry
    except ValueError:
        return None
    return next((r for r in logins if r.registry.lower() == registry.lower()), None)
