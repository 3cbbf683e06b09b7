# mypy: always-true=ASYNC
"""The asyncio client, `AsyncSandgate`, and the source of the blocking one.

The asyncio client is three modules: this one (`AsyncSandgate`, `AsyncSandboxes`,
`AsyncSandbox`, `AsyncTemplates`, `AsyncWorkspaces`, `AsyncWorkspace`), `_async_api.py`
(`_AsyncApi`: the HTTP session and its retry loop) and `_async_toolbox.py` (`AsyncFiles`,
`AsyncProcesses`, `AsyncProcess`, `AsyncTerminal`). Each `_async*.py` generates its
`_sync*.py` twin (`_sync.py`: `Sandgate`) by `scripts/async_to_sync.py`: `async` and `await`
go, the names map (`AsyncSandbox` -> `Sandbox`,
`aclose` -> `close`, `_async_api` -> `_sync_api`, ...), worker-thread calls become plain calls,
and an `if ASYNC: ... else: ...` block keeps its `else` there. So change the SDK here, then run
the script; `scripts/check` fails when a `_sync*.py` is stale.

Local file reads and writes run in worker threads (anyio), so a large upload or download
never blocks the event loop.
"""

from __future__ import annotations

import builtins
import functools
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ParamSpec

import anyio
import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidHandshake, InvalidStatus

from sandgate.client._async_api import _AsyncApi
from sandgate.client._async_toolbox import (
    AsyncCodeContexts,
    AsyncFiles,
    AsyncProcesses,
    AsyncTerminal,
    _run_code,
    _TerminalOpener,
)
from sandgate.client._base import (
    BUILD_IDLE_TIMEOUT,
    CREATE_READ_TIMEOUT,
    DEFAULT_EXEC_TIMEOUT,
    DEFAULT_TIMEOUT,
    EXEC_JOB_FIRST_POLL,
    EXEC_JOB_POLL,
    TEMPLATE_IMPORT_READ_TIMEOUT,
    Mounts,
    Progress,
    Safety,
    Upload,
    UploadData,
    WorkspaceRef,
    auth_headers,
    check_poll,
    create_body,
    error_from_response,
    exec_job_answer,
    exec_job_body,
    exec_job_timeout,
    list_params,
    mounts_body,
    network_body,
    ws_url,
)
from sandgate.client.errors import APIConnectionError, BuildFailedError, NotFoundError
from sandgate.client.models import (
    CodeContext,
    Commit,
    CommitDiff,
    CommitResult,
    ExecJob,
    ExecResult,
    Execution,
    ExecutionError,
    NetworkState,
    OutputMessage,
    Preview,
    PtyToken,
    Result,
    SandboxInfo,
    TemplateInfo,
    WorkspaceInfo,
)

ASYNC = True  # `if ASYNC: <asyncio> else: <blocking>`: scripts/async_to_sync.py keeps the else

# a workspace's commit or restore: the server waits up to 300 s for the worker's git (a large
# tree), so the answer may take that long
WORKSPACE_GIT_READ_TIMEOUT = 330.0
LOG_PAGE_MAX = 500  # the most commits one page of a workspace's log holds
P = ParamSpec("P")


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
        self.templates = AsyncTemplates(self._api)
        self.workspaces = AsyncWorkspaces(self._api)

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


class AsyncTemplates:
    """The images sandboxes start from: `client.templates`."""

    def __init__(self, api: _AsyncApi) -> None:
        self._api = api

    async def import_archive(
        self, name: str, archive: UploadData, *, progress: Progress | None = None
    ) -> TemplateInfo:
        """Import an image archive as template `name` (replacing one of that name): an OCI
        image layout or `docker save` tarball, or a root file system as tar or tar.gz.
        `archive`: a local path, bytes or a binary file, streamed; the server checks every
        digest before it stores anything."""
        upload = await anyio.to_thread.run_sync(Upload, archive)
        response = await self._api.request(
            "POST",
            "/api/v1/templates",
            safety=Safety.IDEMPOTENT,  # the same name and archive give the same template
            params={"name": name},
            upload=upload,
            progress=progress,
            headers={"Content-Type": "application/x-tar"},
            timeouts=self._api.stream_timeout(TEMPLATE_IMPORT_READ_TIMEOUT),
        )
        return TemplateInfo.from_json(response.json())

    async def build(
        self,
        name: str,
        document: Mapping[str, Any],
        *,
        context: UploadData | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> TemplateInfo:
        """Build template `name` from `document` (`from`, `steps`, ...: docs/templates.md),
        with `context` (a tar of the files its copy steps name: a path, bytes or a binary
        file). Each event the server streams (`build`, `step`, `log`, `step_done`, ...) goes
        to `on_event` as it happens. Raises BuildFailedError when a step fails (its log is
        kept: `build_log(error.build_id)`)."""
        files: dict[str, Any] = {"build": (None, json.dumps(dict(document)))}
        if context is not None:
            data = await anyio.to_thread.run_sync(_context_bytes, context)
            files["context"] = ("context.tar", data, "application/x-tar")
        response = await self._api.request(
            "POST",
            "/api/v1/templates",
            safety=Safety.UNSAFE,  # a build runs its steps: never sent twice
            params={"name": name},
            files=files,
            stream=True,
            timeouts=self._api.stream_timeout(BUILD_IDLE_TIMEOUT),
        )
        try:
            async for line in response.aiter_lines():
                if not line:
                    continue
                event = json.loads(line)
                if on_event is not None:
                    on_event(event)
                if event.get("event") == "done":
                    return TemplateInfo.from_json(event["template"])
                if event.get("event") == "error":
                    raise BuildFailedError(
                        str(event.get("message", "the build failed")),
                        build_id=str(event.get("build", "")),
                        step=int(event.get("step") or 0),
                    )
        finally:
            await response.aclose()
        raise APIConnectionError("the build's event stream ended before the build did")

    async def build_log(self, build_id: str) -> dict[str, Any]:
        """A build's record: state, log (the last 1 MiB), error, digest."""
        body: dict[str, Any] = await self._api.json(
            "GET", f"/api/v1/templates/builds/{build_id}", safety=Safety.IDEMPOTENT
        )
        return body

    async def list(self) -> builtins.list[TemplateInfo]:
        """The caller's own templates and the public ones (not the built-ins)."""
        body = await self._api.json("GET", "/api/v1/templates", safety=Safety.IDEMPOTENT)
        return [TemplateInfo.from_json(item) for item in body]

    async def get(self, name: str) -> TemplateInfo:
        body = await self._api.json("GET", f"/api/v1/templates/{name}", safety=Safety.IDEMPOTENT)
        return TemplateInfo.from_json(body)

    async def delete(self, name: str) -> None:
        await self._api.request(
            "DELETE", f"/api/v1/templates/{name}", safety=Safety.IDEMPOTENT, gone_ok=True
        )


def _context_bytes(context: UploadData) -> bytes:
    if isinstance(context, bytes | bytearray | memoryview):
        return bytes(context)
    if isinstance(context, str):
        return context.encode()
    if isinstance(context, os.PathLike):
        with open(context, "rb") as f:
            return f.read()
    return context.read()


class AsyncWorkspaces:
    """The tenant's persistent workspaces: `client.workspaces`. A workspace is a tree of files
    that outlives sandboxes (mounted with `sandboxes.create(workspace=...)`), with a git
    history of commits."""

    def __init__(self, api: _AsyncApi) -> None:
        self._api = api

    def _wrap(self, body: dict[str, Any]) -> AsyncWorkspace:
        return AsyncWorkspace(_api=self._api, **WorkspaceInfo.fields_from_json(body))

    async def create(self, name: str, quota_mb: int | None = None) -> AsyncWorkspace:
        """Make workspace `name` (empty, with a first commit), `quota_mb` for its files and
        history together (server default). `ConflictError` (`workspace_exists`) when the
        tenant has one of that name. Retried only when the request never left."""
        body: dict[str, Any] = {"name": name}
        if quota_mb is not None:
            body["quota_mb"] = quota_mb
        answer = await self._api.json(
            "POST",
            "/api/v1/workspaces",
            safety=Safety.UNSAFE,  # a repeat after it was made would answer 409
            json=body,
            timeouts=self._api.stream_timeout(CREATE_READ_TIMEOUT),
        )
        return self._wrap(answer)

    async def list(self) -> builtins.list[AsyncWorkspace]:
        """The tenant's workspaces."""
        body = await self._api.json("GET", "/api/v1/workspaces", safety=Safety.IDEMPOTENT)
        return [self._wrap(item) for item in body["workspaces"]]

    async def get(self, name: str) -> AsyncWorkspace:
        body = await self._api.json("GET", f"/api/v1/workspaces/{name}", safety=Safety.IDEMPOTENT)
        return self._wrap(body)

    async def delete(self, name: str) -> None:
        """Delete it, files and history. `ConflictError` (`workspace_in_use`) while sandboxes
        mount it."""
        await self._api.request(
            "DELETE",
            f"/api/v1/workspaces/{name}",
            safety=Safety.IDEMPOTENT,
            gone_ok=True,
            timeouts=self._api.stream_timeout(CREATE_READ_TIMEOUT),
        )


def _sha(commit: Commit | str) -> str:
    return commit.sha if isinstance(commit, Commit) else commit


@dataclass(kw_only=True, eq=False, repr=False)
class AsyncWorkspace(WorkspaceInfo):
    """A workspace: its description (as of the last answer) and its history."""

    _api: _AsyncApi

    def __repr__(self) -> str:
        return f"AsyncWorkspace({self.describe()})"

    @property
    def _path(self) -> str:
        return f"/api/v1/workspaces/{self.name}"

    async def refresh(self) -> AsyncWorkspace:
        body = await self._api.json("GET", self._path, safety=Safety.IDEMPOTENT)
        for key, value in WorkspaceInfo.fields_from_json(body).items():
            setattr(self, key, value)
        return self

    async def delete(self) -> None:
        """As `AsyncWorkspaces.delete`."""
        await self._api.request(
            "DELETE",
            self._path,
            safety=Safety.IDEMPOTENT,
            gone_ok=True,
            timeouts=self._api.stream_timeout(CREATE_READ_TIMEOUT),
        )

    async def _git(self, path: str, body: dict[str, Any]) -> CommitResult:
        answer = await self._api.json(
            "POST",
            f"{self._path}/{path}",
            # a repeat changes nothing more: it finds the tree as the first attempt left it
            safety=Safety.IDEMPOTENT,
            json=body,
            timeouts=self._api.stream_timeout(WORKSPACE_GIT_READ_TIMEOUT),
        )
        result = CommitResult.from_json(answer)
        self.head = result.commit.sha
        return result

    async def commit(self, message: str = "") -> CommitResult:
        """Snapshot its files (as the sandboxes mounting it see them now) as a commit.
        `created` is False when nothing changed since the last one (`commit` is then the
        head); `skipped` lists files left out for their size."""
        return await self._git("commits", {"message": message})

    async def restore(self, commit: Commit | str) -> CommitResult:
        """Bring its files back to `commit` (a `Commit` or a sha, at least 4 hex digits). The
        current state is committed first and the restore is a commit of its own, so nothing
        is lost; sandboxes mounting it see the files change at once."""
        return await self._git("restore", {"commit": _sha(commit)})

    async def log(self, limit: int | None = 50) -> builtins.list[Commit]:
        """Its commits, newest first: at most `limit` (None: all), fetching as many pages as
        that takes."""
        if limit is not None and limit < 1:
            raise ValueError("limit must be at least 1 (or None: all)")
        found: builtins.list[Commit] = []
        start: str | None = None
        while limit is None or len(found) < limit:
            want = LOG_PAGE_MAX if limit is None else min(limit - len(found), LOG_PAGE_MAX)
            page, start = await self._log_page(want, start)
            found += [Commit.from_json(body) for body in page]
            if start is None:
                break
        return found

    async def iter_log(
        self, *, start: Commit | str | None = None, page_size: int = 100
    ) -> AsyncIterator[Commit]:
        """Its whole history from `start` (default: the head), newest first, fetching one
        page of `page_size` (1-500) commits at a time as the iteration goes."""
        at = None if start is None else _sha(start)
        while True:
            page, at = await self._log_page(page_size, at)
            for body in page:
                yield Commit.from_json(body)
            if at is None:
                return

    async def _log_page(
        self, limit: int, start: str | None
    ) -> tuple[builtins.list[dict[str, Any]], str | None]:
        params: dict[str, Any] = {"limit": limit}
        if start is not None:
            params["start"] = start
        answer = await self._api.json(
            "GET", f"{self._path}/commits", safety=Safety.IDEMPOTENT, params=params
        )
        following = answer.get("next")
        return list(answer["commits"]), following or None

    async def diff(self, commit: Commit | str) -> CommitDiff:
        """`commit` (a `Commit` or a sha) and what it changed against its parent: the files
        (lines added and deleted) and the patch."""
        path = f"{self._path}/commits/{_sha(commit)}"
        return CommitDiff.from_json(await self._api.json("GET", path, safety=Safety.IDEMPOTENT))


if ASYNC:  # `async with sg.sandboxes.create() as box:`; the blocking create returns the box

    class _SandboxCreation(Coroutine[Any, Any, "AsyncSandbox"]):
        """What `AsyncSandboxes.create` returns: its coroutine (await it, or give it to a task
        as any coroutine), and an async context manager whose sandbox is deleted when the
        block ends."""

        def __init__(self, coro: Coroutine[Any, Any, AsyncSandbox]) -> None:
            self._coro = coro
            self._box: AsyncSandbox | None = None

        def send(self, value: Any) -> Any:
            return self._coro.send(value)

        def throw(self, *args: Any) -> Any:
            return self._coro.throw(*args)

        def close(self) -> None:
            self._coro.close()

        def __await__(self) -> Generator[Any, None, AsyncSandbox]:
            return self._coro.__await__()

        async def __aenter__(self) -> AsyncSandbox:
            self._box = await self._coro
            return self._box

        async def __aexit__(
            self,
            exc_type: type[BaseException] | None,
            exc: BaseException | None,
            tb: TracebackType | None,
        ) -> None:
            if self._box is not None:
                await self._box.__aexit__(exc_type, exc, tb)

    def _deleted_after_block(
        create: Callable[P, Coroutine[Any, Any, AsyncSandbox]],
    ) -> Callable[P, _SandboxCreation]:
        @functools.wraps(create)
        def creation(*args: P.args, **kwargs: P.kwargs) -> _SandboxCreation:
            return _SandboxCreation(create(*args, **kwargs))

        return creation

else:

    def _deleted_after_block(create: Callable[P, AsyncSandbox]) -> Callable[P, AsyncSandbox]:
        """The blocking `create` returns the `Sandbox`, itself a context manager."""
        return create


class AsyncSandboxes:
    def __init__(self, api: _AsyncApi) -> None:
        self._api = api

    def _wrap(self, body: dict[str, Any]) -> AsyncSandbox:
        return AsyncSandbox(_api=self._api, **SandboxInfo.fields_from_json(body))

    @_deleted_after_block
    async def create(
        self,
        *,
        template: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the sandbox's life, sent to the server)
        metadata: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        network: bool | Mapping[str, Sequence[str]] | None = None,
        resources: Mapping[str, float] | None = None,
        idempotency_key: str | None = None,
        workspace: WorkspaceRef | None = None,
        workspaces: Mounts | None = None,
    ) -> AsyncSandbox:
        """Create a sandbox and wait until it runs. Every retry of this call carries one
        Idempotency-Key (`idempotency_key`, or a fresh uuid4), so it makes one sandbox.
        `network`: False (none), True (the public internet) or rules, e.g.
        ``{"allow_out": ["pypi.org", "*.github.com"]}`` (docs/api.md, Network).
        `workspace`: a persistent workspace (its name or the object) mounted read-write at
        /workspace; `workspaces`: more, each where it goes, as ``[("proj", "/mnt/proj")]``,
        ``[{"name": "proj", "path": "/mnt/proj"}]`` or ``{"/mnt/proj": "proj"}``.

        As a context manager (`with sg.sandboxes.create() as box:`, in the asyncio client
        `async with sg.sandboxes.create() as box:`), the sandbox is deleted when the block
        ends, also when it raises."""
        key = idempotency_key or str(uuid.uuid4())
        body = create_body(template, timeout, metadata, env, network, resources)
        body.update(mounts_body(workspace, workspaces))
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

    async def set_network(
        self, name: str, network: bool | Mapping[str, Sequence[str]]
    ) -> NetworkState:
        """Give the running sandbox another network policy: its new connections follow it
        at once. Safe to retry."""
        return await _set_network(self._api, name, network)

    async def network_state(self, name: str) -> NetworkState:
        """Its policy and what its worker's egress gate let through and refused."""
        return await _network_state(self._api, name)

    async def preview(self, name: str, port: int, ttl: float | None = None) -> Preview:
        """A URL to `port` of sandbox `name` (a server listening inside it) that works
        without an API key for `ttl` seconds (server default 3600, at most 86400)."""
        return await _preview(self._api, name, port, ttl)


async def _set_network(
    api: _AsyncApi, name: str, network: bool | Mapping[str, Sequence[str]]
) -> NetworkState:
    path = f"/api/v1/sandboxes/{name}/network"
    body = {"network": network_body(network)}
    return NetworkState.from_json(await api.json("PUT", path, safety=Safety.IDEMPOTENT, json=body))


async def _network_state(api: _AsyncApi, name: str) -> NetworkState:
    path = f"/api/v1/sandboxes/{name}/network"
    return NetworkState.from_json(await api.json("GET", path, safety=Safety.IDEMPOTENT))


async def _preview(api: _AsyncApi, name: str, port: int, ttl: float | None) -> Preview:
    body = {"ttl": ttl} if ttl is not None else None
    path = f"/api/v1/sandboxes/{name}/ports/{port}/preview"
    return Preview.from_json(await api.json("POST", path, safety=Safety.IDEMPOTENT, json=body))


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

    @property
    def contexts(self) -> AsyncCodeContexts:
        """Its code contexts: stateful interpreters for `run_code`."""
        return AsyncCodeContexts(self._api, self.name)

    def _update(self, body: dict[str, Any]) -> None:
        for key, value in SandboxInfo.fields_from_json(body).items():
            setattr(self, key, value)

    async def refresh(self) -> AsyncSandbox:
        self._update(await self._api.json("GET", self._path, safety=Safety.IDEMPOTENT))
        return self

    async def set_timeout(self, seconds: float) -> AsyncSandbox:
        """Let it live `seconds` more from now: `expires_at` moves there, and `timeout` (its
        life from start, `expires_at - started_at`) with it, as the server answered."""
        body = {"timeout": seconds}
        answer = await self._api.json(
            "POST", f"{self._path}/timeout", safety=Safety.IDEMPOTENT, json=body
        )
        self._update(answer)
        return self

    async def delete(self) -> None:
        await self._api.request("DELETE", self._path, safety=Safety.IDEMPOTENT, gone_ok=True)
        self.state = "deleted"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Delete it, however the block ended; one already gone is no error."""
        if ASYNC:
            # a cancelled block still deletes its sandbox; the delete's own request timeouts
            # and retry limit bound how long that takes
            with anyio.CancelScope(shield=True):
                await self._delete_if_there()
        else:
            self._delete_if_there()

    async def _delete_if_there(self) -> None:
        try:
            await self.delete()
        except NotFoundError:
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

    async def run_code(
        self,
        code: str,
        *,
        context: CodeContext | str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the kernel is interrupted after it)
        on_stdout: Callable[[OutputMessage], Any] | None = None,
        on_stderr: Callable[[OutputMessage], Any] | None = None,
        on_result: Callable[[Result], Any] | None = None,
        on_error: Callable[[ExecutionError], Any] | None = None,
        language: str | None = None,
    ) -> Execution:
        """Run `code` in a stateful context (a `CodeContext` or its id; None: the sandbox's
        default context of `language`, python or bash, made on first use), as a notebook
        cell: what it defines (variables, for bash the working directory and exports too) is
        kept for the next run there. `env` applies to this run only; after `timeout` seconds
        (server default 30) the code is interrupted and the error is a `TimeoutError`.

        The callbacks get each piece as it streams (stdout and stderr as `OutputMessage`s,
        results, the error); in the asyncio client they may be coroutines. An exception the
        code raised is `Execution.error`, not raised here. Never retried once sent."""
        return await _run_code(
            self._api,
            self.name,
            code,
            context=context,
            env=env,
            timeout=timeout,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            on_result=on_result,
            on_error=on_error,
            language=language,
        )

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

    async def set_network(self, network: bool | Mapping[str, Sequence[str]]) -> NetworkState:
        """Another network policy for this sandbox (`AsyncSandboxes.set_network`)."""
        state = await _set_network(self._api, self.name, network)
        self.network = state.network is not False
        self.network_policy = state.network if isinstance(state.network, dict) else None
        return state

    async def network_state(self) -> NetworkState:
        """Its policy and the egress gate's counters for it."""
        return await _network_state(self._api, self.name)

    async def preview(self, port: int, ttl: float | None = None) -> Preview:
        """A URL to `port` of this sandbox that works without an API key for `ttl` seconds
        (server default 3600): `sandbox.preview(8000).url`. With the API key the same port
        answers at `<api url>/api/v1/sandboxes/{name}/ports/{port}/...` too."""
        return await _preview(self._api, self.name, port, ttl)

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
