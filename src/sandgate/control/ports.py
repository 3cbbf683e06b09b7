"""Ports of a sandbox: TCP connections to 127.0.0.1:<port> inside it, through its agent.

The agent connects from inside the sandbox's own network namespace (agent/ports.py), so a
port is reached whether or not the sandbox has a network. A connection is a few agent
calls, each one request and its answer over the same seam as the toolbox
(`Toolbox.agent_call`: this instance's tunnel, or forwarded to the instance that holds it):

    port_open (with the first bytes, and a read)   port_write   port_read (a long poll)
    port_shutdown (half-close)                     port_close

So a byte stream works across instances with no more machinery than a terminal needs.
Nothing is kept here between calls but the connection's number, which its `PortConnection`
holds; the agent closes a connection no call used for a while, so one whose caller went
away (an instance that died) does not stay open.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from sandgate.control.replies import PortOpenReply, PortReadReply, parse
from sandgate.control.toolbox import RELAY_GRACE, Toolbox
from sandgate.errors import LimitExceededError, SandgateError, WorkerError
from sandgate.store.base import TenantId

READ_WAIT = 15.0  # a read waits this long for data, then answers empty (the caller reads again)
READ_BYTES = 1 << 20  # one read's answer at most
WRITE_CHUNK = 1 << 20  # one write call at most
WRITE_SECONDS = 35.0  # the agent fails a write the server takes nothing of for 30 s
CLOSE_SECONDS = 10.0


@dataclass(frozen=True)
class PortRead:
    data: bytes
    eof: bool  # the server ended its stream: nothing comes after `data`


class PortConnection:
    """One open TCP connection to a port inside a sandbox."""

    def __init__(self, toolbox: Toolbox, tenant: TenantId, name: str, port: int, conn: int):
        self._toolbox = toolbox
        self.tenant = tenant
        self.sandbox = name
        self.port = port
        self.conn = conn
        self.closed = False

    async def write(self, data: bytes) -> None:
        """Send bytes; answered once the sandbox's kernel took them all. A server that closed
        its side: `ConflictError` `connection_closed`."""
        for start in range(0, len(data), WRITE_CHUNK):
            piece = data[start : start + WRITE_CHUNK]
            await self._call("port_write", {}, piece, seconds=WRITE_SECONDS)

    async def read(self, *, wait: float = READ_WAIT, linger: float = 0.0) -> PortRead:
        """What the server sent, as soon as there is some (then up to `linger` s more for the
        end of its stream), or nothing after `wait` s."""
        fields = {"wait": wait, "linger": linger, "max": READ_BYTES}
        raw, payload = await self._call("port_read", fields, seconds=wait + linger + RELAY_GRACE)
        return PortRead(payload, parse(PortReadReply, raw).eof)

    async def shutdown(self) -> None:
        """No more bytes for the server (it reads the end of its stream); reads go on."""
        await self._call("port_shutdown", {})

    async def close(self) -> None:
        """Close it (once). Never raises: the agent closes an idle connection itself."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(SandgateError):
            await asyncio.shield(self._call("port_close", {}, seconds=CLOSE_SECONDS))

    async def _call(
        self, op: str, fields: dict[str, Any], payload: bytes = b"", *, seconds: float = 60.0
    ) -> tuple[dict[str, Any], bytes]:
        return await self._toolbox.agent_call(
            self.tenant,
            self.sandbox,
            op,
            {"conn": self.conn, **fields},
            payload,
            seconds=seconds,
        )


class PortService:
    """Connections to the ports of a tenant's running sandboxes."""

    def __init__(self, toolbox: Toolbox) -> None:
        self.toolbox = toolbox

    async def open(
        self,
        tenant: TenantId,
        name: str,
        port: int,
        first: bytes = b"",
        *,
        wait: float = 0.0,
        linger: float = 0.0,
        idle: float | None = None,
    ) -> tuple[PortConnection, PortRead]:
        """Connect to `port` in the sandbox and send `first`; with a `wait`, the first read
        comes in the same call (a small request is then one round trip). Nothing listening:
        `WorkerError` `port_not_listening` (502); too many open: `LimitExceededError` (429)."""
        fields: dict[str, Any] = {"port": port, "wait": wait, "linger": linger, "max": READ_BYTES}
        if idle is not None:
            fields["idle"] = idle
        seconds = wait + linger + WRITE_SECONDS
        try:
            raw, payload = await self.toolbox.agent_call(
                tenant, name, "port_open", fields, first, seconds=seconds
            )
        except LimitExceededError as exc:
            if exc.limit:  # the agent named it (`pids`: no thread for the port loop)
                raise
            raise LimitExceededError(
                exc.message, limit="port_connections", retry_after=1.0
            ) from None
        except WorkerError as exc:
            if exc.code != "port_not_listening":
                raise
            raise WorkerError(
                f"nothing listens on port {port} in sandbox {name}: start a server there on "
                f"127.0.0.1:{port} or 0.0.0.0:{port} (e.g. `python3 -m http.server {port}`), "
                "then retry",
                code="port_not_listening",
            ) from None
        reply = parse(PortOpenReply, raw)
        connection = PortConnection(self.toolbox, tenant, name, port, reply.conn)
        return connection, PortRead(payload, reply.eof)
