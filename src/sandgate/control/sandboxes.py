"""Sandboxes once they exist: read, list, the running check every call into one makes,
extend, delete, stop, expire. The create pipeline (accept, deliver, recover) is
`control.create`; calls into a running sandbox are `control.toolbox`."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import timedelta

from sandgate import log_context
from sandgate.agent.frames import Header
from sandgate.control.state import ServerLocalState
from sandgate.control.workers import WorkerRegistry
from sandgate.core.clock import utcnow
from sandgate.core.egress_policy import NetworkPolicy
from sandgate.errors import (
    ConflictError,
    NotFoundError,
    SandgateError,
)
from sandgate.store.base import (
    Sandbox,
    SandboxFilter,
    SandboxName,
    Store,
    TenantId,
)

log = logging.getLogger(__name__)

DESTROY_WAIT = 10.0  # then the worker's next heartbeat reconciles what it still runs
NETWORK_WAIT = 20.0  # a worker adds or removes a sandbox's link within this


class SandboxService:
    def __init__(self, store: Store, state: ServerLocalState, workers: WorkerRegistry) -> None:
        self.store = store
        self.state = state
        self.workers = workers
        # after a sandbox with workspaces stopped: they are committed (control/workspaces.py)
        self.on_stopped: Callable[[Sandbox, str], Awaitable[None]] | None = None

    # -- read --------------------------------------------------------------------------------
    async def get(self, tenant: TenantId, name: str) -> Sandbox:
        log_context.bind(sandbox=name)
        sandbox = await self.store.get_tenant_sandbox(tenant, SandboxName(name))
        if sandbox is None or sandbox.state == "deleted":
            raise NotFoundError(f"sandbox {name} not found")
        return sandbox

    async def owner(self, name: str) -> TenantId | None:
        """The tenant of sandbox `name`, for a credential that is the sandbox's own (E2B's
        envd and traffic tokens), None if there is none: remembered per name (it never
        changes), so a sandbox's stream of calls reads the store once."""
        tenant = self.state.tenant_of_sandbox(name)
        if tenant is None:
            record = await self.store.get_sandbox(SandboxName(name))
            if record is None:
                return None
            tenant = record.tenant_id
            self.state.remember_tenant_of_sandbox(name, tenant)
        return TenantId(tenant)

    async def list(self, tenant: TenantId, where: SandboxFilter) -> list[Sandbox]:
        return await self.store.list_sandboxes(tenant, where)

    async def running(self, tenant: TenantId, name: str) -> Sandbox:
        """The tenant's running sandbox; a read seen within the last second is reused.

        Safe under N instances: a sandbox stopped elsewhere within that second is gone from
        its worker too, whose answer (409 not running) is the final word.
        """
        log_context.bind(sandbox=name)
        cached = self.state.cached_running(tenant, name)
        if cached is not None:
            return cached
        sandbox = await self.get(tenant, name)
        if sandbox.state != "running":
            raise ConflictError(
                f"sandbox {name} is {sandbox.state}, not running", code="not_running"
            )
        self.state.cache_running(tenant, sandbox)
        return sandbox

    # -- change ------------------------------------------------------------------------------
    async def extend(self, tenant: TenantId, name: str, seconds: float) -> Sandbox:
        sandbox = await self.running(tenant, name)
        now = utcnow()
        expires_at = now + timedelta(seconds=seconds)
        self.state.forget_running(tenant, name)
        if not await self.store.set_expiry(sandbox.name, expires_at, now):
            raise ConflictError(f"sandbox {name} is no longer running", code="not_running")
        return replace(sandbox, expires_at=expires_at, updated_at=now)

    async def set_network(self, tenant: TenantId, name: str, policy: NetworkPolicy) -> Header:
        """Give the tenant's running sandbox another network policy: recorded first (a retry
        of the same PUT is harmless), then applied by its worker to new connections and DNS
        queries; connections already open stay."""
        sandbox = await self.running(tenant, name)
        now = utcnow()
        self.state.forget_running(tenant, name)
        stored = await self.store.set_network(sandbox.name, policy.enabled, policy.rules(), now)
        if not stored:
            raise ConflictError(f"sandbox {name} is no longer running", code="not_running")
        fields = {"name": sandbox.name, "network": policy.to_json()}
        state, _ = await self.workers.request(
            sandbox.worker, "set_network", fields, wait=NETWORK_WAIT
        )
        return state

    async def network(self, tenant: TenantId, name: str) -> Header:
        """The running sandbox's policy and its gate's counters, from its worker."""
        sandbox = await self.running(tenant, name)
        state, _ = await self.workers.request(
            sandbox.worker, "network", {"name": sandbox.name}, wait=NETWORK_WAIT
        )
        return state

    async def delete(self, tenant: TenantId, name: str) -> None:
        sandbox = await self.get(tenant, name)
        await self.stop(sandbox, "deleted", reason=None)

    async def stop(self, sandbox: Sandbox, state: str, *, reason: str | None) -> bool:
        """Mark the sandbox gone first (no resurrection), cancel its jobs, then destroy it."""
        self.state.forget_running(sandbox.tenant_id, sandbox.name)
        now = utcnow()
        moved = await self.store.set_sandbox_state(
            sandbox.name,
            state,  # type: ignore[arg-type]
            from_states=("pending", "running", "stopped", "error"),
            error=reason,
            now=now,
        )
        await self.store.fail_sandbox_jobs(sandbox.name, f"sandbox {state}", now)
        if moved:  # another instance that moved it first also takes it down
            await self.destroy_on_worker(sandbox)
            if sandbox.workspaces and self.on_stopped is not None:
                why = "expired" if reason == "timeout reached" else state
                await self.on_stopped(sandbox, why)
        return moved

    async def destroy_on_worker(self, sandbox: Sandbox) -> None:
        """Best effort: a worker we cannot reach removes it on its next heartbeat or hello."""
        try:
            fields = {"name": sandbox.name}
            await self.workers.request(sandbox.worker, "destroy", fields, wait=DESTROY_WAIT)
        except SandgateError as exc:
            log.warning(
                "sandbox.destroy_failed", extra={"sandbox": sandbox.name, "error": exc.message}
            )

    async def expire_due(self, limit: int = 100) -> int:
        due = await self.store.list_expired(utcnow(), limit)
        for sandbox in due:
            await self.stop(sandbox, "stopped", reason="timeout reached")
            log.info("sandbox.expired", extra={"sandbox": sandbox.name})
        return len(due)
