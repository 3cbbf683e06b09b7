"""The blocking client: `Sandgate`. `_async.py` has the same shape with `await`."""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from sandgate.client._base import (
    CHUNK_BYTES,
    CREATE_READ_TIMEOUT,
    DEFAULT_EXEC_TIMEOUT,
    DEFAULT_TIMEOUT,
    EXEC_JOB_FIRST_POLL,
    EXEC_JOB_POLL,
    KEEPALIVE_EXPIRY,
    NOT_SENT,
    STDIN_CHUNK_BYTES,
    Progress,
    RetryPolicy,
    Safety,
    SSEDecoder,
    Upload,
    UploadData,
    auth_headers,
    check_poll,
    connection_error,
    error_from_response,
    event_offset,
    exec_job_answer,
    exec_job_body,
    exec_job_timeout,
    is_local_path,
    make_timeout,
    output_event,
    partial_path,
    resolve_api_key,
    resolve_url,
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

STREAM_IDLE_TIMEOUT = 60.0  # a followed stream silent this long is reopened at its offset
NO_FOLLOW_IDLE = 1.0  # `output(follow=False)` stops after this long without output
NO_FOLLOW_MAX = 5.0  # ... or after this long in all, for a process that never pauses
WAIT_POLL_MAX = 0.5


class _Api:
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
        self.http = httpx.Client(
            base_url=self.url,
            headers=auth_headers(self.api_key),
            timeout=self.timeout,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY),
        )

    def request(
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
                content=upload.chunks(progress) if upload is not None else None,
                headers=all_headers,
                timeout=timeouts if timeouts is not None else self.timeout,
            )
            try:
                response = self.http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if (
                    attempt < self.policy.max_retries
                    and self.policy.retries_exception(exc, safety)
                    and (upload is None or upload.resendable)
                ):
                    maybe_done = maybe_done or not isinstance(exc, NOT_SENT)
                    time.sleep(self.policy.delay(attempt))
                    attempt += 1
                    continue
                raise connection_error(exc, str(request.url)) from exc
            if response.status_code < 400:
                return response
            try:
                body = response.read()
            except httpx.TransportError:
                body = b""
            finally:
                response.close()
            error = error_from_response(response.status_code, body, response.headers)
            if gone_ok and maybe_done and response.status_code == 404:
                return response
            if (
                attempt < self.policy.max_retries
                and self.policy.retries_status(response.status_code, safety)
                and (upload is None or upload.resendable)
            ):
                time.sleep(self.policy.delay(attempt, error.retry_after))
                attempt += 1
                continue
            raise error

    def json(self, method: str, path: str, *, safety: Safety, **kw: Any) -> Any:
        return self.request(method, path, safety=safety, **kw).json()

    def stream_timeout(self, read: float | None) -> httpx.Timeout:
        t = self.timeout
        return httpx.Timeout(connect=t.connect, read=read, write=t.write, pool=t.pool)

    def close(self) -> None:
        self.http.close()


class Sandgate:
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
        self._api = _Api(url, api_key, timeout, max_retries)
        self.sandboxes = Sandboxes(self._api)

    @property
    def url(self) -> str:
        return self._api.url

    def get_exec_job(self, job_id: str) -> ExecJob:
        """An exec job by id, whatever its sandbox (see `Sandbox.submit_exec_job`)."""
        return _ExecJobs(self._api).get(job_id)

    def wait_exec_job(
        self, job_id: str, *, timeout: float | None = None, poll: float = EXEC_JOB_POLL
    ) -> ExecJob:
        """Poll an exec job until it succeeded or failed; `ExecJobTimeoutError` after `timeout`
        seconds (None: until it ends, which the server's own job timeout bounds)."""
        return _ExecJobs(self._api).wait(job_id, timeout=timeout, poll=poll)

    def close(self) -> None:
        self._api.close()

    def __enter__(self) -> Sandgate:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _create_body(
    template: str | None,
    timeout: float | None,
    metadata: Mapping[str, str] | None,
    env: Mapping[str, str] | None,
    network: bool | None,
    resources: Mapping[str, float] | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if template is not None:
        body["template"] = template
    if timeout is not None:
        body["timeout"] = timeout
    if metadata:
        body["metadata"] = dict(metadata)
    if env:
        body["env"] = dict(env)
    if network is not None:
        body["network"] = network
    if resources:
        body["resources"] = dict(resources)
    return body


def _list_params(
    state: str | Sequence[str] | None, metadata: Mapping[str, str] | None, limit: int
) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": limit}
    if state:
        params["state"] = state if isinstance(state, str) else ",".join(state)
    for key, value in (metadata or {}).items():
        params[f"metadata.{key}"] = value
    return params


class _ExecJobs:
    """The exec-job calls, shared by `Sandgate` and `Sandbox`."""

    def __init__(self, api: _Api) -> None:
        self._api = api

    def submit(
        self,
        sandbox: str,
        command: str,
        *,
        timeout: float | None,
        env: Mapping[str, str] | None,
        cwd: str | None,
        idempotency_key: str | None,
    ) -> ExecJob:
        key = idempotency_key or str(uuid.uuid4())
        response = self._api.request(
            "POST",
            f"/api/v1/sandboxes/{sandbox}/exec-jobs",
            safety=Safety.IDEMPOTENT,
            json=exec_job_body(command, timeout, env, cwd),
            headers={"Idempotency-Key": key},
        )
        return exec_job_answer(response)

    def get(self, job_id: str) -> ExecJob:
        answer = self._api.json("GET", f"/api/v1/exec-jobs/{job_id}", safety=Safety.IDEMPOTENT)
        return ExecJob.from_json(answer)

    def list(self, sandbox: str, limit: int) -> builtins.list[ExecJob]:
        answer = self._api.json(
            "GET",
            f"/api/v1/sandboxes/{sandbox}/exec-jobs",
            safety=Safety.IDEMPOTENT,
            params={"limit": limit},
        )
        return [ExecJob.from_json(body) for body in answer["exec_jobs"]]

    def wait(self, job_id: str, *, timeout: float | None, poll: float) -> ExecJob:
        check_poll(poll)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = min(EXEC_JOB_FIRST_POLL, poll)
        while True:
            job = self.get(job_id)
            if job.done:
                return job
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    assert timeout is not None
                    raise exec_job_timeout(job, timeout)
                time.sleep(min(pause, left))
            else:
                time.sleep(pause)
            pause = min(pause * 2, poll)


class Sandboxes:
    def __init__(self, api: _Api) -> None:
        self._api = api

    def _wrap(self, body: dict[str, Any]) -> Sandbox:
        return Sandbox(_api=self._api, **SandboxInfo.fields_from_json(body))

    def create(
        self,
        *,
        template: str | None = None,
        timeout: float | None = None,
        metadata: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        network: bool | None = None,
        resources: Mapping[str, float] | None = None,
        idempotency_key: str | None = None,
    ) -> Sandbox:
        """Create a sandbox and wait until it runs. Every retry of this call carries one
        Idempotency-Key (`idempotency_key`, or a fresh uuid4), so it makes one sandbox."""
        key = idempotency_key or str(uuid.uuid4())
        body = _create_body(template, timeout, metadata, env, network, resources)
        answer = self._api.json(
            "POST",
            "/api/v1/sandboxes",
            safety=Safety.IDEMPOTENT,
            json=body,
            headers={"Idempotency-Key": key},
            timeouts=self._api.stream_timeout(CREATE_READ_TIMEOUT),
        )
        return self._wrap(answer)

    def list(
        self,
        *,
        state: str | Sequence[str] | None = None,
        metadata: Mapping[str, str] | None = None,
        page_size: int = 100,
    ) -> builtins.list[Sandbox]:
        """Every sandbox matching (all pages), sorted by name; deleted ones only if asked."""
        return builtins.list(self.iter(state=state, metadata=metadata, page_size=page_size))

    def iter(
        self,
        *,
        state: str | Sequence[str] | None = None,
        metadata: Mapping[str, str] | None = None,
        page_size: int = 100,
    ) -> Iterator[Sandbox]:
        """Like `list`, fetching one page at a time as the iteration goes."""
        params = _list_params(state, metadata, page_size)
        while True:
            page = self._api.json(
                "GET", "/api/v1/sandboxes", safety=Safety.IDEMPOTENT, params=params
            )
            for body in page["sandboxes"]:
                yield self._wrap(body)
            if not page.get("next_cursor"):
                return
            params = {**params, "cursor": page["next_cursor"]}

    def get(self, name: str) -> Sandbox:
        path = f"/api/v1/sandboxes/{name}"
        return self._wrap(self._api.json("GET", path, safety=Safety.IDEMPOTENT))

    def delete(self, name: str) -> None:
        self._api.request(
            "DELETE", f"/api/v1/sandboxes/{name}", safety=Safety.IDEMPOTENT, gone_ok=True
        )


@dataclass(kw_only=True, eq=False, repr=False)
class Sandbox(SandboxInfo):
    """A sandbox: its description (as of the last answer) and what can be done in it."""

    _api: _Api

    def __repr__(self) -> str:
        return f"Sandbox({self.describe()})"

    @property
    def _path(self) -> str:
        return f"/api/v1/sandboxes/{self.name}"

    @property
    def files(self) -> Files:
        return Files(self._api, self.name)

    @property
    def processes(self) -> Processes:
        return Processes(self._api, self.name)

    def _update(self, body: dict[str, Any]) -> None:
        for key, value in SandboxInfo.fields_from_json(body).items():
            setattr(self, key, value)

    def refresh(self) -> Sandbox:
        self._update(self._api.json("GET", self._path, safety=Safety.IDEMPOTENT))
        return self

    def set_timeout(self, seconds: float) -> Sandbox:
        """Let it live `seconds` more from now."""
        body = {"timeout": seconds}
        answer = self._api.json(
            "POST", f"{self._path}/timeout", safety=Safety.IDEMPOTENT, json=body
        )
        self._update(answer)
        return self

    def delete(self) -> None:
        self._api.request("DELETE", self._path, safety=Safety.IDEMPOTENT, gone_ok=True)
        self.state = "deleted"

    def run(
        self,
        code: str,
        language: str = "bash",
        timeout: float | None = None,
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
        answer = self._api.json(
            "POST",
            f"{self._path}/execute",
            safety=Safety.UNSAFE,
            json=body,
            timeouts=self._api.stream_timeout(read),
        )
        return ExecResult.from_json(answer)

    def submit_exec_job(
        self,
        command: str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        idempotency_key: str | None = None,
    ) -> ExecJob:
        """Run `command` (bash) once, in the background; the job comes back `queued`.

        Every retry of this call carries one Idempotency-Key (`idempotency_key`, or a fresh
        uuid4), so a retry after a lost answer gets the first job: the command runs once. The
        same key again with another command, timeout, env or cwd: `InvalidRequestError`
        (`idempotency_key_reused`). `timeout`: seconds it may run (server default 30)."""
        return _ExecJobs(self._api).submit(
            self.name, command, timeout=timeout, env=env, cwd=cwd, idempotency_key=idempotency_key
        )

    def get_exec_job(self, job_id: str) -> ExecJob:
        """An exec job by id (as `Sandgate.get_exec_job`)."""
        return _ExecJobs(self._api).get(job_id)

    def list_exec_jobs(self, limit: int = 100) -> builtins.list[ExecJob]:
        """This sandbox's exec jobs, newest first, at most `limit` (1-1000), without their
        output (`stdout`, `stderr` empty): `get_exec_job` reads one with it."""
        return _ExecJobs(self._api).list(self.name, limit)

    def wait_exec_job(
        self, job_id: str, *, timeout: float | None = None, poll: float = EXEC_JOB_POLL
    ) -> ExecJob:
        """As `Sandgate.wait_exec_job`: poll until it succeeded or failed."""
        return _ExecJobs(self._api).wait(job_id, timeout=timeout, poll=poll)

    def pty_token(self, ttl: float | None = None) -> PtyToken:
        """A short-lived token that opens a terminal on this sandbox (`?token=`), for browsers."""
        body = {"ttl": ttl} if ttl is not None else None
        answer = self._api.json(
            "POST", f"{self._path}/toolbox/pty-token", safety=Safety.IDEMPOTENT, json=body
        )
        return PtyToken.from_json(answer)

    def pty(self, cols: int = 80, rows: int = 24, command: str | None = None) -> Terminal:
        """Open a terminal (a login bash unless `command`); use it as a context manager."""
        params = {"cols": cols, "rows": rows, "command": command}
        url = ws_url(self._api.url, f"{self._path}/toolbox/pty", params)
        headers = auth_headers(self._api.api_key)
        policy = self._api.policy
        attempt = 0
        while True:
            try:
                ws = connect(
                    url,
                    additional_headers=headers,
                    open_timeout=self._api.timeout.connect,
                    compression=None,
                    max_size=None,
                )
                # entered as websockets >= 17 wants (it warns about a bare connection); the
                # Terminal closes it
                return Terminal(ws.__enter__())
            except InvalidStatus as exc:
                answer = exc.response
                error = error_from_response(
                    answer.status_code, bytes(answer.body or b""), answer.headers
                )
                if attempt < policy.max_retries and answer.status_code == 429:
                    time.sleep(policy.delay(attempt, error.retry_after))
                    attempt += 1
                    continue
                raise error from None
            except ConnectionRefusedError as exc:
                if attempt < policy.max_retries:
                    time.sleep(policy.delay(attempt))
                    attempt += 1
                    continue
                raise APIConnectionError(f"cannot reach {self._api.url}: {exc}") from exc
            except (OSError, TimeoutError, InvalidHandshake) as exc:
                raise APIConnectionError(f"cannot open a terminal at {url}: {exc}") from exc


class Files:
    """`/toolbox/files`: paths are relative to /workspace unless absolute (/workspace, /tmp)."""

    def __init__(self, api: _Api, sandbox: str) -> None:
        self._api = api
        self._path = f"/api/v1/sandboxes/{sandbox}/toolbox/files"

    def write(self, path: str, data: UploadData, *, progress: Progress | None = None) -> FileEntry:
        """Write a file (parents created, replaced atomically), streamed in 1 MiB chunks.

        `data`: bytes, a str (written as UTF-8), a local `os.PathLike` path, or a binary file
        object read from its current position. Nothing is read whole into memory."""
        upload = Upload(data)
        response = self._api.request(
            "PUT",
            self._path,
            safety=Safety.IDEMPOTENT,
            params={"path": path},
            upload=upload,
            progress=progress,
            timeouts=self._api.stream_timeout(self._api.timeout.read),
        )
        return FileEntry.from_json(response.json())

    def read(self, path: str) -> bytes:
        """A whole file in memory; use `download` for large ones."""
        return self._api.request(
            "GET", self._path, safety=Safety.IDEMPOTENT, params={"path": path}
        ).content

    def download(
        self,
        path: str,
        dest: str | os.PathLike[str] | IO[bytes],
        *,
        progress: Progress | None = None,
    ) -> int:
        """Stream a file to a local path (written beside it, then renamed into place) or into
        a binary file object. Returns the number of bytes."""
        if not is_local_path(dest):
            assert not isinstance(dest, str | os.PathLike)
            return self._download_to(path, dest, progress, restartable=False)
        target = Path(dest)  # type: ignore[arg-type]
        partial = partial_path(target)
        try:
            with partial.open("wb") as handle:
                size = self._download_to(path, handle, progress, restartable=True)
            os.replace(partial, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
        return size

    def _download_to(
        self, path: str, handle: IO[bytes], progress: Progress | None, *, restartable: bool
    ) -> int:
        failures = 0
        policy = self._api.policy
        while True:
            response = self._api.request(
                "GET", self._path, safety=Safety.IDEMPOTENT, params={"path": path}, stream=True
            )
            total = (
                int(response.headers["content-length"])
                if "content-length" in response.headers
                else None
            )
            done = 0
            try:
                if restartable:
                    handle.seek(0)
                    handle.truncate()
                if progress is not None:
                    progress(0, total)
                for piece in response.iter_bytes(CHUNK_BYTES):
                    handle.write(piece)
                    done += len(piece)
                    if progress is not None:
                        progress(done, total)
            except httpx.TransportError as exc:
                failures += 1
                if (restartable or done == 0) and failures <= policy.max_retries:
                    time.sleep(policy.delay(failures - 1))
                    continue
                raise connection_error(exc, str(response.url)) from exc
            finally:
                response.close()
            if total is not None and done != total:
                raise APIConnectionError(f"{path}: got {done} of {total} bytes")
            return done

    def list(self, path: str = "/workspace") -> builtins.list[FileEntry]:
        answer = self._api.json(
            "GET", f"{self._path}/list", safety=Safety.IDEMPOTENT, params={"path": path}
        )
        return [FileEntry.from_json(entry) for entry in answer["entries"]]

    def stat(self, path: str) -> FileEntry:
        answer = self._api.json(
            "GET", f"{self._path}/stat", safety=Safety.IDEMPOTENT, params={"path": path}
        )
        return FileEntry.from_json(answer)

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except SandgateError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def remove(self, path: str, *, recursive: bool = False) -> None:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        self._api.request(
            "DELETE", self._path, safety=Safety.IDEMPOTENT, params=params, gone_ok=True
        )

    def mkdir(self, path: str, *, parents: bool = True) -> FileEntry:
        body = {"path": path, "parents": parents}
        safety = Safety.IDEMPOTENT if parents else Safety.UNSAFE
        return FileEntry.from_json(
            self._api.json("POST", f"{self._path}/mkdir", safety=safety, json=body)
        )

    def move(self, source: str, destination: str, *, overwrite: bool = False) -> FileEntry:
        body = {"source": source, "destination": destination, "overwrite": overwrite}
        return FileEntry.from_json(
            self._api.json("POST", f"{self._path}/move", safety=Safety.UNSAFE, json=body)
        )


class Processes:
    """`/toolbox/processes`: background processes whose output can be followed live."""

    def __init__(self, api: _Api, sandbox: str) -> None:
        self._api = api
        self._sandbox = sandbox
        self._path = f"/api/v1/sandboxes/{sandbox}/toolbox/processes"

    def _wrap(self, body: dict[str, Any]) -> Process:
        return Process(_api=self._api, _base=self._path, **ProcessInfo.fields_from_json(body))

    def start(
        self,
        command: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Process:
        """Start `command` under `bash -c` in its own process group; it runs in the background."""
        body: dict[str, Any] = {"command": command}
        if cwd is not None:
            body["cwd"] = cwd
        if env:
            body["env"] = dict(env)
        if timeout is not None:
            body["timeout"] = timeout
        return self._wrap(self._api.json("POST", self._path, safety=Safety.UNSAFE, json=body))

    def list(self) -> builtins.list[Process]:
        answer = self._api.json("GET", self._path, safety=Safety.IDEMPOTENT)
        return [self._wrap(body) for body in answer["processes"]]

    def get(self, pid: int) -> Process:
        return self._wrap(self._api.json("GET", f"{self._path}/{pid}", safety=Safety.IDEMPOTENT))


@dataclass(kw_only=True, eq=False, repr=False)
class Process(ProcessInfo):
    """A background process. `dropped_bytes` counts output lost to the replay buffer."""

    _api: _Api
    _base: str
    dropped_bytes: int = 0

    def __repr__(self) -> str:
        return f"Process({self.describe()}, dropped_bytes={self.dropped_bytes})"

    @property
    def _path(self) -> str:
        return f"{self._base}/{self.pid}"

    def refresh(self) -> Process:
        body = self._api.json("GET", self._path, safety=Safety.IDEMPOTENT)
        for key, value in ProcessInfo.fields_from_json(body).items():
            setattr(self, key, value)
        return self

    def output(self, offset: int = 0, *, follow: bool = True) -> Iterator[OutputEvent]:
        """Output events from `offset` (0: from the start the buffer still holds) until the
        process exits; then `exit_code` is set. A broken connection is resumed at the last
        offset. `follow=False` gives what the process wrote so far and stops (the server's
        `follow=false`), with `exit_code` set if it has exited."""
        position = offset
        failures = 0
        policy = self._api.policy
        idle = STREAM_IDLE_TIMEOUT if follow else NO_FOLLOW_IDLE
        give_up = None if follow else time.monotonic() + NO_FOLLOW_MAX
        while True:
            response = self._api.request(
                "GET",
                f"{self._path}/stream",
                safety=Safety.IDEMPOTENT,
                params={"offset": position} | ({} if follow else {"follow": "false"}),
                stream=True,
                timeouts=self._api.stream_timeout(idle),
            )
            try:
                decoder = SSEDecoder()
                for line in response.iter_lines():
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
                continue  # quiet for a while: reopen at the same offset
            except httpx.TransportError as exc:
                failures += 1
                if failures > policy.max_retries:
                    raise connection_error(exc, str(response.url)) from exc
                time.sleep(policy.delay(failures - 1))
                continue
            finally:
                response.close()
            if not follow:
                return  # the server sent what there is (follow=false) and ended the stream
            failures += 1  # the stream ended without its exit event: resume it
            if failures > policy.max_retries:
                raise APIConnectionError(f"the output of process {self.pid} ended before its exit")
            time.sleep(policy.delay(failures - 1))

    def send_stdin(self, data: bytes | str) -> int:
        """Write to the process's stdin (in 1 MiB requests); returns the bytes written."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        written = 0
        for start in range(0, len(raw), STDIN_CHUNK_BYTES):
            written += self._stdin(raw[start : start + STDIN_CHUNK_BYTES], close=False)
        return written

    def close_stdin(self) -> None:
        self._stdin(b"", close=True)

    def _stdin(self, data: bytes, *, close: bool) -> int:
        answer = self._api.json(
            "POST",
            f"{self._path}/stdin",
            safety=Safety.UNSAFE,
            params={"close": "true"} if close else None,
            upload=Upload(data),
        )
        return int(answer["written"])

    def kill(self, signal: str | int = "SIGTERM") -> None:
        """Send a signal (a name such as "SIGTERM", "KILL", or a number) to its process group."""
        name = _signal_name(signal)
        self._api.request(
            "POST", f"{self._path}/signal", safety=Safety.UNSAFE, json={"signal": name}
        )

    def wait(self, timeout: float | None = None) -> int:
        """Block until it exits; its exit code. `TimeoutError` after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.02
        while self.exit_code is None or self.state != "exited":
            self.refresh()
            if self.state == "exited":
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"process {self.pid} still runs after {timeout} s")
            time.sleep(pause)
            pause = min(pause * 2, WAIT_POLL_MAX)
        assert self.exit_code is not None
        return self.exit_code


def _signal_name(signal: str | int) -> str:
    if isinstance(signal, int):
        import signal as signals

        return signals.Signals(signal).name
    return signal


class Terminal:
    """A PTY in the sandbox over a WebSocket: bytes both ways, resizable."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self.exit_code: int | None = None
        self._ended = False

    def send(self, data: bytes | str) -> None:
        """Type into the terminal (Ctrl-C is the byte 0x03)."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        try:
            self._ws.send(raw)
        except ConnectionClosed as exc:
            raise APIConnectionError("the terminal is closed", code="closed") from exc

    def recv(self, timeout: float | None = None) -> bytes | None:
        """The next terminal output; None once the shell exited (see `exit_code`).
        `TimeoutError` if nothing came within `timeout` seconds."""
        while not self._ended:
            try:
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

    def resize(self, cols: int, rows: int) -> None:
        try:
            self._ws.send(json.dumps({"type": "resize", "cols": cols, "rows": rows}))
        except ConnectionClosed as exc:
            raise APIConnectionError("the terminal is closed", code="closed") from exc

    def close(self) -> None:
        """Hang up: the shell gets SIGHUP."""
        self._ws.close()

    def __enter__(self) -> Terminal:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
