"""The outermost ASGI layer of an instance: one port for the native API and E2B's surface.

Each HTTP request goes where `routing.route` says: envd (`envd.EnvdFront`), E2B's REST API
(`rest`), the port proxy, or on to the native app. Requests routed by `Host` get the
`E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers added, so envd reads one place. Both E2B
front-ends get their own body limits (E2B-shaped refusals). A request (HTTP or WebSocket)
for any other port of a sandbox (`sandbox.get_host(port)`) goes to the native app's port
proxy, as its path form (`api.ports.port_scope`); other lifespan and WebSocket traffic is
the native app's.
"""

from __future__ import annotations

from starlette.datastructures import State
from starlette.types import ASGIApp, Receive, Scope, Send

from sandgate.api.e2b import routing
from sandgate.api.e2b.envd import EnvdFront
from sandgate.api.e2b.rest import create_e2b_rest_app
from sandgate.api.errors import e2b_body
from sandgate.api.limits import BodyLimit
from sandgate.api.ports import port_scope
from sandgate.config import ServerSettings


class E2BDispatch:
    def __init__(self, app: ASGIApp, *, state: State, settings: ServerSettings) -> None:
        self.app = app
        self.domain = settings.e2b_domain
        rest = create_e2b_rest_app(state)
        self.rest = BodyLimit(
            rest,
            max_bytes=settings.max_json_bytes,
            streaming_suffixes=(),
            idle_timeout=settings.body_idle_timeout,
            keyed_prefix="/",
            shape=e2b_body,
        )
        self.envd = BodyLimit(
            EnvdFront(state),
            max_bytes=settings.max_json_bytes,
            # uploads and input streams bound themselves (upload cap, Connect message cap)
            streaming_suffixes=("/files", "/process.Process/StreamInput"),
            idle_timeout=settings.body_idle_timeout,
            keyed_prefix="\x00",  # envd's credential is its access token, checked by envd
            shape=e2b_body,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        found = routing.route(scope["path"], scope.get("headers", ()), self.domain)
        if found.to == "port":
            await self.app(port_scope(scope, found.sandbox, found.port), receive, send)
        elif scope["type"] != "http":
            await self.app(scope, receive, send)
        elif found.to == "envd":
            headers = list(scope.get("headers", ()))
            if not any(name == b"e2b-sandbox-id" for name, _ in headers):
                headers += [
                    (b"e2b-sandbox-id", found.sandbox.encode()),
                    (b"e2b-sandbox-port", found.port.encode()),
                ]
                scope = {**scope, "headers": headers}
            await self.envd(scope, receive, send)
        elif found.to == "e2b_rest":
            await self.rest(scope, receive, send)
        else:
            await self.app(scope, receive, send)
