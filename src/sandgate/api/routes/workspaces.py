"""`/api/v1/workspaces`: a tenant's persistent trees and their git history
(control/workspaces.py). Every route looks the workspace up by the credential's tenant and
its name: another tenant's is 404, exactly like one that does not exist."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response

from sandgate.api.deps import Services, services, tenant
from sandgate.api.responses import DISK, JSON_BODY, PARAMS, TENANT, WORKER, error_docs
from sandgate.api.schemas import CommitIn, CreateWorkspace, RestoreIn, WorkspaceList, WorkspaceOut
from sandgate.store.base import TenantId, WorkspaceRecord

router = APIRouter(prefix="/api/v1/workspaces", tags=["workspaces"])

Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]

# the workspace's worker does it: no such workspace or commit (404), in use or busy on
# another worker (409), no worker serves workspaces (501), the git operation failed (502), the
# workspace's lock is held (503), no answer in time (504); 400: a revision it cannot read
GIT = (400, 404, 409, 501, *WORKER)


async def workspace_out(svc: Services, record: WorkspaceRecord) -> dict[str, Any]:
    return WorkspaceOut(
        name=record.name,
        id=record.id,
        quota_mb=record.quota_mb,
        head=record.head,
        mounted_by=sorted(await svc.workspaces.users(record)),
        created_at=record.created_at,
        updated_at=record.updated_at,
    ).model_dump(mode="json")


@router.post(
    "",
    status_code=201,
    response_model=WorkspaceOut,
    responses=error_docs(TENANT, JSON_BODY, 409, 501, WORKER, DISK),  # 409: the name is taken
)
async def create_workspace(body: CreateWorkspace, who: Tenant, svc: Svc) -> dict[str, Any]:
    record = await svc.workspaces.create(who, body.name, body.quota_mb)
    return await workspace_out(svc, record)


@router.get("", response_model=WorkspaceList, responses=error_docs(TENANT))
async def list_workspaces(who: Tenant, svc: Svc) -> dict[str, Any]:
    return {"workspaces": [await workspace_out(svc, r) for r in await svc.workspaces.all(who)]}


@router.get("/{name}", response_model=WorkspaceOut, responses=error_docs(TENANT, 404))
async def get_workspace(name: str, who: Tenant, svc: Svc) -> dict[str, Any]:
    return await workspace_out(svc, await svc.workspaces.get(who, name))


@router.delete("/{name}", status_code=204, responses=error_docs(TENANT, 404, 409, 501, WORKER))
async def delete_workspace(name: str, who: Tenant, svc: Svc) -> Response:
    await svc.workspaces.delete(who, name)
    return Response(status_code=204)


@router.post("/{name}/commits", status_code=201, responses=error_docs(TENANT, JSON_BODY, GIT, DISK))
async def commit_workspace(name: str, body: CommitIn, who: Tenant, svc: Svc) -> dict[str, Any]:
    """Snapshot the workspace: `commit`, `created` (false: nothing changed since the last
    commit) and `skipped` (files above the size rule, left out)."""
    return await svc.workspaces.commit(who, name, body.message)


@router.get("/{name}/commits", responses=error_docs(TENANT, PARAMS, GIT))
async def list_commits(
    name: str,
    who: Tenant,
    svc: Svc,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    start: Annotated[str | None, Query(min_length=4, max_length=40, pattern="^[0-9a-f]+$")] = None,
) -> dict[str, Any]:
    """Newest first; `next` is the `start` of the next page (null at the end)."""
    return await svc.workspaces.log_page(who, name, limit=limit, start=start)


@router.get("/{name}/commits/{sha}", responses=error_docs(TENANT, GIT))
async def show_commit(name: str, sha: str, who: Tenant, svc: Svc) -> dict[str, Any]:
    """The commit with its diff against its parent: `files` (stat) and `patch`."""
    return await svc.workspaces.show(who, name, sha)


@router.post("/{name}/restore", responses=error_docs(TENANT, JSON_BODY, GIT, DISK))
async def restore_workspace(name: str, body: RestoreIn, who: Tenant, svc: Svc) -> dict[str, Any]:
    """Bring the files back to a commit: the current state is committed first, then the
    restore is a commit of its own, so nothing is lost."""
    return await svc.workspaces.restore(who, name, body.commit)
