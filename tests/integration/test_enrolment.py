"""Enrolment by join token, against real PostgreSQL: a join token never takes an enrolled node over,
except for the one agent instance that enrolled it and never got the Welcome carrying its credential
(the stream broke after the enrolment committed) — without that, a database blip during a node's
first Hello locked it out for good."""

from __future__ import annotations

import os

import pytest

from podium.errors import Unauthorized
from podium.security.secretbox import SecretBox
from podium.security.service import Security
from podium.security.tokens import Role
from podium.store import Store


async def _join_token(sec: Security) -> str:
    _row, token = await sec.create_token("join", Role.JOIN, by="test")
    return token


async def test_the_instance_that_enrolled_a_node_may_enrol_it_again_until_it_uses_its_credential(store: Store) -> None:
    sec = Security(store, SecretBox(os.urandom(32)))
    join = await _join_token(sec)
    first = await sec.admit_node("n1", join, "instance-a")
    assert first is not None  # enrolled: the credential travels in the Welcome
    # ... which never arrived: the same instance comes back with the join token and is enrolled again
    second = await sec.admit_node("n1", join, "instance-a")
    assert second is not None and second != first
    # the first credential no longer opens the node: only the one last issued does
    with pytest.raises(Unauthorized, match="credential does not match"):
        await sec.admit_node("n1", first, "instance-a")
    # another instance (another agent, or an impostor holding the join token) cannot take it over
    for other in ("instance-b", ""):
        with pytest.raises(Unauthorized, match="cannot take over an enrolled node"):
            await sec.admit_node("n1", join, other)
    # once the node has presented its credential it has it: nothing may enrol it again
    assert await sec.admit_node("n1", second, "instance-a") is None
    with pytest.raises(Unauthorized, match="cannot take over an enrolled node"):
        await sec.admit_node("n1", join, "instance-a")
    assert await sec.admit_node("n1", second, "instance-c") is None  # a restarted agent with its credential


async def test_a_node_enrolled_without_an_instance_cannot_be_enrolled_again(store: Store) -> None:
    sec = Security(store, SecretBox(os.urandom(32)))
    join = await _join_token(sec)
    cred = await sec.admit_node("n2", join)  # an agent that sends no instance id
    assert cred is not None
    with pytest.raises(Unauthorized, match="cannot take over an enrolled node"):
        await sec.admit_node("n2", join)
    assert await sec.admit_node("n2", cred) is None
