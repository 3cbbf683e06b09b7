"""`/api/v1/sandboxes/{name}/toolbox/processes`: background processes, live output, stdin.

Output is pulled from the sandbox's agent by long-poll reads at an offset (the agent keeps
the last MiB per process), so any number of followers each keep their own place and no hop
buffers more than one answer.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import StreamingResponse

from sandgate.api.deps import Services, services, tenant
from sandgate.api.responses import AGENT, JSON_BODY, PARAMS, RAW_BODY, TENANT, error_docs
from sandgate.api.schemas import ProcessList, ProcessOut, Signal, StartProcess, Written
from sandgate.errors import InvalidRequestError, PayloadTooLargeError
from sandgate.store.base import TenantId

router = APIRouter(prefix="/api/v1/sandboxes/{name}/toolbox/processes", tags=["processes"])

Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]

FOLLOW_WAIT = 15.0  # seconds one long-poll read may wait for output
MAX_STDIN_BYTES = 8 << 20


@router.post(
    "", status_code=201, response_model=ProcessOut, responses=error_docs(TENANT, JSON_BODY, AGENT)
)
async def start(name: str, body: StartProcess, who: Tenant, svc: Svc) -> Any:
    pid = await svc.toolbox.start_process(
        who, name, body.command, cwd=body.cwd, env=body.env, time_limit=body.timeout
    )
    return (await svc.toolbox.process(who, name, pid)).model_dump()


@router.get("", response_model=ProcessList, responses=error_docs(TENANT, AGENT))
async def list_processes(name: str, who: Tenant, svc: Svc) -> Any:
    return {"processes": [p.model_dump() for p in await svc.toolbox.processes(who, name)]}


@router.get("/{pid}", response_model=ProcessOut, responses=error_docs(TENANT, PARAMS, AGENT))
async def get_process(name: str, pid: int, who: Tenant, svc: Svc) -> Any:
    return (await svc.toolbox.process(who, name, pid)).model_dump()


@router.get(
    "/{pid}/stream",
    responses={
        **error_docs(TENANT, PARAMS, AGENT),  # 400: a Last-Event-ID that is no offset
        200: {"content": {"text/event-stream": {}}},
    },
)
async def stream(
    name: str,
    pid: int,
    who: Tenant,
    svc: Svc,
    offset: Annotated[int | None, Query(ge=0)] = None,
    follow: Annotated[bool, Query(description="false: what is there now, then end")] = True,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    start_at = offset
    if start_at is None and last_event_id:
        try:
            start_at = max(0, int(last_event_id))
        except ValueError:
            raise InvalidRequestError("Last-Event-ID must be an output offset") from None
    # the first read fails fast (404, 409) before the 200 is committed
    read = svc.toolbox.process_output
    first = await read(who, name, pid, start_at or 0, wait=0.0)

    async def events() -> AsyncIterator[bytes]:
        page = first
        position = start_at or 0
        while True:
            if page.first_offset > position:
                yield _event("dropped", {"bytes": page.first_offset - position}, page.first_offset)
                position = page.first_offset
            for chunk in page.chunks:
                position += len(chunk.data)
                yield _event(chunk.stream, _data(chunk.data), position)
            position = max(position, page.next_offset)
            if page.exited:
                yield _event("exit", {"exit_code": page.exit_code}, position)
                return
            if not follow and not page.chunks:
                return  # caught up with a process that still runs
            page = await read(who, name, pid, position, wait=FOLLOW_WAIT if follow else 0)
            if follow and not page.chunks and not page.exited:
                yield b": keep-alive\n\n"  # a quiet process: keep idle proxies from cutting us

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _data(data: bytes) -> dict[str, str]:
    try:
        return {"data": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"data": base64.b64encode(data).decode(), "encoding": "base64"}


def _event(kind: str, body: dict[str, Any], offset: int) -> bytes:
    return f"id: {offset}\nevent: {kind}\ndata: {json.dumps(body)}\n\n".encode()


@router.post(
    "/{pid}/stdin", response_model=Written, responses=error_docs(TENANT, PARAMS, RAW_BODY, AGENT)
)
async def stdin(
    name: str, pid: int, request: Request, who: Tenant, svc: Svc, close: bool = False
) -> Any:
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_STDIN_BYTES:
            raise PayloadTooLargeError(f"stdin writes are at most {MAX_STDIN_BYTES} bytes each")
    return {"written": await svc.toolbox.write_stdin(who, name, pid, bytes(data), close=close)}


@router.post("/{pid}/signal", responses=error_docs(TENANT, JSON_BODY, AGENT))
async def send_signal(name: str, pid: int, body: Signal, who: Tenant, svc: Svc) -> Any:
    await svc.toolbox.signal_process(who, name, pid, body.signal)
    return {"pid": pid, "signal": body.signal}
