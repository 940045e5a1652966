"""The agent's mapping from an Assign to a backend's terms: which registry login goes with a pull,
which limits a container gets, which classes a node reports."""

from __future__ import annotations

from podium.agent.agent import _REPORTED_CLASSES
from podium.agent.backends import FAILURE_CLASSES, RegistryAuth
from podium.agent.backends.container import _limits, _login_for
from podium.failures import NODE_REPORTED


def test_only_the_images_own_registry_login_goes_with_a_pull() -> None:
    mine = RegistryAuth("registry.example.com:5000", "u", "pw-9f3k")
    other = RegistryAuth("other.example.com", "u2", "p2")
    assert _login_for("registry.example.com:5000/team/app@sha256:" + "a" * 64, [other, mine]) is mine
    assert _login_for("other.example.com/app:1", [mine]) is None
    assert _login_for("busybox", [mine, other]) is None  # docker.io: no login was sent for it
    assert _login_for("Not An Image", [mine]) is None
    assert "pw-9f3k" not in repr(mine)  # never printed


def test_limits_come_from_the_spec_as_stored() -> None:
    assert _limits({"resources": {"cpu": "500m", "memory": 64 * 2**20}}) == (500, 64 * 2**20)
    assert _limits({"resources": {"cpu": "2", "memory": "1Gi"}}) == (2000, 2**30)
    assert _limits({"resources": {"cpu": "lots"}}) == (None, None)


def test_a_node_reports_only_the_classes_the_server_takes_from_a_node() -> None:
    assert {c.value for c in NODE_REPORTED} == _REPORTED_CLASSES and _REPORTED_CLASSES <= FAILURE_CLASSES
