"""Listings a user can page to the end, ids a user can type back (a unique prefix), and user text the
CLI prints as it is: real server, real agents, the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.acceptance.conftest import Cluster
from tests.harness import cli

TOTAL = 3000


def _submit_many(http: httpx.Client, n: int) -> set[str]:
    ids: set[str] = set()
    for start in range(0, n, 1000):
        batch = [{"command": ["true"], "name": f"t{i}"} for i in range(start, min(n, start + 1000))]
        r = http.post("/v1/tasks/batch", json={"tasks": batch})
        assert r.status_code == 200, r.text
        ids |= {x["task"]["id"] for x in r.json()}
    return ids


def test_paging_reaches_every_one_of_3000_tasks_by_the_api_and_the_cli(cluster: Cluster) -> None:
    srv = cluster.server()  # no agent: the tasks stay queued, so the listing cannot change under us
    http = cluster.api.http
    submitted = _submit_many(http, TOTAL)

    seen: list[dict] = []
    url: str | None = "/v1/tasks?limit=1000"
    pages = 0
    while url is not None:
        r = http.get(url)
        assert r.status_code == 200, r.text
        seen += r.json()
        pages += 1
        url = r.links.get("next", {}).get("url")
        assert pages <= 4, "the pages never end"
    ids = [t["id"] for t in seen]
    assert len(ids) == TOTAL and set(ids) == submitted
    keys = [(t["created_at"], t["id"]) for t in seen]
    assert keys == sorted(keys, reverse=True), "not newest first in one stable order"

    # filters carry over to the next page; count=true says how many follow the page
    r = http.get("/v1/tasks", params={"state": "queued", "limit": 1000, "count": "true"})
    assert r.headers["Podium-Remaining"] == str(TOTAL - 1000)
    assert "state=queued" in r.links["next"]["url"]
    assert len(http.get(r.links["next"]["url"]).json()) == 1000

    # a bad cursor or limit is a 4xx that names the parameter
    for params, named in (({"after": "not-a-cursor"}, "after"), ({"after": "WyJub2RlcyIsImEiLCJiIl0"}, "after"),
                          ({"limit": 0}, "limit"), ({"limit": 5000}, "limit")):  # fmt: skip
        r = http.get("/v1/tasks", params=params)
        assert r.status_code == 422, (params, r.text)
        assert named in r.json()["error"], r.text

    listed = cli(srv.api, "ls", "--all", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {t["id"] for t in json.loads(listed.stdout)} == submitted
    some = cli(srv.api, "ls", "--limit", "2500", "--json")
    assert some.returncode == 0, some.stderr
    assert len(json.loads(some.stdout)) == 2500
    assert "500 more" in some.stderr

    # the table shows short ids (a long reason may wrap a row onto more lines, so rows are counted by id)
    short = {t[:n] for t in submitted for n in range(8, 13)}

    def rows(out: str) -> list[str]:
        return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in short]

    table = cli(srv.api, "ls")
    assert table.returncode == 0, table.stderr
    assert len(rows(table.stdout)) == 50
    assert table.stdout.strip().splitlines()[-1] == "… 2,950 more; use --all or --limit N"
    everything = cli(srv.api, "ls", "--all")
    assert len(set(rows(everything.stdout))) == TOTAL and "more;" not in everything.stdout


def test_a_unique_prefix_is_taken_wherever_an_id_is(cluster: Cluster) -> None:
    srv = cluster.server()
    cluster.agent("alpha-1")
    cluster.agent("alpha-2")
    cluster.api.wait_node("alpha-1", connected=True)
    cluster.api.wait_node("alpha-2", connected=True)
    http = cluster.api.http
    # 17 ids: at least two share their first hex digit (there are only 16)
    tids = [cluster.api.submit(command=["echo", f"task {i}"])["id"] for i in range(17)]
    for tid in tids:
        cluster.api.wait_state(tid, "succeeded", 120)
    by_first: dict[str, list[str]] = {}
    for tid in tids:
        by_first.setdefault(tid[0], []).append(tid)
    shared, twins = next((c, ts) for c, ts in by_first.items() if len(ts) > 1)

    # ambiguous: 409 with the candidates, in the body and on the CLI's one line
    r = http.get(f"/v1/tasks/{shared}")
    assert r.status_code == 409, r.text
    assert set(twins) <= set(r.json()["candidates"])
    amb = cli(srv.api, "show", shared)
    assert amb.returncode != 0 and all(t in amb.stderr for t in twins) and "Traceback" not in amb.stderr

    # unique: every command that takes a task id takes the shortest unique start of it
    tid = twins[0]
    n = next(n for n in range(1, 37) if sum(t.startswith(tid[:n]) for t in tids) == 1)
    prefix = tid[:n]
    assert http.get(f"/v1/tasks/{prefix}").json()["id"] == tid
    shown = cli(srv.api, "show", "--json", prefix)
    assert shown.returncode == 0 and json.loads(shown.stdout)["id"] == tid, shown.stderr
    assert cli(srv.api, "logs", prefix).stdout == f"task {tids.index(tid)}\n"
    assert cli(srv.api, "explain", "--json", prefix).returncode == 0
    cancelled = cli(srv.api, "cancel", "--json", prefix)
    assert cancelled.returncode == 0 and json.loads(cancelled.stdout)["id"] == tid, cancelled.stderr

    # unknown: 404 naming it
    unknown = next(p for p in (f"{i:x}{j:x}{k:x}" for i in range(16) for j in range(16) for k in range(16))
                   if not any(t.startswith(p) for t in tids))  # fmt: skip
    r = http.get(f"/v1/tasks/{unknown}")
    assert r.status_code == 404 and unknown in r.json()["error"], r.text
    missing = cli(srv.api, "show", unknown)
    assert missing.returncode != 0 and unknown in missing.stderr and "Traceback" not in missing.stderr

    # nodes by the start of a name or an id; "alpha" is both nodes' start
    amb = cli(srv.api, "drain", "alpha")
    assert amb.returncode != 0 and "alpha-1" in amb.stderr and "alpha-2" in amb.stderr, amb.stderr
    assert http.post("/v1/nodes/alpha/drain").status_code == 409
    node_id = next(n["id"] for n in cluster.api.nodes() if n["name"] == "alpha-2")
    other = next(n["id"] for n in cluster.api.nodes() if n["name"] == "alpha-1")
    k = next(k for k in range(1, len(node_id) + 1) if not other.startswith(node_id[:k]))
    drained = cli(srv.api, "drain", node_id[:k])
    assert drained.returncode == 0 and "alpha-2" in drained.stdout, drained.stderr
    assert cluster.api.wait_node("alpha-2", draining=True)
    assert cli(srv.api, "undrain", "alpha-2").returncode == 0
    assert cli(srv.api, "label", "alpha-2", "zone=z1").returncode == 0
    assert next(n for n in cluster.api.nodes() if n["name"] == "alpha-2")["labels"] == {"zone": "z1"}

    # tokens by the start of their id
    made = [http.post("/v1/tokens", json={"name": f"tok{i}", "role": "viewer"}).json()["id"] for i in range(2)]
    # the shortest start of made[0] that no other token's id has (the bootstrap tokens' ids too)
    others = [t["id"] for t in http.get("/v1/tokens").json() if t["id"] != made[0]]
    j = next(j for j in range(1, 13) if not any(o.startswith(made[0][:j]) for o in others))
    revoked = cli(srv.api, "token", "revoke", made[0][:j])
    assert revoked.returncode == 0 and made[0] in revoked.stdout, revoked.stderr
    assert next(t for t in http.get("/v1/tokens").json() if t["id"] == made[0])["revoked_at"] is not None
    assert http.delete("/v1/tokens/zz").status_code == 404

    # a task's events and the audit log page like tasks do
    r = http.get(f"/v1/tasks/{prefix}/events", params={"limit": 2})
    assert r.status_code == 200 and len(r.json()) == 2 and "next" in r.links, r.text
    rest = http.get(r.links["next"]["url"]).json()
    full = http.get(f"/v1/tasks/{tid}").json()["events"]
    assert [e["to_state"] for e in r.json() + rest][: len(full)] == [e["to_state"] for e in full][: len(r.json() + rest)]
    assert http.get(f"/v1/tasks/{tid}/events", params={"after": "bogus"}).status_code == 422
    audit = cli(srv.api, "audit", "--limit", "1")
    assert audit.returncode == 0 and audit.stdout.strip().splitlines()[-1].endswith("more; use --all or --limit N")
    nodes = cli(srv.api, "nodes", "--limit", "1")
    assert nodes.stdout.strip().splitlines()[-1] == "… 1 more; use --all or --limit N", nodes.stdout


def test_user_text_is_printed_as_it_is_and_never_as_a_traceback(cluster: Cluster, tmp_path: Path) -> None:
    srv = cluster.server()
    # a node whose name looks like Rich markup
    cluster.agent("rack7", extra_args=["--name", "rack[/7]"])
    cluster.api.wait_node("rack[/7]", connected=True)

    for value in ("[/x]", "[x]"):
        r = cli(srv.api, "run", "--label", f"gpu={value}", "--", "true")
        assert r.returncode == 1, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"gpu='{value}'" in r.stderr, r.stderr  # the value as typed, not eaten as markup

    ran = cli(srv.api, "run", "--name", "brackets", "-e", "NOTE=[/x] [bold]b", "--", "sh", "-c", 'echo "[/y] $NOTE"')
    assert ran.returncode == 0 and ran.stdout == "[/y] [/x] [bold]b\n", ran.stderr
    for args in (["nodes"], ["ls"], ["show", json.loads(cli(srv.api, "ls", "--json").stdout)[0]["id"]]):
        r = cli(srv.api, *args)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr)
    assert "rack[/7]" in cli(srv.api, "nodes").stdout
    drained = cli(srv.api, "drain", "rack[")
    assert drained.returncode == 0 and "node rack[/7] (" in drained.stdout, drained.stderr
    explain = cli(srv.api, "explain", json.loads(cli(srv.api, "ls", "--json").stdout)[0]["id"])
    assert explain.returncode == 0 and "rack[/7]" in explain.stdout, explain.stderr

    broken = tmp_path / "broken.yaml"
    broken.write_text("command: [echo, hi]\nresources:\n  cpu: [1\n  memory: 1Gi\n")
    r = cli(srv.api, "submit", str(broken))
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "line 4, column" in r.stderr, r.stderr


def test_a_proxy_s_answers_are_one_line_and_a_traceback_only_when_asked_for() -> None:
    """What sits in front of a server may answer anything: an error page in brackets, or a 200 that
    is not JSON. The CLI says so in one line; PODIUM_DEBUG=1 shows the traceback for developers."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Proxy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            status, body = (502, b"bad gateway [/x] [bold]") if "/v1/nodes" in self.path else (200, b"<html>[/x]</html>")
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    addr = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        r = cli(addr, "nodes", token="pdm_x.y")
        assert r.returncode == 1 and r.stderr == "error: bad gateway [/x] [bold]\n", r.stderr
        r = cli(addr, "ls", token="pdm_x.y")
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
        assert "PODIUM_DEBUG=1" in r.stderr
        r = cli(addr, "ls", token="pdm_x.y", extra_env={"PODIUM_DEBUG": "1"})
        assert r.returncode != 0 and "Traceback" in r.stderr, r.stderr
    finally:
        httpd.shutdown()
        httpd.server_close()
