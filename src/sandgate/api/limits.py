"""Request body caps, enforced before a handler reads the body (pure ASGI middleware)."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    """Refuse bodies over `max_bytes` with 413, except on paths that stream (file uploads)."""

    def __init__(
        self, app: ASGIApp, *, max_bytes: int, streaming_suffixes: tuple[str, ...]
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.streaming_suffixes = streaming_suffixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].endswith(self.streaming_suffixes):
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
