"""Container image references: `[HOST[:PORT]/]REPO/PATH[:TAG][@sha256:HEX]`, parsed and checked.

This is the distribution reference grammar (the one `docker pull` accepts), normalised the way
Docker normalises it: no host means `docker.io`, a one-segment name there means `library/NAME`,
no tag and no digest means `latest`. A reference that does not parse is refused with a ValueError
whose message quotes the reference and names the part that is wrong, so the API can hand it to the
user as it is.

One deliberate difference from Docker: the first segment is a registry host only when it contains
a "." or a ":" or is "localhost". Docker also takes a segment with a capital letter for a host
("UPPER/x" pulls "x" from a server named UPPER), which is never what anybody means; here it is a
repository that is not lowercase, and the message says so.

This module is pure: it must never touch the network or the filesystem. Asking a registry what a
tag points at is podium.registry's job.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DEFAULT_REGISTRY", "DEFAULT_TAG", "ImageRef", "is_digest", "parse_image"]

DEFAULT_REGISTRY = "docker.io"
DEFAULT_TAG = "latest"
#: Docker Hub's namespace for its official images: `ubuntu` is `docker.io/library/ubuntu`.
OFFICIAL_NAMESPACE = "library"
#: Other spellings of Docker Hub that Docker itself treats as docker.io.
_HUB_ALIASES = frozenset({"index.docker.io", "registry-1.docker.io"})

NAME_MAX = 255  # characters in HOST/REPO, the distribution library's limit
TAG_MAX = 128  # characters in a tag

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_TAG_CHARS = re.compile(r"[A-Za-z0-9_.-]+")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# A path component: lowercase letters and digits, separated by ".", "_", "__" or a run of "-".
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?")
_IPV6 = re.compile(r"\[[0-9A-Fa-f:.]+\]")
_IMAGE_ID = re.compile(r"[0-9a-f]{64}")

_Bad = Callable[[str], ValueError]  # makes the error for one reference from what is wrong with it


def is_digest(value: str) -> bool:
    """True for a manifest digest as Podium pins it: `sha256:` and 64 lowercase hex digits."""
    return _DIGEST.fullmatch(value) is not None


@dataclass(frozen=True)
class ImageRef:
    """A parsed, normalised image reference.

    `tag` is None only when the reference named a digest and no tag (`repo@sha256:…`); a reference
    with both keeps the tag for display, and the digest is what runs.
    """

    registry: str  # "docker.io", "localhost:5000", "registry.example.com:8443"; host lowercased
    repository: str  # "library/ubuntu", "team/app"
    tag: str | None
    digest: str | None

    @property
    def name(self) -> str:
        """`HOST/REPO`, without tag or digest."""
        return f"{self.registry}/{self.repository}"

    @property
    def reference(self) -> str:
        """What a registry is asked for: the digest when there is one, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    def pinned(self, digest: str) -> str:
        """`HOST/REPO@sha256:…`: the reference every attempt runs, whatever the tag points at later."""
        if not is_digest(digest):
            raise ValueError(f"image {self.name!r}: the digest {digest!r} is not 'sha256:' followed by 64 lowercase hex digits")
        return f"{self.name}@{digest}"

    def __str__(self) -> str:
        out = self.name
        if self.tag is not None:
            out += f":{self.tag}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out


def parse_image(ref: str) -> ImageRef:
    """Parse and normalise an image reference; a ValueError says what is wrong with it."""
    if not isinstance(ref, str) or ref == "":
        raise ValueError("image '': the reference is empty; give one like registry.example.com/team/app:1.4")
    if any(c.isspace() or not c.isprintable() for c in ref):
        raise ValueError(f"image {ref!r}: a reference has no spaces or control characters")

    def bad(what: str) -> ValueError:
        return ValueError(f"image {ref!r}: {what}")

    rest, at, digest = ref.partition("@")
    if at:
        if "@" in digest:
            raise bad("a reference has at most one '@' (before the digest)")
        if not is_digest(digest):
            raise bad(f"the digest {digest!r} is not 'sha256:' followed by 64 lowercase hex digits")
    # The tag is after the last ":" that follows the last "/": a ":" before it is a registry's port.
    name, tag = rest, None
    colon = rest.rfind(":")
    if colon > rest.rfind("/"):
        name, tag = rest[:colon], rest[colon + 1 :]
        _check_tag(tag, bad)
    if not name:
        raise bad("the repository name is missing")
    if len(name) > NAME_MAX:
        raise bad(f"the name is longer than {NAME_MAX} characters")

    registry, path = DEFAULT_REGISTRY, name
    first, slash, remainder = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, path = _check_registry(first, bad), remainder
    if registry in _HUB_ALIASES:
        registry = DEFAULT_REGISTRY
    _check_repository(path, bad)
    if registry == DEFAULT_REGISTRY and "/" not in path:
        if _IMAGE_ID.fullmatch(path):
            raise bad("64 hex digits are an image ID, not a repository; pin a digest with NAME@sha256:…")
        path = f"{OFFICIAL_NAMESPACE}/{path}"
    if tag is None and not digest:
        tag = DEFAULT_TAG
    return ImageRef(registry=registry, repository=path, tag=tag, digest=digest or None)


def _check_tag(tag: str, bad: _Bad) -> None:
    if tag == "":
        raise bad("the tag after ':' is empty; drop the ':' to mean 'latest'")
    if not _TAG_CHARS.fullmatch(tag):
        raise bad(f"the tag {tag!r} has a character not allowed in a tag (A-Z a-z 0-9 _ . -)")
    if not _TAG.fullmatch(tag):
        raise bad(f"the tag {tag!r} must begin with a letter, a digit or '_'")
    if len(tag) > TAG_MAX:
        raise bad(f"the tag is longer than {TAG_MAX} characters")


def _check_registry(host_port: str, bad: _Bad) -> str:
    host, port = host_port, None
    if host_port.startswith("["):  # [IPv6]:port
        end = host_port.find("]")
        host, after = host_port[: end + 1], host_port[end + 1 :]
        if end < 0 or (after and not after.startswith(":")) or not _IPV6.fullmatch(host):
            raise bad(f"the registry host {host_port!r} is not a valid [IPv6] address")
        if after:
            port = after[1:]
    else:
        host, colon, p = host_port.partition(":")
        port = p if colon else None
        labels = host.split(".")
        if not host or not all(_HOST_LABEL.fullmatch(label) for label in labels):
            raise bad(
                f"the registry host {host!r} is not a host name "
                "(letters, digits and '-', in parts separated by '.')"
            )
    if port is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise bad(f"the registry port {port!r} is not a number from 1 to 65535")
    # Host names are case-insensitive; one spelling lets credentials be matched to their registry.
    return host.lower() + (f":{port}" if port is not None else "")


def _check_repository(path: str, bad: _Bad) -> None:
    if path != path.lower():
        raise bad(f"the repository {path!r} must be lowercase")
    for component in path.split("/"):
        if component == "":
            raise bad(f"the repository {path!r} has an empty part (a leading, trailing or doubled '/')")
        if not _COMPONENT.fullmatch(component):
            raise bad(
                f"the repository part {component!r} is not allowed: use lowercase letters and digits, "
                "separated by '.', '_', '__' or '-'"
            )
