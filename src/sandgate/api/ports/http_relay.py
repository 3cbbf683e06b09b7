"""One HTTP request to a server inside a sandbox, and its answer streamed back.

The request goes upstream as HTTP/1.1 with `Connection: close` (one connection per request:
nothing to pool across instances), framed by `h11`: the client's body is streamed on as it
arrives (`Content-Length` kept, a chunked one re-chunked), except a small body with a
`Content-Length`, which travels in the `port_open` call itself with the head, so a small
request is one round trip to the sandbox. The answer is parsed with `h11` too: its status
and headers become the response's, and its body is sent on as it comes, so a server-sent
events stream streams. A client that goes away closes the connection to the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import h11
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from sandgate.api.deps import Services
from sandgate.api.ports.credentials import Caller
from sandgate.api.ports.headers import RawHeaders, from_upstream
from sandgate.api.ports.target import Target, preview_cookie, upstream_headers
from sandgate.control.ports import READ_WAIT, PortConnection, PortRead
from sandgate.errors import ConflictError, InvalidRequestError, WorkerError

log = logging.getLogger(__name__)

SMALL_BODY = 256 << 10  # a body up to this, with a Content-Length, goes with the head
FIRST_LINGER = 0.005  # the first read waits this much more for the end of a small answer
MAX_HEAD_BYTES = 1 << 20  # the server's status line and headers
BODYLESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})  # no Content-Length: 0 sent for them


async def relay(request: Request, svc: Services, who: Caller, target: Target) -> Response:
    """Send the request to the server and answer with its response (head read here, body
    streamed by the returned response)."""
    client = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    headers = [
        (b"host", target.host),
        *upstream_headers(request.scope, who, target, websocket=False),
    ]
    headers += _framing(request)
    headers.append((b"connection", b"close"))
    try:
        head = client.send(
            h11.Request(method=request.method, target=target.resource, headers=headers)
        )
    except h11.LocalProtocolError as exc:
        raise InvalidRequestError(f"this request cannot be sent on as HTTP/1.1: {exc}") from None
    assert head is not None
    declared = _content_length(request)
    if declared is not None and declared <= SMALL_BODY:
        body = await request.body()
        first = head + _send(client, h11.Data(data=body)) if body else head
        first += _send(client, h11.EndOfMessage())
        conn, read = await svc.ports.open(
            who.tenant, target.sandbox, target.port, first, wait=READ_WAIT, linger=FIRST_LINGER
        )
    else:
        conn, _ = await svc.ports.open(who.tenant, target.sandbox, target.port, head)
        try:
            await _stream_body(request, client, conn)
            read = await conn.read(linger=FIRST_LINGER)
        except BaseException:
            await conn.close()
            raise
    try:
        response = await _response_head(request, client, conn, read, target)
    except BaseException:
        await conn.close()
        raise
    status, headers_out, eof = response
    cookie = preview_cookie(who, target, time.time())
    if cookie is not None:
        headers_out.append((b"set-cookie", cookie))
    return Relayed(status, headers_out, client, conn, eof=eof)


def _framing(request: Request) -> RawHeaders:
    declared = _content_length(request)
    if declared is None:
        return [(b"transfer-encoding", b"chunked")]
    if declared or request.method not in BODYLESS:
        return [(b"content-length", str(declared).encode())]
    return []


def _content_length(request: Request) -> int | None:
    """The body's declared length: 0 for none at all, None for a chunked one."""
    if "transfer-encoding" in request.headers:
        return None
    value = request.headers.get("content-length")
    if value is None:
        return 0
    if not value.isdigit():
        raise InvalidRequestError("Content-Length is not a number")
    return int(value)


def _send(client: h11.Connection, event: h11.Data | h11.EndOfMessage) -> bytes:
    data = client.send(event)
    return data or b""


async def _stream_body(request: Request, client: h11.Connection, conn: PortConnection) -> None:
    """The client's body to the server as it comes. A server that closed its side early
    (it answered already) gets no more: its answer is read all the same."""
    try:
        async for piece in request.stream():
            if piece:
                await conn.write(_send(client, h11.Data(data=piece)))
        end = _send(client, h11.EndOfMessage())
        if end:
            await conn.write(end)
    except ConflictError as exc:
        if exc.code != "connection_closed":
            raise
        log.info("ports.body_cut", extra={"sandbox": conn.sandbox, "port": conn.port})
    except h11.LocalProtocolError as exc:
        raise InvalidRequestError(f"the request body does not match its framing: {exc}") from None


async def _response_head(
    request: Request, client: h11.Connection, conn: PortConnection, read: PortRead, target: Target
) -> tuple[int, RawHeaders, bool]:
    """(status, headers for the client, the server's stream ended) of the server's answer,
    reading until its head is whole (its body's first bytes stay in `client`)."""
    eof = _feed(client, read)
    while True:
        try:
            event = client.next_event()
        except h11.RemoteProtocolError as exc:
            raise WorkerError(
                f"the server on port {conn.port} of sandbox {conn.sandbox} answered something "
                f"that is not HTTP/1.x: {exc}",
                code="port_bad_response",
            ) from None
        if event is h11.NEED_DATA:
            if eof:
                raise WorkerError(
                    f"the server on port {conn.port} of sandbox {conn.sandbox} closed the "
                    "connection without answering",
                    code="port_bad_response",
                )
            read = await conn.read()
            eof = _feed(client, read)
            if not read.data and not eof and await request.is_disconnected():
                raise ClientDisconnect()
            continue
        if isinstance(event, h11.InformationalResponse):
            continue  # 100 Continue and the like: the final answer follows
        if isinstance(event, h11.Response):
            raw = event.headers.raw_items()
            headers = from_upstream(raw, prefix=target.prefix, port=target.port)
            return event.status_code, headers, eof
        raise WorkerError(
            f"the server on port {conn.port} of sandbox {conn.sandbox} closed the connection "
            "without answering",
            code="port_bad_response",
        )


def _feed(client: h11.Connection, read: PortRead) -> bool:
    if read.data:
        client.receive_data(read.data)
    if read.eof:
        client.receive_data(b"")
    return read.eof


class Relayed(Response):
    """The server's answer: its head now, its body as it comes, then the connection closed.
    The client going away (`http.disconnect`) ends it early."""

    def __init__(
        self,
        status: int,
        headers: RawHeaders,
        client: h11.Connection,
        conn: PortConnection,
        *,
        eof: bool,
    ) -> None:
        super().__init__(status_code=status)
        self.raw_headers = headers
        self._client = client
        self._conn = conn
        self._eof = eof

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            body = asyncio.ensure_future(self._body(send))
            gone = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait({body, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (body, gone):
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            if body.done() and not body.cancelled() and body.exception() is not None:
                log.info(
                    "ports.body_failed",
                    extra={"sandbox": self._conn.sandbox, "error": repr(body.exception())},
                )
        finally:
            await self._conn.close()

    async def _body(self, send: Send) -> None:
        """The body as h11 parses it. The next read is asked for as soon as one came, so
        the sandbox's next bytes travel while these go out to the client."""
        client, conn = self._client, self._conn
        ahead: asyncio.Future[PortRead] | None = None
        try:
            while True:
                try:
                    event = client.next_event()
                except h11.RemoteProtocolError as exc:  # cut short: the client sees it cut
                    log.info("ports.answer_cut", extra={"sandbox": conn.sandbox, "why": str(exc)})
                    return
                if event is h11.NEED_DATA:
                    if self._eof:
                        return
                    read = await (ahead or conn.read())
                    ahead = None
                    self._eof = _feed(client, read)
                    if not self._eof:
                        ahead = asyncio.ensure_future(conn.read())
                    continue
                if isinstance(event, h11.Data):
                    body: Message = {
                        "type": "http.response.body",
                        "body": bytes(event.data),
                        "more_body": True,
                    }
                    await send(body)
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
        finally:
            if ahead is not None:
                ahead.cancel()
                with contextlib.suppress(BaseException):
                    await ahead


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
