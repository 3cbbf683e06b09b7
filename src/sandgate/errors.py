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
│   └── TunnelUnavailableError     the sandbox's worker is not connected
├── SandboxTimeoutError            the worker did not answer in time (504)
├── WorkerError                    the worker or agent failed the operation (502)
└── StoreError                     the store failed
    ├── IdempotencyConflictError   (tenant, digest) already recorded; carries nothing else
    ├── QuotaConflictError         a tenant's live count is at its quota; carries the count
    └── CapacityConflictError      the chosen worker filled up meanwhile (placement retries)
"""

from __future__ import annotations


class SandgateError(Exception):
    code = "internal"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidRequestError(SandgateError):
    code = "invalid_request"


class IdempotencyMismatchError(InvalidRequestError):
    code = "idempotency_key_reused"


class PathOutsideSandboxError(InvalidRequestError):
    code = "path_outside_sandbox"


class NetworkUnavailableError(InvalidRequestError):
    code = "network_unavailable"


class ResourceCapError(InvalidRequestError):
    """A sandbox asked for more than the operator allows; `cap` names it, `value` is it."""

    code = "resource_cap_exceeded"

    def __init__(self, message: str, *, cap: str, value: float) -> None:
        super().__init__(message)
        self.cap = cap
        self.value = value


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


class UnavailableError(SandgateError):
    code = "unavailable"

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


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

    def __init__(self, message: str, *, live: int) -> None:
        super().__init__(message)
        self.live = live


class CapacityConflictError(StoreError):
    code = "capacity_conflict"
