"""envd's `process.Process` Connect service over the toolbox's processes and terminals.

* `Start` runs `cmd` with `args` as given (E2B's SDK sends `/bin/bash -l -c <command>`), with
  a terminal when `pty` is set; `stdin: false` gives end-of-file at once. The stream is a
  `start` event with the pid, the output as it comes, then one `end` event. The request's
  `Connect-Timeout-Ms` bounds the process: at the deadline it is killed (envd's rule).
* `Connect` follows a running process from its current output on; neither stream's client
  going away stops the process.
* Output is read by long-polls on the toolbox (`process_output` / `terminal_output`), each
  through whichever instance holds the sandbox's worker; an idle stream sends a `keepalive`
  event every `Keepalive-Ping-Interval` seconds (at most 25).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from time import monotonic
from types import MappingProxyType
from typing import Any, Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from sandgate.api.e2b.caller import (
    EnvdCaller,
    OnToolbox,
    as_connect,
    caller,
    sandbox_path,
)
from sandgate.api.e2b.envd_pb.process import process_connect
from sandgate.api.e2b.envd_pb.process import process_pb as pb
from sandgate.control.toolbox import OutputPage
from sandgate.errors import LimitExceededError, SandgateError
from sandgate.store.base import TenantId

# a start answers with what the command printed within START_READ_WAIT s and, if it printed,
# its exit within EXIT_LINGER s more: `echo ok` is one round trip to the sandbox, and a silent
# command's start event waits START_READ_WAIT at most. Reads linger for the exit the same way.
START_READ_WAIT = 0.02
EXIT_LINGER = 0.005
KEEPALIVE_SECONDS = 25.0  # longest silence on an output stream (the agent's long-poll < 30)
KILL = "SIGKILL"
SIGNALS = MappingProxyType({pb.Signal.SIGKILL: "SIGKILL", pb.Signal.SIGTERM: "SIGTERM"})


def _pid(selector: pb.ProcessSelector | None) -> int:
    match selector.selector if selector is not None else None:
        case Oneof(field="pid", value=pid):
            return int(pid)
        case Oneof(field="tag", value=tag):
            raise ConnectError(Code.NOT_FOUND, f"no process tagged {tag!r} (sandgate has no tags)")
    raise ConnectError(Code.INVALID_ARGUMENT, "name the process by pid")


def _keepalive_seconds(ctx: RequestContext[Any, Any]) -> float:
    raw = ctx.request_headers.get("keepalive-ping-interval")
    try:
        seconds = float(raw) if raw else KEEPALIVE_SECONDS
    except ValueError:
        seconds = KEEPALIVE_SECONDS
    return min(max(seconds, 1.0), KEEPALIVE_SECONDS)


def _deadline(ctx: RequestContext[Any, Any]) -> float | None:
    timeout_ms = ctx.timeout_ms
    return None if not timeout_ms else monotonic() + timeout_ms / 1000


def _started(pid: int) -> pb.ProcessEvent:
    start: Oneof[Literal["start"], pb.ProcessEvent.StartEvent]
    start = Oneof("start", pb.ProcessEvent.StartEvent(pid=pid))
    return pb.ProcessEvent(event=start)


def _keepalive() -> pb.ProcessEvent:
    keepalive: Oneof[Literal["keepalive"], pb.ProcessEvent.KeepAlive]
    keepalive = Oneof("keepalive", pb.ProcessEvent.KeepAlive())
    return pb.ProcessEvent(event=keepalive)


def _end(exit_code: int | None) -> pb.ProcessEvent:
    code = -1 if exit_code is None else exit_code
    if code > 128:  # the agent reports a signal as 128 + its number, as a shell does
        status = f"signal: {code - 128}"
    else:
        status = f"exit status {code}"
    end: Oneof[Literal["end"], pb.ProcessEvent.EndEvent]
    end = Oneof("end", pb.ProcessEvent.EndEvent(exit_code=code, exited=True, status=status))
    return pb.ProcessEvent(event=end)


def _data(stream: str, data: bytes) -> pb.ProcessEvent:
    output: Any = Oneof(stream, data)  # stream is one of stdout, stderr, pty (OutputChunk)
    event: Oneof[Literal["data"], pb.ProcessEvent.DataEvent]
    event = Oneof("data", pb.ProcessEvent.DataEvent(output=output))
    return pb.ProcessEvent(event=event)


def _events(page: OutputPage) -> Iterator[pb.ProcessEvent]:
    """One read of a process's output as stream events: its data, then its end if it ended."""
    for chunk in page.chunks:
        if chunk.data:
            yield _data(chunk.stream, chunk.data)
    if page.exited:
        yield _end(page.exit_code)


class ProcessService(OnToolbox, process_connect.Process):
    """The `process.Process` service (its generated protocol: `process_connect.Process`)."""

    # -- streams ----------------------------------------------------------------------------
    async def start(
        self, request: pb.StartRequest, ctx: RequestContext[pb.StartRequest, pb.StartResponse]
    ) -> AsyncIterator[pb.StartResponse]:
        who = caller()
        config = request.process
        if config is None or not config.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        argv = [config.cmd, *config.args]
        cwd = sandbox_path(config.cwd) if config.has_field("cwd") and config.cwd else None
        env = dict(config.envs)
        deadline = _deadline(ctx)
        with as_connect(who.sandbox):
            if request.pty is not None:
                size = request.pty.size
                pid = await self.toolbox.open_terminal(
                    who.tenant,
                    who.sandbox,
                    cols=size.cols if size is not None and size.cols else 80,
                    rows=size.rows if size is not None and size.rows else 24,
                    command=argv,
                    cwd=cwd,
                    env=env,
                )
                first = None
            else:
                stdin = request.stdin if request.has_field("stdin") else True
                pid, first = await self.toolbox.start_process_reading(
                    who.tenant,
                    who.sandbox,
                    argv,
                    cwd=cwd,
                    env=env,
                    time_limit=None if deadline is None else deadline - monotonic(),
                    stdin=bool(stdin),
                    wait=START_READ_WAIT,
                    linger=EXIT_LINGER,
                )
        yield pb.StartResponse(event=_started(pid))
        offset = 0
        if first is not None:  # a short command has printed and exited already
            for event in _events(first):
                yield pb.StartResponse(event=event)
            if first.exited:
                return
            offset = first.next_offset
        follow = self._follow(who, pid, request.pty is not None, offset, deadline, ctx)
        async for event in follow:
            yield pb.StartResponse(event=event)

    async def connect(
        self, request: pb.ConnectRequest, ctx: RequestContext[pb.ConnectRequest, pb.ConnectResponse]
    ) -> AsyncIterator[pb.ConnectResponse]:
        who = caller()
        pid = _pid(request.process)
        with as_connect(who.sandbox):
            process = await self.toolbox.process(who.tenant, who.sandbox, pid)
            if process.state != "running":
                raise ConnectError(Code.NOT_FOUND, f"process {pid} is not running")
        yield pb.ConnectResponse(event=_started(pid))
        # only what comes from now on: from where its output stood when it was listed
        follow = self._follow(who, pid, process.terminal, process.output_end, _deadline(ctx), ctx)
        async for event in follow:
            yield pb.ConnectResponse(event=event)

    async def _read(
        self, who: EnvdCaller, pid: int, terminal: bool, offset: int, wait: float
    ) -> OutputPage:
        if terminal:  # interactive: its output goes out as it comes
            return await self.toolbox.terminal_output(
                who.tenant, who.sandbox, pid, offset, wait=wait
            )
        return await self.toolbox.process_output(
            who.tenant, who.sandbox, pid, offset, wait=wait, linger=EXIT_LINGER
        )

    async def _follow(
        self,
        who: EnvdCaller,
        pid: int,
        terminal: bool,
        offset: int,
        deadline: float | None,
        ctx: RequestContext[Any, Any],
    ) -> AsyncIterator[pb.ProcessEvent]:
        keepalive = _keepalive_seconds(ctx)
        while True:
            wait = keepalive
            if deadline is not None:
                left = deadline - monotonic()
                if left <= 0:
                    await self._kill_quietly(who.tenant, who.sandbox, pid)
                    raise ConnectError(Code.DEADLINE_EXCEEDED, "the command's timeout passed")
                wait = min(wait, left)
            with as_connect(who.sandbox):
                page = await self._read(who, pid, terminal, offset, wait)
            for event in _events(page):
                yield event
            offset = page.next_offset
            if page.exited:
                return
            if not page.chunks:
                yield _keepalive()

    async def _kill_quietly(self, tenant: TenantId, sandbox: str, pid: int) -> None:
        with contextlib.suppress(SandgateError):
            await self.toolbox.signal_process(tenant, sandbox, pid, KILL)

    # -- unary ------------------------------------------------------------------------------
    async def list(
        self, request: pb.ListRequest, ctx: RequestContext[pb.ListRequest, pb.ListResponse]
    ) -> pb.ListResponse:
        who = caller()
        with as_connect(who.sandbox):
            processes = await self.toolbox.processes(who.tenant, who.sandbox)
        infos = []
        for process in processes:
            if process.state != "running":
                continue
            argv = process.argv or ["/bin/bash", "-c", process.command]
            config = pb.ProcessConfig(cmd=argv[0], args=argv[1:], envs=process.env)
            if process.cwd is not None:
                config.cwd = process.cwd
            infos.append(pb.ProcessInfo(config=config, pid=process.pid))
        return pb.ListResponse(processes=infos)

    async def send_input(
        self,
        request: pb.SendInputRequest,
        ctx: RequestContext[pb.SendInputRequest, pb.SendInputResponse],
    ) -> pb.SendInputResponse:
        who = caller()
        await self._input(who, _pid(request.process), request.input)
        return pb.SendInputResponse()

    async def _input(self, who: EnvdCaller, pid: int, given: pb.ProcessInput | None) -> None:
        with as_connect(who.sandbox):
            match given.input if given is not None else None:
                case Oneof(field="stdin", value=data):
                    await self.toolbox.write_stdin(who.tenant, who.sandbox, pid, data, close=False)
                case Oneof(field="pty", value=data):
                    await self.toolbox.write_terminal(who.tenant, who.sandbox, pid, data)
                case _:
                    raise ConnectError(Code.INVALID_ARGUMENT, "give input.stdin or input.pty")

    async def stream_input(
        self,
        requests: AsyncIterator[pb.StreamInputRequest],
        ctx: RequestContext[pb.StreamInputRequest, pb.StreamInputResponse],
    ) -> pb.StreamInputResponse:
        who = caller()
        pid: int | None = None
        async for message in requests:
            match message.event:
                case Oneof(field="start", value=pb.StreamInputRequest.StartEvent() as start):
                    pid = _pid(start.process)
                case Oneof(field="data", value=pb.StreamInputRequest.DataEvent() as data):
                    if pid is None:
                        raise ConnectError(Code.INVALID_ARGUMENT, "send a start event first")
                    await self._input(who, pid, data.input)
                case _:
                    pass  # keepalive
        return pb.StreamInputResponse()

    async def close_stdin(
        self,
        request: pb.CloseStdinRequest,
        ctx: RequestContext[pb.CloseStdinRequest, pb.CloseStdinResponse],
    ) -> pb.CloseStdinResponse:
        who = caller()
        with as_connect(who.sandbox):
            await self.toolbox.write_stdin(
                who.tenant, who.sandbox, _pid(request.process), b"", close=True
            )
        return pb.CloseStdinResponse()

    async def send_signal(
        self,
        request: pb.SendSignalRequest,
        ctx: RequestContext[pb.SendSignalRequest, pb.SendSignalResponse],
    ) -> pb.SendSignalResponse:
        who = caller()
        name = SIGNALS.get(request.signal)
        if name is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "signal must be SIGNAL_SIGKILL or SIGTERM")
        pid = _pid(request.process)
        with as_connect(who.sandbox):
            try:
                state = (await self.toolbox.process(who.tenant, who.sandbox, pid)).state
            except LimitExceededError as exc:
                if exc.limit != "pids":
                    raise
                # a sandbox at its pids limit answers no look-up but still takes a signal,
                # the way to get its pids back: sent without knowing the state, which its
                # answer then gives
                state = "running"
            if state != "running" or not await self.toolbox.signal_process(
                who.tenant, who.sandbox, pid, name
            ):
                raise ConnectError(Code.NOT_FOUND, f"process {pid} is not running")
        return pb.SendSignalResponse()

    async def update(
        self, request: pb.UpdateRequest, ctx: RequestContext[pb.UpdateRequest, pb.UpdateResponse]
    ) -> pb.UpdateResponse:
        who = caller()
        pid = _pid(request.process)
        if request.pty is None or request.pty.size is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "pty.size is required")
        size = request.pty.size
        with as_connect(who.sandbox):
            await self.toolbox.resize_terminal(
                who.tenant, who.sandbox, pid, cols=size.cols, rows=size.rows
            )
        return pb.UpdateResponse()
