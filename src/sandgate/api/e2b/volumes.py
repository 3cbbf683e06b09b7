"""E2B's volumes (`/volumes`, `Sandbox.create(volume_mounts=)`) as sandgate's workspaces.

A volume is a workspace of the caller's tenant (control/workspaces.py): `Volume.create(name)`
makes the workspace of that name with the deployment's default quota, and its `volumeID` is
the workspace's id (`ws-...`). `/volumes/{volumeID}` also takes the name, so a volume made
with the native API or the CLI can be connected by the name it is known by. Another
tenant's volume is "not found", exactly like one that does not exist.

Names follow sandgate's rule (core/workspaces.check_name): 1-63 lowercase letters, digits,
'.', '_' or '-'. E2B's own rule also allows capitals, a leading '_' or '-' and any length;
such a name is refused (400, naming the rule) rather than folded onto another name, since
"Data" and "data" are two volumes in E2B.

`volumeMounts` of a create are the create's workspaces, with E2B's home taken as sandgate's
(`/home/user/x` is `/workspace/x`, as in every path the SDK sends). The `token` E2B issues
for its volume content API (`/volumecontent/...`) is a constant here: that API is not served.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, Field

from sandgate.api.deps import Services, services, tenant
from sandgate.api.e2b.caller import sandbox_path
from sandgate.core.workspaces import WorkspaceMount, check_name, parse_mounts
from sandgate.errors import InvalidRequestError, NotFoundError, NotSupportedError
from sandgate.store.base import Sandbox, TenantId, WorkspaceRecord

NAME_RULE = (
    "1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit "
    "(sandgate's workspace names; E2B also allows capitals, which sandgate does not)"
)

# E2B's token for its volume content API, which is not served (volume_content below): it
# authenticates nothing. Not empty, since an HTTP client refuses the header "Bearer ".
CONTENT_TOKEN = "sandgate-volume-content-not-served"

Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]

router = APIRouter(tags=["e2b"])


class NewVolume(BaseModel):
    name: str = Field(min_length=1, max_length=255)


def volume_name(name: Any) -> str:
    """An E2B volume name that names a workspace, or a 400 naming the rule."""
    try:
        return check_name(name)
    except InvalidRequestError:
        message = f"volume name {name!r} is not valid here: use {NAME_RULE}"
        raise InvalidRequestError(message) from None


def volume_mounts(value: Any) -> tuple[WorkspaceMount, ...]:
    """E2B's `volumeMounts` ([{name, path}]) as the create's workspace mounts; the paths are
    E2B's, so `/home/user/...` is `/workspace/...`, and must pass check_mount_path."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list):
        raise InvalidRequestError("volumeMounts must be a list of {name, path}")
    items: list[dict[str, str]] = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("path"), str):
            raise InvalidRequestError("each of volumeMounts is {name, path}")
        items.append({"name": volume_name(item.get("name")), "path": sandbox_path(item["path"])})
    return parse_mounts(None, items)


def mounts_out(sandbox: Sandbox) -> list[dict[str, str]]:
    """A sandbox's workspaces as E2B's `volumeMounts` (the paths it really has)."""
    return [
        {"name": m.get("name", ""), "path": m.get("path", "")} for m in sandbox.workspaces or ()
    ]


def _info(record: WorkspaceRecord) -> dict[str, str]:
    return {"volumeID": record.id, "name": record.name}


def _with_token(record: WorkspaceRecord) -> dict[str, str]:
    return _info(record) | {"token": CONTENT_TOKEN}


async def _volume(svc: Services, who: TenantId, volume_id: str) -> WorkspaceRecord:
    """The tenant's volume by its id, else by its name; anything else is not found."""
    if volume_id.startswith("ws-"):
        record = await svc.store.get_workspace_by_id(volume_id)
        if record is not None and record.tenant_id == who and record.state == "ready":
            return record
    try:
        return await svc.workspaces.get(who, volume_id)
    except NotFoundError:
        raise NotFoundError(f"volume {volume_id} not found", code="workspace_not_found") from None


@router.post("/volumes", status_code=201)
async def create_volume(body: NewVolume, who: Tenant, svc: Svc) -> dict[str, str]:
    record = await svc.workspaces.create(who, volume_name(body.name), None)
    return _with_token(record)


@router.get("/volumes")
async def list_volumes(who: Tenant, svc: Svc) -> list[dict[str, str]]:
    return [_info(r) for r in sorted(await svc.workspaces.all(who), key=lambda r: r.name)]


@router.get("/volumes/{volume_id}")
async def get_volume(volume_id: str, who: Tenant, svc: Svc) -> dict[str, str]:
    return _with_token(await _volume(svc, who, volume_id))


@router.delete("/volumes/{volume_id}", status_code=204)
async def destroy_volume(volume_id: str, who: Tenant, svc: Svc) -> Response:
    """A volume a running sandbox mounts is not destroyed (409): kill the sandbox first."""
    record = await _volume(svc, who, volume_id)
    await svc.workspaces.delete(who, record.name)
    return Response(status_code=204)


@router.api_route("/volumecontent/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def volume_content() -> None:
    """Volume files without a sandbox: not served. Answered without a key (the SDK sends
    the volume's token here, not the API key), and it says nothing about any volume."""
    raise NotSupportedError(
        "sandgate does not serve E2B's volume content API (/volumecontent) yet: read and "
        "write a volume's files in a sandbox that mounts it (volume_mounts=, docs/e2b.md)"
    )
