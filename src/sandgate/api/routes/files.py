"""`/api/v1/sandboxes/{name}/toolbox/files`: streamed upload/download and file operations.

Data crosses the tunnel in chunks of `file_chunk_bytes`, a few of a file under way at once
(`control/transfers.py`), so neither end holds a whole file in memory.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse

from sandgate.api.deps import Services, services, tenant
from sandgate.api.responses import AGENT, DISK, JSON_BODY, PARAMS, RAW_BODY, TENANT, error_docs
from sandgate.api.schemas import FileEntry, FileList, MakeDir, Move
from sandgate.control.toolbox import Download
from sandgate.store.base import TenantId

router = APIRouter(prefix="/api/v1/sandboxes/{name}/toolbox/files", tags=["files"])

Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]
MAX_PATH_CHARS = 4096  # a `path` query's bound (api/hot.py checks it the same way)
PathQuery = Annotated[str, Query(min_length=1, max_length=MAX_PATH_CHARS)]


@router.put(
    "", response_model=FileEntry, responses=error_docs(TENANT, PARAMS, RAW_BODY, AGENT, DISK)
)
async def upload(name: str, path: PathQuery, request: Request, who: Tenant, svc: Svc) -> Any:
    declared = request.headers.get("content-length", "")
    entry = await svc.toolbox.upload(
        who,
        name,
        path,
        request.stream(),
        chunk_bytes=svc.settings.file_chunk_bytes,
        max_bytes=svc.settings.max_upload_bytes,
        declared_size=int(declared) if declared.isdigit() else None,
    )
    return entry.model_dump()


@router.get(
    "",
    responses={
        **error_docs(TENANT, PARAMS, AGENT),
        200: {"content": {"application/octet-stream": {}}},
    },
)
async def download(name: str, path: PathQuery, who: Tenant, svc: Svc) -> Response:
    opened = await svc.toolbox.download(who, name, path, chunk_bytes=svc.settings.file_chunk_bytes)
    filename = path.rstrip("/").rsplit("/", 1)[-1] or "download"
    disposition = (
        f'attachment; filename="{_ascii_name(filename)}"; '
        f"filename*=UTF-8''{quote(filename, safe='')}"
    )
    return file_response(opened, {"Content-Disposition": disposition})


def file_response(opened: Download, headers: dict[str, str]) -> Response:
    """A download's answer: one body when the whole file came with the open (no stream
    to run: a file of one chunk), else its chunks streamed as they are read."""
    headers = {"Content-Length": str(opened.size), **headers}
    if opened.whole is not None:
        return Response(opened.whole, media_type="application/octet-stream", headers=headers)
    return StreamingResponse(opened.chunks, media_type="application/octet-stream", headers=headers)


@router.delete("", status_code=204, responses=error_docs(TENANT, PARAMS, AGENT))
async def remove(
    name: str,
    path: PathQuery,
    who: Tenant,
    svc: Svc,
    recursive: bool = False,
) -> None:
    await svc.toolbox.remove(who, name, path, recursive=recursive)


@router.get("/list", response_model=FileList, responses=error_docs(TENANT, PARAMS, AGENT))
async def list_dir(name: str, who: Tenant, svc: Svc, path: PathQuery = "/workspace") -> Any:
    return {"entries": [e.model_dump() for e in await svc.toolbox.list_dir(who, name, path)]}


@router.get("/stat", response_model=FileEntry, responses=error_docs(TENANT, PARAMS, AGENT))
async def stat(name: str, path: PathQuery, who: Tenant, svc: Svc) -> Any:
    return (await svc.toolbox.stat(who, name, path)).model_dump()


@router.post(
    "/mkdir",
    response_model=FileEntry,
    status_code=201,
    responses=error_docs(TENANT, JSON_BODY, AGENT, DISK),
)
async def mkdir(name: str, body: MakeDir, who: Tenant, svc: Svc) -> Any:
    return (await svc.toolbox.mkdir(who, name, body.path, parents=body.parents)).model_dump()


@router.post(
    "/move", response_model=FileEntry, responses=error_docs(TENANT, JSON_BODY, AGENT, DISK)
)
async def move(name: str, body: Move, who: Tenant, svc: Svc) -> Any:
    moved = await svc.toolbox.move(
        who, name, body.source, body.destination, overwrite=body.overwrite
    )
    return moved.model_dump()


def _ascii_name(filename: str) -> str:
    """The RFC 6266 fallback name: printable ASCII only (the real name is in filename*)."""
    return "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in filename)
