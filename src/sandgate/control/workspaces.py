"""Workspaces, for the API: a tenant's persistent trees, their history, and the mounts a
create asks for.

A workspace belongs to the tenant whose credential made it: every lookup is by (tenant,
name), so another tenant's workspace is "not found", and the mount a provision carries names
the owner, which the worker checks against the owner it recorded (`worker/workspaces.py`).
Its files live on the workers' shared workspace root; its row's `worker` is the worker that
last had it mounted, where sandboxes using it are placed and its git operations are sent.
When that worker is gone, another takes it over (its flock on the image keeps two hosts from
ever mounting it at once).

Commits and restores hold the workspace's lock for the deployment (`store/workspace_lock.py`)
and carry its fence to the worker; reading the history (log, show) takes no lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Final

from sandgate.config import ServerSettings
from sandgate.control.workers import WorkerRegistry
from sandgate.core.clock import utcnow
from sandgate.core.workspaces import (
    ResolvedMount,
    WorkspaceMount,
    check_name,
    check_quota,
    new_workspace_id,
)
from sandgate.errors import (
    ConflictError,
    LimitExceededError,
    NotFoundError,
    SandgateError,
)
from sandgate.store.base import Sandbox, Store, WorkspaceRecord
from sandgate.store.workspace_lock import WorkspaceLocks

log = logging.getLogger(__name__)

CREATE_WAIT: Final = 120.0  # making the image and its first commit
GIT_WAIT: Final = 300.0  # a commit of a large tree, a restore


class WorkspaceService:
    def __init__(
        self,
        store: Store,
        workers: WorkerRegistry,
        settings: ServerSettings,
        locks: WorkspaceLocks | None = None,
    ) -> None:
        self.store = store
        self.workers = workers
        self.settings = settings
        self.locks = locks or WorkspaceLocks(settings.db_url, store.next_workspace_fence)

    # -- the workspaces ------------------------------------------------------------------------
    async def create(self, tenant: str, name: str, quota_mb: int | None) -> WorkspaceRecord:
        check_name(name)
        quota = check_quota(
            self.settings.default_workspace_mb if quota_mb is None else quota_mb,
            most=self.settings.max_workspace_mb,
        )
        owned = await self.store.list_workspaces(tenant)
        if len(owned) >= self.settings.max_workspaces:
            raise LimitExceededError(
                f"this tenant has {len(owned)} workspaces, the most it may have; delete one first",
                limit="max_workspaces",
                retry_after=0.0,
            )
        worker = await self._any_worker()
        now = utcnow()
        record = WorkspaceRecord(
            id=new_workspace_id(),
            tenant_id=tenant,
            name=name,
            quota_mb=quota,
            state="creating",
            worker=worker,
            fence=0,
            head=None,
            created_at=now,
            updated_at=now,
        )
        if not await self.store.insert_workspace(record):
            raise ConflictError(f"workspace {name} exists already", code="workspace_exists")
        fields = {"workspace": record.id, "owner": tenant, "quota_mb": quota}
        try:
            reply, _ = await self.workers.request(
                worker, "workspace_create", fields, wait=CREATE_WAIT
            )
        except BaseException:
            await self.store.delete_workspace(record.id)
            raise
        head = str(reply.get("head", {}).get("sha", "")) or None
        await self.store.set_workspace_state(record.id, "ready", from_states=("creating",), now=now)
        if head is not None:
            await self.store.set_workspace_head(record.id, head, utcnow())
        log.info("workspace.created", extra={"workspace": record.id, "worker": worker})
        return replace(record, state="ready", head=head)

    async def get(self, tenant: str, name: str) -> WorkspaceRecord:
        record = await self.store.get_workspace(tenant, name)
        if record is None or record.state != "ready":
            raise NotFoundError(f"workspace {name} not found", code="workspace_not_found")
        return record

    async def all(self, tenant: str) -> list[WorkspaceRecord]:
        return [r for r in await self.store.list_workspaces(tenant) if r.state == "ready"]

    async def users(self, record: WorkspaceRecord) -> list[str]:
        return [str(n) for n in await self.store.workspace_users(record.tenant_id, record.id)]

    async def delete(self, tenant: str, name: str) -> None:
        record = await self.get(tenant, name)
        users = await self.users(record)
        if users:
            raise ConflictError(
                f"workspace {name} is mounted by {', '.join(sorted(users))}; delete those "
                "sandboxes first",
                code="workspace_in_use",
            )
        worker = await self._worker_for(record)
        fields = {"workspace": record.id, "owner": tenant}
        await self.workers.request(worker, "workspace_delete", fields, wait=CREATE_WAIT)
        await self.store.delete_workspace(record.id)
        log.info("workspace.deleted", extra={"workspace": record.id})

    # -- history -------------------------------------------------------------------------------
    async def commit(
        self, tenant: str, name: str, message: str, *, sandbox: str | None = None
    ) -> dict[str, Any]:
        record = await self.get(tenant, name)
        fields = {"action": "commit", "message": message, "sandbox": sandbox}
        return await self._locked(record, fields)

    async def restore(
        self, tenant: str, name: str, commit: str, *, sandbox: str | None = None
    ) -> dict[str, Any]:
        record = await self.get(tenant, name)
        return await self._locked(record, {"action": "restore", "rev": commit, "sandbox": sandbox})

    async def log_page(
        self, tenant: str, name: str, *, limit: int, start: str | None
    ) -> dict[str, Any]:
        record = await self.get(tenant, name)
        return await self._read(record, {"action": "log", "limit": limit, "start": start})

    async def show(self, tenant: str, name: str, sha: str) -> dict[str, Any]:
        record = await self.get(tenant, name)
        return await self._read(record, {"action": "show", "rev": sha})

    async def auto_commit(self, sandbox: Sandbox, why: str) -> None:
        """Snapshot each workspace the sandbox mounted (it was deleted or expired); best
        effort: a failure is logged, the files stay and the next commit takes them."""
        for mount in sandbox.workspaces or ():
            name = mount.get("name", "")
            try:
                record = await self.store.get_workspace_by_id(mount.get("id", ""))
                if record is None or record.tenant_id != sandbox.tenant_id:
                    continue
                message = f"Sandbox {sandbox.name} {why}"
                await self._locked(
                    record, {"action": "commit", "message": message, "sandbox": sandbox.name}
                )
            except SandgateError as exc:
                log.warning(
                    "workspace.auto_commit_failed",
                    extra={"workspace": name, "sandbox": sandbox.name, "error": exc.message},
                )

    # -- mounts --------------------------------------------------------------------------------
    async def resolve(
        self, tenant: str, mounts: Sequence[WorkspaceMount]
    ) -> tuple[tuple[ResolvedMount, ...], str | None]:
        """The tenant's workspaces a create names, and the worker it must run on (the one
        that has them mounted, else the one that last had them), or None for any."""
        if not mounts:
            return (), None
        resolved: list[ResolvedMount] = []
        homes: set[str] = set()
        for mount in mounts:
            record = await self.get(tenant, mount.name)
            resolved.append(ResolvedMount(record.id, record.name, mount.path, tenant))
            if record.worker is not None and await self.workers.is_connected(record.worker):
                homes.add(record.worker)
        if len(homes) > 1:
            raise ConflictError(
                "these workspaces are mounted on different workers "
                f"({', '.join(sorted(homes))}); a sandbox mounts workspaces of one worker: "
                "mount them in two sandboxes, or wait until one is unmounted",
                code="workspaces_apart",
            )
        return tuple(resolved), next(iter(homes), None)

    async def placed(self, mounts: Sequence[ResolvedMount], worker: str) -> None:
        """Record that the sandbox mounting `mounts` was placed on `worker`."""
        for mount in mounts:
            record = await self.store.get_workspace_by_id(mount.id)
            if record is not None and record.worker != worker:
                await self.store.move_workspace(
                    mount.id, worker, expected=record.worker, now=utcnow()
                )

    # -- internals -----------------------------------------------------------------------------
    async def _locked(self, record: WorkspaceRecord, fields: dict[str, Any]) -> dict[str, Any]:
        async with self.locks.hold(record.id) as lease:
            worker = await self._worker_for(record)
            await lease.check()
            reply, _ = await self.workers.request(
                worker,
                "workspace_git",
                {"workspace": record.id, "owner": record.tenant_id, "fence": lease.fence, **fields},
                wait=GIT_WAIT,
            )
        commit = reply.get("commit")
        if isinstance(commit, dict) and isinstance(commit.get("sha"), str):
            await self.store.set_workspace_head(record.id, commit["sha"], utcnow())
        return dict(reply)

    async def _read(self, record: WorkspaceRecord, fields: dict[str, Any]) -> dict[str, Any]:
        worker = await self._worker_for(record)
        reply, payload = await self.workers.request(
            worker,
            "workspace_git",
            {"workspace": record.id, "owner": record.tenant_id, "fence": None, **fields},
            wait=GIT_WAIT,
        )
        answer = dict(reply)
        if answer.pop("patch_in_payload", False):
            answer["patch"] = payload.decode("utf-8", "replace")
        return answer

    async def _worker_for(self, record: WorkspaceRecord) -> str:
        """The workspace's worker if connected; else another takes it over."""
        if record.worker is not None and await self.workers.is_connected(record.worker):
            return record.worker
        worker = await self._any_worker()
        await self.store.move_workspace(record.id, worker, expected=record.worker, now=utcnow())
        return worker

    async def _any_worker(self) -> str:
        return await self.workers.offering("workspaces")
