"""The in-sandbox agent, run as a plain subprocess (no sandbox) and spoken to over its pipes.

See docs/agent-protocol.md. Only generous timing bounds are asserted.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, cast

import pytest

from sandgate.agent import frames
from sandgate.core.output import decode_output, split_output

AGENT = Path(__file__).resolve().parents[3] / "src" / "sandgate" / "agent" / "main.py"
EXEC_OUTPUT_CAP = 1 << 20  # main.EXEC_OUTPUT_CAP; importing main would put its dir on sys.path
MiB = 1 << 20


def with_output(header: frames.Header, payload: bytes) -> frames.Header:
    """An exec answer with its payload decoded the way the API decodes it."""
    out, err = split_output(payload, header["stdout_bytes"])
    return {
        **header,
        "stdout": decode_output(out, header["stdout_truncated"]),
        "stderr": decode_output(err, header["stderr_truncated"]),
    }


class Agent:
    """A tiny synchronous client: send requests, read responses in order of arrival."""

    def __init__(
        self, tmp_path: Path, env: dict[str, str] | None = None, cpu_pressure: str = "off"
    ) -> None:
        """``cpu_pressure``: the agent's ``--cpu-pressure`` (off: a shell is started ahead of
        each command whatever the host's load, agent/pressure.py)."""
        self.workspace = tmp_path / "ws"
        self.tmp = tmp_path / "tmp"
        self.workspace.mkdir()
        self.tmp.mkdir()
        self.stderr_path = tmp_path / "agent.stderr"
        with self.stderr_path.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [
                    "/usr/bin/python3",
                    "-I",
                    "-S",
                    str(AGENT),
                    "--workspace",
                    str(self.workspace),
                    "--tmp",
                    str(self.tmp),
                    "--cpu-pressure",
                    cpu_pressure,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env if env is not None else {"SANDBOX_VAR": "from-sandbox"},
            )
        self._next_id = 0
        self.ready = self.recv()

    def send(self, op: str, payload: bytes = b"", **fields: Any) -> int:
        self._next_id += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(frames.encode({"id": self._next_id, "op": op, **fields}, payload))
        self.proc.stdin.flush()
        return self._next_id

    def recv(self) -> tuple[frames.Header, bytes]:
        assert self.proc.stdout is not None
        frame = frames.read_frame(cast(BinaryIO, self.proc.stdout))
        assert frame is not None, f"agent exited: {self.stderr()}"
        return frame

    def call(self, op: str, payload: bytes = b"", **fields: Any) -> tuple[frames.Header, bytes]:
        request_id = self.send(op, payload, **fields)
        header, body = self.recv()
        assert header["id"] == request_id
        return header, body

    def ok(self, op: str, payload: bytes = b"", **fields: Any) -> frames.Header:
        header, _ = self.call(op, payload, **fields)
        assert header["ok"] is True, header
        return header

    def error(self, op: str, payload: bytes = b"", **fields: Any) -> str:
        header, _ = self.call(op, payload, **fields)
        assert header["ok"] is False, header
        assert set(header["error"]) == {"code", "message"}
        code: str = header["error"]["code"]
        return code

    def exec(self, code: str, language: str = "bash", **fields: Any) -> frames.Header:
        header, payload = self.call("exec", language=language, code=code, **fields)
        assert header["ok"] is True, header
        return with_output(header, payload)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def close(self, timeout: float = 10) -> int:
        assert self.proc.stdin is not None
        if not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            assert self.proc.stdout is not None
            self.proc.stdout.close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    client = Agent(tmp_path)
    try:
        yield client
    finally:
        client.close()


def _marker() -> str:
    return f"sandgate-test-{uuid.uuid4().hex}"


def _running(marker: str) -> bool:
    return subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0


def _wait_until(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def _write_file(agent: Agent, path: str, data: bytes, chunk: int = MiB) -> frames.Header:
    handle = agent.ok("open_write", path=path)["handle"]
    for start in range(0, len(data), chunk):
        part = data[start : start + chunk]
        assert agent.ok("write", part, handle=handle)["written"] == len(part)
    entry: frames.Header = agent.ok("close_write", handle=handle, commit=True)["entry"]
    return entry


def _read_file(agent: Agent, path: str, chunk: int = MiB) -> bytes:
    opened = agent.ok("open_read", path=path)
    parts = []
    while True:
        header, body = agent.call("read", handle=opened["handle"], length=chunk)
        assert header["ok"], header
        if not body:
            break
        parts.append(body)
    agent.ok("close_read", handle=opened["handle"])
    data = b"".join(parts)
    assert len(data) == opened["size"]
    return data


# --------------------------------------------------------------------------- lifecycle


def test_ready_event_and_ping(agent: Agent) -> None:
    header, payload = agent.ready
    assert header == {"event": "ready", "pid": agent.proc.pid, "version": 1}
    assert payload == b""
    assert agent.call("ping") == ({"id": 1, "ok": True}, b"")


def test_unknown_op_and_missing_op(agent: Agent) -> None:
    assert agent.error("frobnicate") == "invalid_request"
    assert agent.proc.stdin is not None
    agent.proc.stdin.write(frames.encode({"id": 100}))
    agent.proc.stdin.flush()
    header, _ = agent.recv()
    assert (header["id"], header["error"]["code"]) == (100, "invalid_request")
    assert agent.ok("ping")["ok"] is True  # still serving


def test_stdin_eof_exits_and_kills_running_exec(agent: Agent) -> None:
    marker = _marker()
    agent.send("exec", language="bash", code=f"sh -c 'sleep 100; : {marker}' & sleep 100")
    assert _wait_until(lambda: _running(marker))
    assert agent.close() == 0
    assert _wait_until(lambda: not _running(marker))


def test_sigterm_exits_and_kills_running_exec(agent: Agent) -> None:
    marker = _marker()
    agent.send("exec", language="bash", code=f"sleep 100; : {marker}")
    assert _wait_until(lambda: _running(marker))
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(10) == 0
    assert _wait_until(lambda: not _running(marker))


def test_background_children_outliving_exec_are_killed_at_eof(agent: Agent) -> None:
    marker = _marker()
    result = agent.exec(f"sh -c 'sleep 100; : {marker}' > /dev/null 2>&1 & echo started")
    assert result["stdout"] == "started\n"
    assert _wait_until(lambda: _running(marker))
    assert agent.close() == 0
    assert _wait_until(lambda: not _running(marker))


def test_malformed_frame_makes_the_agent_exit_non_zero(agent: Agent) -> None:
    assert agent.proc.stdin is not None
    agent.proc.stdin.write(frames.PREFIX.pack(4, 0) + b"nope")
    agent.proc.stdin.flush()
    assert agent.proc.wait(10) != 0
    assert "invalid_request" in agent.stderr()


def test_request_without_an_id_makes_the_agent_exit_non_zero(agent: Agent) -> None:
    assert agent.proc.stdin is not None
    agent.proc.stdin.write(frames.encode({"op": "ping"}))
    agent.proc.stdin.flush()
    assert agent.proc.wait(10) != 0


def test_bad_arguments(tmp_path: Path) -> None:
    result = subprocess.run(
        ["/usr/bin/python3", "-I", "-S", str(AGENT), "--workspace", str(tmp_path)],
        capture_output=True,
        timeout=10,
    )
    assert result.returncode == 2
    assert b"--tmp" in result.stderr


# --------------------------------------------------------------------------- exec


def test_exec_echo(agent: Agent) -> None:
    result = agent.exec("echo ok")
    assert result["stdout"] == "ok\n"
    assert result["stderr"] == ""
    assert result["exit_code"] == 0
    assert result["timed_out"] is False
    assert result["stdout_truncated"] is False
    assert result["stderr_truncated"] is False
    assert isinstance(result["duration_ms"], float)
    assert result["duration_ms"] > 0


def test_exec_languages(agent: Agent) -> None:
    assert agent.exec("echo $0", language="sh")["stdout"].strip().endswith("sh")
    assert agent.exec("print(6 * 7)", language="python")["stdout"] == "42\n"
    assert agent.exec("echo ${BASH_VERSION:+bash}")["stdout"] == "bash\n"


@pytest.mark.parametrize("code", [0, 1, 3, 255])
def test_exec_exit_codes(agent: Agent, code: int) -> None:
    assert agent.exec(f"exit {code}")["exit_code"] == code


def test_exec_killed_by_signal_reports_like_a_shell(agent: Agent) -> None:
    assert agent.exec("kill -9 $$")["exit_code"] == 128 + 9


def test_exec_stderr(agent: Agent) -> None:
    result = agent.exec("echo out; echo err >&2; exit 2")
    assert (result["stdout"], result["stderr"], result["exit_code"]) == ("out\n", "err\n", 2)


def test_exec_invalid_utf8_is_replaced(agent: Agent) -> None:
    assert agent.exec(r"printf 'a\377b'")["stdout"] == "a\ufffdb"


def test_exec_stdin_is_dev_null(agent: Agent) -> None:
    result = agent.exec("cat; echo done", timeout=10)
    assert result["stdout"] == "done\n"


def test_exec_env(agent: Agent) -> None:
    result = agent.exec(
        'echo "$PATH|$HOME|$LANG|$SANDBOX_VAR|$FOO"', env={"FOO": "bar baz", "LANG": "C"}
    )
    expected = f"/usr/local/bin:/usr/bin:/bin|{agent.workspace}|C|from-sandbox|bar baz\n"
    assert result["stdout"] == expected


def test_exec_request_env_overrides_sandbox_env(agent: Agent) -> None:
    result = agent.exec("echo $SANDBOX_VAR", env={"SANDBOX_VAR": "from-request"})
    assert result["stdout"] == "from-request\n"


def test_exec_cwd(agent: Agent) -> None:
    (agent.workspace / "sub" / "dir").mkdir(parents=True)
    assert agent.exec("pwd")["stdout"] == f"{agent.workspace}\n"
    assert agent.exec("pwd", cwd="sub/dir")["stdout"] == f"{agent.workspace}/sub/dir\n"
    assert agent.exec("pwd", cwd="/workspace/sub")["stdout"] == f"{agent.workspace}/sub\n"
    assert agent.exec("pwd", cwd="/tmp")["stdout"] == f"{agent.tmp}\n"


def test_exec_bad_cwd(agent: Agent) -> None:
    (agent.workspace / "file").write_text("x")
    assert agent.error("exec", language="bash", code="pwd", cwd="missing") == "not_found"
    assert agent.error("exec", language="bash", code="pwd", cwd="file") == "not_a_directory"
    assert agent.error("exec", language="bash", code="pwd", cwd="/etc") == "path_outside_sandbox"
    outside = agent.error("exec", language="bash", code="pwd", cwd="../..")
    assert outside == "path_outside_sandbox"


@pytest.mark.parametrize(
    "fields",
    [
        {"language": "ruby", "code": "puts 1"},
        {"code": "echo"},
        {"language": "bash"},
        {"language": "bash", "code": 42},
        {"language": "bash", "code": "echo", "timeout": 0},
        {"language": "bash", "code": "echo", "timeout": -1},
        {"language": "bash", "code": "echo", "timeout": "5"},
        {"language": "bash", "code": "echo", "timeout": True},
        {"language": "bash", "code": "echo", "env": ["A=1"]},
        {"language": "bash", "code": "echo", "env": {"A": 1}},
        {"language": "bash", "code": "echo", "env": {"A=B": "1"}},
        {"language": "bash", "code": "echo", "cwd": 7},
        {"language": "bash", "code": "echo\x00"},
    ],
)
def test_exec_invalid_requests(agent: Agent, fields: dict[str, Any]) -> None:
    assert agent.error("exec", **fields) == "invalid_request"


def test_exec_timeout_kills_the_whole_group(agent: Agent) -> None:
    marker = _marker()
    started = time.monotonic()
    result = agent.exec(f"sh -c 'sleep 100; : {marker}' & sleep 100", timeout=0.5)
    assert time.monotonic() - started < 5
    assert result["timed_out"] is True
    assert result["exit_code"] == 124
    assert result["duration_ms"] >= 500
    assert _wait_until(lambda: not _running(marker))


def test_exec_timeout_when_the_command_closed_its_pipes(agent: Agent) -> None:
    result = agent.exec("exec >&- 2>&-; sleep 100", timeout=0.5)
    assert (result["timed_out"], result["exit_code"]) == (True, 124)


def test_background_child_holding_stdout_does_not_hang(agent: Agent) -> None:
    marker = _marker()
    # had the exec waited for the child's stdout to close, its timeout would have fired
    result = agent.exec(f"sh -c 'sleep 100; : {marker}' & echo hi", timeout=30)
    assert result["stdout"] == "hi\n"
    assert result["exit_code"] == 0
    assert result["timed_out"] is False
    assert _wait_until(lambda: _running(marker))  # answered while the child holds stdout


def test_output_cap(agent: Agent) -> None:
    code = "import sys; sys.stdout.write('x' * (3 << 20)); sys.stderr.write('e' * 10)"
    result = agent.exec(code, language="python")
    assert result["stdout_truncated"] is True
    assert 0 < len(result["stdout"].encode()) <= EXEC_OUTPUT_CAP
    assert set(result["stdout"]) == {"x"}
    assert result["stderr"] == "e" * 10
    assert result["stderr_truncated"] is False
    assert result["exit_code"] == 0


def test_output_cap_on_both_streams_with_escaping(agent: Agent) -> None:
    # Control characters take 6 bytes each in JSON: the response must still fit in a frame.
    code = (
        "import sys; sys.stdout.write('\\x01' * (2 << 20)); sys.stderr.write('\\x02' * (2 << 20))"
    )
    result = agent.exec(code, language="python")
    assert result["stdout_truncated"] is True
    assert result["stderr_truncated"] is True
    assert 0 < len(result["stdout"]) <= EXEC_OUTPUT_CAP
    assert 0 < len(result["stderr"]) <= EXEC_OUTPUT_CAP
    assert set(result["stdout"]) == {"\x01"}
    assert len(result["stdout"]) == EXEC_OUTPUT_CAP  # the whole cap: no JSON escaping limit


def test_output_cap_keeps_utf8_whole(agent: Agent) -> None:
    code = "import sys; sys.stdout.write('é' * (1 << 20))"  # 2 MiB of 2-byte characters
    result = agent.exec(code, language="python")
    assert result["stdout_truncated"] is True
    assert set(result["stdout"]) == {"é"}
    assert len(result["stdout"].encode()) <= EXEC_OUTPUT_CAP


def test_concurrent_requests(agent: Agent) -> None:
    started = time.monotonic()
    ids = {agent.send("exec", language="bash", code=f"sleep 0.3; echo {i}"): i for i in range(8)}
    ping = agent.send("ping")
    answers = {}
    for _ in range(len(ids) + 1):
        header, payload = agent.recv()
        answers[header["id"]] = with_output(header, payload) if "exit_code" in header else header
    assert time.monotonic() - started < 2
    assert answers[ping] == {"id": ping, "ok": True}
    for request_id, i in ids.items():
        assert answers[request_id]["stdout"] == f"{i}\n"


# --------------------------------------------------------------------------- file ops


def test_write_and_read_back_20_mib(agent: Agent) -> None:
    data = os.urandom(20 * MiB)
    handle = agent.ok("open_write", path="big/dir/blob.bin")["handle"]
    for start in range(0, len(data), MiB):
        assert agent.ok("write", data[start : start + MiB], handle=handle)["written"] == MiB
    # Until commit the data lives in a temp file beside the target.
    names = [e["name"] for e in agent.ok("list", path="big/dir")["entries"]]
    assert len(names) == 1
    assert names[0].startswith(".blob.bin.sandgate-")
    entry = agent.ok("close_write", handle=handle, commit=True)["entry"]
    assert entry["path"] == "/workspace/big/dir/blob.bin"
    assert entry["name"] == "blob.bin"
    assert entry["type"] == "file"
    assert entry["size"] == len(data)
    assert [e["name"] for e in agent.ok("list", path="big/dir")["entries"]] == ["blob.bin"]
    host = agent.workspace / "big" / "dir" / "blob.bin"
    assert hashlib.sha256(host.read_bytes()).digest() == hashlib.sha256(data).digest()
    back = _read_file(agent, "/workspace/big/dir/blob.bin", chunk=MiB + 12345)
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
    assert _read_file(agent, "big/dir/blob.bin", chunk=4 * MiB) == data


def test_pipelined_handle_operations_run_in_order(agent: Agent) -> None:
    chunks = [bytes([i]) * (16 << 10) for i in range(250)]  # unordered, this fails
    handle = agent.ok("open_write", path="pipelined.bin")["handle"]
    ids = [agent.send("write", chunk, handle=handle) for chunk in chunks]
    close_id = agent.send("close_write", handle=handle, commit=True)
    answers = {}
    for _ in range(len(ids) + 1):
        header, _ = agent.recv()
        assert header["ok"], header
        answers[header["id"]] = header
    assert answers[close_id]["entry"]["size"] == len(b"".join(chunks))
    assert (agent.workspace / "pipelined.bin").read_bytes() == b"".join(chunks)
    opened = agent.ok("open_read", path="pipelined.bin")
    ids = [agent.send("read", handle=opened["handle"], length=len(c)) for c in chunks]
    by_id = {}
    for _ in ids:
        header, body = agent.recv()
        assert header["ok"], header
        by_id[header["id"]] = body
    assert [by_id[i] for i in ids] == chunks
    agent.ok("close_read", handle=opened["handle"])


def test_writes_and_reads_at_offsets_do_not_depend_on_their_order(agent: Agent) -> None:
    chunks = [bytes([i + 1]) * (64 << 10) for i in range(8)]
    opened = agent.ok("open_write", path="at.bin")
    assert opened["offsets"] is True
    size = 64 << 10
    for i in (5, 0, 7, 2, 1, 6, 3, 4):  # out of order: a position-based write would garble
        written = agent.ok("write", chunks[i], handle=opened["handle"], offset=i * size)
        assert written["written"] == size
    assert agent.ok("close_write", handle=opened["handle"], commit=True)["entry"]["size"] == (
        8 * size
    )
    assert (agent.workspace / "at.bin").read_bytes() == b"".join(chunks)
    reading = agent.ok("open_read", path="at.bin")
    assert reading["offsets"] is True
    for i in (6, 1, 3):
        header, body = agent.call("read", handle=reading["handle"], length=size, offset=i * size)
        assert header["ok"] and body == chunks[i], header
    header, body = agent.call("read", handle=reading["handle"], length=size, offset=8 * size)
    assert header["ok"] and body == b""  # past the end: nothing, as at the end of a file
    assert agent.error("read", handle=reading["handle"], length=1, offset=-1) == "invalid_request"
    agent.ok("close_read", handle=reading["handle"])


def test_write_replaces_atomically_and_abort_discards(agent: Agent) -> None:
    _write_file(agent, "f.txt", b"first")
    handle = agent.ok("open_write", path="f.txt")["handle"]
    agent.ok("write", b"second", handle=handle)
    assert (agent.workspace / "f.txt").read_bytes() == b"first"
    assert agent.ok("close_write", handle=handle, commit=False) == {
        "id": agent._next_id,
        "ok": True,
    }
    assert sorted(p.name for p in agent.workspace.iterdir()) == ["f.txt"]
    assert (agent.workspace / "f.txt").read_bytes() == b"first"
    assert agent.error("write", b"x", handle=handle) == "not_found"
    _write_file(agent, "f.txt", b"")
    assert (agent.workspace / "f.txt").read_bytes() == b""


def test_write_mode_and_tmp_root(agent: Agent) -> None:
    entry = _write_file(agent, "/tmp/x/y.txt", b"hello")
    assert entry["path"] == "/tmp/x/y.txt"
    umask = os.umask(0o022)
    os.umask(umask)  # the agent inherited the test's umask
    assert entry["mode"] == f"{0o644 & ~umask:04o}"
    assert (agent.tmp / "x" / "y.txt").read_bytes() == b"hello"
    assert _read_file(agent, "/tmp/x/y.txt") == b"hello"


def test_write_onto_a_directory(agent: Agent) -> None:
    (agent.workspace / "d").mkdir()
    assert agent.error("open_write", path="d") == "is_a_directory"
    assert agent.error("open_write", path="/workspace") == "is_a_directory"
    handle = agent.ok("open_write", path="later")["handle"]
    (agent.workspace / "later").mkdir()
    assert agent.error("close_write", handle=handle, commit=True) == "is_a_directory"
    assert sorted(p.name for p in agent.workspace.iterdir()) == ["d", "later"]


def test_write_below_a_file(agent: Agent) -> None:
    (agent.workspace / "file").write_text("x")
    assert agent.error("open_write", path="file/child") == "not_a_directory"


def test_handle_errors(agent: Agent) -> None:
    (agent.workspace / "r.txt").write_bytes(b"abc")
    rh = agent.ok("open_read", path="r.txt")["handle"]
    wh = agent.ok("open_write", path="w.txt")["handle"]
    assert agent.error("write", b"x", handle=rh) == "invalid_request"
    assert agent.error("read", handle=wh, length=1) == "invalid_request"
    assert agent.error("close_read", handle=wh) == "invalid_request"
    assert agent.error("read", handle=rh, length=0) == "invalid_request"
    assert agent.error("read", handle=rh, length=4 * MiB + 1) == "invalid_request"
    assert agent.error("read", handle="1", length=1) == "invalid_request"
    assert agent.error("read", handle=999, length=1) == "not_found"
    assert agent.error("close_write", handle=wh) == "invalid_request"  # commit is required
    assert agent.call("read", handle=rh, length=2)[1] == b"ab"
    assert agent.call("read", handle=rh, length=2)[1] == b"c"
    assert agent.call("read", handle=rh, length=2)[1] == b""
    agent.ok("close_read", handle=rh)
    assert agent.error("close_read", handle=rh) == "not_found"
    agent.ok("close_write", handle=wh, commit=False)


def test_open_read_errors(agent: Agent) -> None:
    (agent.workspace / "d").mkdir()
    os.mkfifo(agent.workspace / "fifo")
    assert agent.error("open_read", path="missing") == "not_found"
    assert agent.error("open_read", path="d") == "is_a_directory"
    assert agent.error("open_read", path="fifo") == "invalid_request"


def test_a_small_file_in_one_call_each_way(agent: Agent) -> None:
    entry = agent.ok("open_write", b"one trip", path="sub/one.txt", commit=True)
    assert entry["handle"] is None and entry["entry"]["size"] == 8
    assert (agent.workspace / "sub" / "one.txt").read_bytes() == b"one trip"
    assert [p.name for p in (agent.workspace / "sub").iterdir()] == ["one.txt"]  # no temp left
    header, body = agent.call("open_read", path="sub/one.txt", first=MiB)
    assert header["ok"] and (header["handle"], header["eof"], header["size"]) == (None, True, 8)
    assert body == b"one trip" and header["first"] == 8
    # a file larger than `first`: its head, and a handle that reads on from there
    big = os.urandom(3 * 1000 + 7)
    (agent.workspace / "big.bin").write_bytes(big)
    header, body = agent.call("open_read", path="big.bin", first=1000)
    assert (header["eof"], header["first"], header["size"], body) == (False, 1000, 3007, big[:1000])
    rest, more = agent.call("read", handle=header["handle"], length=MiB)
    assert rest["ok"] and body + more == big
    agent.ok("close_read", handle=header["handle"])
    # an empty file, and a file exactly `first` long: both whole in the answer
    (agent.workspace / "empty").write_bytes(b"")
    assert agent.call("open_read", path="empty", first=10)[0]["eof"] is True
    (agent.workspace / "ten").write_bytes(b"0123456789")
    header, body = agent.call("open_read", path="ten", first=10)
    assert (header["eof"], header["handle"], body) == (True, None, b"0123456789")
    # errors are the same as the long way's, and nothing is left behind
    assert agent.error("open_write", b"x", path="/workspace", commit=True) == "is_a_directory"
    assert agent.error("open_read", path="big.bin", first=0) == "invalid_request"
    assert agent.error("open_read", path="big.bin", first=(4 << 20) + 1) == "invalid_request"
    assert agent.error("open_write", b"x", path="w", commit="yes") == "invalid_request"
    assert sorted(p.name for p in agent.workspace.iterdir()) == ["big.bin", "empty", "sub", "ten"]


def test_too_many_handles(agent: Agent) -> None:
    (agent.workspace / "r.txt").write_bytes(b"abc")
    handles = [agent.ok("open_read", path="r.txt")["handle"] for _ in range(64)]
    assert len(set(handles)) == 64
    assert agent.error("open_read", path="r.txt") == "io_error"
    assert agent.error("open_write", path="w.txt") == "io_error"
    assert [p.name for p in agent.workspace.iterdir()] == ["r.txt"]
    agent.ok("close_read", handle=handles[0])
    agent.ok("close_read", handle=agent.ok("open_read", path="r.txt")["handle"])


def test_unfinished_upload_is_discarded_at_exit(agent: Agent) -> None:
    handle = agent.ok("open_write", path="partial.bin")["handle"]
    agent.ok("write", b"x" * 1000, handle=handle)
    assert len(list(agent.workspace.iterdir())) == 1
    assert agent.close() == 0
    assert list(agent.workspace.iterdir()) == []


def test_stat(agent: Agent) -> None:
    (agent.workspace / "f.txt").write_bytes(b"12345")
    os.chmod(agent.workspace / "f.txt", 0o640)
    entry = agent.ok("stat", path="f.txt")["entry"]
    assert set(entry) == {"name", "path", "type", "size", "mode", "mtime"}
    assert (entry["name"], entry["path"], entry["type"]) == ("f.txt", "/workspace/f.txt", "file")
    assert (entry["size"], entry["mode"]) == (5, "0640")
    mtime = datetime.fromisoformat(entry["mtime"])
    assert mtime.utcoffset() is not None and mtime.utcoffset().total_seconds() == 0  # type: ignore[union-attr]
    expected = (agent.workspace / "f.txt").stat().st_mtime
    assert abs(mtime.timestamp() - expected) < 0.001
    root = agent.ok("stat", path="/workspace")["entry"]
    assert (root["path"], root["type"]) == ("/workspace", "dir")
    assert agent.ok("stat", path=".")["entry"]["path"] == "/workspace"
    assert agent.ok("stat", path="/tmp")["entry"]["type"] == "dir"
    assert agent.error("stat", path="nope") == "not_found"


def test_list(agent: Agent) -> None:
    (agent.workspace / "b").mkdir()
    (agent.workspace / "a.txt").write_text("a")
    (agent.workspace / "c").symlink_to("a.txt")
    (agent.workspace / "b" / "inner").write_text("i")
    entries = agent.ok("list", path="/workspace")["entries"]
    assert [(e["name"], e["type"], e["path"]) for e in entries] == [
        ("a.txt", "file", "/workspace/a.txt"),
        ("b", "dir", "/workspace/b"),
        ("c", "symlink", "/workspace/c"),
    ]
    assert [e["path"] for e in agent.ok("list", path="b/")["entries"]] == ["/workspace/b/inner"]
    assert agent.ok("list", path="/tmp")["entries"] == []
    assert agent.error("list", path="a.txt") == "not_a_directory"
    assert agent.error("list", path="missing") == "not_found"


def test_mkdir(agent: Agent) -> None:
    entry = agent.ok("mkdir", path="x/y/z")["entry"]
    assert (entry["path"], entry["type"]) == ("/workspace/x/y/z", "dir")
    assert (agent.workspace / "x" / "y" / "z").is_dir()
    assert agent.ok("mkdir", path="x/y/z", parents=True)["entry"]["path"] == "/workspace/x/y/z"
    assert agent.error("mkdir", path="x/y/z", parents=False) == "exists"
    assert agent.error("mkdir", path="p/q", parents=False) == "not_found"
    agent.ok("mkdir", path="x/single", parents=False)
    (agent.workspace / "file").write_text("f")
    assert agent.error("mkdir", path="file") == "exists"
    assert agent.error("mkdir", path="file/sub") == "not_a_directory"
    assert agent.error("mkdir", path="x", parents="yes") == "invalid_request"


def test_move(agent: Agent) -> None:
    (agent.workspace / "a.txt").write_text("a")
    (agent.workspace / "b.txt").write_text("b")
    (agent.workspace / "dir").mkdir()
    assert agent.error("move", src="a.txt", dst="b.txt") == "exists"
    entry = agent.ok("move", src="a.txt", dst="b.txt", overwrite=True)["entry"]
    assert entry["path"] == "/workspace/b.txt"
    assert (agent.workspace / "b.txt").read_text() == "a"
    assert not (agent.workspace / "a.txt").exists()
    assert agent.ok("move", src="dir", dst="/tmp/moved")["entry"]["type"] == "dir"
    assert (agent.tmp / "moved").is_dir()
    assert agent.error("move", src="missing", dst="x") == "not_found"
    assert agent.error("move", src="b.txt", dst="/etc/b.txt") == "path_outside_sandbox"
    header, _ = agent.call("list", path="/nope")
    assert header["error"]["message"].endswith("use a path under /workspace or /tmp"), header
    assert agent.error("move", src="/workspace", dst="/tmp/ws") == "invalid_request"
    assert agent.error("move", src="b.txt", dst="/tmp") == "invalid_request"
    assert agent.error("move", src="b.txt", dst="no/such/dir/b.txt") == "not_found"


def test_remove(agent: Agent) -> None:
    (agent.workspace / "f").write_text("f")
    (agent.workspace / "d" / "e").mkdir(parents=True)
    (agent.workspace / "d" / "e" / "g").write_text("g")
    assert agent.ok("remove", path="f") == {"id": agent._next_id, "ok": True}
    assert not (agent.workspace / "f").exists()
    assert agent.error("remove", path="f") == "not_found"
    assert agent.error("remove", path="d") == "directory_not_empty"
    agent.ok("remove", path="d", recursive=True)
    assert list(agent.workspace.iterdir()) == []
    agent.ok("mkdir", path="empty")
    agent.ok("remove", path="empty")
    assert agent.error("remove", path="/workspace", recursive=True) == "invalid_request"
    assert agent.error("remove", path="/tmp", recursive=True) == "invalid_request"
    assert agent.error("remove", path=".", recursive=True) == "invalid_request"
    assert agent.workspace.is_dir()


# --------------------------------------------------------------------------- path escapes


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "secret.txt").write_text("secret")
    return directory


@pytest.mark.parametrize(
    "path",
    [
        "../../etc/passwd",
        "/etc/passwd",
        "/workspace/../etc",
        "/workspace/../etc/passwd",
        "/tmp/../etc/passwd",
        "..",
        "/",
        "/workspacex/a",
        "//etc/passwd",
        "/tmpfoo",
    ],
)
def test_lexical_escapes(agent: Agent, path: str) -> None:
    assert agent.error("stat", path=path) == "path_outside_sandbox"
    assert agent.error("open_read", path=path) == "path_outside_sandbox"
    assert agent.error("open_write", path=path) == "path_outside_sandbox"
    assert agent.error("list", path=path) == "path_outside_sandbox"
    assert agent.error("mkdir", path=path) == "path_outside_sandbox"
    assert agent.error("remove", path=path, recursive=True) == "path_outside_sandbox"


@pytest.mark.parametrize("path", ["", "a\x00b", "/workspace/\x00", None, 12])
def test_invalid_paths(agent: Agent, path: Any) -> None:
    assert agent.error("stat", path=path) == "invalid_request"
    assert agent.error("open_read", path=path) == "invalid_request"
    assert agent.error("open_write", path=path) == "invalid_request"


def test_symlink_to_a_directory_outside(agent: Agent, outside: Path) -> None:
    (agent.workspace / "etc").symlink_to("/etc")
    (agent.workspace / "out").symlink_to(outside)
    for path in ("etc/passwd", "/workspace/etc/passwd", "out/secret.txt"):
        assert agent.error("open_read", path=path) == "path_outside_sandbox"
        assert agent.error("stat", path=path) == "path_outside_sandbox"
        assert agent.error("remove", path=path) == "path_outside_sandbox"
    assert agent.error("list", path="etc") == "path_outside_sandbox"
    assert agent.error("list", path="out") == "path_outside_sandbox"
    assert agent.error("open_write", path="out/new.txt") == "path_outside_sandbox"
    assert agent.error("mkdir", path="out/newdir") == "path_outside_sandbox"
    assert agent.error("move", src="out/secret.txt", dst="stolen") == "path_outside_sandbox"
    assert agent.error("exec", language="bash", code="pwd", cwd="out") == "path_outside_sandbox"
    assert not (outside / "new.txt").exists()
    assert not (outside / "newdir").exists()
    # The link itself is the sandbox's own: it can be seen, listed and removed.
    assert agent.ok("stat", path="etc")["entry"]["type"] == "symlink"
    agent.ok("remove", path="out", recursive=True)
    assert not (agent.workspace / "out").is_symlink()
    assert (outside / "secret.txt").read_text() == "secret"


def test_symlink_to_a_file_outside(agent: Agent, outside: Path) -> None:
    (agent.workspace / "passwd").symlink_to("/etc/passwd")
    (agent.workspace / "secret").symlink_to(outside / "secret.txt")
    (agent.workspace / "dangling").symlink_to(outside / "not-yet.txt")
    for path in ("passwd", "secret", "dangling"):
        assert agent.error("open_read", path=path) == "path_outside_sandbox"
        assert agent.error("open_write", path=path) == "path_outside_sandbox"
    assert not (outside / "not-yet.txt").exists()
    assert (outside / "secret.txt").read_text() == "secret"
    entry = agent.ok("stat", path="secret")["entry"]
    assert (entry["type"], entry["path"]) == ("symlink", "/workspace/secret")


def test_removing_a_symlink_removes_only_the_link(agent: Agent, outside: Path) -> None:
    (agent.workspace / "secret").symlink_to(outside / "secret.txt")
    (agent.workspace / "dir").symlink_to(outside)
    agent.ok("remove", path="secret")
    agent.ok("remove", path="dir")
    assert list(agent.workspace.iterdir()) == []
    assert (outside / "secret.txt").read_text() == "secret"
    inner = agent.workspace / "inner"
    inner.mkdir()
    (inner / "target.txt").write_text("t")
    (agent.workspace / "link").symlink_to("inner/target.txt")
    agent.ok("remove", path="link")
    assert (inner / "target.txt").read_text() == "t"


def test_symlinks_inside_the_sandbox_work(agent: Agent) -> None:
    (agent.workspace / "real").mkdir()
    (agent.workspace / "real" / "f.txt").write_text("inside")
    (agent.workspace / "alias").symlink_to("real")
    (agent.workspace / "flink").symlink_to("real/f.txt")
    assert _read_file(agent, "flink") == b"inside"
    assert _read_file(agent, "alias/f.txt") == b"inside"
    assert [e["path"] for e in agent.ok("list", path="alias")["entries"]] == [
        "/workspace/alias/f.txt"
    ]
    _write_file(agent, "flink", b"through the link")
    assert (agent.workspace / "real" / "f.txt").read_text() == "through the link"
    assert (agent.workspace / "flink").is_symlink()
    assert agent.exec("pwd", cwd="alias")["stdout"] == f"{agent.workspace}/real\n"


def test_tmp_link_into_workspace_is_outside_its_root(agent: Agent) -> None:
    (agent.workspace / "f.txt").write_text("ws")
    (agent.tmp / "ws").symlink_to(agent.workspace)
    assert agent.error("open_read", path="/tmp/ws/f.txt") == "path_outside_sandbox"


def _proc_status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_large_transfers_reuse_memory_and_give_it_back_when_idle(agent: Agent) -> None:
    """MiB buffers come from the heap while requests come (no page faults per buffer) and go
    back once the request threads have been idle (main._tune_malloc, threads.on_idle): after
    60 MiB each way and 6 MiB of exec output the agent holds what it held after one small
    request of each kind, give or take 3 MiB (it held ~4 MiB more without giving back)."""
    pid = agent.proc.pid
    agent.ok("open_write", b"x", path="/workspace/small", commit=True)
    agent.ok("open_read", path="/workspace/small", first=MiB)
    agent.exec("echo warm")
    warm = _proc_status(pid, "RssAnon")
    data = os.urandom(MiB)
    for i in range(60):
        agent.ok("open_write", data[i:] + data[:i], path=f"/workspace/f{i % 3}", commit=True)
        _, body = agent.call("open_read", path=f"/workspace/f{i % 3}", first=MiB)
        assert len(body) == MiB
        if i % 10 == 0:
            ran = agent.exec("head -c 1500000 /dev/zero")
            assert ran["stdout_truncated"] is True
    assert _wait_until(lambda: _proc_status(pid, "Threads") == 1, timeout=30)
    assert _proc_status(pid, "RssAnon") <= warm + 3 * 1024
