"""`/api/v1/sandboxes/{name}/toolbox/files`: streamed upload/download and file operations.

Data crosses the tunnel in chunks of `file_chunk_bytes`, each acknowledged before the next
is sent, so neither end holds a whole file in memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from sandgate.api.deps import Services, services, tenant
from sandgate.api.routes.sandboxes import error_docs
from sandgate.api.schemas import FileEntry, FileList, MakeDir, Move
from sandgate.control.replies import EntriesReply, EntryReply, HandleReply, OpenReadReply, parse
from sandgate.errors import PayloadTooLargeError, SandgateError, WorkerError
from sandgate.store.base import Sandbox, TenantId

router = APIRouter(prefix="/api/v1/sandboxes/{name}/toolbox/files", tags=["files"])

Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]
PathQuery = Annotated[str, Query(min_length=1, max_length=4096)]


@router.put("", response_model=FileEntry, responses=error_docs())
async def upload(name: str, path: PathQuery, request: Request, who: Tenant, svc: Svc) -> Any:
    await _refuse_past_the_quota(request, await svc.sandboxes.get(who, name))
    call = svc.sandboxes.agent_call
    raw, _ = await call(who, name, {"op": "open_write", "path": path})
    handle = parse(HandleReply, raw).handle
    committed = False
    try:
        total = 0
        pending = bytearray()
        chunk = svc.settings.file_chunk_bytes
        async for data in request.stream():
            total += len(data)
            if total > svc.settings.max_upload_bytes:
                raise PayloadTooLargeError(
                    f"upload over {svc.settings.max_upload_bytes} bytes; split the file"
                )
            pending += data
            while len(pending) >= chunk:
                await call(who, name, {"op": "write", "handle": handle}, bytes(pending[:chunk]))
                del pending[:chunk]
        if pending:
            await call(who, name, {"op": "write", "handle": handle}, bytes(pending))
        raw, _ = await call(who, name, {"op": "close_write", "handle": handle, "commit": True})
        committed = True
        return parse(EntryReply, raw).entry.model_dump()
    finally:
        if not committed:
            await asyncio.shield(_discard(svc, who, name, handle))


async def _refuse_past_the_quota(request: Request, sandbox: Sandbox) -> None:
    """An upload whose declared size cannot fit the sandbox's disk quota is refused before
    a byte is written (one that only turns out too large answers 507 when the disk fills)."""
    disk_mb = sandbox.resources.get("disk_mb")
    declared = request.headers.get("content-length", "")
    if isinstance(disk_mb, int) and declared.isdigit() and int(declared) > disk_mb << 20:
        raise PayloadTooLargeError(
            f"an upload of {int(declared)} bytes cannot fit this sandbox's disk quota of "
            f"{disk_mb} MiB (resources.disk_mb, /workspace and /tmp together); create the "
            "sandbox with a larger disk_mb",
            code="disk_quota_exceeded",
        )


async def _discard(svc: Services, who: TenantId, name: str, handle: int | str) -> None:
    try:
        await svc.sandboxes.agent_call(
            who, name, {"op": "close_write", "handle": handle, "commit": False}
        )
    except SandgateError:
        pass  # the agent closes idle handles itself


@router.get("", responses={**error_docs(), 200: {"content": {"application/octet-stream": {}}}})
async def download(name: str, path: PathQuery, who: Tenant, svc: Svc) -> StreamingResponse:
    call = svc.sandboxes.agent_call
    raw, _ = await call(who, name, {"op": "open_read", "path": path})
    opened = parse(OpenReadReply, raw)
    handle, size = opened.handle, opened.size
    chunk = svc.settings.file_chunk_bytes

    async def body() -> AsyncIterator[bytes]:
        sent = 0
        try:
            while sent < size:
                _, data = await call(
                    who, name, {"op": "read", "handle": handle, "length": min(chunk, size - sent)}
                )
                if not data or len(data) > size - sent:
                    raise WorkerError(f"{path} changed size while it was being downloaded")
                sent += len(data)
                yield data
        finally:
            await asyncio.shield(_close_read(svc, who, name, handle))

    filename = path.rstrip("/").rsplit("/", 1)[-1] or "download"
    disposition = (
        f'attachment; filename="{_ascii_name(filename)}"; '
        f"filename*=UTF-8''{quote(filename, safe='')}"
    )
    return StreamingResponse(
        body(),
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(size),
            "Content-Disposition": disposition,
        },
    )


async def _close_read(svc: Services, who: TenantId, name: str, handle: int | str) -> None:
    try:
        await svc.sandboxes.agent_call(who, name, {"op": "close_read", "handle": handle})
    except SandgateError:
        pass


@router.delete("", status_code=204, responses=error_docs())
async def remove(
    name: str,
    path: PathQuery,
    who: Tenant,
    svc: Svc,
    recursive: bool = False,
) -> None:
    await svc.sandboxes.agent_call(
        who, name, {"op": "remove", "path": path, "recursive": recursive}
    )


@router.get("/list", response_model=FileList, responses=error_docs())
async def list_dir(name: str, who: Tenant, svc: Svc, path: PathQuery = "/workspace") -> Any:
    raw, _ = await svc.sandboxes.agent_call(who, name, {"op": "list", "path": path})
    return {"entries": [e.model_dump() for e in parse(EntriesReply, raw).entries]}


@router.get("/stat", response_model=FileEntry, responses=error_docs())
async def stat(name: str, path: PathQuery, who: Tenant, svc: Svc) -> Any:
    raw, _ = await svc.sandboxes.agent_call(who, name, {"op": "stat", "path": path})
    return parse(EntryReply, raw).entry.model_dump()


@router.post("/mkdir", response_model=FileEntry, status_code=201, responses=error_docs())
async def mkdir(name: str, body: MakeDir, who: Tenant, svc: Svc) -> Any:
    call = {"op": "mkdir", "path": body.path, "parents": body.parents}
    raw, _ = await svc.sandboxes.agent_call(who, name, call)
    return parse(EntryReply, raw).entry.model_dump()


@router.post("/move", response_model=FileEntry, responses=error_docs())
async def move(name: str, body: Move, who: Tenant, svc: Svc) -> Any:
    call = {"op": "move", "src": body.source, "dst": body.destination, "overwrite": body.overwrite}
    raw, _ = await svc.sandboxes.agent_call(who, name, call)
    return parse(EntryReply, raw).entry.model_dump()


def _ascii_name(filename: str) -> str:
    """The RFC 6266 fallback name: printable ASCII only (the real name is in filename*)."""
    return "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in filename)
