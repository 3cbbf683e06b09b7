"""A short shell command runs in the shell the agent started after the last one (agent/warm.py):
what the command sees is what a spawned ``sh -c``/``bash -c`` gives it, and whatever would
make the waiting shell differ from a fresh one (another directory or environment, the
directory replaced, the shell killed, a long command) spawns instead.

The agent runs as a plain subprocess on the host (test_agent.py's client), so its waiting
shell is found among its children in the host's /proc. Each case runs once spawned (an
environment no waiting shell has) and once in a waiting shell, and the answers are compared;
the answer's ``warm`` says which ran where.
"""

from __future__ import annotations

import asyncio
import os
import queue
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from sandgate.agent import frames
from sandgate.agent.pressure import read_stalled_us
from sandgate.agent.warm import QUICK_SECONDS
from sandgate.worker.runtime.base import SandboxSpec
from sandgate.worker.runtime.bwrap import BwrapRuntime
from sandgate.worker.service import WorkerService
from sandgate.worker.state import WorkerLocalState
from tests.integration.worker.test_agent import Agent
from tests.integration.worker.test_agent_procs import Client
from tests.integration.worker.test_agent_procs import agent as agent  # the fixture

LOOP_MARK = b"__sandgate_"  # in the waiting shell's command line (warm.py's reading loop)


def shells_on_the_host(keep: Callable[[int], bool]) -> list[int]:
    """The waiting shells on the host (their command line carries the loop's mark) that
    ``keep(pid)`` takes; one gone meanwhile is left out."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if LOOP_MARK in Path(f"/proc/{entry}/cmdline").read_bytes() and keep(int(entry)):
                found.append(int(entry))
        except OSError:
            continue
    return found


def waiting_shells(agent: Agent) -> list[int]:
    """The agent's children that are waiting shells."""

    def child(pid: int) -> bool:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return int(stat.rpartition(b")")[2].split()[1]) == agent.proc.pid

    return shells_on_the_host(child)


def one_waiting(agent: Agent, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shells = waiting_shells(agent)
        if shells:
            assert len(shells) == 1, shells
            return shells[0]
        time.sleep(0.01)
    raise AssertionError("no shell was started to wait for the next command")


def run(agent: Agent, code: str, language: str, **fields: Any) -> dict[str, Any]:
    result = agent.exec(code, language=language, **fields)
    return {key: result[key] for key in ("stdout", "stderr", "exit_code", "timed_out", "warm")}


def cold_and_warm(
    agent: Agent, code: str, language: str, **fields: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The command spawned (an environment of its own), then in a shell waiting for it."""
    env = fields.pop("env", {})
    cold = run(agent, code, language, env={**env, "RUN": "cold"}, **fields)
    assert cold["warm"] is False
    # the first spawns and ends the shell started for the cold run (no shell is started
    # after it: warm.py), the second spawns too and a shell is started after it
    for _ in range(2):
        run(agent, "true", language, env={**env, "RUN": "warm"}, **fields)
    one_waiting(agent)
    warm = run(agent, code, language, env={**env, "RUN": "warm"}, **fields)
    assert warm["warm"] is True
    run(agent, "true", language, env={**env, "RUN": "other"}, **fields)  # no shell waits
    cold["warm"] = warm["warm"] = None
    return cold, warm


CASES = [
    "echo ok",
    'echo "$0" $# "$*"',
    "echo a\necho b",
    "echo a\necho b\n",
    "printf '%s\\n' 'back\\slash' \"dq\" '$notexpanded'",
    "exit 3",
    "kill -9 $$",
    "echo out; echo err >&2; exit 2",
    "cat; echo done",  # stdin is /dev/null: cat ends at once
    "readlink /proc/self/fd/0; ls /proc/self/fd | tr '\\n' ' '",  # nothing open but 0-2
    "set | grep __sandgate_; echo $_",  # no variable of the loop (bash: the command's own)
    'pwd; echo "$PWD"; umask; ulimit -n',
    "trap 'echo bye' EXIT; echo x",
    "set -e; false; echo not-reached",
    'echo "$(echo sub) $((6 * 7))"',
    'read -r _ _ _ _ pgrp sid _ < /proc/$$/stat; [ "$pgrp $sid" = "$$ $$" ] && echo leader',
    "cat /proc/$$/oom_score_adj",
    'echo "$SANDBOX_VAR $HOME $LANG $PATH"',
]


@pytest.mark.parametrize("language", ["sh", "bash"])
@pytest.mark.parametrize("code", CASES)
def test_a_command_sees_in_a_waiting_shell_what_a_spawned_one_sees(
    agent: Agent, language: str, code: str
) -> None:
    cold, warm = cold_and_warm(agent, code, language)
    assert warm == cold


def test_bash_line_numbers_are_the_commands_own(agent: Agent) -> None:
    cold, warm = cold_and_warm(agent, "echo $LINENO\nnosuchcommand\necho $LINENO", "bash")
    assert warm == cold
    assert cold["stdout"] == "1\n3\n"
    assert "line 2: nosuchcommand: command not found" in cold["stderr"]


def test_dash_names_eval_in_its_own_error_messages(agent: Agent) -> None:
    """The one difference in output (warm.py, docs/api.md): dash's own messages name the
    eval the waiting shell runs the command in."""
    cold, warm = cold_and_warm(agent, "echo a\nnosuchcommand", "sh")
    assert cold["stderr"].endswith(": 2: nosuchcommand: not found\n")
    assert warm == {**cold, "stderr": cold["stderr"].replace(": 2: ", ": 2: eval: ")}


def test_the_next_command_with_the_same_directory_and_environment_finds_a_shell_waiting(
    agent: Agent,
) -> None:
    assert agent.exec("echo one")["warm"] is False  # the first spawns
    shell = one_waiting(agent)
    result = agent.exec("echo $$")
    assert (result["warm"], result["stdout"]) == (True, f"{shell}\n")
    assert one_waiting(agent) != shell  # and the next is started after its answer


def test_another_directory_or_environment_spawns_and_no_shell_is_started_after(
    agent: Agent,
) -> None:
    (agent.workspace / "sub").mkdir()
    agent.exec("true")
    shell = one_waiting(agent)
    moved = agent.exec("pwd", cwd="sub")
    assert (moved["warm"], moved["stdout"]) == (False, f"{agent.workspace}/sub\n")
    assert not Path(f"/proc/{shell}").exists()  # the shell of no use was ended and reaped
    time.sleep(0.3)
    assert waiting_shells(agent) == []  # a caller that keeps changing pays no spawn more
    assert agent.exec("echo $FOO", env={"FOO": "x"})["warm"] is False
    one_waiting(agent)  # one spawn with nothing waiting: the next is started again
    assert agent.exec("echo $FOO", env={"FOO": "y"})["stdout"] == "y\n"


def test_a_directory_replaced_since_the_shell_started_is_not_run_in(agent: Agent) -> None:
    sub = agent.workspace / "sub"
    sub.mkdir()
    agent.exec("true", cwd="sub")
    one_waiting(agent)
    os.rename(sub, agent.workspace / "old")
    sub.mkdir()
    (sub / "new-file").write_text("")
    result = agent.exec("ls", cwd="sub")
    assert (result["warm"], result["stdout"]) == (False, "new-file\n")


def test_a_waiting_shell_killed_meanwhile_is_not_used(agent: Agent) -> None:
    agent.exec("true")
    os.kill(one_waiting(agent), signal.SIGKILL)
    time.sleep(0.05)
    result = agent.exec("echo ok; exit 4")
    assert (result["warm"], result["stdout"], result["exit_code"]) == (False, "ok\n", 4)


def test_a_command_in_a_waiting_shell_times_out_like_any_other(agent: Agent) -> None:
    agent.exec("true")
    one_waiting(agent)
    result = agent.exec("echo started; sleep 30", timeout=0.5)
    assert result["warm"] is True
    assert (result["exit_code"], result["timed_out"], result["stdout"]) == (124, True, "started\n")


def test_long_commands_and_startup_files_spawn(agent: Agent, tmp_path: Path) -> None:
    agent.exec("true")
    one_waiting(agent)
    long = "echo " + "x" * 2000
    result = agent.exec(long)
    assert (result["warm"], result["stdout"]) == (False, "x" * 2000 + "\n")
    one_waiting(agent)
    startup = tmp_path / "startup.sh"
    startup.write_text("STARTED=yes\n")
    result = agent.exec("echo $STARTED", env={"BASH_ENV": str(startup)})
    assert (result["warm"], result["stdout"]) == (False, "yes\n")


def test_a_quiet_sandbox_holds_no_waiting_shell(agent: Agent) -> None:
    """Once no request came for the agent's idle time (10 s) the shell ends: an idle sandbox
    keeps no task more for each other sandbox's start to walk; the next command spawns."""
    agent.exec("true")
    shell = one_waiting(agent)
    deadline = time.monotonic() + 20
    while Path(f"/proc/{shell}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{shell}").exists()
    assert time.monotonic() - (deadline - 20) > 9  # not before the idle time
    result = agent.exec("echo again")
    assert (result["warm"], result["stdout"]) == (False, "again\n")
    one_waiting(agent)  # and the shell after it is started again


def test_the_agents_exit_ends_the_waiting_shell(agent: Agent) -> None:
    agent.exec("true")
    shell = one_waiting(agent)
    assert agent.close() == 0
    deadline = time.monotonic() + 5
    while Path(f"/proc/{shell}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not Path(f"/proc/{shell}").exists()


# ------------------------------------------------------------------ background processes

LOGIN_BASH = ["/bin/bash", "-l", "-c"]  # what E2B's commands.run starts


def started_and_output(agent: Client, argv: list[str], **fields: Any) -> tuple[int, bytes, int]:
    """Start a process, read it to its end: (pid, stdout and stderr, exit code). Like E2B's
    `commands.run`, the start's answer waits for the first output and the exit."""
    header = agent.ok("proc_start", argv=argv, **{"wait": 2, "linger": 0.2, **fields})
    data, _, last = agent.follow(header["pid"])
    return header["pid"], data, last["exit_code"]


def test_a_shell_process_runs_in_the_waiting_shell_and_reads_its_input_after_the_command(
    agent: Client,
) -> None:
    code = 'echo "$0 $#"; shopt -q login_shell && echo login; read -r line; echo "got $line"'
    started_and_output(agent, [*LOGIN_BASH, "true"])  # spawned, then a shell waits
    shell = one_waiting(agent)
    header = agent.ok("proc_start", argv=[*LOGIN_BASH, code])
    assert header["pid"] == shell  # the waiting shell took it
    agent.call("proc_stdin", b"from stdin\n", pid=shell, close=True)
    data, _, last = agent.follow(shell)
    assert (data, last["exit_code"]) == (b"/bin/bash 0\nlogin\ngot from stdin\n", 0)


def test_a_shell_process_without_stdin_reads_its_end_at_once(agent: Client) -> None:
    argv = [*LOGIN_BASH, "cat; readlink /proc/self/fd/0 | cut -c1-5; exit 3"]
    cold = started_and_output(agent, argv, stdin=False)
    shell = one_waiting(agent)
    warm = started_and_output(agent, argv, stdin=False)
    assert warm[0] == shell
    assert (cold[1:], warm[1:]) == ((b"pipe:\n", 3), (b"pipe:\n", 3))


def test_a_profile_changed_since_the_login_shell_started_spawns(agent: Client) -> None:
    """E2B's `bash -l` reads ~/.profile at its start: one written after the waiting shell
    started (an upload, say) is not missed."""
    argv = [*LOGIN_BASH, 'echo "[$FROM_PROFILE]"']
    assert started_and_output(agent, argv)[1] == b"[]\n"
    shell = one_waiting(agent)
    (agent.workspace / ".profile").write_text("export FROM_PROFILE=yes\n")
    pid, data, _ = started_and_output(agent, argv)
    assert (pid != shell, data) == (True, b"[yes]\n")
    assert not Path(f"/proc/{shell}").exists()
    shell = one_waiting(agent)  # started with the new profile, and used
    assert started_and_output(agent, argv) == (shell, b"[yes]\n", 0)


def test_exec_and_processes_share_the_waiting_shell_only_when_it_fits(agent: Client) -> None:
    agent.exec("true", language="bash")
    exec_shell = one_waiting(agent)
    pid, data, _ = started_and_output(agent, ["bash", "-c", "echo $PYTHONUNBUFFERED"])
    assert (pid != exec_shell, data) == (True, b"1\n")  # a process's environment differs


def test_a_tool_a_running_process_installs_is_on_the_next_login_shells_path(
    agent: Client,
) -> None:
    """A login shell started while the command before it still ran would read its profile
    before that command changed what the profile reads (rustup's `. "$HOME/.cargo/env"`,
    a file no snapshot looks at): no shell is started ahead of a process still running at
    its answer (E2B's wait, 20 ms, for an install that takes longer)."""
    (agent.workspace / ".profile").write_text(
        'if [ -f "$HOME/.cargo/env" ]; then . "$HOME/.cargo/env"; fi\n'
    )
    started_and_output(agent, [*LOGIN_BASH, "true"])
    one_waiting(agent)
    install = (
        "sleep 0.3; mkdir -p ~/.cargo/bin; printf '#!/bin/sh\\necho tool-ran\\n' > "
        "~/.cargo/bin/tool; chmod +x ~/.cargo/bin/tool; "
        "echo 'export PATH=\"$HOME/.cargo/bin:$PATH\"' > ~/.cargo/env"
    )
    _, data, code = started_and_output(agent, [*LOGIN_BASH, install], wait=0.02, linger=0.005)
    assert (data, code) == (b"", 0)
    assert waiting_shells(agent) == []  # none was started while the install ran
    assert started_and_output(agent, [*LOGIN_BASH, "tool"])[1:] == (b"tool-ran\n", 0)


def test_a_directory_debians_profile_puts_on_path_is_looked_at(agent: Client) -> None:
    (agent.workspace / ".profile").write_text(  # what Debian's ~/.profile does
        'if [ -d "$HOME/bin" ]; then PATH="$HOME/bin:$PATH"; fi\n'
        'if [ -d "$HOME/.local/bin" ]; then PATH="$HOME/.local/bin:$PATH"; fi\n'
    )
    argv = [*LOGIN_BASH, 'case ":$PATH:" in *:"$HOME"/bin:*) echo on;; *) echo off;; esac']
    assert started_and_output(agent, argv)[1] == b"off\n"
    shell = one_waiting(agent)
    (agent.workspace / "bin").mkdir()  # through the files API, say
    pid, data, _ = started_and_output(agent, argv)
    assert (pid != shell, data) == (True, b"on\n")


def test_sh_that_is_bash_gets_the_bash_loop(agent: Client, tmp_path: Path) -> None:
    """Where `sh` is bash (Fedora, Arch), what the command sees is still bash's `sh -c`."""
    links = tmp_path / "bin"
    links.mkdir()
    (links / "sh").symlink_to(shutil.which("bash") or "/bin/bash")
    argv = [str(links / "sh"), "-c", 'echo "$LINENO $_ $SECONDS"; echo "$BASH_EXECUTION_STRING"']
    cold = started_and_output(agent, argv)
    shell = one_waiting(agent)
    time.sleep(1.2)  # $SECONDS counts from the command, not from the shell's start
    warm = started_and_output(agent, argv)
    assert warm[0] == shell
    assert cold[1:] == warm[1:]
    assert cold[1].splitlines()[1] == argv[-1].encode()


def test_an_environment_that_changes_how_the_shell_runs_its_loop_spawns(agent: Client) -> None:
    for env in ({"SHELLOPTS": "xtrace"}, {"TMOUT": "1"}, {"BASH_FUNC_read%%": "() { :; }"}):
        agent.exec("true", env=env)
        agent.exec("true", env=env)
        result = agent.exec("echo hi", env=env)
        assert (result["warm"], result["stdout"]) == (False, "hi\n"), env
    assert waiting_shells(agent) == []


def test_a_request_with_an_unhashable_op_is_refused_and_the_agent_goes_on(agent: Client) -> None:
    answer: queue.Queue[tuple[dict[str, Any], bytes]] = queue.Queue(maxsize=1)
    with agent._send_lock:  # as Client.call, with an op no call would send
        agent._next_id += 1
        agent._pending[agent._next_id] = answer
        assert agent.proc.stdin is not None
        agent.proc.stdin.write(frames.encode({"id": agent._next_id, "op": [1]}))
        agent.proc.stdin.flush()
    header, _ = answer.get(timeout=30)
    assert header["ok"] is False and header["error"]["code"] == "invalid_request"
    assert agent.exec("echo still here")["stdout"] == "still here\n"


Run = Callable[..., Awaitable[dict[str, Any]]]


def in_a_sandbox(
    runtime: BwrapRuntime, spec: SandboxSpec, body: Callable[[Run], Awaitable[None]]
) -> None:
    """``body(run)`` with ``spec`` running in a real bwrap sandbox, destroyed after:
    ``await run(code, **fields)`` is an ``exec`` (bash unless a field says otherwise) through
    the worker's service, answered with the agent's header and the command's stdout."""
    service = WorkerService(runtime, capacity=1, state=WorkerLocalState())

    async def run(code: str, **fields: Any) -> dict[str, Any]:
        call = {"op": "exec", "language": "bash", "code": code, "timeout": 30, "env": {}}
        header, payload = await service.handle(
            {"op": "agent", "sandbox": spec.name, "call": {**call, **fields}, "timeout_s": 60},
            b"",
        )
        return {**header, "stdout": payload[: header["stdout_bytes"]].decode()}

    async def whole() -> None:
        await service.provision(spec)
        try:
            await body(run)
        finally:
            await service.destroy(spec.name)

    async def main() -> None:
        await runtime.prepare()
        await service.run(whole)

    asyncio.run(main())


@pytest.mark.bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
def test_in_a_sandbox_the_next_command_runs_in_the_waiting_shell(runtime: BwrapRuntime) -> None:
    """In a real bwrap sandbox, where the agent is pid 1 and /proc is the sandbox's own: the
    waiting shell is found, its directory checked, and its command's exit code exact."""
    answers: list[dict[str, Any]] = []

    async def body(run: Run) -> None:
        for i in range(20):
            answers.append(await run(f"echo $PPID; exit {i + 1}"))
            await asyncio.sleep(0.05)

    in_a_sandbox(runtime, SandboxSpec(name="warm-1"), body)
    assert [a["exit_code"] for a in answers] == list(range(1, 21))
    assert {a["stdout"] for a in answers} == {"1\n"}  # the agent, pid 1, started each shell
    assert answers[0]["warm"] is False
    assert all(a["warm"] for a in answers[1:]), [a["warm"] for a in answers]


# Forks until the sandbox's pids limit refuses one, then holds them all: started after a
# pause, so that the waiting shell the agent starts after its command's answer gets a pid.
FILLER = (
    "import os, time\n"
    "time.sleep(1.5)\n"
    "while True:\n"
    "    try:\n"
    "        pid = os.fork()\n"
    "    except BlockingIOError:\n"
    "        break\n"
    "    if pid == 0:\n"
    "        time.sleep(600)\n"
    "        os._exit(0)\n"
    "time.sleep(600)\n"
)


def host_waiting_shells(group: str) -> list[int]:
    """Waiting shells whose pids cgroup ends with ``group`` (``<worker>/<sandbox>``): other
    tests' sandboxes have theirs."""
    return shells_on_the_host(lambda pid: str(pids_group(pid)).endswith(f"/{group}"))


def pids_group(pid: int) -> Path:
    """The v1 pids cgroup `pid` is counted in, on the host."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            return Path("/sys/fs/cgroup/pids") / path.lstrip("/")
    raise AssertionError(f"process {pid} is in no pids cgroup")


@pytest.mark.bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
@pytest.mark.skipif(not Path("/sys/fs/cgroup/pids").is_dir(), reason="needs the v1 pids cgroup")
def test_at_the_pids_limit_the_waiting_shell_gives_its_pid_to_a_spawn(
    runtime: BwrapRuntime,
) -> None:
    """With every pid of the sandbox held and one of them the waiting shell's, a command that
    does not go to that shell (python) must still be spawned: the shell is ended for it
    (warm.make_room), where the spawn would have been refused with 429. (A shell command
    for another directory or environment ends the shell anyway: warm.take.)"""
    spec = SandboxSpec(name="warm-limit", pids=40)
    group = f"{runtime.worker_name}/{spec.name}"
    seen: dict[str, Any] = {}

    async def full(group: Path) -> bool:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            current = int((group / "pids.current").read_text())
            if current >= int((group / "pids.max").read_text()):
                await asyncio.sleep(0.5)  # the filler has stopped at the refusal
                return True
            await asyncio.sleep(0.1)
        return False

    async def body(run: Run) -> None:
        assert (await run("true"))["exit_code"] == 0
        started = await run(f"python3 -c '{FILLER}' >/dev/null 2>&1 &")
        assert started["exit_code"] == 0, started
        shells: list[int] = []
        deadline = time.monotonic() + 10
        while not shells and time.monotonic() < deadline:
            shells = host_waiting_shells(group)
            await asyncio.sleep(0.02)
        assert len(shells) == 1, shells
        seen["filled"] = await full(pids_group(shells[0]))
        seen["shell_before"] = host_waiting_shells(group)
        code = "import os; print('made room', os.getcwd())"
        seen["answer"] = await run(code, language="python", cwd="/tmp")

    in_a_sandbox(runtime, spec, body)
    assert seen["filled"], "the filler did not take every pid"
    assert len(seen["shell_before"]) == 1
    answer = seen["answer"]
    assert answer.get("exit_code") == 0, answer
    assert answer["stdout"] == "made room /tmp\n"


PSI = "some avg10=0.00 avg60=0.00 avg300=0.00 total={}\nfull total=0\n"  # the kernel's, cut


def test_commands_back_to_back_get_no_shell_ahead_while_the_cpus_are_saturated(
    tmp_path: Path,
) -> None:
    """With every CPU taken, a shell started ahead of commands that come back to back is only
    more work (throughput with 4-8 clients was 7-10 % lower, agent/pressure.py): while the
    host's CPU pressure says so, none is started for them and they spawn. A command after a
    pause still gets one, and once the pressure is gone commands back to back get them again.
    The pressure is a file in PSI's format the test writes (the agent's --cpu-pressure)."""
    psi = tmp_path / "cpu-pressure"
    stalled = 0

    def write_pressure(more: int) -> None:
        nonlocal stalled
        stalled += more
        (tmp_path / "psi.new").write_text(PSI.format(stalled))
        os.replace(tmp_path / "psi.new", psi)  # never a file half written

    def saturated() -> None:
        write_pressure(10**9)  # far more stall than any time since: every CPU taken

    write_pressure(0)
    agent = Agent(tmp_path, cpu_pressure=str(psi))

    def until(warm: bool, times: int = 1, before: Callable[[], None] = lambda: None) -> None:
        """Commands back to back until ``times`` in a row answer ``warm`` (a command of the
        test that comes late, after QUICK_SECONDS, counts as one after a pause)."""
        deadline = time.monotonic() + 20
        in_a_row = 0
        while in_a_row < times:
            before()
            in_a_row = in_a_row + 1 if run(agent, "true", "sh")["warm"] is warm else 0
            assert time.monotonic() < deadline, f"not {times} commands in a row warm={warm}"

    try:
        assert run(agent, "true", "sh")["warm"] is False
        one_waiting(agent)
        # saturated: once a measure (at least pressure.WINDOW_SECONDS long) has seen it, no
        # shell is started for the commands back to back
        until(warm=False, times=4, before=saturated)
        # a command after a pause: its shell is started ahead of the next one all the same
        saturated()
        time.sleep(QUICK_SECONDS + 0.1)
        assert run(agent, "true", "sh")["warm"] is False
        one_waiting(agent)
        assert run(agent, "true", "sh")["warm"] is True
        # no stall from here on: after a measure sees that, commands back to back get shells
        until(warm=True, times=4)
    finally:
        agent.close()


@pytest.mark.bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")
@pytest.mark.skipif(not Path("/proc/pressure/cpu").exists(), reason="the host has no PSI")
def test_in_a_sandbox_the_hosts_cpu_pressure_is_there_to_read(
    runtime: BwrapRuntime, tmp_path: Path
) -> None:
    """The agent's default --cpu-pressure, /proc/pressure/cpu, is the host's inside a
    sandbox too (its own /proc), and in the format pressure.read_stalled_us reads."""
    seen: dict[str, Any] = {}

    async def body(run: Run) -> None:
        seen.update(await run("cat /proc/pressure/cpu", language="sh"))

    in_a_sandbox(runtime, SandboxSpec(name="warm-psi"), body)
    assert seen["exit_code"] == 0, seen
    copy = tmp_path / "cpu"
    copy.write_text(seen["stdout"])
    assert read_stalled_us(str(copy)) is not None, seen["stdout"]
