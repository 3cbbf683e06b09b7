"""A sandbox's ports through an instance that does not hold the worker's tunnel.

Worker w1 dials instance A; these tests talk to instance B, so every call of a proxied
request (port_open, the writes, the long-polled reads, the close: control/ports.py) is
forwarded by B to A, the tunnel owner, as the toolbox's are. Nothing of a connection is kept
in either control plane but its number, so HTTP, server-sent events and a WebSocket work
through B as through A; a preview URL made on A works on B (the token is signed with the
shared secret); and the host form `{port}-{name}.<domain>` (E2B's `get_host(port)`) is
routed on B, with a preview token or E2B's traffic token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox
from websockets.asyncio.client import connect

from tests.e2b_scenarios import E2B
from tests.e2e.conftest import Cluster, running_cluster
from tests.integration.api.conftest import free_port
from tests.port_server import ports, start

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

DOMAIN = "sbx.test"


@pytest.fixture(scope="module")
def cluster(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A and B with a preview domain; w1 dials A."""
    extra = ("--e2b-domain", DOMAIN)
    with running_cluster(pg_dsn, tmp_path_factory.mktemp("ports"), extra=extra) as cl:
        yield cl


@pytest.fixture(scope="module")
def served(cluster: Cluster) -> Iterator[tuple[str, int]]:
    """A sandbox created through B, running the test server (the e2e runtime shares the
    host's loopback, so the port is a free one)."""
    port = free_port()
    with cluster.client("B") as b:
        made = b.post("/api/v1/sandboxes", json={"timeout": 900})
        assert made.status_code == 201, made.text
        name: str = made.json()["name"]
        start(b, name, port)
        try:
            yield name, port
        finally:
            b.delete(f"/api/v1/sandboxes/{name}")


def test_the_tunnel_is_on_a(cluster: Cluster) -> None:
    owner = cluster.owner()
    assert owner is not None and owner[0] == cluster.instances["A"].url


def test_http_through_the_other_instance(cluster: Cluster, served: tuple[str, int]) -> None:
    name, port = served
    with cluster.client("B") as b:
        base = ports(name, port)
        assert b.get(f"{base}/hello.txt").text == "hello\n"
        body = bytes(range(256)) * 8192  # 2 MiB: streamed in writes
        assert b.post(f"{base}/echo", content=body).content == body
        arrived = []
        with b.stream("GET", f"{base}/sse") as answer:
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    arrived.append((time.time(), float(line.split()[2])))
        assert len(arrived) == 3
        assert all(at - sent < 0.5 for at, sent in arrived), arrived  # streamed through B


def test_websocket_through_the_other_instance(cluster: Cluster, served: tuple[str, int]) -> None:
    name, port = served
    url = cluster.instances["B"].url.replace("http://", "ws://") + f"{ports(name, port)}/ws"

    async def session() -> None:
        headers = {"Authorization": f"Bearer {cluster.key}"}
        async with connect(url, additional_headers=headers) as ws:
            for n in range(10):
                await ws.send(f"hello {n}")
                assert await ws.recv() == f"hello {n}"
            await ws.send(b"\x00" * 100_000)
            assert await ws.recv() == b"\x00" * 100_000

    asyncio.run(session())


def test_a_preview_made_on_a_opens_on_b(cluster: Cluster, served: tuple[str, int]) -> None:
    name, port = served
    with cluster.client("A") as a:
        preview = a.post(f"{ports(name, port)}/preview", json={"ttl": 600}).json()
    assert preview["host_url"] == (
        f"http://{port}-{name}.{DOMAIN}/?sandgate_preview={preview['token']}"
    )
    b_url = cluster.instances["B"].url
    on_b = preview["url"].replace(cluster.instances["A"].url, b_url)
    with httpx.Client(timeout=30) as browser:  # no API key
        opened = browser.get(on_b)
        assert opened.status_code == 200 and "hello.txt" in opened.text
        assert browser.get(f"{b_url}{ports(name, port)}/hello.txt").text == "hello\n"  # cookie

        # the host form, on B: the path is the server's own, the cookie the whole host's
        host = {"Host": f"{port}-{name}.{DOMAIN}"}
        by_host = browser.get(
            f"{b_url}/hello.txt", params={"sandgate_preview": preview["token"]}, headers=host
        )
        assert by_host.status_code == 200 and by_host.text == "hello\n"
        assert "Path=/;" in by_host.headers["set-cookie"]
        seen = browser.get(f"{b_url}/headers", headers={**host, "Cookie": _cookie(by_host)})
        assert seen.status_code == 200, seen.text
        assert seen.json()["path"] == "/headers"
        assert dict(seen.json()["headers"])["host"] == host["Host"]  # kept on the host form
    with httpx.Client(timeout=30) as stranger:
        assert stranger.get(f"{b_url}/hello.txt", headers=host).status_code == 401


def test_e2b_get_host_with_the_traffic_token(cluster: Cluster) -> None:
    """E2B's SDK: `sandbox.get_host(port)` is `{port}-{id}.<domain>`; sandgate wants the
    sandbox's `traffic_access_token` there (E2B's header for restricted public traffic)."""
    b_url = cluster.instances["B"].url
    sbx = E2B(cluster.key, b_url).create(timeout=600)
    try:
        port = free_port()
        sbx.files.write(
            "/home/user/app.py",
            f"import http.server as h; h.test(port={port}, "
            "bind='127.0.0.1', HandlerClass=h.SimpleHTTPRequestHandler)",
        )
        sbx.files.write("/home/user/index.html", "<h1>from e2b</h1>")
        sbx.commands.run("python3 app.py", background=True)
        host = sbx.get_host(port)
        assert host == f"{port}-{sbx.sandbox_id}.{DOMAIN}"
        token = sbx.traffic_access_token
        assert token
        with httpx.Client(base_url=b_url, timeout=30) as client:
            deadline = time.monotonic() + 20
            while True:
                got = client.get("/", headers={"Host": host, "E2B-Traffic-Access-Token": token})
                if got.status_code == 200 or time.monotonic() > deadline:
                    break
                assert got.status_code == 502, got.text
                time.sleep(0.2)
            assert got.status_code == 200 and "<h1>from e2b</h1>" in got.text
            assert client.get("/", headers={"Host": host}).status_code == 401
            wrong = client.get("/", headers={"Host": host, "E2B-Traffic-Access-Token": "x"})
            assert wrong.status_code == 401
            # envd's own port on the host form is still envd
            envd = client.get("/health", headers={"Host": f"49983-{sbx.sandbox_id}.{DOMAIN}"})
            assert envd.status_code == 401 and "X-Access-Token" in envd.text, envd.text
    finally:
        Sandbox.kill(sbx.sandbox_id, api_key=cluster.key, api_url=b_url)


def _cookie(response: httpx.Response) -> str:
    return response.headers["set-cookie"].split(";", 1)[0]
