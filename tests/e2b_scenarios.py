"""What E2B's official Python SDK (PyPI `e2b`, pinned in pyproject) does against sandgate.

Plain functions over a `Sandbox` or its connection settings, shared by the single-instance
tests (tests/integration/api/test_e2b_sdk.py) and the two-instance one (tests/e2e), where the
same calls go through an instance that does not hold the worker's tunnel. The SDK is used
unmodified: only its documented settings (api_key, api_url, sandbox_url) point it here.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from e2b import (
    AsyncSandbox,
    CommandExitException,
    FilesystemEventType,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxQuery,
    TimeoutException,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry


@dataclass(frozen=True)
class E2B:
    """Where the SDK goes: sandgate's URL for both its REST API and every sandbox's envd."""

    api_key: str
    url: str

    def options(self) -> dict[str, Any]:
        return {"api_key": self.api_key, "api_url": self.url, "sandbox_url": self.url}

    def create(self, **kw: Any) -> Sandbox:
        return Sandbox.create(**self.options(), **kw)

    async def create_async(self, **kw: Any) -> AsyncSandbox:
        return await AsyncSandbox.create(**self.options(), **kw)


def commands(sbx: Sandbox) -> None:
    ran = sbx.commands.run("echo hi; echo oops >&2")
    assert (ran.stdout, ran.stderr, ran.exit_code) == ("hi\n", "oops\n", 0)
    try:
        sbx.commands.run("echo partial; exit 3")
    except CommandExitException as exc:
        assert exc.exit_code == 3 and exc.stdout == "partial\n"
    else:
        raise AssertionError("a failing command must raise CommandExitException")
    ran = sbx.commands.run("echo $GREETING-$SANDBOX_WIDE", envs={"GREETING": "hello"})
    assert ran.stdout == "hello-yes\n", ran.stdout
    sbx.files.make_dir("/home/user/sub")
    # (paths inside commands are the runtime's: /workspace under bwrap, a host directory
    # under the process runtime the multi-instance tests use)
    assert sbx.commands.run("pwd", cwd="/home/user/sub").stdout.endswith("/sub\n")
    assert sbx.commands.run("pwd", cwd="sub").stdout.endswith("/sub\n")
    assert sbx.commands.run("id -u", user="user").exit_code == 0
    # stdin is end-of-file unless asked for: cat returns at once
    assert sbx.commands.run("cat; echo done").stdout == "done\n"
    started = time.monotonic()
    try:
        sbx.commands.run("sleep 31.7", timeout=1)
    except TimeoutException:
        pass
    else:
        raise AssertionError("a command past its timeout must raise TimeoutException")
    assert time.monotonic() - started < 15
    # killed once the client gave up: the server sees the stream go and kills the process,
    # a moment after (polled for a few seconds: on a loaded machine that moment is not zero);
    # the pattern does not match its own command line ([.] is not a literal "[.]")
    check = (
        "for i in $(seq 50); do pgrep -f 'sleep 31[.]7' >/dev/null || { echo none; exit; }; "
        "sleep 0.1; done"
    )
    gone = sbx.commands.run(check, timeout=10)
    assert gone.stdout.strip() == "none", "the timed-out command must have been killed"


def background(sbx: Sandbox) -> None:
    seen: list[str] = []
    handle = sbx.commands.run("for i in 1 2 3; do echo tick $i; sleep 0.3; done", background=True)
    result = handle.wait(on_stdout=seen.append)
    assert result.exit_code == 0 and "".join(seen) == "tick 1\ntick 2\ntick 3\n"

    # a long one: listed, followed from a second handle, then killed
    long = sbx.commands.run(
        "i=0; while true; do i=$((i+1)); echo n$i; sleep 0.2; done", background=True
    )
    pids = [p.pid for p in sbx.commands.list()]
    assert long.pid in pids
    listed = next(p for p in sbx.commands.list() if p.pid == long.pid)
    assert listed.cmd == "/bin/bash" and listed.args[-1].startswith("i=0")
    follower = sbx.commands.connect(long.pid)
    got: list[str] = []

    def follow() -> None:
        try:
            follower.wait(on_stdout=got.append)
        except CommandExitException:
            pass

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    deadline = time.monotonic() + 10
    while not any("n" in line for line in got) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got, "connect must stream the running command's new output"
    assert sbx.commands.kill(long.pid) is True
    reader.join(10)
    assert not reader.is_alive()
    assert long.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(long.pid) is False  # no such process any more

    # stdin
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "from stdin\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "from stdin\n"


def pty(sbx: Sandbox) -> None:
    before, after = bytearray(), bytearray()
    terminal = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(terminal.pid, b"stty size; echo mark-$((6*7))\n")
    resized = False
    for _, _, data in terminal:
        (after if resized else before).extend(data or b"")
        if not resized and b"mark-42" in before:
            # resized only once the first size is printed (a resize sent at once can reach
            # the terminal before the shell runs the first stty)
            assert b"24 80" in before, before
            sbx.pty.resize(terminal.pid, PtySize(rows=40, cols=120))
            sbx.pty.send_stdin(terminal.pid, b"stty size; echo mark-$((7*7))\n")
            resized = True
        if resized and b"mark-49" in after:
            break
    assert b"40 120" in after, after
    assert terminal.kill() is True


def files(sbx: Sandbox) -> None:
    info = sbx.files.write("/home/user/notes/a.txt", "hello files")
    assert info.path == "/workspace/notes/a.txt"
    assert sbx.files.read("/home/user/notes/a.txt") == "hello files"
    blob = os.urandom(10 << 20)
    sbx.files.write("big.bin", blob)
    assert sbx.files.read("big.bin", format="bytes") == blob
    written = sbx.files.write_files(
        [
            WriteEntry(path="/home/user/many/one.txt", data="1"),
            WriteEntry(path="/home/user/many/deep/two.txt", data=b"22"),
        ]
    )
    assert sorted(w.path for w in written) == [
        "/workspace/many/deep/two.txt",
        "/workspace/many/one.txt",
    ]
    shallow = {e.name: e for e in sbx.files.list("/home/user/many")}
    assert set(shallow) == {"one.txt", "deep"}
    assert shallow["deep"].type == FileType.DIR and shallow["one.txt"].size == 1
    deep = {e.path for e in sbx.files.list("/home/user/many", depth=2)}
    assert "/workspace/many/deep/two.txt" in deep
    assert sbx.files.exists("/home/user/many/one.txt")
    assert not sbx.files.exists("/home/user/nothing-here")
    assert sbx.files.make_dir("/home/user/made/inner") is True
    assert sbx.files.make_dir("/home/user/made/inner") is False  # already there
    moved = sbx.files.rename("/home/user/many/one.txt", "/home/user/made/uno.txt")
    assert moved.path == "/workspace/made/uno.txt"
    assert sbx.files.read("/home/user/made/uno.txt") == "1"
    sbx.files.remove("/home/user/many")
    assert not sbx.files.exists("/home/user/many")
    assert sbx.files.get_info("/home/user/made").type == FileType.DIR


def watch(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/watched")
    handle = sbx.files.watch_dir("/home/user/watched")
    try:
        sbx.files.write("/home/user/watched/new.txt", "x")
        sbx.commands.run("echo more >> watched/new.txt")
        sbx.files.remove("/home/user/watched/new.txt")
        kinds: set[FilesystemEventType] = set()
        deadline = time.monotonic() + 10
        while (
            time.monotonic() < deadline
            and not {
                FilesystemEventType.CREATE,
                FilesystemEventType.REMOVE,
            }
            <= kinds
        ):
            for event in handle.get_new_events():
                assert event.name.endswith("new.txt"), event
                kinds.add(event.type)
            time.sleep(0.1)
        assert FilesystemEventType.CREATE in kinds and FilesystemEventType.REMOVE in kinds
        assert FilesystemEventType.WRITE in kinds
    finally:
        handle.stop()


def lifecycle(e2b: E2B, sbx: Sandbox) -> None:
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id and info.template_id == "base"
    before = info.end_at
    sbx.set_timeout(1200)
    assert sbx.get_info().end_at > before
    other = Sandbox.connect(sbx.sandbox_id, **e2b.options())
    assert other.commands.run("echo from-second").stdout == "from-second\n"
    assert other.is_running()
    metrics = sbx.get_metrics()
    assert metrics and metrics[-1].mem_total > 0 and metrics[-1].disk_total > 0
    # what sandgate does not do yet says so, and is not taken for a missing sandbox
    try:
        sbx.pause()
    except SandboxException as exc:
        assert not isinstance(exc, NotFoundException)
        assert "does not support pausing a sandbox (pause/resume) yet" in str(exc)
        assert str(exc).rstrip(".").endswith("kill it and create a new one instead"), exc
    else:
        raise AssertionError("pause must be refused: sandgate cannot pause sandboxes yet")
    assert sbx.is_running()


def listing(e2b: E2B) -> None:
    tag = uuid.uuid4().hex[:8]
    made = [e2b.create(metadata={"suite": tag, "n": str(i)}) for i in range(3)]
    try:
        paginator = Sandbox.list(
            query=SandboxQuery(metadata={"suite": tag}), limit=2, **e2b.options()
        )
        first = paginator.next_items()
        assert len(first) == 2 and paginator.has_next
        second = paginator.next_items()
        assert len(second) == 1 and not paginator.has_next
        assert {s.sandbox_id for s in first + second} == {s.sandbox_id for s in made}
        one = Sandbox.list(query=SandboxQuery(metadata={"suite": tag, "n": "1"}), **e2b.options())
        assert [s.sandbox_id for s in one.next_items()] == [made[1].sandbox_id]
    finally:
        for sandbox in made:
            sandbox.kill()


def idempotent_create(e2b: E2B) -> None:
    key = "e2b-" + uuid.uuid4().hex
    first = e2b.create(idempotency_key=key, metadata={"k": "v"})
    again = e2b.create(idempotency_key=key, metadata={"k": "v"})
    assert again.sandbox_id == first.sandbox_id
    first.kill()


async def async_scenario(e2b: E2B) -> None:
    sbx = await e2b.create_async(envs={"SANDBOX_WIDE": "yes"})
    try:
        ran = await sbx.commands.run("echo async-$SANDBOX_WIDE")
        assert ran.stdout == "async-yes\n"
        seen: list[str] = []
        handle = await sbx.commands.run(
            "for i in 1 2; do echo a$i; sleep 0.2; done", background=True, on_stdout=seen.append
        )
        await handle.wait()
        assert "".join(seen) == "a1\na2\n"
        cat = await sbx.commands.run("cat", background=True, stdin=True)
        await sbx.commands.send_stdin(cat.pid, "typed\n")
        await sbx.commands.close_stdin(cat.pid)
        assert (await cat.wait()).stdout == "typed\n"
        await sbx.files.write("/home/user/async.txt", "async data")
        assert await sbx.files.read("/home/user/async.txt") == "async data"
        names = [e.name for e in await sbx.files.list("/home/user")]
        assert "async.txt" in names
        events: list[Any] = []
        watcher = await sbx.files.watch_dir("/home/user", on_event=events.append)
        await sbx.files.write("/home/user/watched-async.txt", "w")
        for _ in range(100):
            if any(e.name == "watched-async.txt" for e in events):
                break
            await asyncio.sleep(0.05)
        await watcher.stop()  # type: ignore[no-untyped-call]  # untyped in the SDK
        assert any(e.name == "watched-async.txt" for e in events), events
        out = bytearray()
        got = asyncio.Event()

        def on_data(data: bytes) -> None:
            out.extend(data)
            if b"async-pty-7" in out:
                got.set()

        terminal = await sbx.pty.create(PtySize(rows=24, cols=80), on_data=on_data)
        await sbx.pty.send_stdin(terminal.pid, b"echo async-pty-$((3+4))\n")
        await asyncio.wait_for(got.wait(), 10)
        await sbx.pty.resize(terminal.pid, PtySize(rows=30, cols=90))
        assert await terminal.kill()
        info = await sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        await sbx.set_timeout(600)
        assert await sbx.get_metrics()
    finally:
        await sbx.kill()
    assert not await sbx.is_running()
