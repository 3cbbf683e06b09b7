"""The port proxy's pure rules: port numbers, preview tokens, routing, and what of a request
and its answer crosses (core/ports.py, api/ports/headers.py, api/e2b/routing.py)."""

from __future__ import annotations

import pytest

from sandgate.api.e2b.routing import Route, route
from sandgate.api.ports import HOST_FORM, is_proxied_path, port_scope
from sandgate.api.ports.headers import (
    from_upstream,
    moved_cookie_path,
    moved_location,
    to_upstream,
    without_cookie,
    without_param,
)
from sandgate.core.ports import check_preview, issue_preview, parse_port
from sandgate.errors import AuthError, ForbiddenError, InvalidRequestError

PREFIX = b"/api/v1/sandboxes/sbx-a/ports/8000"


@pytest.mark.parametrize("good", ["1", "80", "8000", "65535", 443])
def test_ports(good: str | int) -> None:
    assert parse_port(good) == int(good)


@pytest.mark.parametrize("bad", ["0", "65536", "-1", "80a", "", "٨٠", "000080", "1e3"])
def test_bad_ports(bad: str) -> None:
    with pytest.raises(InvalidRequestError):
        parse_port(bad)


def test_preview_tokens() -> None:
    made = issue_preview("s", tenant="t1", sandbox="sbx-a", port=8000, ttl=60, now=1000.0)
    assert made.expires == 1060.0
    grant = check_preview("s", made.token, sandbox="sbx-a", port=8000, now=1059.0)
    assert (grant.tenant, grant.expires) == ("t1", 1060.0)
    with pytest.raises(AuthError, match="expired"):
        check_preview("s", made.token, sandbox="sbx-a", port=8000, now=1060.0)
    with pytest.raises(AuthError, match="signature"):
        check_preview("other secret", made.token, sandbox="sbx-a", port=8000, now=1001.0)
    with pytest.raises(ForbiddenError):
        check_preview("s", made.token, sandbox="sbx-b", port=8000, now=1001.0)
    with pytest.raises(ForbiddenError):
        check_preview("s", made.token, sandbox="sbx-a", port=8001, now=1001.0)
    with pytest.raises(AuthError, match="malformed"):
        check_preview("s", "garbage", sandbox="sbx-a", port=8000, now=1001.0)


def headers(**given: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in given.items()]


def test_other_ports_of_a_sandbox_go_to_the_port_proxy() -> None:
    by_host = route("/x", headers(Host="3000-sbx-abc.e2b.test"), "e2b.test")
    assert by_host == Route("port", "sbx-abc", "3000")
    assert route("/x", headers(Host="49983-sbx-abc.e2b.test"), "e2b.test").to == "envd"
    assert route("/x", headers(Host="49999-sbx-abc.e2b.test"), "e2b.test").to == "envd"
    by_header = route("/", headers(E2b_Sandbox_Id="sbx-a", E2b_Sandbox_Port="8080"), None)
    assert by_header == Route("port", "sbx-a", "8080")
    assert route("/", headers(E2b_Sandbox_Id="sbx-a"), None).to == "envd"  # envd's by default


def test_the_host_form_becomes_the_path_form() -> None:
    scope = {"type": "http", "path": "/a b", "raw_path": b"/a%20b", "query_string": b"q=1"}
    moved = port_scope(scope, "sbx-a", "8000")
    assert moved["path"] == "/api/v1/sandboxes/sbx-a/ports/8000/a b"
    assert moved["raw_path"] == PREFIX + b"/a%20b"
    assert moved[HOST_FORM] is True and moved["query_string"] == b"q=1"
    assert is_proxied_path(moved["path"])
    assert is_proxied_path("/api/v1/sandboxes/sbx-a/ports/8000")
    assert not is_proxied_path("/api/v1/sandboxes/sbx-a/execute")
    assert not is_proxied_path("/api/v1/sandboxes/sbx-a/portsx/1/")


def test_what_goes_on_to_the_server() -> None:
    client = headers(
        Host="api.example",
        Authorization="Bearer sg_key",
        X_Api_Key="sg_key",
        Connection="keep-alive, X-Hop",
        X_Hop="1",
        Keep_Alive="5",
        Transfer_Encoding="chunked",
        Content_Length="5",
        Cookie="a=1; sandgate_preview=tok; b=2",
        E2b_Traffic_Access_Token="t",
        Accept="*/*",
    )
    sent = dict(to_upstream(client, drop_credentials=True))
    assert sent == {b"cookie": b"a=1; b=2", b"accept": b"*/*"}
    kept = dict(to_upstream(client, drop_credentials=False))  # the app's own Authorization
    assert kept[b"authorization"] == b"Bearer sg_key"
    only_ours = headers(Cookie="sandgate_preview=tok")
    assert to_upstream(only_ours, drop_credentials=True) == []


def test_what_comes_back() -> None:
    answer = [
        (b"Content-Type", b"text/html"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Connection", b"close"),
        (b"Date", b"x"),
        (b"Server", b"SimpleHTTP"),
        (b"Location", b"/next"),
        (b"Set-Cookie", b"s=1; Path=/; HttpOnly"),
    ]
    path_form = from_upstream(answer, prefix=PREFIX.decode(), port=8000)
    assert path_form == [
        (b"content-type", b"text/html"),
        (b"location", PREFIX + b"/next"),
        (b"set-cookie", b"s=1; Path=" + PREFIX + b"/; HttpOnly"),
    ]
    host_form = from_upstream(answer, prefix="", port=8000)
    assert (b"location", b"/next") in host_form
    assert (b"set-cookie", b"s=1; Path=/; HttpOnly") in host_form


@pytest.mark.parametrize(
    ("location", "moved"),
    [
        (b"/x?y=1", PREFIX + b"/x?y=1"),
        (b"http://localhost:8000/x", PREFIX + b"/x"),
        (b"http://127.0.0.1:8000", PREFIX + b"/"),
        (b"http://localhost:8001/x", b"http://localhost:8001/x"),  # another port: as it is
        (b"https://example.com/x", b"https://example.com/x"),
        (b"//example.com/x", b"//example.com/x"),
        (b"relative", b"relative"),
    ],
)
def test_locations(location: bytes, moved: bytes) -> None:
    assert moved_location(location, PREFIX, 8000) == moved


def test_cookie_paths_and_our_own_parts() -> None:
    assert moved_cookie_path(b"a=1", PREFIX) == b"a=1; Path=" + PREFIX + b"/"
    assert moved_cookie_path(b"a=1; path=/sub; Secure", PREFIX) == (
        b"a=1; path=" + PREFIX + b"/sub; Secure"
    )
    assert without_cookie(b"sandgate_preview=x", "sandgate_preview") == b""
    assert without_param(b"a=1&sandgate_preview=t&b=%20", "sandgate_preview") == b"a=1&b=%20"
    assert without_param(b"sandgate%5Fpreview=t", "sandgate_preview") == b""
    assert without_param(b"", "sandgate_preview") == b""
