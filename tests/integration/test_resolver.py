"""The resolver loop against real PostgreSQL (embedded and 15), the real store, Scheduler and Security.

The ONE test double here is the registry: `RegistryStandIn` answers the loop's resolution calls in
place of the registry HTTP API v2 client, which is built in another branch and is tested there
against a real registry. Everything on this side of that seam is real: the claim, the backoff, the
digest pinned on the task, the dispatch claim that skips a container task until it is pinned, the
Assign that carries `repository@digest`, the task failed with the registry's words beside its reason.
The last test puts the server's own client (`registry_http_client`) behind the seam against a real
registry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Any

from podium import failures, reasons
from podium.errors import ImageNotFound, RegistryCredentialsRefused, RegistryError, RegistryUnreachable
from podium.scheduler.resolver import ImageResolver, backoff, is_loopback, registry_http_client
from podium.scheduler.service import Scheduler
from podium.security.secretbox import SecretBox
from podium.security.service import REGISTRY_PREFIX, Security
from podium.spec import TaskSpec
from podium.store import Store
from podium.timing import DEFAULT_TIMING
from tests.registry import RegistryServer, free_port, note_image

# Retries due at once, so a test waits on nothing: the backoff itself is checked on the stored time.
TIMING = dataclasses.replace(DEFAULT_TIMING, registry_retry=0.0, registry_retry_max=0.0)
IMAGE = "localhost:5000/team/app:1.4"
D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64


class RegistryStandIn:
    """A test double for the registry only (the real client lands in another branch): answers each
    call with the next scripted answer (a digest, or an error to raise), and records every call."""

    def __init__(self, *answers: str | RegistryError) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, tuple[str, str] | None, bool]] = []

    async def __call__(self, image: str, credentials: tuple[str, str] | None, *, insecure: bool, timeout: float) -> str:
        self.calls.append((image, credentials, insecure))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, RegistryError):
            raise answer
        return answer


async def container_node(store: Store, node_id: str = "n1") -> None:
    await store.node_hello(
        node_id=node_id, name=node_id, pool="default", arch="x86_64", labels={}, capabilities=[],
        backends=["container", "process"], artifacts=[], protocol_min=1, protocol_max=1, gpu_indexes=[],
        cpu_millis=4000, memory_bytes=8 * 2**30, disk_bytes=2**34, gpus=0, slots=4, gateway_id="test",
        agent_version="test", egress_contexts=["none", "open"],
    )  # fmt: skip


async def submit(store: Store, image: str = IMAGE, **spec: Any) -> uuid.UUID:
    row, _ = await store.submit(TaskSpec(backend="container", image=image, **spec))
    return row.id


def resolver(store: Store, registry: RegistryStandIn, timing: Any = TIMING) -> ImageResolver:
    return ImageResolver(store, Security(store, SecretBox(os.urandom(32))), timing, resolve=registry, server_id="test")


def scheduler(store: Store) -> Scheduler:
    return Scheduler(store, TIMING, server_id="test")


async def assign_sent(store: Store, node: str) -> list[dict[str, Any]]:
    """What the gateway would push to the node now: the specs of its Assigns."""
    return [json.loads(r.spec) for r in await store.take_outbox([node]) if r.kind == "assign"]


async def test_an_unreachable_registry_keeps_the_task_queued_with_its_words_then_it_runs(store: Store) -> None:
    await container_node(store)
    tid = await submit(store)
    registry = RegistryStandIn(RegistryUnreachable("", "dial tcp 127.0.0.1:5000: connect: connection refused"), D1)
    loop = resolver(store, registry)

    # not resolved yet: the dispatch claim does not even look at it
    out = await scheduler(store).dispatch_once()
    assert out.claimed == 0 and out.assigned == []

    assert await loop.resolve_once() == 1
    task = await store.get_task(tid)
    assert (task.state, task.image_digest) == ("queued", None)
    assert task.reason == reasons.REGISTRY_UNREACHABLE
    assert task.reason_detail == "dial tcp 127.0.0.1:5000: connect: connection refused"
    assert task.resolve_tries == 1
    out = await scheduler(store).dispatch_once()
    assert out.claimed == 0 and (await store.get_task(tid)).reason == reasons.REGISTRY_UNREACHABLE
    # a loopback registry may speak plain HTTP, as Docker allows; no login is stored for it
    assert registry.calls == [(IMAGE, None, True)]

    assert await loop.resolve_once() == 1  # the retry is due (no backoff in this Timing)
    task = await store.get_task(tid)
    assert (task.image_digest, task.reason, task.reason_detail) == (D1, reasons.WAITING, None)
    assert task.resolved_at is not None and task.image == IMAGE

    out = await scheduler(store).dispatch_once()
    assert [t for t, _n, _tok in out.assigned] == [tid]
    (spec,) = await assign_sent(store, "n1")
    assert spec["image"] == "localhost:5000/team/app@" + D1  # the tag is gone: only the digest can run
    assert await loop.resolve_once() == 0 and len(registry.calls) == 2  # resolved once, never again


async def test_a_retag_between_attempts_changes_nothing_that_runs(store: Store) -> None:
    from podium.scheduler import policy
    from podium.scheduler.apply import facts
    from podium.states import TaskState

    await container_node(store)
    tid = await submit(store, max_attempts=2)
    registry = RegistryStandIn(D1)
    loop = resolver(store, registry)
    await loop.resolve_once()
    out = await scheduler(store).dispatch_once()
    (_t, node, tok) = out.assigned[0]
    assert [s["image"] for s in await assign_sent(store, node)] == ["localhost:5000/team/app@" + D1]
    # the tag now points at another image; the first attempt is lost with its node
    registry.answers = [D2]
    row = await store.get_task(tid)
    assert await scheduler(store).applier.apply(tid, TaskState.ASSIGNED, policy.on_node_loss(facts(row), reasons.NODE_LOST),
                                        fencing_token=tok)  # fmt: skip
    assert await loop.resolve_once() == 0
    out = await scheduler(store).dispatch_once()
    assert [t for t, _n, _tok in out.assigned] == [tid]
    assert [s["image"] for s in await assign_sent(store, "n1")] == ["localhost:5000/team/app@" + D1]
    assert len(registry.calls) == 1


async def test_an_image_that_does_not_exist_fails_the_task_with_the_registrys_words(store: Store) -> None:
    await container_node(store)
    tid = await submit(store)
    await resolver(store, RegistryStandIn(ImageNotFound("", "MANIFEST_UNKNOWN: manifest unknown; tag=1.4"))).resolve_once()
    task, attempts, events = await store.task_detail(tid)
    assert (task.state, task.reason, task.reason_detail) == ("failed", reasons.IMAGE_NOT_FOUND,
                                                                      "MANIFEST_UNKNOWN: manifest unknown; tag=1.4")  # fmt: skip
    assert attempts == [] and task.finished_at is not None
    ev = events[-1]
    assert (ev.from_state, ev.to_state, ev.reason, ev.failure_class, ev.detail) == (
        "queued", "failed", reasons.IMAGE_NOT_FOUND, failures.PROVISIONING, "MANIFEST_UNKNOWN: manifest unknown; tag=1.4")


async def test_refused_credentials_fail_the_task_and_the_stored_login_is_the_one_used(store: Store) -> None:
    await container_node(store)
    security = Security(store, SecretBox(os.urandom(32)))
    await security.set_secret(REGISTRY_PREFIX + "registry.example.com", json.dumps({"username": "ci", "password": "pw"}).encode(), "test")
    await security.set_secret(REGISTRY_PREFIX + "other.example.com", json.dumps({"username": "x", "password": "y"}).encode(), "test")
    tid = await submit(store, image="registry.example.com/team/app:1.4")
    anonymous = await submit(store, image="quay.example.org/app")
    registry = RegistryStandIn(RegistryCredentialsRefused("", "UNAUTHORIZED: authentication required"))
    loop = ImageResolver(store, security, TIMING, resolve=registry, server_id="test")
    assert await loop.resolve_once() == 2
    assert sorted(registry.calls) == sorted([
        ("registry.example.com/team/app:1.4", ("ci", "pw"), False),  # that registry's login, no other's
        ("quay.example.org/app", None, False),
    ])  # fmt: skip
    for t in (tid, anonymous):
        task = await store.get_task(t)
        assert (task.state, task.reason, task.reason_detail) == (
            "failed", reasons.REGISTRY_REFUSED, "UNAUTHORIZED: authentication required")


async def test_one_question_per_image_and_a_digest_needs_none(store: Store) -> None:
    await container_node(store)
    same = [await submit(store) for _ in range(3)]
    pinned = await submit(store, image="busybox@" + D2)
    registry = RegistryStandIn(D1)
    assert await resolver(store, registry).resolve_once() == 4
    assert registry.calls == [(IMAGE, None, True)]
    assert [(await store.get_task(t)).image_digest for t in same] == [D1, D1, D1]
    assert (await store.get_task(pinned)).image_digest == D2
    out = await scheduler(store).dispatch_once()
    assert len(out.assigned) == 4
    assert sorted(s["image"] for s in await assign_sent(store, "n1")) == sorted(
        ["busybox@" + D2] + ["localhost:5000/team/app@" + D1] * 3)


async def test_only_a_submit_with_a_tag_to_resolve_wakes_the_resolver(store: Store) -> None:
    """The resolver loop listens on a channel of its own: a process task's submit says nothing to it
    (once every submit woke it, for a query that found nothing, in the way of every placement)."""
    sub = await store.listen("podium_resolve")
    try:
        await store.submit(TaskSpec(command=["true"]))
        # one listener hears its notifications in commit order: the sentinel comes first only if the
        # process task's submit sent none
        async with store.pool.acquire() as conn:
            await conn.execute("SELECT pg_notify('podium_resolve', 'sentinel')")
        assert (await asyncio.wait_for(sub.get(), 30)).payload == "sentinel"
        await submit(store)
        assert (await asyncio.wait_for(sub.get(), 30)).payload == ""
    finally:
        await sub.close()


async def test_a_cancel_while_resolving_wins_and_a_claimed_task_is_not_claimed_twice(store: Store) -> None:
    await container_node(store)
    tid = await submit(store)
    other = await submit(store)
    claimed = await store.claim_unresolved(10, 120.0)
    assert {r.id for r in claimed} == {tid, other}
    assert await store.claim_unresolved(10, 120.0) == []  # another resolver takes nothing of this claim
    await scheduler(store).cancel(tid, actor="operator")
    # the first resolver's answer comes back after the cancel: only the queued task is written
    assert await store.set_resolved([(tid, D1), (other, D1)]) == {other}
    task = await store.get_task(tid)
    assert (task.state, task.image_digest) == ("cancelled", None)


async def test_the_backoff_doubles_up_to_its_limit(store: Store) -> None:
    t = DEFAULT_TIMING
    assert [backoff(t, n) for n in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    await container_node(store)
    tid = await submit(store)
    loop = resolver(store, RegistryStandIn(RegistryUnreachable("", "503 Service Unavailable")), DEFAULT_TIMING)
    await loop.resolve_once()
    async with store.pool.acquire() as c:
        # from the write that set it (against the clock now, a slow machine's second between the write
        # and this read would count)
        wait = await c.fetchval("SELECT extract(epoch FROM resolve_after - updated_at) FROM tasks WHERE id = $1", tid)
    assert wait == 2.0
    assert await loop.resolve_once() == 0  # not due yet


def test_only_a_loopback_registry_may_speak_plain_http() -> None:
    assert is_loopback("localhost:5000") and is_loopback("127.0.0.1:5000") and is_loopback("[::1]:5000")
    assert not is_loopback("registry.example.com") and not is_loopback("10.0.0.1:5000") and not is_loopback("docker.io")


async def test_a_malformed_answer_is_not_pinned(store: Store) -> None:
    await container_node(store)
    tid = await submit(store)
    await resolver(store, RegistryStandIn("latest")).resolve_once()
    task = await store.get_task(tid)
    assert (task.state, task.image_digest, task.reason) == ("queued", None, reasons.REGISTRY_UNREACHABLE)
    assert "no usable digest" in task.reason_detail


# ---- the server's registry client: the real HTTP API v2 client behind the seam, a real registry ----


async def test_the_servers_registry_client_asks_the_real_registry(registry: RegistryServer) -> None:
    """The seam's default (what PodiumServer uses unless a test passes its own) resolves a pushed tag
    with the stored login, and tells refused credentials, a missing tag and a registry that is down
    as the three errors the loop turns into sentences, the registry's words kept."""
    from podium.server import PodiumServer, ServerConfig

    assert PodiumServer(ServerConfig(data_dir=Path("unused"))).resolve_image is registry_http_client
    repo = registry.unique_repo()
    digest = registry.push(repo, "1.0", note_image("resolver"))
    image = f"{registry.host}/{repo}:1.0"
    got = await registry_http_client(image, registry.credentials, insecure=True, timeout=10)
    assert got == digest
    try:
        await registry_http_client(image, None, insecure=True, timeout=10)
    except RegistryCredentialsRefused as e:
        assert "authentication required" in e.detail
    else:
        raise AssertionError("a registry demanding a login resolved without one")
    try:
        await registry_http_client(f"{registry.host}/{repo}:nope", registry.credentials, insecure=True, timeout=10)
    except ImageNotFound as e:
        assert "manifest unknown" in e.detail
    else:
        raise AssertionError("a missing tag resolved")
    try:
        await registry_http_client(f"127.0.0.1:{free_port()}/{repo}:1.0", None, insecure=True, timeout=5)
    except RegistryUnreachable as e:
        assert "127.0.0.1" in e.detail
    else:
        raise AssertionError("a registry nobody listens for resolved")
