"""A WebSocket to a server inside a sandbox: the client's socket relayed to it, both ways.

Towards the sandbox this is a WebSocket client: the sans-IO client protocol of `websockets`
(`ClientProtocol`) speaks over the byte stream of one port connection (`control/ports.py`),
so the handshake, masking, fragments, pings and the closing handshake are its, and only
whole messages cross to the client's socket (text as text, binary as binary, a close with
its code and reason). The handshake is made before the client's socket is accepted: a server
that refuses it (a 404, no WebSocket there) refuses the client's too, with a 502 saying what
it answered. Subprotocols the client offers are offered on; the one the server picks is the
client's. Compression is not negotiated with the server (the client's side is uvicorn's).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from starlette.websockets import WebSocket
from websockets.client import ClientProtocol
from websockets.exceptions import InvalidHandshake, InvalidStatus, WebSocketException
from websockets.frames import EXTERNAL_CLOSE_CODES, Frame, Opcode
from websockets.http11 import Response
from websockets.typing import Subprotocol
from websockets.uri import parse_uri

from sandgate.api.deps import Services
from sandgate.api.ports.credentials import Caller
from sandgate.api.ports.target import Target, upstream_headers
from sandgate.control.ports import READ_WAIT, PortConnection
from sandgate.errors import WorkerError

log = logging.getLogger(__name__)

MAX_MESSAGE = 16 << 20  # one message from the server (uvicorn's own limit for the client's)
HANDSHAKE_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class Upstream:
    """A WebSocket open to the server: its protocol, connection and the frames that came
    with the handshake's answer."""

    protocol: ClientProtocol
    conn: PortConnection
    response: Response
    pending: list[Frame]


async def connect(ws: WebSocket, svc: Services, who: Caller, target: Target) -> Upstream:
    """Open the WebSocket to the server (before the client's is accepted). Refused by the
    server: `WorkerError` (502) with what it answered."""
    offered = [
        Subprotocol(p.strip())
        for value in ws.headers.getlist("sec-websocket-protocol")
        for p in value.split(",")
        if p.strip()
    ]
    protocol = ClientProtocol(
        parse_uri(f"ws://localhost:{target.port}/"),
        subprotocols=offered or None,
        max_size=MAX_MESSAGE,
    )
    request = protocol.connect()
    request = dataclasses.replace(request, path=target.resource.decode("latin-1"))
    del request.headers["Host"]
    request.headers["Host"] = target.host.decode("latin-1")
    for name, value in upstream_headers(ws.scope, who, target, websocket=True):
        request.headers[name.decode("latin-1")] = value.decode("latin-1")
    protocol.send_request(request)
    handshake = b"".join(protocol.data_to_send())
    conn, read = await svc.ports.open(
        who.tenant, target.sandbox, target.port, handshake, wait=READ_WAIT
    )
    try:
        async with asyncio.timeout(HANDSHAKE_SECONDS):
            while True:
                _feed(protocol, read.data, read.eof)
                events = protocol.events_received()
                if events:
                    break
                if read.eof:
                    raise _refused(conn, "it closed the connection without answering")
                read = await conn.read()
    except TimeoutError:
        await conn.close()
        raise _refused(conn, f"no answer within {HANDSHAKE_SECONDS:g} s") from None
    except BaseException:
        await conn.close()
        raise
    response = events[0]
    if not isinstance(response, Response) or protocol.handshake_exc is not None:
        await conn.close()
        raise _refused(conn, _why(protocol.handshake_exc))
    frames = [event for event in events[1:] if isinstance(event, Frame)]
    return Upstream(protocol, conn, response, frames)


def _refused(conn: PortConnection, why: str) -> WorkerError:
    return WorkerError(
        f"the server on port {conn.port} of sandbox {conn.sandbox} refused the WebSocket: {why}",
        code="port_bad_response",
    )


def _why(exc: Exception | None) -> str:
    if isinstance(exc, InvalidStatus):
        return f"it answered HTTP {exc.response.status_code} (no WebSocket there?)"
    if isinstance(exc, InvalidHandshake):
        return str(exc)
    return "it did not answer a WebSocket handshake"


def _feed(protocol: ClientProtocol, data: bytes, eof: bool) -> None:
    if data:
        protocol.receive_data(data)
    if eof:
        protocol.receive_eof()


async def relay(ws: WebSocket, upstream: Upstream) -> None:
    """Relay messages both ways until either side closes; then close both."""
    protocol, conn = upstream.protocol, upstream.conn
    writing = asyncio.Lock()  # one flush at a time: the protocol's bytes go out in order

    async def flush() -> None:
        async with writing:
            chunks = protocol.data_to_send()
            data = b"".join(chunks)
            if data:
                await conn.write(data)
            if b"" in chunks:  # the protocol half-closes after the closing handshake
                await conn.shutdown()

    async def to_client() -> None:
        message: list[bytes] = []
        kind = Opcode.TEXT
        frames = list(upstream.pending)
        while True:
            for frame in frames:
                if frame.opcode is Opcode.CLOSE:
                    await flush()  # the protocol's answer to the close
                    close = protocol.close_rcvd
                    code = close.code if close is not None else 1000
                    reason = close.reason if close is not None else ""
                    await ws.close(code if _sendable(code) else 1000, reason)
                    return
                if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                    kind, message = frame.opcode, [bytes(frame.data)]
                elif frame.opcode is Opcode.CONT:
                    message.append(bytes(frame.data))
                else:
                    continue  # ping and pong: the protocol answers pings itself
                if frame.fin:
                    data = b"".join(message)
                    message = []
                    if kind is Opcode.TEXT:
                        await ws.send_text(data.decode("utf-8", "replace"))
                    else:
                        await ws.send_bytes(data)
            read = await conn.read()
            _feed(protocol, read.data, read.eof)
            await flush()
            frames = [e for e in protocol.events_received() if isinstance(e, Frame)]
            if read.eof and not frames:
                await ws.close(1011 if protocol.close_rcvd is None else 1000)
                return

    async def to_server() -> None:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                code = int(message.get("code") or 1000)
                with contextlib.suppress(WebSocketException):
                    protocol.send_close(code if _sendable(code) else 1000)
                await flush()
                return
            text = message.get("text")
            if text is not None:
                protocol.send_text(text.encode())
            else:
                protocol.send_binary(message.get("bytes") or b"")
            await flush()

    tasks = [asyncio.ensure_future(to_client()), asyncio.ensure_future(to_server())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                why = repr(task.exception())
                log.info("ports.websocket_ended", extra={"sandbox": conn.sandbox, "why": why})
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await conn.close()
        with contextlib.suppress(Exception):
            await ws.close(1000)


def _sendable(code: int) -> bool:
    """A close code that may be sent in a close frame (1005, 1006, 1015 may not)."""
    return code in EXTERNAL_CLOSE_CODES or 3000 <= code < 5000
