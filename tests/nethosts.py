"""Fake "internet" hosts in a network namespace of this machine, for the tests of the egress
gate (the proxy on the host that dials names and addresses on behalf of sandboxes).

The gate's tests need servers it can reach by name and address, that answer with who they are
and which name they were asked for, and a resolver that knows their names; none of it may
depend on the real internet. `internet_hosts(tmp)` builds that and yields an `Internet`:

    with internet_hosts(tmp_path) as net:
        net.resolver                   # "10.77.N.2:53": give this to the gate as its resolver
        net.addresses["allowed.test"]  # "10.77.N.2"
        net.ca_pem                     # trust this CA (and only it) for the HTTPS servers
        net.url("allowed.test", path="/x")   # "https://allowed.test/x"

What it builds: one netns `sgtnet-<6 hex>` and a veth pair, `sgt<hex>h` on the host with
10.77.N.1/24 (the address brings the host its route to the /24) and `sgt<hex>n` in the netns
with .2, .3, .4 and .5. N is a random third octet in 10..250 that no address or route of the
host uses yet (picked under a lock file, so concurrent runs never share one). The host can
reach the hosts directly; nothing is forwarded or NATed. The servers run as child processes
inside the netns (`ip netns exec NS python <this file, copied into tmp> ROLE ...`), each bound
to its own address:

    allowed.test  .2  HTTPS 443 (certificate for allowed.test, other.test, *.wild.test), HTTP 80
    api.wild.test .2  (the same server: a name the wildcard covers)
    denied.test   .3  HTTPS 443 (certificate for denied.test only), HTTP 80
    pypi.test     .4  HTTP 80: a PEP 503 simple index with one wheel, sgprobe 1.0
                      (`import sgprobe; sgprobe.VALUE == 42`)
    tcp.test      .5  TCP 7000: sends b"tcp-host\\n" on connect, then echoes
    resolver      .2  DNS on 53, UDP and TCP: A records for the five names above
                      (case-insensitive), NOERROR without an answer for their other types
                      (AAAA...), NXDOMAIN for every other name. other.test does not resolve.

Every HTTP(S) answer's body starts with one line `host=<allowed|denied|pypi> name=<the Host
header as received, empty if none> path=<the request target as received>\\n` so a test tells
which server answered and for what; a request's body, if any, follows that line. Headers
`X-Nethost: <role>` and, over TLS, `X-Nethost-Sni: <SNI or ->` say the same. Exceptions: the
index and the wheel on pypi, and `GET /bytes/<n>` on allowed (HTTP and HTTPS), which streams
exactly n bytes (1 MiB writes, Content-Length set) for throughput benchmarks. HTTP/1.1 with
keep-alive; ALPN offers http/1.1 only.

The CA and the leaf certificates (EC P-256, CA:FALSE, serverAuth, SANs) are made with the
openssl CLI into a fresh directory under `tmp`, as are the servers' script and logs
(`tmp/nethosts-*/logs/<role>.log`: look there when a server misbehaves).

`internet_hosts` returns once every server accepts (polled from the host). On exit, also on an
exception, it kills the servers and deletes the netns and the veth. A server also exits when
the test process dies (its stdin, a pipe from the test, reaches EOF); a netns left behind by a
killed run is swept by a later one once it has no process and is ten minutes old.

Needs root and iproute2. The servers run on the standard library, and dnspython for DNS: they
run with `sys.executable` (the venv's python). This file is the servers' script too: its top
level imports only the standard library.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import socket
import socketserver
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

NETNS_PREFIX = "sgtnet-"
LOCK_FILE = Path("/run/sgtnet.lock")  # held while a run picks its /24 and puts it on the host
STALE_AFTER_S = 600  # a netns of ours without processes, older than this, is a killed run's
READY_TIMEOUT_S = 30.0
BYTES_CHUNK = 1 << 20
HOST_OCTETS = {
    "allowed.test": 2,
    "api.wild.test": 2,
    "denied.test": 3,
    "pypi.test": 4,
    "tcp.test": 5,
}
RESOLVER_OCTET = 2
TCP_PORT = 7000
TCP_BANNER = b"tcp-host\n"
ALLOWED_SANS = ("allowed.test", "other.test", "*.wild.test")
DENIED_SANS = ("denied.test",)
WHEEL_NAME = "sgprobe-1.0-py3-none-any.whl"


@dataclass(frozen=True)
class Internet:
    """The fake internet of one `internet_hosts` context (see the module docstring)."""

    subnet: str  # "10.77.N.0/24"; the host holds .1
    resolver: str  # "10.77.N.2:53", UDP and TCP
    ca_pem: Path  # the CA the HTTPS servers' certificates chain to
    addresses: dict[str, str]  # name -> IPv4 address, for the five names that resolve
    netns: str = ""  # the namespace's name, "sgtnet-<6 hex>" (gone after exit)
    logs: Path | None = None  # the servers' logs, one file per role

    def report(self) -> str:
        """What to look at when a test through this internet failed: whether each server
        answers the host right now, the servers' logs, the host's addresses and firewall
        tables, the namespace's sockets. Call it inside the context (the servers still run)."""
        out = [f"--- nethosts {self.netns} ({self.subnet}) ---"]
        for name in ("allowed.test", "denied.test"):
            answer = _http_probe(self.addresses[name], name)
            out.append(f"GET http://{name}/ from the host: {answer}")
        host, _, port = self.resolver.partition(":")
        out.append(f"DNS allowed.test at {self.resolver}: {_dns_probe(host, int(port))}")
        for command in (
            ("ip", "-br", "addr"),
            ("ip", "route", "get", self.addresses["allowed.test"]),
            ("nft", "list", "tables"),
            ("ip", "netns", "exec", self.netns, "ss", "-tanup"),
        ):
            proc = subprocess.run(command, capture_output=True, text=True, timeout=10)
            out.append(f"$ {' '.join(command)}\n{proc.stdout}{proc.stderr}")
        for log in sorted(self.logs.glob("*.log")) if self.logs else []:
            out.append(f"--- {log.name} (tail) ---\n{log.read_text(errors='replace')[-2000:]}")
        return "\n".join(out)

    def url(self, name: str, scheme: str = "https", path: str = "/") -> str:
        """`scheme://name/path` on the default port: the URL a sandbox would ask the gate for."""
        if scheme not in ("http", "https"):
            raise ValueError(f"scheme must be http or https, not {scheme!r}")
        if not path.startswith("/"):
            raise ValueError(f"path must start with '/', not {path!r}")
        return f"{scheme}://{name}{path}"


@contextlib.contextmanager
def internet_hosts(tmp: Path) -> Iterator[Internet]:
    """Build the fake internet (netns, veth, CA, servers), yield it, and take it all down."""
    tmp.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nethosts-", dir=tmp))
    logs = work / "logs"
    logs.mkdir()
    script = work / "nethosts_server.py"
    shutil.copyfile(__file__, script)
    ca_pem, leaves = _make_certs(work / "pki")
    www = work / "pypi"
    _write_index(www)
    _sweep_stale()

    tag = secrets.token_hex(3)
    netns, host_if, ns_if = f"{NETNS_PREFIX}{tag}", f"sgt{tag}h", f"sgt{tag}n"
    with contextlib.ExitStack() as stack:
        stack.callback(_ip, "link", "del", host_if, check=False)  # gone with the netns, mostly
        stack.callback(_ip, "netns", "del", netns, check=False)
        with _subnet_lock():
            octet = _free_octet()
            base = f"10.77.{octet}"
            _ip("netns", "add", netns)
            _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", netns)
            _ip("-n", netns, "link", "set", "lo", "up")
            for host in sorted(set(HOST_OCTETS.values())):
                _ip("-n", netns, "addr", "add", f"{base}.{host}/24", "dev", ns_if)
            _ip("-n", netns, "link", "set", ns_if, "up")
            _ip("addr", "add", f"{base}.1/24", "dev", host_if)
            _ip("link", "set", host_if, "up")
        addr = {name: f"{base}.{n}" for name, n in HOST_OCTETS.items()}
        allowed, denied, pypi = addr["allowed.test"], addr["denied.test"], addr["pypi.test"]
        tcp, resolver = addr["tcp.test"], f"{base}.{RESOLVER_OCTET}"
        servers = _Servers(netns, script, logs)
        stack.callback(servers.stop)
        servers.start("dns", "dns", resolver, json.dumps(addr))
        servers.start("allowed", "http", "allowed", allowed, "--tls", *leaves["allowed"], "--bytes")
        servers.start("denied", "http", "denied", denied, "--tls", *leaves["denied"])
        servers.start("pypi", "http", "pypi", pypi, "--www", str(www))
        servers.start("tcp", "tcp", tcp)
        listening = [(allowed, 80), (allowed, 443), (denied, 80), (denied, 443), (pypi, 80)]
        servers.wait_ready(tcp=[*listening, (tcp, TCP_PORT), (resolver, 53)], udp_dns=resolver)
        yield Internet(
            subnet=f"{base}.0/24",
            resolver=f"{resolver}:53",
            ca_pem=ca_pem,
            addresses=addr,
            netns=netns,
            logs=logs,
        )


# -- the host side: iproute2, the subnet, certificates, the index, the server processes --------


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    with open(LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_octet() -> int:
    """A random N in 10..250 such that no address or route of the host is in 10.77.N.0/24."""
    used = _ip("-br", "addr") + _ip("route", "show", "table", "all")
    candidates = list(range(10, 251))
    secrets.SystemRandom().shuffle(candidates)
    for n in candidates:
        if not re.search(rf"(?<![\d.])10\.77\.{n}\.", used):
            return n
    raise RuntimeError("no free 10.77.N.0/24 on this host")


def _sweep_stale() -> None:
    """Delete the netns of killed runs: ours by name, without a process, ten minutes old."""
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split(" ", 1)[0]
        if not name.startswith(NETNS_PREFIX):
            continue
        try:
            age = time.time() - os.stat(f"/run/netns/{name}").st_mtime
        except OSError:
            continue
        if age > STALE_AFTER_S and not _ip("netns", "pids", name, check=False).strip():
            _ip("netns", "del", name, check=False)


def _openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")


def _make_certs(pki: Path) -> tuple[Path, dict[str, tuple[str, str]]]:
    """A test CA and the leaves of allowed and denied: (ca.pem, role -> (cert, key))."""
    pki.mkdir()
    ca_key, ca_pem, cnf = pki / "ca.key", pki / "ca.pem", pki / "ca.cnf"
    cnf.write_text(
        "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = sandgate nethosts test CA\n"
        "[ca]\nbasicConstraints = critical, CA:TRUE\nkeyUsage = critical, keyCertSign, cRLSign\n"
        "subjectKeyIdentifier = hash\n"
    )
    ec = ("-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256")
    _openssl("genpkey", *ec, "-out", str(ca_key))
    _openssl(
        "req", "-x509", "-new", "-key", str(ca_key), "-config", str(cnf), "-extensions", "ca",
        "-days", "7", "-sha256", "-out", str(ca_pem),
    )  # fmt: skip
    leaves: dict[str, tuple[str, str]] = {}
    for role, sans in (("allowed", ALLOWED_SANS), ("denied", DENIED_SANS)):
        key, csr, pem, ext = (pki / f"{role}.{x}" for x in ("key", "csr", "pem", "ext"))
        ext.write_text(
            "basicConstraints = critical, CA:FALSE\nkeyUsage = critical, digitalSignature\n"
            "extendedKeyUsage = serverAuth\nsubjectKeyIdentifier = hash\n"
            "authorityKeyIdentifier = keyid:always\n"
            f"subjectAltName = {', '.join(f'DNS:{s}' for s in sans)}\n"
        )
        _openssl("genpkey", *ec, "-out", str(key))
        _openssl("req", "-new", "-key", str(key), "-subj", f"/CN={sans[0]}", "-out", str(csr))
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(ca_pem), "-CAkey", str(ca_key),
            "-set_serial", f"0x{secrets.token_hex(8)}", "-days", "7", "-sha256",
            "-extfile", str(ext), "-out", str(pem),
        )  # fmt: skip
        leaves[role] = (str(pem), str(key))
    return ca_pem, leaves


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def build_wheel() -> bytes:
    """sgprobe 1.0, a pure-Python wheel: module sgprobe with VALUE = 42."""
    info = "sgprobe-1.0.dist-info"
    files = {
        "sgprobe.py": b'"""Probe package of the sandgate nethosts test index."""\n\nVALUE = 42\n',
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: sgprobe\nVersion: 1.0\n"
        b"Summary: probe package of the sandgate nethosts test index\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: sandgate-tests\n"
        b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for path, data in files.items():
            zi = zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0))
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = 0o644 << 16
            zf.writestr(zi, data)
    return out.getvalue()


def _write_index(www: Path) -> None:
    """pypi.test's files: /simple/, /simple/sgprobe/ and /packages/<wheel>."""
    wheel = build_wheel()
    (www / "packages").mkdir(parents=True)
    (www / "packages" / WHEEL_NAME).write_bytes(wheel)
    (www / "simple" / "sgprobe").mkdir(parents=True)
    head = '<!DOCTYPE html>\n<html><head><meta name="pypi:repository-version" content="1.0">'
    (www / "simple" / "index.html").write_text(
        f"{head}<title>Simple index</title></head><body>\n"
        '<a href="/simple/sgprobe/">sgprobe</a>\n</body></html>\n'
    )
    sha = hashlib.sha256(wheel).hexdigest()
    (www / "simple" / "sgprobe" / "index.html").write_text(
        f"{head}<title>Links for sgprobe</title></head><body>\n<h1>Links for sgprobe</h1>\n"
        f'<a href="/packages/{WHEEL_NAME}#sha256={sha}">{WHEEL_NAME}</a>\n</body></html>\n'
    )


class _Servers:
    """The server processes in the netns: started, waited for, killed."""

    def __init__(self, netns: str, script: Path, logs: Path) -> None:
        self.netns, self.script, self.logs = netns, script, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> None:
        argv = ["ip", "netns", "exec", self.netns, sys.executable, str(self.script), *args]
        with open(self.logs / f"{name}.log", "wb") as log:
            # stdin: a pipe the server watches, so it exits when this process dies
            self.procs[name] = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True
            )

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"nethosts server {name} exited ({proc.returncode}):\n{log}")

    def wait_ready(self, tcp: list[tuple[str, int]], udp_dns: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = set(tcp)
        dns_ok = False
        while pending or not dns_ok:
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"nethosts servers not ready: {sorted(pending)} dns={dns_ok}")
            for target in list(pending):
                with contextlib.suppress(OSError), socket.create_connection(target, timeout=0.2):
                    pending.discard(target)
            dns_ok = dns_ok or _dns_answers(udp_dns)
            if pending or not dns_ok:
                time.sleep(0.05)

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in self.procs.values():
            proc.wait(10)
            if proc.stdin is not None:
                proc.stdin.close()


def _http_probe(address: str, name: str) -> str:
    """The first line of what `address` answers a GET for `name` on port 80, or the error."""
    try:
        with socket.create_connection((address, 80), timeout=3) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
            return s.recv(200).split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
    except OSError as exc:
        return repr(exc)


def _dns_probe(server: str, port: int) -> str:
    import dns.exception
    import dns.message
    import dns.query

    try:
        reply = dns.query.udp(dns.message.make_query("allowed.test", "A"), server, 3, port)
    except (OSError, dns.exception.DNSException) as exc:
        return repr(exc)
    return " ".join(str(rrset) for rrset in reply.answer) or "no answer"


def _dns_answers(server: str) -> bool:
    """Whether the DNS server answers a UDP query (for allowed.test) within 0.2 s."""
    import dns.exception
    import dns.message
    import dns.query

    q = dns.message.make_query("allowed.test", "A")
    try:
        dns.query.udp(q, server, timeout=0.2)
    except (OSError, dns.exception.DNSException):
        return False
    return True


# -- the servers' side: run in the netns as `python nethosts.py ROLE ...` -----------------------


def _exit_with_parent() -> None:
    """Exit as soon as stdin (a pipe from the test process) reaches EOF: the test is gone."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while sys.stdin.buffer.read(4096):
                pass
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


class _TLSHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer, optionally over TLS: the handshake happens in the connection's
    thread (not in accept), so a stalled client holds up only itself."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], role: str, tls: ssl.SSLContext | None) -> None:
        self.role, self.tls = role, tls
        self.www: Path | None = None
        self.bytes = False
        super().__init__(addr, _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(30)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError):
            request.close()
            return
        try:
            super().finish_request(conn, client_address)
        finally:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, (ConnectionError, TimeoutError, ssl.SSLError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 120  # an idle keep-alive connection ends after this
    server: _TLSHTTPServer

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def do_POST(self) -> None:
        self._answer(send_body=True)

    do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_POST

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _answer(self, send_body: bool) -> None:
        body_in = self._read_body()
        path = self.path.split("?", 1)[0]
        n = _bytes_asked(path) if self.server.bytes and self.command in ("GET", "HEAD") else None
        if n is not None:
            self._stream(n, send_body)
            return
        if self.server.www is not None and self.command in ("GET", "HEAD"):
            if self._file(path, send_body):
                return
        line = f"host={self.server.role} name={self.headers.get('Host', '')} path={self.path}\n"
        self._send(200, "text/plain; charset=utf-8", line.encode() + body_in, send_body)

    def _headers(self, status: int, ctype: str, length: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(length))
        self.send_header("X-Nethost", self.server.role)
        if isinstance(self.connection, ssl.SSLSocket):
            self.send_header("X-Nethost-Sni", getattr(self.connection, "sni", None) or "-")
        self.end_headers()

    def _send(self, status: int, ctype: str, body: bytes, send_body: bool) -> None:
        self._headers(status, ctype, len(body))
        if send_body:
            self.wfile.write(body)

    def _stream(self, n: int, send_body: bool) -> None:
        self._headers(200, "application/octet-stream", n)
        if send_body:
            chunk = memoryview(bytes(range(256)) * (BYTES_CHUNK // 256))
            while n > 0:
                self.wfile.write(chunk[: min(n, BYTES_CHUNK)])
                n -= BYTES_CHUNK

    def _file(self, path: str, send_body: bool) -> bool:
        """Serve the index file or wheel at path, if there is one (a directory without its
        slash redirects to it). False: not a file of the index."""
        assert self.server.www is not None
        www = self.server.www.resolve()
        target = (www / path.lstrip("/")).resolve()
        if target != www and www not in target.parents:
            return False
        if target.is_dir():
            if not path.endswith("/"):
                self.send_response(301)
                self.send_header("Location", path + "/")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True
            target = target / "index.html"
        if not target.is_file():
            return False
        ctype = "text/html; charset=utf-8" if target.suffix == ".html" else "application/zip"
        self._send(200, ctype, target.read_bytes(), send_body)
        return True


def _bytes_asked(path: str) -> int | None:
    """n of a path `/bytes/<n>`, else None."""
    m = re.fullmatch(r"/bytes/(\d{1,15})", path)
    return int(m.group(1)) if m else None


def _serve_http(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role")
    p.add_argument("addr")
    p.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    p.add_argument("--www", type=Path)
    p.add_argument("--bytes", action="store_true")
    a = p.parse_args(argv)
    servers = [_TLSHTTPServer((a.addr, 80), a.role, None)]
    if a.tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(a.tls[0], a.tls[1])
        ctx.set_alpn_protocols(["http/1.1"])

        def remember_sni(sock: Any, name: str | None, _ctx: ssl.SSLContext) -> None:
            sock.sni = name

        ctx.sni_callback = remember_sni
        servers.append(_TLSHTTPServer((a.addr, 443), a.role, ctx))
    for s in servers:
        s.www, s.bytes = a.www, a.bytes
    for s in servers[1:]:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    servers[0].serve_forever()


def _dns_reply(query: bytes, records: dict[str, str]) -> bytes | None:
    """The answer to a DNS query in wire format, or None for what is not a query."""
    import dns.exception
    import dns.flags
    import dns.message
    import dns.name
    import dns.rcode
    import dns.rdataclass
    import dns.rdatatype
    import dns.rrset

    try:
        q = dns.message.from_wire(query)
    except dns.exception.DNSException:
        return None
    if q.flags & dns.flags.QR:
        return None
    r: dns.message.Message = dns.message.make_response(q)
    r.flags |= dns.flags.AA
    r.flags &= ~dns.flags.RA
    if len(q.question) != 1 or q.question[0].rdclass != dns.rdataclass.IN:
        r.set_rcode(dns.rcode.FORMERR if not q.question else dns.rcode.REFUSED)
        return r.to_wire()
    question = q.question[0]
    names = {dns.name.from_text(n): ip for n, ip in records.items()}  # Name == ignores case
    ip = names.get(question.name)
    if ip is not None and question.rdtype in (dns.rdatatype.A, dns.rdatatype.ANY):
        r.answer.append(dns.rrset.from_text(question.name, 60, "IN", "A", ip))
    else:
        if ip is None:
            r.set_rcode(dns.rcode.NXDOMAIN)
        soa = "ns.test. hostmaster.test. 1 60 60 60 60"
        r.authority.append(dns.rrset.from_text("test.", 60, "IN", "SOA", soa))
    return r.to_wire()


def _serve_dns(argv: list[str]) -> None:
    addr, records = argv[0], json.loads(argv[1])

    class TCPHandler(socketserver.StreamRequestHandler):
        timeout = 30

        def handle(self) -> None:
            with contextlib.suppress(OSError):
                while len(head := self.rfile.read(2)) == 2:
                    reply = _dns_reply(self.rfile.read(int.from_bytes(head, "big")), records)
                    if reply is None:
                        return
                    self.wfile.write(len(reply).to_bytes(2, "big") + reply)

    class TCPServer(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((addr, 53))

    def serve_udp() -> None:
        while True:
            data, peer = udp.recvfrom(65535)
            reply = _dns_reply(data, records)
            if reply is not None:
                with contextlib.suppress(OSError):
                    udp.sendto(reply, peer)

    threading.Thread(target=serve_udp, daemon=True).start()
    TCPServer((addr, 53), TCPHandler).serve_forever()


def _serve_tcp(argv: list[str]) -> None:
    class Echo(socketserver.BaseRequestHandler):
        request: socket.socket

        def handle(self) -> None:
            with contextlib.suppress(OSError):
                self.request.sendall(TCP_BANNER)
                while data := self.request.recv(65536):
                    self.request.sendall(data)

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    Server((argv[0], TCP_PORT), Echo).serve_forever()


def main(argv: list[str]) -> None:
    """`dns ADDR RECORDS_JSON` | `http ROLE ADDR [--tls CERT KEY] [--www DIR] [--bytes]` |
    `tcp ADDR`: serve until killed, or until stdin reaches EOF."""
    _exit_with_parent()
    roles = {"dns": _serve_dns, "http": _serve_http, "tcp": _serve_tcp}
    roles[argv[0]](argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
