"""Workers, health and the tunnel endpoint workers dial."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse

from sandgate.api.deps import Services, presented_key, resolve_key, services, tenant
from sandgate.errors import AuthError
from sandgate.store.base import TenantId
from sandgate.tunnel.hub import serve_tunnel

router = APIRouter()

Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]


@router.get("/api/v1/workers", tags=["workers"])
async def list_workers(who: Tenant, svc: Svc) -> dict[str, Any]:
    """Connected and known workers, with the protections their runtime enforces."""
    workers = await svc.store.list_workers()
    return {
        "workers": [
            {
                "name": w.name,
                "connected": await svc.workers.is_connected(w.name),
                "capacity": w.capacity,
                "live_sandboxes": await svc.store.count_live_sandboxes(w.name),
                "features": w.features,
                "last_seen_at": w.last_seen_at.isoformat(),
            }
            for w in workers
        ]
    }


@router.get("/healthz", include_in_schema=False)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", include_in_schema=False)
async def readyz(svc: Svc) -> JSONResponse:
    problems = [f"peer: {problem}" for problem in svc.state.recent_peer_problems()]
    try:
        await svc.store.list_workers()
    except Exception as exc:
        problems.append(f"store: {exc}")
    body = {
        "status": "ok" if not problems else "degraded",
        "problems": problems,
        "tunnels": len(svc.state.tunnels),
    }
    return JSONResponse(body, status_code=200 if not problems else 503)


@router.get("/metrics", include_in_schema=False)
async def metrics(svc: Svc) -> PlainTextResponse:
    """Prometheus text format."""
    lines = [
        "# HELP sandgate_store_statements_total Statements this instance sent to the store.",
        "# TYPE sandgate_store_statements_total counter",
        f"sandgate_store_statements_total {svc.store.statements}",
        "# HELP sandgate_tunnels Worker tunnels held by this instance.",
        "# TYPE sandgate_tunnels gauge",
        f"sandgate_tunnels {len(svc.state.tunnels)}",
    ]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


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
    await serve_tunnel(ws, svc.workers, token_hash=key.key_hash)
