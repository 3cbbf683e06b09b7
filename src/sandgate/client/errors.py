"""The client's exceptions, one tree, built from the server's `{"error": {"code", "message"}}`.

SandgateError                      status (None when no answer came), code, message
├── APIConnectionError             no answer: refused, reset, dropped mid-answer (after retries)
│   └── APITimeoutError            the server did not answer within the client's timeout
├── ExecJobTimeoutError            `wait_exec_job` gave up (also a TimeoutError); carries job
├── InvalidRequestError            400, 405, 422: the request cannot be served as written
│   └── PayloadTooLargeError       413
├── AuthenticationError            401: no key, unknown key, or a worker token
├── PermissionDeniedError          403: e.g. a file path that leaves the sandbox
├── NotFoundError                  404: no such sandbox (for this tenant), file or process
├── ConflictError                  409: the sandbox or file is in the wrong state
├── RateLimitedError               429; carries retry_after
└── ServerError                    5xx
    ├── UnavailableError           503: no capacity, worker not connected; carries retry_after
    └── GatewayTimeoutError        504: the worker did not answer in time

These are the client's own classes: `sandgate.errors` is the server's domain tree and the
client never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandgate.client.models import ExecJob


class SandgateError(Exception):
    """An error the server answered with (or, for `APIConnectionError`, no answer at all)."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str = "error",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status}, code={self.code!r}, {self.message!r})"


class APIConnectionError(SandgateError):
    pass


class APITimeoutError(APIConnectionError):
    pass


class InvalidRequestError(SandgateError):
    pass


class PayloadTooLargeError(InvalidRequestError):
    pass


class AuthenticationError(SandgateError):
    pass


class PermissionDeniedError(SandgateError):
    pass


class NotFoundError(SandgateError):
    pass


class ConflictError(SandgateError):
    pass


class RateLimitedError(SandgateError):
    pass


class ServerError(SandgateError):
    pass


class UnavailableError(ServerError):
    pass


class GatewayTimeoutError(ServerError):
    pass


class BuildFailedError(SandgateError):
    """A template build ended with an error: `step` is the step that failed (0: before the
    first), `build_id` names its record (`client.templates.build_log`), which keeps the log."""

    def __init__(self, message: str, *, build_id: str, step: int) -> None:
        super().__init__(message, code="build_failed")
        self.build_id = build_id
        self.step = step


class ExecJobTimeoutError(SandgateError, TimeoutError):
    """`wait_exec_job` waited its `timeout` and the job had not finished; `job` is the job as
    last seen (queued or running). Nothing is cancelled: the job still runs on the server."""

    def __init__(self, message: str, *, job: ExecJob) -> None:
        super().__init__(message, code="wait_timeout")
        self.job = job


def error_class(status: int) -> type[SandgateError]:
    """The exception class of an HTTP error status."""
    exact: dict[int, type[SandgateError]] = {
        400: InvalidRequestError,
        401: AuthenticationError,
        403: PermissionDeniedError,
        404: NotFoundError,
        405: InvalidRequestError,
        409: ConflictError,
        413: PayloadTooLargeError,
        422: InvalidRequestError,
        429: RateLimitedError,
        503: UnavailableError,
        504: GatewayTimeoutError,
    }
    if status in exact:
        return exact[status]
    if status >= 500:
        return ServerError
    if status >= 400:
        return InvalidRequestError
    return SandgateError
