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


class HandleReply(_Reply):
    handle: int | str


class OpenReadReply(_Reply):
    handle: int | str
    size: int = Field(ge=0)


class ExecReply(_Reply):
    exit_code: int
    duration_ms: float = Field(ge=0)
    timed_out: bool = False
    stdout_bytes: int = Field(ge=0)
    stdout_truncated: bool = False
    stderr_truncated: bool = False


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


class ProcessesReply(_Reply):
    processes: list[Process]


class OutputReply(_Reply):
    chunks: list[tuple[Literal["stdout", "stderr", "pty"], int]] = Field(default_factory=list)
    next_offset: int = Field(ge=0)
    first_offset: int = Field(default=0, ge=0)
    exited: bool = False
    exit_code: int | None = None


class WrittenReply(_Reply):
    written: int = Field(default=0, ge=0)


R = TypeVar("R", bound=_Reply)


def parse(model: type[R], reply: dict[str, Any]) -> R:
    try:
        return model.model_validate(reply)
    except ValidationError as exc:
        raise WorkerError(
            f"the sandbox sent a malformed answer ({exc.error_count()} problems); "
            "it may have been tampered with from inside"
        ) from None
