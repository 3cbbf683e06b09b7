"""Each sandbox's network namespace, and its one link to this worker's egress gate.

Every bwrap sandbox of a worker that can (root, iproute2, nftables) runs in a network
namespace the worker made, ``/run/netns/sandgate-<scope>-<sandbox>``. It holds only ``lo``
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

Making a namespace (~6 ms) and its link (~10 ms) takes a few `ip` processes, so the worker
keeps `SPARES` of each kind ready (`take`), made in the background; a start takes one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from sandgate.core.egress_policy import DEFAULT_SANDBOX_SUBNET
from sandgate.errors import WorkerError
from sandgate.worker.uids import UidLease, UidPool

log = logging.getLogger(__name__)

_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)

DEFAULT_SLOT_LOCK_DIR = Path("/run/sandgate/netslots")
NETNS_DIR = Path("/run/netns")
SANDBOX_IF = "eth0"
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

    netns: str  # the name under /run/netns, until the worker holds it by a descriptor (`hold`)
    slot: UidLease | None = None  # held while the link exists
    ifname: str = ""
    host_ip: str = ""
    sandbox_ip: str = ""
    connected: bool = False
    fd: int = -1  # once held (`NetHost.hold`): the worker's descriptor of the namespace

    @property
    def adopted(self) -> bool:
        return self.fd >= 0

    @property
    def path(self) -> Path:
        """A path that opens the namespace (for nsenter, and for `ip … netns PATH`)."""
        if self.adopted:
            return Path(f"/proc/{os.getpid()}/fd/{self.fd}")
        return NETNS_DIR / self.netns

    @property
    def ref(self) -> str:
        """How `ip link … netns REF` names it: its path once adopted (a path with a `/` is
        opened as the namespace), else its name."""
        return str(self.path) if self.adopted else self.netns


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
    import os

    if os.geteuid() != 0:
        return "the worker does not run as root"
    missing = [tool for tool in ("ip", "nft", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (apt-get install -y iproute2 nftables util-linux)"
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
        self._ip = shutil.which("ip") or "/usr/sbin/ip"
        self._nft = shutil.which("nft") or "/usr/sbin/nft"
        self._nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
        # connected or not -> namespaces made ahead for the next starts; their filler
        self.spares: dict[bool, list[SandboxNet]] = {False: [], True: []}
        self._wanted: asyncio.Event | None = None
        self._filler: asyncio.Task[None] | None = None

    @property
    def resolver_address(self) -> str:
        """What a sandbox's resolv.conf names: any address works (all port 53 goes to the
        gate's DNS), this one is the subnet's first host."""
        return str(self.subnet.network_address + 1)

    def netns_name(self) -> str:
        return f"sandgate-{self.scope}-{secrets.token_hex(5)}"

    async def prepare(self, *, gate_port: int, dns_port: int) -> None:
        self.slots.ensure_dir()
        await self.remove_leftovers()
        rules = ruleset(self.table, self.prefix, gate_port=gate_port, dns_port=dns_port)
        await _run(self._nft, "-f", "-", stdin=rules)

    async def remove_leftovers(self) -> None:
        """Namespaces and links a crashed worker of this scope left behind."""
        mine = re.compile(f"^sandgate-{re.escape(self.scope)}-[0-9a-f]{{10}}$")
        for name in await self._names("netns", "list", key="name"):
            if mine.match(name):
                log.warning("netns.leftover_removed", extra={"netns": name})
                await _run(self._ip, "netns", "del", name, check=False)
        for name in await self._names("link", "show", key="ifname"):
            if name.startswith(self.prefix):
                await _run(self._ip, "link", "del", name, check=False)

    async def _names(self, *command: str, key: str) -> list[str]:
        """The `key` of each object `ip -j COMMAND` lists (none when it fails)."""
        out = await _run(self._ip, "-j", *command, check=False)
        try:
            listed = json.loads(out or "[]")
        except ValueError:
            return []
        return [str(item[key]) for item in listed if isinstance(item, dict) and key in item]

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
        await self.remove_leftovers()
        await _run(self._nft, "delete", "table", "inet", self.table, check=False)

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
        """A namespace with loopback only."""
        net = SandboxNet(netns=self.netns_name())
        await _run(self._ip, "netns", "add", net.netns)
        try:
            await _run(self._ip, "-n", net.netns, "link", "set", "lo", "up")
        except BaseException:
            await _run(self._ip, "netns", "del", net.netns, check=False)
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
            await _run(self._ip, "link", "del", net.ifname, check=False)  # a stale one
            host = (
                f"link add {net.ifname} type veth peer name {SANDBOX_IF} netns {net.ref}\n"
                f"addr add {net.host_ip}/30 dev {net.ifname}\n"
            )
            await _run(self._ip, "-b", "-", stdin=host)
            _disable_ipv6(net.ifname)
            await _run(self._ip, "link", "set", net.ifname, "up")
            inside = (
                f"addr add {net.sandbox_ip}/30 dev {SANDBOX_IF}\n"
                f"link set {SANDBOX_IF} up\n"
                f"route add default via {net.host_ip}\n"
            )
            await self._inside(net, "-b", "-", stdin=inside)
        except BaseException:
            await self.disconnect(net)
            raise
        net.connected = True

    async def _inside(self, net: SandboxNet, *args: str, stdin: str | None = None) -> str:
        """`ip ARGS` in the namespace: by its name, or through its sandbox's process."""
        if net.adopted:
            return await _run(self._nsenter, f"--net={net.path}", self._ip, *args, stdin=stdin)
        return await _run(self._ip, "-n", net.netns, *args, stdin=stdin)

    def hold(self, net: SandboxNet) -> None:
        """Trade the namespace's name for a descriptor, before a sandbox's chain enters it
        through that descriptor (`SandboxNet.path`).

        A named namespace is a bind mount in the host's mount table, which every sandbox
        start copies (bwrap's new mount namespace) and to whose copies every `ip netns add`
        propagates: with a name per sandbox, a start cost grew with the sandboxes held
        (docs/benchmarks.md). The name is taken away here, in-process (what `ip netns del`
        does: a lazy unmount, then the file), so a start neither waits for its chain to
        enter nor spawns `ip`; the descriptor keeps the namespace until `remove`."""
        if net.adopted:
            return
        path = NETNS_DIR / net.netns
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        if _libc.umount2(os.fsencode(path), _MNT_DETACH) < 0:
            err = ctypes.get_errno()
            os.close(fd)  # the chain enters it by its name, and `remove` deletes that
            log.warning("netns.unname_failed", extra={"netns": net.netns, "errno": err})
            return
        net.fd = fd  # from here on, everything reaches it through the descriptor
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    async def disconnect(self, net: SandboxNet) -> None:
        """Take the link away: the namespace keeps loopback only."""
        if net.ifname:
            await _run(self._ip, "link", "del", net.ifname, check=False)
        if net.slot is not None:
            net.slot.release()
        net.slot, net.ifname, net.host_ip, net.sandbox_ip = None, "", "", ""
        net.connected = False

    async def remove(self, net: SandboxNet) -> None:
        await self.disconnect(net)
        if net.adopted:  # no name left: the namespace ends with its last descriptor
            fd, net.fd = net.fd, -1
            os.close(fd)
            return
        with contextlib.suppress(WorkerError):
            await _run(self._ip, "netns", "del", net.netns, check=False)


def _disable_ipv6(ifname: str) -> None:
    knob = Path("/proc/sys/net/ipv6/conf") / ifname / "disable_ipv6"
    with contextlib.suppress(OSError):
        knob.write_text("1")
