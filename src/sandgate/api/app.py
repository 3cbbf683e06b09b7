"""create_app(settings): the ASGI app of one API instance."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from sandgate.api import errors, openapi, portal
from sandgate.api.deps import Services
from sandgate.api.e2b.dispatch import E2BDispatch
from sandgate.api.hot import HotPaths
from sandgate.api.internal_auth import InternalAuth
from sandgate.api.limits import BodyLimit
from sandgate.api.metrics import ApiMetrics, RequestMetrics
from sandgate.api.ports import is_proxied_path
from sandgate.api.request_context import RequestContext
from sandgate.api.routes import (
    admin,
    admission,
    contexts,
    exec_jobs,
    files,
    internal,
    ports,
    processes,
    pty,
    sandboxes,
    system,
    templates,
    workspaces,
)
from sandgate.config import ServerSettings
from sandgate.control.admission import Admission, instance_label
from sandgate.control.builds import BuildService
from sandgate.control.contexts import ContextService
from sandgate.control.create import CreatePipeline
from sandgate.control.exec_jobs import ExecJobService
from sandgate.control.peers import PeerClient
from sandgate.control.ports import PortService
from sandgate.control.reaper import Reaper
from sandgate.control.recovery import TIMEOUTS_KEPT, Recovery
from sandgate.control.sandboxes import SandboxService
from sandgate.control.state import ServerLocalState
from sandgate.control.supervisor import Loop, Supervisor
from sandgate.control.templates import TemplateService
from sandgate.control.toolbox import Toolbox
from sandgate.control.workers import WorkerRegistry
from sandgate.control.workspaces import WorkspaceService
from sandgate.errors import TunnelUnavailableError
from sandgate.faults import FAULTS
from sandgate.store.base import WorkerName
from sandgate.store.instance_lock import hold_instance_lock, release_instance_lock
from sandgate.store.sql import open_store
from sandgate.tunnel.hub import TunnelSession

log = logging.getLogger(__name__)


def create_app(settings: ServerSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        instance_lock = hold_instance_lock(settings.db_url)
        store = await open_store(settings.db_url)
        state = ServerLocalState()
        metrics = ApiMetrics(state, lambda: store.statements)
        store.observe_statement = metrics.store_statement.observe
        node_url = settings.node_url or f"http://{settings.host}:{settings.port}"
        peers = PeerClient(secret=settings.secret, state=state)
        workers = WorkerRegistry(
            store, state, node_url=node_url, peers=peers, owner_ttl=settings.owner_ttl
        )
        gate = Admission(store, state, settings, node_url=node_url)
        service = SandboxService(store, state, workers)
        creates = CreatePipeline(store, state, workers, settings, gate, service)

        async def deliver_waiting(session: TunnelSession) -> None:
            await creates.wake(WorkerName(session.worker))

        workers.on_serving = deliver_waiting  # a re-attached worker gets its creates at once
        toolbox = Toolbox(service, workers)
        jobs = ExecJobService(store, state, service, toolbox, settings, gate, node_url=node_url)
        templates_service = TemplateService(store, settings)
        workspaces_service = WorkspaceService(store, workers, settings)
        service.on_stopped = workspaces_service.auto_commit
        app.state.services = Services(
            settings,
            store,
            state,
            workers,
            service,
            creates,
            toolbox,
            jobs,
            gate,
            ContextService(toolbox),
            templates_service,
            BuildService(store, settings, templates_service, creates, toolbox, service),
            PortService(toolbox),
            workspaces_service,
            metrics,
        )
        try:
            # this instance holds no tunnel yet: records naming it are from before a crash or
            # restart, and would send creates to a tunnel that is gone until they expire
            if stale := await store.release_node_tunnels(node_url):
                log.warning("tunnel.stale_owners_released", extra={"records": stale})
        except Exception:
            log.exception("tunnel.stale_owners_not_released")  # they expire after owner_ttl
        try:
            if left := await jobs.fail_leftovers():
                log.warning("exec_jobs.failed_from_earlier_run", extra={"jobs": left})
        except Exception:
            log.exception("exec_jobs.leftovers_not_checked")  # recovery fails them later
        reaper = Reaper(service, interval=settings.reaper_interval, faults=settings.faults)
        recovery = Recovery(
            creates,
            store,
            node_url=node_url,
            after=settings.recovery_after,
            interval=settings.recovery_interval,
            orphan_after=settings.orphan_intervals * settings.recovery_interval
            + settings.orphan_grace,
            exec_job_retention=settings.exec_job_retention,
            sandbox_retention=settings.sandbox_retention,
            timeouts_kept=max(TIMEOUTS_KEPT, settings.breaker_threshold),
        )
        try:
            # the one task group of the instance's long-lived loops (control/supervisor.py)
            async with asyncio.TaskGroup() as tasks:
                supervisor = Supervisor(tasks, state.loops)
                for name, part in (("reaper", reaper), ("recovery", recovery)):
                    await supervisor.start(Loop(name, part.tick, part.interval, part.tick_timeout))
                for fault in sorted(settings.faults):
                    log.critical("fault.active", extra={"fault": fault, "does": FAULTS[fault]})
                log.info("server.started", extra={"node_url": node_url})
                try:
                    yield
                finally:
                    await jobs.aclose()  # running jobs are recorded failed, never left "running"
                    supervisor.cancel()  # the task group awaits the loops
        finally:
            await peers.aclose()
            for session in list(state.tunnels.values()):
                session.channel.close(TunnelUnavailableError("server shutting down"))
            await store.aclose()
            release_instance_lock(instance_lock)

    app = FastAPI(
        title="sandgate",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # openapi.install serves /docs from the package's own assets
        redoc_url=None,
    )
    errors.install(app)
    openapi.install(app)
    app.include_router(sandboxes.router)
    app.include_router(exec_jobs.router)
    app.include_router(admission.router)
    app.include_router(files.router)
    app.include_router(processes.router)
    app.include_router(pty.router)
    app.include_router(ports.router)
    app.include_router(contexts.router)
    app.include_router(templates.router)
    app.include_router(workspaces.router)
    app.include_router(system.router)
    app.include_router(internal.router)
    app.include_router(admin.router)
    portal.install(app)  # last: /ui's catch-all comes after every API route
    # innermost of ours: the hot path still has its body limited, metrics, request ids
    app.add_middleware(HotPaths, fastapi=app)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_json_bytes,
        streaming_suffixes=("/toolbox/files", "/stdin", "/api/v1/templates"),
        idle_timeout=settings.body_idle_timeout,
        proxied=is_proxied_path,  # a sandbox's ports: their route authenticates first
    )
    app.add_middleware(
        InternalAuth, secret=settings.secret, idle_timeout=settings.body_idle_timeout
    )
    # outermost: E2B's REST API and envd (api/e2b) share the port, each with its own limits
    app.add_middleware(E2BDispatch, state=app.state, settings=settings)
    app.add_middleware(RequestMetrics, state=app.state)  # every request, timed
    # outermost: each request's id and context for every line logged while it is served
    node = settings.node_url or f"http://{settings.host}:{settings.port}"
    app.add_middleware(RequestContext, instance=instance_label(node))
    return app
