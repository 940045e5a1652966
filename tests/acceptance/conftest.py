from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Agent, Api, Server


class Cluster:
    def __init__(self, tmp: Path, db_url: str | None) -> None:
        self.tmp = tmp
        self.db_url = db_url
        self.servers: list[Server] = []
        self.agents: list[Agent] = []
        self._api: Api | None = None

    def server(self, **kw: Any) -> Server:
        s = Server(self.tmp, self.db_url, **kw)
        self.servers.append(s)  # before starting: a server that fails to start is still stopped
        return s.start()

    def agent(self, name: str, servers: list[Server] | None = None, **kw: Any) -> Agent:
        a = Agent(self.tmp, [s.grpc for s in (servers or self.servers)], name, **kw)
        self.agents.append(a)
        a.start()
        return a

    @property
    def api(self) -> Api:
        base = self.servers[0].api
        if self._api is None or self._api.base != base:
            if self._api is not None:
                self._api.close()
            self._api = Api(base)
        return self._api

    def stop(self) -> None:
        if self._api is not None:
            self._api.close()
        for a in self.agents:
            a.stop()
        for s in self.servers:
            s.stop()

    def logs(self) -> str:
        return "\n".join(f"==== {p.log_path.name}\n{p.output()[-4000:]}" for p in [*self.servers, *self.agents])


@pytest.fixture
def cluster(tmp_path: Path, e2e_db_url: str, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(tmp_path, e2e_db_url)
    yield c
    c.stop()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(c.logs())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
