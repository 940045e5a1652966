"""The web UI in a real browser against a real server and agent: sign in, live updates, logs,
cancel, drain, roles, CSRF, escaping. Screenshots of each page go to docs/ui/."""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from podium import reasons
from tests.harness import cli, wait_for
from tests.ui.conftest import Cluster

pytestmark = pytest.mark.slow

# PODIUM_UI_SCREENSHOTS=1 refreshes the screenshots in docs/ui/; otherwise they go to a temporary
# directory (still taken: a page that cannot render fails here), so a test run leaves the tree alone.
SHOTS = Path(__file__).resolve().parents[2] / "docs" / "ui"


def shot(page: Any, name: str) -> None:
    where = SHOTS if os.environ.get("PODIUM_UI_SCREENSHOTS") == "1" else Path(tempfile.gettempdir()) / "podium-ui-shots"
    where.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(where / f"{name}.png"))


def sign_in(page: Any, base: str, token: str) -> None:
    page.goto(f"{base}/")
    assert "/signin" in page.url
    page.fill("#token", token)
    page.press("#token", "Enter")  # keyboard-usable: no mouse needed
    page.wait_for_url(f"{base}/")


def submit_cli(base: str, tmp: Path, spec: dict[str, Any]) -> str:
    f = tmp / f"spec-{time.monotonic_ns()}.json"
    f.write_text(json.dumps(spec))
    r = cli(base, "submit", str(f), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    return out["task"]["id"] if "task" in out else out["id"]


def test_operator_sees_live_tasks_logs_cancel_drain_and_escaped_output(cluster: Cluster, page: Any, tmp_path: Path) -> None:
    server = cluster.server()
    cluster.agent("n1")
    api = cluster.api
    api.wait_node("n1", connected=True)
    base = server.api
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))

    page.goto(f"{base}/signin")
    shot(page, "signin")
    sign_in(page, base, server.admin_token)

    # a task submitted through the CLI appears without reloading
    tid = submit_cli(base, tmp_path, {"name": "ticker", "command": ["sh", "-c", "echo tick-one; sleep 60"]})
    page.wait_for_selector(f"#task-{tid}")
    row = page.locator(f"#task-{tid}")
    wait_for(lambda: "running" in row.inner_text(), 30, what="the row to show running")

    # its logs stream
    page.click(f"#task-{tid} a")
    page.wait_for_url(f"{base}/tasks/{tid}")
    page.wait_for_selector("#log >> text=tick-one")
    shot(page, "task")

    # cancel it from the page and see it end cancelled with its reason
    page.click("#cancel-form button")
    page.wait_for_url(f"{base}/tasks/{tid}")
    wait_for(lambda: page.inner_text("#task-state") == "cancelled", 30, what="the page to show cancelled")
    assert page.inner_text("#task-reason") == reasons.CANCELLED
    assert api.task(tid)["state"] == "cancelled"
    page.wait_for_selector("#log-end >> text=cancelled")

    # a task printing a script tag shows it literally, and no dialog fires
    xss = submit_cli(base, tmp_path, {"name": "shouty", "command": ["sh", "-c", "echo '<script>alert(1)</script>'"]})
    api.wait_state(xss, "succeeded")
    page.goto(f"{base}/tasks/{xss}")
    page.wait_for_selector("#log >> text=<script>alert(1)</script>")
    assert page.locator("#log script").count() == 0
    assert "echo '<script>alert(1)</script>'" in page.inner_text("pre.spec")  # the spec too
    assert dialogs == []

    # drain the node from the nodes page; a new task waits with the draining sentence
    page.goto(f"{base}/nodes")
    shot(page, "nodes")
    page.click("text=Drain")
    page.wait_for_selector("text=Undrain")
    assert api.wait_node("n1", draining=True)
    queued = submit_cli(base, tmp_path, {"name": "waits", "command": ["true"]})
    wait_for(lambda: api.task(queued)["reason"] == reasons.ALL_DRAINING, 30, what="the draining reason")
    page.goto(f"{base}/tasks/{queued}")
    assert page.inner_text("#task-reason") == reasons.ALL_DRAINING
    assert page.locator("table.explain").count() == 1  # the "why not node X" table
    shot(page, "task-queued-explain")
    page.goto(f"{base}/?state=queued")
    assert reasons.ALL_DRAINING in page.inner_text(f"#task-{queued}")
    page.goto(f"{base}/")
    shot(page, "tasks")

    # node changes arrive live too: undrained elsewhere, the open nodes page says so without a reload
    page.goto(f"{base}/nodes")
    node_id = api.wait_node("n1")["id"]
    assert api.http.post(f"/v1/nodes/{node_id}/undrain").status_code == 200
    page.wait_for_selector(f"[id='node-status-{node_id}'] >> text=taking work")
    api.wait_state(queued, "succeeded")  # and the waiting task runs

    # named specs: store a revision from the page
    assert api.http.put("/v1/specs/nightly", json={"command": ["echo", "one"]}).status_code == 201
    page.goto(f"{base}/specs")
    shot(page, "specs")
    page.click("text=nightly")
    page.fill("#spec", json.dumps({"command": ["echo", "two"]}))
    page.click("text=Store revision")
    page.wait_for_selector("text=stored revision 2")
    assert api.http.get("/v1/specs/nightly").json()["spec"]["command"] == ["echo", "two"]
    shot(page, "spec")
    page.goto(f"{base}/admin")
    assert "bootstrap-admin" in page.inner_text("main")
    shot(page, "admin")
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{base}/")
    shot(page, "tasks-phone")


def test_viewer_has_no_buttons_and_a_forged_post_is_refused(cluster: Cluster, page: Any) -> None:
    server = cluster.server()
    cluster.agent("n1")
    api = cluster.api
    node = api.wait_node("n1", connected=True)
    base = server.api
    r = api.http.post("/v1/tokens", json={"name": "watcher", "role": "viewer"})
    assert r.status_code == 201, r.text
    viewer = r.json()["token"]
    tid = api.submit(command=["sleep", "60"])["id"]
    api.wait_state(tid, "running")

    sign_in(page, base, viewer)
    for path in ("/", f"/tasks/{tid}", "/nodes"):
        page.goto(base + path)
        assert page.locator("main form[method=post]").count() == 0, path  # no action at all (sign-out is in the header)
        assert page.locator("main button", has_text=re.compile("Cancel|Drain|Undrain|Set labels")).count() == 0, path
    page.goto(f"{base}/admin")
    assert "admin role" in page.inner_text("main")
    page.goto(f"{base}/")
    page.click("header button")  # sign out: the session ends, the pages ask for a token again
    page.wait_for_url(re.compile(r".*/signin.*"))
    page.goto(f"{base}/nodes")
    assert "/signin" in page.url

    # an operator's session forged into posting without the CSRF token changes nothing
    r = api.http.post("/v1/tokens", json={"name": "op", "role": "operator"})
    operator = r.json()["token"]
    with httpx.Client(base_url=base, follow_redirects=False) as c:
        pre = c.get("/signin")
        csrf = re.search(r'name="csrf" value="([^"]+)"', pre.text).group(1)
        assert c.post("/signin", data={"token": operator, "csrf": csrf}).status_code == 303
        assert c.post(f"/nodes/{node['id']}/drain", data={}).status_code == 403
        assert c.post(f"/tasks/{tid}/cancel", data={"csrf": "forged"}).status_code == 403
        # and a sign-in without its own CSRF token is refused too
        assert httpx.post(f"{base}/signin", data={"token": operator}).status_code == 403
    assert api.task(tid)["state"] == "running"
    assert not [n for n in api.nodes() if n["draining"]]
    # the event stream takes a signed-in browser's session cookie instead of a bearer token
    with httpx.Client(base_url=base, follow_redirects=False) as c:
        pre = c.get("/signin")
        csrf = re.search(r'name="csrf" value="([^"]+)"', pre.text).group(1)
        assert c.post("/signin", data={"token": viewer, "csrf": csrf}).status_code == 303
        with c.stream("GET", "/v1/events", params={"after": "0", "task": tid}) as r:
            assert r.status_code == 200
            assert any(line.startswith("event: task") for line in r.iter_lines())
        c.cookies.set("podium_session", "forged")
        assert c.get("/v1/events").status_code == 401
    # the viewer's own session may not post either, even with its CSRF token
    with httpx.Client(base_url=base, follow_redirects=False) as c:
        pre = c.get("/signin")
        csrf = re.search(r'name="csrf" value="([^"]+)"', pre.text).group(1)
        c.post("/signin", data={"token": viewer, "csrf": csrf})
        tasks_page = c.get("/")
        session_csrf = re.search(r'name="csrf" value="([^"]+)"', tasks_page.text).group(1)
        assert c.post(f"/nodes/{node['id']}/drain", data={"csrf": session_csrf}).status_code == 403
    assert not [n for n in api.nodes() if n["draining"]]


_REF = re.compile(r'(?:src|href)\s*=\s*["\']([^"\']*)["\']', re.IGNORECASE)


def test_no_page_references_another_host(cluster: Cluster, browser: Any) -> None:
    server = cluster.server()
    api = cluster.api
    base = server.api
    tid = api.submit(command=["true"])["id"]
    assert api.http.put("/v1/specs/s1", json={"command": ["true"]}).status_code == 201
    with httpx.Client(base_url=base, follow_redirects=False) as c:
        pre = c.get("/signin")
        csrf = re.search(r'name="csrf" value="([^"]+)"', pre.text).group(1)
        assert c.post("/signin", data={"token": server.admin_token, "csrf": csrf}).status_code == 303
        pages = ["/signin", "/", f"/tasks/{tid}", "/nodes", "/specs", "/specs/s1", "/admin", "/docs"]
        seen = 0
        for path in pages:
            r = c.get(path)
            assert r.status_code == 200, (path, r.status_code)
            assert "script-src 'self'" in r.headers["content-security-policy"], path
            for ref in _REF.findall(r.text):
                seen += 1
                assert not re.match(r"^([a-z]+:)?//", ref, re.IGNORECASE), f"{path} references {ref}"
                assert c.get(ref).status_code == 200 if ref.startswith("/ui/static/") else True, ref
        assert seen > 10
        assert c.get("/redoc").status_code in (303, 404)  # not served: it would load from a CDN
    # and in the browser, /docs renders from the vendored Swagger UI alone
    ctx = browser.new_context()
    pg = ctx.new_page()
    hosts: set[str] = set()
    pg.on("request", lambda req: hosts.add(re.sub(r"^[a-z]+://([^/]+).*$", r"\1", req.url)))
    pg.goto(f"{base}/docs")
    pg.wait_for_selector("[data-path='/v1/events']")
    assert hosts == {base.split("://", 1)[1]}, hosts
    ctx.close()
