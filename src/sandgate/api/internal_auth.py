"""`/internal/*` is for other instances only: a request without a valid signature gets 401
and never reaches a handler (pure ASGI, in front of the router)."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandgate.api.limits import reject
from sandgate.core.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, SignatureError, verify

MAX_INTERNAL_BODY = 16 << 20


class InternalAuth:
    def __init__(self, app: ASGIApp, *, secret: str) -> None:
        self.app = app
        self.secret = secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/internal/"):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > MAX_INTERNAL_BODY:
                await reject(send, 413, "payload_too_large", "internal request too large")
                return
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            verify(
                self.secret,
                scope["method"],
                scope["path"],
                bytes(body),
                timestamp=headers.get(TIMESTAMP_HEADER),
                signature=headers.get(SIGNATURE_HEADER),
                now=time.time(),
            )
        except SignatureError as exc:
            await reject(send, 401, "unauthorized", f"internal request refused: {exc}")
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()  # the disconnect, when it comes
            delivered = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)
