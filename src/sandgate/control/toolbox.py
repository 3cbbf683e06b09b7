"""The one seam between the control plane and a sandbox's agent.

Every operation the API offers inside a running sandbox is a typed method here: exec; file
upload, download, stat, list, mkdir, move, remove; processes (start, list, output, stdin,
signal); terminals (open, read, write, resize, close). This is the only module that builds
agent calls and reads their replies, with `control/ports.py` (connections to a sandbox's
ports), which makes its calls through `agent_call`. Routes translate HTTP into these calls
and back, and so does the E2B front-end.

Under each method: the tenant's running sandbox (`SandboxService.running`), then
`WorkerRegistry.request` to its worker. That call goes through this instance's tunnel or,
forwarded, through the instance that holds it; a caller cannot tell which. Errors come back
as codes (`errors.WIRE_CODES`): a sandbox its worker no longer runs is `409 not_running`, a
full disk `507`, a bad path `403`, and so on. Replies are untrusted: the agent runs beside
tenant code, so every field is validated (`control.replies`) and a malformed one is a
`WorkerError`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sandgate.agent.frames import Header
from sandgate.control import transfers
from sandgate.control.replies import (
    EntriesReply,
    Entry,
    EntryReply,
    ExecReply,
    ExportedLayer,
    MetricsReply,
    OpenReadReply,
    OpenWriteReply,
    OutputReply,
    PidReply,
    Process,
    ProcessesReply,
    SignalReply,
    StartedReply,
    TaggedWriteReply,
    WatchReadReply,
    WatchStartReply,
    WrittenReply,
    parse,
)
from sandgate.control.replies import WatchEvent as WatchEvent  # re-exported: WatchPage.events
from sandgate.control.sandboxes import SandboxService
from sandgate.control.workers import WorkerRegistry
from sandgate.core.output import decode_output, split_output
from sandgate.errors import (
    LimitExceededError,
    NotFoundError,
    PayloadTooLargeError,
    SandgateError,
    WorkerError,
)
from sandgate.store.base import Sandbox, TenantId

DEFAULT_CALL_SECONDS = 60.0
RELAY_GRACE = 5.0  # the worker's relay may answer this long after the call's own time
LIMIT_RETRY_FLOOR = 0.1  # seconds at least between two asks of a sandbox at its pids limit


@dataclass(frozen=True)
class ExecOutcome:
    exit_code: int
    duration_ms: float
    timed_out: bool
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    oom_killed: bool = False  # killed at the sandbox's memory limit (exit code 137)


@dataclass(frozen=True)
class OutputChunk:
    stream: Literal["stdout", "stderr", "pty"]
    data: bytes


@dataclass(frozen=True)
class OutputPage:
    """One read of a process's (or terminal's) output at an offset."""

    chunks: list[OutputChunk]
    first_offset: int  # the oldest offset still kept: more than asked for was dropped
    next_offset: int
    exited: bool
    exit_code: int | None


@dataclass(frozen=True)
class Download:
    size: int
    chunks: AsyncIterator[bytes]  # closes the sandbox's handle when done or dropped
    # all of the file, when it came with the open and the sandbox closed its handle: then
    # `chunks` (never started) need not run
    whole: bytes | None = None


@dataclass(frozen=True)
class WatchPage:
    """One read of a directory watch's events (at an offset, or at the watch's own cursor)."""

    events: list[WatchEvent]
    next_offset: int
    first_offset: int  # the oldest event still kept: more than asked for was dropped
    dropped: int  # events this read skipped because they fell out of the watch's buffer
    ended: bool  # the watched directory is gone and every event was read
    overflowed: bool  # the kernel lost events (its queue overflowed) since the watch started


class Toolbox:
    def __init__(self, sandboxes: SandboxService, workers: WorkerRegistry) -> None:
        self.sandboxes = sandboxes
        self.workers = workers

    async def agent_call(
        self,
        tenant: TenantId,
        name: str,
        op: str,
        fields: Mapping[str, Any] | None = None,
        payload: bytes = b"",
        *,
        seconds: float = DEFAULT_CALL_SECONDS,
    ) -> tuple[Header, bytes]:
        """One agent call in the tenant's running sandbox; `seconds`: how long it may run.
        The seam's other services (control/ports.py) call it too, and parse the reply."""
        sandbox = await self.sandboxes.running(tenant, name)
        relay = {
            "sandbox": sandbox.name,
            "call": {"op": op, **(fields or {})},
            "timeout_s": seconds,
        }
        return await self.workers.request(
            sandbox.worker, "agent", relay, payload, wait=seconds + RELAY_GRACE
        )

    # -- exec ------------------------------------------------------------------------------
    async def execute(
        self,
        tenant: TenantId,
        name: str,
        code: str,
        *,
        language: str = "bash",
        time_limit: float,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecOutcome:
        """Run a program to its end; the program travels as the frame's payload (no JSON
        escaping, no header size limit), stdout then stderr come back as the answer's."""
        fields = {"language": language, "timeout": time_limit, "env": dict(env or {}), "cwd": cwd}
        raw, payload = await self.agent_call(
            tenant, name, "exec", fields, code.encode(), seconds=time_limit
        )
        reply = parse(ExecReply, raw)
        if reply.stdout_bytes > len(payload):
            raise WorkerError("the sandbox sent a malformed exec answer")
        out, err = split_output(payload, reply.stdout_bytes)
        return ExecOutcome(
            exit_code=reply.exit_code,
            duration_ms=reply.duration_ms,
            timed_out=reply.timed_out,
            stdout=decode_output(out, reply.stdout_truncated),
            stderr=decode_output(err, reply.stderr_truncated),
            stdout_truncated=reply.stdout_truncated,
            stderr_truncated=reply.stderr_truncated,
            oom_killed=reply.oom_killed,
        )

    # -- files -----------------------------------------------------------------------------
    async def upload(
        self,
        tenant: TenantId,
        name: str,
        path: str,
        data: AsyncIterable[bytes],
        *,
        chunk_bytes: int,
        max_bytes: int,
        declared_size: int | None = None,
    ) -> Entry:
        """Write a file from a stream, `chunk_bytes` per call, a few under way at once
        (`transfers.WINDOW`), so no hop holds the whole file. It appears at `path` only
        when complete; on any failure the partial file is discarded. A file of at most
        `chunk_bytes` goes in one call (`open_write` with `commit`): one round trip instead
        of three."""
        sandbox = await self.sandboxes.running(tenant, name)
        _refuse_past_the_quota(sandbox, declared_size)
        pieces = _at_most(data, max_bytes)
        held = transfers.Chunker(chunk_bytes)
        async for piece in pieces:
            held.add(piece)
            if held.held > chunk_bytes:
                break
        else:  # the whole body came within one chunk
            whole = held.rest()
            raw, _ = await self.agent_call(
                tenant, name, "open_write", {"path": path, "commit": True}, whole
            )
            opened = parse(OpenWriteReply, raw)
            if opened.entry is not None:
                return opened.entry
            # an agent without one-call writes opened a handle: write through it (the body
            # is all in `whole`, `pieces` has no more)
            held.add(whole)
            return await self._write_through(tenant, name, opened, held, pieces)
        raw, _ = await self.agent_call(tenant, name, "open_write", {"path": path})
        opened = parse(OpenWriteReply, raw)
        return await self._write_through(tenant, name, opened, held, pieces)

    async def _write_through(
        self,
        tenant: TenantId,
        name: str,
        opened: OpenWriteReply,
        held: transfers.Chunker,
        rest: AsyncIterator[bytes],
    ) -> Entry:
        """Write what is `held` then the `rest` of the body through an open handle, a chunk
        per call, and commit it; discarded on any failure. Where the agent takes offsets, up
        to `transfers.WINDOW` writes are under way at once; else one after another."""
        handle = opened.handle
        if handle is None:
            raise WorkerError("the agent answered open_write with neither handle nor entry")

        async def write(offset: int, data: bytes) -> None:
            fields = {"handle": handle, "offset": offset} if opened.offsets else {"handle": handle}
            await self.agent_call(tenant, name, "write", fields, data)

        writes = transfers.Writes(write, transfers.WINDOW if opened.offsets else 1)
        committed = False
        try:
            while True:
                while (chunk := held.full()) is not None:
                    await writes.put(chunk)
                piece = await writes.until(anext(rest, None))  # a failed write ends the wait
                if piece is None:
                    break
                held.add(piece)
            if held.held:
                await writes.put(held.rest())
            await writes.finish()
            raw, _ = await self.agent_call(
                tenant, name, "close_write", {"handle": handle, "commit": True}
            )
            committed = True
            return parse(EntryReply, raw).entry
        finally:
            if not committed:  # one shielded step: a second cancel cannot skip the discard
                await asyncio.shield(self._abandon(tenant, name, handle, writes))

    async def _abandon(
        self, tenant: TenantId, name: str, handle: int | str, writes: transfers.Writes
    ) -> None:
        """End the writes still under way, then discard the partial file."""
        await writes.abandon()
        await self._discard(tenant, name, handle)

    async def _discard(self, tenant: TenantId, name: str, handle: int | str) -> None:
        with contextlib.suppress(SandgateError):  # the agent closes idle handles itself
            await self.agent_call(tenant, name, "close_write", {"handle": handle, "commit": False})

    async def download(
        self, tenant: TenantId, name: str, path: str, *, chunk_bytes: int
    ) -> Download:
        """Open a file for reading (its errors come before any byte) and stream it. Its first
        `chunk_bytes` come with the open: a file that fits takes one round trip."""
        raw, head = await self.agent_call(
            tenant, name, "open_read", {"path": path, "first": chunk_bytes}
        )
        opened = parse(OpenReadReply, raw)
        handle, size = opened.handle, opened.size
        if opened.first is None:
            head = b""  # an agent without `first`: everything comes from reads
        elif len(head) != opened.first or len(head) > size:
            raise WorkerError(f"the agent's first bytes of {path} do not match its answer")

        async def read(offset: int, length: int) -> bytes:
            fields: dict[str, Any] = {"handle": handle, "length": length}
            if opened.offsets:
                fields["offset"] = offset
            _, data = await self.agent_call(tenant, name, "read", fields)
            return data

        async def chunks() -> AsyncIterator[bytes]:
            try:
                if handle is None:
                    if head:
                        yield head
                    return
                # where the agent takes offsets, reads run ahead of the client; else one at
                # a time, each where the handle's position is
                window = transfers.WINDOW if opened.offsets else 1
                rest = transfers.ReadAhead(read, len(head), size, chunk_bytes, window)
                try:
                    if head:
                        yield head
                    async for data in rest:
                        yield data
                except transfers.ChangedSizeError:
                    raise WorkerError(
                        f"{path} changed size while it was being downloaded"
                    ) from None
                finally:
                    await rest.aclose()
            finally:
                if handle is not None:
                    with contextlib.suppress(SandgateError):
                        await asyncio.shield(
                            self.agent_call(tenant, name, "close_read", {"handle": handle})
                        )

        whole = head if handle is None and opened.first is not None and len(head) == size else None
        return Download(size, chunks(), whole)

    async def stat(self, tenant: TenantId, name: str, path: str) -> Entry:
        raw, _ = await self.agent_call(tenant, name, "stat", {"path": path})
        return parse(EntryReply, raw).entry

    async def list_dir(self, tenant: TenantId, name: str, path: str) -> list[Entry]:
        raw, _ = await self.agent_call(tenant, name, "list", {"path": path})
        return parse(EntriesReply, raw).entries

    async def mkdir(
        self, tenant: TenantId, name: str, path: str, *, parents: bool, exist_ok: bool | None = None
    ) -> Entry:
        """`exist_ok` (default: `parents`): an existing directory is an answer, not `exists`."""
        fields: dict[str, Any] = {"path": path, "parents": parents}
        if exist_ok is not None:
            fields["exist_ok"] = exist_ok
        raw, _ = await self.agent_call(tenant, name, "mkdir", fields)
        return parse(EntryReply, raw).entry

    async def move(
        self, tenant: TenantId, name: str, source: str, destination: str, *, overwrite: bool
    ) -> Entry:
        fields = {"src": source, "dst": destination, "overwrite": overwrite}
        raw, _ = await self.agent_call(tenant, name, "move", fields)
        return parse(EntryReply, raw).entry

    async def remove(self, tenant: TenantId, name: str, path: str, *, recursive: bool) -> None:
        await self.agent_call(tenant, name, "remove", {"path": path, "recursive": recursive})

    # -- processes -------------------------------------------------------------------------
    async def start_process(
        self,
        tenant: TenantId,
        name: str,
        command: str | Sequence[str],
        *,
        cwd: str | None,
        env: Mapping[str, str],
        time_limit: float | None,
        stdin: bool = True,
    ) -> int:
        """`command`: a shell command line, or a program and its arguments (run as given).
        `stdin=False`: the process reads end-of-file at once."""
        fields = _start_fields(command, cwd=cwd, env=env, time_limit=time_limit, stdin=stdin)
        raw, _ = await self.agent_call(tenant, name, "proc_start", fields)
        return parse(PidReply, raw).pid

    async def start_program(
        self,
        tenant: TenantId,
        name: str,
        program: str,
        args: Sequence[str],
        *,
        cwd: str | None,
        tag: str,
    ) -> int:
        """Start one of the programs deployed with the agent (`sandgate.agent.PROGRAMS`) with
        the sandbox's Python, tagged (at most one running process has a tag)."""
        fields: dict[str, Any] = {"program": program, "argv": list(args), "cwd": cwd, "tag": tag}
        raw, _ = await self.agent_call(tenant, name, "proc_start", fields)
        return parse(PidReply, raw).pid

    async def start_process_reading(
        self,
        tenant: TenantId,
        name: str,
        argv: Sequence[str],
        *,
        cwd: str | None,
        env: Mapping[str, str],
        time_limit: float | None,
        stdin: bool,
        wait: float,
        linger: float,
    ) -> tuple[int, OutputPage]:
        """Start a program and read its first output in the same call: what it printed
        within `wait` seconds, and if it printed, its exit within `linger` more. A short
        command is then one round trip to its sandbox; follow a longer one with
        `process_output` from the page's `next_offset`."""
        fields = _start_fields(argv, cwd=cwd, env=env, time_limit=time_limit, stdin=stdin)
        fields |= {"wait": wait, "linger": linger}
        raw, payload = await self.agent_call(
            tenant, name, "proc_start", fields, seconds=wait + linger + RELAY_GRACE
        )
        reply = parse(StartedReply, raw)
        return reply.pid, _page(reply.output, payload)

    async def processes(self, tenant: TenantId, name: str) -> list[Process]:
        raw, _ = await self.agent_call(tenant, name, "proc_list")
        return parse(ProcessesReply, raw).processes

    async def process(self, tenant: TenantId, name: str, pid: int) -> Process:
        for process in await self.processes(tenant, name):
            if process.pid == pid:
                return process
        raise NotFoundError(f"no process {pid} in sandbox {name}")

    async def process_output(
        self, tenant: TenantId, name: str, pid: int, offset: int, *, wait: float, linger: float = 0
    ) -> OutputPage:
        """Output from `offset` on; waits up to `wait` seconds for some if there is none, and
        with some, up to `linger` more for the process to end (its exit in the same page)."""
        return await self._output(tenant, name, "proc_read", pid, offset, wait, linger)

    async def write_stdin(
        self, tenant: TenantId, name: str, pid: int, data: bytes, *, close: bool
    ) -> int:
        fields = {"pid": pid, "close": close}
        raw, _ = await self.agent_call(tenant, name, "proc_stdin", fields, data)
        return parse(WrittenReply, raw).written

    async def write_stdin_tagged(
        self, tenant: TenantId, name: str, tag: str, data: bytes
    ) -> tuple[int, int]:
        """Write to the stdin of the running process with `tag` (`proc_start`'s): its pid,
        and the offset its output had reached just before the write (what it answers to
        this input comes after it). One call, where a pid would need a lookup first."""
        raw, _ = await self.agent_call(
            tenant, name, "proc_stdin", {"tag": tag, "close": False}, data
        )
        reply = parse(TaggedWriteReply, raw)
        return reply.pid, reply.output_end

    async def signal_process(self, tenant: TenantId, name: str, pid: int, signal: str) -> bool:
        """Signal the process's group; False if it had already exited (nothing was sent)."""
        raw, _ = await self.agent_call(tenant, name, "proc_signal", {"pid": pid, "signal": signal})
        return parse(SignalReply, raw).running

    # -- terminals -------------------------------------------------------------------------
    async def open_terminal(
        self,
        tenant: TenantId,
        name: str,
        *,
        cols: int,
        rows: int,
        command: str | Sequence[str] | None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> int:
        """`command`: a shell command line, a program and its arguments, or None (a login
        shell)."""
        fields: dict[str, Any] = {"cols": cols, "rows": rows}
        if isinstance(command, str) and command:
            fields["command"] = command
        elif command and not isinstance(command, str):
            fields["argv"] = list(command)
        if cwd is not None:
            fields["cwd"] = cwd
        if env:
            fields["env"] = dict(env)
        raw, _ = await self.agent_call(tenant, name, "pty_open", fields)
        return parse(PidReply, raw).pid

    async def terminal_output(
        self, tenant: TenantId, name: str, pid: int, offset: int, *, wait: float
    ) -> OutputPage:
        return await self._output(tenant, name, "pty_read", pid, offset, wait)

    async def write_terminal(self, tenant: TenantId, name: str, pid: int, data: bytes) -> None:
        await self.agent_call(tenant, name, "pty_write", {"pid": pid}, data)

    async def resize_terminal(
        self, tenant: TenantId, name: str, pid: int, *, cols: int, rows: int
    ) -> None:
        await self.agent_call(tenant, name, "pty_resize", {"pid": pid, "cols": cols, "rows": rows})

    async def close_terminal(self, tenant: TenantId, name: str, pid: int) -> None:
        await self.agent_call(tenant, name, "pty_close", {"pid": pid})

    async def _output(
        self,
        tenant: TenantId,
        name: str,
        op: str,
        pid: int,
        offset: int,
        wait: float,
        linger: float = 0,
    ) -> OutputPage:
        fields: dict[str, Any] = {"pid": pid, "offset": offset}
        if linger:
            fields["linger"] = linger
        clock = asyncio.get_running_loop().time
        deadline = clock() + wait
        while True:
            fields["wait"] = left = max(0.0, deadline - clock())
            seconds = left + linger + RELAY_GRACE
            try:
                raw, payload = await self.agent_call(tenant, name, op, fields, seconds=seconds)
            except LimitExceededError as exc:
                # no agent thread could take the read (the sandbox's processes fill its pids
                # limit): it was never begun, so a long poll asks again within its own wait
                if exc.limit != "pids" or deadline - clock() <= 0:
                    raise
                await asyncio.sleep(
                    min(max(LIMIT_RETRY_FLOOR, exc.retry_after), deadline - clock())
                )
                continue
            return _page(parse(OutputReply, raw), payload)

    # -- watches ---------------------------------------------------------------------------
    async def watch_start(self, tenant: TenantId, name: str, path: str, *, recursive: bool) -> str:
        """Watch a directory (and, `recursive`, every directory below it, also those created
        later); the watch's id. Events are kept from now on: read them with `watch_read`."""
        fields = {"path": path, "recursive": recursive}
        raw, _ = await self.agent_call(tenant, name, "watch_start", fields)
        return parse(WatchStartReply, raw).watch

    async def watch_read(
        self, tenant: TenantId, name: str, watch_id: str, offset: int | None, *, wait: float
    ) -> WatchPage:
        """Events from `offset` on, or (None) those not read yet through the watch's own
        cursor, each once; waits up to `wait` seconds (at most 30) for one."""
        fields: dict[str, Any] = {"watch": watch_id, "wait": wait}
        if offset is not None:
            fields["offset"] = offset
        raw, _ = await self.agent_call(
            tenant, name, "watch_read", fields, seconds=wait + RELAY_GRACE
        )
        reply = parse(WatchReadReply, raw)
        return WatchPage(
            reply.events,
            reply.next_offset,
            reply.first_offset,
            reply.dropped,
            reply.ended,
            reply.overflowed,
        )

    async def watch_stop(self, tenant: TenantId, name: str, watch_id: str) -> None:
        await self.agent_call(tenant, name, "watch_stop", {"watch": watch_id})

    # -- metrics ---------------------------------------------------------------------------
    async def export_root(self, tenant: TenantId, name: str) -> ExportedLayer:
        """Have the worker write what the template sandbox changed in its root as a layer
        (worker/export.py); read it with `exported_chunk`. Removed with the sandbox."""
        sandbox = await self.sandboxes.running(tenant, name)
        raw, _ = await self.workers.request(
            sandbox.worker, "export_root", {"name": sandbox.name}, b"", wait=EXPORT_SECONDS
        )
        return parse(ExportedLayer, raw)

    async def exported_chunk(self, tenant: TenantId, name: str, offset: int) -> bytes:
        sandbox = await self.sandboxes.running(tenant, name)
        _, payload = await self.workers.request(
            sandbox.worker,
            "export_read",
            {"name": sandbox.name, "offset": offset},
            b"",
            wait=EXPORT_READ_SECONDS,
        )
        return payload

    async def metrics(self, tenant: TenantId, name: str) -> SandboxMetrics:
        """What the tenant's running sandbox uses now, measured by its worker on its host
        (its cgroups and file system: `worker/metrics.py` says where each figure comes
        from). Takes about 0.1 s when the sandbox was not measured in the last 30 s."""
        sandbox = await self.sandboxes.running(tenant, name)
        raw, _ = await self.workers.request(
            sandbox.worker, "metrics", {"name": sandbox.name}, b"", wait=METRICS_SECONDS
        )
        try:
            reply = parse(MetricsReply, raw)
        except WorkerError:
            raise WorkerError(
                f"worker {sandbox.worker} sent a malformed metrics answer for {sandbox.name}"
            ) from None
        return SandboxMetrics(
            timestamp=reply.timestamp,
            cpu_count=reply.cpu_count,
            cpu_used_pct=reply.cpu_used_pct,
            mem_used=reply.mem_used,
            mem_total=reply.mem_total,
            mem_cache=reply.mem_cache,
            disk_used=reply.disk_used,
            disk_total=reply.disk_total,
        )


def _start_fields(
    command: str | Sequence[str],
    *,
    cwd: str | None,
    env: Mapping[str, str],
    time_limit: float | None,
    stdin: bool,
) -> dict[str, Any]:
    """A `proc_start`'s fields: a shell command line or a program and its arguments."""
    fields: dict[str, Any] = {"cwd": cwd, "env": dict(env), "timeout": time_limit}
    fields |= {"command": command} if isinstance(command, str) else {"argv": list(command)}
    if not stdin:
        fields["stdin"] = False
    return fields


def _page(reply: OutputReply, payload: bytes) -> OutputPage:
    chunks, cursor = [], 0
    for stream, length in reply.chunks:
        chunks.append(OutputChunk(stream, payload[cursor : cursor + length]))
        cursor += length
    if cursor > len(payload):
        raise WorkerError("the sandbox sent a malformed output answer")
    return OutputPage(chunks, reply.first_offset, reply.next_offset, reply.exited, reply.exit_code)


async def _at_most(data: AsyncIterable[bytes], max_bytes: int) -> AsyncIterator[bytes]:
    """The body's pieces, refused (413) as soon as they pass `max_bytes` in all."""
    total = 0
    async for piece in data:
        total += len(piece)
        if total > max_bytes:
            raise PayloadTooLargeError(f"upload over {max_bytes} bytes; split the file")
        yield piece


def _refuse_past_the_quota(sandbox: Sandbox, declared: int | None) -> None:
    """An upload whose declared size cannot fit the sandbox's disk quota is refused before
    a byte is written (one that only turns out too large answers 507 when the disk fills)."""
    disk_mb = sandbox.resources.get("disk_mb")
    if isinstance(disk_mb, int) and declared is not None and declared > disk_mb << 20:
        raise PayloadTooLargeError(
            f"an upload of {declared} bytes cannot fit this sandbox's disk quota of "
            f"{disk_mb} MiB (resources.disk_mb, /workspace and /tmp together); create the "
            "sandbox with a larger disk_mb",
            code="disk_quota_exceeded",
        )


# -- metrics -------------------------------------------------------------------------------
EXPORT_SECONDS = 600.0  # a build step's layer is written (and hashed) on its worker
EXPORT_READ_SECONDS = 60.0
METRICS_SECONDS = 10.0  # a worker measures a sandbox in about 0.1 s (a CPU sampling window)


@dataclass(frozen=True)
class SandboxMetrics:
    """What one running sandbox uses (bytes, unix seconds), as its worker measured it."""

    timestamp: float
    cpu_count: int  # its CPU limit rounded up, or the host's CPUs when it has none
    cpu_used_pct: float  # CPU used since the previous measurement (or over 0.1 s), of cpu_count
    mem_used: int
    mem_total: int  # its memory limit, or the host's memory when it has none
    mem_cache: int  # page cache, part of mem_used
    disk_used: int
    disk_total: int  # its disk quota's file system, or the one its workspace is on
