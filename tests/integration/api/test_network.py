"""Sandbox networks through the API: policies on create and at run time, the gate's counters,
the E2B SDK's network config, against the tests' own internet hosts (tests/nethosts.py).

A real server and a real bwrap worker whose gate may reach the test hosts' /24 (it is a
private range: `--egress-permit`) and resolves names with their DNS (`--egress-resolver`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from tests import e2b_scenarios as sdk
from tests.integration.api.conftest import Deployment, start_deployment, tear_down
from tests.nethosts import Internet

pytestmark = pytest.mark.bwrap

# what a program in the sandbox sees: one GET per argument (a name, or name@address to send
# that name to another address), and the DNS answer for each name
PROBE = r"""
import json, socket, ssl, sys
ca = open("/workspace/ca.pem").read()
out = {}
for arg in sys.argv[1:]:
    scheme, _, target = arg.partition("://")
    name, _, address = target.partition("@")
    try:
        s = socket.create_connection((address or name, 443 if scheme == "https" else 80), timeout=5)
        if scheme == "https":
            ctx = ssl.create_default_context(cadata=ca)
            s = ctx.wrap_socket(s, server_hostname=name)
        s.sendall(f"GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        out[arg] = got.split(b"\r\n\r\n", 1)[-1].split(b"\n")[0].decode() or "cut"
    except (OSError, ssl.SSLError) as e:
        out[arg] = "cut" if isinstance(e, (ConnectionResetError, ssl.SSLError)) else repr(e)
    try:
        out["dns:" + name] = socket.gethostbyname(name)
    except OSError:
        out["dns:" + name] = "NXDOMAIN"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory, internet: Internet) -> Iterator[Deployment]:
    dep = start_deployment(tmp_path_factory.mktemp("gated"), worker=False)
    try:
        dep.start_worker(
            args=("--egress-permit", internet.subnet, "--egress-resolver", internet.resolver)
        )
        yield dep
    finally:
        tear_down(dep)


@pytest.fixture
def alpha(gated: Deployment) -> Iterator[httpx.Client]:
    with gated.client("alpha") as client:
        yield client


def create(client: httpx.Client, internet: Internet, network: Any) -> str:
    made = client.post("/api/v1/sandboxes", json={"network": network})
    assert made.status_code == 201, made.text
    name = str(made.json()["name"])
    for path, content in (
        ("/workspace/ca.pem", internet.ca_pem.read_bytes()),
        ("/workspace/probe.py", textwrap.dedent(PROBE).encode()),
    ):
        put = client.put(
            f"/api/v1/sandboxes/{name}/toolbox/files", params={"path": path}, content=content
        )
        assert put.status_code in (200, 201, 204), put.text
    return name


def probe(client: httpx.Client, name: str, *targets: str) -> dict[str, str]:
    code = "python3 /workspace/probe.py " + " ".join(targets)
    ran = client.post(f"/api/v1/sandboxes/{name}/execute", json={"code": code, "timeout": 60})
    assert ran.status_code == 200, ran.text
    body = ran.json()
    assert body["exit_code"] == 0, body
    result: dict[str, str] = json.loads(body["stdout"])
    return result


def test_allowlist_on_create_then_changed_at_run_time(
    alpha: httpx.Client, internet: Internet
) -> None:
    name = create(alpha, internet, {"allow_out": ["allowed.test"]})
    shown = alpha.get(f"/api/v1/sandboxes/{name}").json()
    assert shown["network"] is True
    assert shown["network_policy"] == {"allow_out": ["allowed.test"], "deny_out": []}
    denied_ip = internet.addresses["denied.test"]
    seen = probe(
        alpha,
        name,
        "https://allowed.test",
        "https://denied.test",  # no address for it
        f"https://denied.test@{denied_ip}",  # dialed at its address anyway
        f"https://allowed.test@{denied_ip}",  # an allowed name at a denied address
    )
    assert seen["https://allowed.test"].startswith("host=allowed name=allowed.test")
    assert seen["dns:allowed.test"] == internet.addresses["allowed.test"]
    assert "gaierror" in seen["https://denied.test"]
    assert seen[f"https://denied.test@{denied_ip}"] == "cut"
    assert seen["dns:denied.test"] == "NXDOMAIN"
    assert seen[f"https://allowed.test@{denied_ip}"].startswith("host=allowed"), seen

    state = alpha.get(f"/api/v1/sandboxes/{name}/network").json()
    assert state["network"] == {"allow_out": ["allowed.test"], "deny_out": []}
    assert state["allowed"] == 2 and state["refused"] >= 1 and state["dns_refused"] >= 1
    assert any("denied.test" in r["target"] for r in state["recent_refusals"])

    changed = alpha.put(
        f"/api/v1/sandboxes/{name}/network", json={"network": {"allow_out": ["denied.test"]}}
    )
    assert changed.status_code == 200, changed.text
    assert changed.json()["network"] == {"allow_out": ["denied.test"], "deny_out": []}
    allowed_ip = internet.addresses["allowed.test"]
    seen = probe(alpha, name, f"http://allowed.test@{allowed_ip}", "http://denied.test")
    assert seen["http://denied.test"].startswith("host=denied name=denied.test")
    assert seen[f"http://allowed.test@{allowed_ip}"] == "cut"
    shown = alpha.get(f"/api/v1/sandboxes/{name}").json()
    assert shown["network_policy"] == {"allow_out": ["denied.test"], "deny_out": []}

    off = alpha.put(f"/api/v1/sandboxes/{name}/network", json={"network": False})
    assert off.json()["network"] is False
    devs = alpha.post(
        f"/api/v1/sandboxes/{name}/execute",
        json={"code": "cut -d: -f1 /proc/net/dev | tail -n +3 | tr -d ' ' | sort"},
    ).json()
    assert devs["stdout"].split() == ["lo"]
    assert alpha.get(f"/api/v1/sandboxes/{name}").json()["network"] is False
    alpha.delete(f"/api/v1/sandboxes/{name}")


def test_public_internet_but_never_the_host(alpha: httpx.Client, internet: Internet) -> None:
    name = create(alpha, internet, True)
    seen = probe(alpha, name, "http://denied.test", "http://pypi.test")
    assert seen["http://denied.test"].startswith("host=denied")
    code = (
        "python3 -c 'import socket\n"
        'for h, p in (("127.0.0.1", 5432), ("169.254.169.254", 80), ("10.211.0.1", 8080)):\n'
        "    try:\n"
        '        s = socket.create_connection((h, p), timeout=3); s.sendall(b"x")\n'
        '        print(h, s.recv(10).decode() or "cut")\n'
        '    except ConnectionResetError: print(h, "cut")\n'
        "    except OSError as e: print(h, type(e).__name__)'"
    )
    out = alpha.post(f"/api/v1/sandboxes/{name}/execute", json={"code": code}).json()["stdout"]
    assert out.splitlines() == [
        "127.0.0.1 ConnectionRefusedError",  # the sandbox's own loopback: nothing listens
        "169.254.169.254 cut",  # the metadata address: the gate refuses it
        "10.211.0.1 cut",  # the host's side of a link
    ], out
    assert alpha.get(f"/api/v1/sandboxes/{name}/network").json()["refused"] == 2
    alpha.delete(f"/api/v1/sandboxes/{name}")


def test_bad_policies_and_other_tenants(gated: Deployment, alpha: httpx.Client) -> None:
    for bad, says in (
        ({"allow_out": ["not a domain"]}, "neither a domain"),
        ({"allow_out": ["fd00::/8"]}, "IPv4 only"),
        ({"allow_out": "pypi.org"}, "allow_out"),
    ):
        refused = alpha.post("/api/v1/sandboxes", json={"network": bad})
        assert refused.status_code in (400, 422), refused.text
        assert says in refused.text, refused.text
    made = alpha.post("/api/v1/sandboxes", json={}).json()["name"]
    with gated.client("beta") as beta:
        assert (
            beta.put(f"/api/v1/sandboxes/{made}/network", json={"network": True}).status_code == 404
        )
        assert beta.get(f"/api/v1/sandboxes/{made}/network").status_code == 404
    bad_put = alpha.put(f"/api/v1/sandboxes/{made}/network", json={"network": {"x": []}})
    assert bad_put.status_code in (400, 422)
    alpha.delete(f"/api/v1/sandboxes/{made}")


def test_e2b_sdk_network_config(gated: Deployment, internet: Internet) -> None:
    e2b = sdk.E2B(gated.keys["alpha"], gated.url)
    sbx: Sandbox = e2b.create(network={"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0"]})
    try:
        sbx.files.write("/home/user/ca.pem", internet.ca_pem.read_text())
        script = textwrap.dedent(PROBE).replace("/workspace/ca.pem", "ca.pem")
        sbx.files.write("/home/user/probe.py", script)
        denied = f"http://denied.test@{internet.addresses['denied.test']}"
        allowed = f"http://allowed.test@{internet.addresses['allowed.test']}"
        seen = json.loads(sbx.commands.run(f"python3 probe.py {allowed} {denied}").stdout)
        assert seen[allowed].startswith("host=allowed")
        assert seen[denied] == "cut"
        info = Sandbox.get_info(sbx.sandbox_id, **e2b.options())
        assert info.allow_internet_access is True
        sbx.update_network({"allow_out": ["denied.test"], "deny_out": ["0.0.0.0/0"]})
        seen = json.loads(sbx.commands.run(f"python3 probe.py {allowed} {denied}").stdout)
        assert seen[denied].startswith("host=denied")
        assert seen[allowed] == "cut"
    finally:
        sbx.kill()
    closed = e2b.create(allow_internet_access=False)
    try:
        devs = closed.commands.run("cut -d: -f1 /proc/net/dev | tail -n +3 | tr -d ' '").stdout
        assert devs.split() == ["lo"]
    finally:
        closed.kill()


def test_sdk_and_cli(gated: Deployment, internet: Internet) -> None:
    from sandgate.client import Sandgate

    with Sandgate(gated.url, gated.keys["alpha"]) as client:
        box = client.sandboxes.create(network={"allow_out": ["allowed.test"]})
        try:
            assert box.network is True
            assert box.network_policy == {"allow_out": ["allowed.test"], "deny_out": []}
            state = box.set_network({"deny_out": [internet.addresses["denied.test"]]})
            assert state.network == {
                "allow_out": [],
                "deny_out": [internet.addresses["denied.test"]],
            }
            assert box.network_policy == state.network
            denied = f"http://denied.test@{internet.addresses['denied.test']}"
            code = (
                "import socket; s = socket.create_connection(("
                f"{internet.addresses['denied.test']!r}, 80), timeout=5); s.sendall(b'x'); "
                "print(s.recv(10) or b'cut')"
            )
            ran = box.run(code, language="python")
            assert "cut" in ran.stdout or "ConnectionResetError" in ran.stderr, denied
            cli = sandgate_cli(gated, "sandbox", "network", box.name)
            assert cli.returncode == 0, cli.stderr
            assert f"deny_out: {internet.addresses['denied.test']}" in cli.stdout
            assert "1 refused" in cli.stdout
            assert f"{internet.addresses['denied.test']}:80: " in cli.stdout
            off = sandgate_cli(gated, "sandbox", "network", box.name, "--off")
            assert "network: off (loopback only)" in off.stdout, off.stdout + off.stderr
            assert client.sandboxes.network_state(box.name).network is False
        finally:
            box.delete()


def sandgate_cli(dep: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    """`sandgate ARGS --url … --api-key …` as alpha."""
    return subprocess.run(
        [
            str(Path(sys.executable).parent / "sandgate"),
            *args,
            "--url",
            dep.url,
            "--api-key",
            dep.keys["alpha"],
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
