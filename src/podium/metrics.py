"""The server's own Prometheus metrics, served at `/metrics` beside the process collector's.

Module-level, as prometheus_client intends: one registry per process. Several servers in one test
process share them, so tests compare before/after values rather than absolute ones.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SIZES = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000)

PLACEMENTS = Counter("podium_placements_total", "Tasks assigned to a node by this server's dispatcher.")
REFILL_PLACEMENTS = Counter(
    "podium_placements_with_ends_total",
    "Tasks assigned by a group commit of node reports, on the room its ends freed (counted in podium_placements_total too).",
)
DISPATCH_SECONDS = Histogram(
    "podium_dispatch_seconds", "One dispatch batch: claim, place, reserve, assign, commit.", buckets=_FAST
)
DISPATCH_HELD = Counter(
    "podium_dispatch_held_total",
    "Dispatch passes that placed nothing because this server's node reports were too far behind "
    "(every new Assign's acceptance would queue behind them).",
)
DISPATCH_SKIPPED = Counter(
    "podium_dispatch_skipped_total",
    "Dispatch passes not run: woken only by capacity freed while the last look found no task queued.",
)
NODE_REPORT_LAG = Gauge(
    "podium_node_report_lag_seconds",
    "How long the oldest node report of the last group commit had waited when it was committed.",
)
DISPATCH_WINDOW_FULL = Counter(
    "podium_dispatch_window_full_total",
    "Dispatch ticks that placed nothing because the fleet had `assign_window` assignments unaccepted.",
)
DISPATCH_CLAIMED = Counter(
    "podium_dispatch_claimed_total", "Queued tasks claimed (locked, read, placed or given a reason) by dispatch passes."
)
DISPATCH_REASONS_WRITTEN = Counter(
    "podium_dispatch_reasons_written_total", "Queued tasks whose waiting reason a dispatch pass changed."
)
NODE_REPORTS = Counter(
    "podium_node_reports_total",
    "Task events from nodes, by what became of them: applied (a transition), settled (nothing to change), "
    "rejected (a stale or foreign attempt) or dropped (kept losing races).",
    ["outcome"],
)
NODE_REPORT_BATCH = Histogram(
    "podium_node_report_batch_size", "Node reports applied per group commit.", buckets=_SIZES
)
NODE_REPORT_BATCH_SECONDS = Histogram(
    "podium_node_report_batch_seconds", "One group commit of node reports: read, decide, write, commit.", buckets=_FAST
)
NODE_REPORT_BACKLOG = Gauge("podium_node_report_backlog", "Node reports received and not yet applied.")
HEARTBEAT_FLUSH_SECONDS = Histogram(
    "podium_heartbeat_flush_seconds", "One flush of the heartbeats received since the last.", buckets=_FAST
)
OUTBOX_TAKE_SECONDS = Histogram(
    "podium_outbox_take_seconds", "One take of what woken nodes are owed (Assigns, stops).", buckets=_FAST
)
CONNECTED_NODES = Gauge("podium_connected_nodes", "Agent streams open on this server.")
LOOP_LAG_SECONDS = Histogram(
    "podium_event_loop_lag_seconds",
    "How late the server's event loop ran a callback due now: its backlog of ready work.",
    buckets=_FAST,
)
RELEASE_PROOFS = Counter(
    "podium_release_proofs_total",
    "Release proofs from nodes: accepted (recorded on their attempt) or refused (a repeat, a late or a foreign one).",
    ["outcome"],
)
IMAGE_RESOLUTIONS = Counter(
    "podium_image_resolutions_total",
    "Image tags the resolver loop asked about, per task, by outcome: resolved, unreachable (retried later), "
    "failed (no such image, or credentials refused: the task failed).",
    ["outcome"],
)
SERIALIZATION_RETRIES = Counter(
    "podium_serialization_retries_total",
    "Store operations run again after PostgreSQL refused them for contention (serialization failure, "
    "deadlock, lock timeout), by operation.",
    ["operation"],
)
SERIALIZATION_GIVEUPS = Counter(
    "podium_serialization_giveups_total",
    "Store operations that failed with Contention: refused for contention more than `serialization_retry_limit` times.",
    ["operation"],
)
