"""Log followers are woken by the store, not by a timer: with the backstop re-read set far beyond the
test's patience (PODIUM_TEST_LOG_BACKSTOP), output and the end still arrive promptly — on the SSE
follow and the NDJSON `?follow=1`, on the replica whose gateway stored the chunks and on another one
(NOTIFY is database-wide)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.acceptance.conftest import Cluster
from tests.harness import ADMIN_TOKENS, wait_for

pytestmark = pytest.mark.slow

# far longer than any wait below: output arriving in time arrived because a NOTIFY woke its follower
NO_BACKSTOP = {"PODIUM_TEST_LOG_BACKSTOP": "3600"}
PROMPT = 30.0  # seconds: generous for a busy machine, and nothing like the backstop


class Follower:
    """One follow request read on a thread of its own: the chunks' text and the end, as they come."""

    def __init__(self, base: str, path: str, ndjson: bool) -> None:
        self.base, self.path, self.ndjson = base, path, ndjson
        self.text = ""
        self.end: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {ADMIN_TOKENS[self.base]}"}
        try:
            with httpx.Client(timeout=httpx.Timeout(10, read=600)) as c, c.stream("GET", self.base + self.path, headers=headers) as r:
                assert r.status_code == 200, r.read()
                event = ""
                for line in r.iter_lines():
                    if self.ndjson and line:
                        obj = json.loads(line)
                        if "chunk" in obj:
                            self.text += obj["chunk"]["data"]
                        else:
                            self.end = obj["end"]
                            return
                    elif line.startswith("event: "):
                        event = line.removeprefix("event: ")
                    elif line.startswith("data: ") and event == "chunk":
                        self.text += json.loads(line.removeprefix("data: "))["data"]
                    elif line.startswith("data: ") and event == "end":
                        self.end = json.loads(line.removeprefix("data: "))
                        return
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            self.error = e

    def has(self, text: str) -> bool:
        if self.error is not None:
            raise self.error
        return text in self.text

    def ended(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.end is not None


def test_followers_on_every_replica_are_woken_by_each_chunk_and_by_the_end(cluster: Cluster, tmp_path: Path) -> None:
    a = cluster.server(extra_env=NO_BACKSTOP)
    b = cluster.server(extra_env=NO_BACKSTOP)
    cluster.agent("n1", servers=[a])  # every chunk is stored by a's gateway
    api = cluster.api
    api.wait_node("n1", connected=True)
    more, done = tmp_path / "more", tmp_path / "done"
    script = (f"echo first; while [ ! -e {more} ]; do sleep 0.02; done; echo second; "
              f"while [ ! -e {done} ]; do sleep 0.02; done; exit 3")  # fmt: skip
    tid = api.submit(command=["sh", "-c", script])["id"]
    followers = {
        "sse on the storing replica": Follower(a.api, f"/v1/tasks/{tid}/logs/stream", ndjson=False),
        "sse on another replica": Follower(b.api, f"/v1/tasks/{tid}/logs/stream", ndjson=False),
        "ndjson on another replica": Follower(b.api, f"/v1/tasks/{tid}/logs?follow=1", ndjson=True),
    }
    for name, f in followers.items():
        wait_for(lambda f=f: f.has("first\n"), PROMPT, what=f"'first' at the {name} follower")
    # every follower has read, found nothing more and waits: the next output reaches it only if the
    # chunk's NOTIFY wakes it (the task stays running, so no event of the task does)
    more.touch()
    for name, f in followers.items():
        wait_for(lambda f=f: f.has("second\n"), PROMPT, what=f"'second' at the {name} follower, woken by its chunk")
    assert api.task(tid)["state"] == "running"
    # the end comes with the task's terminal event, no new output: that event wakes them
    done.touch()
    for name, f in followers.items():
        wait_for(f.ended, PROMPT, what=f"the end at the {name} follower, woken by the task's event")
        assert f.end is not None
        assert (f.end["state"], f.end["exit_code"]) == ("failed", 3), f.end
        assert f.text == "first\nsecond\n", (name, f.text)
