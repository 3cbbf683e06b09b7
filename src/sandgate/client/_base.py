"""What the sync and async clients share: defaults, the retry rule, errors, request bodies,
SSE, upload sources.

Nothing here does network IO, so both clients (and plain-bytes tests) use the same decisions.
Neither client imports the other: the `_async*.py` modules are the source, each `_sync*.py` is
generated from its `_async*.py` (`scripts/async_to_sync.py`), and what both need that is not IO
lives here.
"""

from __future__ import annotations

import base64
import enum
import io
import json
import os
import random
import signal as signals
import stat
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import IO, Any, Literal, TypeAlias
from urllib.parse import urlencode, urlsplit, urlunsplit

import httpx

from sandgate.client.errors import (
    APIConnectionError,
    APITimeoutError,
    ExecJobTimeoutError,
    SandgateError,
    error_class,
)
from sandgate.client.models import (
    ExecJob,
    Execution,
    ExecutionError,
    OutputEvent,
    OutputMessage,
    Result,
    WorkspaceInfo,
    WorkspaceMount,
)

DEFAULT_URL = "http://127.0.0.1:8080"
KEY_FILE = Path(".sandgate") / "api-key"  # where `sandgate up` saves its key, from the cwd
URL_FILE = Path(".sandgate") / "url"  # ... and the URL it serves at
CHUNK_BYTES = 1 << 20  # upload/download piece; the server moves files in 1 MiB frames too
STDIN_CHUNK_BYTES = 1 << 20  # one stdin POST (the server takes at most 8 MiB)
DEFAULT_TIMEOUT = 60.0
# a create may wait in the server's queue (120 s by default) and then start (30 s)
CREATE_READ_TIMEOUT = 300.0
BUILD_IDLE_TIMEOUT = 900.0  # a build step may print nothing for this long
TEMPLATE_IMPORT_READ_TIMEOUT = 600.0  # a large archive's digests are checked before the answer
DEFAULT_EXEC_TIMEOUT = 30.0  # the server's default for `execute` without a timeout
KEEPALIVE_EXPIRY = 4.0  # below uvicorn's 5 s keep-alive, so a pooled socket is never stale
EXEC_JOB_POLL = 0.5  # `wait_exec_job`: the longest pause between two looks at the job
EXEC_JOB_FIRST_POLL = 0.05  # ... and the first one, doubling up to `poll`
STREAM_IDLE_TIMEOUT = 60.0  # a followed stream silent this long is reopened at its offset
NO_FOLLOW_IDLE = 1.0  # `output(follow=False)` stops after this long without output
NO_FOLLOW_MAX = 5.0  # ... or after this long in all, for a process that never pauses
WAIT_POLL_MAX = 0.5  # `Process.wait`: the longest pause between two looks at the process
# a context's create or restart waits for its kernel to answer (the server gives it 60 s)
CONTEXT_READ_TIMEOUT = 120.0

Progress: TypeAlias = Callable[[int, int | None], None]
"""Called as bytes move: (bytes so far, total bytes or None when unknown)."""

UploadData: TypeAlias = "bytes | bytearray | memoryview | str | os.PathLike[str] | IO[bytes]"


def resolve_url(url: str | None) -> str:
    """`url`, else `$SANDGATE_URL`, else the URL in `./.sandgate/url` (a local `sandgate up`),
    else http://127.0.0.1:8080."""
    chosen = url or os.environ.get("SANDGATE_URL") or _read(URL_FILE) or DEFAULT_URL
    if "://" not in chosen:
        chosen = "http://" + chosen  # "127.0.0.1:8080" means what it says
    return chosen.rstrip("/")


def resolve_api_key(api_key: str | None) -> str | None:
    """`api_key`, else `$SANDGATE_API_KEY`, else `./.sandgate/api-key` if it exists."""
    if api_key:
        return api_key
    from_env = os.environ.get("SANDGATE_API_KEY")
    if from_env:
        return from_env
    return _read(KEY_FILE)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def auth_headers(api_key: str | None) -> dict[str, str]:
    headers = {"User-Agent": "sandgate-client"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def make_timeout(timeout: float | httpx.Timeout) -> httpx.Timeout:
    if isinstance(timeout, httpx.Timeout):
        return timeout
    return httpx.Timeout(timeout, connect=min(timeout, 10.0))


def ws_url(base: str, path: str, params: Mapping[str, Any]) -> str:
    parts = urlsplit(base)
    scheme = {"https": "wss", "http": "ws"}.get(parts.scheme, parts.scheme)
    query = urlencode({k: v for k, v in params.items() if v is not None})
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + path, query, ""))


# ------------------------------------------------------------------------------ retries


class Safety(enum.Enum):
    """How a request may be retried.

    IDEMPOTENT: a repeat does no harm (reads, deletes, file uploads, a create carrying its
    Idempotency-Key): retried on any connection error and on 429/503.
    UNSAFE: a repeat could do the work twice (execute, process start, stdin, signal): retried
    only when the request provably never reached the server (connect errors) or when the server
    refused it before doing anything (429).
    """

    IDEMPOTENT = "idempotent"
    UNSAFE = "unsafe"


# the request was never sent on these: safe to repeat anything
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# the connection broke or went quiet after the request may have been sent
TRANSIENT = (
    *NOT_SENT,
    httpx.ReadError,
    httpx.ReadTimeout,
    httpx.WriteError,
    httpx.WriteTimeout,
    httpx.RemoteProtocolError,
)


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3
    backoff_initial: float = 0.25  # seconds before the first retry, doubling each time
    backoff_max: float = 8.0
    retry_after_max: float = 60.0  # a server's Retry-After is honoured up to this

    def retries_exception(self, exc: Exception, safety: Safety) -> bool:
        if safety is Safety.IDEMPOTENT:
            return isinstance(exc, TRANSIENT)
        return isinstance(exc, NOT_SENT)

    def retries_status(self, status: int, safety: Safety) -> bool:
        if status == 429:
            return True
        return status == 503 and safety is Safety.IDEMPOTENT

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number `attempt` (0-based), jittered."""
        if retry_after is not None:
            # honour the server, plus up to 10% so a crowd of clients does not come back at once
            base = min(max(retry_after, 0.0), self.retry_after_max)
            return base + random.uniform(0, base * 0.1)
        ceiling = min(self.backoff_max, self.backoff_initial * 2**attempt)
        return random.uniform(ceiling / 2, ceiling)


def parse_retry_after(value: str | None) -> float | None:
    """`Retry-After` as seconds: a number of seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def error_from_response(status: int, body: bytes, headers: Mapping[str, str]) -> SandgateError:
    """The exception for an error answer, from the server's `{"error": {"code", "message"}}`."""
    code, message = f"http_{status}", ""
    try:
        detail = json.loads(body)["error"]
        code = str(detail.get("code") or code)
        message = str(detail.get("message") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        message = body.decode("utf-8", errors="replace").strip()[:500]
    if not message:
        message = f"the server answered HTTP {status}"
    return error_class(status)(
        message,
        status=status,
        code=code,
        retry_after=parse_retry_after(headers.get("retry-after")),
    )


def connection_error(exc: Exception, url: str) -> APIConnectionError:
    where = url.split("?", 1)[0]
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(
            f"no answer from {where} in time ({type(exc).__name__})", code="timeout"
        )
    detail = str(exc) or type(exc).__name__
    return APIConnectionError(f"cannot reach {where}: {detail}", code="connection_error")


# ------------------------------------------------------------------------------ request bodies


def network_body(network: bool | Mapping[str, Sequence[str]]) -> bool | dict[str, list[str]]:
    """A network policy as JSON: false, true, or {"allow_out": [...], "deny_out": [...]}."""
    if isinstance(network, bool):
        return network
    return {key: list(values) for key, values in network.items()}


def create_body(
    template: str | None,
    timeout: float | None,
    metadata: Mapping[str, str] | None,
    env: Mapping[str, str] | None,
    network: bool | Mapping[str, Sequence[str]] | None,
    resources: Mapping[str, float] | None,
) -> dict[str, Any]:
    """The JSON body of a sandbox create: only what the caller gave."""
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
        body["network"] = network_body(network)
    if resources:
        body["resources"] = dict(resources)
    return body


WorkspaceRef: TypeAlias = "str | WorkspaceInfo"  # a workspace by name, or the object itself
# one mount: (workspace, path), {"name": ..., "path": ...}, a WorkspaceMount (a sandbox's
# `.workspaces`), or a bare workspace (mounted at /workspace)
MountSpec: TypeAlias = (
    "WorkspaceRef | WorkspaceMount | tuple[WorkspaceRef, str] | Mapping[str, str]"
)
# `workspaces=` of a sandbox create: a list of mounts, or a {path: workspace} mapping
Mounts: TypeAlias = "Sequence[MountSpec] | Mapping[str, WorkspaceRef]"


def _workspace_name(ref: WorkspaceRef) -> str:
    return ref.name if isinstance(ref, WorkspaceInfo) else str(ref)


def _mount(spec: MountSpec) -> dict[str, str]:
    if isinstance(spec, WorkspaceMount):
        return {"name": spec.name, "path": spec.path}
    if isinstance(spec, str | WorkspaceInfo):
        return {"name": _workspace_name(spec)}
    if isinstance(spec, tuple):
        name, path = spec
        return {"name": _workspace_name(name), "path": str(path)}
    if isinstance(spec, Mapping) and "name" in spec and not set(spec) - {"name", "path"}:
        return {str(k): str(v) for k, v in spec.items()}
    raise TypeError(
        f"a workspace mount is (name, path), {{'name': ..., 'path': ...}} or a name, not {spec!r}"
    )


def mounts_body(workspace: WorkspaceRef | None, workspaces: Mounts | None) -> dict[str, Any]:
    """The workspace fields of a sandbox create: `workspace` (mounted at /workspace) and
    `workspaces` as [{name, path}]; the server checks names, paths and overlaps."""
    body: dict[str, Any] = {}
    if workspace is not None:
        body["workspace"] = _workspace_name(workspace)
    if workspaces is not None:
        if isinstance(workspaces, Mapping):
            items = [{"name": _workspace_name(n), "path": p} for p, n in workspaces.items()]
        elif isinstance(workspaces, str | WorkspaceInfo | WorkspaceMount):
            items = [_mount(workspaces)]  # one mount where a list was meant
        else:
            items = [_mount(spec) for spec in workspaces]
        body["workspaces"] = items
    return body


def list_params(
    state: str | Sequence[str] | None, metadata: Mapping[str, str] | None, limit: int
) -> dict[str, Any]:
    """The query of a sandbox list: `state` as a comma list, `metadata.<key>=<value>`."""
    params: dict[str, Any] = {"limit": limit}
    if state:
        params["state"] = state if isinstance(state, str) else ",".join(state)
    for key, value in (metadata or {}).items():
        params[f"metadata.{key}"] = value
    return params


def signal_name(signal: str | int) -> str:
    """A signal as the API takes it: a number becomes its name (15 -> "SIGTERM")."""
    if isinstance(signal, int):
        return signals.Signals(signal).name
    return signal


# ------------------------------------------------------------------------------ exec jobs


def exec_job_body(
    command: str, timeout: float | None, env: Mapping[str, str] | None, cwd: str | None
) -> dict[str, Any]:
    body: dict[str, Any] = {"command": command}
    if timeout is not None:
        body["timeout"] = timeout
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    return body


def exec_job_answer(response: httpx.Response) -> ExecJob:
    """The job of a submit's answer; `replayed` from its `Idempotent-Replayed` header."""
    replayed = response.headers.get("idempotent-replayed", "").lower() == "true"
    return ExecJob.from_json(response.json(), replayed=replayed)


def check_poll(poll: float) -> None:
    if not poll > 0:
        raise ValueError(f"poll must be a positive number of seconds, not {poll!r}")


def exec_job_timeout(job: ExecJob, timeout: float) -> ExecJobTimeoutError:
    return ExecJobTimeoutError(
        f"exec job {job.id} is still {job.state} after {timeout:g} s (it goes on on the server)",
        job=job,
    )


# ------------------------------------------------------------------------------ SSE


@dataclass(frozen=True)
class ServerEvent:
    event: str
    data: str
    id: str | None


class SSEDecoder:
    """Server-sent events from lines (the `text/event-stream` format, minus retry hints)."""

    def __init__(self) -> None:
        self._event = ""
        self._data: tuple[str, ...] = ()
        self._id: str | None = None

    def feed(self, line: str) -> ServerEvent | None:
        """One line without its ending; an event is returned at the blank line closing it."""
        if not line:
            if not self._data and not self._event:
                return None
            event = ServerEvent(self._event or "message", "\n".join(self._data), self._id)
            self._event, self._data, self._id = "", (), None
            return event
        if line.startswith(":"):
            return None  # a comment (keep-alive)
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data += (value,)
        elif name == "id" and "\x00" not in value:
            self._id = value
        return None


def output_event(event: ServerEvent, offset: int) -> OutputEvent:
    body = json.loads(event.data)
    raw = str(body.get("data", ""))
    data = base64.b64decode(raw) if body.get("encoding") == "base64" else raw.encode("utf-8")
    stream: Literal["stdout", "stderr"] = "stderr" if event.event == "stderr" else "stdout"
    return OutputEvent(stream=stream, data=data, offset=offset)


def event_offset(event: ServerEvent, current: int) -> int:
    try:
        return int(event.id) if event.id is not None else current
    except ValueError:
        return current


# ------------------------------------------------------------------------------ code runs


def run_code_body(
    code: str, env: Mapping[str, str] | None, timeout: float | None, language: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"code": code}
    if language is not None:
        body["language"] = language
    if env:
        body["env"] = dict(env)
    if timeout is not None:
        body["timeout"] = timeout
    return body


CodeEvent: TypeAlias = "OutputMessage | Result | ExecutionError"


class ExecutionReader:
    """A `run_code` stream's events, into an `Execution` as they come (`stdout`, `stderr`,
    `result`, `error`, then `end`); unknown events are skipped."""

    def __init__(self) -> None:
        self.execution = Execution()
        self.ended = False

    def feed(self, event: ServerEvent) -> CodeEvent | None:
        """Take one event; what a callback is given for it (None for `end` and the rest)."""
        kind = event.event
        if kind not in ("stdout", "stderr", "result", "error", "end"):
            return None
        body = json.loads(event.data) if event.data else {}
        if not isinstance(body, dict):
            return None
        run = self.execution
        if kind in ("stdout", "stderr"):
            message = OutputMessage.from_json("stderr" if kind == "stderr" else "stdout", body)
            (run.stdout if kind == "stdout" else run.stderr).append(message.text)
            return message
        if kind == "result":
            result = Result.from_json(body)
            run.results.append(result)
            return result
        if kind == "error":
            error = ExecutionError.from_json(body)
            run.error = error
            return error
        count = body.get("execution_count")
        run.execution_count = None if count is None else int(count)
        context = body.get("context")
        run.context = None if context is None else str(context)
        self.ended = True
        return None


# ------------------------------------------------------------------------------ uploads


class Upload:
    """Where an upload's bytes come from, re-readable from the start when a retry needs it.

    `bytes`/`bytearray`/`memoryview` are sent as they are, a `str` as UTF-8 text, an
    `os.PathLike` is a local file opened and read in chunks, and a binary file-like object
    is read in chunks from its current position (a retry seeks back there if it can).
    """

    def __init__(self, data: Any) -> None:
        self._bytes: memoryview | None = None
        self._path: Path | None = None
        self._file: IO[bytes] | None = None
        self._start = 0
        self.size: int | None = None
        self.rewindable = True
        self.touched = False  # some data was read (a one-shot source cannot be sent again)
        if isinstance(data, str):
            data = data.encode("utf-8")
        if isinstance(data, bytes | bytearray | memoryview):
            self._bytes = memoryview(data).cast("B")
            self.size = len(self._bytes)
        elif isinstance(data, os.PathLike):
            self._path = Path(data)
            self.size = self._path.stat().st_size
        elif hasattr(data, "read"):
            self._file = data
            self._init_file(data)
        else:
            raise TypeError(
                f"cannot upload {type(data).__name__}: give bytes, str, a Path or a binary file"
            )

    def _init_file(self, handle: IO[bytes]) -> None:
        try:
            self._start = handle.tell()
            handle.seek(self._start)
        except (OSError, AttributeError, io.UnsupportedOperation):
            self.rewindable = False
            return
        try:
            info = os.fstat(handle.fileno())
            if stat.S_ISREG(info.st_mode):
                self.size = max(0, info.st_size - self._start)
        except (OSError, AttributeError, io.UnsupportedOperation):
            pass  # not a real file (BytesIO, a socket): sent chunked, length unknown

    @property
    def in_memory(self) -> bool:
        return self._bytes is not None

    @property
    def resendable(self) -> bool:
        return self.rewindable or not self.touched

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/octet-stream"}
        if self.size is not None:
            headers["Content-Length"] = str(self.size)
        return headers

    def chunks(self, progress: Progress | None) -> Generator[bytes, None, None]:
        """The data from its start, in chunks; blocking reads (the async client runs it in a
        thread)."""
        done = 0
        for piece in self._pieces():
            done += len(piece)
            if progress is not None:
                progress(done, self.size)
            yield piece
        if progress is not None and done == 0:
            progress(0, self.size)

    def _pieces(self) -> Iterator[bytes]:
        self.touched = True
        if self._bytes is not None:
            for start in range(0, len(self._bytes), CHUNK_BYTES):
                yield bytes(self._bytes[start : start + CHUNK_BYTES])
        elif self._path is not None:
            with self._path.open("rb") as handle:
                while piece := handle.read(CHUNK_BYTES):
                    yield piece
        elif self._file is not None:
            if self.rewindable:
                self._file.seek(self._start)
            while piece := self._file.read(CHUNK_BYTES):
                yield piece


def partial_path(target: Path) -> Path:
    """A temporary name beside `target`, renamed over it once the download is complete."""
    return target.with_name(f".{target.name}.{os.getpid()}-{random.getrandbits(32):08x}.part")
