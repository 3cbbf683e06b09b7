"""Answers from workers and agents, validated: a peer's reply is untrusted input.

A sandbox's agent runs beside tenant code, so anything it sends may be forged. Every field
the control plane uses is parsed here; a reply that does not fit becomes a `WorkerError`
(502), never a crash.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandgate.errors import WorkerError


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)


class Entry(_Reply):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int = Field(ge=0)
    mode: str
    mtime: datetime


class EntryReply(_Reply):
    entry: Entry


class EntriesReply(_Reply):
    entries: list[Entry]


class OpenWriteReply(_Reply):
    """`open_write`: a handle, or with `commit` (the file in one call) its entry; an agent
    that predates `commit` answers a handle only, and the caller goes on the long way.
    `offsets`: the handle's writes may name their offset (so several may be under way)."""

    handle: int | str | None = None
    entry: Entry | None = None
    offsets: bool = False


class OpenReadReply(_Reply):
    """`open_read`: a handle and the size; asked for its `first` bytes, how many came in the
    payload and whether that is all (`eof`: no handle left open). An agent that predates
    `first` answers without it."""

    handle: int | str | None
    size: int = Field(ge=0)
    first: int | None = Field(default=None, ge=0)
    eof: bool = False
    offsets: bool = False  # the handle's reads may name their offset


class ExecReply(_Reply):
    exit_code: int
    duration_ms: float = Field(ge=0)
    timed_out: bool = False
    stdout_bytes: int = Field(ge=0)
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    oom_killed: bool = False  # the worker's: SIGKILLed while the memory limit killed


class PidReply(_Reply):
    pid: int = Field(ge=1)


class Process(_Reply):
    pid: int
    command: str
    state: Literal["running", "exited"]
    exit_code: int | None = None
    started_at: datetime
    exited_at: datetime | None = None
    terminal: bool = False
    # what the start asked for: the E2B surface lists processes with these
    argv: list[str] = Field(default_factory=list, exclude=True)
    cwd: str | None = Field(default=None, exclude=True)
    env: dict[str, str] = Field(default_factory=dict, exclude=True)
    tag: str | None = Field(default=None, exclude=True)  # unique among running processes
    output_end: int = Field(default=0, ge=0, exclude=True)  # where new output will start


class ProcessesReply(_Reply):
    processes: list[Process]


class OutputReply(_Reply):
    chunks: list[tuple[Literal["stdout", "stderr", "pty"], int]] = Field(default_factory=list)
    next_offset: int = Field(ge=0)
    first_offset: int = Field(default=0, ge=0)
    exited: bool = False
    exit_code: int | None = None


class ExportedLayer(_Reply):
    """export_root: the layer a template sandbox's root changes make, on its worker."""

    digest: str
    size: int = Field(ge=0)
    entries: int = Field(ge=0)


class TaggedWriteReply(_Reply):
    """proc_stdin to a process named by its tag: which one, and where its output stood."""

    pid: int = Field(ge=1)
    output_end: int = Field(ge=0)


class SignalReply(_Reply):
    """proc_signal: whether the process still ran (False: it had exited, nothing was sent;
    an agent from before the field said so is taken as True)."""

    running: bool = True


class StartedReply(_Reply):
    """proc_start with a `wait`: the pid and the first read of its output."""

    pid: int = Field(ge=1)
    output: OutputReply


class PortOpenReply(_Reply):
    """port_open: the connection's number, and with a wait, its first read (`eof`)."""

    conn: int = Field(ge=1)
    eof: bool = False


class PortReadReply(_Reply):
    """port_read: the bytes are the payload; `eof`: the server ended its stream."""

    eof: bool = False


class WrittenReply(_Reply):
    written: int = Field(default=0, ge=0)


class WatchEvent(_Reply):
    """One change below a watched directory (the agent's watch.py)."""

    name: str  # relative to the watched directory: "a.txt", "sub/b.txt"
    path: str  # the full sandbox path
    type: Literal["create", "write", "remove", "rename", "chmod"]


class WatchStartReply(_Reply):
    watch: str = Field(min_length=1, max_length=64)


class WatchReadReply(_Reply):
    events: list[WatchEvent] = Field(default_factory=list)
    next_offset: int = Field(ge=0)
    first_offset: int = Field(default=0, ge=0)
    dropped: int = Field(default=0, ge=0)
    ended: bool = False
    overflowed: bool = False


R = TypeVar("R", bound=_Reply)


def parse(model: type[R], reply: dict[str, Any]) -> R:
    try:
        return model.model_validate(reply)
    except ValidationError as exc:
        raise WorkerError(
            f"the sandbox sent a malformed answer ({exc.error_count()} problems); "
            "it may have been tampered with from inside"
        ) from None


class MetricsReply(_Reply):
    """A worker's `metrics` answer: what one of its sandboxes uses (`worker/metrics.py`)."""

    timestamp: float = Field(gt=0)
    cpu_count: int = Field(ge=1)
    cpu_used_pct: float = Field(ge=0, le=100)
    mem_used: int = Field(ge=0)
    mem_total: int = Field(gt=0)
    mem_cache: int = Field(ge=0)
    disk_used: int = Field(ge=0)
    disk_total: int = Field(ge=0)
