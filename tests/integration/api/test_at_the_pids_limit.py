"""A sandbox whose processes keep its pids limit full can still end them through the API.

A fork bomb (a background process that forks until refused, then keeps trying) leaves its
sandbox's agent no thread to start: every request that finds no idle one is refused with
429 until processes end. The requests that end processes are the way out, so they are
served anyway.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import datetime
from urllib.parse import urlencode

import httpx
import pytest
from e2b import Sandbox
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from tests.e2b_scenarios import E2B
from tests.integration.api.conftest import RUNTIME, Deployment, wait_until
from tests.integration.api.test_isolation import limited_sandbox

pytestmark = pytest.mark.skipif(RUNTIME != "bwrap", reason="pid limits need the bwrap runtime")

BOMB = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except BlockingIOError:  # the limit: try again, so that no pid stays free\n"
    "        time.sleep(0.005)\n"
    "        continue\n"
    "    if pid == 0:\n"
    "        time.sleep(600)\n"
    "        os._exit(0)\n"
)
FOLLOWERS = 6  # more than the agent keeps idle threads (4): every one of them is taken


def procs(name: str) -> str:
    return f"/api/v1/sandboxes/{name}/toolbox/processes"


def start_bomb(client: httpx.Client, name: str) -> int:
    """The bomb started as a background process, and the limit full (its pid)."""
    written = client.put(f"/api/v1/sandboxes/{name}/toolbox/files?path=bomb.py", content=BOMB)
    assert written.is_success, written.text
    started = client.post(procs(name), json={"command": "exec python3 bomb.py"})
    assert started.status_code == 201, started.text
    time.sleep(1.0)  # forks take a few ms each: 32 pids are full long before
    return int(started.json()["pid"])


def state_of(client: httpx.Client, name: str, pid: int) -> str:
    """The process's state, asked again while the agent answers 429 (the limit)."""
    deadline = time.monotonic() + 20
    while True:
        got = client.get(f"{procs(name)}/{pid}")
        if got.status_code != 429 or time.monotonic() > deadline:
            assert got.status_code == 200, got.text
            return str(got.json()["state"])
        time.sleep(0.2)


def wait_exited(client: httpx.Client, name: str, pid: int) -> None:
    wait_until(lambda: state_of(client, name, pid) == "exited", what=f"process {pid} exited")


def hold_every_thread(client: httpx.Client, name: str, pid: int) -> list[threading.Thread]:
    """Followers of the bomb's output, each in a long poll that holds an agent thread until
    the bomb ends: with no pid free for another thread, none is left for a request."""

    def follow() -> None:
        try:
            with client.stream("GET", f"{procs(name)}/{pid}/stream", timeout=60) as response:
                for _ in response.iter_bytes():  # long polls, until the bomb ends
                    pass
        except httpx.HTTPError:
            pass  # refused (the limit) or cut short: it holds no thread either way

    followers = [threading.Thread(target=follow, daemon=True) for _ in range(FOLLOWERS)]
    for follower in followers:
        follower.start()
    time.sleep(1.5)  # each follower is now in a long poll, or was refused
    return followers


def join(followers: list[threading.Thread]) -> None:
    deadline = time.monotonic() + 30
    for follower in followers:
        follower.join(timeout=max(0.0, deadline - time.monotonic()))


def exited_at(client: httpx.Client, name: str, pid: int) -> datetime:
    return datetime.fromisoformat(client.get(f"{procs(name)}/{pid}").json()["exited_at"])


def test_a_fork_bomb_is_killed_while_every_agent_thread_is_taken(alpha: httpx.Client) -> None:
    """With every idle agent thread held by a follower's long poll and no pid free for
    another, the signal that would stop the bomb was refused (429) for as long as the bomb
    ran, which is forever. The agent's reading thread serves it itself now."""
    with limited_sandbox(alpha, pids=32) as name:
        bomb = start_bomb(alpha, name)
        followers = hold_every_thread(alpha, name, bomb)
        killed = alpha.post(f"{procs(name)}/{bomb}/signal", json={"signal": "SIGKILL"})
        assert killed.status_code == 200, killed.text
        wait_exited(alpha, name, bomb)
        join(followers)
        deadline = time.monotonic() + 20
        while True:  # the bomb's children, killed with it, are reaped: the sandbox serves
            again = alpha.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "echo ok"})
            if again.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert again.status_code == 200 and again.json()["stdout"] == "ok\n", again.text
        assert alpha.get(f"/api/v1/sandboxes/{name}").json()["state"] == "running"


def test_a_terminal_closed_at_the_pids_limit_is_killed(
    deployment: Deployment, alpha: httpx.Client
) -> None:
    """A terminal's close sends SIGHUP, then SIGKILL after a grace counted on a timer
    thread. At the limit, with every agent thread taken, the close was refused (429), and
    when an idle thread took it the timer could not start (io_error): either way, which the
    WebSocket's end swallows, a terminal that ignored the hangup ran on. Now the reading
    thread serves the close and sends SIGKILL at once."""
    with limited_sandbox(alpha, pids=32) as name:
        query = urlencode({"command": "trap '' HUP; exec sleep 600"})
        url = deployment.url.replace("http://", "ws://")
        url += f"/api/v1/sandboxes/{name}/toolbox/pty?{query}"
        headers = {"Authorization": f"Bearer {deployment.keys['alpha']}"}

        def terminal() -> int | None:
            listed = alpha.get(procs(name)).json()["processes"]
            return next((int(p["pid"]) for p in listed if p["terminal"]), None)

        async def open_then_close() -> tuple[int, int, list[threading.Thread]]:
            async with connect(url, additional_headers=headers):
                await asyncio.to_thread(wait_until, terminal, what="the terminal listed")
                pid = terminal()
                assert pid is not None
                bomb = await asyncio.to_thread(start_bomb, alpha, name)
                followers = await asyncio.to_thread(hold_every_thread, alpha, name, bomb)
                return pid, bomb, followers

        shell, bomb, followers = asyncio.run(open_then_close())  # leaving it closes it
        time.sleep(1.0)  # the close reaches the agent while the bomb holds the limit
        killed = alpha.post(f"{procs(name)}/{bomb}/signal", json={"signal": "SIGKILL"})
        assert killed.status_code == 200, killed.text
        wait_exited(alpha, name, bomb)
        join(followers)
        wait_exited(alpha, name, shell)
        # it ended while the limit was full, not once the bomb had let go
        assert exited_at(alpha, name, shell) < exited_at(alpha, name, bomb)


def test_an_e2b_kill_reaches_a_sandbox_at_its_pids_limit(
    deployment: Deployment, alpha: httpx.Client
) -> None:
    """E2B's `commands.kill` looked the process up first (to answer NOT_FOUND for one that
    is gone), and at the limit the look-up was refused: the kill failed with the bomb
    running. Now a look-up refused for the pids limit does not stop the signal."""
    with limited_sandbox(alpha, pids=32) as name:
        bomb = start_bomb(alpha, name)
        followers = hold_every_thread(alpha, name, bomb)
        sandbox = Sandbox.connect(name, **E2B(deployment.keys["alpha"], deployment.url).options())
        assert sandbox.commands.kill(bomb) is True
        wait_exited(alpha, name, bomb)
        join(followers)
        assert sandbox.commands.kill(bomb) is False  # gone now: NOT_FOUND, as before


def test_a_context_restarted_at_the_limit_fails_at_once_and_says_why(
    alpha: httpx.Client,
) -> None:
    """A restart whose new kernel could not start (the bomb took its pids) was seen only as
    silence: the call waited out its 60 s and answered 500. The bridge's error now ends it
    at once, as the worker's error, naming the limits a kernel needs room in."""
    with limited_sandbox(alpha, pids=32) as name:
        made = alpha.post(f"/api/v1/sandboxes/{name}/contexts", json={"language": "python"})
        assert made.status_code == 201, made.text
        start_bomb(alpha, name)
        started = time.monotonic()
        restarted = alpha.post(
            f"/api/v1/sandboxes/{name}/contexts/{made.json()['id']}/restart", timeout=90
        )
        assert time.monotonic() - started < 30
        # Either the new kernel started and died for want of pids (502, the bridge's error),
        # or the bomb had retaken the pids the old kernel freed before the new one could be
        # spawned at all (429, retry later): which one is a race with the bomb's forks, and
        # both answer at once and name the limit.
        assert restarted.status_code in (502, 429), restarted.text
        assert "resources.pids" in restarted.json()["error"]["message"]
        if restarted.status_code == 429:
            assert restarted.json()["error"]["code"] == "limit_exceeded", restarted.text
            assert restarted.headers["Retry-After"] == "1"


def test_a_kernel_with_no_room_to_start_is_a_worker_error_that_names_the_limits(
    alpha: httpx.Client,
) -> None:
    """An IPython kernel's processes and threads do not fit in 16 pids: it died starting,
    and the create answered 500 with an opaque message."""
    with limited_sandbox(alpha, pids=16) as name:
        made = alpha.post(f"/api/v1/sandboxes/{name}/contexts", json={"language": "python"})
        assert made.status_code == 502, made.text
        assert made.json()["error"]["code"] == "worker_error"
        assert "resources.pids" in made.json()["error"]["message"]


def test_refusals_at_the_limit_say_when_to_retry(
    deployment: Deployment, alpha: httpx.Client
) -> None:
    """The code interpreter's routes and a terminal's WebSocket answered the pids limit's
    429 without `Retry-After` (the terminal's without the limit named in its body either)."""
    with limited_sandbox(alpha, pids=32) as name:
        sandbox = Sandbox.connect(name, **E2B(deployment.keys["alpha"], deployment.url).options())
        start_bomb(alpha, name)
        headers = {
            "E2b-Sandbox-Id": name,
            "E2b-Sandbox-Port": "49999",
            "X-Access-Token": str(sandbox._envd_access_token),
        }
        for path, body in (("/execute", {"code": "1"}), ("/contexts", {"language": "python"})):
            refused = httpx.post(f"{deployment.url}{path}", json=body, headers=headers, timeout=30)
            assert refused.status_code == 429, (path, refused.text)
            assert refused.headers["Retry-After"] == "1", path

        async def open_terminal() -> None:
            url = (
                deployment.url.replace("http://", "ws://") + f"/api/v1/sandboxes/{name}/toolbox/pty"
            )
            auth = {"Authorization": f"Bearer {deployment.keys['alpha']}"}
            async with connect(url, additional_headers=auth):
                raise AssertionError("a terminal opened at the limit")

        with pytest.raises(InvalidStatus) as denied:
            asyncio.run(open_terminal())
        response = denied.value.response
        assert response.status_code == 429 and response.headers["Retry-After"] == "1"
        assert json.loads(response.body)["error"]["limit"] == "pids"


async def read_until(ws: ClientConnection, needle: bytes, seconds: float) -> None:
    seen = b""
    async with asyncio.timeout(seconds):
        while needle not in seen:
            message = await ws.recv()
            seen += message if isinstance(message, bytes) else message.encode()


async def bash_at_the_limit(
    ws: ClientConnection, client: httpx.Client, name: str
) -> tuple[int, list[threading.Thread]]:
    """A terminal's shell seen answering, then the bomb started and every agent thread
    taken (the bomb's pid and the followers holding the threads)."""
    await ws.send(b"echo ready-$((1+1))\r")
    await read_until(ws, b"ready-2", 15)
    bomb = await asyncio.to_thread(start_bomb, client, name)
    return bomb, await asyncio.to_thread(hold_every_thread, client, name, bomb)


def test_a_terminal_in_use_outlives_a_moment_at_the_limit(
    deployment: Deployment, alpha: httpx.Client
) -> None:
    """Keys typed while no agent thread could take them were refused (429), and the refusal
    ended the terminal's session, the shell with it. Now they are sent again once the
    limit passes, and the shell answers."""
    with limited_sandbox(alpha, pids=32) as name:
        url = deployment.url.replace("http://", "ws://")
        url += f"/api/v1/sandboxes/{name}/toolbox/pty?command=bash"
        headers = {"Authorization": f"Bearer {deployment.keys['alpha']}"}

        async def session() -> None:
            async with connect(url, additional_headers=headers) as ws:
                bomb, followers = await bash_at_the_limit(ws, alpha, name)
                await ws.send(b"echo hi-$((40+2))\r")  # refused: no thread takes it
                await asyncio.sleep(1.5)
                killed = await asyncio.to_thread(
                    alpha.post, f"{procs(name)}/{bomb}/signal", json={"signal": "SIGKILL"}
                )
                assert killed.status_code == 200, killed.text
                await read_until(ws, b"hi-42", 30)  # the shell got the keys, and answered
                await asyncio.to_thread(join, followers)

        asyncio.run(session())


def test_keys_waiting_out_the_limit_never_reach_the_shell_once_the_client_left(
    deployment: Deployment, alpha: httpx.Client
) -> None:
    """Keys the agent refused for the limit are sent again, but only while their client is
    there: sent once it had left, they would run a command nobody is watching."""
    with limited_sandbox(alpha, pids=32) as name:
        url = deployment.url.replace("http://", "ws://")
        url += f"/api/v1/sandboxes/{name}/toolbox/pty?command=bash"
        headers = {"Authorization": f"Bearer {deployment.keys['alpha']}"}
        files = f"/api/v1/sandboxes/{name}/toolbox/files"

        async def type_then_leave() -> tuple[int, list[threading.Thread]]:
            async with connect(url, additional_headers=headers) as ws:
                bomb, followers = await bash_at_the_limit(ws, alpha, name)
                await ws.send(b"touch /workspace/typed-then-left\r")  # refused: no thread
            return bomb, followers

        bomb, followers = asyncio.run(type_then_leave())
        time.sleep(1.5)  # the server saw the client leave while the keys waited
        killed = alpha.post(f"{procs(name)}/{bomb}/signal", json={"signal": "SIGKILL"})
        assert killed.status_code == 200, killed.text
        wait_exited(alpha, name, bomb)
        join(followers)
        watched_until = time.monotonic() + 8  # keys still being sent arrive within ~2 s
        while time.monotonic() < watched_until:
            assert alpha.get(files, params={"path": "typed-then-left"}).status_code == 404
            time.sleep(0.25)


def test_an_e2b_kill_at_the_pids_limit_of_a_process_that_has_exited_is_false(
    deployment: Deployment, alpha: httpx.Client
) -> None:
    """At the limit the look-up before the signal is refused, and the signal is sent blind:
    for a process that had exited (still listed, for its output) the kill answered True,
    though nothing was signalled. The signal's answer now says the process had ended, and
    the kill is NOT_FOUND (False), as it is off the limit."""
    with limited_sandbox(alpha, pids=32) as name:
        done = alpha.post(procs(name), json={"command": "true"})
        assert done.status_code == 201, done.text
        ended = int(done.json()["pid"])
        wait_exited(alpha, name, ended)
        bomb = start_bomb(alpha, name)
        followers = hold_every_thread(alpha, name, bomb)
        sandbox = Sandbox.connect(name, **E2B(deployment.keys["alpha"], deployment.url).options())
        assert sandbox.commands.kill(ended) is False
        assert sandbox.commands.kill(bomb) is True
        wait_exited(alpha, name, bomb)
        join(followers)
