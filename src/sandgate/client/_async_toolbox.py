# mypy: always-true=ASYNC
"""The asyncio client's toolbox: `AsyncFiles`, `AsyncProcesses` / `AsyncProcess`,
`AsyncTerminal` and `AsyncCodeContexts` with `_run_code` (a sandbox's `files`, `processes`, `pty()`,
`contexts` and `run_code`), on `_AsyncApi`.

`_sync_toolbox.py` is generated from this file by `scripts/async_to_sync.py`, as `_sync.py`
is from `_async.py` (see there). Local file reads and writes run in worker threads (anyio).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import inspect
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import anyio
import httpx
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from sandgate.client._async_api import _AsyncApi
from sandgate.client._base import (
    CHUNK_BYTES,
    CONTEXT_READ_TIMEOUT,
    DEFAULT_EXEC_TIMEOUT,
    DEFAULT_TIMEOUT,
    NO_FOLLOW_IDLE,
    NO_FOLLOW_MAX,
    STDIN_CHUNK_BYTES,
    STREAM_IDLE_TIMEOUT,
    WAIT_POLL_MAX,
    CodeEvent,
    ExecutionReader,
    Progress,
    Safety,
    SSEDecoder,
    Upload,
    UploadData,
    connection_error,
    event_offset,
    output_event,
    partial_path,
    run_code_body,
    signal_name,
)
from sandgate.client.errors import APIConnectionError, SandgateError
from sandgate.client.models import (
    CodeContext,
    Execution,
    ExecutionError,
    FileEntry,
    OutputEvent,
    OutputMessage,
    ProcessInfo,
    Result,
)

ASYNC = True  # `if ASYNC: <asyncio> else: <blocking>`: scripts/async_to_sync.py keeps the else


class AsyncFiles:
    """`/toolbox/files`: paths are relative to /workspace unless absolute (/workspace, /tmp)."""

    def __init__(self, api: _AsyncApi, sandbox: str) -> None:
        self._api = api
        self._path = f"/api/v1/sandboxes/{sandbox}/toolbox/files"

    async def write(
        self, path: str, data: UploadData, *, progress: Progress | None = None
    ) -> FileEntry:
        """Write a file (parents created, replaced atomically), streamed in 1 MiB chunks.

        `data`: bytes, a str (written as UTF-8), a local `os.PathLike` path, or a binary file
        object read from its current position. Nothing is read whole into memory."""
        upload = await anyio.to_thread.run_sync(Upload, data)
        response = await self._api.request(
            "PUT",
            self._path,
            safety=Safety.IDEMPOTENT,
            params={"path": path},
            upload=upload,
            progress=progress,
            timeouts=self._api.stream_timeout(self._api.timeout.read),
        )
        return FileEntry.from_json(response.json())

    async def read(self, path: str) -> bytes:
        """A whole file in memory; use `download` for large ones."""
        response = await self._api.request(
            "GET", self._path, safety=Safety.IDEMPOTENT, params={"path": path}
        )
        return response.content

    async def download(
        self,
        path: str,
        dest: str | os.PathLike[str] | IO[bytes],
        *,
        progress: Progress | None = None,
    ) -> int:
        """Stream a file to a local path (written beside it, then renamed into place) or into
        a binary file object. Returns the number of bytes."""
        if not isinstance(dest, str | os.PathLike):
            return await self._download_to(path, dest, progress, restartable=False)
        target = Path(dest)
        partial = partial_path(target)
        try:
            handle = await anyio.to_thread.run_sync(partial.open, "wb")
            try:
                size = await self._download_to(path, handle, progress, restartable=True)
            finally:
                await anyio.to_thread.run_sync(handle.close)
            await anyio.to_thread.run_sync(os.replace, partial, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
        return size

    async def _download_to(
        self, path: str, handle: IO[bytes], progress: Progress | None, *, restartable: bool
    ) -> int:
        failures = 0
        policy = self._api.policy
        while True:
            response = await self._api.request(
                "GET", self._path, safety=Safety.IDEMPOTENT, params={"path": path}, stream=True
            )
            length = response.headers.get("content-length")
            total = int(length) if length is not None else None
            done = 0
            try:
                if restartable:
                    await anyio.to_thread.run_sync(_rewind, handle)
                if progress is not None:
                    progress(0, total)
                async for piece in response.aiter_bytes(CHUNK_BYTES):
                    await anyio.to_thread.run_sync(handle.write, piece)
                    done += len(piece)
                    if progress is not None:
                        progress(done, total)
            except httpx.TransportError as exc:
                failures += 1
                if (restartable or done == 0) and failures <= policy.max_retries:
                    await anyio.sleep(policy.delay(failures - 1))
                    continue
                raise connection_error(exc, str(response.url)) from exc
            finally:
                await response.aclose()
            if total is not None and done != total:
                raise APIConnectionError(f"{path}: got {done} of {total} bytes")
            return done

    async def list(self, path: str = "/workspace") -> builtins.list[FileEntry]:
        answer = await self._api.json(
            "GET", f"{self._path}/list", safety=Safety.IDEMPOTENT, params={"path": path}
        )
        return [FileEntry.from_json(entry) for entry in answer["entries"]]

    async def stat(self, path: str) -> FileEntry:
        answer = await self._api.json(
            "GET", f"{self._path}/stat", safety=Safety.IDEMPOTENT, params={"path": path}
        )
        return FileEntry.from_json(answer)

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except SandgateError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        await self._api.request(
            "DELETE", self._path, safety=Safety.IDEMPOTENT, params=params, gone_ok=True
        )

    async def mkdir(self, path: str, *, parents: bool = True) -> FileEntry:
        body = {"path": path, "parents": parents}
        safety = Safety.IDEMPOTENT if parents else Safety.UNSAFE
        answer = await self._api.json("POST", f"{self._path}/mkdir", safety=safety, json=body)
        return FileEntry.from_json(answer)

    async def move(self, source: str, destination: str, *, overwrite: bool = False) -> FileEntry:
        body = {"source": source, "destination": destination, "overwrite": overwrite}
        answer = await self._api.json("POST", f"{self._path}/move", safety=Safety.UNSAFE, json=body)
        return FileEntry.from_json(answer)


def _rewind(handle: IO[bytes]) -> None:
    handle.seek(0)
    handle.truncate()


class AsyncProcesses:
    """`/toolbox/processes`: background processes whose output can be followed live."""

    def __init__(self, api: _AsyncApi, sandbox: str) -> None:
        self._api = api
        self._path = f"/api/v1/sandboxes/{sandbox}/toolbox/processes"

    def _wrap(self, body: dict[str, Any]) -> AsyncProcess:
        return AsyncProcess(_api=self._api, _base=self._path, **ProcessInfo.fields_from_json(body))

    async def start(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the server kills the process after it)
    ) -> AsyncProcess:
        """Start `command` under `bash -c` in its own process group; it runs in the background."""
        body: dict[str, Any] = {"command": command}
        if cwd is not None:
            body["cwd"] = cwd
        if env:
            body["env"] = dict(env)
        if timeout is not None:
            body["timeout"] = timeout
        answer = await self._api.json("POST", self._path, safety=Safety.UNSAFE, json=body)
        return self._wrap(answer)

    async def list(self) -> builtins.list[AsyncProcess]:
        answer = await self._api.json("GET", self._path, safety=Safety.IDEMPOTENT)
        return [self._wrap(body) for body in answer["processes"]]

    async def get(self, pid: int) -> AsyncProcess:
        answer = await self._api.json("GET", f"{self._path}/{pid}", safety=Safety.IDEMPOTENT)
        return self._wrap(answer)


@dataclass(kw_only=True, eq=False, repr=False)
class AsyncProcess(ProcessInfo):
    """A background process. `dropped_bytes` counts output lost to the replay buffer."""

    _api: _AsyncApi
    _base: str
    dropped_bytes: int = 0

    def __repr__(self) -> str:
        return f"AsyncProcess({self.describe()}, dropped_bytes={self.dropped_bytes})"

    @property
    def _path(self) -> str:
        return f"{self._base}/{self.pid}"

    async def refresh(self) -> AsyncProcess:
        body = await self._api.json("GET", self._path, safety=Safety.IDEMPOTENT)
        for key, value in ProcessInfo.fields_from_json(body).items():
            setattr(self, key, value)
        return self

    async def output(self, offset: int = 0, *, follow: bool = True) -> AsyncIterator[OutputEvent]:
        """Output events from `offset` (0: from the start the buffer still holds) until the
        process exits; then `exit_code` is set. A broken connection is resumed at the last
        offset. `follow=False` gives what the process wrote so far and stops (the server's
        `follow=false`), with `exit_code` set if it has exited. To stop early, close it:
        `with contextlib.aclosing(process.output()) as events:`."""
        position = offset
        failures = 0
        policy = self._api.policy
        idle = STREAM_IDLE_TIMEOUT if follow else NO_FOLLOW_IDLE
        give_up = None if follow else time.monotonic() + NO_FOLLOW_MAX
        while True:
            response = await self._api.request(
                "GET",
                f"{self._path}/stream",
                safety=Safety.IDEMPOTENT,
                params={"offset": position} | ({} if follow else {"follow": "false"}),
                stream=True,
                timeouts=self._api.stream_timeout(idle),
            )
            try:
                decoder = SSEDecoder()
                async for line in response.aiter_lines():
                    event = decoder.feed(line)
                    if event is None:
                        continue
                    failures = 0
                    if event.event in ("stdout", "stderr"):
                        out = output_event(event, 0)
                        position = event_offset(event, position + len(out.data))
                        yield OutputEvent(stream=out.stream, data=out.data, offset=position)
                        if give_up is not None and time.monotonic() > give_up:
                            return  # not following, and it keeps talking: enough for now
                    elif event.event == "dropped":
                        self.dropped_bytes += int(json.loads(event.data).get("bytes", 0))
                        position = event_offset(event, position)
                    elif event.event == "exit":
                        self.exit_code = int(json.loads(event.data)["exit_code"])
                        self.state = "exited"
                        return
            except httpx.ReadTimeout:
                if not follow:
                    return
                continue
            except httpx.TransportError as exc:
                failures += 1
                if failures > policy.max_retries:
                    raise connection_error(exc, str(response.url)) from exc
                await anyio.sleep(policy.delay(failures - 1))
                continue
            finally:
                await response.aclose()
            if not follow:
                return  # the server sent what there is (follow=false) and ended the stream
            failures += 1
            if failures > policy.max_retries:
                raise APIConnectionError(f"the output of process {self.pid} ended before its exit")
            await anyio.sleep(policy.delay(failures - 1))

    async def send_stdin(self, data: bytes | str) -> int:
        """Write to the process's stdin (in 1 MiB requests); returns the bytes written."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        written = 0
        for start in range(0, len(raw), STDIN_CHUNK_BYTES):
            written += await self._stdin(raw[start : start + STDIN_CHUNK_BYTES], close=False)
        return written

    async def close_stdin(self) -> None:
        await self._stdin(b"", close=True)

    async def _stdin(self, data: bytes, *, close: bool) -> int:
        answer = await self._api.json(
            "POST",
            f"{self._path}/stdin",
            safety=Safety.UNSAFE,
            params={"close": "true"} if close else None,
            upload=Upload(data),
        )
        return int(answer["written"])

    async def kill(self, signal: str | int = "SIGTERM") -> None:
        """Send a signal (a name such as "SIGTERM", "KILL", or a number) to its process group."""
        name = signal_name(signal)
        await self._api.request(
            "POST", f"{self._path}/signal", safety=Safety.UNSAFE, json={"signal": name}
        )

    async def wait(self, timeout: float | None = None) -> int:  # noqa: ASYNC109 (sync twin's shape)
        """Wait until it exits; its exit code. `TimeoutError` after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.02
        while self.exit_code is None or self.state != "exited":
            await self.refresh()
            if self.state == "exited":
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"process {self.pid} still runs after {timeout} s")
            await anyio.sleep(pause)
            pause = min(pause * 2, WAIT_POLL_MAX)
        assert self.exit_code is not None
        return self.exit_code


class AsyncTerminal:
    """A PTY in the sandbox over a WebSocket: bytes both ways, resizable."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self.exit_code: int | None = None
        self._ended = False

    async def send(self, data: bytes | str) -> None:
        """Type into the terminal (Ctrl-C is the byte 0x03)."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        try:
            await self._ws.send(raw)
        except ConnectionClosed as exc:
            raise APIConnectionError("the terminal is closed", code="closed") from exc

    async def recv(self, timeout: float | None = None) -> bytes | None:  # noqa: ASYNC109 (sync twin's shape)
        """The next terminal output; None once the shell exited (see `exit_code`).
        `TimeoutError` if nothing came within `timeout` seconds."""
        while not self._ended:
            try:
                if ASYNC:
                    async with asyncio.timeout(timeout):
                        message = await self._ws.recv()
                else:
                    message = self._ws.recv(timeout)
            except ConnectionClosed:
                self._ended = True
                break
            if isinstance(message, bytes):
                return message
            self._control(message)
        return None

    def _control(self, text: str) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            return
        if isinstance(message, dict) and message.get("type") == "exit":
            code = message.get("exit_code")
            self.exit_code = int(code) if code is not None else None

    async def resize(self, cols: int, rows: int) -> None:
        try:
            await self._ws.send(json.dumps({"type": "resize", "cols": cols, "rows": rows}))
        except ConnectionClosed as exc:
            raise APIConnectionError("the terminal is closed", code="closed") from exc

    async def aclose(self) -> None:
        """Hang up: the shell gets SIGHUP."""
        await self._ws.close()

    async def __aenter__(self) -> AsyncTerminal:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class AsyncCodeContexts:
    """`/contexts`: a sandbox's code contexts, stateful interpreters (IPython kernels) that
    `run_code(context=...)` runs in. Each lives until it is deleted or its sandbox goes."""

    def __init__(self, api: _AsyncApi, sandbox: str) -> None:
        self._api = api
        self._path = f"/api/v1/sandboxes/{sandbox}/contexts"

    async def create(self, language: str = "python", cwd: str | None = None) -> CodeContext:
        """A new context, its kernel started and answering; `cwd` defaults to /workspace.
        Not retried once sent (a retry could start a second kernel)."""
        body: dict[str, Any] = {"language": language}
        if cwd is not None:
            body["cwd"] = cwd
        answer = await self._api.json(
            "POST",
            self._path,
            safety=Safety.UNSAFE,
            json=body,
            timeouts=self._api.stream_timeout(CONTEXT_READ_TIMEOUT),
        )
        return CodeContext.from_json(answer)

    async def list(self) -> builtins.list[CodeContext]:
        """The sandbox's contexts, `default` among them once a `run_code` without a context
        made it."""
        answer = await self._api.json("GET", self._path, safety=Safety.IDEMPOTENT)
        return [CodeContext.from_json(body) for body in answer]

    async def delete(self, context: CodeContext | str) -> None:
        """Shut its kernel down: its state is gone, and runs in it answer 404."""
        await self._api.request(
            "DELETE",
            f"{self._path}/{_context_id(context)}",
            safety=Safety.IDEMPOTENT,
            gone_ok=True,
        )

    async def restart(self, context: CodeContext | str) -> CodeContext:
        """A fresh kernel for the context: every variable and import is forgotten."""
        answer = await self._api.json(
            "POST",
            f"{self._path}/{_context_id(context)}/restart",
            safety=Safety.IDEMPOTENT,
            timeouts=self._api.stream_timeout(CONTEXT_READ_TIMEOUT),
        )
        return CodeContext.from_json(answer)


def _context_id(context: CodeContext | str) -> str:
    return context.id if isinstance(context, CodeContext) else str(context)


async def _run_code(
    api: _AsyncApi,
    sandbox: str,
    code: str,
    *,
    context: CodeContext | str | None,
    env: Mapping[str, str] | None,
    timeout: float | None,  # noqa: ASYNC109 (the kernel is interrupted after it)
    on_stdout: Callable[[OutputMessage], Any] | None,
    on_stderr: Callable[[OutputMessage], Any] | None,
    on_result: Callable[[Result], Any] | None,
    on_error: Callable[[ExecutionError], Any] | None,
    language: str | None = None,
) -> Execution:
    """`Sandbox.run_code`: POST the code, read the server-sent events as they come, each
    given to its callback at once. Never retried once sent (the code could run twice); a
    callback that raises, or a broken connection, ends the stream, and the server interrupts
    the code."""
    base = f"/api/v1/sandboxes/{sandbox}"
    path = f"{base}/run-code" if context is None else f"{base}/contexts/{_context_id(context)}/run"
    # a run says nothing while its code computes; the first use of the default context waits
    # for its kernel to start
    waits = timeout if timeout is not None else DEFAULT_EXEC_TIMEOUT
    read = max(waits + (api.timeout.read or DEFAULT_TIMEOUT), CONTEXT_READ_TIMEOUT)
    response = await api.request(
        "POST",
        path,
        safety=Safety.UNSAFE,
        json=run_code_body(code, env, timeout, language if context is None else None),
        stream=True,
        timeouts=api.stream_timeout(read),
    )
    reader = ExecutionReader()
    decoder = SSEDecoder()
    try:
        async for line in response.aiter_lines():
            event = decoder.feed(line)
            if event is None:
                continue
            piece = reader.feed(event)
            if piece is not None:
                await _notify(piece, on_stdout, on_stderr, on_result, on_error)
    except httpx.TransportError as exc:
        raise connection_error(exc, str(response.url)) from exc
    finally:
        await response.aclose()
    if not reader.ended:
        raise APIConnectionError(
            "the run's stream ended before the run did (the code may have run)",
            code="connection_error",
        )
    return reader.execution


async def _notify(
    piece: CodeEvent,
    on_stdout: Callable[[OutputMessage], Any] | None,
    on_stderr: Callable[[OutputMessage], Any] | None,
    on_result: Callable[[Result], Any] | None,
    on_error: Callable[[ExecutionError], Any] | None,
) -> None:
    """Give `piece` to its callback; in the asyncio client a callback may be a coroutine."""
    handler = _handler_of(piece, on_stdout, on_stderr, on_result, on_error)
    if handler is None:
        return
    if ASYNC:
        outcome = handler(piece)
        if inspect.isawaitable(outcome):
            await outcome
    else:
        handler(piece)


def _handler_of(
    piece: CodeEvent,
    on_stdout: Callable[[OutputMessage], Any] | None,
    on_stderr: Callable[[OutputMessage], Any] | None,
    on_result: Callable[[Result], Any] | None,
    on_error: Callable[[ExecutionError], Any] | None,
) -> Callable[[Any], Any] | None:
    if isinstance(piece, OutputMessage):
        return on_stdout if piece.stream == "stdout" else on_stderr
    if isinstance(piece, Result):
        return on_result
    return on_error


if ASYNC:  # the blocking `pty()` returns its `Terminal` open

    class _TerminalOpener:
        """What `AsyncSandbox.pty()` returns: await it, or use it with `async with`."""

        def __init__(self, open_: Callable[[], Awaitable[AsyncTerminal]]) -> None:
            self._open = open_
            self._terminal: AsyncTerminal | None = None

        def __await__(self) -> Generator[Any, None, AsyncTerminal]:
            return self._open().__await__()

        async def __aenter__(self) -> AsyncTerminal:
            self._terminal = await self._open()
            return self._terminal

        async def __aexit__(
            self,
            exc_type: type[BaseException] | None,
            exc: BaseException | None,
            tb: TracebackType | None,
        ) -> None:
            if self._terminal is not None:
                await self._terminal.aclose()
