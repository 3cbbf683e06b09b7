# mypy: always-true=ASYNC
"""The HTTP session of the asyncio client: `_AsyncApi`, the one retry loop every call goes
through, and the upload body it streams (local reads in worker threads).

`_sync_api.py` (`_Api`) is generated from this file by `scripts/async_to_sync.py`, as
`_sync.py` is from `_async.py` (see there).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import anyio
import httpx

from sandgate.client._base import (
    KEEPALIVE_EXPIRY,
    NOT_SENT,
    Progress,
    RetryPolicy,
    Safety,
    Upload,
    auth_headers,
    connection_error,
    error_from_response,
    make_timeout,
    resolve_api_key,
    resolve_url,
)

ASYNC = True  # `if ASYNC: <asyncio> else: <blocking>`: scripts/async_to_sync.py keeps the else


if ASYNC:

    async def _chunks(upload: Upload, progress: Progress | None) -> AsyncIterator[bytes]:
        """An upload's body; reads of a local file or file object run in a worker thread."""
        pieces = upload.chunks(progress)
        if upload.in_memory:
            for piece in pieces:
                yield piece
            return
        try:
            while (read := await anyio.to_thread.run_sync(_next, pieces)) is not None:
                yield read
        finally:
            pieces.close()

    def _next(pieces: Iterator[bytes]) -> bytes | None:
        return next(pieces, None)

else:

    def _chunks(upload: Upload, progress: Progress | None) -> AsyncIterator[bytes]:
        """An upload's body, read in the caller's thread."""
        return upload.chunks(progress)


class _AsyncApi:
    """The HTTP session and the one retry loop every call goes through."""

    def __init__(
        self,
        url: str | None,
        api_key: str | None,
        timeout: float | httpx.Timeout,
        max_retries: int,
    ) -> None:
        self.url = resolve_url(url)
        self.api_key = resolve_api_key(api_key)
        self.timeout = make_timeout(timeout)
        self.policy = RetryPolicy(max_retries=max_retries)
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers=auth_headers(self.api_key),
            timeout=self.timeout,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY),
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        safety: Safety,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        upload: Upload | None = None,
        progress: Progress | None = None,
        files: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeouts: httpx.Timeout | None = None,
        stream: bool = False,
        gone_ok: bool = False,
    ) -> httpx.Response:
        """Send with retries; an error answer raises. `gone_ok`: a 404 after a retry of a
        request that may have been carried out already counts as done (a repeated delete)."""
        attempt = 0
        maybe_done = False
        all_headers = {**(upload.headers() if upload else {}), **(headers or {})}
        while True:
            request = self.http.build_request(
                method,
                path,
                params=params,
                json=json,
                files=files,
                content=_chunks(upload, progress) if upload is not None else None,
                headers=all_headers,
                timeout=timeouts if timeouts is not None else self.timeout,
            )
            try:
                response = await self.http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if (
                    attempt < self.policy.max_retries
                    and self.policy.retries_exception(exc, safety)
                    and (upload is None or upload.resendable)
                ):
                    maybe_done = maybe_done or not isinstance(exc, NOT_SENT)
                    await anyio.sleep(self.policy.delay(attempt))
                    attempt += 1
                    continue
                raise connection_error(exc, str(request.url)) from exc
            if response.status_code < 400:
                return response
            try:
                body = await response.aread()
            except httpx.TransportError:
                body = b""
            finally:
                await response.aclose()
            error = error_from_response(response.status_code, body, response.headers)
            if gone_ok and maybe_done and response.status_code == 404:
                return response
            if (
                attempt < self.policy.max_retries
                and self.policy.retries_status(response.status_code, safety)
                and (upload is None or upload.resendable)
            ):
                await anyio.sleep(self.policy.delay(attempt, error.retry_after))
                attempt += 1
                continue
            raise error

    async def json(self, method: str, path: str, *, safety: Safety, **kw: Any) -> Any:
        return (await self.request(method, path, safety=safety, **kw)).json()

    def stream_timeout(self, read: float | None) -> httpx.Timeout:
        t = self.timeout
        return httpx.Timeout(connect=t.connect, read=read, write=t.write, pool=t.pool)

    async def aclose(self) -> None:
        await self.http.aclose()
