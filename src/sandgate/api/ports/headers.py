"""What of a request goes on to the server in the sandbox, and what of its answer comes back.

Pure functions over raw ASGI headers (lower-case byte names). Hop-by-hop headers (RFC 9110
7.6.1, and every header `Connection` names) belong to one connection and are dropped both
ways; so are sandgate's own credentials: the API key when it was the credential, the preview
token (its query parameter and its cookie) and E2B's traffic token. On the path form
(`/api/v1/sandboxes/{name}/ports/{port}/...`) the server's redirects and cookies are moved
under that prefix, so they stay inside the preview.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote_to_bytes

RawHeaders = list[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# set by the proxy itself, never copied from the client
OWN = frozenset(
    {
        b"host",
        b"content-length",
        b"expect",
        b"e2b-sandbox-id",
        b"e2b-sandbox-port",
        b"e2b-traffic-access-token",
        b"x-forwarded-for",
        b"x-forwarded-host",
        b"x-forwarded-proto",
        b"x-forwarded-prefix",
    }
)
# the WebSocket handshake's own: the client protocol towards the sandbox makes them
WEBSOCKET_OWN = frozenset(
    {
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-extensions",
        b"sec-websocket-protocol",
        b"sec-websocket-accept",
    }
)
# the server this instance is sets its own, once (uvicorn)
ANSWER_OWN = frozenset({b"date", b"server"})
PREVIEW_PARAM = "sandgate_preview"
PREVIEW_COOKIE = "sandgate_preview"
CREDENTIAL_HEADERS = frozenset({b"authorization", b"x-api-key"})


def named_by_connection(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The headers a `Connection` header lists (they are hop-by-hop too)."""
    names: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            names.update(part.strip().lower() for part in value.split(b",") if part.strip())
    return frozenset(names)


def to_upstream(
    headers: RawHeaders, *, drop_credentials: bool, websocket: bool = False
) -> RawHeaders:
    """The client's headers the sandbox's server gets: no hop-by-hop ones, none the proxy
    sets itself, our credentials removed (the API key only if it was the credential: else it
    may be the app's own `Authorization`), our cookie cut out of `Cookie`."""
    dropped = HOP_BY_HOP | OWN | named_by_connection(headers)
    if websocket:
        dropped |= WEBSOCKET_OWN
    if drop_credentials:
        dropped |= CREDENTIAL_HEADERS
    kept: RawHeaders = []
    for raw_name, value in headers:
        name = raw_name.lower()
        if name in dropped:
            continue
        if name == b"cookie":
            cut = without_cookie(value, PREVIEW_COOKIE)
            if cut:
                kept.append((name, cut))
            continue
        kept.append((name, value))
    return kept


def forwarded(client: str | None, host: bytes, scheme: str, prefix: str) -> RawHeaders:
    """X-Forwarded-* for the sandbox's server: who asked, by which host and scheme, and the
    path prefix it is served under (empty on the host form)."""
    added: RawHeaders = [(b"x-forwarded-proto", scheme.encode())]
    if client:
        added.append((b"x-forwarded-for", client.encode()))
    if host:
        added.append((b"x-forwarded-host", host))
    if prefix:
        added.append((b"x-forwarded-prefix", prefix.encode()))
    return added


def from_upstream(headers: Iterable[tuple[bytes, bytes]], *, prefix: str, port: int) -> RawHeaders:
    """The server's answer headers the client gets: no hop-by-hop ones, no `Date` and
    `Server` (ours are sent); on the path form, `Location` and cookie paths moved under the
    prefix."""
    listed = list(headers)
    dropped = HOP_BY_HOP | ANSWER_OWN | named_by_connection(listed)
    kept: RawHeaders = []
    for raw_name, value in listed:
        name = raw_name.lower()
        if name in dropped:
            continue
        if prefix and name == b"location":
            value = moved_location(value, prefix.encode(), port)
        elif prefix and name == b"set-cookie":
            value = moved_cookie_path(value, prefix.encode())
        kept.append((name, value))
    return kept


def moved_location(value: bytes, prefix: bytes, port: int) -> bytes:
    """A redirect to the server's own paths, under the prefix: `/x` and
    `http://localhost:{port}/x` become `{prefix}/x`; anything else is left as it is."""
    for origin in (b"http://localhost:%d" % port, b"http://127.0.0.1:%d" % port):
        if value == origin or value.startswith(origin + b"/") or value.startswith(origin + b"?"):
            value = value[len(origin) :] or b"/"
            if not value.startswith(b"/"):
                value = b"/" + value
            break
    if value.startswith(b"/") and not value.startswith(b"//"):
        return prefix + value
    return value


_COOKIE_PATH = re.compile(rb"(;\s*path\s*=\s*)([^;]*)", re.IGNORECASE)


def moved_cookie_path(value: bytes, prefix: bytes) -> bytes:
    """A cookie the server sets for `Path=/x` is set for `{prefix}/x` (and one with no path
    for the prefix): it is sent back to this preview only, not to the whole origin."""
    if not _COOKIE_PATH.search(value):
        return value + b"; Path=" + prefix + b"/"

    def move(match: re.Match[bytes]) -> bytes:
        path = match.group(2).strip()
        if not path.startswith(b"/"):
            path = b"/"
        return match.group(1) + prefix + path

    return _COOKIE_PATH.sub(move, value)


def without_cookie(value: bytes, name: str) -> bytes:
    """A `Cookie` header without the cookie `name`."""
    wanted = name.encode()
    parts = [part.strip() for part in value.split(b";")]
    return b"; ".join(p for p in parts if p and p.split(b"=", 1)[0].strip() != wanted)


def without_param(query: bytes, name: str) -> bytes:
    """A query string without the parameter `name` (the rest kept byte for byte)."""
    wanted = name.encode()
    parts = query.split(b"&") if query else []
    return b"&".join(p for p in parts if unquote_to_bytes(p.split(b"=", 1)[0]) != wanted)
