"""Each request's context, and its access log line.

ASGI middleware, outermost: a request gets the id its client (or the peer instance that
forwarded it) sent in `X-Request-Id`, if it is a valid one, else a new one; the answer
carries it back in the same header; every line logged while it is served says it, with the
instance, and the tenant and sandbox once they are known (`log_context.bind`). The id goes
on with every tunnel call the request makes (`WorkerRegistry.call`), to the instance holding
the worker's tunnel and to the worker. One `http.request` line per request is the access
log: method, path, route template, status, duration.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from structlog.contextvars import unbind_contextvars

from sandgate import log_context

log = logging.getLogger("sandgate.access")

_HEADER = log_context.HEADER.lower().encode()


class RequestContext:
    def __init__(self, app: ASGIApp, *, instance: str) -> None:
        self.app = app
        self.instance = instance

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k == _HEADER), None)
        asked = given.decode("latin-1") if given is not None else None
        with log_context.request(asked, instance=self.instance) as rid:
            started = time.perf_counter()
            status = 500

            async def sending(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    headers = [*message.get("headers", ()), (_HEADER, rid.encode())]
                    message = {**message, "headers": headers}
                await send(message)

            try:
                await self.app(scope, receive, sending)
            finally:
                if scope["type"] == "http":
                    route: Any = scope.get("route")
                    log.info(
                        "http.request",
                        extra={
                            "method": scope.get("method", ""),
                            "path": scope.get("path", ""),
                            "route": getattr(route, "path", None) or "unmatched",
                            "status": status,
                            "duration_ms": round((time.perf_counter() - started) * 1000, 2),
                        },
                    )
                unbind_contextvars("tenant", "sandbox")  # bound while it was served
