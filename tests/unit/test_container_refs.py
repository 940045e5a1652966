"""Which credentials a pull carries: only the image's own registry's (issue 13), and how a pinned
reference is split for the Docker API's pull call."""

from __future__ import annotations

from podium.agent.backends import RegistryAuth
from podium.agent.backends.container import _split_for_pull, pull_auth

AUTH = RegistryAuth("registry.example.com:5000", "ci", "hunter2")
DIGEST = "sha256:" + "ab" * 32


def test_credentials_go_only_to_their_own_registry() -> None:
    assert pull_auth(f"registry.example.com:5000/team/app@{DIGEST}", AUTH) == {
        "username": "ci", "password": "hunter2", "serveraddress": "registry.example.com:5000"
    }  # fmt: skip
    assert pull_auth("REGISTRY.example.com:5000/team/app:1.4", AUTH) is not None
    # another port, another host, Docker Hub, a look-alike path: none of them get the password
    assert pull_auth("registry.example.com:5001/team/app:1.4", AUTH) is None
    assert pull_auth("evil.example.com/registry.example.com:5000/app:1", AUTH) is None
    assert pull_auth("team/app:1.4", AUTH) is None
    assert pull_auth("localhost/busybox:test", None) is None


def test_the_password_is_not_in_the_repr() -> None:
    assert "hunter2" not in repr(AUTH)


def test_pinned_references_are_pulled_by_digest() -> None:
    assert _split_for_pull(f"registry.example.com:5000/team/app@{DIGEST}") == ("registry.example.com:5000/team/app", DIGEST)
    assert _split_for_pull(f"registry.example.com:5000/team/app:1.4@{DIGEST}") == ("registry.example.com:5000/team/app", DIGEST)
    assert _split_for_pull("registry.example.com:5000/team/app:1.4") == ("registry.example.com:5000/team/app", "1.4")
    assert _split_for_pull("localhost/busybox") == ("localhost/busybox", None)
