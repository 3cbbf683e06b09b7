"""Where a proxied request goes in the sandbox, and what it carries there besides its own."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from starlette.types import Scope

from sandgate.api.ports import HOST_FORM
from sandgate.api.ports.credentials import Caller
from sandgate.api.ports.headers import (
    PREVIEW_COOKIE,
    PREVIEW_PARAM,
    RawHeaders,
    forwarded,
    to_upstream,
    without_param,
)
from sandgate.core.ports import API_PREFIX


@dataclass(frozen=True)
class Target:
    """Where a proxied request goes in the sandbox, and how it is presented there."""

    sandbox: str
    port: int
    resource: bytes  # path and query for the server (our token removed)
    prefix: str  # the path form's prefix; "" on the host form
    host: bytes  # the Host the server gets
    client_host: bytes  # the Host the client used
    scheme: str  # "http" or "https", as the client spoke to us

    @property
    def cookie_path(self) -> str:
        return self.prefix + "/" if self.prefix else "/"


def target_of(scope: Scope, sandbox: str, port_text: str, port: int) -> Target:
    prefix = f"{API_PREFIX}/{sandbox}/ports/{port_text}"
    raw: bytes = scope.get("raw_path") or scope["path"].encode()
    if raw.startswith(prefix.encode()):
        tail = raw[len(prefix) :]
    else:  # the client encoded the prefix differently: the decoded tail, encoded again
        tail = quote(str(scope["path"])[len(prefix) :]).encode()
    query = without_param(scope.get("query_string", b""), PREVIEW_PARAM)
    resource = (tail or b"/") + (b"?" + query if query else b"")
    client_host = next((v for k, v in scope.get("headers", ()) if k == b"host"), b"")
    host_form = bool(scope.get(HOST_FORM))
    scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
    return Target(
        sandbox=sandbox,
        port=port,
        resource=resource,
        prefix="" if host_form else prefix,
        host=client_host if host_form and client_host else b"localhost:%d" % port,
        client_host=client_host,
        scheme=scheme,
    )


def upstream_headers(scope: Scope, who: Caller, target: Target, *, websocket: bool) -> RawHeaders:
    """The request's headers for the server: the client's own (see headers.to_upstream),
    then X-Forwarded-*."""
    client = scope.get("client")
    return [
        *to_upstream(
            list(scope.get("headers", ())), drop_credentials=who.key_used, websocket=websocket
        ),
        *forwarded(client[0] if client else None, target.client_host, target.scheme, target.prefix),
    ]


def preview_cookie(who: Caller, target: Target, now: float) -> bytes | None:
    """The cookie that carries a preview token from the URL to the page's later requests."""
    if who.via != "preview" or who.grant is None:
        return None
    age = max(0, int(who.grant.expires - now))
    cookie = (
        f"{PREVIEW_COOKIE}={who.token}; Path={target.cookie_path}; Max-Age={age}; HttpOnly; "
        "SameSite=Lax"
    )
    if target.scheme == "https":
        cookie += "; Secure"
    return cookie.encode()
