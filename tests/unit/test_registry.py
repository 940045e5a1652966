"""The registry client's decisions that need no registry: where to connect, how to read a challenge,
which class a refusal belongs to. The exchange itself is tested against a real registry in
tests/integration/test_registry.py."""

from __future__ import annotations

import httpx
import pytest

from podium import reasons
from podium.registry import (
    ImageNotFound,
    RegistryCredentialsRefused,
    RegistryUnreachable,
    _error_for,
    _parse_challenges,
    base_url,
    is_loopback,
)


@pytest.mark.parametrize(
    "registry,insecure,url",
    [
        ("docker.io", False, "https://registry-1.docker.io"),
        ("ghcr.io", False, "https://ghcr.io"),
        ("registry.example.com:8443", False, "https://registry.example.com:8443"),
        ("registry.lan:5000", True, "http://registry.lan:5000"),
        ("localhost:5000", False, "http://localhost:5000"),
        ("localhost", False, "http://localhost"),
        ("127.0.0.1:5000", False, "http://127.0.0.1:5000"),
        ("127.8.9.1", False, "http://127.8.9.1"),
        ("[::1]:5000", False, "http://[::1]:5000"),
        # not loopback, however it looks: plain http only when the operator says so
        ("10.0.0.1:5000", False, "https://10.0.0.1:5000"),
        ("localhost.example.com", False, "https://localhost.example.com"),
        ("[2001:db8::1]:5000", False, "https://[2001:db8::1]:5000"),
    ],
)
def test_plain_http_only_on_loopback_or_when_marked_insecure(registry: str, insecure: bool, url: str) -> None:
    assert base_url(registry, insecure=insecure) == url
    if not insecure:
        assert is_loopback(registry) == url.startswith("http://")


def test_challenges_are_read_by_scheme() -> None:
    headers = [
        'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
        'scope="repository:library/ubuntu:pull"',
        'Basic realm="a \\"quoted\\" realm"',
    ]
    assert _parse_challenges(headers) == {
        "bearer": {
            "realm": "https://auth.docker.io/token",
            "service": "registry.docker.io",
            "scope": "repository:library/ubuntu:pull",
        },
        "basic": {"realm": 'a "quoted" realm'},
    }
    # two challenges in one header value, unquoted parameters
    assert _parse_challenges(["Basic realm=x, Bearer realm=https://t/token,service=s"]) == {
        "basic": {"realm": "x"},
        "bearer": {"realm": "https://t/token", "service": "s"},
    }
    assert _parse_challenges([]) == {}


def _response(status: int, body: object = None) -> httpx.Response:
    return httpx.Response(status, json=body) if body is not None else httpx.Response(status)


@pytest.mark.parametrize(
    "status,body,cls,words",
    [
        (401, {"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]}, RegistryCredentialsRefused,
         "authentication required"),
        (403, None, RegistryCredentialsRefused, "403 Forbidden"),
        (404, {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]}, ImageNotFound, "manifest unknown"),
        (404, None, ImageNotFound, "404 Not Found"),
        (400, {"errors": [{"code": "NAME_INVALID", "message": "invalid repository name"}]}, ImageNotFound, "invalid repository name"),
        (429, {"errors": [{"code": "TOOMANYREQUESTS", "message": "rate limit"}]}, RegistryUnreachable, "rate limit"),
        (500, None, RegistryUnreachable, "500 Internal Server Error"),
        (503, {"errors": [{"code": "UNAVAILABLE", "message": "a"}, {"code": "X", "message": "b"}]}, RegistryUnreachable, "a; b"),
        (502, "<html>bad gateway</html>", RegistryUnreachable, "502 Bad Gateway"),
    ],
)
def test_refusals_are_classified_with_the_registrys_words(status: int, body: object, cls: type, words: str) -> None:
    error = _error_for("reg.io", _response(status, body))
    assert type(error) is cls
    assert error.words == words
    assert error.reason in (reasons.REGISTRY_UNREACHABLE, reasons.IMAGE_NOT_FOUND, reasons.REGISTRY_REFUSED)
    assert error.transient == (cls is RegistryUnreachable)


async def test_credentials_are_never_sent_to_a_plain_http_token_service_off_loopback() -> None:
    from podium.images import parse_image
    from podium.registry import _Exchange

    async with httpx.AsyncClient() as client:
        exchange = _Exchange(client, parse_image("reg.example.com/team/app:1"), ("user", "secret"), insecure=False)
        with pytest.raises(RegistryCredentialsRefused) as e:
            # refused before any request is made: a broken check would try to connect and fail otherwise
            await exchange.fetch_token({"realm": "http://auth.example.com/token", "service": "reg"})
        assert "plain http" in e.value.words and "secret" not in str(e.value)
