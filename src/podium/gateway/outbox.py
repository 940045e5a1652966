"""The outbox and delivery: what nodes are owed (Assigns placed by any replica, stops), taken from the
store when PostgreSQL notifies `podium_node` — every node woken since the last take in one
statement — with a periodic sweep as the backstop, so a missed notification only delays.

An Assign's secrets are resolved just before it is pushed, for the node that runs it. A store that
cannot be read keeps the Assign here, sent again on the same stream once it can; a secret gone or
unreadable is the policy's to decide (`policy.on_undeliverable`), applied by the one applier.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from podium import metrics
from podium.errors import NotFound, StoreUnavailable
from podium.gateway.sessions import Session, Sessions
from podium.proto.podium.v1 import agent_pb2 as pb
from podium.scheduler import policy
from podium.scheduler.apply import Applier
from podium.security.secretbox import SecretUnreadable
from podium.security.service import SecretMissing, Security
from podium.states import TaskState
from podium.store import AuditEntry, Store, Subscription
from podium.store.rows import OutboxRow
from podium.timing import Timing

log = logging.getLogger(__name__)

# At most this many Assigns of one push are queued on their streams by the push itself (`Outbox.push`)
PUSH_NOW_MAX = 16


class Outbox:
    def __init__(
        self, store: Store, sessions: Sessions, timing: Timing, *, take_store: Store, security: Security,
        applier: Applier,
    ) -> None:  # fmt: skip
        self.store = store
        # the outbox takes run over the pool of the group commits, so no Hello storm delays them
        self.take_store = take_store
        self.sessions = sessions
        self.timing = timing
        self.security = security
        self.applier = applier
        self._node_sub: Subscription | None = None
        self._revoked_sub: Subscription | None = None  # also hears podium_superseded
        self._due: set[str] = set()  # nodes to take the outbox of at the next take
        self._pushed: list[OutboxRow] = []  # Assigns this server's dispatch marked delivered: to send
        self._wake = asyncio.Event()

    async def loop(self) -> None:
        """LISTEN for per-node wake-ups, and sweep every node with a pending outbox as a backstop."""
        while True:
            try:
                if self._node_sub is None or self._node_sub.is_closed():
                    self._node_sub = await self.store.listen("podium_node", self.due)
                if self._revoked_sub is None or self._revoked_sub.is_closed():
                    self._revoked_sub = await self.store.listen(
                        "podium_revoked", self.sessions.on_revoked, also={"podium_superseded": self.sessions.on_superseded}
                    )
                for node_id in await self.store.nodes_with_outbox():
                    self.due(node_id)
            except StoreUnavailable as e:
                log.warning("outbox sweep: %s", e)
                sub, self._node_sub = self._node_sub, None
                if sub is not None:
                    await sub.close()
            await asyncio.sleep(max(self.timing.tick, 0.1))

    async def close(self) -> None:
        for sub in (self._node_sub, self._revoked_sub):
            if sub is not None:
                await sub.close()

    def push(self, rows: list[OutboxRow]) -> None:
        """Assigns this server's dispatcher placed on nodes whose streams it holds, marked delivered in
        the placement's own transaction: sent with no take. A few that need nothing from the store
        (no secret, no registry login to read), with nothing pushed earlier still waiting, are
        queued on their streams now, in this call, so that each stream's writer runs before whatever
        the caller wakes next (the dispatcher then answers the submissions' HTTP requests);
        otherwise the next delivery sends them, in order. Not many: building hundreds of Assigns here
        would hold the dispatcher's next pass, where the delivery loop builds them while that pass
        waits on the database."""
        now = self.sendable_now(rows)
        if now is not None:
            self.send_now(now)
            return
        self._pushed.extend(rows)
        self._wake.set()

    def sendable_now(self, rows: list[OutboxRow]) -> list[tuple[Session, OutboxRow, dict[str, Any]]] | None:
        """The rows with their streams and specs if every one may be queued on its stream now: not
        many, nothing pushed earlier still waiting (their order), Assigns all, to streams this server
        holds, none needing the store (a secret, a registry login). None if not."""
        if self._pushed or len(rows) > PUSH_NOW_MAX:
            return None
        now: list[tuple[Session, OutboxRow, dict[str, Any]]] = []
        for r in rows:
            s = self.sessions.get(r.node_id)
            if s is None or r.kind != "assign" or r.spec is None:
                return None  # a stream that ended (its Assign handed back), or not an Assign: the loop's
            spec = json.loads(r.spec)
            if self.security.needs_store(spec):
                return None
            now.append((s, r, spec))
        return now

    def send_now(self, now: list[tuple[Session, OutboxRow, dict[str, Any]]]) -> None:
        for s, r, spec in now:
            self._assign(s, r, spec, [], [])

    def due(self, node_id: str) -> None:
        """Take this node's outbox at the next take (if this replica holds its stream)."""
        if node_id in self.sessions:
            self._due.add(node_id)
            self._wake.set()

    async def deliver_loop(self) -> None:
        """Push what the store says nodes are owed: every node woken since the last take, in one
        statement (a dispatch batch spread over a thousand nodes is one take, not a thousand).

        An Assign whose secrets could not be read because the store was unavailable is kept here
        and sent again (with backoff) on the same stream: the take already marked it delivered, so
        no other take would return it, and failing the task over a database blip would be a lie.
        Should this server die meanwhile, the node's next Hello has it redelivered."""
        delay = 0.05
        retry: list[tuple[Session, OutboxRow]] = []  # (stream, outbox row) to send again, oldest first
        retry_delay = 0.05
        while True:
            if retry:
                with contextlib.suppress(TimeoutError):
                    # not wait_for, which in Python 3.11 loses a cancel that comes as the wait ends
                    async with asyncio.timeout(retry_delay):
                        await self._wake.wait()
            else:
                await self._wake.wait()
            self._wake.clear()
            due, self._due = self._due, set()
            live = sorted(n for n in due if n in self.sessions)
            pushed, self._pushed = self._pushed, []
            # a stream that ended since its Assigns were placed: whoever holds the node now takes them
            orphans = [r.fencing_token for r in pushed if r.node_id not in self.sessions]
            if orphans:
                try:
                    await self.take_store.give_back_assigns(orphans)
                except StoreUnavailable as e:
                    # marked delivered but never sent: the node's next Hello redelivers them, or
                    # their accept deadline gives them to another node
                    log.warning("%d Assigns whose stream ended could not be handed back: %s", len(orphans), e)
            rows = [r for r in pushed if r.node_id in self.sessions]
            if live:
                try:
                    with metrics.OUTBOX_TAKE_SECONDS.time():
                        rows += await self.take_store.take_outbox(live)
                except StoreUnavailable as e:
                    log.warning("outbox for %d nodes: %s", len(live), e)
                    self._due.update(live)
                    self._pushed[:0] = rows  # sent after the take that failed, in their order
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    self._wake.set()
                    continue
                delay = 0.05
            # what waited for the store first, each still only on the stream it was taken for (a
            # node that reconnected since is redelivered its Assigns by its Hello)
            work = [(s, r, True) for s, r in retry if self.sessions.get(s.node_id) is s]
            retry = []
            work += [(s, r, False) for r in rows if (s := self.sessions.get(r.node_id)) is not None]
            for s, r, again in work:
                if r.kind == "assign":
                    # marked delivered but not sent if this fails: closing the stream makes the
                    # node's next Hello redeliver it
                    try:
                        if not await self._send_assign(s, r, again=again):
                            retry.append((s, r))
                    except asyncio.CancelledError:
                        raise
                    except Exception:
                        log.exception("sending task %s to node %s failed; closing its stream", r.task_id, s.node_id)
                        s.close()
                else:
                    s.send(pb.ServerMessage(cancel=pb.Cancel(
                        task_id=str(r.task_id), fencing_token=r.fencing_token, reason=r.reason or "",
                    )))  # fmt: skip
            retry_delay = min(retry_delay * 2, 1.0) if retry else 0.05

    async def _send_assign(self, s: Session, r: OutboxRow, *, again: bool = False) -> bool:
        """Resolve the task's secrets now, immediately before the Assign that carries them, and only
        for the node that runs this attempt. False when the store could not be read: nothing is
        known yet, and the caller sends it again. With `again`, the attempt is first checked to
        still be the task's current one (it may have been cancelled or revoked while it waited)."""
        task_id, token = r.task_id, r.fencing_token
        assert r.spec is not None, "an assign outbox row carries its spec"
        spec = json.loads(r.spec)
        try:
            if again:
                current = await self.store.get_task(task_id)
                if current.state != TaskState.ASSIGNED or current.fencing_token != token:
                    return True  # moved on while it waited: nothing to send
            values, registries = await self.security.resolve(spec)
        except StoreUnavailable as e:
            log.warning("task %s: its secrets cannot be read now (%s); sending it to node %s again shortly", task_id, e, s.node_id)
            return False
        except SecretMissing as e:
            log.warning("task %s cannot be sent: %s", task_id, e)
            return await self._undeliverable(r, policy.SECRET_GONE, {"secret": e.secret})
        except SecretUnreadable as e:
            log.error("task %s cannot be sent to node %s: %s; every replica must be given the same key "
                      "(PODIUM_SECRET_KEY or PODIUM_SECRET_KEY_FILE)", task_id, s.node_id, e)  # fmt: skip
            return await self._undeliverable(r, policy.SECRET_UNREADABLE, {"secret": e.secret, "key_id": e.key_id})
        except NotFound:
            return True  # the task itself is gone (pruned): nothing to send
        self._assign(s, r, spec, values, registries)
        return True

    @staticmethod
    def _assign(s: Session, r: OutboxRow, spec: dict[str, Any], values: list[tuple[str, str]],
                registries: list[tuple[str, str, str]]) -> None:  # fmt: skip
        s.send(pb.ServerMessage(assign=pb.Assign(
            task_id=str(r.task_id), attempt=r.attempt, fencing_token=r.fencing_token,
            spec_json=r.spec, gpu_indexes=list(r.gpu_indexes or ()),
            secrets=[pb.SecretValue(env=env, value=value) for env, value in values],
            registries=[pb.RegistryCredential(registry=h, username=u, password=p) for h, u, p in registries],
        )))  # fmt: skip
        s.carried(r.fencing_token, spec.get("timeout"))

    async def _undeliverable(self, r: OutboxRow, problem: str, detail: dict[str, Any]) -> bool:
        """Apply the policy's step for an Assign that cannot be sent; the detail (which secret, which
        key) goes beside the reason, in the audit log, never into it. False if the store went away
        meanwhile (the caller tries the whole delivery again)."""
        step = policy.on_undeliverable(policy.TaskFacts(state=TaskState.ASSIGNED), problem)
        # the entry is written with the failure, in its transaction: never one without the other
        entry = None if step is None else AuditEntry(
            "task.undeliverable", {"reason": step.reason, "fencing_token": r.fencing_token, **detail})  # fmt: skip
        try:
            await self.applier.apply(r.task_id, TaskState.ASSIGNED, step, fencing_token=r.fencing_token, audit=entry)
        except StoreUnavailable as e:
            log.warning("task %s: its failure could not be recorded yet (%s); trying again", r.task_id, e)
            return False
        return True
