"""The store's own row types: what it returns to the scheduler's loops and the gateway, instead of
the driver's records (nothing above the store knows the driver).

Each is a frozen dataclass read by attribute. `Row` also lets a caller read one by column name
(`row["id"]`, `row.get("why")`), as the API's response models and the tests read rows.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

_R = TypeVar("_R", bound="Row")


class Row:
    __slots__ = ()

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def keys(self) -> tuple[str, ...]:
        return _names(type(self))

    @classmethod
    def of(cls: type[_R], record: Mapping[str, Any]) -> _R:
        """From a record of any query that returns some of the row's columns (the rest keep their
        defaults); columns the row does not have are left out."""
        names = _names(cls)
        # keys(), not the record itself: a driver record iterates over its values
        return cls(**{k: record[k] for k in record.keys() if k in names})  # noqa: SIM118


_NAMES: dict[type[Row], tuple[str, ...]] = {}


def _names(cls: type[Row]) -> tuple[str, ...]:
    names = _NAMES.get(cls)
    if names is None:
        assert dataclasses.is_dataclass(cls)
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


@dataclass(frozen=True, slots=True)
class TaskFactsRow(Row):
    """A task as a decision about it needs it: its state and current attempt, and what the policy
    reads (`podium.scheduler.apply.facts`). Queries that need less leave the rest at defaults."""

    id: uuid.UUID
    state: str
    fencing_token: int | None = None
    node_id: str | None = None
    attempts: int = 1
    max_attempts: int = 1
    requeue_on_node_loss: bool = True
    timeout_seconds: float | None = None
    cancel_reason: str | None = None
    why: str | None = None  # the watchdog's lost tasks: why the node can no longer be counted on


@dataclass(frozen=True, slots=True)
class OutboxRow(Row):
    """One thing a node is owed: an Assign (`kind` "assign": attempt, gpu indexes, spec as JSON text)
    or a stop (`kind` "stop", with its reason)."""

    kind: str
    node_id: str
    task_id: uuid.UUID
    fencing_token: int
    attempt: int | None = None
    gpu_indexes: list[int] | None = None
    spec: str | None = None
    reason: str | None = None
