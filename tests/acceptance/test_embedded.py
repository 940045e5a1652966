"""The embedded default: no database URL, PostgreSQL starts in the data directory and stops on exit."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.harness import Agent, Api, Server, cli, wait_for


def test_server_on_the_embedded_default_runs_work_and_stops_its_database(tmp_path: Path) -> None:
    data = tmp_path / "data"
    srv = Server(tmp_path, None, data_dir=data).start()
    agent = Agent(tmp_path, [srv.grpc], "local").start()
    try:
        r = cli(srv.api, "run", "--", "sh", "-c", "echo embedded")
        assert r.returncode == 0 and r.stdout == "embedded\n", r.stderr
        assert (data / "pg" / "PG_VERSION").read_text().strip() == "18"
        srv.signal(signal.SIGTERM)
        srv.p.wait(30)  # type: ignore[union-attr]
        # a clean stop stops PostgreSQL too
        wait_for(lambda: not (data / "pg" / "postmaster.pid").exists(), 30, what="the embedded PostgreSQL to stop")
        # and the next start finds everything where it was
        srv2 = Server(tmp_path, None, data_dir=data, port=srv.port, grpc_port=srv.grpc_port).start()
        try:
            api = Api(srv2.api)
            assert api.http.get("/v1/tasks").json()[0]["state"] == "succeeded"
            api.close()
        finally:
            srv2.stop()
    finally:
        agent.stop()
        srv.stop()
