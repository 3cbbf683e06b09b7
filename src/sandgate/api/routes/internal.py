"""`/internal/*`: what instances ask each other. Signed (see `api/internal_auth.py`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel

from sandgate.agent.frames import FrameError, decode, encode, error_header
from sandgate.api.deps import Services, services
from sandgate.api.routes.sandboxes import sandbox_out
from sandgate.control.peers import FRAME_TYPE
from sandgate.errors import InvalidRequestError, SandgateError

router = APIRouter(prefix="/internal", include_in_schema=False)

Svc = Annotated[Services, Depends(services)]


@router.post("/tunnel-call")
async def tunnel_call(request: Request, svc: Svc) -> Response:
    """Relay one tunnel request to a worker whose tunnel this instance holds.

    Never forwards again (the hop guard): if the tunnel is not here, 503.
    """
    try:
        header, payload = decode(await request.body())
        worker, op, fields = header["worker"], header["op"], header["fields"]
        wait = float(header.get("wait", 30.0))
        if not isinstance(worker, str) or not isinstance(op, str) or not isinstance(fields, dict):
            raise TypeError("worker, op and fields have the wrong types")
    except (FrameError, KeyError, TypeError, ValueError) as exc:
        raise InvalidRequestError(f"bad tunnel-call frame: {exc}") from None
    try:
        reply, body = await svc.workers.request(
            worker, op, fields, payload, wait=min(wait, 3600.0), forward=False
        )
        answer = encode({**reply, "ok": True}, body)
    except SandgateError as exc:
        answer = encode(error_header(None, exc.code, exc.message))
    return Response(answer, media_type=FRAME_TYPE)


class ProvisionRequest(BaseModel):
    job_id: str


@router.post("/provision")
async def provision(body: ProvisionRequest, svc: Svc) -> dict[str, Any]:
    """Deliver a create another instance accepted, through this instance's tunnel."""
    sandbox = await svc.sandboxes.deliver_job(body.job_id, forwarded=True)
    return sandbox_out(sandbox)
