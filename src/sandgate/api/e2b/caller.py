"""Who an envd request is for, and translations every envd handler shares.

`envd.EnvdFront` authenticates the request and resolves its sandbox before any handler runs,
and sets `CALLER` for the request's task (the Connect handlers run inside it). Errors: the
toolbox's domain errors become the Connect codes E2B's SDK maps to its exceptions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from sandgate import errors as e
from sandgate.control.toolbox import Toolbox
from sandgate.store.base import TenantId

HOME = "/home/user"  # E2B's home directory: its paths are /workspace's here
WORKSPACE = "/workspace"
DEFAULT_USER = "user"


@dataclass(frozen=True)
class EnvdCaller:
    tenant: TenantId
    sandbox: str


CALLER: ContextVar[EnvdCaller] = ContextVar("sandgate_e2b_envd_caller")


def caller() -> EnvdCaller:
    try:
        return CALLER.get()
    except LookupError:  # only envd.EnvdFront routes to the handlers, and it sets it
        raise ConnectError(Code.INTERNAL, "request reached envd without a sandbox") from None


class OnToolbox:
    """A Connect service over the instance's toolbox (made by its lifespan, after the
    service: so it is looked up when a request comes)."""

    def __init__(self, toolbox: Callable[[], Toolbox]) -> None:
        self._toolbox = toolbox

    @property
    def toolbox(self) -> Toolbox:
        return self._toolbox()


@contextlib.contextmanager
def as_connect(sandbox: str) -> Iterator[None]:
    """The toolbox's domain errors, raised as the Connect errors E2B's SDK maps."""
    try:
        yield
    except e.SandgateError as exc:
        raise connect_error(exc, sandbox) from None


def sandbox_path(path: str) -> str:
    """E2B's /home/user is the sandbox's /workspace; relative paths are the agent's (below
    /workspace, the home directory)."""
    if path == HOME or path.startswith(HOME + "/"):
        return WORKSPACE + path[len(HOME) :]
    return path


def check_user(user: str | None) -> None:
    """Sandboxes run every command as one unprivileged user; E2B's `user` may name only it."""
    if user not in (None, "", DEFAULT_USER):
        raise e.InvalidRequestError(
            f"user {user!r}: sandgate sandboxes have one unprivileged user ({DEFAULT_USER!r}); "
            "run without user= (commands cannot become root)"
        )


def not_found_message(sandbox: str) -> str:
    """What E2B's SDK recognises as a sandbox that is not running (SandboxNotRunningException)."""
    return f"The sandbox {sandbox} was not found"


_CODES: tuple[tuple[type[e.SandgateError], Code], ...] = (
    (e.PathOutsideSandboxError, Code.PERMISSION_DENIED),
    (e.NetworkUnavailableError, Code.FAILED_PRECONDITION),
    (e.NotSupportedError, Code.UNIMPLEMENTED),
    (e.InvalidRequestError, Code.INVALID_ARGUMENT),
    (e.AuthError, Code.UNAUTHENTICATED),
    (e.ForbiddenError, Code.PERMISSION_DENIED),
    (e.NotFoundError, Code.NOT_FOUND),
    (e.PayloadTooLargeError, Code.RESOURCE_EXHAUSTED),
    (e.StorageFullError, Code.RESOURCE_EXHAUSTED),
    (e.LimitExceededError, Code.RESOURCE_EXHAUSTED),
    (e.UnavailableError, Code.UNAVAILABLE),
    (e.SandboxTimeoutError, Code.DEADLINE_EXCEEDED),
    (e.WorkerError, Code.INTERNAL),
    (e.StoreError, Code.UNAVAILABLE),
)


def connect_error(exc: e.SandgateError, sandbox: str) -> ConnectError:
    if isinstance(exc, e.ConflictError):
        if exc.code == "not_running":
            return ConnectError(Code.UNAVAILABLE, not_found_message(sandbox))
        if exc.code == "exists":
            return ConnectError(Code.ALREADY_EXISTS, exc.message)
        return ConnectError(Code.FAILED_PRECONDITION, exc.message)
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return ConnectError(code, exc.message)
    return ConnectError(Code.INTERNAL, exc.message)
