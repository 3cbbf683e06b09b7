"""Development runtime: the agent as a plain subprocess. NO isolation at all.

The agent runs as the worker's own user with the worker's network, filesystem view and
privileges; `--workspace`/`--tmp` are host directories. Use it only to develop sandgate on a
machine without bubblewrap, never for untrusted code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from sandgate.errors import WorkerError
from sandgate.worker.cleanup import remove_tree
from sandgate.worker.pipes import PIPE_LIMIT, widen_pipes
from sandgate.worker.runtime.base import RunningSandbox, SandboxSpec
from sandgate.worker.runtime.bwrap import check_spec

log = logging.getLogger(__name__)


def _python() -> str:
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def _descendants(root: int) -> list[int]:
    """Pids of every live descendant of `root` (from /proc; children that called setsid
    leave the process group but not the parent chain)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        # the comm field may contain spaces and parentheses: split after the last ')'
        fields = data[data.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            found.append(child)
            todo.append(child)
    return found


class ProcessRuntime:
    name = "process"

    def __init__(self, state_dir: Path, agent_dir: Path, *, worker_name: str) -> None:
        self.state_dir = Path(state_dir).absolute()
        self.agent_dir = Path(agent_dir).absolute()
        self.worker_name = worker_name
        self.sandboxes_dir = self.state_dir / "sandboxes"

    def agent_argv(self, sandbox_dir: Path) -> list[str]:
        return [
            _python(),
            "-I",
            "-S",
            str(self.agent_dir / "agent.py"),
            "--workspace",
            str(sandbox_dir / "workspace"),
            "--tmp",
            str(sandbox_dir / "tmp"),
        ]

    def features(self) -> dict[str, Any]:
        return {
            "runtime": "process",
            "isolation": False,
            "user_namespace": False,
            "uid": "worker",
            "seccomp": False,
            "no_new_privs": False,
            "capabilities": "worker",
            "network": "host",
            "readonly_root": False,
            "pid_namespace": False,
            "cgroup": "none",
            "limits": {"memory": False, "pids": False, "cpu": False},
        }

    async def prepare(self) -> None:
        log.warning(
            "runtime.unisolated worker=%s: the process runtime gives sandboxes NO isolation",
            self.worker_name,
        )
        try:
            self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
            leftovers = list(self.sandboxes_dir.iterdir())
        except OSError as exc:
            raise WorkerError(f"cannot create {self.sandboxes_dir}: {exc}") from exc
        for p in leftovers:
            await asyncio.to_thread(remove_tree, p)

    async def start(self, spec: SandboxSpec, argv: list[str] | None = None) -> RunningSandbox:
        check_spec(spec)
        log.warning(
            "runtime.unisolated sandbox=%s: started as a plain process, no isolation", spec.name
        )
        sandbox_dir = self.sandboxes_dir / spec.name
        try:
            sandbox_dir.mkdir(parents=True)
        except FileExistsError:
            raise WorkerError(f"sandbox {spec.name!r} already exists on this worker") from None
        except OSError as exc:
            raise WorkerError(f"cannot create {sandbox_dir}: {exc}") from exc
        log_fd = -1
        try:
            workspace = sandbox_dir / "workspace"
            workspace.mkdir()
            (sandbox_dir / "tmp").mkdir()
            log_path = sandbox_dir / "agent.log"
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            env = {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": str(workspace),
                "LANG": "C.UTF-8",
                "TMPDIR": str(sandbox_dir / "tmp"),
                **spec.env,
            }
            process = await asyncio.create_subprocess_exec(
                *(argv if argv is not None else self.agent_argv(sandbox_dir)),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log_fd,
                cwd=workspace,
                env=env,
                start_new_session=True,
                limit=PIPE_LIMIT,
            )
            widen_pipes(process)
        except BaseException as exc:
            await asyncio.to_thread(remove_tree, sandbox_dir)
            if isinstance(exc, Exception) and not isinstance(exc, WorkerError):
                raise WorkerError(f"cannot start sandbox {spec.name!r}: {exc}") from exc
            raise
        finally:
            if log_fd >= 0:
                os.close(log_fd)
        return RunningSandbox(
            spec=spec,
            process=process,
            workspace=workspace,
            private={"sandbox_dir": sandbox_dir, "log_path": log_path, "stopped": False},
            scratch=(workspace, sandbox_dir / "tmp"),
        )

    async def close(self) -> None:
        """Nothing of the worker's own to remove: no cgroups."""

    async def stop(self, sandbox: RunningSandbox) -> None:
        if sandbox.private.get("stopped"):
            return
        process = sandbox.process
        if process.returncode is None:
            # the agent's children run in sessions of their own: find them by parentage
            for _ in range(3):
                pids = _descendants(process.pid)
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if not pids:
                    break
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            await asyncio.wait_for(process.wait(), 5.0)
        except TimeoutError:
            raise WorkerError(
                f"sandbox {sandbox.spec.name!r}: pid {process.pid} did not exit"
            ) from None
        if process.stdin is not None:
            process.stdin.close()
        await asyncio.to_thread(remove_tree, sandbox.private["sandbox_dir"])
        sandbox.private["stopped"] = True
