"""Failure classes: what kind of end an attempt had, in one word an operator (and a retry policy)
can group by. The seed's `DurableAssignment.FailureClass`.

The class sits beside the reason, never instead of it: the reason is the sentence
(`podium.reasons`), the class is the category, and the engine's or node's own words are stored
beside both (`attempts.failure_detail`). A successful attempt has no class.

This module must never format anything with task-specific values: a class is compared by equality.
"""

from __future__ import annotations

from enum import StrEnum


class FailureClass(StrEnum):
    EXIT = "exit"                  # the command ran and exited with a non-zero code
    TIMEOUT = "timeout"            # the spec's timeout stopped it
    CANCELLED = "cancelled"        # an operator's cancel stopped it
    NODE_LOST = "node_lost"        # its node went offline, was removed, or forgot it
    NOT_ACCEPTED = "not_accepted"  # its node did not accept the assignment in time
    PROVISIONING = "provisioning"  # the sandbox could not be prepared: pull, create, a missing secret
    OOM = "oom"                    # killed for running out of its memory limit
    INTERNAL = "internal"          # the node or server failed in a way that is nobody's input


EXIT = FailureClass.EXIT
TIMEOUT = FailureClass.TIMEOUT
CANCELLED = FailureClass.CANCELLED
NODE_LOST = FailureClass.NODE_LOST
NOT_ACCEPTED = FailureClass.NOT_ACCEPTED
PROVISIONING = FailureClass.PROVISIONING
OOM = FailureClass.OOM
INTERNAL = FailureClass.INTERNAL

#: The classes a node may report with an end (TaskEvent.failure_class). The others are the server's
#: to decide: a node does not get to call its own end a timeout, a cancel or a node loss.
NODE_REPORTED = frozenset({EXIT, OOM, PROVISIONING, INTERNAL})

#: The most a node's or engine's words about an end may take; the rest is cut (they are for humans).
DETAIL_LIMIT = 4096


def from_node(value: str) -> FailureClass | None:
    """The class a node reported, or None when it reported none. A class a node may not report, or
    one this server does not know (a newer agent), is read as INTERNAL: something went wrong there
    that the server cannot name better."""
    if not value:
        return None
    try:
        cls = FailureClass(value)
    except ValueError:
        return INTERNAL
    return cls if cls in NODE_REPORTED else INTERNAL


def detail(words: str | None) -> str | None:
    """A node's or registry's words as stored: empty is None, long is cut to DETAIL_LIMIT."""
    if not words:
        return None
    words = words.strip().replace("\x00", "")
    if not words:
        return None
    return words if len(words) <= DETAIL_LIMIT else words[: DETAIL_LIMIT - 1] + "…"
