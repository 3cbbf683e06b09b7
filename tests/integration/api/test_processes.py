"""Background processes through the real API: start, follow live over SSE, stdin, signals."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.api.conftest import Deployment, wait_until


def procs(name: str) -> str:
    return f"/api/v1/sandboxes/{name}/toolbox/processes"


def sse(response: httpx.Response) -> Iterator[tuple[str, dict, str]]:  # type: ignore[type-arg]
    """(event, data, id) for each server-sent event."""
    event, data, ident = "message", "", ""
    for line in response.iter_lines():
        if line == "":
            if data:
                yield event, json.loads(data), ident
            event, data, ident = "message", "", ""
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data += line[6:]
        elif line.startswith("id: "):
            ident = line[4:]


def follow(client: httpx.Client, name: str, pid: int, **params: int) -> list[tuple[str, dict, str]]:  # type: ignore[type-arg]
    with client.stream("GET", f"{procs(name)}/{pid}/stream", params=params) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(sse(response))


def text_of(events: list[tuple[str, dict, str]], stream: str = "stdout") -> str:  # type: ignore[type-arg]
    return "".join(d["data"] for e, d, _ in events if e == stream)


def test_start_list_and_follow_to_exit(alpha: httpx.Client, sandbox: str) -> None:
    started = alpha.post(procs(sandbox), json={"command": "echo out; echo err >&2; exit 3"})
    assert started.status_code == 201, started.text
    process = started.json()
    pid = process["pid"]
    assert process["command"] == "echo out; echo err >&2; exit 3"
    events = follow(alpha, sandbox, pid)
    assert text_of(events) == "out\n"
    assert text_of(events, "stderr") == "err\n"
    assert events[-1][0] == "exit" and events[-1][1] == {"exit_code": 3}
    listed = {p["pid"]: p for p in alpha.get(procs(sandbox)).json()["processes"]}
    assert listed[pid]["state"] == "exited" and listed[pid]["exit_code"] == 3
    assert alpha.get(f"{procs(sandbox)}/{pid}").json()["exit_code"] == 3


def test_ten_thousand_lines_complete_and_in_order_for_two_followers(
    deployment: Deployment, sandbox: str
) -> None:
    with deployment.client() as alpha:
        pid = alpha.post(
            procs(sandbox),
            json={"command": "sleep 0.5; for i in $(seq 1 10000); do echo line-$i; done"},
        ).json()["pid"]
        results: dict[int, str] = {}

        def follower(slot: int) -> None:
            with deployment.client() as own:
                results[slot] = text_of(follow(own, sandbox, pid))

        threads = [threading.Thread(target=follower, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    expected = "".join(f"line-{i}\n" for i in range(1, 10001))
    assert results[0] == expected
    assert results[1] == expected


def test_output_arrives_live(alpha: httpx.Client, sandbox: str) -> None:
    command = (
        'python3 -c "import time\nfor i in range(5):\n'
        '    print(i, time.time(), flush=True); time.sleep(0.3)"'
    )
    pid = alpha.post(procs(sandbox), json={"command": command}).json()["pid"]
    lags: list[float] = []
    pending = ""  # output chunks are not line-aligned: keep a partial line for the next one
    with alpha.stream("GET", f"{procs(sandbox)}/{pid}/stream") as response:
        for event, data, _ in sse(response):
            if event == "stdout":
                pending += data["data"]
                *lines, pending = pending.split("\n")
                lags.extend(time.time() - float(line.split()[1]) for line in lines)
            if event == "exit":
                break
    assert len(lags) == 5
    # printed lines reach the follower while the process runs (not at its exit, 1.2 s later)
    assert sorted(lags)[2] < 0.5, lags


def test_stdin_round_trip_through_cat(alpha: httpx.Client, sandbox: str) -> None:
    pid = alpha.post(procs(sandbox), json={"command": "cat"}).json()["pid"]
    sent = alpha.post(f"{procs(sandbox)}/{pid}/stdin", content=b"hello\n")
    assert sent.json() == {"written": 6}
    closed = alpha.post(f"{procs(sandbox)}/{pid}/stdin", params={"close": "true"}, content=b"bye\n")
    assert closed.status_code == 200
    events = follow(alpha, sandbox, pid)
    assert text_of(events) == "hello\nbye\n"
    assert events[-1] == ("exit", {"exit_code": 0}, events[-1][2])


def test_signal_and_timeout(alpha: httpx.Client, sandbox: str) -> None:
    pid = alpha.post(procs(sandbox), json={"command": "sleep 300"}).json()["pid"]
    signalled = alpha.post(f"{procs(sandbox)}/{pid}/signal", json={"signal": "TERM"})
    assert signalled.json() == {"pid": pid, "signal": "SIGTERM"}
    assert follow(alpha, sandbox, pid)[-1][1] == {"exit_code": 143}
    bad = alpha.post(f"{procs(sandbox)}/{pid}/signal", json={"signal": "SIGNOPE"})
    assert bad.status_code == 422
    timed = alpha.post(procs(sandbox), json={"command": "sleep 300", "timeout": 0.5}).json()["pid"]
    assert follow(alpha, sandbox, timed)[-1][1] == {"exit_code": 124}


def test_binary_output_and_resume_by_offset(alpha: httpx.Client, sandbox: str) -> None:
    pid = alpha.post(
        procs(sandbox), json={"command": "printf 'ok\\n'; printf '\\377\\376'"}
    ).json()["pid"]
    events = follow(alpha, sandbox, pid)
    data = [d for e, d, _ in events if e == "stdout"]
    raw = b"".join(
        base64.b64decode(d["data"]) if d.get("encoding") == "base64" else d["data"].encode()
        for d in data
    )
    assert raw == b"ok\n\xff\xfe"
    assert any(d.get("encoding") == "base64" for d in data)
    # resuming from the id of the first event repeats nothing before it
    first_id = int(events[0][2])
    resumed = follow(alpha, sandbox, pid, offset=first_id)
    assert resumed[-1][0] == "exit"
    resumed_raw = b"".join(
        base64.b64decode(d["data"]) if d.get("encoding") == "base64" else d["data"].encode()
        for e, d, _ in resumed
        if e == "stdout"
    )
    assert resumed_raw == raw[first_id:]


def test_late_follower_of_a_large_output_learns_what_was_dropped(
    alpha: httpx.Client, sandbox: str
) -> None:
    pid = alpha.post(
        procs(sandbox), json={"command": "head -c 3000000 /dev/zero | tr '\\0' x"}
    ).json()["pid"]
    wait_exited(alpha, sandbox, pid)  # late: all of it was written before anyone followed
    events = follow(alpha, sandbox, pid)
    dropped = [d for e, d, _ in events if e == "dropped"]
    assert dropped and dropped[0]["bytes"] >= 3000000 - (1 << 20)
    assert len(text_of(events)) + dropped[0]["bytes"] == 3000000


@pytest.mark.parametrize(
    ("path", "status"),
    [("/999999", 404), ("/999999/stream", 404), ("/abc", 422)],
)
def test_unknown_process(alpha: httpx.Client, sandbox: str, path: str, status: int) -> None:
    assert alpha.get(procs(sandbox) + path).status_code == status


def test_other_tenant_cannot_touch_processes(
    alpha: httpx.Client, beta: httpx.Client, sandbox: str
) -> None:
    pid = alpha.post(procs(sandbox), json={"command": "sleep 30"}).json()["pid"]
    assert beta.get(procs(sandbox)).status_code == 404
    assert beta.get(f"{procs(sandbox)}/{pid}/stream").status_code == 404
    assert beta.post(f"{procs(sandbox)}/{pid}/signal", json={"signal": "KILL"}).status_code == 404
    assert beta.post(f"{procs(sandbox)}/{pid}/stdin", content=b"x").status_code == 404
    assert alpha.get(f"{procs(sandbox)}/{pid}").json()["state"] == "running"


def test_follow_false_returns_what_is_there(alpha: httpx.Client, sandbox: str) -> None:
    pid = alpha.post(procs(sandbox), json={"command": "echo first; sleep 300"}).json()["pid"]
    with alpha.stream("GET", f"{procs(sandbox)}/{pid}/stream") as live:  # until "first" is out
        assert any(e == "stdout" for e, _, _ in sse(live)), "the stream ended before any output"
    events = follow(alpha, sandbox, pid, follow=0)  # returns though the process runs 300 s
    assert text_of(events) == "first\n"
    assert all(e != "exit" for e, _, _ in events)
    assert alpha.get(f"{procs(sandbox)}/{pid}").json()["state"] == "running"
    alpha.post(f"{procs(sandbox)}/{pid}/signal", json={"signal": "KILL"})


def test_terminals_are_marked_in_the_list(
    deployment: Deployment, alpha: httpx.Client, sandbox: str
) -> None:
    import asyncio

    from websockets.asyncio.client import connect

    async def with_terminal() -> list[dict]:  # type: ignore[type-arg]
        url = (
            deployment.url.replace("http://", "ws://") + f"/api/v1/sandboxes/{sandbox}/toolbox/pty"
        )
        headers = {"Authorization": f"Bearer {deployment.keys['alpha']}"}
        listed: list[dict] = []  # type: ignore[type-arg]

        def terminal_listed() -> bool:
            listed[:] = alpha.get(procs(sandbox)).json()["processes"]
            return any(p["terminal"] for p in listed)

        async with connect(url, additional_headers=headers):
            await asyncio.to_thread(wait_until, terminal_listed, what="the terminal listed")
            return listed

    listed = asyncio.run(with_terminal())
    assert any(p["terminal"] for p in listed)


def wait_exited(client: httpx.Client, name: str, pid: int) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        process: dict = client.get(f"{procs(name)}/{pid}").json()  # type: ignore[type-arg]
        if process["state"] == "exited":
            return process
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not exit")


@pytest.mark.parametrize("command", ["true", "sh -c 'exit 3'"])
def test_stdin_to_an_exited_process_is_a_conflict(
    alpha: httpx.Client, sandbox: str, command: str
) -> None:
    pid = alpha.post(procs(sandbox), json={"command": command}).json()["pid"]
    wait_exited(alpha, sandbox, pid)
    for params, body in (({}, b"late\n"), ({"close": "true"}, b""), ({}, b"again\n")):
        answer = alpha.post(f"{procs(sandbox)}/{pid}/stdin", params=params, content=body)
        assert answer.status_code == 409, answer.text
        error = answer.json()["error"]
        assert error["code"] == "process_exited"
        assert error["message"].startswith(f"process {pid} has exited"), error


def test_stdin_cut_off_by_the_process_exiting_is_a_conflict(
    alpha: httpx.Client, sandbox: str
) -> None:
    # head reads a little and exits while the 4 MiB are still going in: the pipe breaks
    pid = alpha.post(procs(sandbox), json={"command": "head -c 1 >/dev/null"}).json()["pid"]
    answer = alpha.post(f"{procs(sandbox)}/{pid}/stdin", content=b"x" * (4 << 20))
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert error["code"] == "process_exited"
    assert error["message"].startswith(f"process {pid} has exited"), error
    assert wait_exited(alpha, sandbox, pid)["exit_code"] == 0


def test_stdin_to_a_running_process_that_closed_it_is_a_conflict(
    alpha: httpx.Client, sandbox: str
) -> None:
    pid = alpha.post(procs(sandbox), json={"command": "exec 0<&-; sleep 30"}).json()["pid"]
    deadline = time.monotonic() + 10
    while True:  # until the shell has closed its stdin (a write before that just goes in)
        answer = alpha.post(f"{procs(sandbox)}/{pid}/stdin", content=b"x")
        if answer.status_code != 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert error["code"] == "conflict"
    assert error["message"].startswith(f"process {pid} closed its stdin"), error
    assert alpha.get(f"{procs(sandbox)}/{pid}").json()["state"] == "running"
    # closing our end of its stdin is still fine; a running reader still takes input
    assert alpha.post(f"{procs(sandbox)}/{pid}/stdin", params={"close": "true"}).status_code == 200
    alpha.post(f"{procs(sandbox)}/{pid}/signal", json={"signal": "KILL"})
    reader = alpha.post(procs(sandbox), json={"command": "cat"}).json()["pid"]
    assert alpha.post(f"{procs(sandbox)}/{reader}/stdin", content=b"in\n").status_code == 200
    alpha.post(f"{procs(sandbox)}/{reader}/signal", json={"signal": "KILL"})
