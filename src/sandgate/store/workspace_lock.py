"""The one lock of a workspace for the whole deployment: its commits and restores run one at
a time, whichever instance serves them.

PostgreSQL: a session advisory lock (`pg_advisory_lock`, keyed by `core.workspaces.lock_key`)
taken on a connection of its own, opened for the hold and closed after it, so the lock goes
exactly when its holder does: a release, a crash (the server ends the session) or a dropped
connection. Each hold then takes the next of the workspace's fences from the store; the
operation carries it to the worker, which stops one whose fence is no longer the highest
before its next git step (`worker/workspaces.py`). `Lease.check()` asks the lock's connection
before each step the holder takes itself, so a holder whose connection dropped stops too.

SQLite serves one instance (`instance_lock.py`): an asyncio lock per workspace suffices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy.engine import make_url

from sandgate.core.workspaces import lock_key
from sandgate.errors import ConflictError, NotFoundError, UnavailableError

log = logging.getLogger(__name__)

LOCK_WAIT: Final = 60.0  # seconds a commit waits for the lock before 503
CHECK_TIMEOUT: Final = 5.0

Fence = Callable[[str], Awaitable[int | None]]


@dataclass
class Lease:
    """A held workspace lock: its fence, and a check that it is still held."""

    fence: int
    _check: Callable[[], Awaitable[None]]

    async def check(self) -> None:
        await self._check()


def _lost(ws_id: str) -> ConflictError:
    return ConflictError(
        f"the lock of workspace {ws_id} was lost (the store connection holding it dropped); "
        "the operation stopped: retry it",
        code="workspace_lock_lost",
    )


class WorkspaceLocks:
    def __init__(self, db_url: str, next_fence: Fence) -> None:
        url = make_url(db_url)
        self._pg_dsn: str | None = None
        if url.get_backend_name() == "postgresql":
            plain = url.set(drivername="postgresql")
            self._pg_dsn = plain.render_as_string(hide_password=False)
        self._next_fence = next_fence
        # workspace id -> its lock (SQLite only: one instance serves the store)
        self._local: dict[str, asyncio.Lock] = {}

    @property
    def deployment_wide(self) -> bool:
        return self._pg_dsn is not None

    @contextlib.asynccontextmanager
    async def hold(self, ws_id: str) -> AsyncIterator[Lease]:
        if self._pg_dsn is None:
            async with self._local_lock(ws_id):
                yield Lease(await self._fence(ws_id), _no_check)
            return
        import asyncpg  # type: ignore[import-untyped]

        try:
            conn = await asyncpg.connect(self._pg_dsn, timeout=10.0)
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            raise UnavailableError(
                f"cannot reach the store for workspace {ws_id}'s lock: {exc}"
            ) from exc
        try:
            try:
                await conn.execute(f"SET lock_timeout = '{int(LOCK_WAIT * 1000)}ms'")
                await conn.execute("SELECT pg_advisory_lock($1)", lock_key(ws_id))
            except asyncpg.exceptions.LockNotAvailableError:
                raise UnavailableError(
                    f"workspace {ws_id} is busy: another commit or restore held it for "
                    f"{LOCK_WAIT:g} s; retry",
                    code="workspace_lock_busy",
                    retry_after=5.0,
                ) from None

            async def check() -> None:
                try:
                    await conn.fetchval("SELECT 1", timeout=CHECK_TIMEOUT)
                except Exception as exc:
                    log.warning("workspace.lock_lost", extra={"workspace": ws_id})
                    raise _lost(ws_id) from exc

            yield Lease(await self._fence(ws_id), check)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 5.0)  # ends the session: the lock goes
            if not conn.is_closed():
                conn.terminate()

    def _local_lock(self, ws_id: str) -> asyncio.Lock:
        lock = self._local.get(ws_id)
        if lock is None:
            lock = self._local[ws_id] = asyncio.Lock()
        return lock

    async def _fence(self, ws_id: str) -> int:
        fence = await self._next_fence(ws_id)
        if fence is None:
            raise NotFoundError(f"workspace {ws_id} not found")
        return fence


async def _no_check(*_args: Any) -> None:
    return None
