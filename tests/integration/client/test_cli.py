"""The client commands of `sandgate`, run as a user runs them: subprocesses, a real pseudo-
terminal for `sandgate shell`, and tmux."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.api.conftest import (
    Deployment,
    deployment,  # noqa: F401 (the session fixture, shared with the API tests' module)
    free_port,
)

BIG = 20 * 1024 * 1024  # over the progress bar's threshold


@pytest.fixture
def env(deployment: Deployment) -> dict[str, str]:  # noqa: F811 (pytest fixture injection)
    return {
        **os.environ,
        "SANDGATE_URL": deployment.url,
        "SANDGATE_API_KEY": deployment.keys["alpha"],
        "COLUMNS": "200",
    }


def cli(
    env: dict[str, str], *args: str, stdin: bytes | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "sandgate", *args],
        env=env,
        input=stdin,
        capture_output=True,
        timeout=timeout,
    )


def ok(result: subprocess.CompletedProcess[bytes]) -> str:
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    return result.stdout.decode()


def one_error_line(result: subprocess.CompletedProcess[bytes]) -> str:
    err = result.stderr.decode()
    assert result.returncode != 0
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def name(env: dict[str, str]) -> Iterator[str]:
    created = ok(cli(env, "sandbox", "create", "--metadata", "test=cli")).strip()
    yield created
    cli(env, "sandbox", "rm", created)


# ------------------------------------------------------------------------------ sandbox


def test_create_ls_rm(env: dict[str, str]) -> None:
    tag = uuid.uuid4().hex
    created = cli(
        env, "sandbox", "create", "--metadata", f"tag={tag}", "-m", "b=c", "--env", "A=from-env",
        "--timeout", "120",
    )  # fmt: skip
    name = ok(created).strip()
    assert name.startswith("sbx-") and "\n" not in name

    table = ok(cli(env, "sandbox", "ls", "--metadata", f"tag={tag}"))
    header, row = table.strip().splitlines()
    assert header.split()[:4] == ["NAME", "STATE", "TEMPLATE", "WORKER"]
    assert row.split()[:2] == [name, "running"] and f"tag={tag}" in row and "idem" not in row
    assert ok(cli(env, "sandbox", "ls", "-q", "--metadata", f"tag={tag}")) == f"{name}\n"
    assert name in ok(cli(env, "sandbox", "ls", "--state", "running", "-q")).split()
    assert ok(cli(env, "sandbox", "exec", name, "--", "echo $A")) == "from-env\n"

    assert ok(cli(env, "sandbox", "rm", name)) == f"{name}\n"
    assert ok(cli(env, "sandbox", "ls", "-q", "--metadata", f"tag={tag}")) == ""
    again = cli(env, "sandbox", "rm", name)
    assert again.returncode == 1
    assert one_error_line(again) == f"error: sandbox {name} not found"


def test_exec(env: dict[str, str], name: str) -> None:
    hello = cli(env, "sandbox", "exec", name, "--", "echo", "hello  world", "$HOME")
    assert ok(hello) == "hello  world $HOME\n"  # several arguments are quoted, as argv
    mixed = cli(env, "sandbox", "exec", name, "--", "echo out; echo err >&2; exit 3")
    assert (mixed.returncode, mixed.stdout, mixed.stderr) == (3, b"out\n", b"err\n")
    python = cli(env, "sandbox", "exec", name, "--code", "print(6*7)", "--language", "python")
    assert ok(python) == "42\n"
    piped = cli(env, "sandbox", "exec", name, "-c", "-", stdin=b"pwd; echo $X")
    assert ok(piped) == "/workspace\n\n"
    where = cli(env, "sandbox", "exec", name, "--cwd", "/tmp", "-e", "X=y", "--", "pwd; echo $X")
    assert ok(where) == "/tmp\ny\n"
    slow = cli(env, "sandbox", "exec", name, "--timeout", "0.5", "--", "sleep 5")
    assert slow.returncode == 124 and b"timed out" in slow.stderr

    missing = cli(env, "sandbox", "exec", "sbx-nothere", "--", "true")
    assert missing.returncode == 255
    assert one_error_line(missing) == "error: sandbox sbx-nothere not found"
    assert cli(env, "sandbox", "exec", name).returncode == 2  # usage: no command


def test_errors_are_one_line(env: dict[str, str], tmp_path: Path) -> None:
    wrong_key = cli({**env, "SANDGATE_API_KEY": "sg_wrong"}, "sandbox", "ls")
    assert wrong_key.returncode == 1 and "key" in one_error_line(wrong_key)
    nowhere = f"http://127.0.0.1:{free_port()}"
    unreachable = cli(env, "sandbox", "ls", "--url", nowhere)
    assert unreachable.returncode == 1
    assert one_error_line(unreachable).startswith(f"error: cannot reach {nowhere}")
    bad_pair = cli(env, "sandbox", "create", "--metadata", "novalue")
    assert bad_pair.returncode == 2 and b"KEY=VALUE" in bad_pair.stderr


def test_default_key_file(env: dict[str, str], deployment: Deployment, tmp_path: Path) -> None:  # noqa: F811
    (tmp_path / ".sandgate").mkdir()
    (tmp_path / ".sandgate" / "api-key").write_text(deployment.keys["alpha"] + "\n")
    no_key = {k: v for k, v in env.items() if k != "SANDGATE_API_KEY"}
    result = subprocess.run(
        [sys.executable, "-m", "sandgate", "sandbox", "ls", "-q"],
        env=no_key,
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_start_logs_ps(env: dict[str, str], name: str) -> None:
    script = "for i in 1 2 3; do echo l$i; done; echo e >&2; exit 4"
    pid = ok(cli(env, "sandbox", "start", name, "--", script)).strip()
    assert pid.isdigit()
    followed = cli(env, "sandbox", "logs", name, pid, "--follow")
    assert (followed.returncode, followed.stdout, followed.stderr) == (4, b"l1\nl2\nl3\n", b"e\n")

    sleeper = ok(cli(env, "sandbox", "start", name, "--", "echo early; sleep 300")).strip()
    began = time.monotonic()
    snapshot = cli(env, "sandbox", "logs", name, sleeper)  # no --follow: what is there now
    assert ok(snapshot) == "early\n" and time.monotonic() - began < 10

    table = ok(cli(env, "sandbox", "ps", name))
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert rows[pid].split()[1:3] == ["exited", "4"]
    assert rows[sleeper].split()[1] == "running" and "sleep 300" in rows[sleeper]
    missing = cli(env, "sandbox", "logs", name, "99999")
    assert missing.returncode == 1 and "99999" in one_error_line(missing)


# ------------------------------------------------------------------------------ exec jobs


def test_exec_job_submit_wait(env: dict[str, str], name: str) -> None:
    waited = cli(env, "exec-job", "submit", name, "--wait", "--", "echo out; echo err >&2; exit 3")
    assert (waited.returncode, waited.stdout, waited.stderr) == (3, b"out\n", b"err\n")
    argv = cli(env, "exec-job", "submit", name, "-w", "-e", "X=y", "--cwd", "/tmp", "--",
               "echo", "a  b", "$X")  # fmt: skip
    assert ok(argv) == "a  b $X\n"  # several arguments are quoted, as argv
    where = cli(env, "exec-job", "submit", name, "-w", "-e", "X=y", "--cwd", "/tmp", "--",
                "pwd; echo $X")  # fmt: skip
    assert ok(where) == "/tmp\ny\n"
    slow = cli(env, "exec-job", "submit", name, "--wait", "--timeout", "0.5", "--", "sleep 5")
    assert slow.returncode == 124 and b"timed out" in slow.stderr

    missing = cli(env, "exec-job", "submit", "sbx-nothere", "--wait", "--", "true")
    assert missing.returncode == 255  # as `sandbox exec`: the job's own codes stay apart
    assert one_error_line(missing) == "error: sandbox sbx-nothere not found"
    not_waiting = cli(env, "exec-job", "submit", "sbx-nothere", "--", "true")
    assert not_waiting.returncode == 1 and "sbx-nothere" in one_error_line(not_waiting)
    assert cli(env, "exec-job", "submit", name).returncode == 2  # usage: no command


def test_exec_job_key_get_ls(env: dict[str, str], name: str) -> None:
    key = f"cli-{uuid.uuid4().hex}"
    command = "echo ran >> runs; echo hi"
    job_id = ok(cli(env, "exec-job", "submit", name, "--key", key, "--", command)).strip()
    assert len(job_id) == 32 and "\n" not in job_id
    again = ok(cli(env, "exec-job", "submit", name, "--key", key, "--", command)).strip()
    assert again == job_id
    waited = cli(env, "exec-job", "submit", name, "-k", key, "--wait", "--", command)
    assert (waited.returncode, waited.stdout, waited.stderr) == (0, b"hi\n", b"")
    assert ok(cli(env, "sandbox", "exec", name, "--", "cat runs")) == "ran\n"  # ran once

    reused = cli(env, "exec-job", "submit", name, "--key", key, "--", "echo other >> runs")
    assert reused.returncode == 1 and "Idempotency-Key" in one_error_line(reused)
    assert ok(cli(env, "sandbox", "exec", name, "--", "cat runs")) == "ran\n"

    shown = ok(cli(env, "exec-job", "get", job_id))
    fields = dict(line.split(":", 1) for line in shown.splitlines())
    fields = {k: v.strip() for k, v in fields.items()}
    assert (fields["id"], fields["sandbox"], fields["state"]) == (job_id, name, "succeeded")
    assert (fields["exit code"], fields["command"], fields["error"]) == ("0", command, "-")
    assert fields["stdout"] == "3 bytes" and fields["finished"] != "-"
    assert ok(cli(env, "exec-job", "get", job_id, "--output")) == "hi\n"
    missing = cli(env, "exec-job", "get", "0" * 32)
    assert missing.returncode == 1
    assert one_error_line(missing) == f"error: exec job {'0' * 32} not found"

    failed_id = ok(cli(env, "exec-job", "submit", name, "--", "exit 7")).strip()
    assert cli(env, "exec-job", "submit", name, "--wait", "--", "exit 5").returncode == 5
    assert ok(cli(env, "exec-job", "ls", name, "-q")).split()[1:] == [failed_id, job_id]
    table = ok(cli(env, "exec-job", "ls", name))
    header, *rows = table.strip().splitlines()
    assert header.split() == ["ID", "STATE", "EXIT", "CREATED", "FINISHED", "COMMAND"]
    assert len(rows) == 3 and rows[0].split()[1:3] == ["failed", "5"]
    assert rows[2].split()[:3] == [job_id, "succeeded", "0"] and rows[2].endswith(command)
    assert ok(cli(env, "exec-job", "ls", name, "-q", "--limit", "1")).split() == [
        rows[0].split()[0]
    ]


# ------------------------------------------------------------------------------ cp


def test_cp_both_ways(env: dict[str, str], name: str, tmp_path: Path) -> None:
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(BIG))
    digest = hashlib.sha256(source.read_bytes()).hexdigest()

    upload = cli(env, "cp", str(source), f"{name}:data/big.bin")
    assert ok(upload) == "" and upload.stderr == b""  # no bar when stderr is not a terminal
    check = ok(cli(env, "sandbox", "exec", name, "--", "sha256sum data/big.bin"))
    assert check.split()[0] == digest

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ok(cli(env, "cp", f"{name}:data/big.bin", str(out_dir)))  # into a directory: its name
    assert hashlib.sha256((out_dir / "big.bin").read_bytes()).hexdigest() == digest
    ok(cli(env, "cp", f"{name}:/workspace/data/big.bin", str(tmp_path / "copy.bin")))
    assert (tmp_path / "copy.bin").read_bytes() == source.read_bytes()

    small = tmp_path / "note.txt"
    small.write_text("note\n")
    ok(cli(env, "cp", str(small), f"{name}:data/"))  # into a remote directory: its name
    ok(cli(env, "cp", str(small), f"{name}:data"))  # an existing remote directory too
    assert ok(cli(env, "sandbox", "exec", name, "--", "cat data/note.txt")) == "note\n"

    ok(cli(env, "cp", "-", f"{name}:/tmp/piped", stdin=b"from stdin"))
    assert ok(cli(env, "cp", f"{name}:/tmp/piped", "-")) == "from stdin"

    missing = cli(env, "cp", str(tmp_path / "nope"), f"{name}:x")
    assert missing.returncode == 1 and "nope" in one_error_line(missing)
    remote_missing = cli(env, "cp", f"{name}:nope", str(tmp_path / "x"))
    assert remote_missing.returncode == 1 and not (tmp_path / "x").exists()
    assert cli(env, "cp", str(small), str(tmp_path / "y")).returncode == 2  # both local


def test_cp_shows_progress_on_a_terminal(env: dict[str, str], name: str, tmp_path: Path) -> None:
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(BIG))
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandgate", "cp", str(source), f"{name}:big.bin"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=slave,
        )
        os.close(slave)
        drawn = Tty(master).read_all(proc, timeout=60)
    finally:
        os.close(master)
    assert proc.returncode == 0
    assert b"big.bin" in drawn and b"21.0/21.0 MB" in drawn, drawn[-400:]


# ------------------------------------------------------------------------------ run-code


def test_run_code_argument_stdin_and_errors(env: dict[str, str], name: str) -> None:
    assert ok(cli(env, "run-code", name, "x = 6")) == ""
    assert ok(cli(env, "run-code", name, "print('out'); x * 7")) == "out\n42\n"
    block = b"import sys\nprint('err', file=sys.stderr)\nfor i in range(2):\n    print(i + x)\n"
    piped = cli(env, "run-code", name, stdin=block)  # no CODE, stdin not a terminal
    assert (ok(piped), piped.stderr) == ("6\n7\n", b"err\n")
    assert ok(cli(env, "run-code", name, "-", stdin=b"x")) == "6\n"
    assert ok(cli(env, "run-code", name, "--context", "default", "x")) == "6\n"
    assert ok(cli(env, "run-code", name, "-e", "ONLY=here", "import os; os.environ['ONLY']")) == (
        "'here'\n"
    )

    failed = cli(env, "run-code", name, "print('before'); 1/0")
    assert failed.returncode == 1 and failed.stdout == b"before\n"
    err = failed.stderr.decode()
    assert "ZeroDivisionError: division by zero" in err and "\x1b[" not in err  # no colours
    late = cli(env, "run-code", name, "--timeout", "1", "import time; time.sleep(30)")
    assert late.returncode == 1 and b"TimeoutError" in late.stderr
    assert ok(cli(env, "run-code", name, "x")) == "6\n", "the context outlived both"

    plot = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()"
    figure = ok(cli(env, "run-code", name, plot, timeout=120))
    assert re.fullmatch(r"<Figure size \S+ with 1 Axes>\n\[image/png result: \d+ bytes\]\n", figure)

    missing = cli(env, "run-code", name, "--context", "nope", "1")
    assert missing.returncode == 255
    assert one_error_line(missing) == f"error: no code context 'nope' in sandbox {name}"
    nobox = cli(env, "run-code", "sbx-nothere", "1")
    assert nobox.returncode == 255
    assert one_error_line(nobox) == "error: sandbox sbx-nothere not found"


def test_run_code_json_lines(env: dict[str, str], name: str) -> None:
    out = ok(cli(env, "run-code", name, "--json", "print('a'); 6 * 7"))
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["type"] for e in events] == ["stdout", "result", "end"]
    assert events[0]["text"] == "a\n" and events[0]["timestamp"]
    assert events[1] == {"type": "result", "text": "42", "is_main_result": True}
    assert events[2] == {"type": "end", "execution_count": 1, "context": "default"}
    failed = cli(env, "run-code", name, "--json", "raise ValueError('no')")
    assert failed.returncode == 1 and failed.stderr == b""
    error, end = (json.loads(line) for line in failed.stdout.decode().splitlines())
    assert (error["type"], error["name"], error["value"]) == ("error", "ValueError", "no")
    assert "ValueError" in error["traceback"] and end["execution_count"] == 2


def test_run_code_repl_through_a_pseudo_terminal(env: dict[str, str], name: str) -> None:
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", CTTY, "run-code", name],  # the pty is its terminal: Ctrl-C works
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    screen = Tty(master)
    try:
        screen.expect(b">>> ", timeout=60)
        screen.type(b"y = 20\r")
        screen.expect(b">>> ")
        screen.type(b"for i in range(2):\r")
        screen.expect(b"... ")
        screen.type(b"    print(i + y)\r")
        screen.expect(b"... ")
        screen.type(b"\r")
        screen.expect(b"20\r\n21\r\n")
        screen.type(b"1/0\r")
        screen.expect(b"ZeroDivisionError")
        screen.expect(b">>> ")
        # Ctrl-C once the code runs (its output is in): readline has given the terminal
        # back by then, so ^C is a signal (a fixed pause lost that race on a loaded machine)
        screen.type(b"import time; print('sleep' + 'ing', flush=True); time.sleep(60)\r")
        screen.expect(b"sleeping\r\n", timeout=30)
        screen.type(b"\x03")  # Ctrl-C: the run's stream closes, the kernel is interrupted
        screen.expect(b"KeyboardInterrupt")
        screen.expect(b">>> ", timeout=30)
        screen.type(b"y * 2\r")
        screen.expect(b"40\r\n", timeout=30)  # interrupted, not restarted: y is still there
        screen.expect(b">>> ")
        time.sleep(0.2)  # readline has the terminal now
        screen.type(b"\x04")  # Ctrl-D at the prompt ends the session
        assert proc.wait(timeout=30) == 0, screen.seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        os.close(slave)
    # the session had a context of its own (deleted at its end), not the default one
    outside = cli(env, "run-code", name, "y")
    assert outside.returncode == 1 and b"NameError" in outside.stderr


# ------------------------------------------------------------------------------ shell


class Tty:
    """The master side of a pseudo-terminal, read as a person watching the screen."""

    def __init__(self, master: int) -> None:
        self.master = master
        self.seen = b""
        self.mark = 0

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: every slave descriptor is closed
            return False
        self.seen += data
        return bool(data)

    def expect(self, wanted: bytes, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while (found := self.seen.find(wanted, self.mark)) < 0:
            left = deadline - time.monotonic()
            assert left > 0, f"no {wanted!r} in {self.seen[self.mark :]!r}"
            assert self._read(min(left, 0.2)), f"closed before {wanted!r}: {self.seen!r}"
        self.mark = found + len(wanted)

    def type(self, text: bytes) -> None:
        os.write(self.master, text)

    def read_all(self, proc: subprocess.Popen[bytes], timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._read(0.2):
            if proc.poll() is not None and not select.select([self.master], [], [], 0)[0]:
                break
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return self.seen


def set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


# the shell client gets the pty as its controlling terminal, as in a real login
CTTY = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, '-m', 'sandgate', *sys.argv[1:]])"
)


def spawn_shell(env: dict[str, str], name: str, slave: int, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", CTTY, "shell", name, *extra],
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )


def test_shell_through_a_pseudo_terminal(env: dict[str, str], name: str) -> None:
    master, slave = os.openpty()
    set_size(slave, 30, 100)
    before = termios.tcgetattr(slave)
    proc = spawn_shell(env, name, slave)
    screen = Tty(master)
    try:
        screen.expect(b"$ ")
        screen.type(b"echo hi\r")
        screen.expect(b"echo hi\r\n")  # the remote echo of what was typed
        screen.expect(b"hi\r\n")  # then the output
        screen.type(b"stty size\r")
        screen.expect(b"30 100")

        set_size(master, 40, 120)
        os.kill(proc.pid, signal.SIGWINCH)
        time.sleep(0.5)
        screen.type(b"stty size\r")
        screen.expect(b"40 120")

        screen.type(b"sleep 30\r")
        time.sleep(0.5)
        screen.type(b"\x03")  # Ctrl-C: a byte for the remote shell, not a signal for us
        screen.type(b"echo after-$((6*7))\r")
        screen.expect(b"after-42", timeout=10)
        assert proc.poll() is None

        # while it runs, the local terminal is raw: no echo, no signals from keys
        raw = termios.tcgetattr(slave)
        assert not raw[3] & termios.ECHO and not raw[3] & termios.ISIG

        screen.type(b"exit\r")
        assert proc.wait(timeout=15) == 0
        assert termios.tcgetattr(slave) == before  # the terminal is as it was
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        os.close(slave)


def test_shell_exit_code_and_sigterm_restore_the_terminal(env: dict[str, str], name: str) -> None:
    master, slave = os.openpty()
    before = termios.tcgetattr(slave)
    proc = spawn_shell(env, name, slave, "--command", "bash --norc -i")
    try:
        screen = Tty(master)
        screen.expect(b"$ ")
        screen.type(b"exit 3\r")
        assert proc.wait(timeout=15) == 3
        assert termios.tcgetattr(slave) == before

        proc = spawn_shell(env, name, slave)
        screen.expect(b"$ ")
        assert termios.tcgetattr(slave) != before  # raw now
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 128 + signal.SIGTERM
        assert termios.tcgetattr(slave) == before
        screen.expect(b"error: stopped by SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        os.close(slave)


def test_shell_refuses_a_missing_sandbox(env: dict[str, str]) -> None:
    result = cli(env, "shell", "sbx-nothere")
    assert result.returncode == 255
    assert one_error_line(result) == "error: sandbox sbx-nothere not found"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_shell_in_tmux(env: dict[str, str], name: str, tmp_path: Path) -> None:
    socket_name = f"sandgate-test-{uuid.uuid4().hex[:8]}"
    done = tmp_path / "exit-code"
    command = (
        f"SANDGATE_URL={env['SANDGATE_URL']} SANDGATE_API_KEY={env['SANDGATE_API_KEY']} "
        f"{sys.executable} -m sandgate shell {name}; echo $? > {done}; sleep 60"
    )

    def tmux(*args: str) -> str:
        result = subprocess.run(
            ["tmux", "-L", socket_name, *args], capture_output=True, text=True, timeout=10
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def wait_for_line(match: Callable[[str], bool], timeout: float = 15.0) -> None:
        """Until a line of the screen matches (tmux trims trailing blanks)."""
        deadline = time.monotonic() + timeout
        while not any(match(line) for line in tmux("capture-pane", "-p", "-t", "main").split("\n")):
            assert time.monotonic() < deadline, tmux("capture-pane", "-p", "-t", "main")
            time.sleep(0.1)

    tmux("new-session", "-d", "-s", "main", "-x", "100", "-y", "30", command)
    try:
        wait_for_line(lambda line: line.endswith("$"))  # the prompt
        tmux("send-keys", "-t", "main", "echo hi", "Enter")
        wait_for_line(lambda line: line == "hi")
        tmux("send-keys", "-t", "main", "stty size", "Enter")
        wait_for_line(lambda line: line == "30 100")
        tmux("resize-window", "-t", "main", "-x", "120", "-y", "40")
        time.sleep(0.5)
        tmux("send-keys", "-t", "main", "stty size", "Enter")
        wait_for_line(lambda line: line == "40 120")
        tmux("send-keys", "-t", "main", "exit", "Enter")
        deadline = time.monotonic() + 15
        while not done.exists() or not done.read_text().strip():
            assert time.monotonic() < deadline, "sandgate shell did not exit"
            time.sleep(0.1)
        assert done.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "-L", socket_name, "kill-server"], capture_output=True)


def test_url_flag_overrides_env(env: dict[str, str], deployment: Deployment) -> None:  # noqa: F811
    elsewhere = {**env, "SANDGATE_URL": f"http://127.0.0.1:{free_port()}"}
    result = cli(elsewhere, "sandbox", "ls", "-q", "--url", deployment.url)
    assert result.returncode == 0, result.stderr
