"""The worker's nftables table against the rest of the host, with the kernel's real rules.

A worker's table outlives it when the worker is killed. Its rules must never touch traffic
that is not its sandboxes': a program on the host whose connection happens to get one of the
gate's old port numbers as its own port must still get its replies (they used to be dropped:
the gate's DNS and dials then timed out at random, one in a few hundred connections on a host
where killed workers had left tables), while a new connection to a gate's port from outside
stays refused."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.query
import pytest

from sandgate.worker.netns import NetHost, interface_prefix, ruleset, table_name
from tests.nethosts import Internet

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("nft") is None or shutil.which("ip") is None,
        reason="needs root, nftables and iproute2",
    ),
]


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def dead_workers_table() -> Iterator[tuple[int, int]]:
    """The table a killed worker left: its gate's TCP port and its DNS port."""
    scope = f"dead-{secrets.token_hex(3)}"
    gate_port, dns_port = free_port(socket.SOCK_STREAM), free_port(socket.SOCK_DGRAM)
    rules = ruleset(
        table_name(scope), interface_prefix(scope), gate_port=gate_port, dns_port=dns_port
    )
    subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)
    try:
        yield gate_port, dns_port
    finally:
        subprocess.run(["nft", "delete", "table", "inet", table_name(scope)], check=False)


def test_the_hosts_own_connections_from_those_ports_get_their_replies(
    internet: Internet, dead_workers_table: tuple[int, int]
) -> None:
    gate_port, dns_port = dead_workers_table
    allowed = internet.addresses["allowed.test"]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind(("0.0.0.0", gate_port))
        tcp.settimeout(3)
        tcp.connect((allowed, 80))  # the SYN-ACK arrives on the nethosts link, dport gate_port
        tcp.sendall(b"GET / HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
        assert tcp.recv(100).startswith(b"HTTP/1.1 200")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("0.0.0.0", dns_port))
        host, _, port = internet.resolver.partition(":")
        query = dns.message.make_query("allowed.test", "A")
        reply = dns.query.udp(query, host, timeout=3, port=int(port), sock=udp)
        assert reply.answer[0][0].address == allowed


def test_a_new_connection_to_a_gate_port_from_outside_stays_refused(
    internet: Internet, dead_workers_table: tuple[int, int]
) -> None:
    gate_port, _ = dead_workers_table
    host_side = internet.subnet.replace(".0/24", ".1")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("0.0.0.0", gate_port))
        listener.listen()
        dial = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(({host_side!r}, {gate_port}), timeout=2)\n"
            "    print('open')\n"
            "except OSError as e:\n"
            "    print(type(e).__name__)\n"
        )
        ran = subprocess.run(
            ["ip", "netns", "exec", internet.netns, sys.executable, "-c", dial],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert ran.stdout.strip() == "TimeoutError", ran.stdout + ran.stderr
        # the same port from the host's loopback is not the rule's business
        with contextlib.closing(socket.create_connection(("127.0.0.1", gate_port), 2)):
            pass


def test_a_namespace_whose_making_is_cancelled_leaves_no_descriptor(tmp_path: Path) -> None:
    # a worker closing its spare maker cancels a create while the thread is still making
    # the namespace: what the thread makes is closed, not left to the garbage collector
    async def cancel_creates() -> None:
        net = NetHost(f"t-cancel-{secrets.token_hex(3)}", slot_lock_dir=tmp_path / "slots")
        for _ in range(20):
            making = asyncio.ensure_future(net.create())
            await asyncio.sleep(0)  # the thread has started, the caller goes away
            making.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                made = await making
                await net.remove(made)

    before = len(os.listdir("/proc/self/fd"))
    asyncio.run(cancel_creates())
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
