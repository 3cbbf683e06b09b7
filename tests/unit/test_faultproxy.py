"""The fault proxy does what the fault tests rely on, against a plain echo server."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.faultproxy import FaultProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


@pytest.fixture
def proxy(sockets: list[socket.socket]) -> Iterator[FaultProxy]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with FaultProxy.to(f"http://127.0.0.1:{server.server_address[1]}") as p:
        p.opened = sockets  # type: ignore[attr-defined]
        yield p
    server.shutdown()
    server.server_close()


def _dial(proxy: FaultProxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
    proxy.opened.append(sock)  # type: ignore[attr-defined]
    return sock


def _echo(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        piece = sock.recv(65536)
        if not piece:
            break
        got += piece
    return got


def test_passes_and_cuts_with_a_reset(proxy: FaultProxy) -> None:
    sock = _dial(proxy)
    assert _echo(sock, b"hello") == b"hello"
    assert proxy.cut() == 1
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        for _ in range(50):  # the reset may land on a send or a receive
            sock.sendall(b"x")
            if not sock.recv(10):
                raise ConnectionResetError
            time.sleep(0.01)
    assert _echo(_dial(proxy), b"again") == b"again"  # new connections pass


def test_refuses_new_connections_after_a_cut_for_a_while(proxy: FaultProxy) -> None:
    proxy.cut(refuse_for=2.0)  # generous: a loaded machine may be slow to accept
    with pytest.raises(OSError):  # reset at connect, send or receive: all refusals
        sock = _dial(proxy)
        sock.sendall(b"x")
        if not sock.recv(10):
            raise ConnectionResetError
    time.sleep(2.1)
    assert _echo(_dial(proxy), b"back") == b"back"


def test_blackhole_holds_bytes_and_heal_delivers_them(proxy: FaultProxy) -> None:
    sock = _dial(proxy)
    assert _echo(sock, b"a") == b"a"
    proxy.blackhole()
    sock.sendall(b"held")
    sock.settimeout(0.3)
    with pytest.raises(TimeoutError):
        sock.recv(10)
    fresh = _dial(proxy)  # accepted, never dialed on
    fresh.settimeout(0.3)
    fresh.sendall(b"new")
    with pytest.raises(TimeoutError):
        fresh.recv(10)
    proxy.heal()
    sock.settimeout(2)
    fresh.settimeout(2)
    assert sock.recv(10) == b"held"
    assert fresh.recv(10) == b"new"


def test_drop_after_resets_once_the_budget_is_spent(proxy: FaultProxy) -> None:
    sock = _dial(proxy)
    assert _echo(sock, b"warm") == b"warm"
    proxy.drop_after(10)
    sock.sendall(b"0123456789abcdef")
    got = b""
    with pytest.raises(ConnectionResetError):
        while True:
            piece = sock.recv(100)
            if not piece:
                raise ConnectionResetError
            got += piece
    assert len(got) <= 10


def test_delay_holds_each_chunk(proxy: FaultProxy) -> None:
    sock = _dial(proxy)
    proxy.delay(0.2)
    started = time.monotonic()
    assert _echo(sock, b"slow") == b"slow"
    assert time.monotonic() - started >= 0.35  # held once each way
