from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # registered here rather than in pyproject.toml: select with `-m nemesis`, skip with `-m "not nemesis"`
    config.addinivalue_line("markers", "nemesis: a short nemesis campaign on a fleet in network namespaces (needs root)")
