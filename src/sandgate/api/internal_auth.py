"""`/internal/*` is for other instances only: a request without a valid signature gets 401
and never reaches a handler (pure ASGI, in front of the router).

The signature is checked on the headers alone (it covers the body's digest, sent in
`x-sandgate-body-sha256`), before a byte of the body is read: an unauthenticated request costs
no memory. The body of a signed one is then read (at most MAX_INTERNAL_BODY, each part within
BODY_IDLE_TIMEOUT) and must match the signed digest.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from sandgate.api.limits import BODY_IDLE_TIMEOUT, reject, replay
from sandgate.core.signing import (
    BODY_DIGEST_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    SignatureError,
    verify_head,
)

MAX_INTERNAL_BODY = 16 << 20


class InternalAuth:
    def __init__(
        self, app: ASGIApp, *, secret: str, idle_timeout: float = BODY_IDLE_TIMEOUT
    ) -> None:
        self.app = app
        self.secret = secret
        self.idle_timeout = idle_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/internal/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        digest = headers.get(BODY_DIGEST_HEADER)
        try:
            verify_head(
                self.secret,
                scope["method"],
                scope["path"],
                digest,
                timestamp=headers.get(TIMESTAMP_HEADER),
                signature=headers.get(SIGNATURE_HEADER),
                now=time.time(),
            )
        except SignatureError as exc:
            await reject(send, 401, "unauthorized", f"internal request refused: {exc}", close=True)
            return
        assert digest is not None
        body = bytearray()
        hashed = hashlib.sha256()
        while True:
            try:
                async with asyncio.timeout(self.idle_timeout):
                    message = await receive()
            except TimeoutError:
                await reject(
                    send, 408, "request_timeout", "internal request body stalled", close=True
                )
                return
            if message["type"] == "http.disconnect":
                return
            part = message.get("body", b"")
            body += part
            hashed.update(part)
            if len(body) > MAX_INTERNAL_BODY:
                await reject(
                    send, 413, "payload_too_large", "internal request too large", close=True
                )
                return
            if not message.get("more_body"):
                break
        if not hmac.compare_digest(hashed.hexdigest(), digest):
            await reject(send, 401, "unauthorized", "internal request refused: body altered")
            return
        await self.app(scope, replay(bytes(body), receive), send)
