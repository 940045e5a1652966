"""A real browser for the UI tests: Debian's chromium driven by Playwright (its own browser download
cannot work offline). Without the browser the tests skip saying why; under CI=true they fail."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.conftest import Cluster, cluster  # noqa: F401  (the fixture, reused)

CHROMIUM = os.environ.get("PODIUM_TEST_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-quic"]  # fmt: skip


def _missing() -> str | None:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        return f"no chromium at {CHROMIUM} (apt-get install chromium; scripts/test does)"
    return None


@pytest.fixture
def browser(cluster: Cluster) -> Iterator[Any]:  # noqa: F811
    # Function-scoped and after the cluster: Playwright's sync API keeps an event loop running in
    # this thread, and the database fixtures use asyncio.run, which refuses to run inside one.
    why = _missing()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1200, "height": 900})
    pg = ctx.new_page()
    pg.set_default_timeout(30_000)
    yield pg
    ctx.close()
