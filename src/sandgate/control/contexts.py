"""Code contexts: stateful interpreters inside a sandbox, over the toolbox's processes.

A context is one `kernel_bridge` process of the sandbox (agent/kernel_bridge.py: a real
IPython kernel driven over jupyter_client's IPC transport, or a persistent bash for
`language: "bash"`), tagged `ctx:<id>`. The agent keeps
a tag unique among running processes, so the context's id finds its process on any instance
and two creates of one id (the per-sandbox `default` context, asked for by two instances at
once) make one. Nothing is kept in the control plane: a context lives and dies with its
process, which lives and dies with its sandbox.

A run writes one JSON line to the bridge's stdin and follows its stdout (NDJSON) from where
the output ended before the write, taking the events of its own run id. A run whose client
goes away, or whose timeout passes, interrupts the kernel (the bridge enforces the timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from sandgate.control.replies import Process
from sandgate.control.toolbox import Toolbox
from sandgate.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    SandgateError,
    WorkerError,
)
from sandgate.store.base import TenantId

TAG_PREFIX = "ctx:"
LANGUAGES = ("python", "bash")  # an IPython kernel; a persistent bash (agent/kernel_bridge.py)
DEFAULT_CONTEXT = "default"
# the context a run without a context id goes to, per language (made by its first run)
DEFAULT_CONTEXTS = MappingProxyType({"python": DEFAULT_CONTEXT, "bash": "default-bash"})
# a kernel that does not answer within this is a failed create: past the bridge's own
# READY_TIMEOUT (60 s), so that a kernel that hangs is reported by the bridge, saying so
READY_SECONDS = 70.0
# what a kernel that died starting most often ran into, and what to do about it
KERNEL_ROOM = (
    "a kernel needs room for its processes and threads and its memory: if the sandbox's "
    "processes are near its resources.pids or resources.memory_mb, end some of them or "
    "create the sandbox with more"
)
FOLLOW_WAIT = 25.0
DELETE_SECONDS = 10.0  # then a context's process that did not exit is killed
CONTEXT_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")


class _BridgeEnded(Exception):
    """A context's bridge exited before its kernel answered (ContextService.restart)."""


@dataclass(frozen=True)
class Context:
    id: str
    language: str
    cwd: str
    pid: int
    output_end: int = 0  # where its process's output stood when it was listed


def _context_of(process: Process) -> Context | None:
    if process.state != "running" or not (process.tag or "").startswith(TAG_PREFIX):
        return None
    args = process.argv
    cwd = args[args.index("--cwd") + 1] if "--cwd" in args[:-1] else "/workspace"
    language = args[args.index("--language") + 1] if "--language" in args[:-1] else "python"
    context_id = str(process.tag)[len(TAG_PREFIX) :]
    return Context(context_id, language, cwd, process.pid, process.output_end)


async def _prepend(
    first: dict[str, Any], rest: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    yield first
    async for event in rest:
        yield event


def check_context_id(context_id: str) -> None:
    if not 0 < len(context_id) <= 64 or not set(context_id) <= CONTEXT_ID_CHARS:
        raise InvalidRequestError("a context id is 1-64 characters of a-z, 0-9 and '-'")


class ContextService:
    def __init__(self, toolbox: Toolbox) -> None:
        self.toolbox = toolbox

    async def list(self, tenant: TenantId, name: str) -> list[Context]:
        found = [_context_of(p) for p in await self.toolbox.processes(tenant, name)]
        return [context for context in found if context is not None]

    async def get(self, tenant: TenantId, name: str, context_id: str) -> Context:
        for context in await self.list(tenant, name):
            if context.id == context_id:
                return context
        raise NotFoundError(f"no code context {context_id!r} in sandbox {name}")

    async def create(
        self,
        tenant: TenantId,
        name: str,
        *,
        language: str = "python",
        cwd: str | None = None,
        context_id: str | None = None,
    ) -> Context:
        """A new context, its kernel ready; with `context_id` given and already running,
        that one (so the default context is made once, whoever asks first)."""
        if language not in LANGUAGES:
            raise InvalidRequestError(
                f"language {language!r} has no kernel here; use one of {', '.join(LANGUAGES)}"
            )
        context_id = context_id or "ctx-" + secrets.token_hex(6)
        check_context_id(context_id)
        directory = cwd or "/workspace"
        args = ["--context", context_id, "--cwd", directory, "--language", language]
        try:
            pid = await self.toolbox.start_program(
                tenant, name, "kernel_bridge", args, cwd=directory, tag=TAG_PREFIX + context_id
            )
        except ConflictError as exc:
            if exc.code != "exists":
                raise
            return await self._ready(tenant, name, await self.get(tenant, name, context_id))
        return await self._ready(tenant, name, Context(context_id, language, directory, pid))

    async def default(self, tenant: TenantId, name: str, language: str = "python") -> Context:
        """The sandbox's default context of `language`, made by the first run that needs it."""
        if language not in DEFAULT_CONTEXTS:
            raise InvalidRequestError(
                f"language {language!r} has no kernel here; use one of {', '.join(LANGUAGES)}"
            )
        context_id = DEFAULT_CONTEXTS[language]
        try:
            return await self.get(tenant, name, context_id)
        except NotFoundError:
            return await self.create(tenant, name, language=language, context_id=context_id)

    async def start_run(
        self,
        tenant: TenantId,
        name: str,
        context_id: str | None,
        code: str,
        *,
        env: dict[str, str] | None = None,
        time_limit: float | None = None,
        language: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """The run handed to its context, and its events (`number_of_executions`, `stdout`,
        `stderr`, `result`, `error`, ending with `end_of_execution`) to follow, its first
        event read already. A context that does not exist raises here, before a stream has
        answered; a run waiting behind another waits here for its turn (at most that run's
        timeout and KILL_GRACE, then its kernel is restarted). Without a context id, in the
        default context of `language` (python if none), made by the first run that needs
        it."""
        language = language or "python"
        if context_id is None and language not in DEFAULT_CONTEXTS:
            raise InvalidRequestError(
                f"language {language!r} has no kernel here; use one of {', '.join(LANGUAGES)}"
            )
        target = context_id or DEFAULT_CONTEXTS[language]
        run_id = secrets.token_hex(8)
        # the bridge interrupts the kernel when the time limit passes (and restarts one that
        # ignores the interrupt)
        request = {"op": "run", "run": run_id, "code": code, "env": env or {}}
        line = json.dumps({**request, "timeout": time_limit}, separators=(",", ":")) + "\n"
        for attempt in (1, 2):
            try:
                pid, offset = await self.toolbox.write_stdin_tagged(
                    tenant, name, TAG_PREFIX + target, line.encode()
                )
            except NotFoundError:
                if context_id is not None:
                    raise NotFoundError(
                        f"no code context {context_id!r} in sandbox {name}"
                    ) from None
                if attempt == 2:
                    raise
                await self.default(tenant, name, language)
                continue
            events = self._follow_run(tenant, name, pid, offset, run_id)
            first = await anext(events)  # the stream answers once the run has its turn
            return _prepend(first, events)
        raise AssertionError("unreachable")

    async def _ready(self, tenant: TenantId, name: str, context: Context) -> Context:
        """Wait for the bridge's `ready` line: its kernel answers."""
        # its bridge gone before its kernel answered: most often the memory limit's doing
        ended = WorkerError(
            f"the kernel of context {context.id} exited while starting ({KERNEL_ROOM})"
        )
        await self._kernel_answers(tenant, name, context, 0, ("ready", "start"), ended)
        return context

    async def _kernel_answers(
        self,
        tenant: TenantId,
        name: str,
        context: Context,
        offset: int,
        wanted: tuple[str, str],
        ended: Exception,
    ) -> None:
        """Until the bridge's line `wanted[0]` (`ready`, `restarted`) from `offset`: its
        kernel answers. Its error of op `wanted[1]` (`start`, `restart`: the kernel could not
        start), its exit (raises `ended`), or `READY_SECONDS` without any fail the call."""
        line, op = wanted
        try:
            async with asyncio.timeout(READY_SECONDS):
                async for event in self._events(tenant, name, context.pid, offset):
                    if event.get("type") == line:
                        return
                    if event.get("type") == "error" and event.get("op") == op:
                        raise WorkerError(
                            f"the kernel of context {context.id} did not start: "
                            f"{event.get('value')} ({KERNEL_ROOM})"
                        )
        except TimeoutError:
            raise WorkerError(
                f"the kernel of context {context.id} did not answer within {READY_SECONDS:g} s"
                f" ({KERNEL_ROOM})"
            ) from None
        raise ended

    async def delete(self, tenant: TenantId, name: str, context_id: str) -> None:
        """End the context: its kernel is shut down and its process has exited when this
        returns (so a list right after no longer has it)."""
        context = await self.get(tenant, name, context_id)
        # end of its stdin: the bridge shuts its kernel down and exits
        await self.toolbox.write_stdin(tenant, name, context.pid, b"", close=True)
        offset = context.output_end
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DELETE_SECONDS):
                while True:
                    page = await self.toolbox.process_output(
                        tenant, name, context.pid, offset, wait=FOLLOW_WAIT
                    )
                    if page.exited:
                        return
                    offset = page.next_offset
        # a bridge that did not exit in time (a kernel stuck in its shutdown) is killed
        await self.toolbox.signal_process(tenant, name, context.pid, "SIGKILL")

    async def restart(self, tenant: TenantId, name: str, context_id: str) -> Context:
        context = await self.get(tenant, name, context_id)
        await self._send(tenant, name, context.pid, {"op": "restart"})
        wanted = ("restarted", "restart")
        try:
            await self._kernel_answers(
                tenant, name, context, context.output_end, wanted, _BridgeEnded()
            )
        except _BridgeEnded:
            raise await self._why_ended(tenant, name, context) from None
        return context

    async def _why_ended(self, tenant: TenantId, name: str, context: Context) -> SandgateError:
        """What to answer for a context whose bridge exited while its kernel restarted: one
        that ended itself (a delete closed its stdin) is gone, a conflict; one that was killed
        (the memory limit's doing, most often: a kernel starting takes ~100 MiB) is the
        worker's error, saying what a kernel needs room for."""
        try:
            code = (await self.toolbox.process(tenant, name, context.pid)).exit_code
        except NotFoundError:
            code = None
        if code is not None and code > 128:
            return WorkerError(
                f"the process of context {context.id} was killed (signal {code - 128}) while "
                f"its kernel restarted ({KERNEL_ROOM}); create the context again"
            )
        return ConflictError(f"context {context.id} ended while restarting")

    async def _follow_run(
        self, tenant: TenantId, name: str, pid: int, offset: int, run_id: str
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of run `run_id`, read from the context's output at `offset` (where it
        stood when the run was written)."""
        finished = False
        try:
            async for event in self._events(tenant, name, pid, offset):
                if event.get("run") != run_id:
                    continue
                event.pop("run", None)
                last = event.get("type") == "end_of_execution"
                yield event
                if last:
                    finished = True
                    return
            yield {
                "type": "error",
                "name": "KernelDied",
                "value": "the context ended while running this code: create it again",
                "traceback": "",
            }
            yield {"type": "end_of_execution"}
            finished = True
        finally:
            if not finished:  # the client left, or the call failed: stop its code (or drop
                # it from its context's turn), never the code of a run before it
                with contextlib.suppress(SandgateError):
                    interrupt = {"op": "interrupt", "run": run_id}
                    await asyncio.shield(self._send(tenant, name, pid, interrupt))

    async def _send(self, tenant: TenantId, name: str, pid: int, request: dict[str, Any]) -> None:
        line = json.dumps(request, separators=(",", ":")) + "\n"
        await self.toolbox.write_stdin(tenant, name, pid, line.encode(), close=False)

    async def _events(
        self, tenant: TenantId, name: str, pid: int, offset: int
    ) -> AsyncIterator[dict[str, Any]]:
        """The bridge's JSON lines from `offset` until it exits."""
        pending = b""
        while True:
            page = await self.toolbox.process_output(tenant, name, pid, offset, wait=FOLLOW_WAIT)
            if page.first_offset > offset:  # dropped from the buffer: resync on a line end
                pending = b""
            for chunk in page.chunks:
                if chunk.stream != "stdout":
                    continue  # the kernel's own log lines
                pending += chunk.data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict):
                        yield event
            offset = page.next_offset
            if page.exited:
                return
