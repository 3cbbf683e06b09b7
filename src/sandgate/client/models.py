"""Typed results of the API, as dataclasses. Each `from_json` reads one wire object."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime
from types import MappingProxyType
from typing import Any, Literal


def _time(value: Any) -> datetime | None:
    return None if value is None else datetime.fromisoformat(str(value))


def _life(timeout: Any, started_at: datetime | None, expires_at: datetime | None) -> float:
    """A sandbox's `timeout`: its life from start, `expires_at - started_at`, once it started
    (an extend moves `expires_at`, while the answer's `timeout` stays what the create asked);
    before that, the asked timeout."""
    if started_at is not None and expires_at is not None:
        return (expires_at - started_at).total_seconds()
    return float(timeout or 0.0)


@dataclass(kw_only=True)
class SandboxInfo:
    """A sandbox as the server described it when this object was made (see `refresh()`)."""

    name: str
    state: str  # pending, running, stopped, error, deleted
    template: str = "default"
    metadata: dict[str, str] = field(default_factory=dict)
    worker: str | None = None
    network: bool = False
    # its rules ({"allow_out": [...], "deny_out": [...]}) when it has some
    network_policy: dict[str, list[str]] | None = None
    resources: dict[str, Any] = field(default_factory=dict)
    # the persistent workspaces it mounts read-write, and where
    workspaces: list[WorkspaceMount] = field(default_factory=list)
    timeout: float = 0.0  # its life in seconds from start (an extend lengthens it)
    created_at: datetime | None = None
    started_at: datetime | None = None
    expires_at: datetime | None = None
    error: str | None = None

    def describe(self) -> str:
        """`name=..., state=..., ...`: the description fields, for a subclass's repr."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(SandboxInfo))

    @staticmethod
    def fields_from_json(body: dict[str, Any]) -> dict[str, Any]:
        started_at, expires_at = _time(body.get("started_at")), _time(body.get("expires_at"))
        return {
            "name": str(body["name"]),
            "state": str(body["state"]),
            "template": str(body.get("template", "default")),
            "metadata": dict(body.get("metadata") or {}),
            "worker": body.get("worker"),
            "network": bool(body.get("network", False)),
            "network_policy": body.get("network_policy"),
            "resources": dict(body.get("resources") or {}),
            "workspaces": [WorkspaceMount.from_json(m) for m in body.get("workspaces") or []],
            "timeout": _life(body.get("timeout"), started_at, expires_at),
            "created_at": _time(body.get("created_at")),
            "started_at": started_at,
            "expires_at": expires_at,
            "error": body.get("error"),
        }


@dataclass(frozen=True, kw_only=True)
class ExecResult:
    """The answer of `Sandbox.run`: output is UTF-8 with invalid bytes replaced."""

    stdout: str
    stderr: str
    exit_code: int
    duration_ms: float
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    oom_killed: bool = False  # killed at the sandbox's memory limit (exit code 137)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ExecResult:
        return cls(
            stdout=str(body["stdout"]),
            stderr=str(body["stderr"]),
            exit_code=int(body["exit_code"]),
            duration_ms=float(body["duration_ms"]),
            timed_out=bool(body.get("timed_out", False)),
            stdout_truncated=bool(body.get("stdout_truncated", False)),
            stderr_truncated=bool(body.get("stderr_truncated", False)),
            oom_killed=bool(body.get("oom_killed", False)),
        )


ExecJobState = Literal["queued", "running", "succeeded", "failed"]
EXEC_JOB_DONE: tuple[ExecJobState, ...] = ("succeeded", "failed")


@dataclass(frozen=True, kw_only=True)
class ExecJob:
    """An exec job as the server described it: a command run once, in the background.

    `state` goes queued -> running -> succeeded (exit code 0) or failed (a non-zero exit code,
    a timeout (exit code 124), or the sandbox, its worker or the instance running it failing:
    `error` says which, and `exit_code` may then be None). Output is UTF-8 with invalid bytes
    replaced, each stream cut at 1 MiB (`*_truncated`). `replayed` is True when `submit_exec_job`
    was answered with a job an earlier request with the same Idempotency-Key had made.
    """

    id: str
    sandbox: str
    state: ExecJobState
    command: str
    timeout: float
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    error: str | None = None
    created_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    replayed: bool = False

    @property
    def done(self) -> bool:
        """It finished (succeeded or failed): it will not change any more."""
        return self.state in EXEC_JOB_DONE

    @property
    def ok(self) -> bool:
        return self.state == "succeeded"

    @classmethod
    def from_json(cls, body: dict[str, Any], *, replayed: bool = False) -> ExecJob:
        code = body.get("exit_code")
        return cls(
            id=str(body["id"]),
            sandbox=str(body["sandbox"]),
            state=body["state"],
            command=str(body.get("command", "")),
            timeout=float(body.get("timeout") or 0.0),
            exit_code=None if code is None else int(code),
            stdout=str(body.get("stdout") or ""),
            stderr=str(body.get("stderr") or ""),
            stdout_truncated=bool(body.get("stdout_truncated", False)),
            stderr_truncated=bool(body.get("stderr_truncated", False)),
            error=body.get("error"),
            created_at=_time(body.get("created_at")),
            started_at=_time(body.get("started_at")),
            finished_at=_time(body.get("finished_at")),
            replayed=replayed,
        )


FileType = Literal["file", "dir", "symlink", "other"]


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    name: str
    path: str
    type: FileType
    size: int
    mode: str
    mtime: datetime

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> FileEntry:
        mtime = _time(body["mtime"])
        assert mtime is not None
        return cls(
            name=str(body["name"]),
            path=str(body["path"]),
            type=body["type"],
            size=int(body["size"]),
            mode=str(body["mode"]),
            mtime=mtime,
        )


@dataclass(kw_only=True)
class ProcessInfo:
    """A background process as last seen; `exit_code` is None while it runs."""

    pid: int
    command: str = ""
    state: str = "running"  # running, exited
    exit_code: int | None = None
    started_at: datetime | None = None
    exited_at: datetime | None = None

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(ProcessInfo))

    @staticmethod
    def fields_from_json(body: dict[str, Any]) -> dict[str, Any]:
        code = body.get("exit_code")
        return {
            "pid": int(body["pid"]),
            "command": str(body.get("command", "")),
            "state": str(body.get("state", "running")),
            "exit_code": None if code is None else int(code),
            "started_at": _time(body.get("started_at")),
            "exited_at": _time(body.get("exited_at")),
        }


@dataclass(frozen=True, kw_only=True)
class OutputEvent:
    """One piece of a process's output; `offset` is the output position after it."""

    stream: Literal["stdout", "stderr"]
    data: bytes
    offset: int

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


@dataclass(frozen=True, kw_only=True)
class PtyToken:
    token: str
    expires_at: datetime

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> PtyToken:
        expires = _time(body["expires_at"])
        assert expires is not None
        return cls(token=str(body["token"]), expires_at=expires)


@dataclass(frozen=True, kw_only=True)
class NetworkState:
    """A sandbox's network as its worker's egress gate sees it (`GET …/network`)."""

    network: bool | dict[str, list[str]]  # the policy in force
    allowed: int  # connections let through
    open: int  # of them, open now
    refused: int  # connections refused
    dns_refused: int  # names answered NXDOMAIN
    recent_refusals: list[dict[str, Any]]  # the last 20: at, target, reason

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> NetworkState:
        return cls(
            network=body["network"],
            allowed=int(body.get("allowed", 0)),
            open=int(body.get("open", 0)),
            refused=int(body.get("refused", 0)),
            dns_refused=int(body.get("dns_refused", 0)),
            recent_refusals=list(body.get("recent_refusals") or []),
        )


@dataclass(frozen=True, kw_only=True)
class Preview:
    """A URL to a port of a sandbox that works without an API key until `expires_at`: open
    it in a browser (its page's own requests carry the token as a cookie)."""

    url: str  # the path form: <api url>/api/v1/sandboxes/{name}/ports/{port}/?sandgate_preview=
    token: str
    expires_at: datetime
    host_url: str | None = None  # {port}-{name}.<domain>, on a deployment with a domain

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Preview:
        expires = _time(body["expires_at"])
        assert expires is not None
        host_url = body.get("host_url")
        return cls(
            url=str(body["url"]),
            token=str(body["token"]),
            expires_at=expires,
            host_url=str(host_url) if host_url else None,
        )


# ------------------------------------------------------------------------------ code contexts


@dataclass(frozen=True, kw_only=True)
class CodeContext:
    """A stateful interpreter (an IPython kernel) in a sandbox: its variables, imports and
    working directory last from one `run_code` to the next, until it is restarted or deleted."""

    id: str
    language: str = "python"
    cwd: str = "/workspace"

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> CodeContext:
        return cls(
            id=str(body["id"]),
            language=str(body.get("language", "python")),
            cwd=str(body.get("cwd", "/workspace")),
        )


MIME_FIELDS = MappingProxyType(
    {
        "text": "text/plain",
        "html": "text/html",
        "markdown": "text/markdown",
        "svg": "image/svg+xml",
        "png": "image/png",
        "jpeg": "image/jpeg",
        "pdf": "application/pdf",
        "latex": "text/latex",
        "json": "application/json",
        "javascript": "application/javascript",
    }
)
"""`Result` field -> the MIME type it holds (png, jpeg and pdf are base64 text)."""


@dataclass(frozen=True, kw_only=True)
class Result:
    """One output of a run: the value of its last expression (`is_main_result`) or something it
    displayed (`display(...)`, a plot), as a MIME bundle. `png`, `jpeg` and `pdf` are base64;
    MIME types without a field of their own are in `extra`."""

    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = None
    jpeg: str | None = None
    pdf: str | None = None
    latex: str | None = None
    json: Any = None
    javascript: str | None = None
    is_main_result: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def formats(self) -> list[str]:
        """The MIME types it has, as `MIME_FIELDS` names them (then `extra`'s own)."""
        present = [mime for name, mime in MIME_FIELDS.items() if getattr(self, name) is not None]
        return present + list(self.extra)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Result:
        def text(name: str) -> str | None:
            value = body.get(name)
            return None if value is None else str(value)

        return cls(
            text=text("text"),
            html=text("html"),
            markdown=text("markdown"),
            svg=text("svg"),
            png=text("png"),
            jpeg=text("jpeg"),
            pdf=text("pdf"),
            latex=text("latex"),
            json=body.get("json"),
            javascript=text("javascript"),
            is_main_result=bool(body.get("is_main_result", False)),
            extra=dict(body.get("extra") or {}),
        )


@dataclass(frozen=True, kw_only=True)
class ExecutionError:
    """The exception a run raised: its class name, its message and the formatted traceback
    (IPython's, with ANSI colours). A timeout is `TimeoutError`; a kernel that died,
    `KernelDied` (restart the context)."""

    name: str
    value: str
    traceback: str = ""

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ExecutionError:
        return cls(
            name=str(body.get("name", "")),
            value=str(body.get("value", "")),
            traceback=str(body.get("traceback") or ""),
        )


@dataclass(frozen=True, kw_only=True)
class OutputMessage:
    """A piece of a run's stdout or stderr, as the kernel flushed it, when it did."""

    stream: Literal["stdout", "stderr"]
    text: str
    timestamp: datetime | None = None

    @classmethod
    def from_json(cls, stream: Literal["stdout", "stderr"], body: dict[str, Any]) -> OutputMessage:
        stamp = body.get("timestamp")
        try:
            when = _time(stamp)
        except ValueError:
            when = None
        return cls(stream=stream, text=str(body.get("text", "")), timestamp=when)


@dataclass(kw_only=True)
class Execution:
    """What `run_code` gave: its results, its output (the pieces as they came), the exception
    it raised if any (`error`; not raised in the client), and the context's execution count."""

    results: list[Result] = field(default_factory=list)
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    error: ExecutionError | None = None
    execution_count: int | None = None
    context: str | None = None  # the id of the context it ran in

    @property
    def text(self) -> str | None:
        """The text of the main result (the value of the last expression), if there is one."""
        for result in self.results:
            if result.is_main_result:
                return result.text
        return None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, kw_only=True)
class TemplateInfo:
    """A template as the server described it: an image a sandbox may start from."""

    name: str
    public: bool  # every tenant may start from it
    digest: str  # content address of its layers and config
    source: str  # "oci", "docker" or "rootfs"
    size: int  # bytes of its layers as stored
    layers: int
    env: dict[str, str]
    workdir: str
    user: str
    cmd: list[str]
    created_at: datetime | None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> TemplateInfo:
        return cls(
            name=str(body["name"]),
            public=bool(body.get("public", False)),
            digest=str(body.get("digest", "")),
            source=str(body.get("source", "")),
            size=int(body.get("size") or 0),
            layers=int(body.get("layers") or 0),
            env=dict(body.get("env") or {}),
            workdir=str(body.get("workdir") or ""),
            user=str(body.get("user") or ""),
            cmd=[str(x) for x in body.get("cmd") or []],
            created_at=_time(body.get("created_at")),
        )


# ------------------------------------------------------------------------------ workspaces


@dataclass(frozen=True, kw_only=True)
class WorkspaceMount:
    """A workspace a sandbox mounts, and the path it is mounted at."""

    name: str
    path: str = "/workspace"

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> WorkspaceMount:
        return cls(name=str(body["name"]), path=str(body.get("path") or "/workspace"))


@dataclass(kw_only=True)
class WorkspaceInfo:
    """A persistent workspace as the server described it when this object was made (see
    `refresh()`): a tree of files that outlives sandboxes, with a git history."""

    name: str
    id: str = ""
    quota_mb: int = 0  # its files and history together
    head: str | None = None  # the sha of its last commit
    mounted_by: list[str] = field(default_factory=list)  # the sandboxes that mount it now
    created_at: datetime | None = None
    updated_at: datetime | None = None

    def describe(self) -> str:
        """`name=..., head=..., ...`: the description fields, for a subclass's repr."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(WorkspaceInfo))

    @staticmethod
    def fields_from_json(body: dict[str, Any]) -> dict[str, Any]:
        return {
            "name": str(body["name"]),
            "id": str(body.get("id", "")),
            "quota_mb": int(body.get("quota_mb") or 0),
            "head": body.get("head"),
            "mounted_by": [str(n) for n in body.get("mounted_by") or []],
            "created_at": _time(body.get("created_at")),
            "updated_at": _time(body.get("updated_at")),
        }


@dataclass(frozen=True, kw_only=True)
class CommitAuthor:
    name: str  # the tenant
    email: str


@dataclass(frozen=True, kw_only=True)
class Commit:
    """One commit of a workspace's history. `message` is the whole message: its subject (the
    first line, `.subject`), body and trailers (`Sandgate-Sandbox: <name>` on the commits a
    sandbox's delete or expiry made)."""

    sha: str
    parents: tuple[str, ...]
    author: CommitAuthor
    date: datetime | None
    message: str

    @property
    def subject(self) -> str:
        return self.message.split("\n", 1)[0]

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Commit:
        author = body.get("author") or {}
        try:
            date = _time(body.get("date"))
        except ValueError:
            date = None
        return cls(
            sha=str(body["sha"]),
            parents=tuple(str(p) for p in body.get("parents") or ()),
            author=CommitAuthor(
                name=str(author.get("name", "")), email=str(author.get("email", ""))
            ),
            date=date,
            message=str(body.get("message") or ""),
        )


@dataclass(frozen=True, kw_only=True)
class SkippedFile:
    """A file a commit left out: larger than the size rule allows."""

    path: str
    size: int


@dataclass(frozen=True, kw_only=True)
class CommitResult:
    """What a commit or a restore did: `commit` is the new commit, or the head when nothing
    had changed (`created` False); `skipped`, the files left out by the size rule."""

    commit: Commit
    created: bool
    skipped: tuple[SkippedFile, ...] = ()

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> CommitResult:
        return cls(
            commit=Commit.from_json(body["commit"]),
            created=bool(body.get("created", False)),
            skipped=tuple(
                SkippedFile(path=str(s["path"]), size=int(s.get("size") or 0))
                for s in body.get("skipped") or ()
            ),
        )


@dataclass(frozen=True, kw_only=True)
class FileStat:
    """One file a commit changed: lines added and deleted (None for a binary file)."""

    path: str
    added: int | None
    deleted: int | None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> FileStat:
        added, deleted = body.get("added"), body.get("deleted")
        return cls(
            path=str(body["path"]),
            added=None if added is None else int(added),
            deleted=None if deleted is None else int(deleted),
        )


@dataclass(frozen=True, kw_only=True)
class CommitDiff:
    """A commit and what it changed against its first parent (the first commit: against
    nothing): `files`, the stat, and `patch`, the unified diff, cut at 1 MiB (`truncated`)."""

    commit: Commit
    files: tuple[FileStat, ...]
    patch: str
    truncated: bool = False

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> CommitDiff:
        return cls(
            commit=Commit.from_json(body["commit"]),
            files=tuple(FileStat.from_json(f) for f in body.get("files") or ()),
            patch=str(body.get("patch") or ""),
            truncated=bool(body.get("truncated", False)),
        )
