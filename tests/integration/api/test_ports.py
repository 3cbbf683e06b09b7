"""A server inside a sandbox, reached through the control plane: `/ports/{port}/...` with the
API key, preview URLs without one, HTTP (bodies both ways, server-sent events) and WebSocket.

The sandboxes here have no network (the default): the proxy reaches 127.0.0.1 inside the
sandbox through its agent. The server is tests/port_server.py, run by the sandbox's Python.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from sandgate.client import AsyncSandgate, NotFoundError, Sandgate
from tests.integration.api.conftest import Deployment, sandgate, wait_until
from tests.port_server import ports, start

PORT = 8000


@pytest.fixture(scope="module")
def served(deployment: Deployment) -> Iterator[str]:
    """A sandbox made without network (`network: false`) running the test server on PORT."""
    with deployment.client("alpha") as alpha:
        made = alpha.post("/api/v1/sandboxes", json={"network": False, "timeout": 900})
        assert made.status_code == 201, made.text
        name: str = made.json()["name"]
        assert made.json()["network"] is False
        start(alpha, name, PORT)
        try:
            yield name
        finally:
            alpha.delete(f"/api/v1/sandboxes/{name}")


def test_get_post_and_headers_with_the_api_key(alpha: httpx.Client, served: str) -> None:
    base = ports(served, PORT)
    got = alpha.get(f"{base}/hello.txt")
    assert got.status_code == 200, got.text
    assert got.text == "hello\n"
    assert got.headers["content-type"] == "text/plain"
    assert alpha.get(f"{base}/missing").status_code == 404  # the server's own answer
    head = alpha.head(f"{base}/hello.txt")
    assert head.status_code == 200 and head.headers["content-length"] == "6"

    body = bytes(range(256)) * 4096  # 1 MiB, with a Content-Length: streamed in pieces
    echoed = alpha.post(f"{base}/echo", content=body, headers={"Content-Type": "x/y"})
    assert echoed.status_code == 200, echoed.text
    assert echoed.content == body and echoed.headers["content-type"] == "x/y"
    small = alpha.put(f"{base}/echo", content=b"small")  # travels with the head
    assert small.content == b"small"

    def pieces() -> Iterator[bytes]:  # no Content-Length: chunked on to the server
        for n in range(5):
            yield b"piece-%d;" % n

    chunked = alpha.post(f"{base}/echo", content=pieces())
    assert chunked.content == b"piece-0;piece-1;piece-2;piece-3;piece-4;"

    seen = alpha.get(f"{base}/headers?a=1&b=2", headers={"X-Mine": "yes"}).json()
    headers = dict(seen["headers"])
    assert seen["path"] == "/headers?a=1&b=2"
    assert headers["host"] == f"localhost:{PORT}"
    assert headers["x-mine"] == "yes"
    assert headers["connection"] == "close"
    assert headers["x-forwarded-prefix"] == base
    assert "authorization" not in headers  # our API key is ours, not the app's


def test_redirects_and_cookies_stay_under_the_prefix(alpha: httpx.Client, served: str) -> None:
    base = ports(served, PORT)
    moved = alpha.get(f"{base}/redirect")
    assert moved.status_code == 302
    assert moved.headers["location"] == f"{base}/hello.txt"
    assert moved.headers["set-cookie"] == f"app=1; Path={base}/"
    bare = alpha.get(base, params={"q": "1"})  # no trailing slash: the page's root
    assert bare.status_code == 307 and bare.headers["location"] == f"{base}/?q=1"


def test_server_sent_events_stream(alpha: httpx.Client, served: str) -> None:
    arrived: list[tuple[float, str]] = []
    with alpha.stream("GET", f"{ports(served, PORT)}/sse") as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "text/event-stream"
        for line in answer.iter_lines():
            if line.startswith("data: "):
                arrived.append((time.time(), line))
        ended = time.time()
    assert [line.split()[1] for _, line in arrived] == ["0", "1", "2"]
    # the server sleeps 0.6 s between events: the first came well before the stream ended
    assert ended - arrived[0][0] > 1.0, arrived
    for at, line in arrived:
        sent = float(line.split()[2])
        assert at - sent < 0.5, (at, line)  # each came as it was written, not at the end


def test_websocket_echo(deployment: Deployment, served: str) -> None:
    url = deployment.url.replace("http://", "ws://") + f"{ports(served, PORT)}/ws"
    headers = {"Authorization": f"Bearer {deployment.keys['alpha']}"}

    async def session() -> None:
        async with connect(url, additional_headers=headers, subprotocols=["chat"]) as ws:  # type: ignore[list-item]
            assert ws.subprotocol == "chat"
            await ws.send("hello")
            assert await ws.recv() == "hello"
            big = bytes(range(256)) * 1024  # 256 KiB, binary
            await ws.send(big)
            assert await ws.recv() == big
            for n in range(20):
                await ws.send(f"m{n}")
            assert [await ws.recv() for _ in range(20)] == [f"m{n}" for n in range(20)]
            await ws.close(1000)
        assert ws.close_code == 1000

    asyncio.run(session())


def test_websocket_refusals(deployment: Deployment, served: str) -> None:
    base = deployment.url.replace("http://", "ws://")

    async def status(path: str, key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            async with connect(base + path, additional_headers=headers):
                return 101
        except InvalidStatus as refused:
            return refused.response.status_code

    alpha, beta = deployment.keys["alpha"], deployment.keys["beta"]
    assert asyncio.run(status(f"{ports(served, PORT)}/ws", None)) == 401
    assert asyncio.run(status(f"{ports(served, PORT)}/ws", beta)) == 404
    assert asyncio.run(status(f"{ports(served, 8009)}/ws", alpha)) == 502  # nothing listens
    assert asyncio.run(status(f"{ports(served, PORT)}/hello.txt", alpha)) == 502  # no WebSocket


def test_preview_urls(deployment: Deployment, alpha: httpx.Client, served: str) -> None:
    base = ports(served, PORT)
    made = alpha.post(f"{base}/preview", json={"ttl": 3})
    assert made.status_code == 201, made.text
    preview = made.json()
    assert set(preview) == {"url", "token", "expires_at", "host_url"}
    assert preview["url"] == f"{deployment.url}{base}/?sandgate_preview={preview['token']}"
    assert preview["host_url"] is None  # no --e2b-domain here

    with httpx.Client(timeout=30) as browser:  # no API key: the URL, then its cookie
        opened = browser.get(preview["url"])
        assert opened.status_code == 200, opened.text
        assert "hello.txt" in opened.text  # the directory listing
        cookie = opened.headers["set-cookie"]
        assert cookie.startswith(f"sandgate_preview={preview['token']}; Path={base}/;")
        assert "HttpOnly" in cookie and "SameSite=Lax" in cookie
        asset = browser.get(f"{deployment.url}{base}/hello.txt")  # the page's own request
        assert asset.status_code == 200 and asset.text == "hello\n"
        seen = browser.get(
            f"{deployment.url}{base}/headers?x=1", headers={"Authorization": "Basic YXBwOg=="}
        ).json()
        headers = dict(seen["headers"])
        assert seen["path"] == "/headers?x=1"
        assert "sandgate_preview" not in headers.get("cookie", "")
        assert headers["authorization"] == "Basic YXBwOg=="  # the app's own, kept
        posted = browser.post(f"{deployment.url}{base}/echo", content=b"no key needed")
        assert posted.content == b"no key needed"  # a body without our credential header

    with httpx.Client(base_url=deployment.url, timeout=30) as stranger:
        token = preview["token"]
        other_port = stranger.get(f"{ports(served, 8001)}/", params={"sandgate_preview": token})
        assert other_port.status_code == 403, other_port.text
        other = alpha.post("/api/v1/sandboxes", json={}).json()["name"]
        try:
            elsewhere = stranger.get(f"{ports(other, PORT)}/", params={"sandgate_preview": token})
            assert elsewhere.status_code == 403, elsewhere.text
        finally:
            alpha.delete(f"/api/v1/sandboxes/{other}")
        forged = stranger.get(f"{base}/", params={"sandgate_preview": token[:-3] + "abc"})
        assert forged.status_code == 401
        assert stranger.get(f"{base}/").status_code == 401  # nothing at all

        def expired() -> bool:
            return stranger.get(f"{base}/", params={"sandgate_preview": token}).status_code == 401

        wait_until(expired, timeout=10, what="the preview token expired")
        refused = stranger.get(f"{base}/", params={"sandgate_preview": token}).json()
        assert "expired" in refused["error"]["message"]


def test_preview_websocket_with_the_token(
    deployment: Deployment, alpha: httpx.Client, served: str
) -> None:
    token = alpha.post(f"{ports(served, PORT)}/preview").json()["token"]
    url = deployment.url.replace("http://", "ws://") + f"{ports(served, PORT)}/ws"

    async def session() -> None:
        async with connect(f"{url}?sandgate_preview={token}") as ws:
            await ws.send("via the token")
            assert await ws.recv() == "via the token"

    asyncio.run(session())


def test_refusals(alpha: httpx.Client, beta: httpx.Client, served: str) -> None:
    assert beta.get(f"{ports(served, PORT)}/hello.txt").status_code == 404  # another tenant's
    assert beta.post(f"{ports(served, PORT)}/preview").status_code == 404
    assert alpha.get(f"{ports('sbx-nosuchthing', PORT)}/").status_code == 404
    silent = alpha.get(f"{ports(served, 8002)}/")
    assert silent.status_code == 502
    error = silent.json()["error"]
    assert error["code"] == "port_not_listening"
    assert "nothing listens on port 8002" in error["message"]
    for bad in ("0", "65536", "http", "-1"):
        refused = alpha.get(f"/api/v1/sandboxes/{served}/ports/{bad}/")
        assert refused.status_code == 400, (bad, refused.text)
    assert alpha.post(f"{ports(served, PORT)}/preview", json={"ttl": 0}).status_code == 422
    too_long = alpha.post(f"{ports(served, PORT)}/preview", json={"ttl": 10**6})
    assert too_long.status_code == 422


def test_a_client_that_goes_away_closes_the_connection(alpha: httpx.Client, served: str) -> None:
    """Leaving an event stream early closes the sandbox's side too (the agent's connection
    is closed by the proxy, not left for its idle timeout)."""

    def open_connections() -> int:
        ran = alpha.post(
            f"/api/v1/sandboxes/{served}/execute",
            # the server's side of established connections to PORT, in the sandbox's netns
            json={"code": f"awk '$4 == \"01\" && $2 ~ /:{PORT:04X}$/' /proc/net/tcp | wc -l"},
        )
        return int(ran.json()["stdout"].strip() or 0)

    with alpha.stream("GET", f"{ports(served, PORT)}/sse") as answer:
        lines = answer.iter_lines()  # kept: a dropped iterator closes the response
        assert next(lines).startswith("data: 0")
        assert open_connections() == 1
        answer.close()  # the client goes away
    wait_until(lambda: open_connections() == 0, timeout=10, what="the connection closed")


def test_many_requests_at_once(alpha: httpx.Client, served: str) -> None:
    async def burst() -> list[int]:
        async with httpx.AsyncClient(
            base_url=str(alpha.base_url), headers=alpha.headers, timeout=60
        ) as client:
            answers = await asyncio.gather(
                *(client.get(f"{ports(served, PORT)}/hello.txt") for _ in range(60))
            )
        return [a.status_code for a in answers]

    assert asyncio.run(burst()) == [200] * 60


def test_the_sandbox_sees_only_its_loopback(alpha: httpx.Client, served: str) -> None:
    """With no network, the server is still reached: the sandbox's only interface is lo."""
    ran = alpha.post(
        f"/api/v1/sandboxes/{served}/execute",
        json={"code": "awk 'NR > 2 {print $1}' /proc/net/dev"},
    )
    assert ran.json()["stdout"].split() == ["lo:"]
    assert alpha.get(f"{ports(served, PORT)}/hello.txt").status_code == 200


def test_the_sdk_and_the_cli_make_previews(deployment: Deployment, served: str) -> None:
    key = deployment.keys["alpha"]
    with Sandgate(deployment.url, key) as client:
        made = client.sandboxes.preview(served, PORT, ttl=60)
        assert made.url.startswith(f"{deployment.url}{ports(served, PORT)}/?sandgate_preview=")
        assert made.host_url is None and made.token in made.url
        again = client.sandboxes.get(served).preview(PORT)
        assert again.expires_at > made.expires_at
    with Sandgate(deployment.url, deployment.keys["beta"]) as other, pytest.raises(NotFoundError):
        other.sandboxes.preview(served, PORT)

    async def via_async() -> str:
        async with AsyncSandgate(deployment.url, key) as client:
            return (await client.sandboxes.preview(served, PORT)).url

    printed = sandgate(
        "sandbox",
        "preview",
        served,
        str(PORT),
        "--url",
        deployment.url,
        "--api-key",
        key,
        "--ttl",
        "60",
    )
    for url in (made.url, asyncio.run(via_async()), printed):
        assert httpx.get(url).text.startswith("<!DOCTYPE HTML>")  # no key needed
