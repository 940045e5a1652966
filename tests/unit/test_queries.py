"""The named SQL blocks: every fragment a query includes exists, and is spliced in whole."""

from __future__ import annotations

from podium.store.queries import queries


def test_fragments_are_included_and_are_no_queries_of_their_own() -> None:
    q = queries()
    assert not any(name.startswith("_") for name in q)
    for name, body in q.items():
        assert "{{" not in body and "__ROWS__" not in body, name
    # the capacity of an ended, proved or abandoned attempt comes back through the one fragment
    for name, rows in (("transition_tasks", "ended WHERE ended.released"), ("release_proofs", "proved WHERE proved.released"),
                       ("release_abandoned", "rel")):  # fmt: skip
        assert "freed AS (\n    UPDATE nodes n SET" in q[name]
        assert f"FROM {rows} GROUP BY node_id) f" in q[name]
