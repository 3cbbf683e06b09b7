"""One code context: a real IPython kernel, driven over jupyter_client's IPC transport, or
(``--language bash``) a persistent bash shell (`ShellBridge`).

Deployed next to the agent (`sandgate.agent.EXTRA_FILES`) but not imported by it: the control
plane starts it as an ordinary background process of the sandbox (`proc_start`, tagged with
the context's id), with the sandbox's own Python and its packages (Debian's
python3-ipykernel and python3-jupyter-client on the host-root template):

    /usr/bin/python3 -I /opt/sandgate/kernel_bridge.py --context ID --cwd DIR

Everything is through its stdin and stdout, one JSON object a line, so it lives, is followed
and dies like any process (and with its sandbox). In:

    {"op": "run", "run": "<id>", "code": "...", "env": {...}, "timeout": seconds | null}
    {"op": "interrupt", "run": "<id>"}  that run's code gets KeyboardInterrupt (a run still
                             waiting its turn is dropped); without a run, whatever runs
    {"op": "restart"}        a fresh kernel: every variable is gone

Out, each with the `run` it belongs to: `ready` (once, when the kernel answers),
`number_of_executions`, `stdout`, `stderr`, `result` (a MIME bundle: text, html, markdown, svg,
png, jpeg, pdf, latex, json, javascript; `is_main_result` for the value of the last
expression), `error` (name, value, traceback) and `end_of_execution`; `restarted` after a
restart. An `error` of no run names the `op` it ended (`start`: the first kernel did not
start; `restart`), or none (a line in that was not a request). A kernel that dies ends its
run with an `error` named `KernelDied`, and the context can be restarted. Code still running
`KILL_GRACE` seconds after its timeout's interrupt (it ignores SIGINT, or sits in one long C
call) has its kernel restarted: the run ends with an `error` named `KernelRestarted`, and the
runs after it get a fresh kernel, not a wait.
The kernel's sockets are files in /tmp (no network), its state dirs too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import secrets
import shlex
import signal
import sys
import tempfile
import threading
import time
from types import MappingProxyType
from typing import Any

MIME_FIELDS = MappingProxyType(
    {
        "text/plain": "text",
        "text/html": "html",
        "text/markdown": "markdown",
        "image/svg+xml": "svg",
        "image/png": "png",
        "image/jpeg": "jpeg",
        "application/pdf": "pdf",
        "text/latex": "latex",
        "application/json": "json",
        "application/javascript": "javascript",
    }
)
READY_TIMEOUT = 60.0
# IPython's input history is an SQLite file written at every execution: a third of the time
# of a short one; the execution count, `_` and `Out` stay
KERNEL_ARGUMENTS = ("--HistoryManager.enabled=False",)
POLL_SECONDS = 0.5  # how often a run waiting for kernel output checks the kernel is alive
# how long code may go on after its timeout's interrupt before its kernel (or shell) is
# restarted under it: a time limit holds for code that ignores KeyboardInterrupt too
KILL_GRACE = 5.0
# events of one burst of kernel messages go out in one write (so the control plane reads them
# in one request): a line waits at most this long for the next message
BURST_SECONDS = 0.003


class Bridge:
    def __init__(self, context: str, cwd: str) -> None:
        from jupyter_client.manager import KernelManager

        self.context = context
        self.cwd = cwd
        self.out_lock = threading.Lock()
        self.pending: list[str] = []  # lines of the current burst, not written yet
        self.runs: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.turns = Turns()
        self.state_dir = tempfile.mkdtemp(prefix=f"sandgate-kernel-{context}-", dir="/tmp")
        self.manager = KernelManager(
            kernel_name="python3",
            transport="ipc",
            ip=os.path.join(self.state_dir, "kernel"),
            connection_file=os.path.join(self.state_dir, "kernel.json"),
        )
        self.client: Any = None

    # -- output -------------------------------------------------------------------------------
    def emit(self, kind: str, run: str | None = None, **fields: Any) -> None:
        self.hold(kind, run, **fields)
        self.flush()

    def hold(self, kind: str, run: str | None = None, **fields: Any) -> None:
        line = json.dumps({"type": kind, "run": run, **fields}, separators=(",", ":"))
        with self.out_lock:
            self.pending.append(line + "\n")

    def flush(self) -> None:
        with self.out_lock:
            if self.pending:
                sys.stdout.write("".join(self.pending))
                sys.stdout.flush()
                self.pending.clear()

    # -- the kernel ---------------------------------------------------------------------------
    def kernel_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "JPY_PARENT_PID"}
        env.setdefault("IPYTHONDIR", os.path.join(self.state_dir, "ipython"))
        env.setdefault("MPLCONFIGDIR", os.path.join(self.state_dir, "matplotlib"))
        env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # ipykernel's debugger notice
        return env

    def start(self) -> None:
        self.manager.start_kernel(
            cwd=self.cwd, env=self.kernel_env(), extra_arguments=list(KERNEL_ARGUMENTS)
        )
        self.connect()

    def connect(self) -> None:
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=READY_TIMEOUT)

    def restart(self) -> None:
        if self.client is not None:
            self.client.stop_channels()
        self.manager.restart_kernel(now=True, env=self.kernel_env())
        self.connect()

    # -- runs ---------------------------------------------------------------------------------
    def run(self, request: dict[str, Any]) -> None:
        run = str(request.get("run"))
        env = request.get("env") or {}
        timeout = request.get("timeout")
        fresh = False
        try:
            if env:
                self.silent(f"import os as _sg_os; _sg_os.environ.update({env!r})")
            fresh = self.execute(run, str(request.get("code", "")), timeout)
        finally:
            if env and not fresh:  # a restarted kernel never had them
                names = sorted(env)
                self.silent(f"[_sg_os.environ.pop(_sg_k, None) for _sg_k in {names!r}]")
            self.emit("end_of_execution", run)

    def death(self) -> str:
        """How the kernel ended, as far as its exit tells: a SIGKILL that no timeout here sent
        is most often the sandbox's memory limit (the kernel's OOM killer)."""
        process = getattr(self.manager.provisioner, "process", None)
        if getattr(process, "returncode", None) == -signal.SIGKILL:
            return (
                "the kernel was killed (SIGKILL), most often by the sandbox's memory limit: "
                "use less memory, or create the sandbox with a higher resources.memory_mb"
            )
        return "the kernel died"

    def silent(self, code: str) -> None:
        if not self.manager.is_alive():
            return
        msg_id = self.client.execute(code, silent=True, store_history=False, stop_on_error=False)
        self.drain(msg_id, None, timeout=30)

    def execute(self, run: str, code: str, timeout: float | None) -> bool:
        """Run `code`; True when its kernel had to be restarted under it."""
        if not self.manager.is_alive():
            self.emit(
                "error",
                run,
                name="KernelDied",
                value="the kernel is not running: restart the context",
                traceback="",
            )
            return False
        # runs go to the kernel one at a time already; with stop_on_error, ipykernel would
        # abort a run that reaches it just after an error or an interrupt (no output, no
        # count: it never ran)
        msg_id = self.client.execute(
            code, store_history=True, allow_stdin=False, stop_on_error=False
        )
        return self.drain(msg_id, run, timeout)

    def drain(self, msg_id: str, run: str | None, timeout: float | None) -> bool:
        """Relay the kernel's messages for one execution until it is idle again (True: it
        never was, and the kernel was restarted `KILL_GRACE` seconds after the interrupt)."""
        deadline = None if not timeout else time.monotonic() + float(timeout)
        interrupted = False
        while True:
            try:
                wait = BURST_SECONDS if self.pending else POLL_SECONDS
                message = self.client.get_iopub_msg(timeout=wait)
            except queue.Empty:
                if self.pending:
                    self.flush()
                    continue
                if not self.manager.is_alive():
                    if run is not None:
                        self.emit(
                            "error",
                            run,
                            name="KernelDied",
                            value=f"{self.death()}: restart the context",
                            traceback="",
                        )
                    return False
                if (
                    interrupted
                    and deadline is not None
                    and time.monotonic() > deadline + KILL_GRACE
                ):
                    self.restart()
                    if run is not None:
                        self.emit(
                            "error",
                            run,
                            name="KernelRestarted",
                            value=f"the code did not stop within {KILL_GRACE:g} s of its "
                            "interrupt: its kernel was restarted, and every variable is gone",
                            traceback="",
                        )
                    return True
                if deadline is not None and time.monotonic() > deadline and not interrupted:
                    interrupted = True
                    self.manager.interrupt_kernel()
                    if run is not None:
                        self.emit(
                            "error",
                            run,
                            name="TimeoutError",
                            value=f"the code ran "
                            f"longer than its timeout of {timeout} s and was interrupted",
                            traceback="",
                        )
                continue
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = message["msg_type"]
            content = message["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                return False
            if run is None:
                continue
            if kind == "execute_input":
                self.hold("number_of_executions", run, execution_count=content["execution_count"])
            elif kind == "stream":
                stream = "stderr" if content.get("name") == "stderr" else "stdout"
                self.hold(stream, run, text=content.get("text", ""), timestamp=_now())
            elif kind in ("execute_result", "display_data"):
                self.hold("result", run, **_bundle(content.get("data", {}), kind))
            elif kind == "error" and not interrupted:
                self.hold(
                    "error",
                    run,
                    name=content.get("ename", ""),
                    value=content.get("evalue", ""),
                    traceback="\n".join(content.get("traceback", [])),
                )

    # -- the loops ----------------------------------------------------------------------------
    def serve(self) -> None:
        worker = threading.Thread(target=self.work, name="runs", daemon=True)
        worker.start()
        for line in sys.stdin:
            try:
                request = json.loads(line)
            except ValueError:
                self.emit("error", None, name="BadRequest", value="not JSON", traceback="")
                continue
            op = request.get("op")
            if op == "run":
                self.turns.queue(str(request.get("run")))
                self.runs.put(request)
            elif op == "interrupt":
                if self.turns.interrupt(request.get("run")):
                    self.interrupt()
            elif op == "restart":
                self.runs.put({"op": "restart"})
            elif op == "env":  # a pooled sandbox handed out: its environment, for good
                self.runs.put({"op": "env", "env": request.get("env") or {}})
        self.runs.put(None)  # stdin closed: the context is being removed
        worker.join(timeout=5)

    def work(self) -> None:
        while (request := self.runs.get()) is not None:
            try:
                if request.get("op") == "restart":
                    self.restart()
                    self.emit("restarted")
                elif request.get("op") == "env":
                    env = {str(k): str(v) for k, v in dict(request["env"]).items()}
                    os.environ.update(env)  # a restarted kernel gets it too
                    self.silent(f"import os as _sg_os; _sg_os.environ.update({env!r})")
                elif self.turns.begin(str(request.get("run"))):
                    try:
                        self.run(request)
                    finally:
                        self.turns.end()
                else:  # its client left before its turn came
                    self.emit("end_of_execution", request.get("run"))
            except Exception as exc:  # never leave a run without its end
                # a run's error is its run's; any other names its op (a failed restart)
                about = {} if request.get("op") == "run" else {"op": request.get("op")}
                self.emit(
                    "error",
                    request.get("run"),
                    name=type(exc).__name__,
                    value=str(exc),
                    traceback="",
                    **about,
                )
                if request.get("op") == "run":
                    self.emit("end_of_execution", request.get("run"))

    def interrupt(self) -> None:
        self.manager.interrupt_kernel()

    def close(self) -> None:
        if self.client is not None:
            self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


class ShellBridge(Bridge):
    """A `bash` context: one persistent bash (variables, functions, the working directory
    and exports survive from run to run). A run is the code `eval`ed in it with stdin from
    /dev/null, then a marker with its exit status written to both streams, so the bridge
    knows where each run's output ends; a non-zero status is an `error` named
    `CommandExitError`. An interrupt (a timeout, a client gone) is SIGINT to the commands;
    the shell itself traps it and lives on. `exit` ends the shell: the context says so and
    can be restarted."""

    def __init__(self, context: str, cwd: str) -> None:  # no kernel manager: no jupyter
        self.context = context
        self.cwd = cwd
        self.out_lock = threading.Lock()
        self.pending = []
        self.runs = queue.Queue()
        self.turns = Turns()
        self.shell: Any = None
        self.streams: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.count = 0

    def start(self) -> None:
        import subprocess

        env = {k: v for k, v in os.environ.items() if k != "JPY_PARENT_PID"}
        self.shell = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self.cwd,
            env=env,
            start_new_session=True,  # its own process group: an interrupt reaches its commands
        )
        # a queue per shell: the readers of a killed shell end in theirs, not in the next's
        self.streams = queue.Queue()
        for name, pipe in (("stdout", self.shell.stdout), ("stderr", self.shell.stderr)):
            threading.Thread(
                target=self._pump, args=(name, pipe, self.streams), daemon=True
            ).start()
        self._send("trap 'true' INT\n")  # the shell survives an interrupt; its commands do not

    @staticmethod
    def _pump(name: str, pipe: Any, into: queue.Queue[tuple[str, bytes]]) -> None:
        while chunk := os.read(pipe.fileno(), 65536):
            into.put((name, chunk))
        into.put((name, b""))

    def _send(self, text: str) -> bool:
        try:
            self.shell.stdin.write(text.encode())
            self.shell.stdin.flush()
            return True
        except (BrokenPipeError, ValueError, OSError):
            return False

    def alive(self) -> bool:
        return self.shell is not None and self.shell.poll() is None

    def restart(self) -> None:
        self.close()
        self.start()

    def interrupt(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.shell.pid, signal.SIGINT)

    def close(self) -> None:
        if self.shell is not None and self.shell.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.shell.pid, signal.SIGKILL)
            self.shell.wait()

    def silent(self, code: str) -> None:
        pass  # env is given to each run's eval (below)

    def run(self, request: dict[str, Any]) -> None:
        run = str(request.get("run"))
        env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
        try:
            self.execute_shell(run, str(request.get("code", "")), env, request.get("timeout"))
        finally:
            self.emit("end_of_execution", run)

    def execute_shell(
        self, run: str, code: str, env: dict[str, str], timeout: float | None
    ) -> None:
        if not self.alive():
            self.emit(
                "error",
                run,
                name="KernelDied",
                value="the shell is not running: restart the context",
                traceback="",
            )
            return
        self.count += 1
        self.emit("number_of_executions", run, execution_count=self.count)
        marker = f"__sandgate_end_{secrets.token_hex(8)}__"
        save = restore = ""
        if env:  # the variables hold for this run only
            save = "__sg_saved=$(export -p); " + "".join(
                f"export {k}={shlex.quote(v)}; " for k, v in env.items()
            )
            restore = "".join(f"unset {k}; " for k in env) + 'eval "$__sg_saved"; '
        script = (
            f"{save}eval {shlex.quote(code)} < /dev/null; __sg_rc=$?; {restore}"
            f"printf '\\n{marker}%s\\n' \"$__sg_rc\"; printf '\\n{marker}\\n' >&2\n"
        )
        if not self._send(script):
            self.emit("error", run, name="KernelDied", value="the shell exited", traceback="")
            return
        deadline = None if not timeout else time.monotonic() + float(timeout)
        done: dict[str, bool] = {"stdout": False, "stderr": False}
        held: dict[str, bytes] = {"stdout": b"", "stderr": b""}
        status: int | None = None
        interrupted = ended = False
        token = marker.encode()
        while not all(done.values()):
            try:
                name, chunk = self.streams.get(timeout=BURST_SECONDS if self.pending else 0.5)
            except queue.Empty:
                self.flush()
                if not self.alive():
                    break
                if (
                    interrupted
                    and deadline is not None
                    and time.monotonic() > deadline + KILL_GRACE
                ):
                    self.restart()
                    self.emit(
                        "error",
                        run,
                        name="KernelRestarted",
                        value=f"the commands did not stop within {KILL_GRACE:g} s of their "
                        "interrupt: the shell was restarted (its variables, functions and "
                        "working directory are reset)",
                        traceback="",
                    )
                    return
                if deadline is not None and time.monotonic() > deadline and not interrupted:
                    interrupted = True
                    self.interrupt()
                    self.emit(
                        "error",
                        run,
                        name="TimeoutError",
                        value=f"the code ran longer than its timeout of {timeout} s "
                        "and was interrupted",
                        traceback="",
                    )
                continue
            if not chunk:  # the shell exited (`exit` in the code): what it held goes out
                if held[name]:
                    self.hold(name, run, text=held[name].decode(errors="replace"), timestamp=_now())
                    held[name] = b""
                done[name] = ended = True
                continue
            data = held[name] + chunk
            at = data.find(b"\n" + token)
            if at >= 0:
                tail = data[at + 1 + len(token) :]
                if name == "stdout":
                    digits = tail.split(b"\n", 1)[0]
                    status = int(digits) if digits.strip().isdigit() else None
                text, held[name], done[name] = data[:at], b"", True
            else:
                keep = len(token) + 1  # a marker may be cut between two reads
                text, held[name] = data[:-keep], data[-keep:]
            if text:
                self.hold(name, run, text=text.decode(errors="replace"), timestamp=_now())
        self.flush()
        if ended or not all(done.values()):
            exit_status = self.shell.wait() if self.shell is not None else None
            self.emit(
                "error",
                run,
                name="KernelDied",
                value=f"the shell exited (status {exit_status}): restart the context",
                traceback="",
            )
        elif status and not interrupted:
            self.emit(
                "error",
                run,
                name="CommandExitError",
                value=f"exit status {status}",
                traceback="",
            )


class Turns:
    """Which run has the kernel, and which wait for it: an interrupt from a client that
    left stops its own run, never the one before it (a waiting run is dropped instead).
    Shared by the thread reading requests and the one running them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current: str | None = None
        self.waiting: set[str] = set()
        self.dropped: set[str] = set()

    def queue(self, run: str) -> None:
        with self.lock:
            self.waiting.add(run)

    def interrupt(self, run: object) -> bool:
        """True when the kernel is to be interrupted (`run` is running, or no run named)."""
        with self.lock:
            if run is None or run == self.current:
                return True
            if run in self.waiting:
                self.dropped.add(str(run))
            return False

    def begin(self, run: str) -> bool:
        """`run`'s turn: False when it was dropped while it waited."""
        with self.lock:
            self.waiting.discard(run)
            if run in self.dropped:
                self.dropped.discard(run)
                return False
            self.current = run
            return True

    def end(self) -> None:
        with self.lock:
            self.current = None


def _bundle(data: dict[str, Any], kind: str) -> dict[str, Any]:
    fields: dict[str, Any] = {"is_main_result": kind == "execute_result"}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            fields[field] = value
    if extra:
        fields["extra"] = extra
    return fields


def _now() -> str:
    seconds, nanos = divmod(time.time_ns(), 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{nanos // 1000:06d}Z"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", required=True)
    # the directory as the sandbox names it (listed back); the kernel starts in this
    # process's working directory, which the agent made that same directory
    parser.add_argument("--cwd", default="/workspace")
    parser.add_argument("--language", default="python", choices=("python", "bash"))
    args = parser.parse_args()
    bridge = (ShellBridge if args.language == "bash" else Bridge)(args.context, os.getcwd())
    try:
        bridge.start()
    except Exception as exc:
        bridge.emit(
            "error", None, op="start", name=type(exc).__name__, value=str(exc), traceback=""
        )
        return 1
    bridge.emit("ready", context=args.context)
    try:
        bridge.serve()
    finally:
        bridge.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
