"""The CLI's view of the REST API: the rows it prints, as dicts, over the connection the Python client
(`podium.client`) makes — the same discovery of the server, the token and the CA. Errors become
`CliError` with one line."""

from __future__ import annotations

import base64
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import ssl

import httpx

from podium.cli.base import CliError
from podium.client import connection, token_file

__all__ = ["CliError", "Client", "Listing", "token_file"]
FOLLOW_RECONNECT_SECONDS = 120.0
OVERLOAD_PATIENCE = 120.0  # seconds the CLI keeps re-sending a request an overloaded server refused
PAGE = 1000  # rows per request when the CLI pages through a listing (the API's largest page)


def _q(ref: str) -> str:
    """A user's id, prefix or name as one path segment: whatever they typed stays one argument."""
    return quote(ref, safe="")


@dataclass
class Listing:
    """Rows of a paged listing, and how many follow them: an exact number, or REMAINING_CAP+ as text."""

    rows: list[dict[str, Any]]
    remaining: str = "0"


class Client:
    def __init__(self, addr: str | None = None, timeout: float = 30.0) -> None:
        self.http = connection(addr, timeout=timeout)
        self.addr = str(self.http.base_url).rstrip("/")

    def _request(self, method: str, path: str, **kw: Any) -> Any:
        return self._answer(self._response(method, path, **kw))

    def _response(self, method: str, path: str, **kw: Any) -> httpx.Response:
        # An overloaded server refuses submissions with 429 and stores nothing: wait as it asks and
        # send again, for up to OVERLOAD_PATIENCE seconds, telling the user once.
        give_up = time.monotonic() + OVERLOAD_PATIENCE
        told = False
        while True:
            r = self._send(method, path, **kw)
            if r.status_code != 429 or time.monotonic() >= give_up:
                break
            if not told:
                sys.stderr.write("the server is overloaded; waiting to submit again...\n")
                told = True
            time.sleep(min(10.0, max(0.1, _retry_after(r))))
        return r

    def listing(self, path: str, limit: int | None, **params: Any) -> Listing:
        """Up to `limit` rows (all with None) of a paged listing, following its `Link: rel="next"`
        pages; the last request asks how many rows remain after it."""
        rows: list[dict[str, Any]] = []
        url: str = path
        query: dict[str, Any] = {k: v for k, v in params.items() if v is not None}
        while True:
            want = PAGE if limit is None else min(PAGE, limit - len(rows))
            last = limit is not None and want == limit - len(rows)
            r = self._response("GET", url, params={**query, "limit": want, **({"count": "true"} if last else {})})
            page = self._answer(r)
            rows.extend(page)
            nxt = r.links.get("next", {}).get("url")
            if nxt is None:
                return Listing(rows)
            if last:
                return Listing(rows, r.headers.get("Podium-Remaining", "1"))
            # the next page's URL carries the filters and the cursor (httpx's `params` would replace
            # its query, not add to it: so the query is taken apart here)
            link = httpx.URL(nxt)
            url, query = link.path, dict(link.params)

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return self.http.request(method, path, **kw)
        except httpx.ConnectError:
            raise CliError(
                f"cannot reach the Podium server at {self.addr}; is it running? "
                "(`podium dev` starts one; --server or PODIUM_ADDR point elsewhere)"
            ) from None
        except httpx.TimeoutException:
            raise CliError(f"the Podium server at {self.addr} did not answer in time") from None
        except httpx.HTTPError as e:
            raise CliError(f"talking to {self.addr} failed: {e}") from None
        except ssl.SSLError as e:
            raise CliError(f"TLS with {self.addr} failed: {e} (PODIUM_CA_FILE names the CA to trust)") from None

    @staticmethod
    def _answer(r: httpx.Response) -> Any:
        if r.status_code >= 400:
            try:
                msg = r.json().get("error") or r.text
            except (json.JSONDecodeError, AttributeError):
                msg = r.text or r.reason_phrase
            if r.status_code == 401:
                msg += " (set PODIUM_TOKEN to an operator token)"
            raise CliError(f"{msg}")
        if r.status_code == 204:
            return None
        return r.json()

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/v1/tasks", json=body)

    def check(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/v1/tasks/check", json=body)

    def tasks(self, limit: int | None = 100, **params: Any) -> Listing:
        return self.listing("/v1/tasks", limit, **params)

    def task(self, task_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/tasks/{_q(task_id)}")

    def cancel(self, task_id: str, if_revision: int | None = None) -> dict[str, Any]:
        headers = {"If-Match": f'"{if_revision}"'} if if_revision is not None else None
        return self._request("POST", f"/v1/tasks/{_q(task_id)}/cancel", headers=headers)

    def logs(self, task_id: str, after: int = 0) -> dict[str, Any]:
        return self._request("GET", f"/v1/tasks/{_q(task_id)}/logs", params={"after": after})

    def output(self, task_id: str) -> Iterator[dict[str, Any]]:
        """Every chunk of a task's output in the order it was written, each with its bytes as "raw"."""
        seen = _Seen()
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"encoding": "base64", **({"cursor": cursor} if cursor else {})}
            page = self._request("GET", f"/v1/tasks/{_q(task_id)}/logs", params=params)
            if not page["chunks"]:
                return
            for c in page["chunks"]:
                if seen.admit(c):
                    yield c
            cursor = page["next_cursor"]

    def follow(self, task_id: str, cursor: str | None = None) -> Iterator[dict[str, Any]]:
        """NDJSON lines of a task's output until it ends, each chunk with its bytes as "raw";
        reconnecting if the stream breaks, from just after the last chunk received."""
        import time

        seen = _Seen()
        gave_up_at: float | None = None
        while True:
            params = {"follow": "true", "encoding": "base64", **({"cursor": cursor} if cursor else {})}
            try:
                with self.http.stream("GET", f"/v1/tasks/{_q(task_id)}/logs", params=params, timeout=None) as r:
                    if r.status_code >= 400:
                        r.read()
                        try:
                            raise CliError(r.json().get("error") or r.text)
                        except json.JSONDecodeError:
                            raise CliError(r.text) from None
                    gave_up_at = None
                    for line in r.iter_lines():
                        if not line:
                            continue
                        item = json.loads(line)
                        if "chunk" in item:
                            cursor = item["chunk"]["cursor"]
                            if not seen.admit(item["chunk"]):
                                continue
                        yield item
                        if "end" in item:
                            return
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError):
                # the server restarted under us: wait for it (a while) and carry on from the last chunk
                now = time.monotonic()
                gave_up_at = gave_up_at or now + FOLLOW_RECONNECT_SECONDS
                if now > gave_up_at:
                    raise CliError(f"lost the Podium server at {self.addr} and it did not come back") from None
                time.sleep(0.5)

    def explain(self, task_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/tasks/{_q(task_id)}/explain")

    def set_labels(self, node: str, labels: dict[str, str]) -> dict[str, Any]:
        return self._request("PUT", f"/v1/nodes/{_q(node)}/labels", json={"labels": labels})

    def node(self, node: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/nodes/{_q(node)}")

    def put_spec(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self._request("PUT", f"/v1/specs/{name}", json=spec)

    def spec(self, name: str, revision: int | None = None) -> dict[str, Any]:
        return self._request("GET", f"/v1/specs/{name}", params={"revision": revision} if revision else None)

    def specs(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/specs")

    def submit_spec(self, name: str, revision: int | None, idempotency_key: str | None) -> dict[str, Any]:
        body = {k: v for k, v in {"revision": revision, "idempotency_key": idempotency_key}.items() if v is not None}
        return self._request("POST", f"/v1/specs/{name}/submit", json=body)

    def create_token(self, name: str, role: str) -> dict[str, Any]:
        return self._request("POST", "/v1/tokens", json={"name": name, "role": role})

    def tokens(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/tokens")

    def revoke_token(self, token_id: str) -> dict[str, Any]:
        return self._request("DELETE", f"/v1/tokens/{_q(token_id)}")

    def set_secret(self, name: str, value: str) -> dict[str, Any]:
        return self._request("PUT", f"/v1/secrets/{name}", json={"value": value})

    def secrets(self) -> list[dict[str, Any]]:
        return self._request("GET", "/v1/secrets")

    def delete_secret(self, name: str) -> None:
        self._request("DELETE", f"/v1/secrets/{name}")

    def registry_login(self, host: str, username: str, password: str) -> dict[str, Any]:
        return self._request("PUT", f"/v1/registries/{host}", json={"username": username, "password": password})

    def revoke_node(self, node: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/nodes/{_q(node)}/revoke")

    def audit(self, limit: int | None) -> Listing:
        return self.listing("/v1/audit", limit)

    def nodes(self, limit: int | None = None) -> Listing:
        return self.listing("/v1/nodes", limit)

    def node_events(self, node: str, after: int = 0) -> list[dict[str, Any]]:
        return self._request("GET", f"/v1/nodes/{node}/events", params={"after": after})

    def drain(self, node: str, draining: bool, deadline: str | None = None) -> dict[str, Any]:
        params = {"deadline": deadline} if draining and deadline is not None else None
        return self._request("POST", f"/v1/nodes/{_q(node)}/{'drain' if draining else 'undrain'}", params=params)


def _retry_after(r: httpx.Response) -> float:
    try:
        return float(r.headers.get("Retry-After", "1"))
    except ValueError:
        return 1.0


class _Seen:
    """Where a reader is in a task's output: the position (fencing token, seq, stream) of the last
    chunk it printed. Chunks come in that order, so one at or before it is one it already has (a
    guard for resuming after a lost stream). A chunk let through gets "raw" (its bytes) and "data"
    (them as text)."""

    def __init__(self) -> None:
        self.last: tuple[int, int, str] | None = None

    def admit(self, c: dict[str, Any]) -> bool:
        position = (c["fencing_token"], c["seq"], c["stream"])
        if self.last is not None and position <= self.last:
            return False
        self.last = position
        raw = base64.b64decode(c["data"])
        c["raw"], c["data"] = raw, raw.decode("utf-8", errors="replace")
        return True
