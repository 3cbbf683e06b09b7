"""core/sniff: the name a connection is for, from a real ClientHello and HTTP heads."""

from __future__ import annotations

import ssl

from sandgate.core.sniff import NEED_MORE, claims_a_name, http_host, server_name, tls_server_name


def client_hello(name: str | None) -> bytes:
    """The first flight of Python's own TLS client (OpenSSL) for `name`."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=name)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def test_sni_of_a_real_client_hello() -> None:
    hello = client_hello("Pypi.Org")
    assert tls_server_name(hello) == "pypi.org"
    assert server_name(hello) == "pypi.org"


def test_a_cut_client_hello_needs_more_and_one_without_sni_has_no_name() -> None:
    hello = client_hello("files.pythonhosted.org")
    for cut in (1, 4, 5, 60, len(hello) - 1):
        assert tls_server_name(hello[:cut]) == NEED_MORE
    assert tls_server_name(client_hello(None)) is None


def test_garbage_is_no_name() -> None:
    assert tls_server_name(b"\x16\x03\x01\x00\x05\x01\x00\x00\x01\x03") is None
    assert server_name(b"SSH-2.0-OpenSSH_9.2\r\n") is None
    assert server_name(b"\x00\x01\x02\x03\x04\x05") is None


def test_http_host() -> None:
    assert http_host(b"GET / HTTP/1.1\r\nHost: Example.COM:8080\r\nAccept: */*\r\n\r\n") == (
        "example.com"
    )
    assert http_host(b"GET /x HTTP/1.1\r\nUser-Agent: y\r\nhost:a.test\r\n\r\n") == "a.test"
    assert http_host(b"GET / HTTP/1.1\r\nHo") == NEED_MORE
    assert http_host(b"GE") == NEED_MORE
    assert http_host(b"GET / HTTP/1.1\r\nHost: a.te") == NEED_MORE
    assert http_host(b"GET / HTTP/1.1\r\n\r\n") is None  # no Host at all
    assert http_host(b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n") is None
    assert http_host(b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n") is None


def split_records(hello: bytes, cut: int) -> bytes:
    """The same ClientHello as two handshake records, cut `cut` bytes into its body."""
    version, body = hello[1:3], hello[5:]
    first, second = body[:cut], body[cut:]
    return (
        b"\x16"
        + version
        + len(first).to_bytes(2, "big")
        + first
        + b"\x16"
        + version
        + len(second).to_bytes(2, "big")
        + second
    )


def test_a_client_hello_cut_into_several_records_is_put_together() -> None:
    hello = client_hello("denied.test")
    for cut in (1, 3, 40, 200):
        split = split_records(hello, cut)
        assert tls_server_name(split) == "denied.test", cut
        assert tls_server_name(split[: len(split) - 1]) == NEED_MORE


def test_what_claims_a_name() -> None:
    assert claims_a_name(client_hello("x.test"))
    assert claims_a_name(b"GET / HTTP/1.1\r\nHost: denied.test:80:\r\n\r\n")
    assert http_host(b"GET / HTTP/1.1\r\nHost: denied.test:80:\r\n\r\n") is None
    assert not claims_a_name(b"SSH-2.0-OpenSSH_9.2\r\n")
    assert not claims_a_name(b"")
