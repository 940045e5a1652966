"""An operator's token, checked once, is checked again without reading the store while its server
hears every revocation, and refused as soon as a revocation made on any server is heard. Real
PostgreSQL: two `Security` services on one database stand for two servers."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from podium.errors import Unauthorized
from podium.security import service
from podium.security.secretbox import SecretBox
from podium.security.service import Security
from podium.security.tokens import Role
from podium.store import Store
from tests.integration.helpers import WAIT, looping


class Counted(Store):
    """The store, counting the token reads `authenticate` makes (and able to hold one back)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store.pool, store.dsn)
        self.reads = 0
        self.before_answer: Any = None  # awaited after a read, before its answer

    async def get_token(self, token_id: str) -> Any:
        self.reads += 1
        row = await super().get_token(token_id)
        if self.before_answer is not None:
            await self.before_answer()
        return row


@contextlib.asynccontextmanager
async def listening(security: Security) -> AsyncIterator[None]:
    async with looping(security.watch_revocations()):
        await until(lambda: security._listening, "the LISTEN for revocations")
        yield


async def until(cond: Any, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def refused(security: Security, header: str) -> bool:
    try:
        await security.authenticate(header, Role.OPERATOR)
    except Unauthorized:
        return True
    return False


@pytest.fixture
def kept_long(monkeypatch: pytest.MonkeyPatch) -> None:
    # only a revocation heard can drop a kept token in these tests, never its age
    monkeypatch.setattr(service, "TOKEN_KEPT_SECONDS", 3600.0)


async def test_a_token_is_read_once_while_revocations_are_heard_and_refused_once_one_is(store: Store, kept_long: None) -> None:
    box = SecretBox(os.urandom(32))
    counted = Counted(store)
    here, there = Security(counted, box), Security(store, box)  # two servers on one database
    _row, token = await here.create_token("ci", Role.OPERATOR, by="test")
    header = f"Bearer {token}"
    async with listening(here):
        for _ in range(3):
            assert (await here.authenticate(header, Role.OPERATOR)).name == "ci"
        assert counted.reads == 1, "checked again without a round trip"
        # a wrong secret for the same id is refused, kept row or not
        bad = header[:-4] + ("aaaa" if not header.endswith("aaaa") else "bbbb")
        with pytest.raises(Unauthorized, match="not valid"):
            await here.authenticate(bad, Role.OPERATOR)
        await there.store.revoke_token(_row.id)  # on the other server
        await until(lambda: _row.id not in here._kept, "the revocation to be heard")
        with pytest.raises(Unauthorized, match="revoked"):
            await here.authenticate(header, Role.OPERATOR)


async def test_nothing_is_kept_by_a_server_that_does_not_hear_revocations(store: Store, kept_long: None) -> None:
    counted = Counted(store)
    security = Security(counted, SecretBox(os.urandom(32)))
    _row, token = await security.create_token("ci", Role.OPERATOR, by="test")
    for _ in range(3):
        await security.authenticate(f"Bearer {token}", Role.OPERATOR)
    assert counted.reads == 3


async def test_a_token_read_while_a_revocation_was_heard_is_not_kept(store: Store, kept_long: None) -> None:
    """The row read before the revocation committed, its notification heard before the read's answer
    came back: kept, it would let the revoked token in until it aged out."""
    box = SecretBox(os.urandom(32))
    counted = Counted(store)
    security = Security(counted, box)
    row, token = await security.create_token("ci", Role.OPERATOR, by="test")
    async with listening(security):

        async def revoked_meanwhile() -> None:
            counted.before_answer = None
            heard = security._heard
            await Security(store, box).store.revoke_token(row.id)
            await until(lambda: security._heard > heard, "the revocation to be heard")

        counted.before_answer = revoked_meanwhile
        # the answer is the row as read before the revocation: this one call passes, as it would have
        # had it come a moment sooner
        await security.authenticate(f"Bearer {token}", Role.OPERATOR)
        assert row.id not in security._kept
        assert await refused(security, f"Bearer {token}")


async def test_a_lost_listen_drops_every_kept_token_and_keeps_none_until_it_listens_again(store: Store, kept_long: None) -> None:
    counted = Counted(store)
    security = Security(counted, SecretBox(os.urandom(32)))
    _row, token = await security.create_token("ci", Role.OPERATOR, by="test")
    header = f"Bearer {token}"
    listens: list[Any] = []
    listen = store.listen

    async def noted(*a: Any, **kw: Any) -> Any:
        sub = await listen(*a, **kw)
        listens.append(sub)
        return sub

    counted.listen = noted  # type: ignore[method-assign]
    async with listening(security):
        await security.authenticate(header, Role.OPERATOR)
        assert _row.id in security._kept
        listens[0]._conn.terminate()  # the LISTEN's connection lost
        await until(lambda: len(listens) == 2 and security._listening, "a new LISTEN")
        assert security._kept == {}, "a revocation made while none listened was never heard"
        reads = counted.reads
        await security.authenticate(header, Role.OPERATOR)
        assert counted.reads == reads + 1
