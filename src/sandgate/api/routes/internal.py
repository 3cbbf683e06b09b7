"""`/internal/*`: what instances ask each other. Signed with the shared secret.

HTTP requests are checked by `api/internal_auth.py` before any handler; the peer WebSocket
checks its handshake's signature here, before accepting.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, WebSocket
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.websockets import WebSocketDisconnect

from sandgate import log_context
from sandgate.agent.frames import FrameError, Header, decode
from sandgate.api.deps import Services, services
from sandgate.api.routes.sandboxes import sandbox_out
from sandgate.core.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, SignatureError, verify
from sandgate.errors import InvalidRequestError
from sandgate.tunnel.rpc import RpcChannel

log = logging.getLogger(__name__)

router = APIRouter(prefix="/internal", include_in_schema=False)

Svc = Annotated[Services, Depends(services)]


class ProvisionRequest(BaseModel):
    job_id: str


@router.post("/provision")
async def provision(body: ProvisionRequest, svc: Svc) -> dict[str, Any]:
    """Deliver a create another instance accepted, through this instance's tunnel."""
    sandbox = await svc.creates.deliver_job(body.job_id, forwarded=True)
    return sandbox_out(sandbox)


@router.websocket("/peer")
async def peer(ws: WebSocket) -> None:
    """A peer's link: tunnel requests for workers whose tunnels this instance holds.

    Never forwards again (the hop guard): a worker not attached here answers 503.
    """
    svc: Services = ws.app.state.services
    try:
        verify(
            svc.settings.secret,
            "GET",
            "/internal/peer",
            b"",
            timestamp=ws.headers.get(TIMESTAMP_HEADER),
            signature=ws.headers.get(SIGNATURE_HEADER),
            now=time.time(),
        )
    except SignatureError as exc:
        error = {"code": "unauthorized", "message": f"peer link refused: {exc}"}
        await ws.send_denial_response(JSONResponse({"error": error}, status_code=401))
        return
    await ws.accept()

    async def send(frame: bytes) -> None:
        await ws.send_bytes(frame)

    async def handle(header: Header, payload: bytes) -> tuple[Header, bytes]:
        if header.get("op") != "tunnel":
            raise InvalidRequestError(f"unknown peer op {header.get('op')!r}")
        worker, op, fields = header.get("worker"), header.get("op_"), header.get("fields")
        wait = header.get("wait", 30.0)
        if not isinstance(worker, str) or not isinstance(op, str) or not isinstance(fields, dict):
            raise InvalidRequestError("a tunnel request needs worker, op and fields")
        if not isinstance(wait, int | float) or not 0 < wait <= 3600:
            raise InvalidRequestError("wait must be a number of seconds up to 3600")
        with log_context.request(fields.get(log_context.FIELD)):  # the origin's id
            reply, body = await svc.workers.request(
                worker, op, fields, payload, wait=float(wait), forward=False
            )
        reply.pop("id", None)
        reply.pop("ok", None)
        return reply, body

    async def frames() -> tuple[Header, bytes] | None:
        try:
            message = await ws.receive()
        except (WebSocketDisconnect, RuntimeError):
            return None
        if message["type"] == "websocket.disconnect" or message.get("bytes") is None:
            return None
        return decode(message["bytes"])

    channel = RpcChannel(send, handler=handle, name="peer link (incoming)")
    try:
        await channel.serve(frames)
    except* FrameError as group:
        log.warning("peer.bad_frame", extra={"error": str(group.exceptions[0])})
    except* (WebSocketDisconnect, RuntimeError, OSError):
        pass
