"""The worker writes and reads a whole file on a sandbox's own disk as the agent does
(worker/disk_files.py): the same calls, one set answered through `DiskFiles` (the agent only
where it declines) and one by the agent alone, on twin directories of one real bwrap sandbox,
give the same answers, and the files they leave have the same owner, mode and content. The
cases the worker must take itself are checked to be its own; its threads get the worker's ids
back after every call; a stopping sandbox's files are the agent's again."""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from sandgate.agent.frames import Header
from sandgate.errors import SandgateError
from sandgate.worker.runtime.base import SandboxSpec
from sandgate.worker.runtime.bwrap import BwrapRuntime
from sandgate.worker.service import WorkerService
from sandgate.worker.state import LiveSandbox, WorkerLocalState

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap"),
]

# the same tree under /workspace/<side> and /tmp/<side> for both sides
SETUP = """
set -e
for top in /workspace/{side} /tmp/{side}; do
  mkdir -p $top/dir $top/ro $top/sub $top/nosearch/in
  printf n > $top/nosearch/in/f && chmod 0600 $top/nosearch
  printf hello > $top/small.txt
  printf 0123456789 > $top/ten.txt
  : > $top/empty.txt
  printf old > $top/readonly.txt && chmod 0444 $top/readonly.txt
  printf secret > $top/closed.txt && chmod 0000 $top/closed.txt
  printf f > $top/file.txt
  python3 -c "import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])" $top/sock
  ln -s /workspace/{side}/small.txt $top/link.txt
  ln -s /workspace/{side}/sub $top/linkdir
  ln -s /etc $top/out
  chmod 0555 $top/ro
done
"""

# (what it checks, op, fields with {side} in the path, payload, whether the worker answers)
CASES: list[tuple[str, str, dict[str, Any], bytes, bool]] = [
    ("a new file", "open_write", {"path": "/workspace/{side}/new.txt"}, b"abc\n", True),
    ("in /tmp", "open_write", {"path": "/tmp/{side}/new.bin"}, b"\x00\xff", True),
    ("relative", "open_write", {"path": "{side}/rel.txt"}, b"r", True),
    ("missing parents", "open_write", {"path": "/workspace/{side}/a/b/c.txt"}, b"deep", True),
    ("empty", "open_write", {"path": "/workspace/{side}/zero"}, b"", True),
    ("1 MiB", "open_write", {"path": "/workspace/{side}/big"}, os.urandom(1 << 20), True),
    ("overwrite", "open_write", {"path": "/workspace/{side}/small.txt"}, b"new", True),
    ("over read-only", "open_write", {"path": "/workspace/{side}/readonly.txt"}, b"x", True),
    ("dotted", "open_write", {"path": "/workspace/{side}/sub/../dir/./d.txt"}, b"d", True),
    ("onto a directory", "open_write", {"path": "/workspace/{side}/dir"}, b"x", True),
    ("no write permission", "open_write", {"path": "/workspace/{side}/ro/x"}, b"x", True),
    ("under a read-only dir", "open_write", {"path": "/workspace/{side}/ro/n/x"}, b"x", False),
    (
        "no search permission",
        "open_write",
        {"path": "/workspace/{side}/nosearch/in/x"},
        b"x",
        False,
    ),
    ("a name too long", "open_write", {"path": "/workspace/{side}/" + "L" * 256}, b"x", False),
    ("a parent is a file", "open_write", {"path": "/workspace/{side}/file.txt/x"}, b"x", False),
    ("through a symlink", "open_write", {"path": "/workspace/{side}/linkdir/x"}, b"x", False),
    ("onto a symlink", "open_write", {"path": "/workspace/{side}/link.txt"}, b"via", False),
    ("out by a symlink", "open_write", {"path": "/workspace/{side}/out/x"}, b"x", False),
    ("the root", "open_write", {"path": "/workspace"}, b"x", False),
    ("outside", "open_write", {"path": "/etc/{side}"}, b"x", False),
    ("no commit", "open_write", {"path": "/workspace/{side}/h", "commit": False}, b"", False),
    ("a file", "open_read", {"path": "/workspace/{side}/ten.txt", "first": 64}, b"", True),
    ("exactly first", "open_read", {"path": "/workspace/{side}/ten.txt", "first": 10}, b"", True),
    ("empty file", "open_read", {"path": "/workspace/{side}/empty.txt", "first": 8}, b"", True),
    ("in /tmp", "open_read", {"path": "/tmp/{side}/small.txt", "first": 8}, b"", True),
    ("missing", "open_read", {"path": "/workspace/{side}/nope", "first": 8}, b"", True),
    ("a directory", "open_read", {"path": "/workspace/{side}/dir", "first": 8}, b"", True),
    ("a socket", "open_read", {"path": "/workspace/{side}/sock", "first": 8}, b"", True),
    ("no search permission", "open_read", {"path": "{side}/nosearch/in/f", "first": 8}, b"", True),
    ("unreadable", "open_read", {"path": "/workspace/{side}/closed.txt", "first": 8}, b"", True),
    ("the root", "open_read", {"path": "/workspace", "first": 8}, b"", False),
    (
        "longer than first",
        "open_read",
        {"path": "/workspace/{side}/ten.txt", "first": 4},
        b"",
        False,
    ),
    ("a symlink", "open_read", {"path": "/workspace/{side}/link.txt", "first": 64}, b"", False),
    (
        "out by a symlink",
        "open_read",
        {"path": "/workspace/{side}/out/passwd", "first": 8},
        b"",
        False,
    ),
    ("under a file", "open_read", {"path": "/workspace/{side}/file.txt/x", "first": 8}, b"", False),
    (
        "first too large",
        "open_read",
        {"path": "/workspace/{side}/ten.txt", "first": 1 << 30},
        b"",
        False,
    ),
]

_libc = ctypes.CDLL(None, use_errno=True)
TEMP = re.compile(r"\.[^/]*\.sandgate-[0-9a-f]{12}")


def _effective(status: str) -> int:
    """The effective capabilities in a /proc status file."""
    with open(status) as f:
        found = re.search(r"CapEff:\s*([0-9a-f]+)", f.read())
    assert found is not None
    return int(found[1], 16)


def _filled(op: str, fields: dict[str, Any], side: str) -> dict[str, Any]:
    """The call as the control plane makes it (a whole file's write commits at once)."""
    filled = {k: v.format(side=side) if isinstance(v, str) else v for k, v in fields.items()}
    return {"commit": True, **filled} if op == "open_write" else filled


def _plain(side: str, answer: tuple[Header, bytes] | SandgateError) -> object:
    """An answer with the side's name, the times and an upload's temp name taken out."""
    if isinstance(answer, SandgateError):
        message = TEMP.sub("TEMP", answer.message.replace(side, "SIDE"))
        return ("error", answer.code, message)
    header, body = answer
    header = {k: v for k, v in header.items() if k not in ("id", "ok")}  # the relay drops these
    if isinstance(header.get("handle"), int):
        header["handle"] = "HANDLE"  # each side's agent numbers its own
    text = repr(header).replace(side, "SIDE")
    entry = header.get("entry")
    if isinstance(entry, dict):
        text = text.replace(repr(entry["mtime"]), "MTIME")
    return (text, body)


async def _outcome(
    call: Callable[..., Awaitable[tuple[Header, bytes] | None]], *args: Any
) -> tuple[Header, bytes] | SandgateError | None:
    try:
        return await call(*args)
    except SandgateError as exc:
        return exc


def test_the_worker_answers_whole_files_as_the_agent_does(runtime: BwrapRuntime) -> None:
    service = WorkerService(runtime, capacity=4, state=WorkerLocalState())

    async def sh(live: LiveSandbox, code: str) -> str:
        reply, out = await live.link.channel.request(
            "exec", {"language": "sh", "timeout": 30}, code.encode()
        )
        assert reply["exit_code"] == 0, (code, reply, out)
        return out[: reply["stdout_bytes"]].decode()

    async def body() -> None:
        await service.provision(SandboxSpec(name="files-twin", disk_mb=64))
        live = service.state.sandboxes["files-twin"]
        files = live.running.files
        assert files is not None
        for side in ("side-w", "side-a"):
            await sh(live, SETUP.format(side=side))
        mismatches, taken = [], []
        for what, op, fields, payload, worker_answers in CASES:
            mine = _filled(op, fields, "side-w")
            served = await _outcome(files.serve, op, mine, payload)
            if served is None:
                served = await _outcome(live.link.channel.request, op, mine, payload)
            else:
                taken.append(what)
            theirs = _filled(op, fields, "side-a")
            agent = await _outcome(live.link.channel.request, op, theirs, payload)
            assert served is not None and agent is not None
            if _plain("side-w", served) != _plain("side-a", agent):
                mismatches.append((what, op, served, agent))
            assert (what in taken) == worker_answers, (what, op, served)
        assert mismatches == []
        # what the writes left: owner, group, mode and content alike, inside the sandbox
        listing = (
            "chmod 0700 /workspace/{side}/nosearch /tmp/{side}/nosearch && cd /workspace/{side}"
            " && find . /tmp/{side} | sort | xargs stat -c '%n %u %g %a %s %F'"
            " && sha256sum big new.txt rel.txt small.txt readonly.txt a/b/c.txt dir/d.txt"
        )
        worker_view = await sh(live, listing.format(side="side-w"))
        agent_view = await sh(live, listing.format(side="side-a"))
        # (the uncommitted write's temp file is there on both sides, each under its own name)
        assert TEMP.sub("TEMP", worker_view.replace("side-w", "SIDE")) == TEMP.sub(
            "TEMP", agent_view.replace("side-a", "SIDE")
        )
        assert " 1000 1000 644 " in worker_view  # the sandbox's own files, not the worker's

        # both file threads have the worker's own ids, groups none, capabilities all back
        def ids() -> tuple[int, int, list[int], int]:
            time.sleep(0.2)  # so that the two calls are on the two threads
            fsuid, fsgid = _libc.setfsuid(0xFFFFFFFF), _libc.setfsgid(0xFFFFFFFF)
            return fsuid, fsgid, os.getgroups(), _effective("/proc/thread-self/status")

        threads = runtime._file_threads
        assert threads is not None
        seen = await asyncio.gather(threads.run(ids, wait=10), threads.run(ids, wait=10))
        full = _effective("/proc/self/status")
        assert list(seen) == [(0, 0, [], full)] * 2, seen
        # a third call while both are busy is not queued: the agent takes it
        busy = [asyncio.ensure_future(threads.run(ids, wait=10)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert await files.serve("open_read", {"path": "side-w/ten.txt", "first": 64}, b"") is None
        await asyncio.gather(*busy)

        files.close()  # as a stop does first: from now on the agent answers
        write = {"path": "/workspace/side-w/late.txt", "commit": True}
        assert await files.serve("open_write", write, b"late") is None
        await service.destroy("files-twin")

    async def main() -> None:
        await runtime.prepare()
        await service.run(body)

    asyncio.run(main())


def test_a_full_disk_is_storage_full_from_the_worker_too(runtime: BwrapRuntime) -> None:
    service = WorkerService(runtime, capacity=4, state=WorkerLocalState())

    async def body() -> None:
        await service.provision(SandboxSpec(name="files-full", disk_mb=16))
        live = service.state.sandboxes["files-full"]
        assert live.running.files is not None
        fill = {"language": "sh", "timeout": 30}
        reply, _ = await live.link.channel.request(
            "exec", fill, b"head -c 40000000 /dev/zero > /workspace/fill 2>/dev/null; true"
        )
        assert reply["exit_code"] == 0
        call = {"path": "/workspace/more.bin", "commit": True}
        with pytest.raises(SandgateError) as raised:  # the worker's own answer
            await live.running.files.serve("open_write", call, os.urandom(1 << 20))
        assert raised.value.code == "storage_full"
        relay = {"op": "agent", "sandbox": "files-full", "call": {"op": "open_write", **call}}
        with pytest.raises(SandgateError) as raised:  # as the control plane gets it
            await service.handle(relay, os.urandom(1 << 20))
        assert raised.value.code == "disk_quota_exceeded"
        assert "disk_mb" in raised.value.message  # the worker's words for the quota
        listing, _ = await live.link.channel.request("list", {"path": "/workspace"}, b"")
        assert [e["name"] for e in listing["entries"]] == ["fill"]  # no temp file left
        await service.destroy("files-full")

    async def main() -> None:
        await runtime.prepare()
        await service.run(body)

    asyncio.run(main())
