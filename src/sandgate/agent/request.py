"""What every operation of the agent shares: the header type, its error and field readers."""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    import threading
    from typing import Any

    Header = dict[str, Any]
else:
    Header = dict


class AgentError(Exception):
    """A request failed with one of the protocol's error codes (`details`: the fields its
    error class takes, errors.py)."""

    def __init__(self, code: str, message: str, details: Header | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details


AT_LIMIT_RETRY_S = 1.0  # the retry a request refused at the sandbox's pids limit is told


def at_pids_limit() -> AgentError:
    """A process or thread the sandbox could not start: its processes and threads hold its
    whole pids limit (a fork or clone refused with EAGAIN)."""
    return AgentError(
        "limit_exceeded",
        "the sandbox is at its limit of processes and threads (resources.pids): retry once "
        "some of its processes end, or create it with a higher limit",
        {"limit": "pids", "retry_after": AT_LIMIT_RETRY_S},
    )


def start_thread(thread: threading.Thread) -> None:
    """``thread.start()``; a thread the sandbox's pids limit refuses (a thread is a task:
    "can't start new thread") is that limit's error."""
    try:
        thread.start()
    except RuntimeError:
        raise at_pids_limit() from None


def str_field(req: Header, name: str, default: str | None = None) -> str:
    value = req.get(name)
    if value is None:
        value = default
    if not isinstance(value, str):
        raise AgentError("invalid_request", f"{name!r} must be a string")
    return value


def bool_field(req: Header, name: str, default: bool | None = None) -> bool:
    value = req.get(name)
    if value is None:
        value = default
    if not isinstance(value, bool):
        raise AgentError("invalid_request", f"{name!r} must be a boolean")
    return value


def int_field(req: Header, name: str) -> int:
    value = req.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise AgentError("invalid_request", f"{name!r} must be an integer")
    return value
