"""Background processes and terminals of the agent (procs.py), over a real agent subprocess.

See the last section of docs/agent-protocol.md. Responses are routed by request id, so several
threads can long-poll the agent at once. Only generous timing bounds are asserted.
"""

from __future__ import annotations

import logging
import queue
import re
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import pytest

from sandgate.agent import frames
from tests.integration.worker.test_agent import Agent, _marker, _running, _wait_until

MiB = 1 << 20
log = logging.getLogger(__name__)


class Client(Agent):
    """An agent client safe to use from several threads: answers are matched by id."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self._send_lock = threading.Lock()
        self._pending: dict[int, queue.Queue[tuple[frames.Header, bytes]]] = {}
        self._reader = threading.Thread(target=self._read_answers, daemon=True)
        self._reader.start()

    def _read_answers(self) -> None:
        stdout = cast(BinaryIO, self.proc.stdout)
        while True:
            try:
                frame = frames.read_frame(stdout)
            except (frames.FrameError, OSError, ValueError):
                return
            if frame is None:
                return
            waiting = self._pending.pop(cast(int, frame[0].get("id")), None)
            if waiting is not None:
                waiting.put(frame)

    def call(self, op: str, payload: bytes = b"", **fields: Any) -> tuple[frames.Header, bytes]:
        answer: queue.Queue[tuple[frames.Header, bytes]] = queue.Queue(maxsize=1)
        with self._send_lock:
            self._next_id += 1
            request_id = self._next_id
            self._pending[request_id] = answer
            assert self.proc.stdin is not None
            self.proc.stdin.write(frames.encode({"id": request_id, "op": op, **fields}, payload))
            self.proc.stdin.flush()
        try:
            return answer.get(timeout=60)
        except queue.Empty:
            raise AssertionError(f"no answer to {op}: {self.stderr()}") from None

    def start(self, command: str, **fields: Any) -> int:
        header = self.ok("proc_start", command=command, **fields)
        assert isinstance(header["started_at"], str)
        pid: int = header["pid"]
        return pid

    def follow(
        self, pid: int, op: str = "proc_read", offset: int = 0, wait: float = 10
    ) -> tuple[bytes, list[tuple[str, bytes]], frames.Header]:
        """Read until the end: (all bytes, [(stream, bytes)], the last answer)."""
        data = bytearray()
        chunks: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            header, body = self.call(op, pid=pid, offset=offset, wait=wait)
            assert header["ok"], header
            assert header["next_offset"] == offset + len(body) or header["first_offset"] > offset
            position = 0
            for stream, length in header["chunks"]:
                chunks.append((stream, body[position : position + length]))
                position += length
            assert position == len(body)
            data += body
            offset = header["next_offset"]
            if header["exited"]:
                return bytes(data), chunks, header
        raise AssertionError("the process did not end")

    def read_until(
        self, pid: int, pattern: bytes, offset: int, op: str = "pty_read", timeout: float = 10
    ) -> tuple[bytes, int]:
        """Read from ``offset`` until ``pattern`` was seen: (what was read, next offset)."""
        data = bytearray()
        deadline = time.monotonic() + timeout
        while pattern not in data:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{pattern!r} not seen in {bytes(data)!r}"
            header, body = self.call(op, pid=pid, offset=offset, wait=min(remaining, 5))
            assert header["ok"], header
            assert not header["exited"] or body, f"exited before {pattern!r}: {bytes(data)!r}"
            data += body
            offset = header["next_offset"]
        return bytes(data), offset


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Client]:
    client = Client(tmp_path)
    try:
        yield client
    finally:
        client.close()


def _entry(agent: Client, pid: int) -> frames.Header:
    for entry in agent.ok("proc_list")["processes"]:
        if entry["pid"] == pid:
            return cast(frames.Header, entry)
    raise AssertionError(f"{pid} is not listed")


# --------------------------------------------------------------------------- processes


def test_start_list_and_exit_code(agent: Client) -> None:
    sleeper = agent.start("sleep 100")
    pid = agent.start("echo hello; exit 3")
    data, chunks, last = agent.follow(pid)
    assert data == b"hello\n"
    assert chunks == [("stdout", b"hello\n")]
    assert (last["exited"], last["exit_code"]) == (True, 3)
    entry = _entry(agent, pid)
    assert entry["command"] == "echo hello; exit 3"
    assert (entry["state"], entry["exit_code"], entry["terminal"]) == ("exited", 3, False)
    assert entry["started_at"] <= entry["exited_at"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", entry["exited_at"])
    running = _entry(agent, sleeper)
    assert (running["state"], running["exit_code"], running["exited_at"]) == (
        "running",
        None,
        None,
    )
    pids = [entry["pid"] for entry in agent.ok("proc_list")["processes"]]
    assert pids == [sleeper, pid]  # in start order
    agent.ok("proc_signal", pid=sleeper, signal="KILL")
    assert agent.follow(sleeper)[2]["exit_code"] == 128 + 9


def test_cwd_and_env(agent: Client) -> None:
    (agent.tmp / "sub").mkdir()
    pid = agent.start(
        'pwd; echo "$HOME|$SANDBOX_VAR|$FOO|$PYTHONUNBUFFERED|$(printenv TERM || echo none)"',
        cwd="/tmp/sub",
        env={"FOO": "bar"},
    )
    expected = f"{agent.tmp}/sub\n{agent.workspace}|from-sandbox|bar|1|none\n"
    assert agent.follow(pid)[0].decode() == expected
    pid = agent.start("echo $PYTHONUNBUFFERED", env={"PYTHONUNBUFFERED": ""})
    assert agent.follow(pid)[0] == b"\n"


def test_argv_stdin_and_a_start_that_reads(agent: Client) -> None:
    """What E2B's process service asks for: a program run as given, end-of-file on stdin,
    and the first output (with the exit of a short command) in the start's own answer."""
    header, body = agent.call(
        "proc_start",
        argv=["/bin/bash", "-c", "cat; echo out-$X"],
        env={"X": "1"},
        stdin=False,
        wait=10,
        linger=1,
    )
    assert header["ok"], header
    output = header["output"]
    assert body == b"out-1\n" and output["chunks"] == [["stdout", 6]]
    assert (output["exited"], output["exit_code"], output["next_offset"]) == (True, 0, 6)
    entry = _entry(agent, header["pid"])
    assert entry["argv"] == ["/bin/bash", "-c", "cat; echo out-$X"] and entry["env"] == {"X": "1"}
    # a silent command: the start answers after its wait, not at the command's end
    started = time.monotonic()
    header, body = agent.call("proc_start", command="sleep 30", wait=0.2, linger=0.1)
    assert header["ok"] and body == b"" and not header["output"]["exited"]
    assert time.monotonic() - started < 5
    agent.ok("proc_signal", pid=header["pid"], signal="KILL")
    # a read lingers for the exit of a process that has printed
    pid = agent.start("echo a; sleep 0.2; echo b")
    first, body = agent.call("proc_read", pid=pid, offset=0, wait=5, linger=0.01)
    assert body == b"a\n" and not first["exited"]  # still running after the linger
    last, body = agent.call("proc_read", pid=pid, offset=2, wait=5, linger=1)
    assert body == b"b\n" and last["exited"], "the exit came with the last output"
    assert agent.error("proc_start", command="true", linger=2) == "invalid_request"
    assert agent.error("proc_start", argv=[]) == "invalid_request"
    assert agent.error("proc_start", argv=["a\x00"]) == "invalid_request"
    assert agent.error("proc_start", command="true", stdin="no") == "invalid_request"


def test_a_tag_names_one_running_process(agent: Client) -> None:
    pid = agent.start("echo hi; sleep 30", tag="ctx:one")
    assert agent.error("proc_start", command="true", tag="ctx:one") == "exists"
    agent.read_until(pid, b"hi", 0, op="proc_read")
    entry = _entry(agent, pid)
    assert entry["tag"] == "ctx:one" and entry["output_end"] == 3
    agent.ok("proc_signal", pid=pid, signal="KILL")
    agent.follow(pid)
    again = agent.start("true", tag="ctx:one")  # its process ended: the tag is free again
    assert _entry(agent, again)["tag"] == "ctx:one"
    # stdin addressed by tag: which process, and where its output stood before the write
    cat = agent.start("cat", tag="ctx:cat")
    header, _ = agent.call("proc_stdin", b"abc\n", tag="ctx:cat")
    assert header["ok"] and (header["pid"], header["output_end"]) == (cat, 0), header
    agent.read_until(cat, b"abc", 0, op="proc_read")
    header, _ = agent.call("proc_stdin", b"de\n", tag="ctx:cat")
    assert header["output_end"] == 4
    assert agent.error("proc_stdin", tag="ctx:none") == "not_found"
    assert agent.error("proc_start", command="true", tag="") == "invalid_request"
    assert agent.error("proc_start", program="nope", argv=["x"]) == "invalid_request"


def test_invalid_requests(agent: Client) -> None:
    assert agent.error("proc_start") == "invalid_request"
    assert agent.error("proc_start", command="") == "invalid_request"
    assert agent.error("proc_start", command="a\x00b") == "invalid_request"
    assert agent.error("proc_start", command="true", timeout=0) == "invalid_request"
    assert agent.error("proc_start", command="true", timeout="1") == "invalid_request"
    assert agent.error("proc_start", command="true", env={"A": 1}) == "invalid_request"
    assert agent.error("proc_start", command="true", cwd="/etc") == "path_outside_sandbox"
    assert agent.error("proc_start", command="true", cwd="missing") == "not_found"
    pid = agent.start("sleep 100")
    assert agent.error("proc_read", pid=pid, offset=-1) == "invalid_request"
    assert agent.error("proc_read", pid=pid, offset=1) == "invalid_request"  # past the end
    assert agent.error("proc_read", pid=pid, offset=0, wait=31) == "invalid_request"
    assert agent.error("proc_read", pid=str(pid), offset=0) == "invalid_request"
    assert agent.error("proc_signal", pid=pid, signal="SIGFOO") == "invalid_request"
    assert agent.error("proc_signal", pid=pid, signal=1000) == "invalid_request"
    assert agent.error("proc_signal", pid=pid) == "invalid_request"
    assert agent.error("proc_stdin", b"x", pid=pid, close="yes") == "invalid_request"
    assert agent.error("pty_read", pid=pid, offset=0) == "invalid_request"  # not a terminal
    assert agent.error("pty_write", b"x", pid=pid) == "invalid_request"
    agent.ok("proc_signal", pid=pid, signal=9)


@pytest.mark.parametrize(
    ("op", "fields"),
    [
        ("proc_read", {"offset": 0}),
        ("proc_stdin", {}),
        ("proc_signal", {"signal": "TERM"}),
        ("pty_read", {"offset": 0}),
        ("pty_write", {}),
        ("pty_resize", {"cols": 80, "rows": 24}),
        ("pty_close", {}),
    ],
)
def test_unknown_pid(agent: Client, op: str, fields: dict[str, Any]) -> None:
    assert agent.error(op, pid=1 << 30, **fields) == "not_found"


def test_many_lines_read_in_order_by_two_followers_after_exit(agent: Client) -> None:
    pad = "x" * 40
    pid = agent.start(f"for i in $(seq 1 10000); do printf 'line %05d {pad}\\n' $i; done")
    expected = b"".join(b"line %05d %s\n" % (i, pad.encode()) for i in range(1, 10001))
    assert len(expected) < MiB
    assert agent.follow(pid)[0] == expected
    results: list[bytes] = []

    def follower() -> None:
        results.append(agent.follow(pid)[0])

    threads = [threading.Thread(target=follower) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [expected, expected]


def test_two_live_followers_see_everything_in_order(agent: Client) -> None:
    code = (
        "import time\n"
        "for i in range(10000):\n"
        "    print(f'line {i:05d}')\n"
        "    if i % 500 == 0: time.sleep(0.02)\n"
    )
    results: dict[int, bytes] = {}
    pid = agent.start(f'python3 -c "{code}"')

    def follower(index: int) -> None:
        results[index] = agent.follow(pid, wait=5)[0]

    threads = [threading.Thread(target=follower, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    expected = b"".join(b"line %05d\n" % i for i in range(10000))
    assert results == {0: expected, 1: expected}


def test_a_follower_sees_each_line_promptly(agent: Client) -> None:
    # print() without flush: PYTHONUNBUFFERED=1 makes Python write each line at once
    code = "import time\nfor i in range(10):\n    print(i, time.time())\n    time.sleep(0.2)\n"
    pid = agent.start(f"python3 -c '{code}'")
    latencies: list[float] = []
    offset = 0
    pending = b""
    while True:
        header, body = agent.call("proc_read", pid=pid, offset=offset, wait=5)
        received = time.time()
        offset = header["next_offset"]
        pending += body
        *lines, pending = pending.split(b"\n")
        latencies += [received - float(line.split()[1]) for line in lines]
        if header["exited"]:
            break
    assert len(latencies) == 10
    median = statistics.median(latencies)
    log.info("line latency: median %.2f ms, max %.2f ms", median * 1000, max(latencies) * 1000)
    assert median < 0.05
    assert max(latencies) < 0.5


def test_a_read_waits_without_stalling_other_requests(agent: Client) -> None:
    pid = agent.start("sleep 100")
    answers: list[frames.Header] = []
    reader = threading.Thread(
        target=lambda: answers.append(agent.call("proc_read", pid=pid, offset=0, wait=1.5)[0])
    )
    read_id = agent._next_id + 1
    started = time.monotonic()
    reader.start()
    # sent under the send lock it is registered under: the ping goes after it on the pipe
    assert _wait_until(lambda: read_id in agent._pending), "the read was not sent"
    agent.ok("ping")
    assert read_id in agent._pending  # answered while the read was waiting (not answered yet)
    reader.join(10)
    # the point of the test: the read waits its whole wait (a lower bound, never flaky)
    assert time.monotonic() - started >= 1.4
    assert answers[0]["chunks"] == [] and answers[0]["exited"] is False
    assert answers[0]["next_offset"] == 0
    agent.ok("proc_signal", pid=pid, signal="SIGKILL")


def test_stdin_round_trip(agent: Client) -> None:
    pid = agent.start("cat")
    assert agent.ok("proc_stdin", b"hello\n", pid=pid)["written"] == 6
    data, offset = agent.read_until(pid, b"hello\n", 0, op="proc_read")
    assert data == b"hello\n"
    big = bytes(range(256)) * 4096  # 1 MiB: more than a pipe holds, while cat echoes it
    assert agent.ok("proc_stdin", big, pid=pid)["written"] == len(big)
    assert agent.ok("proc_stdin", pid=pid, close=True)["written"] == 0
    rest, _, last = agent.follow(pid, offset=offset)
    assert rest == big
    assert (last["exited"], last["exit_code"]) == (True, 0)
    assert agent.error("proc_stdin", b"more", pid=pid) == "invalid_request"


def test_stdin_of_an_exited_process(agent: Client) -> None:
    pid = agent.start("true")
    agent.follow(pid)
    assert agent.error("proc_stdin", b"late", pid=pid) == "process_exited"
    assert agent.error("proc_stdin", pid=pid, close=True) == "process_exited"


@pytest.mark.parametrize("name", ["SIGTERM", "TERM", "term", 15])
def test_signal(agent: Client, name: str | int) -> None:
    pid = agent.start("sleep 100")
    agent.ok("proc_signal", pid=pid, signal=name)
    assert agent.follow(pid)[2]["exit_code"] == 128 + signal.SIGTERM


def test_signal_reaches_the_whole_group(agent: Client) -> None:
    marker = _marker()
    pid = agent.start(f"sh -c 'sleep 100; : {marker}' & wait")
    assert _wait_until(lambda: _running(marker))
    agent.ok("proc_signal", pid=pid, signal="SIGTERM")
    assert _wait_until(lambda: not _running(marker))
    assert agent.follow(pid)[2]["exit_code"] == 128 + signal.SIGTERM


def test_timeout_kills_the_group(agent: Client) -> None:
    marker = _marker()
    started = time.monotonic()
    pid = agent.start(f"sh -c 'sleep 100; : {marker}' & echo started; wait", timeout=0.5)
    data, _, last = agent.follow(pid)
    assert 0.4 < time.monotonic() - started < 5
    assert data == b"started\n"
    assert (last["exited"], last["exit_code"]) == (True, 124)
    assert _entry(agent, pid)["exit_code"] == 124
    assert _wait_until(lambda: not _running(marker))


def test_pipes_held_by_background_children_do_not_block_the_exit(agent: Client) -> None:
    started = time.monotonic()
    pid = agent.start("sleep 100 & echo done")
    data, _, last = agent.follow(pid)
    assert data == b"done\n"
    assert (last["exited"], last["exit_code"]) == (True, 0)
    assert time.monotonic() - started < 3


def test_stderr_chunks_are_tagged(agent: Client) -> None:
    pid = agent.start("echo out; sleep 0.2; echo err >&2; sleep 0.2; echo out2")
    data, chunks, _ = agent.follow(pid)
    assert data == b"out\nerr\nout2\n"
    assert chunks == [("stdout", b"out\n"), ("stderr", b"err\n"), ("stdout", b"out2\n")]


def test_output_beyond_the_buffer(agent: Client) -> None:
    code = "import sys; sys.stdout.write(''.join(f'{i:09d}\\n' for i in range(300000)))"
    pid = agent.start(f'python3 -c "{code}"')
    expected = b"".join(b"%09d\n" % i for i in range(300000))
    assert agent.follow(pid, offset=0)[2]["next_offset"] == len(expected)  # drained
    header, body = agent.call("proc_read", pid=pid, offset=0, wait=0)
    assert header["first_offset"] == len(expected) - MiB > 0
    assert header["next_offset"] == header["first_offset"] + len(body)
    data, _, last = agent.follow(pid, offset=0)
    assert data == expected[-MiB:]
    assert last["next_offset"] == len(expected)


def test_a_live_follower_never_gets_more_than_a_mebibyte(agent: Client) -> None:
    pid = agent.start("head -c 3000000 /dev/zero; sleep 0.5")

    def produced() -> bool:  # all 3 MB are in (the buffer keeps the last MiB of them)
        return int(agent.call("proc_read", pid=pid, offset=0, wait=0)[0]["next_offset"]) >= 3000000

    assert _wait_until(produced), "the output was not produced"
    header, body = agent.call("proc_read", pid=pid, offset=0, wait=5)
    assert 0 < len(body) <= MiB
    assert header["next_offset"] - header["first_offset"] == len(body)


def test_raw_bytes_pass_through(agent: Client) -> None:
    pid = agent.start(r"printf 'a\377\376\000b\r\n'")
    assert agent.follow(pid)[0] == b"a\xff\xfe\x00b\r\n"


def test_list_forgets_the_oldest_exited_and_refuses_when_all_run(agent: Client) -> None:
    marker = _marker()
    first = agent.start("true")
    agent.follow(first)
    pids = [agent.start(f"sleep 100; : {marker}") for _ in range(255)]
    listed = [entry["pid"] for entry in agent.ok("proc_list")["processes"]]
    assert listed == [first, *pids]
    last = agent.start(f"sleep 100; : {marker}")  # the exited one makes room
    listed = [entry["pid"] for entry in agent.ok("proc_list")["processes"]]
    assert listed == [*pids, last]
    header, _ = agent.call("proc_start", command="true")
    assert header["error"]["code"] == "io_error"
    assert "256" in header["error"]["message"]
    agent.ok("proc_signal", pid=pids[0], signal="KILL")
    agent.follow(pids[0])
    agent.start("true")
    assert agent.close() == 0
    assert _wait_until(lambda: not _running(marker))


# --------------------------------------------------------------------------- terminals


def test_terminal_size_resize_echo_and_exit(agent: Client) -> None:
    header = agent.ok("pty_open", cols=100, rows=30)
    pid = header["pid"]
    entry = _entry(agent, pid)
    assert (entry["command"], entry["terminal"], entry["state"]) == ("bash -l", True, "running")
    agent.ok("pty_write", b"stty size\n", pid=pid)
    _, offset = agent.read_until(pid, b"30 100\r\n", 0)
    agent.ok("pty_resize", pid=pid, cols=120, rows=50)
    agent.ok("pty_write", b"stty size\n", pid=pid)
    _, offset = agent.read_until(pid, b"50 120\r\n", offset)
    assert agent.ok("pty_write", b"echo $TERM hi\n", pid=pid)["written"] == 14
    data, offset = agent.read_until(pid, b"xterm-256color hi\r\n", offset)
    assert b"echo $TERM hi" in data  # the terminal echoed what was typed
    agent.ok("pty_write", b"exit\n", pid=pid)
    _, chunks, last = agent.follow(pid, op="pty_read", offset=offset)
    assert {stream for stream, _ in chunks} <= {"pty"}
    assert (last["exited"], last["exit_code"]) == (True, 0)
    assert agent.error("pty_write", b"late", pid=pid) == "process_exited"
    assert agent.error("pty_resize", pid=pid, cols=80, rows=24) == "process_exited"
    assert agent.error("proc_read", pid=pid, offset=0) == "invalid_request"


def test_terminal_command_cwd_and_control_characters(agent: Client) -> None:
    (agent.workspace / "dir").mkdir()
    pid = agent.ok("pty_open", command="pwd; tty; cat", cwd="dir")["pid"]
    data, offset = agent.read_until(pid, b"/dev/pts/", 0)
    assert f"{agent.workspace}/dir\r\n".encode() in data
    agent.ok("pty_write", b"typed\n", pid=pid)
    _, offset = agent.read_until(pid, b"typed\r\ntyped\r\n", offset)  # echo, then cat
    agent.ok("pty_write", b"\x03", pid=pid)  # ^C: SIGINT to the foreground group
    last = agent.follow(pid, op="pty_read", offset=offset)[2]
    assert last["exit_code"] == 128 + signal.SIGINT


def test_terminal_invalid_requests(agent: Client) -> None:
    assert agent.error("pty_open", cols=0, rows=10) == "invalid_request"
    assert agent.error("pty_open", cols=80, rows=70000) == "invalid_request"
    assert agent.error("pty_open", command="") == "invalid_request"
    assert agent.error("pty_open", cwd="/etc") == "path_outside_sandbox"
    pid = agent.ok("pty_open")["pid"]
    assert agent.error("pty_resize", pid=pid, cols=80) == "invalid_request"
    assert agent.error("proc_stdin", b"x", pid=pid) == "invalid_request"
    agent.ok("pty_close", pid=pid)


def test_pty_close_kills_what_runs_in_it(agent: Client) -> None:
    marker = _marker()
    pid = agent.ok("pty_open")["pid"]
    agent.ok("pty_write", f"sh -c 'sleep 100; : {marker}'\n".encode(), pid=pid)
    assert _wait_until(lambda: _running(marker))
    agent.ok("pty_close", pid=pid)
    assert _wait_until(lambda: not _running(marker))
    last = agent.follow(pid, op="pty_read")[2]
    assert last["exited"] is True
    assert last["exit_code"] == 128 + signal.SIGHUP
    agent.ok("pty_close", pid=pid)  # again: nothing left to do


def test_pty_close_kills_a_shell_ignoring_hangups(agent: Client) -> None:
    marker = _marker()
    pid = agent.ok("pty_open", command=f"trap '' HUP; sleep 100; : {marker}")["pid"]
    assert _wait_until(lambda: _running(marker))
    started = time.monotonic()
    agent.ok("pty_close", pid=pid)
    last = agent.follow(pid, op="pty_read")[2]
    assert 0.8 < time.monotonic() - started < 5
    assert last["exit_code"] == 128 + signal.SIGKILL
    assert _wait_until(lambda: not _running(marker))


# --------------------------------------------------------------------------- agent exit


def test_agent_exit_kills_processes_and_terminals(agent: Client) -> None:
    markers = [_marker() for _ in range(4)]
    agent.start(f"sh -c 'sleep 100; : {markers[0]}' & sleep 100")
    pid = agent.ok("pty_open")["pid"]
    # a background job runs in a process group of its own, in the terminal's session
    agent.ok("pty_write", f"sh -c 'sleep 100; : {markers[1]}' &\n".encode(), pid=pid)
    agent.ok("pty_write", f"sh -c 'sleep 100; : {markers[2]}'\n".encode(), pid=pid)
    exited = agent.start(f"sh -c 'sleep 100; : {markers[3]}' > /dev/null 2>&1 &")
    agent.follow(exited)  # its child lingers in its group
    assert _wait_until(lambda: all(_running(marker) for marker in markers))
    assert agent.close() == 0
    for marker in markers:
        assert _wait_until(lambda marker=marker: not _running(marker)), marker


def test_agent_sigterm_kills_processes_and_terminals(agent: Client) -> None:
    markers = [_marker() for _ in range(2)]
    agent.start(f"sleep 100; : {markers[0]}")
    agent.ok("pty_open", command=f"sleep 100; : {markers[1]}")
    assert _wait_until(lambda: all(_running(marker) for marker in markers))
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(10) == 0
    for marker in markers:
        assert _wait_until(lambda marker=marker: not _running(marker)), marker
