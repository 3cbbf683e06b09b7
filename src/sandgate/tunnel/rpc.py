"""Request/response over frames, in both directions, on any byte link.

One `RpcChannel` sits on each link sandgate runs: server⇄worker (WebSocket) and
worker⇄agent (pipes). The link's owner feeds it every received frame and gives it a `send`
coroutine; the channel correlates responses with the calls waiting for them and runs
incoming requests through a handler inside the task group its `serve()` owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sandgate.agent.frames import FrameError, Header, encode, encode_parts, error_header
from sandgate.errors import (
    SandboxTimeoutError,
    SandgateError,
    TunnelUnavailableError,
    from_wire,
    to_wire,
)

log = logging.getLogger(__name__)

Send = Callable[[bytes], Awaitable[None]]
# a frame's head and, apart, its payload (a link where two writes cost less than a copy)
SendParts = Callable[[bytes, bytes], Awaitable[None]]
Handler = Callable[[Header, bytes], Awaitable[tuple[Header, bytes]]]
EventHandler = Callable[[Header, bytes], Awaitable[None]]


class LinkClosedError(TunnelUnavailableError):
    """The link went away while a call was waiting."""


class NoAnswerError(SandboxTimeoutError):
    """Our own wait ran out: no answer came at all (a peer that answered with a timeout of
    its own raises plain SandboxTimeoutError, through `remote_error`)."""


def remote_error(header: Header) -> SandgateError:
    """The error a peer answered with (its code decides the class: `errors.WIRE_CODES`)."""
    err = header.get("error")
    return from_wire(err if isinstance(err, dict) else {})


class RpcChannel:
    def __init__(
        self,
        send: Send,
        *,
        handler: Handler | None = None,
        on_event: EventHandler | None = None,
        name: str = "link",
        send_parts: SendParts | None = None,
    ) -> None:
        self._send = send
        self._send_parts = send_parts
        self._handler = handler
        self._on_event = on_event
        self.name = name
        self._next_id = 1
        self._pending: dict[int, asyncio.Future[tuple[Header, bytes]]] = {}
        self._send_lock = asyncio.Lock()
        self._tasks: asyncio.TaskGroup | None = None
        self._closed: SandgateError | None = None
        self._running: set[asyncio.Task[None]] = set()

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def send_frame(self, header: Header, payload: bytes = b"") -> None:
        if self._closed is not None:
            raise self._closed
        send_parts = self._send_parts
        frame, tail = (
            encode_parts(header, payload) if send_parts else (encode(header, payload), b"")
        )
        async with self._send_lock:
            if send_parts is not None and tail:
                await send_parts(frame, tail)
            else:
                await self._send(frame)

    async def call(
        self, op: str, payload: bytes = b"", *, wait: float | None = 30.0, **fields: Any
    ) -> tuple[Header, bytes]:
        """Send a request and wait up to `wait` s for its answer; raise the error it carries."""
        return await self.request(op, fields, payload, wait=wait)

    async def request(
        self,
        op: str,
        fields: dict[str, Any],
        payload: bytes = b"",
        *,
        wait: float | None = 30.0,
        slow_after: float | None = None,
        on_slow: Callable[[], None] | None = None,
    ) -> tuple[Header, bytes]:
        """`call` with the request's fields as a dict (any names, relayed as they are).

        `on_slow` is called once if no answer came within `slow_after` s (the wait goes on).
        """
        if self._closed is not None:
            raise self._closed
        request_id = self._next_id
        self._next_id += 1
        future: asyncio.Future[tuple[Header, bytes]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        slow: asyncio.TimerHandle | None = None
        try:
            await self.send_frame({**fields, "id": request_id, "op": op}, payload)
            if on_slow is not None and slow_after is not None and wait is not None:
                slow = asyncio.get_running_loop().call_later(slow_after, on_slow)
            # the task waits on the answer's future itself: no wait_for or shield in between,
            # each of which costs the answer a turn of the loop before this task resumes
            try:
                async with asyncio.timeout(wait):
                    header, body = await future
            except TimeoutError:
                raise NoAnswerError(f"{self.name}: no answer to {op!r} within {wait:g} s") from None
        finally:
            if slow is not None:
                slow.cancel()
            self._pending.pop(request_id, None)
        if not header.get("ok"):
            raise remote_error(header)
        return header, body

    async def event(self, kind: str, /, payload: bytes = b"", **fields: Any) -> None:
        await self.send_frame({"event": kind, **fields}, payload)

    async def serve(
        self,
        frames: Callable[[], Awaitable[tuple[Header, bytes] | None]],
        *,
        started: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Read frames until the link ends, dispatching each; then fail what is waiting.

        `started` runs (as a task of this channel) once frames are being read: the moment a
        link's owner may let others send requests on it, since their answers will be read.
        """
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                if started is not None:
                    tasks.create_task(self._notify_started(started))
                while True:
                    frame = await frames()
                    if frame is None:
                        break
                    self._dispatch(*frame)
                # the link is gone: fail every call waiting on it now (the tasks below may
                # be among them), and stop the work behind answers that cannot be sent
                self.close(LinkClosedError(f"{self.name} closed", retry_after=1.0))
                for task in list(self._running):
                    task.cancel()
        finally:
            self._tasks = None
            self.close(LinkClosedError(f"{self.name} closed", retry_after=1.0))

    async def _notify_started(self, started: Callable[[], Awaitable[None]]) -> None:
        try:
            await started()
        except Exception:
            log.exception("rpc.started_failed", extra={"link": self.name})

    def close(self, error: SandgateError) -> None:
        if self._closed is None:
            self._closed = error
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    def _dispatch(self, header: Header, payload: bytes) -> None:
        # the peer may be hostile (a sandbox's agent runs next to tenant code): check types
        request_id = header.get("id")
        if "ok" in header:
            if type(request_id) is not int:
                log.warning("rpc.bad_answer_id", extra={"link": self.name})
                return
            future = self._pending.get(request_id)
            if future is not None and not future.done():
                future.set_result((header, payload))
            return
        if type(request_id) is not int and "op" in header:
            log.warning("rpc.bad_request_id", extra={"link": self.name})
            return
        if "op" in header and self._tasks is not None and self._handler is not None:
            task = self._tasks.create_task(self._answer(header, payload))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            return
        if "event" in header and self._tasks is not None and self._on_event is not None:
            self._tasks.create_task(self._notify(header, payload))
            return
        log.warning("rpc.unexpected_frame", extra={"link": self.name, "keys": sorted(header)})

    async def _answer(self, header: Header, payload: bytes) -> None:
        assert self._handler is not None
        request_id = header.get("id")
        try:
            reply, body = await self._handler(header, payload)
            response: Header = {"id": request_id, "ok": True, **reply}
        except SandgateError as exc:
            response, body = {"id": request_id, "ok": False, "error": to_wire(exc)}, b""
        except Exception as exc:
            log.exception("rpc.handler_failed", extra={"link": self.name, "op": header.get("op")})
            response, body = (
                error_header(request_id, "worker_error", f"{type(exc).__name__}: {exc}"),
                b"",
            )
        try:
            await self.send_frame(response, body)
        except FrameError as exc:  # our own answer cannot be framed: nothing of it was sent
            log.warning("rpc.answer_too_large", extra={"link": self.name, "op": header.get("op")})
            too_large = error_header(
                request_id, "payload_too_large", f"the answer is too large to send: {exc}"
            )
            with contextlib.suppress(SandgateError):
                await self.send_frame(too_large)
        except SandgateError:
            pass  # the link closed; the caller's side fails its own wait

    async def _notify(self, header: Header, payload: bytes) -> None:
        assert self._on_event is not None
        try:
            await self._on_event(header, payload)
        except Exception:
            log.exception(
                "rpc.event_failed", extra={"link": self.name, "event": header.get("event")}
            )
