"""Request body caps, enforced before a handler reads the body (pure ASGI middleware)."""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)


BODY_IDLE_TIMEOUT = 60.0  # a request body that sends nothing for this long is cut


class BodyLimit:
    """Refuse bodies over `max_bytes` with 413, except on paths that stream (file uploads);
    and cut any body, streamed or not, that sends nothing for `idle_timeout` s (the handler
    sees the client gone), so a stalled upload holds no connection or buffer for long."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        streaming_suffixes: tuple[str, ...],
        idle_timeout: float = BODY_IDLE_TIMEOUT,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.streaming_suffixes = streaming_suffixes
        self.idle_timeout = idle_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        receive = self._with_deadline(scope, receive)
        if scope["path"].endswith(self.streaming_suffixes):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await reject(send, 400, "bad_request", "Content-Length is not a number")
                    return
                if declared > self.max_bytes:
                    await _too_large(send, self.max_bytes)
                    return
        seen = 0
        answered = False

        async def counting_receive() -> Message:
            nonlocal seen, answered
            if answered:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # answer now; the handler sees a disconnect and whatever it sends is dropped
                    answered = True
                    await _too_large(send, self.max_bytes)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not answered:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    def _with_deadline(self, scope: Scope, receive: Receive) -> Receive:
        """`receive`, cut to a disconnect when a part of the body takes over idle_timeout;
        once the body is complete, untouched (handlers wait on it for the disconnect)."""
        complete = False

        async def deadline_receive() -> Message:
            nonlocal complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout(self.idle_timeout):
                    message = await receive()
            except TimeoutError:
                log.warning(
                    "request.body_stalled",
                    extra={"path": scope["path"], "after_s": self.idle_timeout},
                )
                complete = True
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body"):
                complete = True
            return message

        return deadline_receive


async def _too_large(send: Send, limit: int) -> None:
    await reject(send, 413, "payload_too_large", f"request body over {limit} bytes")


async def reject(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
