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
from sandgate.api.routes.sandboxes import error_docs
from sandgate.api.schemas import ProcessList, ProcessOut, Signal, StartProcess, Written
from sandgate.control.replies import (
    OutputReply,
    PidReply,
    ProcessesReply,
    WrittenReply,
    parse,
)
from sandgate.errors import InvalidRequestError, NotFoundError, PayloadTooLargeError
from sandgate.store.base import TenantId

router = APIRouter(prefix="/api/v1/sandboxes/{name}/toolbox/processes", tags=["processes"])

Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]

FOLLOW_WAIT = 15.0  # seconds one long-poll read may wait for output
MAX_STDIN_BYTES = 8 << 20


@router.post("", status_code=201, response_model=ProcessOut, responses=error_docs())
async def start(name: str, body: StartProcess, who: Tenant, svc: Svc) -> Any:
    call = {
        "op": "proc_start",
        "command": body.command,
        "cwd": body.cwd,
        "env": body.env,
        "timeout": body.timeout,
    }
    raw, _ = await svc.sandboxes.agent_call(who, name, call)
    return await _describe(svc, who, name, parse(PidReply, raw).pid)


@router.get("", response_model=ProcessList, responses=error_docs())
async def list_processes(name: str, who: Tenant, svc: Svc) -> Any:
    raw, _ = await svc.sandboxes.agent_call(who, name, {"op": "proc_list"})
    return {"processes": [p.model_dump() for p in parse(ProcessesReply, raw).processes]}


@router.get("/{pid}", response_model=ProcessOut, responses=error_docs())
async def get_process(name: str, pid: int, who: Tenant, svc: Svc) -> Any:
    return await _describe(svc, who, name, pid)


async def _describe(svc: Services, who: TenantId, name: str, pid: int) -> dict[str, Any]:
    raw, _ = await svc.sandboxes.agent_call(who, name, {"op": "proc_list"})
    for process in parse(ProcessesReply, raw).processes:
        if process.pid == pid:
            return process.model_dump()
    raise NotFoundError(f"no process {pid} in sandbox {name}")


@router.get(
    "/{pid}/stream",
    responses={**error_docs(), 200: {"content": {"text/event-stream": {}}}},
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
    first = await _read(svc, who, name, pid, start_at or 0, wait=0.0)

    async def events() -> AsyncIterator[bytes]:
        answer = first
        position = start_at or 0
        while True:
            reply, payload = answer
            if reply.first_offset > position:
                yield _event(
                    "dropped", {"bytes": reply.first_offset - position}, reply.first_offset
                )
                position = reply.first_offset
            cursor = 0
            for stream_name, length in reply.chunks:
                data = payload[cursor : cursor + length]
                cursor += length
                position += len(data)
                yield _event(stream_name, _data(data), position)
            position = max(position, reply.next_offset)
            if reply.exited:
                yield _event("exit", {"exit_code": reply.exit_code}, position)
                return
            if not follow and not reply.chunks:
                return  # caught up with a process that still runs
            answer = await _read(svc, who, name, pid, position, wait=FOLLOW_WAIT if follow else 0)
            if follow and not answer[0].chunks and not answer[0].exited:
                yield b": keep-alive\n\n"  # a quiet process: keep idle proxies from cutting us

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _read(
    svc: Services, who: TenantId, name: str, pid: int, offset: int, *, wait: float
) -> tuple[OutputReply, bytes]:
    call = {"op": "proc_read", "pid": pid, "offset": offset, "wait": wait}
    raw, payload = await svc.sandboxes.agent_call(who, name, call, seconds=wait + 5.0)
    return parse(OutputReply, raw), payload


def _data(data: bytes) -> dict[str, str]:
    try:
        return {"data": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"data": base64.b64encode(data).decode(), "encoding": "base64"}


def _event(kind: str, body: dict[str, Any], offset: int) -> bytes:
    return f"id: {offset}\nevent: {kind}\ndata: {json.dumps(body)}\n\n".encode()


@router.post("/{pid}/stdin", response_model=Written, responses=error_docs())
async def stdin(
    name: str, pid: int, request: Request, who: Tenant, svc: Svc, close: bool = False
) -> Any:
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_STDIN_BYTES:
            raise PayloadTooLargeError(f"stdin writes are at most {MAX_STDIN_BYTES} bytes each")
    call = {"op": "proc_stdin", "pid": pid, "close": close}
    raw, _ = await svc.sandboxes.agent_call(who, name, call, bytes(data))
    return {"written": parse(WrittenReply, raw).written}


@router.post("/{pid}/signal", responses=error_docs())
async def send_signal(name: str, pid: int, body: Signal, who: Tenant, svc: Svc) -> Any:
    call = {"op": "proc_signal", "pid": pid, "signal": body.signal}
    await svc.sandboxes.agent_call(who, name, call)
    return {"pid": pid, "signal": body.signal}
