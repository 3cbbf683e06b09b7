"""Recovery: every instance delivers create jobs that nobody finished.

A create is accepted (rows committed) and then delivered; the accepting process may die in
between. Each tick claims pending jobs untouched for `after` seconds by compare-and-swap
(exactly one instance wins each) and delivers them. Idempotent; trusts the store.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from sandgate.control.sandboxes import SandboxService
from sandgate.control.workers import utcnow
from sandgate.store.base import Store

log = logging.getLogger(__name__)

CLAIM_BATCH = 20


class Recovery:
    def __init__(
        self,
        sandboxes: SandboxService,
        store: Store,
        *,
        node_url: str,
        after: float,
        interval: float,
        tick_timeout: float = 120.0,
    ) -> None:
        self.sandboxes = sandboxes
        self.store = store
        self.node_url = node_url
        self.after = after
        self.interval = interval
        self.tick_timeout = tick_timeout

    async def run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.tick_timeout):
                    await self.tick()
            except TimeoutError:
                log.warning("recovery.tick_timeout")
            except Exception:
                log.exception("recovery.tick_failed")  # the next tick retries
            await asyncio.sleep(self.interval)

    async def tick(self) -> int:
        now = utcnow()
        claimed = await self.store.claim_stale_jobs(
            now - timedelta(seconds=self.after), self.node_url, now, CLAIM_BATCH
        )
        if claimed:
            log.info("recovery.claimed", extra={"jobs": len(claimed)})
            await asyncio.gather(*(self.sandboxes.recover(job) for job in claimed))
        return len(claimed)
