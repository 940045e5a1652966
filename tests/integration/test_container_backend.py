"""The container backend against a real engine (podman's Docker-compatible service, tests/engine.py):
output and exit codes, streams kept apart and in order, environment, cancel and timeout (SIGTERM,
SIGKILL after the grace, then removed), egress none, recovery by label, release proofs, provisioning
failures in the engine's words, and OOM where the engine enforces limits."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import docker
import docker.errors
import pytest

from podium.agent.backends import (
    EGRESS_NONE,
    EGRESS_OPEN,
    FAILURE_CANCELLED,
    FAILURE_EXIT,
    FAILURE_OOM,
    FAILURE_PROVISIONING,
    FAILURE_TIMEOUT,
    Handle,
    RegistryAuth,
    RunSpec,
    StartFailed,
)
from podium.agent.backends.container import LABEL_NODE, ContainerBackend
from tests.engine import TEST_IMAGE, Engine
from tests.registry import RegistryServer, busybox_image

pytestmark = pytest.mark.timeout(180)


class Output:
    """An OutputSink that keeps each stream's bytes and can wait for a marker to appear."""

    def __init__(self) -> None:
        self.data: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self.changed = asyncio.Event()

    async def __call__(self, stream: str, data: bytes) -> None:
        self.data[stream] += data
        self.changed.set()

    def text(self, stream: str) -> str:
        return self.data[stream].decode()

    async def wait_for(self, stream: str, marker: str, timeout: float = 60.0) -> None:
        async with asyncio.timeout(timeout):
            while marker not in self.text(stream):
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def backend(engine: Engine) -> AsyncIterator[ContainerBackend]:  # noqa: F811
    b = ContainerBackend(node_id=f"n-{uuid.uuid4().hex[:12]}", instance_id="i-1", host=engine.url)
    yield b
    await b.close()
    # whatever a failing test left behind on this node
    for c in engine.client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={b.node_id}"}):  # type: ignore[attr-defined]
        c.remove(force=True)


def spec(*command: str, **kw: object) -> RunSpec:
    kw.setdefault("image", TEST_IMAGE)
    # No network unless a test is about the network: podman 4.3's netavark sets a container's bridge
    # network up while its asynchronous cleanup of the previous container may be tearing the same
    # NAT chains down ("iptables: Chain already exists", "No chain/target/match": the engine's race,
    # failing the create about once in a few suite runs). The egress test asks for `open` itself.
    kw.setdefault("egress", EGRESS_NONE)
    return RunSpec(task_id=f"t-{uuid.uuid4().hex[:8]}", token=int(time.time_ns() % 10**12), command=command, **kw)  # type: ignore[arg-type]


async def run(b: ContainerBackend, s: RunSpec, env: dict[str, str] | None = None) -> tuple[Output, object, Handle]:
    out = Output()
    h = await b.start(s, env or {}, Path("/nonexistent"))
    res = await b.wait(h, out)
    return out, res, h


def gone(engine: Engine, cid: str) -> bool:  # noqa: F811
    try:
        engine.client.api.inspect_container(cid)  # type: ignore[attr-defined]
    except docker.errors.NotFound:
        return True
    return False


async def test_output_and_exit_code(backend: ContainerBackend, engine: Engine) -> None:  # noqa: F811
    out, res, h = await run(backend, spec("sh", "-c", "echo hello from the image"))
    assert out.text("stdout") == "hello from the image\n" and out.text("stderr") == ""
    assert (res.exit_code, res.failure_class, res.oom) == (0, None, False)
    # labels say whose it is, so a restarted agent can find it
    labels = engine.client.api.inspect_container(h.ref)["Config"]["Labels"]  # type: ignore[attr-defined]
    assert labels["podium.node"] == backend.node_id and labels["podium.task"] == h.task_id
    assert labels["podium.token"] == str(h.token) and labels["podium.instance"] == "i-1"
    await backend.destroy(h)


async def test_a_failing_command_gives_its_code(backend: ContainerBackend) -> None:
    out, res, h = await run(backend, spec("sh", "-c", "echo no >&2; exit 3"))
    assert (res.exit_code, res.failure_class) == (3, FAILURE_EXIT)
    assert out.text("stderr") == "no\n"
    await backend.destroy(h)


async def test_stdout_and_stderr_stay_apart_and_in_order(backend: ContainerBackend) -> None:
    n = 3000
    script = f'i=0; while [ $i -lt {n} ]; do echo "out $i"; echo "err $i" >&2; i=$((i+1)); done'
    out, res, h = await run(backend, spec("sh", "-c", script))
    assert res.exit_code == 0
    assert out.text("stdout").splitlines() == [f"out {i}" for i in range(n)]
    assert out.text("stderr").splitlines() == [f"err {i}" for i in range(n)]
    await backend.destroy(h)


async def test_environment_arrives(backend: ContainerBackend) -> None:
    env = {"PODIUM_TASK_ID": "t-env", "API_TOKEN": "s3cret value"}
    out, res, h = await run(backend, spec("sh", "-c", 'echo "$PODIUM_TASK_ID|$API_TOKEN"'), env)
    assert res.exit_code == 0 and out.text("stdout") == "t-env|s3cret value\n"
    await backend.destroy(h)


@pytest.mark.parametrize("why", [FAILURE_CANCELLED, FAILURE_TIMEOUT])
async def test_stop_is_sigterm_then_sigkill_after_the_grace_then_removed(
    backend: ContainerBackend, engine: Engine, why: str  # noqa: F811
) -> None:
    grace = 2.0
    # ignores SIGTERM (says so), so only the SIGKILL after the grace can end it
    script = "trap 'echo got TERM' TERM; echo ready; while true; do sleep 0.1; done"
    out = Output()
    h = await backend.start(spec("sh", "-c", script), {}, Path("/nonexistent"))
    waiter = asyncio.create_task(backend.wait(h, out))
    await out.wait_for("stdout", "ready")
    t0 = time.monotonic()
    await backend.stop(h, kill_grace=grace, failure_class=why)
    res = await waiter
    elapsed = time.monotonic() - t0
    assert "got TERM" in out.text("stdout")
    assert elapsed >= grace * 0.9, f"killed after {elapsed:.2f}s, before the {grace}s grace"
    assert (res.exit_code, res.failure_class, res.oom) == (137, why, False)
    proof = await backend.destroy(h)
    assert proof.ref == h.ref and gone(engine, h.ref)
    assert engine.client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={backend.node_id}"}) == []  # type: ignore[attr-defined]


async def test_a_task_that_honours_sigterm_ends_before_the_grace(backend: ContainerBackend) -> None:
    script = "trap 'echo bye; exit 0' TERM; echo ready; while true; do sleep 0.1; done"
    out = Output()
    h = await backend.start(spec("sh", "-c", script), {}, Path("/nonexistent"))
    waiter = asyncio.create_task(backend.wait(h, out))
    await out.wait_for("stdout", "ready")
    t0 = time.monotonic()
    await backend.stop(h, kill_grace=60)
    res = await waiter
    assert time.monotonic() - t0 < 50  # far from the grace: SIGTERM alone ended it
    assert (res.exit_code, res.failure_class) == (0, FAILURE_CANCELLED) and "bye" in out.text("stdout")
    await backend.destroy(h)


async def test_egress_none_cannot_reach_the_node_and_open_can(backend: ContainerBackend, engine: Engine) -> None:  # noqa: F811
    connections: list[str] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(str(writer.get_extra_info("peername")))
        writer.close()

    server = await asyncio.start_server(accept, "0.0.0.0", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        # the node as an `open` container sees it: the default network's gateway
        gateways = [
            cfg["Gateway"]
            for net in engine.client.networks.list()  # type: ignore[attr-defined]
            if net.name in ("podman", "bridge")
            for cfg in (net.attrs.get("IPAM") or {}).get("Config") or ()
            if cfg.get("Gateway")
        ]
        assert gateways, "the engine's default network has no gateway"
        probe = (f"nc -w 5 {gateways[0]} {port} </dev/null && echo reached-gateway; "
                 f"nc -w 5 127.0.0.1 {port} </dev/null && echo reached-loopback; true")

        out, res, h = await run(backend, spec("sh", "-c", probe, egress=EGRESS_NONE))
        assert res.exit_code == 0
        assert "reached" not in out.text("stdout") and connections == []
        assert "unreachable" in out.text("stderr").lower() or "refused" in out.text("stderr").lower()
        await backend.destroy(h)

        out, res, h = await run(backend, spec("sh", "-c", probe, egress=EGRESS_OPEN))
        assert "reached-gateway" in out.text("stdout") and len(connections) == 1
        await backend.destroy(h)
    finally:
        server.close()
        await server.wait_closed()


async def test_recover_finds_what_an_earlier_instance_started(backend: ContainerBackend, engine: Engine) -> None:  # noqa: F811
    s = spec("sleep", "600")
    h = await backend.start(s, {}, Path("/nonexistent"))
    other_node = ContainerBackend(node_id=f"n-{uuid.uuid4().hex[:12]}", instance_id="i-x", host=engine.url)
    later = ContainerBackend(node_id=backend.node_id, instance_id="i-2", host=engine.url)
    try:
        h_other = await other_node.start(spec("sleep", "600"), {}, Path("/nonexistent"))
        found = await later.recover()
        assert [(r.handle.ref, r.handle.task_id, r.handle.token, r.running, r.instance) for r in found] == [
            (h.ref, s.task_id, s.token, True, "i-1")
        ]
        # the new instance can stop and remove it by the recovered handle alone
        await later.stop(found[0].handle, kill_grace=0)
        proof = await later.destroy(found[0].handle)
        assert proof.ref == h.ref and gone(engine, h.ref)
        assert await later.recover() == []
        await other_node.destroy(h_other)
    finally:
        await later.close()
        await other_node.close()


async def test_destroy_returns_a_proof_and_the_container_is_gone(backend: ContainerBackend, engine: Engine) -> None:  # noqa: F811
    h = await backend.start(spec("sleep", "600"), {}, Path("/nonexistent"))
    assert not gone(engine, h.ref)
    before = datetime.now(UTC)
    proof = await backend.destroy(h)  # while it still runs: removal kills it
    assert proof.ref == h.ref and before <= proof.at <= datetime.now(UTC) + timedelta(seconds=1)
    assert gone(engine, h.ref)
    # a second destroy (a retried release) proves the same and does not fail
    assert (await backend.destroy(h)).ref == h.ref


async def test_an_image_that_is_nowhere_is_a_provisioning_failure_in_the_engines_words(backend: ContainerBackend) -> None:
    image = f"localhost:1/podium-no-such-image-{uuid.uuid4().hex[:6]}:nope"
    with pytest.raises(StartFailed) as ei:
        await backend.start(spec("true", image=image), {}, Path("/nonexistent"))
    e = ei.value
    assert e.failure_class == FAILURE_PROVISIONING
    # the engine's own words, not only ours: it names where it tried to pull from
    assert image in e.message and "localhost:1" in e.message.replace(image, "")


async def test_a_command_the_image_lacks_is_a_provisioning_failure(backend: ContainerBackend) -> None:
    with pytest.raises(StartFailed) as ei:
        await backend.start(spec("/no/such/binary"), {}, Path("/nonexistent"))
    assert ei.value.failure_class == FAILURE_PROVISIONING and "/no/such/binary" in ei.value.message


async def test_fingerprint_offers_egress_limits_and_the_digests_held(backend: ContainerBackend, engine: Engine) -> None:  # noqa: F811
    fp = await backend.fingerprint()
    assert fp.available and fp.kind == "container"
    assert set(fp.egress) == {EGRESS_NONE, EGRESS_OPEN}
    assert fp.enforces_limits is engine.enforces_limits
    repo_digests = engine.client.api.inspect_image(TEST_IMAGE)["RepoDigests"]  # type: ignore[attr-defined]
    assert {d.partition("@")[2] for d in repo_digests} <= set(fp.artifacts)


async def test_docker_host_is_honoured_and_an_unreachable_engine_says_so(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, tmp_path: Path  # noqa: F811
) -> None:
    monkeypatch.setenv("DOCKER_HOST", engine.url)
    b = ContainerBackend(node_id="n-env", instance_id="i-1")
    try:
        assert (await b.fingerprint()).available
    finally:
        await b.close()
    nowhere = f"unix://{tmp_path}/no-engine.sock"
    b = ContainerBackend(node_id="n-env", instance_id="i-1", host=nowhere)
    fp = await b.fingerprint()
    assert not fp.available and "no container engine reachable" in fp.detail


async def test_memory_over_the_limit_ends_as_oom(backend: ContainerBackend, engine: Engine) -> None:  # noqa: F811
    if not engine.enforces_limits:
        pytest.skip(engine.limits_reason)
    # `tail` keeps a line it has not finished in memory: /dev/zero has no newline
    out, res, h = await run(backend, spec("tail", "/dev/zero", memory_bytes=16 * 2**20, cpu_millis=500))
    assert (res.failure_class, res.oom, res.exit_code) == (FAILURE_OOM, True, 137)
    await backend.destroy(h)
    # the same limit on a command within it is no OOM
    out, res, h = await run(backend, spec("sh", "-c", "echo fine; exit 3", memory_bytes=16 * 2**20))
    assert (res.failure_class, res.oom, res.exit_code) == (FAILURE_EXIT, False, 3)
    await backend.destroy(h)


async def test_a_container_silent_longer_than_the_control_timeout_still_streams(
    engine: Engine, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    import podium.agent.backends.container as container

    # control calls give up after 5s here; the output stream and the wait must not. (Not shorter: on
    # a busy machine the engine's own create or start may take seconds, and that is not this test.)
    monkeypatch.setattr(container, "CONTROL_TIMEOUT", 5.0)
    b = ContainerBackend(node_id=f"n-{uuid.uuid4().hex[:12]}", instance_id="i-1", host=engine.url)
    try:
        out, res, h = await run(b, spec("sh", "-c", "echo early; sleep 8; echo late"))
        assert (res.exit_code, out.text("stdout")) == (0, "early\nlate\n")
        await b.destroy(h)
    finally:
        await b.close()


async def test_a_pinned_reference_held_locally_runs_without_a_registry(backend: ContainerBackend, engine: Engine) -> None:  # noqa: F811
    # every attempt runs `image@sha256:…`; no registry answers here, so this proves no pull happened
    pinned = engine.client.api.inspect_image(TEST_IMAGE)["RepoDigests"][0]  # type: ignore[attr-defined]
    assert "@sha256:" in pinned
    out, res, h = await run(backend, spec("echo", "pinned", image=pinned))
    assert (res.exit_code, out.text("stdout")) == (0, "pinned\n")
    await backend.destroy(h)


async def test_prepare_pulls_from_the_real_registry_with_its_login_only(
    backend: ContainerBackend, engine: Engine, registry: RegistryServer  # noqa: F811
) -> None:
    """The pull happens in `prepare` (while provisioning), by digest, with the login for the image's
    own registry; without the login the registry's refusal comes back in its words."""
    image = busybox_image(f"pull {uuid.uuid4().hex}")
    repo = registry.unique_repo()
    digest = registry.push(repo, "1.0", image)
    pinned = f"{registry.host}/{repo}@{digest}"
    with pytest.raises(StartFailed) as ei:
        await backend.prepare(spec("true", image=pinned), {}, Path("/nonexistent"))
    assert ei.value.failure_class == FAILURE_PROVISIONING
    assert "authentication required" in ei.value.message or "unauthorized" in ei.value.message.lower(), ei.value.message
    # another registry's login is never sent: the same refusal
    other = RegistryAuth("registry.example.com", *registry.credentials)
    with pytest.raises(StartFailed):
        await backend.prepare(spec("true", image=pinned, registry_auth=other), {}, Path("/nonexistent"))
    login = RegistryAuth(registry.host, *registry.credentials)
    prepared = spec("true", image=pinned, registry_auth=login)
    await backend.prepare(prepared, {}, Path("/nonexistent"))
    assert digest in (await backend.fingerprint()).artifacts
    # created while provisioning, not started; discarded, it is gone
    (made,) = engine.client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={backend.node_id}"})  # type: ignore[attr-defined]
    assert made.status == "created"
    proof = await backend.discard(prepared)
    assert proof.ref == made.id and gone(engine, made.id)
    out, res, _h = await run(backend, spec("cat", "/etc/podium-image", image=pinned))
    assert out.text("stdout").startswith("pull ") and res.exit_code == 0  # type: ignore[attr-defined]
