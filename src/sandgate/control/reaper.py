"""The reaper: stops and removes sandboxes past `expires_at`. Idempotent; trusts the store."""

from __future__ import annotations

import asyncio
import logging

from sandgate.control.sandboxes import SandboxService

log = logging.getLogger(__name__)


class Reaper:
    def __init__(self, sandboxes: SandboxService, *, interval: float, tick_timeout: float = 60.0):
        self.sandboxes = sandboxes
        self.interval = interval
        self.tick_timeout = tick_timeout

    async def run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.tick_timeout):
                    await self.sandboxes.expire_due()
            except TimeoutError:
                log.warning("reaper.tick_timeout")
            except Exception:
                # a store hiccup must not stop the reaper; the next tick retries
                log.exception("reaper.tick_failed")
            await asyncio.sleep(self.interval)
