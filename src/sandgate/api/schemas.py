"""Wire models of the native REST API. Unknown fields and wrong types are refused."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sandgate.core.ports import DEFAULT_PREVIEW_TTL, MAX_PREVIEW_TTL

RESERVED_METADATA = ("idem", "idem_owner")
MIN_DISK_MB = 64  # the smallest sandbox file system


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


MIN_PIDS = 16


class Resources(_In):
    """What the sandbox asks for; left out, the deployment's default. Above the operator's
    cap (`sandgate server --max-memory-mb/--max-cpus/--max-pids/--max-disk-mb`): 422 naming
    the cap. `disk_mb` is the quota of /workspace and /tmp together."""

    memory_mb: int | None = Field(default=None, ge=16, le=1 << 20)
    cpus: float | None = Field(default=None, ge=0.01, le=1024)  # a cgroup's least is 0.01
    # a sandbox's own start (bwrap, the agent and its threads) takes more than 8: at 8 it
    # could never run (found by schemathesis)
    pids: int | None = Field(default=None, ge=MIN_PIDS, le=1 << 22)
    disk_mb: int | None = Field(default=None, ge=MIN_DISK_MB, le=1 << 24)


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
MAX_MAP_BYTES = 64 << 10  # all keys and values of one metadata or env map together


def _check_str_map(value: dict[str, str], what: str, max_items: int = 64) -> dict[str, str]:
    if len(value) > max_items:
        raise ValueError(f"{what} takes at most {max_items} entries")
    for key, item in value.items():
        if not key or len(key) > 256 or len(item) > 8192 or "\x00" in key + item:
            raise ValueError(f"{what} keys must be 1-256 characters, values at most 8192, no NUL")
    if sum(len(k) + len(v) for k, v in value.items()) > MAX_MAP_BYTES:
        raise ValueError(f"{what} holds at most {MAX_MAP_BYTES // 1024} KiB in all")
    return value


def _check_env(value: dict[str, str]) -> dict[str, str]:
    for key in value:
        if not ENV_NAME.match(key):
            raise ValueError(f"env name {key!r} must match [A-Za-z_][A-Za-z0-9_]*")
    return _check_str_map(value, "env", max_items=256)


class NetworkRules(_In):
    """Where a sandbox may connect: domains (``pypi.org``, ``*.github.com``, ``*``), IPv4
    addresses and CIDRs. An ``allow_out`` match lets a connection through; else a
    ``deny_out`` match refuses it; else it passes only when ``allow_out`` is empty."""

    allow_out: list[str] = Field(default_factory=list, max_length=256)
    deny_out: list[str] = Field(default_factory=list, max_length=256)


NetworkField = bool | NetworkRules


class SetNetwork(_In):
    network: NetworkField = Field(
        description='false: loopback only; true: the public internet; or {"allow_out": '
        '[...], "deny_out": [...]}'
    )


class NetworkOut(BaseModel):
    network: bool | NetworkRules
    allowed: int = 0  # connections the gate let through
    open: int = 0  # of them, open now
    refused: int = 0  # connections it refused
    dns_refused: int = 0  # names its DNS answered NXDOMAIN
    recent_refusals: list[dict[str, Any]] = Field(default_factory=list)  # {at, target, reason}


class WorkspaceMountIn(_In):
    name: str
    path: str = "/workspace"


class CreateSandbox(_In):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "template": "default",
                    "timeout": 600,
                    "metadata": {"agent": "demo"},
                    "env": {"GREETING": "hello"},
                    "network": {"allow_out": ["pypi.org", "*.pythonhosted.org"]},
                    "resources": {"memory_mb": 512, "cpus": 1, "disk_mb": 1024},
                }
            ]
        }
    )

    template: str = Field(default="default", min_length=1, max_length=128)
    timeout: float | None = Field(default=None, gt=0, description="seconds until it is reaped")
    metadata: dict[str, str] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    network: NetworkField = False
    resources: Resources = Field(default_factory=Resources)
    # false: a cold start even where a worker has a warm pool of the template (benchmarks)
    pool: bool = True
    # the tenant's persistent workspaces it mounts read-write: one at /workspace, or several
    workspace: str | None = Field(default=None, description="a workspace mounted at /workspace")
    workspaces: list[WorkspaceMountIn] | None = Field(
        default=None, description="workspaces and where each is mounted"
    )

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str]) -> dict[str, str]:
        for key in RESERVED_METADATA:
            if key in value:
                raise ValueError(f"metadata key {key!r} is reserved (set from Idempotency-Key)")
        return _check_str_map(value, "metadata")

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env(value)


class CreateWorkspace(_In):
    name: str = Field(min_length=1, max_length=63)
    quota_mb: int | None = Field(default=None, description="its files and history together")


class CommitIn(_In):
    message: str = Field(default="", max_length=4096)


class RestoreIn(_In):
    commit: str = Field(min_length=4, max_length=40)


class WorkspaceOut(BaseModel):
    name: str
    id: str
    quota_mb: int
    head: str | None  # its last commit
    mounted_by: list[str]  # the sandboxes using it now
    created_at: datetime
    updated_at: datetime


class WorkspaceList(BaseModel):
    workspaces: list[WorkspaceOut]


class TemplateOut(BaseModel):
    name: str
    public: bool  # every tenant may start from it (made with an admin key)
    digest: str  # content address of its layers and config
    source: str  # oci, docker or rootfs
    size: int  # bytes of its layers as stored
    layers: int
    env: dict[str, str]
    workdir: str
    user: str
    cmd: list[str]
    created_at: datetime


class BuildOut(BaseModel):
    id: str
    name: str  # the template it makes
    state: str  # running, succeeded, failed
    log: str  # its steps' output (the last 1 MiB)
    error: str | None
    digest: str | None  # the template's, once it succeeded
    created_at: datetime
    finished_at: datetime | None


class SandboxOut(BaseModel):
    name: str
    state: str
    template: str
    metadata: dict[str, str]
    worker: str | None
    network: bool
    network_policy: NetworkRules | None = None  # its rules, when it has some
    resources: dict[str, Any]
    workspaces: list[dict[str, str]] = Field(default_factory=list)  # [{name, path}] it mounts
    timeout: float
    created_at: datetime
    started_at: datetime | None
    expires_at: datetime | None
    error: str | None = None


class SandboxList(BaseModel):
    sandboxes: list[SandboxOut]
    next_cursor: str | None


class ExtendTimeout(_In):
    timeout: float = Field(gt=0, description="seconds from now until it is reaped")


class _RunOptions(_In):
    """Where and how long a command runs: shared by execute and exec jobs."""

    timeout: float | None = Field(default=None, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    # none: /workspace, or the template's WorkingDir
    cwd: str | None = Field(default=None, min_length=1, max_length=4096)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env(value)


class Execute(_RunOptions):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"language": "python", "code": "print(6 * 7)", "timeout": 30},
                {"code": "ls -la", "cwd": "/workspace", "env": {"LC_ALL": "C"}},
            ]
        }
    )

    language: Literal["bash", "sh", "python"] = "bash"
    code: str = Field(min_length=1)


class ExecuteOut(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "stdout": "42\n",
                    "stderr": "",
                    "exit_code": 0,
                    "duration_ms": 38.5,
                    "timed_out": False,
                    "stdout_truncated": False,
                    "stderr_truncated": False,
                }
            ]
        }
    )

    stdout: str
    stderr: str
    exit_code: int
    duration_ms: float
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    oom_killed: bool = Field(
        default=False,
        description="The command was killed at the sandbox's memory limit (exit code 137): "
        "create the sandbox with a larger resources.memory_mb, or use less memory.",
    )


class CreateCodeContext(_In):
    language: Literal["python", "bash"] = "python"
    cwd: str | None = Field(default=None, min_length=1, max_length=4096)


class CodeContextOut(BaseModel):
    id: str
    language: str
    cwd: str


class RunCode(_In):
    code: str
    timeout: float | None = Field(default=None, gt=0, description="seconds; then interrupted")
    env: dict[str, str] = Field(default_factory=dict)
    # /run-code: the default context of this language (a context's own run: ignored)
    language: Literal["python", "bash"] | None = None

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env(value)


class CreateExecJob(_RunOptions):
    command: str = Field(min_length=1)


class ExecJobSummary(BaseModel):
    """An exec job as lists show it: everything but its output."""

    id: str
    sandbox: str
    state: Literal["queued", "running", "succeeded", "failed"]
    command: str
    timeout: float
    exit_code: int | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    error: str | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class ExecJobOut(ExecJobSummary):
    stdout: str = ""
    stderr: str = ""


class ExecJobList(BaseModel):
    exec_jobs: list[ExecJobSummary]
    next_cursor: str | None = None


class FileEntry(BaseModel):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: str
    mtime: datetime


class FileList(BaseModel):
    entries: list[FileEntry]


class MakeDir(_In):
    path: str = Field(min_length=1, max_length=4096)
    parents: bool = True


class Move(_In):
    source: str = Field(min_length=1, max_length=4096)
    destination: str = Field(min_length=1, max_length=4096)
    overwrite: bool = False


class StartProcess(_In):
    command: str = Field(min_length=1, max_length=1 << 20)
    # none: /workspace, or the template's WorkingDir
    cwd: str | None = Field(default=None, min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    timeout: float | None = Field(default=None, gt=0, le=7 * 24 * 3600)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env(value)


class ProcessOut(BaseModel):
    pid: int
    command: str
    state: Literal["running", "exited"]
    exit_code: int | None
    started_at: datetime
    exited_at: datetime | None = None
    terminal: bool = False  # a PTY session: follow it over the pty WebSocket, not /stream


class ProcessList(BaseModel):
    processes: list[ProcessOut]


SIGNALS = (
    "SIGTERM",
    "SIGKILL",
    "SIGINT",
    "SIGHUP",
    "SIGQUIT",
    "SIGUSR1",
    "SIGUSR2",
    "SIGSTOP",
    "SIGCONT",
    "SIGWINCH",
)


class Signal(_In):
    signal: str = Field(default="SIGTERM", description=f"one of {', '.join(SIGNALS)}")

    @field_validator("signal")
    @classmethod
    def _known(cls, value: str) -> str:
        name = value.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name not in SIGNALS:
            raise ValueError(f"unknown signal {value!r}; use one of {', '.join(SIGNALS)}")
        return name


class Written(BaseModel):
    written: int


class PtyToken(_In):
    ttl: float = Field(default=60.0, gt=0, le=600)


class PtyTokenOut(BaseModel):
    token: str
    expires_at: datetime


class PreviewIn(_In):
    """`POST /api/v1/sandboxes/{name}/ports/{port}/preview`: how long the URL works."""

    ttl: float = Field(default=DEFAULT_PREVIEW_TTL, gt=0, le=MAX_PREVIEW_TTL)


class PreviewOut(BaseModel):
    url: str  # the path form, with the token: works without an API key until expires_at
    token: str
    expires_at: datetime
    host_url: str | None = None  # the host form, {port}-{name}.<domain>, when there is one


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorOut(BaseModel):
    """Every error of the native API (`api/errors.py`); 429 and 422 `resource_cap_exceeded`
    add `limit` (and `max`) to `error`."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "error": {
                        "code": "not_running",
                        "message": "sandbox sbx-3k9q2m7x4w1z is stopped, not running",
                    }
                }
            ]
        }
    )

    error: ErrorBody
