"""envd's front door: every request for a sandbox's envd is authenticated and resolved here,
then handed to the Connect services (`process`, `filesystem`) or to `/files` and `/health`.

In this order, so nothing about a sandbox is revealed before its credential is checked:

1. the sandbox's envd port (49983) and its code interpreter's (49999, api.e2b.interpreter)
   are served here (others go to the port proxy, api/ports, by `routing`; one that still
   came here: 502, saying so);
2. the credential: `X-Access-Token` (the `envdAccessToken` create answered), or for
   `/files` a signed URL, or on the interpreter's port `E2B-Traffic-Access-Token` (the
   `trafficAccessToken`: that SDK sends the access token on `/execute` only). Missing:
   401. Present but not this sandbox's: the sandbox "was not found" (502), exactly as for an
   unknown id, so another tenant's sandbox looks like none;
3. `Authorization: Basic` naming a user other than the sandbox's one: `invalid_argument`
   (a Connect error from `UserCheck` on the Connect services, 400 on `/files` and `/health`);
4. the sandbox must be running (502 "The sandbox … was not found" otherwise: E2B's SDK
   raises SandboxNotRunningException on that message).

Refusals made here answer `{"code": <status>, "message"}` with the HTTP status, as E2B's own
edge does; the SDK maps both the Connect and the plain form.
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from connectrpc.server import ConnectASGIApplication
from starlette.datastructures import State
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from sandgate.api import errors as api_errors
from sandgate.api.deps import Services
from sandgate.api.e2b import files, interpreter
from sandgate.api.e2b.caller import CALLER, EnvdCaller, check_user, not_found_message
from sandgate.api.e2b.codecs import envd_codecs
from sandgate.api.e2b.envd_pb.filesystem.filesystem_connect import FilesystemASGIApplication
from sandgate.api.e2b.envd_pb.process.process_connect import ProcessASGIApplication
from sandgate.api.e2b.filesystem import FilesystemService
from sandgate.api.e2b.process import ProcessService
from sandgate.control.toolbox import Toolbox
from sandgate.core import e2b_auth
from sandgate.errors import ConflictError, NotFoundError, SandgateError

log = logging.getLogger(__name__)

ENVD_PORT = 49983
MAX_MESSAGE_BYTES = 4 << 20  # one Connect message (a larger one: resource_exhausted)


def refuse(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


class EnvdFront:
    """The ASGI app of every request carrying `E2b-Sandbox-Id` (api.e2b.dispatch)."""

    def __init__(self, state: State) -> None:
        self.state = state  # the native app's: its lifespan puts the services there
        process = ProcessASGIApplication(
            ProcessService(self._toolbox),
            read_max_bytes=MAX_MESSAGE_BYTES,
            codecs=envd_codecs(),
            interceptors=(UserCheck(),),
        )
        filesystem = FilesystemASGIApplication(
            FilesystemService(self._toolbox),
            read_max_bytes=MAX_MESSAGE_BYTES,
            codecs=envd_codecs(),
            interceptors=(UserCheck(),),
        )
        self.connect_apps: Mapping[str, ConnectASGIApplication[Any]] = MappingProxyType(
            {process.path: process, filesystem.path: filesystem}
        )

    def _services(self) -> Services:
        found: Services = self.state.services
        return found

    def _toolbox(self) -> Toolbox:
        return self._services().toolbox

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        response = await self._front(request, scope, receive, send)
        if response is not None:
            await response(scope, receive, send)

    async def _front(
        self, request: Request, scope: Scope, receive: Receive, send: Send
    ) -> Response | None:
        sandbox = request.headers.get("e2b-sandbox-id", "")
        port = request.headers.get("e2b-sandbox-port", str(ENVD_PORT))
        if port not in (str(ENVD_PORT), str(interpreter.INTERPRETER_PORT)):
            return refuse(
                502,
                f"port {port} of sandbox {sandbox} is not served: sandgate serves envd "
                f"({ENVD_PORT}) and the code interpreter ({interpreter.INTERPRETER_PORT}) so far",
            )
        svc = self._services()
        path = request.url.path
        if port == str(interpreter.INTERPRETER_PORT):
            traffic = request.headers.get("e2b-traffic-access-token")
            if e2b_auth.traffic_token_matches(svc.settings.secret, sandbox, traffic):
                problem = None
            else:
                problem = self._credential(request, svc, sandbox, path="")
        else:
            problem = self._credential(request, svc, sandbox, path)
        if problem is not None:
            return problem
        try:
            if not path.startswith(tuple(self.connect_apps)):  # there: UserCheck
                check_user(_basic_user(request.headers.get("authorization")))
            if path == "/files":
                check_user(request.query_params.get("username"))
            who = await self._resolve(svc, sandbox)
        except (NotFoundError, ConflictError):
            return refuse(502, not_found_message(sandbox))
        except SandgateError as exc:
            return self._error(exc, sandbox)
        token = CALLER.set(who)
        try:
            if port == str(interpreter.INTERPRETER_PORT):
                return await interpreter.serve(request, svc, who)
            if path == "/health":
                return Response(status_code=204)
            if path == "/files":
                return await self._files(request, svc, who, sandbox)
            service = "/" + path.lstrip("/").split("/", 1)[0]
            app = self.connect_apps.get(service)
            if app is None:
                return refuse(404, f"envd has no {request.method} {path}")
            await app(scope, receive, send)
            return None
        finally:
            CALLER.reset(token)

    async def _resolve(self, svc: Services, sandbox: str) -> EnvdCaller:
        """The running sandbox's tenant: remembered per name (it never changes), and its
        running record through the same 1-s cache as every toolbox call."""
        tenant = await svc.sandboxes.owner(sandbox)
        if tenant is None:
            raise NotFoundError(not_found_message(sandbox))
        running = await svc.sandboxes.running(tenant, sandbox)
        return EnvdCaller(running.tenant_id, running.name)

    def _credential(
        self, request: Request, svc: Services, sandbox: str, path: str
    ) -> Response | None:
        presented = request.headers.get("x-access-token")
        if presented is not None:
            if e2b_auth.token_matches(svc.settings.secret, sandbox, presented):
                return None
            return refuse(502, not_found_message(sandbox))
        signature = request.query_params.get("signature")
        if path == "/files" and signature is not None:
            try:
                e2b_auth.check_file_signature(
                    token=e2b_auth.envd_token(svc.settings.secret, sandbox),
                    path=request.query_params.get("path", ""),
                    operation="read" if request.method == "GET" else "write",
                    username=request.query_params.get("username"),
                    signature=signature,
                    expiration=request.query_params.get("signature_expiration"),
                    now=time.time(),
                )
            except e2b_auth.SignatureRefused as exc:
                return refuse(401, str(exc))
            return None
        return refuse(
            401,
            "missing X-Access-Token: send the envdAccessToken that creating (or connecting "
            "to) the sandbox answered",
        )

    async def _files(
        self, request: Request, svc: Services, who: EnvdCaller, sandbox: str
    ) -> Response:
        try:
            if request.method == "GET":
                return await files.download(request, svc, who)
            if request.method == "POST":
                return await files.upload(request, svc, who)
        except SandgateError as exc:
            return self._error(exc, sandbox)
        return refuse(405, "use GET /files to download or POST /files to upload")

    def _error(self, exc: SandgateError, sandbox: str) -> Response:
        if isinstance(exc, ConflictError) and exc.code == "not_running":
            return refuse(502, not_found_message(sandbox))
        status = api_errors.status_of(exc)
        if exc.code == "disk_quota_exceeded":  # refused by its declared size too (natively 413)
            status = 507  # the SDK's NotEnoughSpaceException
        if status >= 500:
            log.warning("e2b.envd_failed", extra={"code": exc.code, "error": exc.message})
        return refuse(status, exc.message)


class UserCheck:
    """A Connect interceptor: a call naming a user other than the sandbox's is refused as the
    Connect error E2B's SDK maps (InvalidArgumentException), stream or not."""

    async def on_start(self, ctx: RequestContext[Any, Any]) -> None:
        try:
            check_user(_basic_user(ctx.request_headers.get("authorization")))
        except SandgateError as exc:
            raise ConnectError(Code.INVALID_ARGUMENT, exc.message) from None

    async def on_end(
        self, token: None, ctx: RequestContext[Any, Any], error: Exception | None
    ) -> None:
        return None


def _basic_user(header: str | None) -> str | None:
    """The user of `Authorization: Basic base64("<user>:")`, as E2B's SDK sends it."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        return "\x00malformed"  # refused by check_user, like any unknown user
