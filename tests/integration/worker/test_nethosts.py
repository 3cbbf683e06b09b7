"""Self-check of tests/nethosts.py, the fake internet of the egress gate's tests: from the host,
every server answers as documented, the resolver knows the names, pip installs from the index,
and nothing is left behind."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import httpx
import pytest

from tests.nethosts import Internet, internet_hosts

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2"),
]


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Internet]:
    with internet_hosts(tmp_path_factory.mktemp("nethosts")) as n:
        yield n


def test_the_report_of_a_failed_run_says_what_answers(net: Internet) -> None:
    report = net.report()
    assert "GET http://allowed.test/ from the host: HTTP/1.1 200" in report, report
    assert f"IN A {net.addresses['allowed.test']}" in report, report
    assert f"$ ip netns exec {net.netns} ss -tanup" in report and "dns.log" in report


def netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def tls_context(net: Internet) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(net.ca_pem))


def get(net: Internet, name: str, path: str = "/", scheme: str = "https") -> httpx.Response:
    """GET name's server by its address, with name as Host and SNI (the name as seen by DNS)."""
    ip = net.addresses.get(name, net.addresses["allowed.test"])
    with httpx.Client(verify=tls_context(net), trust_env=False, timeout=10) as client:
        return client.get(
            f"{scheme}://{ip}{path}", headers={"Host": name}, extensions={"sni_hostname": name}
        )


def test_the_layout(net: Internet) -> None:
    base = net.subnet.removesuffix("0/24")
    assert net.subnet.startswith("10.77.") and 10 <= int(net.subnet.split(".")[2]) <= 250
    assert net.resolver == f"{base}2:53"
    assert net.addresses == {
        "allowed.test": f"{base}2",
        "api.wild.test": f"{base}2",
        "denied.test": f"{base}3",
        "pypi.test": f"{base}4",
        "tcp.test": f"{base}5",
    }
    assert net.netns in netns_list()
    assert net.url("allowed.test") == "https://allowed.test/"
    assert net.url("pypi.test", "http", "/simple/") == "http://pypi.test/simple/"


@pytest.mark.parametrize(
    ("name", "scheme", "line"),
    [
        ("allowed.test", "https", "host=allowed name=allowed.test path=/p?q=1\n"),
        ("allowed.test", "http", "host=allowed name=allowed.test path=/p?q=1\n"),
        ("api.wild.test", "https", "host=allowed name=api.wild.test path=/p?q=1\n"),
        ("other.test", "https", "host=allowed name=other.test path=/p?q=1\n"),
        ("denied.test", "https", "host=denied name=denied.test path=/p?q=1\n"),
        ("denied.test", "http", "host=denied name=denied.test path=/p?q=1\n"),
        ("pypi.test", "http", "host=pypi name=pypi.test path=/p?q=1\n"),
    ],
)
def test_each_server_says_who_it_is_and_what_it_was_asked(
    net: Internet, name: str, scheme: str, line: str
) -> None:
    r = get(net, name, "/p?q=1", scheme)
    assert r.status_code == 200
    assert r.text == line
    if scheme == "https":
        assert r.headers["X-Nethost-Sni"] == name


def test_a_raw_tls_connection_checks_the_name_against_the_test_ca(net: Internet) -> None:
    ctx = tls_context(net)
    with (
        socket.create_connection((net.addresses["allowed.test"], 443), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="allowed.test") as tls,
    ):
        tls.sendall(b"GET /raw HTTP/1.1\r\nHost: allowed.test\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200")
    assert answer.endswith(b"\r\n\r\nhost=allowed name=allowed.test path=/raw\n")
    # denied's certificate names denied.test only: asking it for allowed.test fails the check
    with (
        socket.create_connection((net.addresses["denied.test"], 443), timeout=10) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        ctx.wrap_socket(raw, server_hostname="allowed.test")


def test_a_post_body_follows_the_line(net: Internet) -> None:
    with httpx.Client(trust_env=False, timeout=10) as client:
        r = client.post(
            f"http://{net.addresses['denied.test']}/up", headers={"Host": "x"}, content=b"abc"
        )
    assert r.text == "host=denied name=x path=/up\nabc"


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_bytes_streams_exactly_n_bytes(net: Internet, scheme: str) -> None:
    r = get(net, "allowed.test", "/bytes/3000000", scheme)
    assert r.status_code == 200
    assert r.headers["Content-Length"] == "3000000"
    assert len(r.content) == 3000000


@pytest.mark.parametrize("tcp", [False, True])
def test_the_resolver(net: Internet, tcp: bool) -> None:
    host, port = net.resolver.split(":")

    def ask(name: str, rdtype: str) -> dns.message.Message:
        q = dns.message.make_query(name, rdtype)
        if tcp:
            return dns.query.tcp(q, host, port=int(port), timeout=5)
        return dns.query.udp(q, host, port=int(port), timeout=5)

    for name, ip in net.addresses.items():
        r = ask(name.upper() + ".", "A")
        assert r.rcode() == dns.rcode.NOERROR
        assert [rd.to_text() for rrset in r.answer for rd in rrset] == [ip]
    r = ask("allowed.test", "AAAA")
    assert r.rcode() == dns.rcode.NOERROR and r.answer == []
    for unknown in ("example.com", "other.test", "x.wild.test"):
        r = ask(unknown, "A")
        assert r.rcode() == dns.rcode.NXDOMAIN and r.answer == []


def test_the_tcp_host_greets_and_echoes(net: Internet) -> None:
    with socket.create_connection((net.addresses["tcp.test"], 7000), timeout=10) as s:
        f = s.makefile("rb")
        assert f.readline() == b"tcp-host\n"
        s.sendall(b"ping\n")
        assert f.readline() == b"ping\n"
        f.close()


def test_pip_installs_sgprobe_from_the_index(net: Internet, tmp_path: Path) -> None:
    ip = net.addresses["pypi.test"]
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    pip = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check"]
    index = ["--index-url", f"http://{ip}/simple", "--trusted-host", ip]
    target = tmp_path / "site"
    proc = subprocess.run(
        [*pip, "--no-input", *index, "--target", str(target), "sgprobe"],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    probe = subprocess.run(
        [sys.executable, "-c", "import sgprobe; print(sgprobe.VALUE)"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(target)},
    )
    assert probe.stdout == "42\n", probe.stderr
    assert (target / "sgprobe-1.0.dist-info" / "RECORD").exists()


def test_everything_is_gone_after_the_context_even_after_an_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), internet_hosts(tmp_path) as n:
        host_ip = n.addresses["allowed.test"].removesuffix(".2") + ".1"
        assert n.netns in netns_list()
        raise RuntimeError("boom")
    assert n.netns not in netns_list()
    links = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
    assert f"{host_ip}/" not in links
    assert f"sgt{n.netns.removeprefix('sgtnet-')}h" not in links
