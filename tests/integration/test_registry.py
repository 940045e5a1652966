"""Tag → digest resolution against a real registry (Debian's docker-registry with htpasswd)."""

from __future__ import annotations

import io
import socket
import tarfile
from collections.abc import Callable

import httpx
import pytest

from podium import reasons
from podium.images import parse_image
from podium.registry import ImageNotFound, RegistryCredentialsRefused, RegistryUnreachable, resolve
from tests.harness import free_port
from tests.registry import MANIFEST_V2, RegistryServer, busybox_image, note_image


async def test_resolve_with_credentials_gives_the_pushed_digest(registry: RegistryServer) -> None:
    repo = registry.unique_repo()
    pushed = registry.push(repo, "1.4", note_image("one"))
    ref = parse_image(f"{registry.host}/{repo}:1.4")
    assert await resolve(ref, registry.credentials, timeout=30) == pushed
    # "localhost" is loopback by name: plain http too, same answer
    assert await resolve(parse_image(f"localhost:{registry.port}/{repo}:1.4"), registry.credentials, timeout=30) == pushed


async def test_a_moved_tag_resolves_to_the_new_digest_and_the_old_pin_still_names_the_old_image(
    registry: RegistryServer,
) -> None:
    repo = registry.unique_repo()
    old = registry.push(repo, "stable", note_image("before"))
    ref = parse_image(f"{registry.host}/{repo}:stable")
    assert await resolve(ref, registry.credentials, timeout=30) == old
    new = registry.push(repo, "stable", note_image("after"))
    assert new != old
    assert await resolve(ref, registry.credentials, timeout=30) == new
    # what a retry of an attempt placed before the retag runs: the pin, still the old manifest
    pinned = parse_image(ref.pinned(old))
    assert await resolve(pinned, None, timeout=30) == old
    r = httpx.get(
        f"http://{registry.host}/v2/{repo}/manifests/{old}",
        auth=registry.credentials,
        headers={"Accept": MANIFEST_V2},
        trust_env=False,
    )
    assert r.status_code == 200 and r.content == note_image("before").manifest


async def test_no_credentials_are_refused_in_the_registrys_words(registry: RegistryServer) -> None:
    repo = registry.unique_repo()
    registry.push(repo, "1", note_image("private"))
    with pytest.raises(RegistryCredentialsRefused) as e:
        await resolve(parse_image(f"{registry.host}/{repo}:1"), None, timeout=30)
    assert e.value.words == "authentication required"
    assert e.value.reason == reasons.REGISTRY_REFUSED and not e.value.transient
    assert e.value.registry == registry.host


async def test_a_wrong_password_is_refused(registry: RegistryServer) -> None:
    repo = registry.unique_repo()
    registry.push(repo, "1", note_image("private"))
    with pytest.raises(RegistryCredentialsRefused) as e:
        await resolve(parse_image(f"{registry.host}/{repo}:1"), (registry.user, "not-" + registry.password), timeout=30)
    assert e.value.words == "authentication required"
    assert registry.password not in str(e.value)


async def test_an_unknown_repository_or_tag_is_not_found(registry: RegistryServer) -> None:
    repo = registry.unique_repo()
    registry.push(repo, "1", note_image("exists"))
    for missing in (f"{repo}:2", f"{registry.unique_repo()}:1"):
        with pytest.raises(ImageNotFound) as e:
            await resolve(parse_image(f"{registry.host}/{missing}"), registry.credentials, timeout=30)
        assert e.value.reason == reasons.IMAGE_NOT_FOUND and not e.value.transient
        assert e.value.words == "manifest unknown"  # the registry's own words, as it sent them


async def test_a_registry_that_stopped_is_unreachable_and_transient(
    registry_factory: Callable[..., RegistryServer],
) -> None:
    spare = registry_factory()
    repo = spare.unique_repo()
    pushed = spare.push(repo, "1", note_image("soon gone"))
    ref = parse_image(f"{spare.host}/{repo}:1")
    assert await resolve(ref, spare.credentials, timeout=30) == pushed
    spare.stop()
    with pytest.raises(RegistryUnreachable) as e:
        await resolve(ref, spare.credentials, timeout=30)
    assert e.value.reason == reasons.REGISTRY_UNREACHABLE and e.value.transient
    assert spare.host in e.value.words


async def test_a_registry_that_never_answers_is_unreachable_within_the_timeout() -> None:
    # A socket that listens but never accepts: the kernel completes the connection, nobody replies.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        host = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(RegistryUnreachable) as e:
            await resolve(parse_image(f"{host}/team/app:1"), None, timeout=0.5)
    assert "0.5s" in e.value.words or "timed out" in e.value.words.lower()


async def test_a_registry_without_auth_needs_no_credentials(registry_factory: Callable[..., RegistryServer]) -> None:
    open_registry = registry_factory(auth=None)
    repo = open_registry.unique_repo()
    pushed = open_registry.push(repo, "latest", note_image("public"))
    assert await resolve(parse_image(f"{open_registry.host}/{repo}"), None, timeout=30) == pushed


async def test_a_reference_with_a_digest_is_not_asked_about() -> None:
    digest = "sha256:" + "ab" * 32
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens here: asking would raise RegistryUnreachable
    assert await resolve(parse_image(f"{nobody}/team/app:1.4@{digest}"), None, timeout=5) == digest


async def test_a_registry_with_bearer_tokens_is_resolved_through_its_token_service(
    registry_factory: Callable[..., RegistryServer],
) -> None:
    # The flow Docker Hub, GHCR and Harbor use: a 401 naming a token realm, a token fetched there
    # with the credentials, the request again with the token. The registry checks the token's signature.
    bearer = registry_factory(auth="token")
    repo = bearer.unique_repo()
    old = bearer.push(repo, "1", note_image("bearer one"))
    ref = parse_image(f"{bearer.host}/{repo}:1")
    assert await resolve(ref, bearer.credentials, timeout=30) == old
    new = bearer.push(repo, "1", note_image("bearer two"))
    assert await resolve(ref, bearer.credentials, timeout=30) == new != old
    # no credentials: an anonymous token that grants nothing, and the registry's refusal
    with pytest.raises(RegistryCredentialsRefused) as e:
        await resolve(ref, None, timeout=30)
    assert e.value.words == "authentication required"
    # wrong credentials: the token service's own refusal
    with pytest.raises(RegistryCredentialsRefused) as e:
        await resolve(ref, (bearer.user, "not-" + bearer.password), timeout=30)
    assert e.value.words == "incorrect username or password"
    with pytest.raises(ImageNotFound):
        await resolve(parse_image(f"{bearer.host}/{repo}:2"), bearer.credentials, timeout=30)


async def test_the_busybox_test_image_round_trips_through_the_registry(registry: RegistryServer) -> None:
    # The image the container tests run: what the registry gives back is a root an engine can start.
    image = busybox_image("round trip")
    repo = registry.unique_repo()
    digest = registry.push(repo, "test", image)
    assert await resolve(parse_image(f"{registry.host}/{repo}:test"), registry.credentials, timeout=30) == digest
    with httpx.Client(base_url=f"http://{registry.host}", auth=registry.credentials, trust_env=False) as c:
        manifest = c.get(f"/v2/{repo}/manifests/{digest}", headers={"Accept": MANIFEST_V2}).json()
        layer = c.get(f"/v2/{repo}/blobs/{manifest['layers'][0]['digest']}", follow_redirects=True).content
    with tarfile.open(fileobj=io.BytesIO(layer), mode="r:gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["bin/busybox"].isfile() and members["bin/busybox"].mode & 0o111
    for applet in ("sh", "echo", "sleep", "cat", "true"):
        assert members[f"bin/{applet}"].issym() and members[f"bin/{applet}"].linkname == "busybox"
    assert busybox_image("another").digest != image.digest  # a note is enough to make another image


async def test_a_registry_on_loopback_is_never_asked_through_a_proxy(
    registry: RegistryServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As Docker does: an operator's proxy settings are for the outside world, not for 127.0.0.1.
    dead = f"http://127.0.0.1:{free_port()}"
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(var, dead)
    repo = registry.unique_repo()
    pushed = registry.push(repo, "1", note_image("no proxy"))
    assert await resolve(parse_image(f"{registry.host}/{repo}:1"), registry.credentials, timeout=30) == pushed
