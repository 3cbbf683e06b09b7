"""The only place that knows HTTP statuses: domain errors → `{"error": {code, message}}`.

The E2B-compatible routes (api/e2b) answer the same statuses in the body E2B's SDKs parse,
`{"code": <status>, "message": ...}`: `install(app, shape=e2b_body)`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sandgate import errors as e

log = logging.getLogger(__name__)

_STATUS: tuple[tuple[type[e.SandgateError], int], ...] = (
    (e.IdempotencyMismatchError, 422),
    (e.NetworkUnavailableError, 422),
    (e.ResourceCapError, 422),
    (e.PathOutsideSandboxError, 403),
    (e.InvalidRequestError, 400),
    (e.AuthError, 401),
    (e.ForbiddenError, 403),
    (e.NotFoundError, 404),
    (e.ConflictError, 409),
    (e.PayloadTooLargeError, 413),
    (e.StorageFullError, 507),
    (e.LimitExceededError, 429),
    (e.UnavailableError, 503),
    (e.SandboxTimeoutError, 504),
    (e.WorkerError, 502),
    (e.StoreError, 503),
    (e.NotSupportedError, 501),
)

_HTTP_CODES = MappingProxyType(
    {
        400: "bad_request",
        401: "unauthorized",
        403: "forbidden",
        404: "not_found",
        405: "method_not_allowed",
        413: "payload_too_large",
        415: "unsupported_media_type",
    }
)


def status_of(exc: e.SandgateError) -> int:
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


Shape = Callable[[int, str, str, dict[str, str]], dict[str, Any]]


def native_body(status: int, code: str, message: str, extra: dict[str, str]) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, **extra}}


def e2b_body(status: int, code: str, message: str, extra: dict[str, str]) -> dict[str, Any]:
    """What E2B's SDKs parse (`Error.from_dict`): the status as `code`, and `message`."""
    return {"code": status, "message": message}


def error_response(
    status: int,
    code: str,
    message: str,
    headers: dict[str, str] | None = None,
    *,
    shape: Shape = native_body,
    **extra: str,
) -> JSONResponse:
    return JSONResponse(shape(status, code, message, extra), status_code=status, headers=headers)


def retry_after_header(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def retry_headers(exc: e.SandgateError) -> dict[str, str] | None:
    """`Retry-After` for an error that passes with time (a limit, an outage), else None."""
    if isinstance(exc, e.UnavailableError | e.LimitExceededError):
        return retry_after_header(exc.retry_after)
    if isinstance(exc, e.StoreError):
        return {"Retry-After": "1"}
    return None


def body_fields(exc: e.SandgateError) -> dict[str, str]:
    """What an error's JSON body carries beside its code and message: the limit it names."""
    if isinstance(exc, e.LimitExceededError):
        return {"limit": exc.limit}
    if isinstance(exc, e.ResourceCapError):
        return {"limit": exc.cap, "max": f"{exc.value:g}"}
    return {}


def domain_response(
    exc: e.SandgateError, status: int | None = None, *, shape: Shape = native_body
) -> JSONResponse:
    """The answer to `exc` (at its own status unless `status` is given): its body in `shape`
    and its `Retry-After`, as every route answers it."""
    return error_response(
        status_of(exc) if status is None else status,
        exc.code,
        exc.message,
        retry_headers(exc),
        shape=shape,
        **body_fields(exc),
    )


def install(app: FastAPI, *, shape: Shape = native_body, validation_status: int = 422) -> None:
    """Answer every error of `app` in `shape`; a body that fails validation gets
    `validation_status` (422 natively; E2B's SDKs expect 400)."""

    async def _domain(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, e.SandgateError)
        status = status_of(exc)
        if status >= 500:
            log.warning("request.failed", extra={"code": exc.code, "error": exc.message})
        return domain_response(exc, status, shape=shape)

    async def _validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        problems = exc.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return error_response(
                400, "invalid_json", "the request body is not valid JSON", shape=shape
            )
        parts = []
        for problem in problems[:5]:
            where = ".".join(str(x) for x in problem.get("loc", ()) if x != "body") or "body"
            parts.append(f"{where}: {problem.get('msg', 'invalid')}")
        return error_response(validation_status, "validation_error", "; ".join(parts), shape=shape)

    async def _http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        message = str(exc.detail) if exc.detail else code.replace("_", " ")
        if exc.status_code == 404 and exc.detail == "Not Found":
            message = f"no route for {request.method} {request.url.path}"
        headers = dict(exc.headers or {}) or None
        return error_response(exc.status_code, code, message, headers, shape=shape)

    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request.crashed", extra={"path": request.url.path})
        return error_response(
            500, "internal", "internal error; the server log has the details", shape=shape
        )

    app.add_exception_handler(e.SandgateError, _domain)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _unexpected)
