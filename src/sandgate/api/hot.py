"""The sandbox path's hottest requests, answered without FastAPI's routing and dependency
machinery: `POST /api/v1/sandboxes/{name}/execute` and a file's upload and download (`PUT` and
`GET /api/v1/sandboxes/{name}/toolbox/files?path=`).

Everything a sandbox request costs on this instance before and after the tunnel was measured
in docs/benchmarks.md ("Session 14"): for `execute` of `echo ok`, FastAPI's stack (its
error, telemetry and exit-stack layers, route matching, the `Request`, dependency solving, a
body validated field by field) took ~0.3 ms of a ~3.5 ms request, as much as the whole
tunnel hop; a file's answer paid about as much. This layer sits inside our own middlewares
(request ids, metrics, body limits still apply) and serves those routes with the same parts
the routes use: the body model (`schemas.Execute`, validated from the raw JSON in one call)
or the `path` query's bounds, the tenant dependency (`deps.tenant`: key, kind, rate limit),
the route functions themselves, the same responses (an upload's entry through its
`FileEntry` model), and the app's own exception handlers for their domain errors (any other
exception goes on up, as from a route, to the app's outermost layer). So the answers
are the routes', byte for byte (`tests/fast/test_hot_paths.py` sends the same requests both
ways).

Anything it does not serve in full goes to the app untouched: another path or method, an
execute body that is not `application/json` or does not validate, a `path` query missing,
repeated or out of bounds (FastAPI then answers with its 4xx, after the credentials, as
before). `ServerSettings.hot_paths=False` sends everything there.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, FastAPI, Request
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sandgate import errors as e
from sandgate.api import deps
from sandgate.api.limits import replay
from sandgate.api.routes import files, sandboxes
from sandgate.api.schemas import Execute, FileEntry
from sandgate.store.base import TenantId

EXECUTE = re.compile(r"/api/v1/sandboxes/([^/]+)/execute")
FILES = re.compile(r"/api/v1/sandboxes/([^/]+)/toolbox/files")

Work = Callable[[TenantId], Awaitable[Response]]


def _file_path(scope: Scope) -> str | None:
    """The `path` query as FastAPI reads it (`files.PathQuery`), or None where FastAPI would
    refuse it (missing, empty, too long) or where it comes more than once."""
    query: str = scope.get("query_string", b"").decode("latin-1")
    found = [value for name, value in parse_qsl(query, keep_blank_values=True) if name == "path"]
    if len(found) != 1 or not 1 <= len(found[0]) <= files.MAX_PATH_CHARS:
        return None
    return found[0]


def _json_body(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media: bytes = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json"
    return False


class HotPaths:
    def __init__(self, app: ASGIApp, *, fastapi: FastAPI) -> None:
        self.app = app
        self.fastapi = fastapi  # its state (services) and exception handlers
        self.execute_route = _route(sandboxes.router, sandboxes.execute)
        self.upload_route = _route(files.router, files.upload)
        self.download_route = _route(files.router, files.download)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        svc = getattr(self.fastapi.state, "services", None)
        if scope["type"] == "http" and svc is not None and svc.settings.hot_paths:
            method, path = scope["method"], scope["path"]
            if method == "POST" and _json_body(scope) and (found := EXECUTE.fullmatch(path)):
                await self._execute(scope, receive, send, found.group(1), svc)
                return
            if method in ("PUT", "GET") and (found := FILES.fullmatch(path)):
                if (file := _file_path(scope)) is not None:
                    await self._file(scope, receive, send, found.group(1), file, svc)
                    return
        await self.app(scope, receive, send)

    async def _execute(
        self, scope: Scope, receive: Receive, send: Send, name: str, svc: deps.Services
    ) -> None:
        http = Request(scope, receive)
        try:
            body = await http.body()
        except ClientDisconnect:  # the client left, or the body limit answered already
            # (then it drops this answer): what FastAPI answers for a body it could not read
            scope["route"] = self.execute_route
            unread = HTTPException(400, "There was an error parsing the body")
            response = await self._handled(HTTPException, http, unread)
            await response(scope, receive, send)
            return
        try:
            request = Execute.model_validate_json(body)
        except ValidationError:
            await self.app(scope, replay(body, receive), send)  # FastAPI's 4xx, as ever
            return

        async def work(who: TenantId) -> Response:
            return JSONResponse(await sandboxes.run_execute(name, request, who, svc))

        await self._answer(scope, receive, send, self.execute_route, work)

    async def _file(
        self, scope: Scope, receive: Receive, send: Send, name: str, path: str, svc: deps.Services
    ) -> None:
        async def upload(who: TenantId) -> Response:
            entry = await files.upload(name, path, Request(scope, receive), who, svc)
            return JSONResponse(FileEntry.model_validate(entry).model_dump(mode="json"))

        async def download(who: TenantId) -> Response:
            return await files.download(name, path, who, svc)

        if scope["method"] == "PUT":
            await self._answer(scope, receive, send, self.upload_route, upload)
        else:
            await self._answer(scope, receive, send, self.download_route, download)

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, route: APIRoute, work: Work
    ) -> None:
        """The tenant (as `deps.tenant` gives it), then `work`'s response or the app's own
        for the domain error it raised. Any other exception goes on up, as from a route:
        the app's outermost layer answers 500 and logs it (a client gone mid-upload is
        `_Guarded`'s to see, as before)."""
        scope["route"] = route  # what the metrics and the request log label it with
        scope.setdefault("app", self.fastapi)  # the app's own call set it; deps read it
        http = Request(scope, receive)
        try:
            response = await work(await deps.tenant(http))
        except e.SandgateError as exc:
            response = await self._handled(e.SandgateError, http, exc)
        await response(scope, receive, send)

    async def _handled(self, kind: type[Exception], request: Request, exc: Exception) -> Response:
        """The response the app's own handler for `kind` gives (api/errors.py)."""
        response = self.fastapi.exception_handlers[kind](request, exc)
        return await response if inspect.isawaitable(response) else response


def _route(router: APIRouter, endpoint: Callable[..., Any]) -> APIRoute:
    """The route of `endpoint`: its path labels metrics and the request log."""
    return next(r for r in router.routes if isinstance(r, APIRoute) and r.endpoint is endpoint)
