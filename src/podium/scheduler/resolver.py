"""The resolver loop: before a container task can be placed, its image's tag is resolved to a digest
through the image's registry (with that registry's stored login), and the digest is recorded on the
task. Dispatch claims a container task only once it has one, and every attempt is sent the image
pinned to it (`repository@digest`), so a tag moved between attempts can never change what runs.

What a registry answers becomes a sentence on the task:

- a digest: the task is pinned and dispatch is woken;
- it cannot be reached: the task stays queued with `REGISTRY_UNREACHABLE` and the registry's (or the
  network's) words beside it, and is tried again later, each try waiting twice as long
  (`Timing.registry_retry` up to `Timing.registry_retry_max`);
- no such image, or the credentials are refused: the task fails (`IMAGE_NOT_FOUND`,
  `REGISTRY_REFUSED`), the registry's words beside the reason.

The call to the registry is a seam (`ResolveImage`): the loop is tested against real PostgreSQL with
a stand-in registry answer; the server plugs in `registry_http_client` (podium.registry's HTTP API v2
client), tested against a real registry.

This module must never hold a row lock across a registry call (a claim is a short lease, not a
lock), never write a task it has not re-checked (every write is conditional on the task being still
queued and unresolved), never resolve a task that is already pinned, and never log credentials.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from podium import failures, metrics
from podium.errors import (
    ImageNotFound,
    RegistryCredentialsRefused,
    RegistryError,
    RegistryUnreachable,
    StoreUnavailable,
)  # fmt: skip
from podium.registry import is_loopback
from podium.scheduler import policy
from podium.scheduler.apply import change
from podium.scheduler.woken import WokenLoop
from podium.security.service import Security, registry_of
from podium.spec import image_digest
from podium.states import TaskState
from podium.store import Change, Store
from podium.store.rows import UnresolvedRow
from podium.timing import Timing

log = logging.getLogger(__name__)

RESOLVE_BATCH = 64  # tasks one pass claims
RESOLVE_CONCURRENCY = 8  # registry calls in flight at once within a pass
RESOLVE_TIMEOUT = 10.0  # seconds one registry call may take before it counts as "cannot be reached"
CLAIM_LEASE = 120.0  # seconds a claimed task is left to this resolver (longer than a whole pass)
QUEUED = policy.TaskFacts(state=TaskState.QUEUED)  # what a claimed task is: the claim reads only queued ones
_DIGEST = re.compile(r"^[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-fA-F0-9]{32,}$")


class ResolveImage(Protocol):
    """The seam: resolve `image`'s tag to its manifest digest ("sha256:…") at its registry, or raise
    RegistryUnreachable, ImageNotFound or RegistryCredentialsRefused with the registry's words in
    `.detail`. `insecure` allows plain HTTP (a loopback registry, as Docker allows it)."""

    def __call__(
        self, image: str, credentials: tuple[str, str] | None, *, insecure: bool, timeout: float
    ) -> Awaitable[str]: ...


async def registry_http_client(
    image: str, credentials: tuple[str, str] | None, *, insecure: bool, timeout: float
) -> str:
    """What the server resolves tags with: the registry's HTTP API v2 (podium.registry), its errors
    translated into the ones this loop tells as sentences, the registry's own words kept as detail."""
    from podium import registry as v2
    from podium.images import parse_image

    try:
        ref = parse_image(image)
    except ValueError as e:
        # admission refuses malformed references; one stored before that check cannot be pulled either
        raise ImageNotFound(registry_of(image), str(e)) from None
    return await v2.resolve(ref, credentials, timeout=timeout, insecure=insecure)


@dataclass(frozen=True, slots=True)
class _Answer:
    digest: str | None = None
    error: RegistryError | None = None


def backoff(timing: Timing, tries: int) -> float:
    """How long after its `tries`-th failed try (0-based) a task's registry is asked again."""
    return min(timing.registry_retry * 2 ** min(tries, 30), timing.registry_retry_max)


class ImageResolver:
    def __init__(
        self, store: Store, security: Security, timing: Timing, *, resolve: ResolveImage, server_id: str
    ) -> None:
        self.store = store
        self.security = security
        self.timing = timing
        self.resolve = resolve
        self.actor = f"resolver:{server_id}"
        self.woken = WokenLoop("resolver", store, "podium_resolve", timing.tick, self._pass)

    def tasks(self) -> dict[str, Callable[[], Awaitable[None]]]:
        """The named loop the server supervises: woken by a submission with a tag to resolve (NOTIFY
        podium_resolve), and every tick for the retries coming due."""
        return {"scheduler.resolver": self.woken.run}

    async def close(self) -> None:
        await self.woken.close()

    async def _pass(self) -> float | None:
        return 0 if await self.resolve_once() >= RESOLVE_BATCH else None  # a full batch: more may be waiting

    async def resolve_once(self) -> int:
        """One pass: claim the tasks due, ask each distinct image's registry once, write the answers.
        Returns how many tasks were claimed."""
        claimed = await self.store.claim_unresolved(RESOLVE_BATCH, CLAIM_LEASE)
        if not claimed:
            return 0
        by_image: dict[str, list[UnresolvedRow]] = defaultdict(list)
        for row in claimed:
            by_image[row.image].append(row)
        limit = asyncio.Semaphore(RESOLVE_CONCURRENCY)

        async def ask(image: str) -> tuple[str, _Answer]:
            async with limit:
                return image, await self._ask(image)

        answers = dict(await asyncio.gather(*(ask(image) for image in by_image)))
        resolved: list[tuple[uuid.UUID, str]] = []
        unreachable: list[tuple[uuid.UUID, str | None, float]] = []
        failed: list[Change] = []
        for image, rows in by_image.items():
            answer = answers[image]
            for row in rows:
                if answer.digest is not None:
                    resolved.append((row.id, answer.digest))
                elif isinstance(answer.error, ImageNotFound | RegistryCredentialsRefused):
                    step = policy.on_image_unresolvable(QUEUED, answer.error.reason, answer.error.detail)
                    if step is not None:
                        failed.append(change(row.id, TaskState.QUEUED, step, actor=self.actor))
                else:
                    detail = failures.detail(answer.error.detail if answer.error else None)
                    unreachable.append((row.id, detail, backoff(self.timing, row.resolve_tries)))
        await self.store.set_resolved(resolved)
        await self.store.set_unresolved(unreachable)
        if failed:
            await self.store.transition_many(failed)
        metrics.IMAGE_RESOLUTIONS.labels("resolved").inc(len(resolved))
        metrics.IMAGE_RESOLUTIONS.labels("unreachable").inc(len(unreachable))
        metrics.IMAGE_RESOLUTIONS.labels("failed").inc(len(failed))
        return len(claimed)

    async def _ask(self, image: str) -> _Answer:
        pinned = image_digest(image)
        if pinned is not None:
            return _Answer(digest=pinned)  # already names exactly one image: nothing to ask
        registry = registry_of(image)
        try:
            credentials = await self.security.registry_credentials(image)
            # not wait_for, which in Python 3.11 loses a cancel (the server stopping) that comes as
            # the answer does
            async with asyncio.timeout(RESOLVE_TIMEOUT + 1.0):
                digest = await self.resolve(image, credentials, insecure=is_loopback(registry), timeout=RESOLVE_TIMEOUT)
        except RegistryError as e:
            log.info("image %s: %s: %s", image, type(e).__name__, e.detail)
            return _Answer(error=e)
        except TimeoutError:
            return _Answer(error=RegistryUnreachable(registry, f"no answer within {RESOLVE_TIMEOUT:g}s"))
        except (StoreUnavailable, asyncio.CancelledError):
            raise
        except Exception as e:  # a bug in a client must not stop the loop: the task waits, saying so
            log.exception("resolving image %s failed", image)
            return _Answer(error=RegistryUnreachable(registry, f"resolving the tag failed: {type(e).__name__}: {e}"))
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            return _Answer(error=RegistryUnreachable(registry, f"answered with no usable digest ({str(digest)[:100]!r})"))
        return _Answer(digest=digest)
