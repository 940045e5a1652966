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
    """The image's registry did not resolve the tag."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail or None)
        self.detail = detail  # the registry's (or the network's) own words, stored beside the reason


class RegistryUnreachable(RegistryError):
    """The image's registry cannot be reached."""


class ImageNotFound(RegistryError):
    """The image does not exist in its registry."""


class RegistryCredentialsRefused(RegistryError):
    """The image's registry refused the credentials."""
