"""Workers, health and the tunnel endpoint workers dial."""

from __future__ import annotations

import hmac
import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response, WebSocket
from fastapi.responses import JSONResponse

from sandgate.api.deps import Services, Viewer, presented_key, resolve_key, services, viewer
from sandgate.api.metrics import CONTENT_TYPE
from sandgate.api.responses import VIEWER, error_docs
from sandgate.core.clock import utcnow
from sandgate.errors import AuthError, SandgateError, StoreError
from sandgate.tunnel.hub import serve_tunnel

router = APIRouter()
log = logging.getLogger(__name__)

Who = Annotated[Viewer, Depends(viewer)]
Svc = Annotated[Services, Depends(services)]

STORE_PROBE_INTERVAL = 1.0  # seconds this instance reuses its last /readyz write probe


@router.get("/api/v1/workers", tags=["workers"], responses=error_docs(VIEWER))
async def list_workers(who: Who, svc: Svc) -> dict[str, Any]:
    """Connected and known workers, with the protections their runtime enforces. A tenant key
    sees only its own live sandboxes on each (`your_live_sandboxes`); an admin key sees every
    tenant's (`live_sandboxes`)."""
    workers = await svc.store.list_workers()
    live = await svc.store.live_sandboxes_per_worker(who.tenant)
    count = "live_sandboxes" if who.admin else "your_live_sandboxes"
    return {
        "view": "fleet" if who.admin else "tenant",
        "workers": [
            {
                "name": w.name,
                "connected": await svc.workers.is_connected(w.name),
                "capacity": w.capacity,
                count: live.get(w.name, 0),
                "features": w.features,
                "last_seen_at": w.last_seen_at.isoformat(),
            }
            for w in workers
        ],
    }


@router.get("/healthz", tags=["system"])
async def healthz() -> dict[str, str]:
    """The process is up (liveness): `{"status": "ok"}`."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    tags=["system"],
    responses={503: {"description": "degraded: `problems` says why (peers, loops, store)"}},
)
async def readyz(svc: Svc) -> JSONResponse:
    """Ready to serve (readiness): the store takes a write, the loops run, peers answer;
    `503` with `problems` otherwise."""
    problems = [f"peer: {problem}" for problem in svc.state.recent_peer_problems()]
    now = utcnow()
    # a loop that keeps failing (sandgate.core.loops): named until an iteration succeeds
    problems += [p for h in list(svc.state.loops.values()) if (p := h.problem(now)) is not None]
    if store_problem := await _store_problem(svc):
        problems.append(store_problem)
    body = {
        "status": "ok" if not problems else "degraded",
        "problems": problems,
        "tunnels": len(svc.state.tunnels),
    }
    return JSONResponse(body, status_code=200 if not problems else 503)


async def _store_problem(svc: Services) -> str:
    """Why the store takes no write ("" when it took one): one small committed write, made
    at most once per STORE_PROBE_INTERVAL by this instance; calls meanwhile reuse its answer."""
    last = svc.state.store_probe
    if last is not None and time.monotonic() - last[1] < STORE_PROBE_INTERVAL:
        return last[0]
    try:
        await svc.store.probe_write(svc.workers.node_url, utcnow())
        problem = ""
    except StoreError as exc:
        problem = f"store: cannot write: {exc.message}"
    except Exception as exc:  # never let the probe turn /readyz into a 500
        problem = f"store: cannot write: {type(exc).__name__}: {exc}"
    svc.state.store_probe = (problem, time.monotonic())
    return problem


@router.get(
    "/metrics",
    tags=["system"],
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}},
        401: {
            **error_docs(401)[401],
            "description": "the metrics token is asked for and was not given",
        },
    },
)
async def metrics(request: Request, svc: Svc) -> Response:
    """Prometheus text format; behind `Authorization: Bearer <metrics token>` when the
    instance has one (`--metrics-token-file`). The series: docs/api.md, Metrics."""
    token = svc.settings.metrics_token
    if token:
        presented = request.headers.get("authorization", "")
        if not hmac.compare_digest(presented.encode(), f"Bearer {token}".encode()):
            raise AuthError("/metrics takes the metrics token: Authorization: Bearer <token>")
    try:
        await svc.metrics.refresh(svc.store, svc.workers, svc.admission)
    except SandgateError as exc:  # the store is down: this instance's own series still serve
        log.warning("metrics.refresh_failed", extra={"error": exc.message})
    return Response(svc.metrics.exposition(), media_type=CONTENT_TYPE)


@router.websocket("/tunnel")
async def tunnel(ws: WebSocket) -> None:
    svc: Services = ws.app.state.services
    try:
        key = await resolve_key(svc, presented_key(ws.headers))
        if key.kind != "worker":
            raise AuthError("the tunnel takes worker tokens (sandgate keys create --worker)")
    except AuthError as exc:
        await ws.send_denial_response(
            JSONResponse({"error": {"code": exc.code, "message": exc.message}}, status_code=401)
        )
        return

    await serve_tunnel(
        ws, svc.workers, token_hash=key.key_hash, handler=svc.templates.answer_worker
    )
