"""Sandbox networks across instances on one PostgreSQL database.

A bwrap worker dials instance A; its gate may reach the tests' own internet hosts. A sandbox
created through B with an allowlist gets it from the create job A delivers; B changes and
reads its policy (the worker's `set_network` and `network` calls are forwarded to A, the
tunnel's owner), and what the sandbox reaches follows."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sandgate.cli import launch as launcher
from tests.e2e.conftest import WORKER, Cluster, running_cluster
from tests.nethosts import Internet

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.bwrap]


@pytest.fixture(scope="module")
def cluster(
    pg_dsn: str, tmp_path_factory: pytest.TempPathFactory, internet: Internet
) -> Iterator[Cluster]:
    if os.geteuid() != 0 or shutil.which("bwrap") is None or shutil.which("nft") is None:
        pytest.skip("the egress gate needs root, bubblewrap and nftables")
    with running_cluster(pg_dsn, tmp_path_factory.mktemp("network"), worker=False) as cl:
        via = cl.instances["A"]
        log_path = cl.base / f"worker-{WORKER}.log"
        argv = launcher.worker_argv(
            via.url,
            WORKER,
            runtime="bwrap",
            capacity=8,
            state_dir=cl.state_dir / WORKER,
            extra=("--egress-permit", internet.subnet, "--egress-resolver", internet.resolver),
        )
        cl.worker = launcher.start(
            argv, log=log_path, env=launcher.child_env(token=cl.worker_token, faults="")
        )
        cl.worker_log = log_path
        cl.wait_connected(via)
        yield cl


def fetch(client: httpx.Client, sandbox: str, name: str, address: str) -> str:
    """The first line of http://{name}/ fetched at `address` from inside the sandbox."""
    code = (
        "import socket\n"
        "try:\n"
        f"    s = socket.create_connection(({address!r}, 80), timeout=5)\n"
        f"    s.sendall(b'GET / HTTP/1.1\\r\\nHost: {name}\\r\\nConnection: close\\r\\n\\r\\n')\n"
        "    got = b''\n"
        "    while chunk := s.recv(65536):\n"
        "        got += chunk\n"
        "    print(got.split(b'\\r\\n\\r\\n', 1)[-1].split(b'\\n')[0].decode() or 'cut')\n"
        "except ConnectionResetError:\n"
        "    print('cut')\n"
    )
    ran = client.post(
        f"/api/v1/sandboxes/{sandbox}/execute",
        json={"language": "python", "code": code, "timeout": 30},
        timeout=60,
    )
    assert ran.status_code == 200, ran.text
    body: dict[str, Any] = ran.json()
    return str(body["stdout"]).strip()


def test_a_policy_set_and_read_through_the_other_instance(
    cluster: Cluster, internet: Internet
) -> None:
    allowed, denied = internet.addresses["allowed.test"], internet.addresses["denied.test"]
    with cluster.client("B") as b:
        made = b.post("/api/v1/sandboxes", json={"network": {"allow_out": ["allowed.test"]}})
        assert made.status_code == 201, made.text
        name = made.json()["name"]
        assert fetch(b, name, "allowed.test", allowed).startswith("host=allowed")
        assert fetch(b, name, "denied.test", denied) == "cut"
        changed = b.put(
            f"/api/v1/sandboxes/{name}/network", json={"network": {"allow_out": ["denied.test"]}}
        )
        assert changed.status_code == 200, changed.text
        assert fetch(b, name, "denied.test", denied).startswith("host=denied")
        assert fetch(b, name, "allowed.test", allowed) == "cut"
        state = b.get(f"/api/v1/sandboxes/{name}/network").json()
        assert state["network"] == {"allow_out": ["denied.test"], "deny_out": []}
        assert state["allowed"] == 2 and state["refused"] == 2
    with cluster.client("A") as a:
        shown = a.get(f"/api/v1/sandboxes/{name}").json()
        assert shown["network_policy"] == {"allow_out": ["denied.test"], "deny_out": []}
        a.delete(f"/api/v1/sandboxes/{name}")
