"""What `podium show` prints of an attempt's record beyond its table row (seed DurableAssignment):
what it was decided on, and the reconcile loop's last check; and what `podium nodes NODE` prints
of a node's operations and materialization snapshots. Every value a user or a node chose is
printed as plain text, never as markup."""

from __future__ import annotations

from typing import Any

from rich.console import Console


def _plain(out: Console, line: str) -> None:
    out.print(line, markup=False, highlight=False)


def _time(ts: str | None) -> str:
    return "" if not ts else ts[:23].replace("T", " ")


def print_attempt_record(out: Console, a: dict[str, Any]) -> None:
    n = a["attempt"]
    snap = a.get("capability_snapshot")
    if snap:
        labels = ",".join(f"{k}={v}" for k, v in sorted((snap.get("labels") or {}).items())) or "none"
        caps = ",".join(snap.get("capabilities") or ()) or "none"
        _plain(out, f"  attempt {n}: decided on node {a['node_id']}: pool {snap.get('pool')}, arch {snap.get('arch')}, "
                    f"backends {','.join(snap.get('backends') or ())}, labels {labels}, capabilities {caps}, "
                    f"egress {','.join(snap.get('egress_contexts') or ())}")  # fmt: skip
        for m in snap.get("materializations") or ():
            _plain(out, f"  attempt {n}: {m.get('backend_kind')} runtime {m.get('runtime_digest') or '-'}, "
                        f"toolchain {m.get('toolchain_digest') or '-'}")  # fmt: skip
    ref = a.get("backend_ref") or "not reported yet"
    _plain(out, f"  attempt {n}: backend {a.get('backend_kind')} ({ref}), operation deadline "
                f"{_time(a.get('operation_deadline'))}, retry {a.get('retry_count', 0)} of at most {a.get('retry_limit', 0)}")  # fmt: skip
    if a.get("last_reconciled_at"):
        _plain(out, f"  attempt {n}: last reconciled {_time(a['last_reconciled_at'])} by {a.get('last_reconciled_by')}: "
                    f"{a.get('last_reconcile_result')}")  # fmt: skip
    elif not a.get("finished_at"):
        _plain(out, f"  attempt {n}: not reconciled yet (due {_time(a.get('next_reconcile_at'))})")
    if a.get("reconcile_owner"):
        _plain(out, f"  attempt {n}: being reconciled by {a['reconcile_owner']} (claim until "
                    f"{_time(a.get('reconcile_claim_expires_at'))})")  # fmt: skip


def print_node_record(out: Console, n: dict[str, Any]) -> None:
    """`podium nodes NODE`: the node's identity, health, capacity, operations and materializations."""
    a, r = n["allocatable"], n["reserved"]
    _plain(out, f"{n['id']} {n['name']}")
    _plain(out, f"  health:      {n['health']}, {'connected' if n['connected'] else 'not connected'}, "
                f"{n.get('drain_phase', 'active')}")  # fmt: skip
    _plain(out, f"  pool/arch:   {n['pool']} / {n['arch']}; backends {','.join(n['backends'])}; "
                f"egress {','.join(n['egress_contexts'])}")  # fmt: skip
    _plain(out, f"  slots:       {r['slots']}/{a['slots']} in use")
    _plain(out, f"  operations:  at most {n.get('max_operations', 4)} tasks prepared (pulled, created) at once")
    labels = ",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())) or "none"
    _plain(out, f"  labels:      {labels}")
    mats = n.get("materializations") or []
    if not mats:
        _plain(out, "  materializations: none reported")
    for m in mats:
        _plain(out, f"  materialization {m.get('backend_kind')} ({m.get('architecture')}):")
        _plain(out, f"    runtime   {m.get('runtime_digest') or '-'}")
        _plain(out, f"    toolchain {m.get('toolchain_digest') or '-'}")
        _plain(out, f"    artifacts {m.get('digest') or '-'}")
