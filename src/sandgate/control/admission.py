"""Admission: what lets a request in, counted once for the whole deployment.

- Per-tenant rate limit: a token bucket per tenant in the store (`take_rate_token`).
- Per-tenant quotas: live sandboxes and active exec jobs, counted under the tenant's limits
  row lock inside the very transaction that inserts the new one.
- The create queue: a create that finds every worker full takes a ticket (at most
  `queue_limit` across all instances) and waits; only the head of the queue places. Tenants
  take turns at the head, and with `tenant_share` a tenant at its share waits behind the
  others (`sandgate.core.fair_queue`).
- The scheduling breaker: sandboxes not ready within the start timeout open it
  (`sandgate.core.breaker` has the rules); while open creates get 503 at once; after the open
  period exactly one trial create is let through and its outcome closes or re-opens it.

Nothing here counts in memory: every number is read and taken in the store, so two instances
enforce exactly the configured limits, not twice them. The only cache is each tenant's limits
*configuration* (auth_cache_ttl), never what they count.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

from sandgate.config import ServerSettings
from sandgate.control.state import ServerLocalState
from sandgate.core import breaker
from sandgate.core.breaker import BreakerPolicy, BreakerRecord
from sandgate.core.clock import utcnow
from sandgate.errors import (
    AtCapacityError,
    LimitExceededError,
    QuotaConflictError,
    UnavailableError,
)
from sandgate.store.base import (
    Sandbox,
    SchedulingTimeout,
    Store,
    TenantId,
    TenantLimits,
    TenantShare,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

TICKET_LEASE = 15.0  # a queued create's ticket lives this long unless renewed...
TICKET_RENEW = 4.0  # ...and its waiting request renews it this often
HEAD_POLL = 0.1  # the head of the queue retries placement this often
TAIL_POLL = 0.5  # the others check their position this often
QUEUE_FULL_RETRY = 5.0
QUOTA_RETRY = 5.0
RECENT_TIMEOUTS = 20  # shown by GET /api/v1/admission

Disconnected = Callable[[], Awaitable[bool]]


@dataclass(frozen=True)
class Admitted(Generic[T]):
    """A create let in: what `place` returned (its sandbox, committed), and whether it is
    the half-open breaker's trial (its outcome then closes or re-opens the breaker)."""

    value: T
    trial: str | None = None


class Admission:
    def __init__(
        self, store: Store, state: ServerLocalState, settings: ServerSettings, *, node_url: str
    ) -> None:
        self.store = store
        self.state = state
        self.settings = settings
        self.node_url = node_url
        self.policy = BreakerPolicy(
            threshold=settings.breaker_threshold,
            window=settings.breaker_window,
            open_for=settings.breaker_open,
            # a trial whose instance died is taken over once it could no longer be queued or
            # starting
            trial_lease=settings.queue_timeout + settings.start_timeout + 30.0,
        )

    @property
    def enabled(self) -> bool:
        return self.settings.admission

    # -- tenant limits -------------------------------------------------------------------------
    async def limits(self, tenant: TenantId) -> TenantLimits | None:
        if not self.enabled:
            return None
        hit, limits = self.state.cached_limits(tenant, self.settings.auth_cache_ttl)
        if not hit:
            limits = await self.store.get_tenant_limits(tenant)
            self.state.cache_limits(tenant, limits)
        return limits

    async def check_rate(self, tenant: TenantId) -> None:
        """Take one request token of the tenant's bucket, or refuse with 429."""
        limits = await self.limits(tenant)
        if limits is None or limits.rps is None or limits.rps <= 0:
            return
        wait = await self.store.take_rate_token(tenant, limits.rps, limits.bucket, time.time())
        if wait > 0:
            raise LimitExceededError(
                f"this tenant is limited to {limits.rps:g} requests per second (burst "
                f"{limits.bucket}) across the deployment; retry in {wait:.2f} s",
                limit="rps",
                code="rate_limited",
                retry_after=wait,
            )

    async def within_quota(
        self, tenant: TenantId, insert: Callable[[int | None], Awaitable[T]], *, exec_jobs: bool
    ) -> T:
        """Run `insert(max)`, which counts under the tenant's lock; map a full quota to 429."""
        limits = await self.limits(tenant)
        cap = None
        if limits is not None:
            cap = limits.max_exec_jobs if exec_jobs else limits.max_sandboxes
        try:
            return await insert(cap)
        except QuotaConflictError as exc:
            assert cap is not None
            raise _quota_error(exc.live, cap, exec_jobs=exec_jobs) from None

    async def _check_sandbox_quota(self, tenant: TenantId) -> None:
        """Before queueing: a tenant already at its quota would only wait to be refused."""
        limits = await self.limits(tenant)
        if limits is None or limits.max_sandboxes is None:
            return
        live = await self.store.count_tenant_live_sandboxes(tenant)
        if live >= limits.max_sandboxes:
            raise _quota_error(live, limits.max_sandboxes, exec_jobs=False)

    # -- creates -------------------------------------------------------------------------------
    async def admit_create(
        self,
        tenant: TenantId,
        sandbox_name: str,
        place: Callable[[], Awaitable[T]],
        disconnected: Disconnected | None = None,
        *,
        keep_on_leave: bool = False,
    ) -> Admitted[T]:
        """Let a create in through the breaker and the queue. `place` picks a worker and
        commits the sandbox there; it raises AtCapacityError when every worker is full (or
        the chosen one filled up meanwhile). A queued create leaves the queue once placed,
        or when `disconnected` says its client left, unless `keep_on_leave` (a keyed create:
        the retry with its key takes it over); either way the leave is counted."""
        if not self.enabled:
            return Admitted(await place())
        now = utcnow()
        snapshot = await self.store.admission_snapshot(now)
        trial = await self._through_breaker(snapshot.breaker, sandbox_name, now)
        try:
            if snapshot.queued == 0:
                try:
                    return Admitted(await place(), trial=trial)
                except AtCapacityError:
                    if self.settings.queue_limit <= 0:
                        raise
            waited = await self._wait_in_queue(tenant, place, disconnected, trial, keep_on_leave)
            return Admitted(waited, trial)
        except BaseException:
            if trial is not None:  # the trial never got to start a sandbox: no outcome
                await asyncio.shield(self.trial_outcome(trial, success=False))
            raise

    async def _through_breaker(
        self, record: BreakerRecord, sandbox_name: str, now: datetime
    ) -> str | None:
        verdict = breaker.verdict(record, now, self.policy)
        if verdict.admit:
            return None
        if verdict.try_trial:
            stale = now - timedelta(seconds=self.policy.trial_lease)
            if await self.store.claim_breaker_trial(sandbox_name, now, stale):
                log.warning("breaker.trial", extra={"sandbox": sandbox_name})
                return sandbox_name
            raise _breaker_open(
                breaker.refused_trial_message(record), min(self.policy.trial_lease, 5.0)
            )
        raise _breaker_open(verdict.message, verdict.retry_after)

    async def _wait_in_queue(
        self,
        tenant: TenantId,
        place: Callable[[], Awaitable[T]],
        disconnected: Disconnected | None,
        trial: str | None,
        keep_on_leave: bool,
    ) -> T:
        limit = self.settings.queue_limit
        await self._check_sandbox_quota(tenant)
        ticket = await self._enqueue(tenant, limit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.queue_timeout
        renew_at = loop.time() + TICKET_RENEW
        try:
            while True:
                now = utcnow()
                ahead = await self.store.queue_position(ticket, now, self._share(now))
                if ahead is None:  # our lease ran out (this process stalled): queue again
                    log.warning("admission.ticket_lost", extra={"ticket": ticket})
                    ticket = await self._enqueue(tenant, limit)
                    now = utcnow()
                    ahead = await self.store.queue_position(ticket, now, self._share(now))
                if ahead == 0:
                    if trial is None:  # the breaker may have opened while we waited
                        record = (await self.store.admission_snapshot(now)).breaker
                        self._refuse_if_open(record, now)
                    try:
                        return await place()
                    except AtCapacityError:
                        pass
                if loop.time() >= deadline:
                    raise UnavailableError(
                        f"no worker capacity came free within {self.settings.queue_timeout:g} s "
                        "while this create waited in the queue; retry later",
                        code="queue_timeout",
                        retry_after=QUEUE_FULL_RETRY,
                    )
                if disconnected is not None and await disconnected():
                    if not keep_on_leave:
                        self.state.queue_clients_left["abandoned"] += 1
                        raise UnavailableError("the client left while queued", code="client_left")
                    self.state.queue_clients_left["kept"] += 1
                    log.info("admission.client_left_kept", extra={"ticket": ticket})
                    disconnected = None  # seen once: the create waits on for its retry
                if loop.time() >= renew_at:
                    await self.store.renew_ticket(ticket, utcnow() + _lease())
                    renew_at = loop.time() + TICKET_RENEW
                await asyncio.sleep(HEAD_POLL if ahead == 0 else TAIL_POLL)
        finally:  # placed (its sandbox row now holds the capacity), or given up
            await asyncio.shield(self._leave(ticket))

    def _share(self, now: datetime) -> TenantShare | None:
        """The deployment's share, against the workers connected as `pick` counts them (a
        tunnel owner row fresher than owner_ttl)."""
        if self.settings.tenant_share is None:
            return None
        since = now - timedelta(seconds=self.settings.owner_ttl)
        return TenantShare(self.settings.tenant_share, since)

    def _refuse_if_open(self, record: BreakerRecord, now: datetime) -> None:
        verdict = breaker.verdict(record, now, self.policy)
        if not verdict.admit:
            raise _breaker_open(
                verdict.message
                or "the scheduling breaker opened while this create was queued; it is due "
                "for a trial create: retry",
                verdict.retry_after or 1.0,
            )

    async def _enqueue(self, tenant: TenantId, limit: int) -> int:
        now = utcnow()
        ticket = await self.store.enqueue_create(tenant, self.node_url, now, now + _lease(), limit)
        if ticket is None:
            raise LimitExceededError(
                f"every worker is full and the create queue is full: {limit} creates already "
                "wait for capacity across the deployment (queue_limit); retry later",
                limit="queue_limit",
                code="queue_full",
                retry_after=QUEUE_FULL_RETRY,
            )
        log.info("admission.queued", extra={"ticket": ticket, "tenant": tenant})
        return ticket

    async def _leave(self, ticket: int) -> None:
        try:
            await self.store.leave_queue(ticket)
        except Exception:  # the lease runs out by itself
            log.warning("admission.leave_failed", extra={"ticket": ticket}, exc_info=True)

    # -- the breaker's inputs --------------------------------------------------------------------
    async def trial_outcome(self, trial: str, *, success: bool) -> None:
        try:
            if await self.store.conclude_breaker_trial(trial, success, utcnow()):
                event = "breaker.closed" if success else "breaker.trial_inconclusive"
                log.warning(event, extra={"sandbox": trial})
        except Exception:  # the trial lease lets another create try
            log.warning("breaker.trial_not_recorded", extra={"sandbox": trial}, exc_info=True)

    async def scheduling_timeout(self, sandbox: Sandbox, reason: str) -> None:
        """A sandbox was not ready within the start timeout: count it (deployment-wide)."""
        if not self.enabled:
            return
        event = SchedulingTimeout(
            at=utcnow(),
            sandbox_name=sandbox.name,
            tenant_id=sandbox.tenant_id,
            node_url=self.node_url,
            reason=reason,
        )
        try:
            record = await self.store.record_scheduling_timeout(event, self.policy)
        except Exception:
            log.exception("breaker.timeout_not_recorded", extra={"sandbox": sandbox.name})
            return
        log.warning("sandbox.scheduling_timeout", extra={"sandbox": sandbox.name})
        if record.state == "open" and record.opened_at == event.at:
            log.error("breaker.opened", extra={"reason": record.reason})

    # -- GET /api/v1/admission -------------------------------------------------------------------
    async def status(self, tenant: TenantId | None) -> dict[str, Any]:
        """GET /api/v1/admission. `tenant` None (an admin key): the fleet-wide view, every
        queued create and every recent timeout, named. A tenant: only its own queued creates,
        its own recent timeouts and its limits; the breaker as is, since it answers everyone's
        creates (its count of timeouts included), but no global queue length."""
        now = utcnow()
        snapshot = await self.store.admission_snapshot(now)
        record = snapshot.breaker
        since = breaker.window_start(record, now, self.policy)
        window_start = now - timedelta(seconds=self.policy.window)
        recent = await self.store.list_scheduling_timeouts(window_start, RECENT_TIMEOUTS)
        breaker_view = {
            "state": record.state,
            "reason": record.reason,
            "opened_at": record.opened_at,
            "closes_at": record.open_until if record.state == "open" else None,
            "trial_started_at": record.trial_at if record.state == "half_open" else None,
            "threshold": self.policy.threshold,
            "window": self.policy.window,
            "open_for": self.policy.open_for,
            "counted_timeouts": sum(1 for t in recent if t.at >= since),
        }
        queue_config = {"limit": self.settings.queue_limit, "timeout": self.settings.queue_timeout}
        if tenant is None:
            return {
                "view": "fleet",
                "enabled": self.enabled,
                "queue": {"length": snapshot.queued, **queue_config},
                "breaker": breaker_view,
                "recent_timeouts": [
                    {
                        "at": t.at,
                        "sandbox": t.sandbox_name,
                        "tenant_id": t.tenant_id,
                        "instance": instance_label(t.node_url),
                        "reason": t.reason,
                    }
                    for t in recent
                ],
            }
        own = await self.store.list_tenant_scheduling_timeouts(
            tenant, window_start, RECENT_TIMEOUTS
        )
        limits = await self.limits(tenant)
        return {
            "view": "tenant",
            "enabled": self.enabled,
            "queue": {
                "your_queued": await self.store.count_tenant_queued(tenant, now),
                **queue_config,
            },
            "breaker": breaker_view,
            "recent_timeouts": [
                {
                    "at": t.at,
                    "sandbox": t.sandbox_name,
                    # which instance saw it, without telling tenants internal addresses
                    "instance": instance_label(t.node_url),
                    "reason": t.reason,
                }
                for t in own
            ],
            "tenant_limits": None
            if limits is None
            else {
                "rps": limits.rps,
                "burst": limits.bucket if limits.rps else None,
                "max_sandboxes": limits.max_sandboxes,
                "max_exec_jobs": limits.max_exec_jobs,
            },
        }


def _breaker_open(message: str, retry_after: float) -> UnavailableError:
    return UnavailableError(message, code="scheduling_breaker_open", retry_after=retry_after)


def instance_label(node_url: str) -> str:
    """A short stable name for an instance, safe to show to tenants."""
    return "i-" + hashlib.sha256(node_url.encode()).hexdigest()[:8]


def _quota_error(live: int, cap: int, *, exec_jobs: bool) -> LimitExceededError:
    name = "max_exec_jobs" if exec_jobs else "max_sandboxes"
    what = "queued or running exec jobs" if exec_jobs else "live sandboxes"
    return LimitExceededError(
        f"this tenant has {live} {what} and its quota {name} is {cap}; wait for one to "
        "finish (or delete one), or ask the operator to raise the quota (sandgate tenants limit)",
        limit=name,
        code="quota_exceeded",
        retry_after=QUOTA_RETRY,
    )


def _lease() -> timedelta:
    return timedelta(seconds=TICKET_LEASE)
