"""The error statuses each route documents in OpenAPI: what each means and what to do next.

A route lists only what it can answer (`api/errors.py` maps the domain errors to statuses),
composed from the groups below, e.g. `error_docs(TENANT, JSON_BODY, AGENT)`. 500 is never
listed: it is a bug, not an answer. Statuses the framework gives any path (404 for no
route, 405 for a wrong method) are not listed per route either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from sandgate.api.schemas import ErrorOut

MEANING: Mapping[int, str] = MappingProxyType(
    {
        400: "Bad request: the body is not JSON, or a value cannot be served as written "
        "(`error.code` names it, e.g. `invalid_request`, `bad_cursor`). Fix the request; "
        "sending it again unchanged fails again.",
        401: "Missing or unknown API key (or a worker token). Send a tenant API key as "
        "`Authorization: Bearer <key>` or `X-API-Key: <key>`.",
        403: "Refused: an admin key on a tenant's route (use that tenant's key), or a path "
        "outside the sandbox or one the sandbox may not touch (`path_outside_sandbox`).",
        404: "Not found for this tenant: no such sandbox, file, process, job, template or "
        "workspace (another tenant's looks exactly like one that does not exist).",
        408: "The request body did not arrive in time (a JSON body within the idle timeout, "
        "a streamed one never silent that long). Send it again.",
        409: "Conflict: the target is in the wrong state (`not_running`: the sandbox is not "
        "running; start or create one) or already exists (`exists`, `workspace_exists`).",
        413: "The request body is over its cap (`message` says which). Send less, or split it.",
        422: "Invalid: the body or a parameter does not match the schema (`validation_error`), "
        "a resource asks for more than the operator's cap (`resource_cap_exceeded`, with "
        "`limit` and `max`), or an `Idempotency-Key` is reused with another body.",
        429: "A limit was hit (`limit` names it: `rps`, `max_sandboxes`, `queue`...). Wait "
        "`Retry-After` seconds, or free what the limit counts first.",
        501: "Not supported by any connected worker or runtime (`not_supported`); the message "
        "says what works instead.",
        502: "The sandbox's worker or agent failed the operation (`worker_error`, `io_error`). "
        "Retrying may help; the message says what failed.",
        503: "Unavailable for now: no worker has room, the sandbox's tunnel is down, or the "
        "store failed. Retry after `Retry-After` seconds.",
        504: "The worker did not answer in time (`timeout`). Retry later, with a longer "
        "timeout if the operation takes one.",
        507: "No space left: the sandbox's disk quota or the worker's disk is full "
        "(`disk_quota_exceeded`, `storage_full`). Delete files, or ask for a larger `disk_mb`.",
    }
)

# what each status's body looks like, for the document's examples: (code, message)
EXAMPLE: Mapping[int, tuple[str, str]] = MappingProxyType(
    {
        400: ("invalid_json", "the request body is not valid JSON"),
        401: ("unauthorized", "unknown API key; create one with `sandgate keys create`"),
        403: ("forbidden", "this is an admin key: a tenant's routes take that tenant's API key"),
        404: ("not_found", "sandbox sbx-3k9q2m7x4w1z not found"),
        408: ("request_timeout", "the request body did not arrive in time; send it again"),
        409: ("not_running", "sandbox sbx-3k9q2m7x4w1z is stopped, not running"),
        413: ("payload_too_large", "request body over 1048576 bytes"),
        422: ("validation_error", "timeout: Input should be greater than 0"),
        429: ("rate_limited", "this tenant is limited to 10 requests per second; retry in 0.20 s"),
        501: ("not_supported", "no connected worker offers workspaces"),
        502: ("worker_error", "sandbox sbx-3k9q2m7x4w1z failed to start: the runtime failed"),
        503: ("tunnel_unavailable", "sandbox tunnel not available"),
        504: ("timeout", "the worker did not answer within 65 s"),
        507: ("disk_quota_exceeded", "the sandbox's disk quota (1024 MiB) is full"),
    }
)


def replayed() -> dict[str, Any]:
    """The header of an answer to a retry with the same Idempotency-Key."""
    return {
        "Idempotent-Replayed": {
            "description": "`true`: the answer to an earlier request with the same "
            "Idempotency-Key (nothing new was made)",
            "schema": {"type": "string", "enum": ["true"]},
        }
    }


def _retry_after() -> dict[str, Any]:
    return {
        "Retry-After": {
            "description": "seconds to wait before trying again",
            "required": True,
            "schema": {"type": "integer", "minimum": 1},
        }
    }


# Who calls: the key is looked up in the store (503 when it fails) and the tenant's request
# rate taken (429). An admin key reads the views that take one (templates, admission,
# workers); on a tenant's route it is refused (403).
VIEWER = (401, 429, 503)
TENANT = (*VIEWER, 403)
# A JSON body: not JSON (400), stalled (408), over the cap (413), not the schema (422).
JSON_BODY = (400, 408, 413, 422)
# A streamed body (file uploads, stdin): stalled, or over the route's own cap.
RAW_BODY = (408, 413)
PARAMS = (422,)  # query or path parameters that are validated
SANDBOX = (404, 409)  # the tenant's running sandbox: no such sandbox, not running
WORKER = (502, 503, 504)  # a call through a worker's tunnel: failed, tunnel down, no answer
# A call into the running sandbox's agent: it answers as a file system does (400 a bad
# value, 403 a path it may not touch, 404 not found, 409 exists or not a directory).
AGENT = (400, 403, *SANDBOX, *WORKER)
DISK = (507,)  # a write that may find the disk full


def error_docs(*statuses: int | Iterable[int]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these statuses (ints or groups of them), each the error body
    with its meaning; 429 and 503 with their `Retry-After` header."""
    flat: set[int] = set()
    for item in statuses:
        flat.update((item,) if isinstance(item, int) else item)
    docs: dict[int | str, dict[str, Any]] = {}
    for status in sorted(flat):
        code, message = EXAMPLE[status]
        doc: dict[str, Any] = {
            "model": ErrorOut,
            "description": MEANING[status],
            "content": {
                "application/json": {"example": {"error": {"code": code, "message": message}}}
            },
        }
        if status in (429, 503):
            doc["headers"] = _retry_after()
        docs[status] = doc
    return docs
