"""Nodes: list, read, history, drain and undrain, labels, and removal from the fleet (revoke)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from podium.api.deps import Admin, Operator, SchedulerDep, StoreDep, Viewer, audit, revision_of
from podium.api.models import LabelsIn, NodeEventOut, NodeOut, node_out
from podium.api.paging import AFTER_DOC, COUNT_DOC, ERRORS, PAGED, REMAINING_CAP, cursor, page, uncursor
from podium.errors import InvalidRequest
from podium.store import Store
from podium.units import parse_duration

router = APIRouter()


async def _node(store: Store, node: str) -> NodeOut:
    """A node as the API shows it, with the capacity it still holds for sandboxes being removed."""
    row = await store.get_node(node)
    return node_out(row, (await store.nodes_releasing([row.id])).get(row.id))


@router.get("/v1/nodes", response_model=list[NodeOut], responses=PAGED)
async def list_nodes(
    _who: Viewer,
    store: StoreDep,
    request: Request,
    response: Response,
    limit: Annotated[int, Query(ge=1, le=1000, description="nodes per page")] = 1000,
    after: Annotated[str | None, Query(max_length=512, description=AFTER_DOC)] = None,
    count: Annotated[bool, Query(description=COUNT_DOC)] = False,
) -> list[NodeOut]:
    """Nodes by name (then id), one page at a time (see `GET /v1/tasks` for paging)."""
    cur = uncursor("nodes", after, (str, str))
    pos = (cur[0], cur[1]) if cur else None
    rows = list(await store.list_nodes_page(limit=limit + 1, after=pos))
    remaining = None
    if count:
        last = (rows[limit - 1].name, rows[limit - 1].id) if len(rows) > limit else None
        remaining = await store.count_nodes_after(after=last, cap=REMAINING_CAP) if last else 0
    rows = page(request, response, rows, limit, lambda r: cursor("nodes", r.name, r.id), remaining)
    releasing = await store.nodes_releasing([r.id for r in rows])
    return [node_out(r, releasing.get(r.id)) for r in rows]


@router.get("/v1/nodes/{node}", response_model=NodeOut, responses=ERRORS)
async def get_node(node: str, _who: Viewer, store: StoreDep, response: Response) -> NodeOut:
    out = await _node(store, node)
    response.headers["ETag"] = f'"{out.revision}"'
    return out


@router.get("/v1/nodes/{node}/events", response_model=list[NodeEventOut], responses=ERRORS)
async def node_events(
    node: str, _who: Viewer, store: StoreDep, after: Annotated[int, Query(ge=0)] = 0, limit: Annotated[int, Query(ge=1, le=1000)] = 1000
) -> list[NodeEventOut]:
    """The node's history, oldest first: agent instances superseded, attempts handed over. Page
    with `after` = the last id seen."""
    row = await store.get_node(node)
    return [NodeEventOut.model_validate(r, from_attributes=True) for r in await store.node_events(row.id, after, limit)]


@router.post("/v1/nodes/{node}/drain", response_model=NodeOut, responses=ERRORS)
async def drain(
    node: str,
    who: Operator,
    store: StoreDep,
    deadline: Annotated[
        str | None, Query(description="e.g. 10m: past it, what still runs there is requeued or lost by its node-loss policy")
    ] = None,
) -> NodeOut:
    """Take no new work on this node; what it runs finishes (or, past `deadline`, goes through
    its node-loss policy). `drain_phase` says when it is drained: nothing left, safe to power off."""
    seconds = None
    if deadline is not None:
        try:
            seconds = parse_duration(deadline)
        except ValueError as e:
            raise InvalidRequest(f"deadline: {e}") from None
        if seconds < 0:
            raise InvalidRequest("deadline: must not be negative (e.g. 10m)")
    row = await store.get_node(node)
    await store.set_draining(row.id, True, seconds)
    await audit(store, who, "node.drain", row.id, deadline=seconds)
    return await _node(store, row.id)


@router.put("/v1/nodes/{node}/labels", response_model=NodeOut, responses=ERRORS)
async def set_labels(
    node: str,
    body: LabelsIn,
    who: Operator,
    store: StoreDep,
    response: Response,
    if_match: Annotated[str | None, Header(description="the node's revision (its ETag): refuse (412) if it changed since")] = None,
) -> NodeOut:
    """Replace a node's labels. From then on the operator's labels win over what the agent reports.
    With `If-Match`, only if the node is still at that revision."""
    row = await store.get_node(node)
    await store.set_labels(row.id, body.labels, revision_of(if_match))
    await audit(store, who, "node.labels", row.id, labels=body.labels)
    out = await _node(store, row.id)
    response.headers["ETag"] = f'"{out.revision}"'
    return out


@router.post("/v1/nodes/{node}/undrain", response_model=NodeOut, responses=ERRORS)
async def undrain(node: str, who: Operator, store: StoreDep) -> NodeOut:
    row = await store.get_node(node)
    await store.set_draining(row.id, False)
    await audit(store, who, "node.undrain", row.id)
    return await _node(store, row.id)


@router.post("/v1/nodes/{node}/revoke", response_model=NodeOut, responses=ERRORS)
async def revoke_node(node: str, who: Admin, store: StoreDep, scheduler: SchedulerDep) -> NodeOut:
    """Remove a node from the fleet: its stream is closed, it can never rejoin, and its tasks go
    through the node-loss policy."""
    row = await store.get_node(node)
    await store.revoke_node(row.id)
    await scheduler.node_removed(row.id)
    await audit(store, who, "node.revoke", row.id)
    return await _node(store, row.id)
