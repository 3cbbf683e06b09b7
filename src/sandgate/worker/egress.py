"""The egress gate: the only way out of a sandbox's network namespace (`netns.py`).

Two listeners in the worker process, on ports nftables steers the sandboxes' traffic to:

* **the proxy** takes every TCP connection a sandbox makes, to any address and port. It
  reads where the sandbox meant to go (``SO_ORIGINAL_DST``), and, when the sandbox's policy
  has domain rules, the name the connection is for (TLS SNI or HTTP ``Host``: `core/sniff.py`),
  without answering anything. The tenant's policy judges name and address
  (`core/egress_policy.decide`); a connection let through by a domain is dialed **by that
  name**, resolved by the gate, never at the address the sandbox chose. Every address about
  to be dialed must pass the operator's bounds (`OperatorBounds`: no loopback, private,
  link-local or reserved ranges unless permitted) and must not be one of the host's own. The
  bytes read so far are sent on, then both directions are copied until each side closes.
* **the DNS** answers queries from sandboxes (UDP and TCP): names the policy cannot reach get
  NXDOMAIN, AAAA gets no answer (sandboxes have IPv4 only), the rest are asked of the
  upstream resolver. The answers are a convenience: the proxy decides, not the DNS.

A sandbox is known by the address of its link; an unknown source is cut at once. Every
refused connection and refused name is counted on the sandbox (`GatedSandbox`) and logged
(at most `LOG_BURST` lines per `LOG_WINDOW` per sandbox, then a count of those not logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import dns.asyncquery
import dns.asyncresolver
import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdatatype
import dns.resolver

from sandgate.core import sniff
from sandgate.core.egress_policy import (
    DEFAULT_DENY,
    DEFAULT_SANDBOX_SUBNET,
    NO_NETWORK,
    NetworkPolicy,
    OperatorBounds,
    decide,
    resolves,
)
from sandgate.worker import splice

log = logging.getLogger(__name__)

SO_ORIGINAL_DST = 80  # <linux/netfilter_ipv4.h>
PEEK_TIMEOUT = 3.0  # a connection that sends nothing this long is judged without a name
CONNECT_TIMEOUT = 10.0
DNS_TIMEOUT = 4.0
RECENT_REFUSALS = 20  # kept per sandbox for GET …/network
LOG_WINDOW = 10.0
LOG_BURST = 20
RESOLVER_CACHE = 4096
MAX_CONNECTIONS = 512  # open connections one sandbox may have through the gate (default)
MAX_DNS_IN_FLIGHT = 64  # queries of one sandbox being answered; more are dropped
UNLINK_WAIT = 2.0  # a network turned off waits this long for its connections to be cut
DNS_TCP_IDLE = 10.0  # a DNS-over-TCP connection silent this long is closed
DNS_RECEIVE_BUFFER = 4 << 20  # the DNS socket's: a burst from one sandbox does not drown others
# TCP keepalive and user timeout on both ends of every relayed connection, so a peer that
# vanished is noticed (and its descriptors freed) within a couple of minutes
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 60, 10, 6
USER_TIMEOUT_MS = 120_000


@dataclass(frozen=True)
class EgressConfig:
    """The operator's settings for a worker's gate (`sandgate worker --egress-*`)."""

    deny: tuple[str, ...] = DEFAULT_DENY  # CIDRs no sandbox reaches...
    permit: tuple[str, ...] = ()  # ...except these
    resolver: str = ""  # host[:port] the gate asks; "" = the host's first nameserver
    subnet: str = DEFAULT_SANDBOX_SUBNET  # the sandboxes' links (netns.py)
    max_connections: int = MAX_CONNECTIONS  # open at once per sandbox; more are refused
    half_closed_linger: float = splice.LINGER  # a half-closed connection silent this long goes
    dns_tcp_idle: float = DNS_TCP_IDLE  # a DNS-over-TCP connection silent this long goes

    def upstream(self) -> str:
        return self.resolver or system_resolver()


@dataclass
class Refusal:
    at: float
    target: str
    reason: str


@dataclass
class GatedSandbox:
    name: str
    policy: NetworkPolicy
    address: str = ""  # its link's address while connected
    allowed: int = 0
    open: int = 0  # connections through the gate now (DNS over TCP included)
    dns_in_flight: int = 0
    # the tasks serving its connections: cancelled when its link goes or it is removed
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    refused: int = 0
    dns_refused: int = 0
    recent: deque[Refusal] = field(default_factory=lambda: deque(maxlen=RECENT_REFUSALS))
    _window: float = 0.0
    _logged: int = 0
    _unlogged: int = 0

    def stats(self) -> dict[str, Any]:
        """Its policy and counters, as `GET …/network` shows them."""
        return {
            "network": self.policy.to_json(),
            "allowed": self.allowed,
            "open": self.open,
            "refused": self.refused,
            "dns_refused": self.dns_refused,
            "recent_refusals": [asdict(r) for r in self.recent],
        }

    @contextlib.contextmanager
    def holding(self, task: asyncio.Task[None]) -> Iterator[None]:
        """One of its open connections while `task` serves it (cancelled with its link)."""
        self.open += 1
        self.tasks.add(task)
        try:
            yield
        finally:
            self.open -= 1
            self.tasks.discard(task)

    def note_refusal(self, target: str, reason: str, *, dns_query: bool = False) -> None:
        now = time.time()
        if dns_query:
            self.dns_refused += 1
        else:
            self.refused += 1
        self.recent.append(Refusal(now, target, reason))
        if now - self._window >= LOG_WINDOW:
            if self._unlogged:
                log.warning(
                    "egress.refusals_not_logged",
                    extra={"sandbox": self.name, "count": self._unlogged},
                )
            self._window, self._logged, self._unlogged = now, 0, 0
        if self._logged < LOG_BURST:
            self._logged += 1
            log.info(
                "egress.refused",
                extra={"sandbox": self.name, "target": target, "reason": reason, "dns": dns_query},
            )
        else:
            self._unlogged += 1


def _parse_host_port(value: str, default_port: int) -> tuple[str, int]:
    host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    return (host or value), int(port) if port else default_port


def system_resolver() -> str:
    """The host's first nameserver (/etc/resolv.conf, as dnspython reads it), the gate's
    default upstream; 127.0.0.1 when it names none."""
    try:
        return str(dns.resolver.Resolver().nameservers[0])
    except (dns.resolver.NoResolverConfiguration, OSError, IndexError):
        return "127.0.0.1"


def is_host_address(address: ipaddress.IPv4Address) -> bool:
    """Whether `address` is one of this host's own (binding to it succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


class EgressGate:
    def __init__(self, config: EgressConfig) -> None:
        self.config = config
        self.bounds = OperatorBounds.of(config.deny, config.permit)
        self.upstream = _parse_host_port(config.upstream(), 53)
        self.sandbox_subnet = ipaddress.IPv4Network(config.subnet)
        self._resolver = dns.asyncresolver.Resolver(configure=False)
        self._resolver.nameservers = [self.upstream[0]]
        self._resolver.port = self.upstream[1]
        self._resolver.cache = dns.resolver.LRUCache(RESOLVER_CACHE)
        # sandbox name -> what the gate knows of it; its link's address -> the same, while linked
        self.sandboxes: dict[str, GatedSandbox] = {}
        self.by_address: dict[str, GatedSandbox] = {}
        self._servers: list[asyncio.AbstractServer] = []  # the DNS over TCP
        self._listener: socket.socket | None = None  # the proxy's, accepted by _accepting
        self._accepting: asyncio.Task[None] | None = None
        self._udp: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.gate_port = 0
        self.dns_port = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", 0))
        listener.listen(1024)
        listener.setblocking(False)
        self._listener = listener
        self.gate_port = listener.getsockname()[1]
        self._accepting = asyncio.ensure_future(self._accept(listener))
        # the DNS listens on one port number for UDP and TCP
        for _ in range(20):
            loop = asyncio.get_running_loop()
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            with contextlib.suppress(OSError):
                udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, DNS_RECEIVE_BUFFER)
            udp.bind(("0.0.0.0", 0))
            transport, _protocol = await loop.create_datagram_endpoint(
                lambda: _DnsDatagrams(self), sock=udp
            )
            port = transport.get_extra_info("sockname")[1]
            try:
                tcp = await asyncio.start_server(self._dns_stream, "0.0.0.0", port)
            except OSError:
                transport.close()
                continue
            self._udp, self.dns_port = transport, port
            self._servers.append(tcp)
            break
        else:
            raise OSError("no port free for the gate's DNS on both UDP and TCP")
        log.info(
            "egress.started",
            extra={
                "proxy_port": self.gate_port,
                "dns_port": self.dns_port,
                "upstream": self.upstream,
            },
        )

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._accepting
        if self._listener is not None:
            self._listener.close()
        for server in self._servers:
            server.close()
        if self._udp is not None:
            self._udp.close()
        for task in list(self._tasks):
            task.cancel()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers.clear()

    # ------------------------------------------------------------------ sandboxes

    def add(self, name: str, policy: NetworkPolicy) -> GatedSandbox:
        entry = self.sandboxes.get(name)
        if entry is None:
            entry = self.sandboxes[name] = GatedSandbox(name, policy)
        entry.policy = policy
        return entry

    def link(self, name: str, address: str) -> None:
        """The sandbox's link address; "" when its link goes (its connections are cut)."""
        entry = self.sandboxes[name]
        if entry.address:
            self.by_address.pop(entry.address, None)
            _cancel(entry.tasks)
        entry.address = address
        if address:
            self.by_address[address] = entry

    async def unlink(self, name: str) -> None:
        """The sandbox's link goes: its connections are cut first (so their ends inside it
        still hear of it), then its address is forgotten."""
        entry = self.sandboxes[name]
        tasks = list(entry.tasks)
        self.link(name, "")
        if tasks:
            await asyncio.wait(tasks, timeout=UNLINK_WAIT)

    def remove(self, name: str) -> None:
        entry = self.sandboxes.pop(name, None)
        if entry is not None:
            if entry.address:
                self.by_address.pop(entry.address, None)
            _cancel(entry.tasks)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ the proxy

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(listener)
            except OSError as exc:  # out of descriptors, say: the sandboxes' connections wait
                log.warning("egress.accept_failed", extra={"error": str(exc)})
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            _keep_alive(conn)
            self._spawn(self._proxy(conn, peer[0]))

    def _admit(self, peer: str) -> GatedSandbox | None:
        """The sandbox a new connection from `peer` is of, if it may have one more."""
        entry = self.by_address.get(peer)
        if entry is None:
            return None
        most = self.config.max_connections
        if entry.open >= most:
            entry.note_refusal(peer, f"more than {most} connections open")
            return None
        return entry

    async def _proxy(self, conn: socket.socket, peer: str) -> None:
        upstream: socket.socket | None = None
        entry = self._admit(peer)
        task = asyncio.current_task()
        try:
            if entry is None or task is None:
                return
            with entry.holding(task):
                upstream = await self._serve(entry, conn)
        except OSError:
            pass
        finally:
            conn.close()
            if upstream is not None:
                upstream.close()

    async def _serve(self, entry: GatedSandbox, conn: socket.socket) -> socket.socket | None:
        """Judge one connection and relay it; returns the upstream it dialed (to close)."""
        upstream: socket.socket | None = None
        try:
            raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
            port = struct.unpack_from("!H", raw, 2)[0]
            address = ipaddress.IPv4Address(raw[4:8])
            target = f"{address}:{port}"
            policy = entry.policy
            first, name = b"", None
            if policy.enabled and policy.uses_names:
                first, name = await _peek(conn)
                if name is not None:
                    target = f"{name}:{port} ({address})"
                elif policy.deny_out.domains and sniff.claims_a_name(first):
                    # TLS or HTTP whose name cannot be read: under a blocklist of domains it
                    # might be one of them
                    entry.note_refusal(target, "its TLS or HTTP name cannot be read")
                    return None
            verdict = decide(policy, name=name, address=address)
            if not verdict.allowed:
                entry.note_refusal(target, verdict.reason)
                return None
            if verdict.dial_name is not None:
                try:
                    candidates = await self._resolve(verdict.dial_name)
                except (dns.exception.DNSException, OSError) as exc:
                    entry.note_refusal(target, f"{verdict.dial_name} does not resolve: {exc}")
                    return None
            else:
                candidates = [address]
            dialable = [a for a in candidates if self._reachable(a)]
            if not dialable:
                entry.note_refusal(target, "the operator does not let sandboxes reach that address")
                return None
            upstream = await _dial(dialable, port)
            if upstream is None:
                return None  # nothing answered: the sandbox sees its connection closed
            entry.allowed += 1
            if first:
                await asyncio.get_running_loop().sock_sendall(upstream, first)
            await splice.relay(conn, upstream, linger=self.config.half_closed_linger)
        except BaseException:
            if upstream is not None:
                upstream.close()
            raise
        return upstream

    def _reachable(self, address: ipaddress.IPv4Address) -> bool:
        if address in self.sandbox_subnet or address.is_loopback or address.is_unspecified:
            return False  # never another sandbox or the host, whatever the operator permits
        return self.bounds.permits(address) and not is_host_address(address)

    async def _resolve(self, name: str) -> list[ipaddress.IPv4Address]:
        answer = await self._resolver.resolve(name, "A", lifetime=DNS_TIMEOUT)
        return [ipaddress.IPv4Address(r.address) for r in answer]

    # ------------------------------------------------------------------ the DNS

    def dns_admits(self, source: str) -> GatedSandbox | None:
        """The sandbox a query from `source` is of, if it may have one more in flight."""
        entry = self.by_address.get(source)
        if entry is None or entry.dns_in_flight >= MAX_DNS_IN_FLIGHT:
            return None
        return entry

    async def answer(self, query_wire: bytes, source: str, *, max_size: int) -> bytes | None:
        """The reply to one query from `source` (None: not a sandbox of ours, too many of
        its queries in flight, or not a query at all)."""
        entry = self.dns_admits(source)
        if entry is None:
            return None
        entry.dns_in_flight += 1
        try:
            return await self._answer(entry, query_wire, max_size=max_size)
        except Exception:  # anything a hostile packet provokes: no answer, no traceback
            return None
        finally:
            entry.dns_in_flight -= 1

    async def _answer(
        self, entry: GatedSandbox, query_wire: bytes, *, max_size: int
    ) -> bytes | None:
        query = dns.message.from_wire(query_wire)  # garbage raises: answer() drops it
        if query.flags & dns.flags.QR or query.opcode() != dns.opcode.QUERY:
            return None  # a response, or not a query: nothing to answer
        if len(query.question) != 1:
            reply = dns.message.make_response(query)
            reply.set_rcode(dns.rcode.FORMERR)
            return reply.to_wire()
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True)
        if not resolves(entry.policy, name):
            entry.note_refusal(
                name, "the sandbox's policy does not reach this name", dns_query=True
            )
            reply = dns.message.make_response(query)
            reply.set_rcode(dns.rcode.NXDOMAIN)
            return reply.to_wire()
        if question.rdtype == dns.rdatatype.AAAA:
            return dns.message.make_response(query).to_wire()  # IPv4 only: no data
        try:
            reply, _ = await dns.asyncquery.udp_with_fallback(
                query, self.upstream[0], timeout=DNS_TIMEOUT, port=self.upstream[1]
            )
        except (dns.exception.DNSException, OSError):
            reply = dns.message.make_response(query)
            reply.set_rcode(dns.rcode.SERVFAIL)
        try:
            return reply.to_wire(max_size=max_size)
        except dns.exception.TooBig:
            cut = dns.message.make_response(query)
            cut.flags |= dns.flags.TC
            return cut.to_wire()

    async def _dns_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        entry = self._admit(peer[0]) if peer else None
        task = asyncio.current_task()
        if entry is None or task is None:
            writer.close()
            return
        idle = self.config.dns_tcp_idle
        try:
            with entry.holding(task):  # counted with its connections through the proxy
                while True:
                    head = await asyncio.wait_for(reader.readexactly(2), idle)
                    size = int.from_bytes(head, "big")
                    query = await asyncio.wait_for(reader.readexactly(size), idle)
                    reply = await self.answer(query, peer[0], max_size=65535)
                    if reply is None:
                        return
                    writer.write(len(reply).to_bytes(2, "big") + reply)
                    await asyncio.wait_for(writer.drain(), idle)
        except (OSError, asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    def stats(self, name: str) -> dict[str, Any]:
        entry = self.sandboxes.get(name)
        return GatedSandbox(name, NO_NETWORK).stats() if entry is None else entry.stats()


class _DnsDatagrams(asyncio.DatagramProtocol):
    def __init__(self, gate: EgressGate) -> None:
        self.gate = gate
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        if self.gate.dns_admits(str(addr[0])) is not None:  # else dropped before any task
            self.gate._spawn(self._reply(data, addr))

    async def _reply(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        reply = await self.gate.answer(data, str(addr[0]), max_size=1232)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


def _cancel(tasks: set[asyncio.Task[None]]) -> None:
    for task in list(tasks):
        task.cancel()


def _keep_alive(sock: socket.socket) -> None:
    """Probe an idle peer, and give up on unacknowledged data, within about two minutes."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)


async def _peek(conn: socket.socket) -> tuple[bytes, str | None]:
    """The first bytes of a connection and the name they carry (None: none, or silence)."""
    loop = asyncio.get_running_loop()
    data = b""
    deadline = loop.time() + PEEK_TIMEOUT
    while len(data) < sniff.MAX_PEEK:
        left = deadline - loop.time()
        if left <= 0:
            return data, None
        try:
            more = await asyncio.wait_for(loop.sock_recv(conn, sniff.MAX_PEEK - len(data)), left)
        except TimeoutError:
            return data, None
        if not more:
            return data, None
        data += more
        name = sniff.server_name(data)
        if name != sniff.NEED_MORE:
            return data, name
    return data, None


async def _dial(addresses: list[ipaddress.IPv4Address], port: int) -> socket.socket | None:
    """A connection to the first of `addresses` that answers, or None."""
    loop = asyncio.get_running_loop()
    for address in addresses:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        _keep_alive(sock)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, (str(address), port)), CONNECT_TIMEOUT)
        except (OSError, TimeoutError):
            sock.close()
            continue
        return sock
    return None
