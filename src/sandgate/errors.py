"""Domain errors. Only `api/errors.py` maps them to HTTP statuses.

SandgateError                      code, message (both shown to the user)
├── InvalidRequestError            the request cannot be served as written (400/422)
│   ├── IdempotencyMismatchError   same Idempotency-Key, different body (422)
│   ├── PathOutsideSandboxError    a file path leaves the sandbox (403)
│   ├── NetworkUnavailableError    network asked for, worker cannot give it safely (422)
│   └── ResourceCapError           resources above the operator's cap; carries cap, value (422)
├── AuthError                      missing or unknown credentials (401)
├── ForbiddenError                 a valid key of the wrong kind for the route (403)
├── NotFoundError                  no such sandbox/file for this tenant (404)
├── ConflictError                  the target exists or is in the wrong state (409)
├── PayloadTooLargeError           body over the documented cap (413)
├── StorageFullError               the host's disk is full under a write (507)
│   └── DiskQuotaExceededError     the sandbox's disk quota is full (507)
├── LimitExceededError             a configured limit was hit; carries limit, retry_after (429)
├── UnavailableError               try again later; carries retry_after (503)
│   ├── NoCapacityError            no connected worker has room
│   │   └── AtCapacityError        workers are connected and all full (the create may queue)
│   └── TunnelUnavailableError     the sandbox's worker is not connected
├── SandboxTimeoutError            the worker did not answer in time (504)
├── WorkerError                    the worker or agent failed the operation (502)
└── StoreError                     the store failed
    ├── IdempotencyConflictError   (tenant, digest) already recorded; carries nothing else
    ├── QuotaConflictError         a tenant's live count is at its quota; carries the count
    └── CapacityConflictError      the chosen worker filled up meanwhile (placement retries)

Elsewhere: `tunnel.rpc.LinkClosedError` (a TunnelUnavailableError: the link went away while
a call waited), `tunnel.rpc.NoAnswerError` (a SandboxTimeoutError: our own wait ran out),
`control.peers.PeerMisconfiguredError` (an UnavailableError: a peer instance refused us).

On the wire (tunnel frames, peer links) an error is `{"code", "message", "details"}`:
`to_wire` writes it, `from_wire` reads it back into the class `WIRE_CODES` names for the
code. Nobody recognises an error by its message.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Self

Details = dict[str, str | float]


class SandgateError(Exception):
    code = "internal"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def details(self) -> Details:
        """What the error carries beyond code and message (sent on the wire)."""
        return {}

    @classmethod
    def from_details(cls, message: str, code: str, details: Mapping[str, Any]) -> Self:
        return cls(message, code=code)


class InvalidRequestError(SandgateError):
    code = "invalid_request"


class IdempotencyMismatchError(InvalidRequestError):
    code = "idempotency_key_reused"


class NotSupportedError(SandgateError):
    """What sandgate does not do (yet): the message says what works instead."""

    code = "not_supported"


class PathOutsideSandboxError(InvalidRequestError):
    code = "path_outside_sandbox"


class NetworkUnavailableError(InvalidRequestError):
    code = "network_unavailable"


class ResourceCapError(InvalidRequestError):
    """A sandbox asked for more than the operator allows; `cap` names it, `value` is it."""

    code = "resource_cap_exceeded"

    def __init__(self, message: str, *, cap: str, value: float, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.cap = cap
        self.value = value

    def details(self) -> Details:
        return {"cap": self.cap, "value": self.value}

    @classmethod
    def from_details(cls, message: str, code: str, details: Mapping[str, Any]) -> Self:
        return cls(
            message, cap=str(details.get("cap", "")), value=_number(details, "value"), code=code
        )


class AuthError(SandgateError):
    code = "unauthorized"


class ForbiddenError(SandgateError):
    """A valid key of a kind this route does not take (an admin key on a tenant route)."""

    code = "forbidden"


class NotFoundError(SandgateError):
    code = "not_found"


class ConflictError(SandgateError):
    code = "conflict"


class PayloadTooLargeError(SandgateError):
    code = "payload_too_large"


class StorageFullError(SandgateError):
    """A write found no space: on a worker that enforces no quota, the host's disk."""

    code = "storage_full"


class DiskQuotaExceededError(StorageFullError):
    code = "disk_quota_exceeded"


class LimitExceededError(SandgateError):
    """A limit of the deployment or the tenant; `limit` names it, as the user configured it."""

    code = "limit_exceeded"

    def __init__(
        self, message: str, *, limit: str, retry_after: float, code: str | None = None
    ) -> None:
        super().__init__(message, code=code)
        self.limit = limit
        self.retry_after = retry_after

    def details(self) -> Details:
        return {"limit": self.limit, "retry_after": self.retry_after}

    @classmethod
    def from_details(cls, message: str, code: str, details: Mapping[str, Any]) -> Self:
        limit = str(details.get("limit", ""))
        return cls(message, limit=limit, retry_after=_number(details, "retry_after"), code=code)


class UnavailableError(SandgateError):
    code = "unavailable"

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after

    def details(self) -> Details:
        return {"retry_after": self.retry_after}

    @classmethod
    def from_details(cls, message: str, code: str, details: Mapping[str, Any]) -> Self:
        return cls(message, retry_after=_number(details, "retry_after", 1.0), code=code)


class NoCapacityError(UnavailableError):
    code = "no_capacity"


class AtCapacityError(NoCapacityError):
    """Workers are connected and all full: a create may wait in the admission queue."""


class TunnelUnavailableError(UnavailableError):
    code = "tunnel_unavailable"


class SandboxTimeoutError(SandgateError):
    code = "timeout"


class WorkerError(SandgateError):
    code = "worker_error"


class StoreError(SandgateError):
    code = "store_error"


class IdempotencyConflictError(StoreError):
    code = "idempotency_conflict"


class QuotaConflictError(StoreError):
    code = "quota_conflict"

    def __init__(self, message: str, *, live: int, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.live = live

    @classmethod
    def from_details(cls, message: str, code: str, details: Mapping[str, Any]) -> Self:
        return cls(message, live=int(_number(details, "live")), code=code)


class CapacityConflictError(StoreError):
    code = "capacity_conflict"


def _number(details: Mapping[str, Any], key: str, default: float = 0.0) -> float:
    value = details.get(key, default)
    return float(value) if isinstance(value, int | float) and value == value else default


# Every code that may cross a tunnel or a peer link, and the class it is read back as. A code
# not listed is a WorkerError (502): a peer's answer is untrusted input.
WIRE_CODES: Mapping[str, type[SandgateError]] = MappingProxyType(
    {
        # the request
        "invalid_request": InvalidRequestError,
        "validation_error": InvalidRequestError,
        "bad_cursor": InvalidRequestError,
        "invalid_idempotency_key": InvalidRequestError,
        "idempotency_key_reused": IdempotencyMismatchError,
        "path_outside_sandbox": PathOutsideSandboxError,
        "permission_denied": PathOutsideSandboxError,  # the agent: EACCES, EPERM, EROFS
        "network_unavailable": NetworkUnavailableError,
        "resource_cap_exceeded": ResourceCapError,
        "payload_too_large": PayloadTooLargeError,
        "not_supported": NotSupportedError,
        # who asks
        "unauthorized": AuthError,
        "forbidden": ForbiddenError,
        # the target
        "not_found": NotFoundError,
        "conflict": ConflictError,
        "exists": ConflictError,
        "not_a_directory": ConflictError,
        "is_a_directory": ConflictError,
        "directory_not_empty": ConflictError,
        "not_running": ConflictError,
        "process_exited": ConflictError,
        "connection_closed": ConflictError,  # the agent: a port connection writes no more
        # workspaces (control/workspaces.py, worker/workspaces.py, worker/git_history.py)
        "workspace_not_found": NotFoundError,
        "commit_not_found": NotFoundError,
        "workspace_exists": ConflictError,
        "workspace_in_use": ConflictError,
        "workspace_busy": ConflictError,  # mounted by another worker
        "workspace_lock_lost": ConflictError,
        "workspaces_apart": ConflictError,
        "storage_full": StorageFullError,
        "disk_quota_exceeded": DiskQuotaExceededError,
        # limits and availability
        "limit_exceeded": LimitExceededError,
        "rate_limited": LimitExceededError,
        "quota_exceeded": LimitExceededError,
        "queue_full": LimitExceededError,
        "unavailable": UnavailableError,
        "no_capacity": NoCapacityError,
        "tunnel_unavailable": TunnelUnavailableError,
        "scheduling_breaker_open": UnavailableError,
        "queue_timeout": UnavailableError,
        "peer_misconfigured": UnavailableError,
        "delivery_skipped": UnavailableError,
        "workspace_lock_busy": UnavailableError,
        "timeout": SandboxTimeoutError,
        # failures
        "worker_error": WorkerError,
        "io_error": WorkerError,  # the agent: any other OSError
        "port_not_listening": WorkerError,  # the agent: nothing listens on a sandbox's port
        "store_error": StoreError,
    }
)


def to_wire(exc: SandgateError) -> dict[str, Any]:
    wire: dict[str, Any] = {"code": exc.code, "message": exc.message}
    if details := exc.details():
        wire["details"] = details
    return wire


def from_wire(error: Mapping[str, Any]) -> SandgateError:
    """The error a peer answered with, as its class (WorkerError for a code not known)."""
    code = str(error.get("code", "worker_error"))
    message = str(error.get("message", "the peer failed without a message"))
    details = error.get("details")
    cls = WIRE_CODES.get(code, WorkerError)
    return cls.from_details(message, code, details if isinstance(details, dict) else {})
