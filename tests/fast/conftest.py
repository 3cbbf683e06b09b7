"""The whole control plane and a real worker service in one process, in seconds.

The real FastAPI app (its lifespan: store, registry, admission, recovery) on a real SQLite
file, reached through httpx's ASGI transport; the real `WorkerService` with the `process`
runtime (the agent is a real child process, without isolation); between them the real
tunnel code (`hub.serve_tunnel`, `TunnelClient.serve_link`) over an in-memory link. No
server or worker subprocess, no socket: nothing of the project is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandgate.api.app import create_app
from sandgate.api.deps import Services
from sandgate.cli.main import _create_key
from sandgate.config import ServerSettings, WorkerSettings
from sandgate.core.credentials import key_hash
from sandgate.tunnel.hub import serve_tunnel
from sandgate.tunnel.memory import MemoryLink
from sandgate.worker import budget
from sandgate.worker.main import assemble, install_agent
from sandgate.worker.runtime.process import ProcessRuntime
from sandgate.worker.service import WorkerService


@dataclass
class Fast:
    """One in-process deployment: `api` is tenant alpha's client, `beta` another tenant's."""

    api: httpx.AsyncClient
    beta: httpx.AsyncClient
    services: Services
    worker: WorkerService
    link: MemoryLink
    tasks: list[asyncio.Task[Any]]
    app: Any  # the FastAPI app, with our middlewares


async def until(check: Callable[[], Awaitable[bool]], within: float = 10.0) -> None:
    """Wait for a condition only the store or another task can make true (no event to
    wait on across that boundary): polled every 10 ms, failing after `within` seconds."""
    async with asyncio.timeout(within):
        for _ in iter(int, 1):
            if await check():
                return
            await asyncio.sleep(0.01)


async def _client(app: Any, key: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://sandgate.test",
        headers={"Authorization": f"Bearer {key}"},
        timeout=30.0,
    )


@contextlib.asynccontextmanager
async def fast_deployment(
    root: Path, *, capacity: int = 8, pools: dict[str, int] | None = None, **settings: Any
) -> AsyncIterator[Fast]:
    db = f"sqlite:///{root / 'sandgate.db'}"
    alpha_key = await _create_key(db, "alpha")
    beta_key = await _create_key(db, "beta")
    token = await _create_key(db, None, "fast-worker")
    app = create_app(ServerSettings(db_url=db, secret=secrets.token_hex(16), **settings))
    state_dir = root / "worker"
    agent_dir = state_dir / "agent"
    install_agent(agent_dir)
    runtime = ProcessRuntime(state_dir, agent_dir, worker_name="fast-worker")
    await runtime.prepare()
    features = runtime.features()
    features["enforces"] = budget.measure(state_dir, disk_quota=False)
    worker_settings = WorkerSettings(
        server_url="http://sandgate.test",
        token=token,
        name="fast-worker",
        capacity=capacity,
        runtime="process",
        state_dir=state_dir,
        pools=pools or {},
    )
    async with app.router.lifespan_context(app):
        services: Services = app.state.services
        service, client = assemble(worker_settings, runtime, features)
        link = MemoryLink()
        tasks = [
            asyncio.create_task(
                serve_tunnel(
                    link.server,
                    services.workers,
                    token_hash=key_hash(token),
                    handler=services.templates.answer_worker,
                )
            ),
            asyncio.create_task(service.run(lambda: client.serve_link(link.worker))),
        ]
        await asyncio.wait_for(client.connected.wait(), 10)
        await until(lambda: services.workers.is_connected("fast-worker"))  # serving too
        api, beta = await _client(app, alpha_key), await _client(app, beta_key)
        try:
            yield Fast(api, beta, services, service, link, tasks, app)
        finally:
            await api.aclose()
            await beta.aclose()
            link.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
async def fast(tmp_path: Path) -> AsyncIterator[Fast]:
    async with fast_deployment(tmp_path) as deployment:
        yield deployment


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
