"""What every operation of the agent shares: the header type, its error and field readers."""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    from typing import Any

    Header = dict[str, Any]
else:
    Header = dict


class AgentError(Exception):
    """A request failed with one of the protocol's error codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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
