"""The sandbox path's hottest request, `POST /api/v1/sandboxes/{name}/execute`, answered
without FastAPI's routing and dependency machinery.

Everything a sandbox request costs on this instance before and after the tunnel was measured
in docs/benchmarks.md ("Session 14"): for `execute` of `echo ok`, FastAPI's stack (its
error, telemetry and exit-stack layers, route matching, the `Request`, dependency solving, a
body validated field by field) took ~0.3 ms of a ~3.5 ms request, as much as the whole
tunnel hop. This layer sits inside our own middlewares (request ids, metrics, body limits
still apply) and serves that one route with the same parts the route uses: the body model
(`schemas.Execute`, validated from the raw JSON in one call), the tenant dependency
(`deps.tenant`: key, kind, rate limit), the route's own `run_execute`, the same
`JSONResponse`, and the app's own exception handlers for its errors. So the answers are the
route's, byte for byte (`tests/fast/test_hot_paths.py` sends the same requests both ways).

Anything it does not serve in full goes to the app untouched: another path or method, a body
that is not `application/json` or does not validate (FastAPI then answers with its 4xx,
after the credentials, as before). `ServerSettings.hot_paths=False` sends everything there.
"""

from __future__ import annotations

import inspect
import re

from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandgate import errors as e
from sandgate.api import deps
from sandgate.api.routes import sandboxes
from sandgate.api.schemas import Execute

EXECUTE = re.compile(r"/api/v1/sandboxes/([^/]+)/execute")


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
        self.route = sandboxes.execute_route()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = None
        if scope["type"] == "http" and scope["method"] == "POST":
            found = EXECUTE.fullmatch(scope["path"])
        svc = getattr(self.fastapi.state, "services", None)
        if found is None or svc is None or not svc.settings.hot_paths or not _json_body(scope):
            await self.app(scope, receive, send)
            return
        body = await _read(receive)
        if body is None:
            return  # the client left, or the body limit answered already
        try:
            request = Execute.model_validate_json(body)
        except ValidationError:
            await self.app(scope, _replay(body, receive), send)  # FastAPI's 4xx, as ever
            return
        scope["route"] = self.route  # what the metrics and the request log label it with
        scope.setdefault("app", self.fastapi)  # the app's own call set it; deps read it
        http = Request(scope, receive)
        try:
            who = await deps.tenant(http)
            answer = await sandboxes.run_execute(found.group(1), request, who, svc)
        except e.SandgateError as exc:
            response = await self._handled(e.SandgateError, http, exc)
        except Exception as exc:
            response = await self._handled(Exception, http, exc)
        else:
            response = JSONResponse(answer)
        await response(scope, receive, send)

    async def _handled(self, kind: type[Exception], request: Request, exc: Exception) -> Response:
        """The response the app's own handler for `kind` gives (api/errors.py)."""
        response = self.fastapi.exception_handlers[kind](request, exc)
        return await response if inspect.isawaitable(response) else response


async def _read(receive: Receive) -> bytes | None:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body already read once, then whatever the client sends."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
