"""Each sandbox's network namespace, and its one link to this worker's egress gate.

Every bwrap sandbox of a worker that can (root, nftables) runs in a network namespace the
worker made in-process (`nsthread.py`) and holds by a descriptor only: the namespace has no
name in ``/run/netns`` (a name is a mount in the host's table, which every sandbox start
copies), and it ends with the descriptor, so a killed worker leaves none. It holds only ``lo``
while the sandbox's network is off. Turned on (at create or by ``PUT …/network``), the
namespace gets one veth pair, a /30 of `subnet`: the sandbox's end ``eth0`` with a default
route to the host's end. On the host, this worker's nftables table
(``inet sandgate_<scope>``) takes over everything that arrives from its interfaces:

* UDP and TCP to port 53 (any address) go to the gate's DNS (`egress.py`);
* every other TCP connection (any address, any port) goes to the gate's proxy port;
* whatever else arrives (UDP, ICMP, IPv6, a packet with another source address) is dropped,
  and nothing from or to these interfaces is ever forwarded;
* a new connection to the gate's ports from any other interface but ``lo`` is dropped; only
  new ones: a reply to the host's own connection from such a port number passes (a table left
  by a killed worker once dropped the replies of whatever on the host drew that port);
* each sandbox may open `NEW_FLOWS_PER_S` new flows a second and hold `TRACKED_FLOWS` in the
  host's connection tracking, and send `DNS_PACKETS_PER_S` DNS packets a second: more are
  dropped before they are tracked, so one sandbox cannot fill the host's conntrack table.

So a sandbox has no route to the host's loopback services, to another sandbox or to any
network: its packets end on the host's side of its own link, where only the gate listens.
The host's ``ip_forward`` is not touched, and no NAT is set up. The sandbox's user namespace
holds no capability over the namespace (the worker, root in the host's user namespace, owns
it), so it cannot change its address, routes or link.

A host-side interface is named ``sg`` + 6 hex of the worker's scope + its slot in hex, so one
worker's rules match only its own links (``iifname "sgXXXXXX*"``).
Slots (the /30 a link gets) are leased host-wide with lock files, as uids are (`uids.py`):
several workers on one host never hand out the same addresses.

Links, addresses and routes are set over netlink (pyroute2), from the worker's namespace and
through a netlink socket made inside the sandbox's: no `ip` process is spawned. Making a
namespace (~3 ms) and its link (~10 ms) is still kernel work, so the worker keeps `SPARES`
of each kind ready (`take`), made in the background; a start takes one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import ipaddress
import logging
import os
import re
import shutil
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

from sandgate.core.egress_policy import DEFAULT_SANDBOX_SUBNET
from sandgate.errors import WorkerError
from sandgate.worker import nsthread
from sandgate.worker.uids import UidLease, UidPool

log = logging.getLogger(__name__)
T = TypeVar("T")

_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)

DEFAULT_SLOT_LOCK_DIR = Path("/run/sandgate/netslots")
NETNS_DIR = Path("/run/netns")
SANDBOX_IF = "eth0"
LOOPBACK_INDEX = 1  # `lo` is the first link of every network namespace
IP_TIMEOUT = 10.0
SLOT_BASE = 1000  # UidPool numbers from here
SPARES = 2  # namespaces of each kind (with a link, without) kept ready
# what one sandbox may cost the host's connection tracking (its table is shared by everything
# in the host's namespace, the API server and the database included): new flows per second,
# flows tracked at once, and DNS packets per second; more are dropped before they are tracked
NEW_FLOWS_PER_S, NEW_FLOWS_BURST = 200, 400
TRACKED_FLOWS = 4096
DNS_PACKETS_PER_S, DNS_PACKETS_BURST = 500, 1000
SPARE_RETRY = 5.0  # after a spare could not be made
SPARE_DELAY = 0.5  # a spare is made this long after one was taken: not during that start


@dataclass
class SandboxNet:
    """One sandbox's namespace, and its link while its network is on."""

    fd: int  # the worker's descriptor of the namespace: it has no name, this keeps it alive
    slot: UidLease | None = None  # held while the link exists
    ifname: str = ""
    host_ip: str = ""
    sandbox_ip: str = ""
    connected: bool = False

    @property
    def path(self) -> Path:
        """A path that opens the namespace (for the chain's nsenter)."""
        return Path(f"/proc/{os.getpid()}/fd/{self.fd}")


def interface_prefix(scope: str) -> str:
    return "sg" + hashlib.sha256(scope.encode()).hexdigest()[:6]


def table_name(scope: str) -> str:
    return "sandgate_" + scope.replace("-", "_")


def ruleset(table: str, prefix: str, *, gate_port: int, dns_port: int) -> str:
    """This worker's nftables table (see the module docstring); replaces any older one."""
    ours = f'iifname "{prefix}*"'
    new_flows = f"limit rate over {NEW_FLOWS_PER_S}/second burst {NEW_FLOWS_BURST} packets"
    dns_packets = f"limit rate over {DNS_PACKETS_PER_S}/second burst {DNS_PACKETS_BURST} packets"
    tracked = f"ct count over {TRACKED_FLOWS}"
    return f"""
table inet {table}
delete table inet {table}
table inet {table} {{
  chain guard {{
    type filter hook prerouting priority raw; policy accept;
    {ours} fib saddr . iif oif missing drop
    {ours} meta nfproto ipv6 drop
  }}
  chain flows {{
    type filter hook prerouting priority mangle; policy accept;
    {ours} ct state new meter {table}_rate {{ ip saddr {new_flows} }} counter drop
    {ours} ct state new meter {table}_count {{ ip saddr {tracked} }} counter drop
    {ours} udp dport 53 meter {table}_dns {{ ip saddr {dns_packets} }} counter drop
  }}
  chain steer {{
    type nat hook prerouting priority dstnat; policy accept;
    {ours} udp dport 53 redirect to :{dns_port}
    {ours} tcp dport 53 redirect to :{dns_port}
    {ours} meta l4proto tcp redirect to :{gate_port}
  }}
  chain arrive {{
    type filter hook input priority filter; policy accept;
    {ours} tcp dport {{ {gate_port}, {dns_port} }} accept
    {ours} udp dport {dns_port} accept
    {ours} counter drop
    iifname != "lo" ct state new tcp dport {{ {gate_port}, {dns_port} }} drop
    iifname != "lo" ct state new udp dport {dns_port} drop
  }}
  chain through {{
    type filter hook forward priority filter; policy accept;
    {ours} drop
    oifname "{prefix}*" drop
  }}
}}
"""


def available() -> str | None:
    """Why this host cannot give sandboxes a gated network, or None if it can."""
    if os.geteuid() != 0:
        return "the worker does not run as root"
    missing = [tool for tool in ("nft", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (apt-get install -y nftables util-linux)"
    return None


async def _run(*argv: str, stdin: str | None = None, check: bool = True) -> str:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    try:
        out, err = await asyncio.wait_for(
            process.communicate(None if stdin is None else stdin.encode()), IP_TIMEOUT
        )
    except TimeoutError:
        process.kill()
        await process.wait()
        raise WorkerError(f"{argv[0]} {' '.join(argv[1:3])} did not finish") from None
    if check and process.returncode != 0:
        text = err.decode(errors="replace").strip() or out.decode(errors="replace").strip()
        raise WorkerError(f"{' '.join(argv[:3])} failed: {text}")
    return out.decode(errors="replace")


@contextlib.asynccontextmanager
async def _netlink(what: str) -> AsyncIterator[None]:
    """A netlink or namespace failure as the worker's error, saying what was being done."""
    try:
        yield
    except NetlinkError as exc:
        raise WorkerError(f"{what} failed: {os.strerror(exc.code)}") from exc
    except OSError as exc:
        raise WorkerError(f"{what} failed: {exc.strerror or exc}") from exc


class NetHost:
    """This worker's namespaces, links and nftables table."""

    def __init__(
        self,
        scope: str,
        *,
        subnet: str = DEFAULT_SANDBOX_SUBNET,
        slot_lock_dir: Path = DEFAULT_SLOT_LOCK_DIR,
    ) -> None:
        self.scope = scope
        self.subnet = ipaddress.IPv4Network(subnet)
        if self.subnet.prefixlen > 29:
            raise ValueError(f"sandbox subnet {subnet} is too small: give a /29 or larger")
        self.prefix = interface_prefix(scope)
        self.table = table_name(scope)
        # a slot is leased as a "uid" of the lock-file pool uids.py keeps, offset by SLOT_BASE
        self.slots = UidPool(slot_lock_dir, SLOT_BASE, min(self.subnet.num_addresses // 4, 0xFFFF))
        self._nft = shutil.which("nft") or "/usr/sbin/nft"
        self._host: AsyncIPRoute | None = None  # netlink in the worker's own namespace
        # connected or not -> namespaces made ahead for the next starts; their filler
        self.spares: dict[bool, list[SandboxNet]] = {False: [], True: []}
        self._wanted: asyncio.Event | None = None
        self._filler: asyncio.Task[None] | None = None

    @property
    def resolver_address(self) -> str:
        """What a sandbox's resolv.conf names: any address works (all port 53 goes to the
        gate's DNS), this one is the subnet's first host."""
        return str(self.subnet.network_address + 1)

    @property
    def host(self) -> AsyncIPRoute:
        if self._host is None:
            self._host = AsyncIPRoute()
        return self._host

    async def prepare(self, *, gate_port: int, dns_port: int) -> None:
        self.slots.ensure_dir()
        await self.remove_leftovers()
        rules = ruleset(self.table, self.prefix, gate_port=gate_port, dns_port=dns_port)
        await _run(self._nft, "-f", "-", stdin=rules)

    async def remove_leftovers(self) -> None:
        """Links a crashed worker of this scope left behind (its namespaces have no name: they
        ended with its descriptors), and the named namespaces of a worker of an earlier
        version."""
        mine = re.compile(f"^sandgate-{re.escape(self.scope)}-[0-9a-f]{{10}}$")
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(NETNS_DIR):
                if mine.match(name):
                    log.warning("netns.leftover_removed", extra={"netns": name})
                    _unname(NETNS_DIR / name)
        async with _netlink("listing this worker's links"):
            links = [link async for link in await self.host.get_links()]
        for link in links:
            if str(link.get("ifname", "")).startswith(self.prefix):
                with contextlib.suppress(NetlinkError):
                    await self.host.link("del", index=link["index"])

    async def close(self) -> None:
        if self._filler is not None:
            self._filler.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._filler
            self._filler = None
        for kind in self.spares.values():
            while kind:
                await self.remove(kind.pop())
        # and whatever a start or a spare cut short by cancellation made without a record
        with contextlib.suppress(WorkerError):
            await self.remove_leftovers()
        await _run(self._nft, "delete", "table", "inet", self.table, check=False)
        if self._host is not None:
            self._host.close()
            self._host = None

    async def take(self, *, connected: bool) -> SandboxNet:
        """A namespace for a starting sandbox: a spare if one is ready, else made now."""
        ready = self.spares[connected]
        net = ready.pop() if ready else await self._make(connected)
        if self._filler is None or self._filler.done():
            self._wanted = asyncio.Event()
            self._filler = asyncio.ensure_future(self._fill())
        assert self._wanted is not None
        self._wanted.set()
        return net

    async def _make(self, connected: bool) -> SandboxNet:
        net = await self.create()
        if connected:
            try:
                await self.connect(net)
            except BaseException:
                await self.remove(net)
                raise
        return net

    async def _fill(self) -> None:
        assert self._wanted is not None
        while True:
            self._wanted.clear()
            await asyncio.sleep(SPARE_DELAY)
            for connected, ready in self.spares.items():
                while len(ready) < SPARES:
                    try:
                        ready.append(await self._make(connected))
                    except WorkerError as exc:
                        log.warning("netns.spare_failed", extra={"error": exc.message})
                        await asyncio.sleep(SPARE_RETRY)
            await self._wanted.wait()

    async def create(self) -> SandboxNet:
        """A namespace with loopback only, held by a descriptor and by no name."""
        async with _netlink("making a network namespace"):
            fd, sock = await _finished(nsthread.new_namespace, _close_namespace)
        net = SandboxNet(fd=fd)
        try:
            async with _netlink("bringing the namespace's lo up"):
                with _inside(sock) as inside:
                    await inside.link("set", index=LOOPBACK_INDEX, state="up")
        except BaseException:
            await self.remove(net)
            raise
        return net

    async def connect(self, net: SandboxNet) -> None:
        """Give the namespace its link to the gate (idempotent)."""
        if net.connected:
            return
        lease = self.slots.lease()
        slot = lease.uid - SLOT_BASE
        base = self.subnet.network_address + 4 * slot
        net.slot, net.ifname = lease, f"{self.prefix}{slot:x}"
        net.host_ip, net.sandbox_ip = str(base + 1), str(base + 2)
        try:
            async with _netlink(f"making the link {net.ifname}"):
                await self._delete_link(net.ifname)  # a stale one: its namespace is ending
                peer = {"ifname": SANDBOX_IF, "net_ns_fd": net.fd}
                await self.host.link("add", ifname=net.ifname, kind="veth", peer=peer)
                (index,) = await self.host.link_lookup(ifname=net.ifname)
                await self.host.addr("add", index=index, address=net.host_ip, prefixlen=30)
                _disable_ipv6(net.ifname)
                await self.host.link("set", index=index, state="up")
            async with _netlink(f"configuring {SANDBOX_IF} in the namespace"):
                fd = net.fd
                sock = await _finished(lambda: nsthread.route_socket_in(fd), socket.socket.close)
                with _inside(sock) as inside:
                    (eth,) = await inside.link_lookup(ifname=SANDBOX_IF)
                    await inside.addr("add", index=eth, address=net.sandbox_ip, prefixlen=30)
                    await inside.link("set", index=eth, state="up")
                    await inside.route("add", dst="0.0.0.0/0", gateway=net.host_ip)
        except BaseException:
            await self.disconnect(net)
            raise
        net.connected = True

    async def _delete_link(self, ifname: str) -> None:
        """Delete the host's link `ifname` if there is one (its peer goes with it)."""
        for index in await self.host.link_lookup(ifname=ifname):
            with contextlib.suppress(NetlinkError):  # gone meanwhile
                await self.host.link("del", index=index)

    async def disconnect(self, net: SandboxNet) -> None:
        """Take the link away: the namespace keeps loopback only."""
        if net.ifname:
            with contextlib.suppress(WorkerError):
                async with _netlink(f"deleting the link {net.ifname}"):
                    await self._delete_link(net.ifname)
        if net.slot is not None:
            net.slot.release()
        net.slot, net.ifname, net.host_ip, net.sandbox_ip = None, "", "", ""
        net.connected = False

    async def remove(self, net: SandboxNet) -> None:
        """End the namespace: its link, then its last descriptor (it has no name)."""
        await self.disconnect(net)
        if net.fd >= 0:
            fd, net.fd = net.fd, -1
            os.close(fd)


async def _finished(work: Callable[[], T], undo: Callable[[T], object]) -> T:
    """`work` on a thread; if the caller is cancelled meanwhile (a worker closing its spare
    maker), what the thread still makes is undone, not left to the garbage collector."""
    running = asyncio.ensure_future(asyncio.to_thread(work))
    try:
        return await asyncio.shield(running)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            undo(await running)
        raise


def _close_namespace(made: tuple[int, socket.socket]) -> None:
    os.close(made[0])
    made[1].close()


@contextlib.contextmanager
def _inside(sock: socket.socket) -> Iterator[AsyncIPRoute]:
    """Netlink through `sock` (made inside a namespace), closed after use."""
    route = AsyncIPRoute(use_socket=sock)
    try:
        yield route
    finally:
        route.close()
        sock.close()


def _unname(path: Path) -> None:
    """What `ip netns del` does, in-process: a lazy unmount of the name, then the file."""
    if _libc.umount2(os.fsencode(path), _MNT_DETACH) < 0:
        log.warning("netns.unname_failed", extra={"netns": path.name, "errno": ctypes.get_errno()})
    with contextlib.suppress(OSError):
        path.unlink()


def _disable_ipv6(ifname: str) -> None:
    knob = Path("/proc/sys/net/ipv6/conf") / ifname / "disable_ipv6"
    with contextlib.suppress(OSError):
        knob.write_text("1")
