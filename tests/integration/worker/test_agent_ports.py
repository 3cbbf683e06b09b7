"""The agent's port connections (agent/ports.py), spoken to over its pipes, against real
servers on this host's loopback (the agent runs here as a plain subprocess)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.worker.test_agent import Agent


class Server:
    """A loopback TCP server whose connections a test drives by hand."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.port = int(self.sock.getsockname()[1])
        self.accepted: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def nth(self, n: int, timeout: float = 5.0) -> socket.socket:
        deadline = time.monotonic() + timeout
        while len(self.accepted) <= n:
            assert time.monotonic() < deadline, "the agent never connected"
            time.sleep(0.01)
        return self.accepted[n]

    def close(self) -> None:
        # shutdown wakes the accept (close alone does not), and the join makes sure no
        # connection accepted meanwhile is left open (a ResourceWarning in a later test)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=5)
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    client = Agent(tmp_path)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def server() -> Iterator[Server]:
    listening = Server()
    try:
        yield listening
    finally:
        listening.close()


def test_write_read_half_close_and_close(agent: Agent, server: Server) -> None:
    opened = agent.ok("port_open", b"first", port=server.port)
    conn = opened["conn"]
    peer = server.nth(0)
    assert peer.recv(100) == b"first"
    assert agent.ok("port_write", b"second", conn=conn)["written"] == 6
    assert peer.recv(100) == b"second"

    header, body = agent.call("port_read", conn=conn, wait=0)
    assert (header["eof"], body) == (False, b"")  # nothing yet: answered at once
    peer.sendall(b"answer")
    header, body = agent.call("port_read", conn=conn, wait=5)
    assert (header["eof"], body) == (False, b"answer")

    agent.ok("port_shutdown", conn=conn)  # the server reads its end; we still read
    assert peer.recv(100) == b""
    assert agent.error("port_write", b"late", conn=conn) == "connection_closed"
    peer.sendall(b"after")
    peer.close()
    header, body = agent.call("port_read", conn=conn, wait=5, linger=0.5)
    assert (header["eof"], body) == (True, b"after")  # linger: the end in the same answer
    agent.ok("port_close", conn=conn)
    assert agent.error("port_read", conn=conn, wait=0) == "not_found"


def test_an_open_that_reads_its_answer(agent: Agent, server: Server) -> None:
    def respond() -> None:
        peer = server.nth(0)
        assert peer.recv(100) == b"ping"
        peer.sendall(b"pong")
        peer.close()

    threading.Thread(target=respond, daemon=True).start()
    header, body = agent.call("port_open", b"ping", port=server.port, wait=5, linger=0.5)
    assert header["ok"] and header["eof"] is True and body == b"pong"


def test_a_read_waits_and_a_close_ends_it(agent: Agent, server: Server) -> None:
    conn = agent.ok("port_open", port=server.port)["conn"]
    started = time.monotonic()
    reading = agent.send("port_read", conn=conn, wait=10)
    agent.send("port_close", conn=conn)
    answers = {}
    for _ in range(2):
        header, _body = agent.recv()
        answers[header["id"]] = header
    assert answers[reading]["ok"] and answers[reading]["eof"] is True
    assert time.monotonic() - started < 5


def test_nothing_listening_and_bad_requests(agent: Agent) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    header, _ = agent.call("port_open", port=free)
    assert header["error"]["code"] == "port_not_listening"
    assert f"port {free}" in header["error"]["message"]
    for port in (0, 65536, -1, "80", True, None):
        assert agent.error("port_open", port=port) == "invalid_request"
    assert agent.error("port_open", port=80, wait=31) == "invalid_request"
    assert agent.error("port_read", conn="x", wait=0) == "invalid_request"
    assert agent.error("port_read", conn=99, wait=0) == "not_found"
    assert agent.error("port_close", conn=99) == "not_found"


def test_one_read_at_a_time(agent: Agent, server: Server) -> None:
    conn = agent.ok("port_open", port=server.port)["conn"]
    first = agent.send("port_read", conn=conn, wait=5)
    second = agent.send("port_read", conn=conn, wait=5)
    header, _ = agent.recv()
    assert header["id"] == second and header["error"]["code"] == "conflict"
    server.nth(0).sendall(b"x")
    header, body = agent.recv()
    assert header["id"] == first and body == b"x"


def test_idle_connections_are_closed(agent: Agent, server: Server) -> None:
    conn = agent.ok("port_open", port=server.port, idle=1)["conn"]
    peer = server.nth(0)
    peer.settimeout(5)
    assert peer.recv(10) == b""  # closed by the agent after a second unused
    assert agent.error("port_read", conn=conn, wait=0) == "not_found"
    assert "idle, closed" in agent.stderr()


def test_connections_are_capped(agent: Agent, server: Server) -> None:
    MAX = 256  # agent/ports.py MAX_CONNECTIONS
    conns = [agent.ok("port_open", port=server.port)["conn"] for _ in range(MAX)]
    header, _ = agent.call("port_open", port=server.port)
    assert header["error"]["code"] == "limit_exceeded"
    assert "256" in header["error"]["message"]
    agent.ok("port_close", conn=conns[0])
    agent.ok("port_open", port=server.port)  # room again


def test_one_thread_serves_every_connection(agent: Agent, server: Server) -> None:
    """Reads waiting on 50 connections hold no thread each (threads count against the
    sandbox's pids limit)."""
    conns = [agent.ok("port_open", port=server.port)["conn"] for _ in range(50)]
    for conn in conns:
        agent.send("port_read", conn=conn, wait=10)
    time.sleep(0.3)
    threads = len(list(Path(f"/proc/{agent.proc.pid}/task").iterdir()))
    assert threads < 10, threads
    for n in range(50):
        server.nth(n).close()
    for _ in conns:
        header, _body = agent.recv()
        assert header["eof"] is True


def test_the_agent_exit_closes_its_connections(tmp_path: Path, server: Server) -> None:
    client = Agent(tmp_path)
    client.ok("port_open", port=server.port)
    peer = server.nth(0)
    assert client.close() == 0
    peer.settimeout(5)
    assert peer.recv(10) == b""
