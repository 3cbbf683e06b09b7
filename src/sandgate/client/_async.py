# mypy: always-true=ASYNC
"""The asyncio client, `AsyncSandgate`, and the source of the blocking one.

`_sync.py` (`Sandgate`) is generated from this file by `scripts/async_to_sync.py`: `async` and
`await` go, the names map (`AsyncSandbox` -> `Sandbox`, `aclose` -> `close`, ...), worker-thread
calls become plain calls, and an `if ASYNC: ... else: ...` block keeps its `else` there. So
change the SDK here, then run the script; `scripts/check` fails when `_sync.py` is stale.

Local file reads and writes run in worker threads (anyio), so a large upload or download
never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import os
import time
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import anyio
import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from sandgate.client._base import (
    CHUNK_BYTES,
    CREATE_READ_TIMEOUT,
    DEFAULT_EXEC_TIMEOUT,
    DEFAULT_TIMEOUT,
    EXEC_JOB_FIRST_POLL,
    EXEC_JOB_POLL,
    KEEPALIVE_EXPIRY,
    NO_FOLLOW_IDLE,
    NO_FOLLOW_MAX,
    NOT_SENT,
    STDIN_CHUNK_BYTES,
    STREAM_IDLE_TIMEOUT,
    WAIT_POLL_MAX,
    Progress,
    RetryPolicy,
    Safety,
    SSEDecoder,
    Upload,
    UploadData,
    auth_headers,
    check_poll,
    connection_error,
    create_body,
    error_from_response,
    event_offset,
    exec_job_answer,
    exec_job_body,
    exec_job_timeout,
    list_params,
    make_timeout,
    output_event,
    partial_path,
    resolve_api_key,
    resolve_url,
    signal_name,
    ws_url,
)
from sandgate.client.errors import APIConnectionError, SandgateError
from sandgate.client.models import (
    ExecJob,
    ExecResult,
    FileEntry,
    OutputEvent,
    ProcessInfo,
    PtyToken,
    SandboxInfo,
)

ASYNC = True  # `if ASYNC: <asyncio> else: <blocking>`: scripts/async_to_sync.py keeps the else


if ASYNC:

    async def _chunks(upload: Upload, progress: Progress | None) -> AsyncIterator[bytes]:
        """An upload's body; reads of a local file or file object run in a worker thread."""
        pieces = upload.chunks(progress)
        if upload.in_memory:
            for piece in pieces:
                yield piece
            return
        try:
            while (read := await anyio.to_thread.run_sync(_next, pieces)) is not None:
                yield read
        finally:
            pieces.close()

    def _next(pieces: Iterator[bytes]) -> bytes | None:
        return next(pieces, None)

else:

    def _chunks(upload: Upload, progress: Progress | None) -> AsyncIterator[bytes]:
        """An upload's body, read in the caller's thread."""
        return upload.chunks(progress)


class _AsyncApi:
    """The HTTP session and the one retry loop every call goes through."""

    def __init__(
        self,
        url: str | None,
        api_key: str | None,
        timeout: float | httpx.Timeout,
        max_retries: int,
    ) -> None:
        self.url = resolve_url(url)
        self.api_key = resolve_api_key(api_key)
        self.timeout = make_timeout(timeout)
        self.policy = RetryPolicy(max_retries=max_retries)
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers=auth_headers(self.api_key),
            timeout=self.timeout,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY),
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        safety: Safety,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        upload: Upload | None = None,
        progress: Progress | None = None,
        headers: Mapping[str, str] | None = None,
        timeouts: httpx.Timeout | None = None,
        stream: bool = False,
        gone_ok: bool = False,
    ) -> httpx.Response:
        """Send with retries; an error answer raises. `gone_ok`: a 404 after a retry of a
        request that may have been carried out already counts as done (a repeated delete)."""
        attempt = 0
        maybe_done = False
        all_headers = {**(upload.headers() if upload else {}), **(headers or {})}
        while True:
            request = self.http.build_request(
                method,
                path,
                params=params,
                json=json,
                content=_chunks(upload, progress) if upload is not None else None,
                headers=all_headers,
                timeout=timeouts if timeouts is not None else self.timeout,
            )
            try:
                response = await self.http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if (
                    attempt < self.policy.max_retries
                    and self.policy.retries_exception(exc, safety)
                    and (upload is None or upload.resendable)
                ):
                    maybe_done = maybe_done or not isinstance(exc, NOT_SENT)
                    await anyio.sleep(self.policy.delay(attempt))
                    attempt += 1
                    continue
                raise connection_error(exc, str(request.url)) from exc
            if response.status_code < 400:
                return response
            try:
                body = await response.aread()
            except httpx.TransportError:
                body = b""
            finally:
                await response.aclose()
            error = error_from_response(response.status_code, body, response.headers)
            if gone_ok and maybe_done and response.status_code == 404:
                return response
            if (
                attempt < self.policy.max_retries
                and self.policy.retries_status(response.status_code, safety)
                and (upload is None or upload.resendable)
            ):
                await anyio.sleep(self.policy.delay(attempt, error.retry_after))
                attempt += 1
                continue
            raise error

    async def json(self, method: str, path: str, *, safety: Safety, **kw: Any) -> Any:
        return (await self.request(method, path, safety=safety, **kw)).json()

    def stream_timeout(self, read: float | None) -> httpx.Timeout:
        t = self.timeout
        return httpx.Timeout(connect=t.connect, read=read, write=t.write, pool=t.pool)

    async def aclose(self) -> None:
        await self.http.aclose()


class AsyncSandgate:
    """A sandgate API client.

    `url` defaults to `$SANDGATE_URL`, then `./.sandgate/url`, then http://127.0.0.1:8080;
    `api_key` to `$SANDGATE_API_KEY`, then the contents of `./.sandgate/api-key` if that file
    exists. Connection errors and 429/503 answers are retried up to `max_retries` times with
    jittered backoff honouring `Retry-After`; calls that must not run twice (execute, process
    start, stdin, signals) are retried only when the request never left (connect errors) or
    was refused unprocessed (429).
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = 3,
    ) -> None:
        self._api = _AsyncApi(url, api_key, timeout, max_retries)
        self.sandboxes = AsyncSandboxes(self._api)

    @property
    def url(self) -> str:
        return self._api.url

    async def get_exec_job(self, job_id: str) -> ExecJob:
        """An exec job by id, whatever its sandbox (see `Sandbox.submit_exec_job`)."""
        return await _AsyncExecJobs(self._api).get(job_id)

    async def wait_exec_job(
        self,
        job_id: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (sync twin's shape)
        poll: float = EXEC_JOB_POLL,
    ) -> ExecJob:
        """Poll an exec job until it succeeded or failed; `ExecJobTimeoutError` after `timeout`
        seconds (None: until it ends, which the server's own job timeout bounds)."""
        return await _AsyncExecJobs(self._api).wait(job_id, timeout=timeout, poll=poll)

    async def aclose(self) -> None:
        await self._api.aclose()

    async def __aenter__(self) -> AsyncSandgate:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class _AsyncExecJobs:
    """The exec-job calls, shared by `AsyncSandgate` and `AsyncSandbox`."""

    def __init__(self, api: _AsyncApi) -> None:
        self._api = api

    async def submit(
        self,
        sandbox: str,
        command: str,
        *,
        timeout: float | None,  # noqa: ASYNC109 (the server kills the command after it)
        env: Mapping[str, str] | None,
        cwd: str | None,
        idempotency_key: str | None,
    ) -> ExecJob:
        key = idempotency_key or str(uuid.uuid4())
        response = await self._api.request(
            "POST",
            f"/api/v1/sandboxes/{sandbox}/exec-jobs",
            safety=Safety.IDEMPOTENT,
            json=exec_job_body(command, timeout, env, cwd),
            headers={"Idempotency-Key": key},
        )
        return exec_job_answer(response)

    async def get(self, job_id: str) -> ExecJob:
        path = f"/api/v1/exec-jobs/{job_id}"
        return ExecJob.from_json(await self._api.json("GET", path, safety=Safety.IDEMPOTENT))

    async def list(self, sandbox: str, limit: int) -> builtins.list[ExecJob]:
        answer = await self._api.json(
            "GET",
            f"/api/v1/sandboxes/{sandbox}/exec-jobs",
            safety=Safety.IDEMPOTENT,
            params={"limit": limit},
        )
        return [ExecJob.from_json(body) for body in answer["exec_jobs"]]

    async def wait(
        self,
        job_id: str,
        *,
        timeout: float | None,  # noqa: ASYNC109 (sync twin's shape)
        poll: float,
    ) -> ExecJob:
        check_poll(poll)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = min(EXEC_JOB_FIRST_POLL, poll)
        while True:
            job = await self.get(job_id)
            if job.done:
                return job
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    assert timeout is not None
                    raise exec_job_timeout(job, timeout)
                await anyio.sleep(min(pause, left))
            else:
                await anyio.sleep(pause)
            pause = min(pause * 2, poll)


class AsyncSandboxes:
    def __init__(self, api: _AsyncApi) -> None:
        self._api = api

    def _wrap(self, body: dict[str, Any]) -> AsyncSandbox:
        return AsyncSandbox(_api=self._api, **SandboxInfo.fields_from_json(body))

    async def create(
        self,
        *,
        template: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the sandbox's life, sent to the server)
        metadata: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        network: bool | None = None,
        resources: Mapping[str, float] | None = None,
        idempotency_key: str | None = None,
    ) -> AsyncSandbox:
        """Create a sandbox and wait until it runs. Every retry of this call carries one
        Idempotency-Key (`idempotency_key`, or a fresh uuid4), so it makes one sandbox."""
        key = idempotency_key or str(uuid.uuid4())
        body = create_body(template, timeout, metadata, env, network, resources)
        answer = await self._api.json(
            "POST",
            "/api/v1/sandboxes",
            safety=Safety.IDEMPOTENT,
            json=body,
            headers={"Idempotency-Key": key},
            timeouts=self._api.stream_timeout(CREATE_READ_TIMEOUT),
        )
        return self._wrap(answer)

    async def list(
        self,
        *,
        state: str | Sequence[str] | None = None,
        metadata: Mapping[str, str] | None = None,
        page_size: int = 100,
    ) -> builtins.list[AsyncSandbox]:
        """Every sandbox matching (all pages), sorted by name; deleted ones only if asked."""
        return [s async for s in self.iter(state=state, metadata=metadata, page_size=page_size)]

    async def iter(
        self,
        *,
        state: str | Sequence[str] | None = None,
        metadata: Mapping[str, str] | None = None,
        page_size: int = 100,
    ) -> AsyncIterator[AsyncSandbox]:
        """Like `list`, fetching one page at a time as the iteration goes."""
        params = list_params(state, metadata, page_size)
        while True:
            page = await self._api.json(
                "GET", "/api/v1/sandboxes", safety=Safety.IDEMPOTENT, params=params
            )
            for body in page["sandboxes"]:
                yield self._wrap(body)
            if not page.get("next_cursor"):
                return
            params = {**params, "cursor": page["next_cursor"]}

    async def get(self, name: str) -> AsyncSandbox:
        path = f"/api/v1/sandboxes/{name}"
        return self._wrap(await self._api.json("GET", path, safety=Safety.IDEMPOTENT))

    async def delete(self, name: str) -> None:
        await self._api.request(
            "DELETE", f"/api/v1/sandboxes/{name}", safety=Safety.IDEMPOTENT, gone_ok=True
        )


@dataclass(kw_only=True, eq=False, repr=False)
class AsyncSandbox(SandboxInfo):
    """A sandbox: its description (as of the last answer) and what can be done in it."""

    _api: _AsyncApi

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.describe()})"

    @property
    def _path(self) -> str:
        return f"/api/v1/sandboxes/{self.name}"

    @property
    def files(self) -> AsyncFiles:
        return AsyncFiles(self._api, self.name)

    @property
    def processes(self) -> AsyncProcesses:
        return AsyncProcesses(self._api, self.name)

    def _update(self, body: dict[str, Any]) -> None:
        for key, value in SandboxInfo.fields_from_json(body).items():
            setattr(self, key, value)

    async def refresh(self) -> AsyncSandbox:
        self._update(await self._api.json("GET", self._path, safety=Safety.IDEMPOTENT))
        return self

    async def set_timeout(self, seconds: float) -> AsyncSandbox:
        """Let it live `seconds` more from now."""
        body = {"timeout": seconds}
        answer = await self._api.json(
            "POST", f"{self._path}/timeout", safety=Safety.IDEMPOTENT, json=body
        )
        self._update(answer)
        return self

    async def delete(self) -> None:
        await self._api.request("DELETE", self._path, safety=Safety.IDEMPOTENT, gone_ok=True)
        self.state = "deleted"

    async def run(
        self,
        code: str,
        language: str = "bash",
        timeout: float | None = None,  # noqa: ASYNC109 (the server enforces it in the sandbox)
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run `code` (bash, sh or python) to completion; `timeout` seconds (server default 30)."""
        body: dict[str, Any] = {"language": language, "code": code}
        if timeout is not None:
            body["timeout"] = timeout
        if env:
            body["env"] = dict(env)
        if cwd is not None:
            body["cwd"] = cwd
        waits = timeout if timeout is not None else DEFAULT_EXEC_TIMEOUT
        read = waits + (self._api.timeout.read or DEFAULT_TIMEOUT)
        answer = await self._api.json(
            "POST",
            f"{self._path}/execute",
            safety=Safety.UNSAFE,
            json=body,
            timeouts=self._api.stream_timeout(read),
        )
        return ExecResult.from_json(answer)

    async def submit_exec_job(
        self,
        command: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the server kills the command after it)
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        idempotency_key: str | None = None,
    ) -> ExecJob:
        """Run `command` (bash) once, in the background; the job comes back `queued`.

        Every retry of this call carries one Idempotency-Key (`idempotency_key`, or a fresh
        uuid4), so a retry after a lost answer gets the first job: the command runs once. The
        same key again with another command, timeout, env or cwd: `InvalidRequestError`
        (`idempotency_key_reused`). `timeout`: seconds it may run (server default 30)."""
        return await _AsyncExecJobs(self._api).submit(
            self.name, command, timeout=timeout, env=env, cwd=cwd, idempotency_key=idempotency_key
        )

    async def get_exec_job(self, job_id: str) -> ExecJob:
        """An exec job by id (as `AsyncSandgate.get_exec_job`)."""
        return await _AsyncExecJobs(self._api).get(job_id)

    async def list_exec_jobs(self, limit: int = 100) -> builtins.list[ExecJob]:
        """This sandbox's exec jobs, newest first, at most `limit` (1-1000), without their
        output (`stdout`, `stderr` empty): `get_exec_job` reads one with it."""
        return await _AsyncExecJobs(self._api).list(self.name, limit)

    async def wait_exec_job(
        self,
        job_id: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (sync twin's shape)
        poll: float = EXEC_JOB_POLL,
    ) -> ExecJob:
        """As `AsyncSandgate.wait_exec_job`: poll until it succeeded or failed."""
        return await _AsyncExecJobs(self._api).wait(job_id, timeout=timeout, poll=poll)

    async def pty_token(self, ttl: float | None = None) -> PtyToken:
        """A short-lived token that opens a terminal on this sandbox (`?token=`), for browsers."""
        body = {"ttl": ttl} if ttl is not None else None
        answer = await self._api.json(
            "POST", f"{self._path}/toolbox/pty-token", safety=Safety.IDEMPOTENT, json=body
        )
        return PtyToken.from_json(answer)

    if ASYNC:

        def pty(
            self, cols: int = 80, rows: int = 24, command: str | None = None
        ) -> _TerminalOpener:
            """Open a terminal (a login bash unless `command`): `async with sandbox.pty() as
            term:`, or `term = await sandbox.pty()`."""
            return _TerminalOpener(lambda: self._open_pty(cols, rows, command))

    else:

        def pty(self, cols: int = 80, rows: int = 24, command: str | None = None) -> AsyncTerminal:
            """Open a terminal (a login bash unless `command`); use it as a context manager."""
            return self._open_pty(cols, rows, command)

    async def _open_pty(self, cols: int, rows: int, command: str | None) -> AsyncTerminal:
        params = {"cols": cols, "rows": rows, "command": command}
        url = ws_url(self._api.url, f"{self._path}/toolbox/pty", params)
        headers = auth_headers(self._api.api_key)
        policy = self._api.policy
        attempt = 0
        while True:
            try:
                # entered as websockets >= 17 wants (the blocking flavour warns about a bare
                # connection); the terminal closes it
                ws = await connect(
                    url,
                    additional_headers=headers,
                    open_timeout=self._api.timeout.connect,
                    compression=None,
                    max_size=None,
                ).__aenter__()
                return AsyncTerminal(ws)
            except InvalidStatus as exc:
                answer = exc.response
                error = error_from_response(
                    answer.status_code, bytes(answer.body or b""), answer.headers
                )
                if attempt < policy.max_retries and answer.status_code == 429:
                    await anyio.sleep(policy.delay(attempt, error.retry_after))
                    attempt += 1
                    continue
                raise error from None
            except ConnectionRefusedError as exc:
                if attempt < policy.max_retries:
                    await anyio.sleep(policy.delay(attempt))
                    attempt += 1
                    continue
                raise APIConnectionError(f"cannot reach {self._api.url}: {exc}") from exc
            except (OSError, TimeoutError, InvalidHandshake) as exc:
                raise APIConnectionError(f"cannot open a terminal at {url}: {exc}") from exc


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
