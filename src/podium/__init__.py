"""Podium: a control plane that runs work on a fleet of machines and tells the truth about it."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "__version__"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: the server and the agent import this package too, and need no client.
    if name in ("Client", "AsyncClient"):
        from podium import client

        return getattr(client, name)
    raise AttributeError(f"module 'podium' has no attribute {name!r}")
