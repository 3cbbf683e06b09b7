"""The fault proxy's HTTP rules, its redirect and its script mode, against plain servers: what
the SDK tests, the e2e move tests and scripts/multi-instance-check.sh rely on."""

from __future__ import annotations

import http.server
import signal
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy, OpenProxy, first_n
from tests.integration.api.conftest import free_port, wait_until

BODY = b"x" * 5000
FAULTPROXY = Path(__file__).parents[1] / "faultproxy.py"


class _Answer(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    heads: list[dict[str, str]]  # set per server: the heads that reached the upstream

    def do_GET(self) -> None:
        self.heads.append({k.lower(): v for k, v in self.headers.items()})
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[tuple[str, list[dict[str, str]]]]:
    heads: list[dict[str, str]] = []
    handler = type("Handler", (_Answer,), {"heads": heads})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", heads
    server.shutdown()
    server.server_close()


def _get(proxy: FaultProxy, path: str) -> bytes:
    """Send one GET (asking to keep the connection alive) and read until the proxy closes."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n".encode())
        got = b""
        while piece := sock.recv(65536):
            got += piece
        return got


def test_a_rule_drops_cuts_or_passes_each_answer(
    upstream: tuple[str, list[dict[str, str]]], fault_proxy: OpenProxy
) -> None:
    url, heads = upstream
    rule = first_n(1, "GET", "/drop")
    proxy = fault_proxy(url, rule=lambda seen: 100 if seen.path == "/cut" else rule(seen))
    assert _get(proxy, "/drop?a=1") == b""  # the server answered; the client heard nothing
    assert len(heads) == 1
    assert len(_get(proxy, "/cut")) == 100
    whole = _get(proxy, "/drop")  # only the first matching request is dropped
    assert whole.startswith(b"HTTP/1.1 200") and whole.endswith(BODY)
    assert [s.target for s in proxy.seen] == ["/drop?a=1", "/cut", "/drop"]
    assert len(proxy.count("GET", "/drop")) == 2 and proxy.count("POST", "/drop") == []
    # each connection carries one request: the server is asked to close after its answer
    assert {h["connection"] for h in heads} == {"close"} and len(heads) == 3


class _Tag(socketserver.BaseRequestHandler):
    tag: bytes

    def handle(self) -> None:
        try:
            while self.request.recv(65536):
                self.request.sendall(self.tag)
        except OSError:
            pass  # the proxy reset it: what these tests do


@pytest.fixture
def tagged() -> Iterator[list[str]]:
    """Two servers answering every chunk with their name, a and b."""
    servers = []
    for tag in (b"a", b"b"):
        handler = type("Handler", (_Tag,), {"tag": tag})
        server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


def _ask(sock: socket.socket) -> bytes:
    sock.sendall(b"?")
    return sock.recv(10)


def test_redirect_resets_the_open_connections_and_dials_the_new_upstream(
    tagged: list[str], fault_proxy: OpenProxy
) -> None:
    proxy = fault_proxy(tagged[0])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as old:
        assert _ask(old) == b"a"
        assert proxy.redirect(tagged[1]) == 1
        with pytest.raises(OSError):  # reset at send or receive
            if not _ask(old):
                raise ConnectionResetError
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as new:
        assert _ask(new) == b"b"


def test_as_a_script_it_forwards_until_sigterm(tagged: list[str]) -> None:
    port = free_port()
    target = tagged[0].removeprefix("http://").split(":")[1]  # a bare port: 127.0.0.1
    with subprocess.Popen(
        [sys.executable, str(FAULTPROXY), str(port), target], stdout=subprocess.PIPE
    ) as proc:
        try:
            assert proc.stdout is not None
            assert (
                proc.stdout.readline().decode().startswith(f"faultproxy: http://127.0.0.1:{port}")
            )
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                assert _ask(sock) == b"a"
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=10) == 0
                with pytest.raises(OSError):  # the connection went with it
                    if not _ask(sock):
                        raise ConnectionResetError

            def refused() -> bool:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                except ConnectionRefusedError:
                    return True
                return False

            wait_until(refused, timeout=5, what="the port closed")
        finally:
            if proc.poll() is None:
                proc.kill()
