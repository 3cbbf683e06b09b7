"""Recovery: every instance delivers create jobs that nobody finished, and fails exec jobs
whose instance died.

A create is accepted (rows committed) and then delivered; the accepting process may die in
between. Each tick claims pending jobs untouched for `after` seconds by compare-and-swap
(exactly one instance wins each) and delivers them. Idempotent; trusts the store.

Each tick also renews this instance's heartbeat in the store, and fails the unfinished exec
jobs of instances whose heartbeat is older than `orphan_after` seconds: a command may have
had side effects, so it is never re-run, only reported failed with a reason. And it deletes
finished exec jobs (their output with them) past `exec_job_retention`, or whose sandbox is
gone, so the table does not grow without bound; the same for ended sandboxes (with their
create jobs and idempotency records) past `sandbox_retention`, stale tunnel owners, dead
instances, expired queue tickets and surplus scheduling timeouts (`_sweep`; the bound of every
table is in docs/state.md, "What grows and what bounds it").

It runs as the loop "recovery" of the instance's supervisor (`control/supervisor.py`), which
repeats `tick` every `interval` s, bounded by `tick_timeout`, and restarts it with backoff
when it fails.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta

from sandgate.control.create import CreatePipeline
from sandgate.control.exec_jobs import OVERDUE_GRACE
from sandgate.core.clock import utcnow
from sandgate.store.base import OVERDUE_EXEC_JOB, Store

log = logging.getLogger(__name__)

CLAIM_BATCH = 20
SWEEP_BATCH = 500  # exec jobs deleted per tick at most (past retention, or sandbox gone)
STALE_OWNER_AFTER = 3600.0  # a tunnel owner record not renewed this long is deleted
DEAD_INSTANCE_AFTER = 3600.0  # an instance silent this long (and 10 x orphan_after) too
TIMEOUTS_KEPT = 1000  # scheduling timeouts kept at most (or the breaker threshold, if higher)


class Recovery:
    def __init__(
        self,
        sandboxes: CreatePipeline,
        store: Store,
        *,
        node_url: str,
        after: float,
        interval: float,
        orphan_after: float | None = None,
        tick_timeout: float = 120.0,
        exec_job_retention: float = 24 * 3600.0,
        sandbox_retention: float = 24 * 3600.0,
        timeouts_kept: int = TIMEOUTS_KEPT,
    ) -> None:
        self.sandboxes = sandboxes
        self.store = store
        self.node_url = node_url
        self.after = after
        self.interval = interval
        self.tick_timeout = tick_timeout
        self.exec_job_retention = exec_job_retention
        self.sandbox_retention = sandbox_retention
        self.timeouts_kept = timeouts_kept
        # an instance silent this long is dead (default: 3 intervals + 30 s)
        self.orphan_after = orphan_after if orphan_after is not None else 3 * interval + 30.0

    async def _fail_overdue_exec_jobs(self, now: datetime) -> None:
        """Jobs of a live instance whose start or result the store lost: failed, not re-run
        (else they would hang as queued/running forever and hold the tenant's quota)."""
        before = now - timedelta(seconds=OVERDUE_GRACE)
        for job in await self.store.list_overdue_exec_jobs(before, CLAIM_BATCH):
            if await self.store.fail_exec_job_as_seen(job, OVERDUE_EXEC_JOB, now):
                log.warning("recovery.exec_job_overdue", extra={"job": job.id})

    async def _sweep(self, now: datetime) -> None:
        """Delete what is past its retention, at most SWEEP_BATCH rows of each per tick."""
        dead = max(DEAD_INSTANCE_AFTER, 10 * self.orphan_after)
        swept = {
            "sandboxes": await self.store.sweep_sandboxes(
                now - timedelta(seconds=self.sandbox_retention), SWEEP_BATCH
            ),
            "tunnel_owners": await self.store.sweep_tunnel_owners(
                now - timedelta(seconds=STALE_OWNER_AFTER), SWEEP_BATCH
            ),
            "instances": await self.store.sweep_instances(
                now - timedelta(seconds=dead), SWEEP_BATCH
            ),
            "admission_tickets": await self.store.sweep_admission_tickets(now, SWEEP_BATCH),
            "scheduling_timeouts": await self.store.sweep_scheduling_timeouts(
                self.timeouts_kept, SWEEP_BATCH
            ),
        }
        if any(swept.values()):
            log.info("recovery.swept", extra={k: v for k, v in swept.items() if v})

    async def tick(self) -> int:
        now = utcnow()
        await self.store.heartbeat_instance(self.node_url, now)
        orphaned = await self.store.fail_orphaned_exec_jobs(
            now - timedelta(seconds=self.orphan_after), now
        )
        if orphaned:
            log.warning("recovery.exec_jobs_orphaned", extra={"jobs": orphaned})
        await self._fail_overdue_exec_jobs(now)
        swept = await self.store.sweep_exec_jobs(
            now - timedelta(seconds=self.exec_job_retention), SWEEP_BATCH
        )
        if swept:
            log.info("recovery.exec_jobs_swept", extra={"jobs": swept})
        await self._sweep(now)
        claimed = await self.store.claim_stale_jobs(
            now - timedelta(seconds=self.after), self.node_url, now, CLAIM_BATCH
        )
        if claimed:
            log.info("recovery.claimed", extra={"jobs": len(claimed)})
            await asyncio.gather(*(self.sandboxes.recover(job) for job in claimed))
        return len(claimed)
