"""Nothing unauthenticated is buffered, and no body may stall (issue 10, point 3): raw
sockets against a real server started with `--body-idle-timeout 1`."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandgate.core.signing import signed_headers
from tests.integration.api.conftest import Deployment, start_deployment, tear_down

SECRET = "a-shared-secret-of-the-instances"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    base = tmp_path_factory.mktemp("slow")
    secret_file = base / "secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)
    dep = start_deployment(
        base / "deployment",
        worker=False,
        server_args=("--body-idle-timeout", "1", "--secret-file", str(secret_file)),
    )
    try:
        yield dep
    finally:
        tear_down(dep)


def _open(dep: Deployment, head: str, first: bytes) -> socket.socket:
    host, port = dep.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(head.encode("latin-1") + b"\r\n" + first)
    return sock


def _answer(sock: socket.socket, within: float) -> bytes:
    """What the server sends (until it closes) within `within` s; b"" if it closed."""
    sock.settimeout(within)
    got = b""
    try:
        while piece := sock.recv(65536):
            got += piece
            head, _, body = got.partition(b"\r\n\r\n")
            length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
            if length and len(body) >= int(length.group(1)):
                break  # a whole answer (the connection may be kept open)
    finally:
        sock.close()
    return got


def test_an_unsigned_internal_body_is_refused_before_it_is_read(server: Deployment) -> None:
    head = (
        "POST /internal/provision HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {15 << 20}\r\nx-sandgate-timestamp: {time.time():.3f}\r\n"
        "x-sandgate-signature: " + "0" * 64 + "\r\n"
        "x-sandgate-body-sha256: " + "0" * 64 + "\r\n"
    )
    started = time.monotonic()
    answer = _answer(_open(server, head, b"{" * 100), within=5)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert time.monotonic() - started < 1  # not after a deadline: at once, body unread


def _signed_head(body: bytes, length: int) -> str:
    signed = signed_headers(SECRET, "POST", "/internal/provision", time.time(), body)
    lines = "".join(f"{k}: {v}\r\n" for k, v in signed.items())
    return (
        "POST /internal/provision HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{lines}"
    )


def test_a_signed_internal_request_reaches_its_handler(server: Deployment) -> None:
    body = b'{"job_id": "none"}'
    answer = _answer(_open(server, _signed_head(body, len(body)), body), within=5)
    assert answer.startswith(b"HTTP/1.1 404"), answer[:300]  # past the signature: no such job


def test_a_signed_internal_request_whose_body_was_altered_is_refused(server: Deployment) -> None:
    body = b'{"job_id": "none"}'
    altered = body.replace(b"none", b"nope")
    answer = _answer(_open(server, _signed_head(body, len(altered)), altered), within=5)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    assert b"body altered" in answer


def test_a_stalled_signed_internal_body_is_cut(server: Deployment) -> None:
    body = b'{"job_id": "none"}'
    started = time.monotonic()
    answer = _answer(_open(server, _signed_head(body, len(body)), body[:5]), within=10)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert time.monotonic() - started < 5


def test_a_stalled_public_body_is_cut(server: Deployment) -> None:
    head = (
        "POST /api/v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {server.keys['alpha']}\r\nContent-Length: 1000\r\n"
    )
    started = time.monotonic()
    sock = _open(server, head, b'{"metadata": ')
    answer = _answer(sock, within=10)
    took = time.monotonic() - started
    assert took < 5, took  # cut after the 1 s idle deadline, not held for ever
    assert not answer.startswith(b"HTTP/1.1 2"), answer[:200]


def test_the_server_still_serves_after_all_that(server: Deployment, tmp_path: Path) -> None:
    with server.client() as c:
        assert c.get("/api/v1/sandboxes").status_code == 200


def _answer_then_closed(sock: socket.socket, within: float) -> tuple[bytes, bool]:
    """The answer, and whether the server then closed the connection (within `within` s)
    while we sent nothing more. A server that closes with part of our body unread makes its
    kernel answer the rest with a reset: that is a close too (the answer came before it)."""
    sock.settimeout(within)
    got = b""
    try:
        while piece := sock.recv(65536):
            got += piece
    except TimeoutError:
        return got, False
    except ConnectionResetError:
        return got, True
    finally:
        sock.close()
    return got, True


def test_an_unsigned_internal_request_is_answered_and_its_connection_closed(
    server: Deployment,
) -> None:
    """The 401 comes before the body is read; the socket must not stay open for a body
    the server will never read (it used to, for minutes)."""
    head = (
        "POST /internal/peer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {16_000_000}\r\n"
    )
    answer, closed = _answer_then_closed(_open(server, head, b"x" * 100_000), within=5)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"connection: close" in answer.lower()
    assert closed


def test_a_body_without_credentials_is_refused_before_it_is_read(server: Deployment) -> None:
    head = (
        "POST /api/v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 2000000\r\n"
    )
    started = time.monotonic()
    answer, closed = _answer_then_closed(_open(server, head, b'{"metadata": '), within=5)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert closed and time.monotonic() - started < 1  # at once, not after a deadline


def test_a_stalled_public_body_is_answered_408_and_closed(server: Deployment) -> None:
    head = (
        "POST /api/v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {server.keys['alpha']}\r\nContent-Length: 1000\r\n"
    )
    answer, closed = _answer_then_closed(_open(server, head, b'{"metadata": '), within=10)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"request_timeout" in answer and closed


def test_a_trickled_json_body_is_cut_by_its_whole_body_deadline(server: Deployment) -> None:
    """Never silent for the idle timeout (1 s), but not whole within it either."""
    head = (
        "POST /api/v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {server.keys['alpha']}\r\nContent-Length: 1000\r\n"
    )
    sock = _open(server, head, b"{")
    sock.settimeout(0.3)
    started = time.monotonic()
    got = b""
    while time.monotonic() - started < 8 and not got:
        try:
            sock.sendall(b" ")
            got = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
    sock.close()
    assert got.startswith(b"HTTP/1.1 408"), got[:300]
    assert time.monotonic() - started < 4
