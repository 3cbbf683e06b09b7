"""PTY terminals over the real WebSocket, and the tokens that open them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.integration.api.conftest import Deployment, wait_until


def ws_url(dep: Deployment, name: str, **query: str) -> str:
    params = "&".join(f"{k}={v}" for k, v in query.items())
    return dep.url.replace("http://", "ws://") + f"/api/v1/sandboxes/{name}/toolbox/pty?{params}"


async def read_until(ws: ClientConnection, needle: bytes) -> bytes:
    seen = b""
    async with asyncio.timeout(15):
        while needle not in seen:
            message = await ws.recv()
            if isinstance(message, bytes):
                seen += message
    return seen


async def echo_resize_exit(ws: ClientConnection) -> dict[str, object] | None:
    """Drive a 100x30 terminal: echo, `stty size`, resize to 120x50, `exit 7`.

    Returns the server's last control message (the exit). Shared with the e2e test that
    runs the same session through an instance that does not hold the tunnel."""
    await ws.send(b"stty size; echo hi-$((40+2))\r")
    out = await read_until(ws, b"hi-42")
    assert b"30 100" in out
    await ws.send(json.dumps({"type": "resize", "cols": 120, "rows": 50}))
    await ws.send(b"stty size\r")
    assert b"50 120" in await read_until(ws, b"50 120")
    await ws.send(b"exit 7\r")
    final = None
    try:
        while True:
            message = await asyncio.wait_for(ws.recv(), 15)
            if isinstance(message, str):
                final = json.loads(message)
    except ConnectionClosed:
        pass
    return final


def test_echo_resize_and_exit(deployment: Deployment, sandbox: str) -> None:
    async def session() -> None:
        headers = {"Authorization": f"Bearer {deployment.keys['alpha']}"}
        url = ws_url(deployment, sandbox, cols="100", rows="30", command="bash")
        async with connect(url, additional_headers=headers) as ws:
            assert await echo_resize_exit(ws) == {"type": "exit", "exit_code": 7}

    asyncio.run(session())


def test_closing_the_socket_ends_the_shell(
    deployment: Deployment, alpha: httpx.Client, sandbox: str
) -> None:
    def markers() -> str:
        left = alpha.post(
            f"/api/v1/sandboxes/{sandbox}/execute",
            json={"code": "ps -eo args | grep -c '[p]ty-marker' || true"},
        )
        return str(left.json()["stdout"].strip())

    async def session() -> None:
        headers = {"Authorization": f"Bearer {deployment.keys['alpha']}"}
        async with connect(ws_url(deployment, sandbox), additional_headers=headers) as ws:
            await ws.send(b"exec -a pty-marker-sleep sleep 300\r")
            await asyncio.to_thread(
                wait_until, lambda: markers() == "1", what="the shell exec'd the marker"
            )

    asyncio.run(session())
    wait_until(lambda: markers() == "0", what="the marker gone after the socket closed")


def test_tokens(
    deployment: Deployment, alpha: httpx.Client, beta: httpx.Client, sandbox: str
) -> None:
    issued = alpha.post(f"/api/v1/sandboxes/{sandbox}/toolbox/pty-token", json={"ttl": 1})
    assert issued.status_code == 201, issued.text
    token = issued.json()["token"]
    assert beta.post(f"/api/v1/sandboxes/{sandbox}/toolbox/pty-token").status_code == 404

    async def open_with(name: str, tok: str) -> int | None:
        try:
            async with connect(ws_url(deployment, name, token=tok)) as ws:
                await ws.send(b"echo via-token\r")
                await read_until(ws, b"via-token")
                return None
        except InvalidStatus as refused:
            return refused.response.status_code

    assert asyncio.run(open_with(sandbox, token)) is None  # no header needed
    other = alpha.post("/api/v1/sandboxes", json={}).json()["name"]
    try:
        assert asyncio.run(open_with(other, token)) == 401  # for one sandbox only
    finally:
        alpha.delete(f"/api/v1/sandboxes/{other}")
    wait_until(  # expired: the token's ttl is 1 s
        lambda: asyncio.run(open_with(sandbox, token)) == 401, what="the token expired"
    )
    assert asyncio.run(open_with(sandbox, token[:-2] + "xx")) == 401  # forged


@pytest.mark.parametrize("query", [{"cols": "0"}, {"rows": "abc"}, {"cols": "5000"}])
def test_bad_sizes_are_refused(deployment: Deployment, sandbox: str, query: dict[str, str]) -> None:
    async def attempt() -> int:
        headers = {"Authorization": f"Bearer {deployment.keys['alpha']}"}
        try:
            async with connect(ws_url(deployment, sandbox, **query), additional_headers=headers):
                return 101
        except InvalidStatus as refused:
            return refused.response.status_code

    assert asyncio.run(attempt()) == 400


def test_no_credentials_or_other_tenant(deployment: Deployment, sandbox: str) -> None:
    async def attempt(headers: dict[str, str]) -> int:
        try:
            async with connect(ws_url(deployment, sandbox), additional_headers=headers):
                return 101
        except InvalidStatus as refused:
            return refused.response.status_code

    assert asyncio.run(attempt({})) == 401
    beta = {"Authorization": f"Bearer {deployment.keys['beta']}"}
    assert asyncio.run(attempt(beta)) == 404
