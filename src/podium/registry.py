"""Asking an image's registry which manifest a tag points at, through the registry HTTP API v2.

The server resolves a container task's image to a digest once, when the task is first placed, and
every attempt then runs `HOST/REPO@sha256:…`: a tag moved between a failure and its retry must not
change what runs. `resolve` is that question and nothing more: one HEAD (a GET when the HEAD names no
digest, or to read the registry's words after a refusal) of `/v2/REPO/manifests/TAG`, after the
authentication the registry asks for in its 401: Basic, or a Bearer token fetched from the realm
the registry names.

What can go wrong is three things, each a class below with the constant reason the task carries
and the registry's own words (its JSON `errors[].message`, or the status line) to store beside it:

    PodiumError
    └── RegistryError
        ├── RegistryUnreachable        — no answer, a timeout, a 5xx or 429: try again later
        ├── ImageNotFound              — no such repository or tag (404, NAME_UNKNOWN, …)
        └── RegistryCredentialsRefused — 401/403 with the credentials, or none for a registry
                                         that demands them

This module must never log or keep the credentials it is given, never pull anything but the
manifest, and never speak plain http to a registry (or send credentials to a token service) that
is neither on loopback nor marked insecure by the operator: they would cross the network in the clear.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import ipaddress
import json
import re

import httpx

from podium.errors import ImageNotFound, RegistryCredentialsRefused, RegistryError, RegistryUnreachable
from podium.images import DEFAULT_REGISTRY, ImageRef, is_digest

__all__ = [
    "DEFAULT_TIMEOUT",
    "ImageNotFound",
    "MANIFEST_MEDIA_TYPES",
    "RegistryCredentialsRefused",
    "RegistryError",
    "RegistryUnreachable",
    "base_url",
    "is_loopback",
    "resolve",
]

DEFAULT_TIMEOUT = 10.0  # seconds for the whole resolution, token included

#: What a manifest may be: single-platform images and multi-platform indexes, Docker's and OCI's.
#: The digest of an index is what a multi-platform image is pinned by; each node picks its platform.
MANIFEST_MEDIA_TYPES = (
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
)
_ACCEPT = ", ".join(MANIFEST_MEDIA_TYPES)

#: Docker Hub's API does not live at the name people write in references.
_HUB_API_HOST = "registry-1.docker.io"

_NOT_FOUND_CODES = frozenset({"NAME_UNKNOWN", "MANIFEST_UNKNOWN", "NAME_INVALID", "TAG_INVALID"})
_REFUSED_CODES = frozenset({"UNAUTHORIZED", "DENIED"})
_BUSY_CODES = frozenset({"TOOMANYREQUESTS", "UNAVAILABLE"})


def is_loopback(registry: str) -> bool:
    """True for `localhost`, 127.0.0.0/8 and ::1, with or without a port."""
    host = registry
    if host.startswith("["):
        host = host[1 : host.find("]")]
    elif ":" in host:
        host = host.rpartition(":")[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def base_url(registry: str, *, insecure: bool = False) -> str:
    """Where the registry's API is: https, except on loopback or for a registry marked insecure."""
    host = _HUB_API_HOST if registry == DEFAULT_REGISTRY else registry
    scheme = "http" if insecure or is_loopback(registry) else "https"
    return f"{scheme}://{host}"


async def resolve(
    ref: ImageRef,
    credentials: tuple[str, str] | None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    insecure: bool = False,
) -> str:
    """The digest (`sha256:…`) of the manifest `ref` names, as its registry says today.

    A reference that already carries a digest is its own answer: the registry is not asked.
    `credentials` are (user, password) for `ref.registry` only; `timeout` bounds the whole exchange.
    Raises RegistryUnreachable, ImageNotFound or RegistryCredentialsRefused.
    """
    if ref.digest is not None:
        return ref.digest
    url = f"{base_url(ref.registry, insecure=insecure)}/v2/{ref.repository}/manifests/{ref.reference}"
    try:
        async with asyncio.timeout(timeout):
            # An operator's HTTPS_PROXY and SSL_CERT_FILE apply, as they do for Docker; and as in Docker
            # (Go's ProxyFromEnvironment), never a proxy for a registry on loopback.
            trust_env = not is_loopback(ref.registry)
            async with httpx.AsyncClient(timeout=timeout, follow_redirects=True, trust_env=trust_env) as client:
                return await _Exchange(client, ref, credentials, insecure=insecure).run(url)
    except TimeoutError:
        raise RegistryUnreachable(ref.registry, f"no answer within {timeout:g}s") from None
    except httpx.HTTPError as e:
        raise RegistryUnreachable(ref.registry, _transport_words(e)) from None


class _Exchange:
    """One resolution: the requests, and the Authorization the registry's challenge led to."""

    def __init__(
        self, client: httpx.AsyncClient, ref: ImageRef, credentials: tuple[str, str] | None, *, insecure: bool
    ) -> None:
        self.client = client
        self.ref = ref
        self.credentials = credentials
        self.insecure = insecure
        self.authorization: str | None = None

    async def run(self, url: str) -> str:
        r = await self.send("HEAD", url)
        if r.status_code == 401:
            self.authorization = await self.authorize(r)
            if self.authorization is not None:
                r = await self.send("HEAD", url)
        if r.is_success:
            digest = r.headers.get("docker-content-digest", "")
            if is_digest(digest):
                return digest
        # A HEAD has no body: the GET gives the manifest to hash, or the registry's words for a refusal.
        r = await self.send("GET", url)
        if r.is_success:
            return self.digest_of(r)
        raise _error_for(self.ref.registry, r)

    async def send(self, method: str, url: str) -> httpx.Response:
        headers = {"Accept": _ACCEPT}
        if self.authorization is not None:
            headers["Authorization"] = self.authorization
        return await self.client.request(method, url, headers=headers)

    async def authorize(self, challenge: httpx.Response) -> str | None:
        """The Authorization header the registry's 401 asks for, or None when there is nothing to
        offer (then the refusal stands, in the registry's words)."""
        challenges = _parse_challenges(challenge.headers.get_list("www-authenticate"))
        bearer = challenges.get("bearer")
        if bearer is not None and bearer.get("realm"):
            return f"Bearer {await self.fetch_token(bearer)}"
        # Basic, or a 401 with no challenge we know: Basic is what registries fall back to.
        if self.credentials is not None:
            return _basic(self.credentials)
        return None

    async def fetch_token(self, challenge: dict[str, str]) -> str:
        # Without credentials the realm may still give an anonymous token (public images).
        params = {"scope": challenge.get("scope") or f"repository:{self.ref.repository}:pull"}
        if challenge.get("service"):
            params["service"] = challenge["service"]
        realm = challenge["realm"]
        headers = {}
        if self.credentials is not None:
            realm_host = httpx.URL(realm).netloc.decode()
            if httpx.URL(realm).scheme != "https" and not (self.insecure or is_loopback(realm_host)):
                raise RegistryCredentialsRefused(
                    self.ref.registry, f"the token service {realm} is plain http; the credentials are not sent there"
                )
            headers["Authorization"] = _basic(self.credentials)
        r = await self.client.get(realm, params=params, headers=headers)
        if not r.is_success:
            error = _error_for(self.ref.registry, r)
            if isinstance(error, ImageNotFound):  # a token service has no images: its 4xx is a refusal
                error = RegistryCredentialsRefused(self.ref.registry, error.words)
            raise error
        try:
            body = r.json()
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise RegistryCredentialsRefused(self.ref.registry, f"the token service {realm} gave no token")
        return token

    def digest_of(self, r: httpx.Response) -> str:
        digest = r.headers.get("docker-content-digest", "")
        if is_digest(digest):
            return digest
        content_type = r.headers.get("content-type", "").partition(";")[0].strip()
        if content_type not in MANIFEST_MEDIA_TYPES and not _looks_like_manifest(r.content):
            raise ImageNotFound(self.ref.registry,
                                f"the registry answered with {content_type or 'something'} that is not an image manifest")
        # A manifest's digest is the sha256 of its bytes exactly as served.
        return "sha256:" + hashlib.sha256(r.content).hexdigest()


def _error_for(registry: str, r: httpx.Response) -> RegistryError:
    """The class a refusal belongs to, carrying the registry's words."""
    codes, words = _registry_words(r)
    status = r.status_code
    if status in (401, 403) or codes & _REFUSED_CODES:
        return RegistryCredentialsRefused(registry, words)
    if status == 404 or codes & _NOT_FOUND_CODES:
        return ImageNotFound(registry, words)
    if status in (408, 429) or status >= 500 or codes & _BUSY_CODES or status < 400:
        return RegistryUnreachable(registry, words)
    # Any other 4xx is the registry refusing this name for good: asking again will not help.
    return ImageNotFound(registry, words)


def _registry_words(r: httpx.Response) -> tuple[set[str], str]:
    """The registry's error codes and messages (`{"errors": [{"code", "message"}]}`), or the status line."""
    status_line = f"{r.status_code} {r.reason_phrase}".strip()
    try:
        errors = r.json().get("errors") if r.content else None
    except (ValueError, AttributeError):
        errors = None
    if not isinstance(errors, list):
        return set(), status_line
    codes = {str(e.get("code", "")).upper() for e in errors if isinstance(e, dict)}
    messages = [str(e["message"]) for e in errors if isinstance(e, dict) and e.get("message")]
    # Bounded: a stored detail is for an operator to read, not a place for a registry's page.
    return codes, ("; ".join(messages) or status_line)[:500]


def _transport_words(e: httpx.HTTPError) -> str:
    where = ""
    with contextlib.suppress(RuntimeError):  # an error raised before any request was made has no .request
        where = f"{e.request.url.scheme}://{e.request.url.netloc.decode()}: "
    return f"{where}{str(e) or type(e).__name__}"


_CHALLENGE_ITEM = re.compile(r"""([A-Za-z0-9!#$%&'*+.^_`|~-]+)(?:\s*=\s*("(?:[^"\\]|\\.)*"|[^,\s]*))?""")


def _parse_challenges(headers: list[str]) -> dict[str, dict[str, str]]:
    """`WWW-Authenticate` challenges by lowercase scheme: `Bearer realm="…",service="…"` →
    {"bearer": {"realm": "…", "service": "…"}}. Tolerates several challenges in one header."""
    out: dict[str, dict[str, str]] = {}
    for header in headers:
        current: dict[str, str] | None = None
        for m in _CHALLENGE_ITEM.finditer(header):
            key, value = m.group(1), m.group(2)
            if value is None:  # a bare token starts a new challenge
                current = out.setdefault(key.lower(), {})
            elif current is not None:
                if value.startswith('"'):
                    value = re.sub(r"\\(.)", r"\1", value[1:-1])
                current[key.lower()] = value
    return out


def _basic(credentials: tuple[str, str]) -> str:
    user, password = credentials
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def _looks_like_manifest(body: bytes) -> bool:
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return isinstance(doc, dict) and "schemaVersion" in doc
