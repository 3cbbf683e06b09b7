"""Workers as the control plane sees them: attach, reconcile, route, detach."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sandgate import log_context
from sandgate.agent.frames import Header
from sandgate.control.peers import PeerClient
from sandgate.control.state import ServerLocalState
from sandgate.core import placement
from sandgate.core.clock import utcnow
from sandgate.core.loops import LoopHealth
from sandgate.errors import (
    AtCapacityError,
    AuthError,
    NetworkUnavailableError,
    NoCapacityError,
    NotSupportedError,
    ResourceCapError,
    SandgateError,
    TunnelUnavailableError,
    UnavailableError,
)
from sandgate.store.base import SandboxName, Store, Worker, WorkerName
from sandgate.tunnel.hub import TunnelSession
from sandgate.tunnel.rpc import LinkClosedError, NoAnswerError

# what a worker reports in features["network"] when it can give sandboxes one: "gate" (the
# bwrap runtime's egress gate, worker/egress.py) or "host" (the unisolated process runtime)
NETWORKED = ("gate", "host")

log = logging.getLogger(__name__)

PROBE_LEAD = 3.0  # a request still unanswered this long before its end pings the link...
PROBE_GRACE = 0.5  # ...and the answer to that ping may come this long after the end
OWNER_RENEWAL = "owner-renewal"  # the loop renewing a worker's tunnel owner, per worker


@dataclass(frozen=True)
class Placement:
    """A worker chosen for a new sandbox."""

    worker: WorkerName
    features: dict[str, Any]
    capacity: int
    budget: dict[str, int] | None = None  # its host's memory/disk for all its sandboxes


class WorkerRegistry:
    def __init__(
        self,
        store: Store,
        state: ServerLocalState,
        *,
        node_url: str,
        peers: PeerClient,
        owner_ttl: float,
    ) -> None:
        self.store = store
        self.state = state
        self.node_url = node_url
        self.peers = peers
        self.owner_ttl = owner_ttl
        # set by the app: what to do once a worker's tunnel serves (deliver waiting creates)
        self.on_serving: Callable[[TunnelSession], Awaitable[None]] | None = None

    # -- TunnelEvents ---------------------------------------------------------------------
    async def attached(self, session: TunnelSession, hello: Header) -> Header:
        """Record the worker and reconcile what it runs with what the store expects."""
        if not await self.store.bind_worker_key(session.token_hash, session.worker):
            raise AuthError(
                f"this worker token belongs to another worker, not {session.worker!r}; "
                "create a token per worker (sandgate keys create --worker)"
            )
        now = utcnow()
        worker = WorkerName(session.worker)
        await self.store.upsert_worker(
            Worker(
                name=worker,
                capacity=session.capacity,
                features=session.features,
                connected=True,
                last_seen_at=now,
                node_url=self.node_url,
            )
        )
        reported = {str(n) for n in hello.get("sandboxes") or []}
        expected = await self.store.list_worker_sandboxes(worker, ("running",))
        for sandbox in expected:
            if sandbox.name not in reported:
                await self.store.set_sandbox_state(
                    sandbox.name,
                    "error",
                    from_states=("running",),
                    error="the worker restarted and no longer runs this sandbox",
                    now=now,
                )
                log.warning("sandbox.lost", extra={"sandbox": sandbox.name, "worker": worker})
        remove = await self._strays(worker, reported, adopt_pending=now)
        log.info(
            "tunnel.attached",
            extra={"worker": worker, "sandboxes": len(reported), "remove": len(remove)},
        )
        return {"remove": remove}

    async def serving(self, session: TunnelSession) -> None:
        """The welcome is sent and the session reads frames: route requests to it, record
        that this instance holds it, and deliver the creates that wait for this worker."""
        old = self.state.tunnels.get(session.worker)
        self.state.tunnels[session.worker] = session  # before any await: routed from now on
        self.state.tunnel_attaches += 1
        if old is not None and old is not session:
            log.warning("tunnel.replaced", extra={"worker": session.worker})
            old.channel.close(TunnelUnavailableError("replaced by a newer tunnel"))
            await old.disconnect(4409)
        now = utcnow()
        await self.store.claim_tunnel(session.worker, self.node_url, now)
        await self.store.set_worker_connected(WorkerName(session.worker), True, now)
        log.info("tunnel.serving", extra={"worker": session.worker})
        if self.on_serving is not None:
            await self.on_serving(session)

    async def _strays(
        self, worker: WorkerName, reported: set[str], *, adopt_pending: datetime | None
    ) -> list[str]:
        """Sandboxes the worker runs that the store does not expect there: to remove.

        With `adopt_pending`, a reported sandbox still `pending` (its create's instance died
        before recording the start) is marked running: it runs.
        """
        # one read for the whole report, not one per sandbox (this runs on every heartbeat)
        expected = {
            record.name: record
            for record in await self.store.list_worker_sandboxes(worker, ("running", "pending"))
        }
        remove = []
        for name in sorted(reported):
            record = expected.get(SandboxName(name))
            if record is None or record.worker != worker:
                remove.append(name)
            elif record.state == "pending" and adopt_pending is not None:
                now = adopt_pending
                await self.store.mark_running(
                    record.name, worker, now, now + timedelta(seconds=record.timeout)
                )
        return remove

    async def event(self, session: TunnelSession, header: Header) -> None:
        kind = header.get("event")
        now = utcnow()
        if kind == "heartbeat":
            await self._renew_owner(session, now)
            reported = header.get("sandboxes")
            if isinstance(reported, list) and all(isinstance(n, str) for n in reported):
                worker = WorkerName(session.worker)
                for name in await self._strays(worker, set(reported), adopt_pending=None):
                    log.warning("sandbox.stray_removed", extra={"sandbox": name, "worker": worker})
                    await session.channel.call("destroy", wait=30.0, name=name)
        elif kind == "sandbox_exited":
            name = SandboxName(str(header.get("name", "")))
            record = await self.store.get_sandbox(name)
            if record is not None and record.worker == session.worker:
                await self.store.set_sandbox_state(
                    name,
                    "error",
                    from_states=("running",),
                    error=str(header.get("reason") or "the sandbox exited"),
                    now=now,
                )
                log.warning("sandbox.exited", extra={"sandbox": name})

    async def _renew_owner(self, session: TunnelSession, now: datetime) -> None:
        """Renew the store's record that this instance holds the worker's tunnel, on each of
        its heartbeats. Its health is the loop "owner-renewal <worker>" that /readyz reads; a
        failure is raised on to the channel, which logs it with its traceback."""
        name = f"{OWNER_RENEWAL} {session.worker}"
        health = self.state.loops.setdefault(name, LoopHealth(name))
        try:
            if not await self.store.renew_tunnel(session.worker, self.node_url, now):
                # someone else holds the record; take it only when theirs went stale
                if await self.owner(session.worker) is None:
                    await self.store.claim_tunnel(session.worker, self.node_url, now)
            await self.store.set_worker_connected(WorkerName(session.worker), True, now)
        except Exception as exc:
            health.failed(f"{type(exc).__name__}: {exc}", now)
            raise
        if ended := health.succeeded(now):
            log.info("loop.recovered", extra={"loop": name, "failures": ended})

    async def detached(self, session: TunnelSession) -> None:
        current = self.state.tunnels.get(session.worker)
        if current is not None and current is not session:
            return  # a newer tunnel of the same worker took over
        self.state.loops.pop(f"{OWNER_RENEWAL} {session.worker}", None)
        if current is session:
            del self.state.tunnels[session.worker]
        try:
            await self.store.set_worker_connected(WorkerName(session.worker), False, utcnow())
            await self.store.release_tunnel(session.worker, self.node_url)
            newer = self.state.tunnels.get(session.worker)
            if newer is not None and newer is not session:
                # a new session of this worker started serving while we recorded the loss:
                # its claim may have been undone by ours; record it again
                now = utcnow()
                await self.store.claim_tunnel(session.worker, self.node_url, now)
                await self.store.set_worker_connected(WorkerName(session.worker), True, now)
        except Exception:
            log.exception("tunnel.detach_not_recorded", extra={"worker": session.worker})
        log.warning("tunnel.detached", extra={"worker": session.worker})

    # -- routing -----------------------------------------------------------------------------
    def local(self, worker: str | None) -> TunnelSession | None:
        session = self.state.tunnels.get(worker or "")
        return None if session is None or session.channel.closed else session

    async def owner(self, worker: str | None) -> str | None:
        """The node_url of the instance holding the worker's tunnel, if fresh; else None."""
        if not worker:
            return None
        found = await self.store.tunnel_owner(worker)
        if found is None:
            return None
        node_url, updated_at = found
        if (utcnow() - updated_at).total_seconds() > self.owner_ttl:
            return None
        return node_url

    async def request(
        self,
        worker: str | None,
        op: str,
        fields: dict[str, Any],
        payload: bytes = b"",
        *,
        wait: float,
        forward: bool = True,
    ) -> tuple[Header, bytes]:
        """A tunnel request to `worker`: down our own tunnel, or through the instance that
        holds it. `forward=False` is the hop guard for requests that came from a peer."""
        session = self.local(worker)
        if session is not None:  # `call` adds the request's id
            return await self.call(session, op, fields, payload, wait=wait)
        if not forward or not worker:
            raise TunnelUnavailableError("sandbox tunnel not available", retry_after=2.0)
        fields = _with_request_id(fields)  # for the peer, and the worker behind it
        node_url = self.state.cached_owner(worker)
        if node_url is None:
            node_url = await self.owner(worker)
            if node_url is None or node_url == self.node_url:
                raise TunnelUnavailableError("sandbox tunnel not available", retry_after=2.0)
            self.state.cache_owner(worker, node_url)
        self.state.forwarded += 1
        try:
            return await self.peers.tunnel_call(node_url, worker, op, fields, payload, wait=wait)
        except UnavailableError:
            self.state.forget_owner(worker)  # unreachable or not the owner: look it up again
            raise

    async def call(
        self,
        session: TunnelSession,
        op: str,
        fields: dict[str, Any],
        payload: bytes = b"",
        *,
        wait: float,
    ) -> tuple[Header, bytes]:
        """A request down our own tunnel. A timeout is the worker's only if the link still
        answers: a silent link (a partition, a blackholed balancer) is tunnel loss instead,
        503 `tunnel_unavailable`, never a scheduling timeout.

        The link is asked (a ping) while the request still waits, PROBE_LEAD s before its
        end, so a loaded but live worker has time to answer and the verdict costs at most
        PROBE_GRACE s past `wait`. Any frame from the worker after the ping was sent (its
        answer, a heartbeat, another call's answer) proves the link.
        """
        fields = _with_request_id(fields)
        probe: asyncio.Task[None] | None = None
        asked_at = 0.0

        def ask() -> None:
            nonlocal probe, asked_at
            asked_at = time.monotonic()
            probe = asyncio.get_running_loop().create_task(
                self._ping(session, PROBE_LEAD + PROBE_GRACE)
            )

        try:
            return await session.channel.request(
                op, fields, payload, wait=wait, slow_after=max(0.0, wait - PROBE_LEAD), on_slow=ask
            )
        except NoAnswerError:  # a timeout the worker itself answered proves the link
            assert probe is not None  # asked before the wait ran out (the lead is clamped)
            # only a frame that came after the ping was sent proves the link carries frames
            # now (one from before may predate a partition)
            if session.last_heartbeat <= asked_at:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(probe), PROBE_GRACE)
            if session.last_heartbeat > asked_at:
                raise  # the worker answers: the timeout is the sandbox's
            raise await self.lost(session, f"no answer to {op!r} within {wait:g} s") from None
        finally:
            if probe is not None:
                probe.cancel()

    async def _ping(self, session: TunnelSession, wait: float) -> None:
        """Ask the worker for any answer (it updates `session.last_heartbeat` on arrival)."""
        with contextlib.suppress(SandgateError):
            await session.channel.call("ping", wait=wait)

    async def lost(self, session: TunnelSession, why: str) -> TunnelUnavailableError:
        """Give up on a silent link: fail every call waiting on it, drop the WebSocket (the
        worker redials), count it. Returns the error to answer with."""
        error = LinkClosedError(
            f"the tunnel of worker {session.worker} went silent ({why}); it is dropped and "
            "the worker redials",
            retry_after=2.0,
        )
        if not session.channel.closed:
            self.state.tunnel_losses += 1
            log.warning("tunnel.silent", extra={"worker": session.worker, "why": why})
            session.channel.close(error)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(session.disconnect(4408)), PROBE_LEAD)
        return error

    async def offering(self, feature: str) -> str:
        """A connected worker whose runtime reports `feature`, for work that takes no slot
        (a workspace's image and history)."""
        connected = False
        for worker in await self.store.list_workers():
            if await self.is_connected(worker.name):
                connected = True
                if worker.features.get(feature):
                    return worker.name
        if not connected:
            raise NoCapacityError("no worker is connected", retry_after=5.0)
        raise NotSupportedError(
            f"no connected worker offers {feature} (that takes the bwrap runtime as root, with "
            "loop devices and Linux >= 5.12)"
        )

    async def is_connected(self, worker: str) -> bool:
        return self.local(worker) is not None or await self.owner(worker) is not None

    async def pick(
        self,
        *,
        network: bool = False,
        need: Mapping[str, Any] | None = None,
        image: bool = False,
        workspaces: bool = False,
        only: str | None = None,
    ) -> Placement:
        """The connected worker (through any instance) with the most free slots (then the
        most room left in its budget) that can hold a sandbox granted `need` (with `image`:
        one whose runtime starts a template's own root file system; with `workspaces`: one
        that mounts workspaces; with `only`: that worker, the one its workspaces are on)."""
        need = need or {}
        best: tuple[tuple[int, float], Placement] | None = None
        offered = False
        connected = 0
        smaller: list[tuple[str, float]] = []  # workers that can never hold one this large
        imageless = 0
        for worker in await self.store.list_workers():
            if only is not None and worker.name != only:
                continue
            if not await self.is_connected(worker.name):
                continue
            connected += 1
            if workspaces and not worker.features.get("workspaces"):
                continue
            if image and not worker.features.get("images"):
                imageless += 1
                continue
            if network and worker.features.get("network") not in NETWORKED:
                continue
            most = placement.sandbox_max_of(worker.features.get("enforces"))
            if (name := placement.too_large(need, most)) is not None:
                smaller.append((name, most[name]))
                continue
            offered = True
            usage = await self.store.worker_usage(worker.name)
            free = worker.capacity - usage.sandboxes
            budget = placement.budget_of(worker.features.get("enforces"))
            if free <= 0 or (budget and placement.short_of(need, usage.granted, budget)):
                continue
            score = (free, placement.room(need, usage.granted, budget or {}))
            if best is None or score > best[0]:
                chosen = Placement(worker.name, worker.features, worker.capacity, budget)
                best = (score, chosen)
        if best is None and smaller and not offered:
            name, largest = max(smaller, key=lambda s: s[1])
            raise ResourceCapError(
                f"{name} {need[name]:g} is more than any connected worker can give one sandbox "
                f"(the largest takes {largest:g}); ask for at most {largest:g}",
                cap=f"worker_max_{name}",
                value=largest,
            )
        if best is None:
            if image and connected and imageless == connected:
                raise NotSupportedError(
                    "no connected worker can start a template's own root file system (that "
                    "takes the bwrap runtime on Linux >= 5.12); use a built-in template"
                )
            if network and connected and not offered:
                raise NetworkUnavailableError(
                    "no connected worker offers sandboxes a network (a worker gives one "
                    "through its egress gate when it runs as root with iproute2 and nftables "
                    'installed, and without --no-network); or create with "network": false'
                )
            if not connected:
                if only is not None:
                    raise NoCapacityError(
                        f"worker {only}, where this sandbox's workspaces are, is not connected",
                        retry_after=5.0,
                    )
                raise NoCapacityError("no worker is connected", retry_after=5.0)
            if workspaces and not offered:
                raise NotSupportedError(
                    "no connected worker mounts workspaces (that takes the bwrap runtime as "
                    "root, with loop devices and Linux >= 5.12)"
                )
            raise AtCapacityError("every connected worker is at capacity", retry_after=5.0)
        return best[1]


def _with_request_id(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields, with the current request's id for the worker's (and the peer's) lines."""
    rid = log_context.request_id()
    if rid is None or log_context.FIELD in fields:
        return fields
    return {**fields, log_context.FIELD: rid}
