"""Request body caps and deadlines, enforced before a handler reads the body (pure ASGI).

- A request with a body and no credentials at all gets 401 before a byte of it is read
  (a wrong key is found only by the handler, after a body bounded as below). Requests for
  a sandbox's ports (`proxied`) are let through uncapped: their credential may be a preview
  token, which their route checks before it reads a byte, and their body is streamed on to
  the sandbox; the idle timeout holds for them too.
- A JSON body over `max_bytes` gets 413 (file uploads and stdin stream instead: their
  routes bound them).
- A JSON body must arrive whole within `idle_timeout` s; a streamed one may take longer
  but must never be silent that long. Either way a stalled body is answered `408
  request_timeout` and the connection closed; the handler sees the client gone and what it
  sends after is dropped.

Every refusal made before the body was read closes the connection (`Connection: close`),
so a client cannot keep a socket open by never finishing what it started.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandgate.api.errors import Shape, native_body

log = logging.getLogger(__name__)


BODY_IDLE_TIMEOUT = 60.0  # a request body that sends nothing for this long is cut
CREDENTIAL_HEADERS = (b"authorization", b"x-api-key")
BODY_METHODS = ("POST", "PUT", "PATCH")


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        streaming_suffixes: tuple[str, ...],
        idle_timeout: float = BODY_IDLE_TIMEOUT,
        keyed_prefix: str = "/api/",
        shape: Shape = native_body,
        proxied: Callable[[str], bool] | None = None,
    ) -> None:
        self.app = app
        self.proxied = proxied  # paths that authenticate and bound their body themselves
        self.max_bytes = max_bytes
        self.streaming_suffixes = streaming_suffixes
        self.idle_timeout = idle_timeout
        self.keyed_prefix = keyed_prefix
        self.shape = shape  # the body of its refusals (api.errors)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        path: str = scope["path"]
        proxied = self.proxied is not None and self.proxied(path)
        if (
            not proxied
            and scope["method"] in BODY_METHODS
            and path.startswith(self.keyed_prefix)
            and not any(name in headers for name in CREDENTIAL_HEADERS)
        ):
            await reject(
                send,
                401,
                "unauthorized",
                "missing credentials: send Authorization: Bearer <api key> or X-API-Key",
                close=True,
                shape=self.shape,
            )
            return
        streaming = proxied or path.endswith(self.streaming_suffixes)
        if not streaming and b"content-length" in headers:
            try:
                declared = int(headers[b"content-length"])
            except ValueError:
                message = "Content-Length is not a number"
                await reject(send, 400, "bad_request", message, close=True, shape=self.shape)
                return
            if declared > self.max_bytes:
                await _too_large(send, self.shape, self.max_bytes)
                return
        await _Guarded(self, scope, receive, send, streaming=streaming).run()


class _Guarded:
    """One request: its body counted and timed; once this middleware has answered, the
    handler reads a disconnect and whatever it sends is dropped."""

    def __init__(
        self, limit: BodyLimit, scope: Scope, receive: Receive, send: Send, *, streaming: bool
    ) -> None:
        self.limit = limit
        self.scope = scope
        self._receive = receive
        self._send = send
        self.streaming = streaming
        self.seen = 0
        self.complete = False  # the whole body was read: receive() now waits for a disconnect
        self.started = False  # the handler began its answer
        self.answered = False  # this middleware answered instead
        loop = asyncio.get_running_loop()
        self.whole_by = None if streaming else loop.time() + limit.idle_timeout

    async def run(self) -> None:
        try:
            await self.limit.app(self.scope, self.receive, self.send)
        except Exception:
            if not self.answered:
                raise
            # the handler saw the disconnect we gave it (starlette's ClientDisconnect, a
            # half-read form...): the client already has our answer
            log.debug("request.handler_cut", extra={"path": self.scope["path"]})

    async def receive(self) -> Message:
        if self.answered:
            return {"type": "http.disconnect"}
        if self.complete:
            return await self._receive()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limit.idle_timeout
        if self.whole_by is not None:
            deadline = min(deadline, self.whole_by)
        try:
            async with asyncio.timeout_at(deadline):
                message = await self._receive()
        except TimeoutError:
            log.warning(
                "request.body_stalled",
                extra={"path": self.scope["path"], "after_s": self.limit.idle_timeout},
            )
            await self._answer(
                408,
                "request_timeout",
                f"the request body did not arrive in time (a JSON body within "
                f"{self.limit.idle_timeout:g} s, a streamed one never silent that long); "
                "send it again",
            )
            return {"type": "http.disconnect"}
        if message["type"] != "http.request" or not message.get("more_body"):
            self.complete = True
        if message["type"] == "http.request" and not self.streaming:
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit.max_bytes:
                await self._answer(
                    413, "payload_too_large", f"request body over {self.limit.max_bytes} bytes"
                )
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    async def _answer(self, status: int, code: str, text: str) -> None:
        self.complete = True
        if self.started:  # too late for an answer of our own: the handler's stands, cut short
            return
        self.answered = True
        await reject(self._send, status, code, text, close=True, shape=self.limit.shape)


async def _too_large(send: Send, shape: Shape, limit: int) -> None:
    message = f"request body over {limit} bytes"
    await reject(send, 413, "payload_too_large", message, close=True, shape=shape)


async def reject(
    send: Send,
    status: int,
    code: str,
    message: str,
    *,
    close: bool = False,
    shape: Shape = native_body,
) -> None:
    """Answer with a sandgate error; `close`: the body was not read, so the connection
    closes after the answer (uvicorn does so on `Connection: close`)."""
    body = json.dumps(shape(status, code, message, {})).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive for an app behind a middleware that read the whole body first: the body
    once, then whatever the client sends (its disconnect, when it comes)."""
    delivered = False

    async def replayed() -> Message:
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
