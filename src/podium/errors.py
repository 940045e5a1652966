"""Podium's exceptions, one module, one base. Each class's docstring is its default message.

    PodiumError
    ├── NotFound            — no such task / node
    ├── Conflict            — the request disagrees with what is stored (idempotency key reused, …)
    │   ├── Ambiguous       — an id prefix that more than one thing starts with (409, with the candidates)
    │   └── PreconditionFailed — a write conditional on a revision (If-Match) that is no longer current (412)
    ├── InvalidRequest      — the input is wrong; the message says how to fix it
    ├── Unauthorized        — no valid credential (401)
    ├── Forbidden           — a valid credential that may not do this (403)
    ├── StoreUnavailable    — PostgreSQL cannot be reached; nothing was written
    │   └── Contention      — a write kept losing to concurrent ones past its retry limit (503, Retry-After)
    ├── Overloaded          — the server sheds submissions until it catches up (429, Retry-After)
    ├── EmbeddedDatabaseError — the embedded PostgreSQL would not start
    └── RegistryError       — an image's registry did not resolve its tag; `.detail` is its own words
        ├── RegistryUnreachable        — no answer (network, DNS, TLS, 5xx): try again later
        ├── ImageNotFound              — the registry says there is no such image or tag
        └── RegistryCredentialsRefused — the registry refused the credentials (or their absence)

Driver errors are translated into these at the edge of the store, so nothing above it imports asyncpg.
"""

from __future__ import annotations

from typing import ClassVar

from podium import reasons


class PodiumError(Exception):
    """Something went wrong in Podium."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class NotFound(PodiumError):
    """Not found."""


class Conflict(PodiumError):
    """The request conflicts with what is stored."""


class Ambiguous(Conflict):
    """That prefix is shared by more than one id; type more of it."""

    def __init__(self, message: str | None = None, *, candidates: list[str] | None = None) -> None:
        super().__init__(message)
        self.candidates = candidates or []


class PreconditionFailed(Conflict):
    """The thing changed since the revision this request names; read it again and decide again."""


class ProfileRevisionMismatch(Conflict):
    """The seed's ErrProfileRevisionMismatch: a submission pinned to a revision of a named spec (a
    profile) that is not its current one. Nothing was stored."""


class InvalidRequest(PodiumError):
    """The request is not valid."""


class Unauthorized(PodiumError):
    """A valid bearer token is required (Authorization: Bearer pdm_…)."""


class Forbidden(PodiumError):
    """This token's role may not do that."""


class StoreUnavailable(PodiumError):
    """The database cannot be reached; nothing was written."""


class Contention(StoreUnavailable):
    """The database kept refusing this write because of concurrent ones; nothing was written. Retry later."""

    def __init__(self, message: str | None = None, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Overloaded(PodiumError):
    """The server is overloaded; retry later."""

    def __init__(self, message: str | None = None, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EmbeddedDatabaseError(PodiumError):
    """The embedded PostgreSQL did not start."""


class RegistryError(PodiumError):
    """The image's registry did not say which manifest the image is."""

    #: The constant sentence a task carries for this failure (podium.reasons).
    reason: ClassVar[str] = reasons.REGISTRY_UNREACHABLE
    #: True when asking again later may succeed: the task stays queued rather than failing.
    transient: ClassVar[bool] = False

    def __init__(self, registry: str, words: str) -> None:
        self.registry = registry
        self.words = words  # the registry's own words, stored beside the reason
        super().__init__(f"{registry}: {words}" if registry else words)

    @property
    def detail(self) -> str:
        """What is stored beside the reason: the registry's words, and which registry said them."""
        return f"{self.registry}: {self.words}" if self.registry else self.words


class RegistryUnreachable(RegistryError):
    """The registry could not be reached, did not answer in time, or answered that it is busy or
    broken (5xx, 429). Nothing is known about the image: the task stays queued and is tried again."""

    reason = reasons.REGISTRY_UNREACHABLE
    transient = True


class ImageNotFound(RegistryError):
    """The registry answered that the repository or the tag does not exist (404, NAME_UNKNOWN,
    MANIFEST_UNKNOWN), or refused the name itself. Asking again will not change that: the task fails."""

    reason = reasons.IMAGE_NOT_FOUND


class RegistryCredentialsRefused(RegistryError):
    """The registry demands credentials and refused the ones it was given (401 or 403 after
    authenticating), or none were given for it (`podium registry login` stores them). The task fails."""

    reason = reasons.REGISTRY_REFUSED

