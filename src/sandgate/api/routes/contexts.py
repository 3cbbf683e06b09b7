"""`/api/v1/sandboxes/{name}/contexts`: stateful code contexts (IPython kernels).

`POST .../contexts/{id}/run` (and `POST .../run-code`, in the default context) streams the
run as server-sent events: `stdout`, `stderr`, `result` (a MIME bundle; `is_main_result` for
the value of the last expression), `error`, then `end` with the execution count. A client
that goes away interrupts the code. See control/contexts.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Response
from fastapi.responses import StreamingResponse

from sandgate.api.beats import keep_alive
from sandgate.api.deps import Services, services, tenant
from sandgate.api.responses import AGENT, JSON_BODY, TENANT, error_docs
from sandgate.api.schemas import CodeContextOut, CreateCodeContext, RunCode
from sandgate.control.contexts import DEFAULT_CONTEXTS, Context
from sandgate.errors import InvalidRequestError
from sandgate.store.base import TenantId

KEEPALIVE_SECONDS = 15.0  # the longest a run's stream is silent: a comment line then

router = APIRouter(prefix="/api/v1/sandboxes/{name}", tags=["code contexts"])

Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]


def sse_docs() -> dict[int | str, dict[str, Any]]:
    return {**error_docs(TENANT, JSON_BODY, AGENT), 200: {"content": {"text/event-stream": {}}}}


def _out(context: Context) -> dict[str, Any]:
    return {"id": context.id, "language": context.language, "cwd": context.cwd}


@router.post(
    "/contexts",
    status_code=201,
    response_model=CodeContextOut,
    responses=error_docs(TENANT, JSON_BODY, AGENT),
)
async def create(name: str, body: CreateCodeContext, who: Tenant, svc: Svc) -> Any:
    return _out(await svc.contexts.create(who, name, language=body.language, cwd=body.cwd))


@router.get("/contexts", response_model=list[CodeContextOut], responses=error_docs(TENANT, AGENT))
async def list_contexts(name: str, who: Tenant, svc: Svc) -> Any:
    return [_out(context) for context in await svc.contexts.list(who, name)]


@router.delete("/contexts/{context_id}", status_code=204, responses=error_docs(TENANT, AGENT))
async def delete(name: str, context_id: str, who: Tenant, svc: Svc) -> Response:
    await svc.contexts.delete(who, name, context_id)
    return Response(status_code=204)


@router.post(
    "/contexts/{context_id}/restart",
    response_model=CodeContextOut,
    responses=error_docs(TENANT, AGENT),
)
async def restart(name: str, context_id: str, who: Tenant, svc: Svc) -> Any:
    return _out(await svc.contexts.restart(who, name, context_id))


@router.post("/contexts/{context_id}/run", responses=sse_docs())
async def run(name: str, context_id: str, body: RunCode, who: Tenant, svc: Svc) -> Any:
    return await _stream(svc, who, name, context_id, body)


@router.post("/run-code", responses=sse_docs())
async def run_code(name: str, body: RunCode, who: Tenant, svc: Svc) -> Any:
    """Run in the sandbox's default context (made on first use)."""
    return await _stream(svc, who, name, None, body)


async def _stream(
    svc: Services, who: TenantId, name: str, context_id: str | None, body: RunCode
) -> StreamingResponse:
    timeout = body.timeout if body.timeout is not None else svc.settings.default_exec_timeout
    if timeout > svc.settings.max_exec_timeout:
        raise InvalidRequestError(f"timeout is at most {svc.settings.max_exec_timeout:g} seconds")
    # a context that does not exist is a 404 before the stream's 200
    events = await svc.contexts.start_run(
        who, name, context_id, body.code, env=body.env, time_limit=timeout, language=body.language
    )
    shown = context_id or DEFAULT_CONTEXTS[body.language or "python"]

    async def sse() -> AsyncIterator[bytes]:
        count = None
        async for event in keep_alive(events, KEEPALIVE_SECONDS):
            if event is None:  # a cell that prints nothing for a while: idle proxies stay
                yield b": keep-alive\n\n"
                continue
            kind = event.pop("type", "")
            if kind == "number_of_executions":
                count = event.get("execution_count")
            elif kind == "end_of_execution":
                yield _event("end", {"execution_count": count, "context": shown})
            else:
                yield _event(kind, event)

    return StreamingResponse(
        sse(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _event(kind: str, body: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()
