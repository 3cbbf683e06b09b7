"""Ports of a sandbox through the control plane, and the preview URLs that open them.

`/api/v1/sandboxes/{name}/ports/{port}/{path...}`: any HTTP method (bodies streamed both
ways) and WebSocket, to 127.0.0.1:{port} inside the sandbox, through its agent, whether or
not the sandbox has a network. `POST .../ports/{port}/preview` with the API key makes a
signed, expiring URL that works without one. The host form `{port}-{name}.<domain>` comes
here too (api/ports). Who may: `api/ports/credentials.py`; the relays: `api/ports/`.

`POST .../ports/{port}/preview` is the preview endpoint when it carries the API key on the
path form; with a preview token, or on the host form, it is the server's own `/preview`.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from pydantic import ValidationError

from sandgate.api.deps import Services, presented_key, services, services_of, tenant
from sandgate.api.errors import error_response, status_of
from sandgate.api.ports import HOST_FORM, http_relay, ws_relay
from sandgate.api.ports.credentials import TRAFFIC_HEADER, Caller, caller
from sandgate.api.ports.headers import PREVIEW_COOKIE, PREVIEW_PARAM
from sandgate.api.ports.target import target_of
from sandgate.api.responses import JSON_BODY, SANDBOX, TENANT, error_docs
from sandgate.api.schemas import PreviewIn, PreviewOut
from sandgate.core.ports import issue_preview, parse_port, port_prefix
from sandgate.errors import PayloadTooLargeError, SandgateError, WorkerError
from sandgate.store.base import TenantId

log = logging.getLogger(__name__)

router = APIRouter(prefix="/api/v1/sandboxes/{name}/ports/{port}", tags=["ports"])

Svc = Annotated[Services, Depends(services)]

METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
MAX_PREVIEW_BODY = 64 << 10


@router.post(
    "/preview",
    status_code=201,
    response_model=PreviewOut,
    responses=error_docs(TENANT, JSON_BODY, SANDBOX),  # 400 also: not a port number
    openapi_extra={
        "requestBody": {
            "required": False,
            "content": {"application/json": {"schema": PreviewIn.model_json_schema()}},
        }
    },
)
async def preview(name: str, port: str, request: Request, svc: Svc) -> Response:
    """A URL to this port that works without an API key until it expires (`ttl` s, default
    3600, at most 86400): a browser opens it; its page's own requests carry the token as a
    cookie scoped to the preview."""
    if _for_the_server(request):
        return await proxy(name, port, request)
    who = await tenant(request)
    number = parse_port(port)
    body = await _small_body(request)
    try:
        ttl = PreviewIn.model_validate_json(body).ttl if body.strip() else PreviewIn().ttl
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    await svc.sandboxes.running(who, name)
    made = issue_preview(
        svc.settings.secret, tenant=who, sandbox=name, port=number, ttl=ttl, now=time.time()
    )
    query = f"?{PREVIEW_PARAM}={made.token}"
    base = str(request.base_url).rstrip("/")
    domain = svc.settings.e2b_domain
    out = PreviewOut(
        url=f"{base}{port_prefix(name, number)}/{query}",
        token=made.token,
        expires_at=datetime.fromtimestamp(made.expires, UTC),
        host_url=f"{request.url.scheme}://{number}-{name}.{domain}/{query}" if domain else None,
    )
    return JSONResponse(out.model_dump(mode="json"), status_code=201)


def _for_the_server(request: Request) -> bool:
    """A POST .../preview that is the server's own: on the host form, or with a preview
    token or E2B's traffic token and no API key."""
    if request.scope.get(HOST_FORM):
        return True
    if presented_key(request.headers) is not None:
        return False
    return (
        PREVIEW_PARAM in request.query_params
        or PREVIEW_COOKIE in request.cookies
        or TRAFFIC_HEADER in request.headers
    )


async def _small_body(request: Request) -> bytes:
    body = b""
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_PREVIEW_BODY:
            raise PayloadTooLargeError(f"request body over {MAX_PREVIEW_BODY} bytes")
    return body


@router.api_route("", methods=list(METHODS), include_in_schema=False)
async def to_the_root(name: str, port: str, request: Request) -> Response:
    """`.../ports/{port}` is `.../ports/{port}/`: relative links of the page then resolve
    under the preview."""
    query = request.url.query
    return RedirectResponse(request.url.path + "/" + (f"?{query}" if query else ""), 307)


@router.api_route("/{path:path}", methods=list(METHODS), include_in_schema=False)
async def proxy(name: str, port: str, request: Request) -> Response:
    """Any HTTP request for the server on `port` inside the sandbox (docs/api.md, "Ports
    and previews")."""
    svc = services_of(request)
    who = await _admitted(request, svc, name, port)
    target = target_of(request.scope, name, port, parse_port(port))
    try:
        return await http_relay.relay(request, svc, who, target)
    except WorkerError as exc:
        if exc.code != "port_not_listening":
            raise
        # the tenant's server is not up (yet): their answer, not a failure of ours to log
        return error_response(502, exc.code, exc.message)


async def _admitted(conn: Request | WebSocket, svc: Services, name: str, port: str) -> Caller:
    """The caller of a proxied request, within its tenant's rate limit, for a running sandbox
    of its own: 400 (port), 401/403 (credential), 429, 404/409 (sandbox), in that order."""
    number = parse_port(port)
    who = await caller(conn, svc, name, number)
    await svc.admission.check_rate(TenantId(who.tenant))
    await svc.sandboxes.running(who.tenant, name)
    return who


@router.websocket("")
@router.websocket("/{path:path}")
async def websocket(ws: WebSocket, name: str, port: str) -> None:
    """A WebSocket to the server on `port` inside the sandbox: refused with the HTTP status
    of the error before the upgrade, then relayed both ways."""
    svc: Services = ws.app.state.services
    try:
        who = await _admitted(ws, svc, name, port)
        target = target_of(ws.scope, name, port, parse_port(port))
        upstream = await ws_relay.connect(ws, svc, who, target)
    except SandgateError as exc:
        status = status_of(exc) if status_of(exc) != 500 else 400
        await ws.send_denial_response(
            JSONResponse({"error": {"code": exc.code, "message": exc.message}}, status_code=status)
        )
        return
    subprotocol = upstream.response.headers.get("Sec-WebSocket-Protocol")
    try:
        await ws.accept(subprotocol=subprotocol)
    except BaseException:
        await upstream.conn.close()
        raise
    log.info("ports.websocket_opened", extra={"sandbox": name, "port": port})
    await ws_relay.relay(ws, upstream)
