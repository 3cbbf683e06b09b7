"""The owner renewal a worker's heartbeat drives, under a real store fault: the SQLite file
write-locked by another connection. Its failure is recorded as the loop
"owner-renewal <worker>" that /readyz reads (sandgate.core.loops), and a renewal that
succeeds again clears it; the worker detaching drops it."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from sandgate.errors import StoreError
from tests.fast.conftest import Fast, until

pytestmark = pytest.mark.anyio

LOOP = "owner-renewal fast-worker"


async def test_a_failed_owner_renewal_is_recorded_until_one_succeeds(
    fast: Fast, tmp_path: Path
) -> None:
    state, workers = fast.services.state, fast.services.workers
    session = state.tunnels["fast-worker"]
    heartbeat = {"event": "heartbeat", "sandboxes": []}
    await workers.event(session, heartbeat)
    assert state.loops[LOOP].failures == 0 and state.loops[LOOP].last_ok_at is not None

    # in a thread, so the server's transactions in flight can finish (they need the loop)
    holder = sqlite3.connect(
        tmp_path / "sandgate.db", isolation_level=None, check_same_thread=False, timeout=10
    )
    await asyncio.to_thread(holder.execute, "BEGIN IMMEDIATE")  # other writers now wait 5 s
    try:
        with pytest.raises(StoreError, match="locked"):
            await workers.event(session, heartbeat)
    finally:
        await asyncio.to_thread(holder.execute, "ROLLBACK")
        holder.close()
    health = state.loops[LOOP]
    assert health.failures >= 1 and health.failing_since is not None
    assert "locked" in health.last_error, health.last_error

    await workers.event(session, heartbeat)
    assert state.loops[LOOP].failures == 0 and state.loops[LOOP].failing_since is None

    fast.link.close()  # the worker goes: so does its renewal's entry
    await until(lambda: _gone(fast))


async def _gone(fast: Fast) -> bool:
    return LOOP not in fast.services.state.loops
