"""Directory watches through the seam: `Toolbox.watch_*` onto the agent's inotify watchers
(agent/watch.py), with the real app, worker service and agent (see conftest)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from sandgate.control.toolbox import Toolbox, WatchPage
from sandgate.errors import (
    ConflictError,
    LimitExceededError,
    NotFoundError,
    PathOutsideSandboxError,
)
from sandgate.store.base import TenantId
from tests.fast.conftest import Fast, until

pytestmark = pytest.mark.anyio

Event = tuple[str, str]  # (type, name)


@dataclass
class Box:
    toolbox: Toolbox
    tenant: TenantId
    name: str

    async def run(self, command: str, cwd: str = "/workspace") -> None:
        """Under the process runtime a command sees host paths: it uses relative ones."""
        ran = await self.toolbox.execute(self.tenant, self.name, command, time_limit=10, cwd=cwd)
        assert ran.exit_code == 0, ran.stderr

    async def start(self, path: str, *, recursive: bool = False) -> str:
        return await self.toolbox.watch_start(self.tenant, self.name, path, recursive=recursive)

    async def read(self, watch: str, offset: int | None = None, wait: float = 0.0) -> WatchPage:
        return await self.toolbox.watch_read(self.tenant, self.name, watch, offset, wait=wait)

    async def until(
        self, watch: str, done: Callable[[list[Event]], bool], within: float = 10.0
    ) -> list[Event]:
        """Cursor reads (long-polling) until ``done`` holds for what arrived, or the end."""
        events: list[Event] = []
        async with asyncio.timeout(within):
            while not done(events):
                page = await self.read(watch, wait=1.0)
                events += [(e.type, e.name) for e in page.events]
                if page.ended:
                    break
        return events


@pytest.fixture
async def box(fast: Fast) -> AsyncIterator[Box]:
    created = await fast.api.post("/api/v1/sandboxes", json={})
    assert created.status_code == 201, created.text
    tenant = (await fast.services.store.ensure_tenant("alpha")).id
    yield Box(fast.services.toolbox, tenant, created.json()["name"])


def merged(events: list[Event]) -> list[Event]:
    """Consecutive equal events as one: the kernel merges them only while none was read."""
    return [event for event, _ in itertools.groupby(events)]


async def test_changes_arrive_in_order_with_their_types(box: Box) -> None:
    await box.toolbox.mkdir(box.tenant, box.name, "/workspace/w", parents=True)
    watch = await box.start("/workspace/w")
    assert isinstance(watch, str) and watch
    await box.run("cd w && echo hi > a.txt && chmod 600 a.txt && mv a.txt b.txt && rm b.txt")
    events = await box.until(watch, lambda got: ("remove", "b.txt") in got)
    assert merged(events) == [
        ("create", "a.txt"),
        ("write", "a.txt"),
        ("chmod", "a.txt"),
        ("rename", "a.txt"),
        ("create", "b.txt"),
        ("remove", "b.txt"),
    ]
    page = await box.read(watch, offset=0)  # an offset reader sees everything again
    assert [e.path for e in page.events][:2] == ["/workspace/w/a.txt"] * 2
    assert page.first_offset == 0 and page.dropped == 0 and not page.ended


async def test_toolbox_file_operations_are_seen(box: Box) -> None:
    watch = await box.start("/workspace")

    async def data() -> AsyncIterator[bytes]:
        yield b"payload"

    tb, tenant, name = box.toolbox, box.tenant, box.name
    await tb.upload(tenant, name, "/workspace/up.txt", data(), chunk_bytes=4, max_bytes=100)
    await tb.move(tenant, name, "/workspace/up.txt", "/workspace/moved.txt", overwrite=False)
    await tb.remove(tenant, name, "/workspace/moved.txt", recursive=False)
    events = await box.until(watch, lambda got: ("remove", "moved.txt") in got)
    # the upload writes a temp file beside the target and renames it onto the target: the
    # watch reports the file when it appears, never the upload's temp file
    assert events == [
        ("create", "up.txt"),
        ("rename", "up.txt"),
        ("create", "moved.txt"),
        ("remove", "moved.txt"),
    ]


async def test_a_recursive_watch_sees_new_subdirectories(box: Box) -> None:
    await box.run("mkdir -p r/old")
    deep = await box.start("/workspace/r", recursive=True)
    flat = await box.start("/workspace/r")
    await box.run("cd r && echo x > old/o.txt && mkdir -p sub/deep && echo y > sub/deep/c.txt")
    events = await box.until(deep, lambda got: ("create", "sub/deep/c.txt") in got)
    # c.txt may be written before sub/deep is watched: then its write is not seen
    assert [e for e in merged(events) if e != ("write", "sub/deep/c.txt")] == [
        ("create", "old/o.txt"),
        ("write", "old/o.txt"),
        ("create", "sub"),
        ("create", "sub/deep"),
        ("create", "sub/deep/c.txt"),
    ]
    await box.run("echo z >> r/sub/deep/c.txt && rm -r r/sub")
    events = await box.until(deep, lambda got: ("remove", "sub") in got)
    assert merged(events) == [
        ("write", "sub/deep/c.txt"),
        ("remove", "sub/deep/c.txt"),
        ("remove", "sub/deep"),
        ("remove", "sub"),
    ]
    page = await box.read(deep, offset=0)
    assert page.events[-1].path == "/workspace/r/sub" and page.events[-1].type == "remove"
    assert "/workspace/r/sub/deep/c.txt" in {e.path for e in page.events}
    # without recursive: the directory's own entries only
    assert await box.until(flat, lambda got: len(got) >= 2) == [
        ("create", "sub"),
        ("remove", "sub"),
    ]
    assert (await box.read(flat, wait=0.3)).events == []


async def test_cursor_reads_deliver_each_event_once(box: Box) -> None:
    watch = await box.start("/tmp")
    await box.run("for i in 1 2 3 4 5; do : > f$i; done", cwd="/tmp")
    events = await box.until(watch, lambda got: len(got) >= 5)
    assert events == [("create", f"f{i}") for i in range(1, 6)]
    again = await box.read(watch, wait=0.2)
    assert again.events == [] and again.next_offset == 5
    await box.run(": > f6", cwd="/tmp")
    assert await box.until(watch, lambda got: bool(got)) == [("create", "f6")]
    assert [e.name for e in (await box.read(watch, offset=4)).events] == ["f5", "f6"]


async def test_a_long_poll_wakes_on_the_event_and_blocks_nothing(box: Box) -> None:
    watch = await box.start("/workspace")
    waiting = asyncio.ensure_future(box.read(watch, wait=20.0))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    async with asyncio.timeout(5):  # other requests still run while the read waits
        await box.run("echo now > late.txt")
        page = await waiting
    assert [(e.type, e.name) for e in page.events][:1] == [("create", "late.txt")]


async def test_a_watch_ends_with_its_directory(box: Box) -> None:
    await box.run("mkdir -p gone && : > gone/x")
    watch = await box.start("/workspace/gone")
    await box.toolbox.remove(box.tenant, box.name, "/workspace/gone", recursive=True)
    events = await box.until(watch, lambda got: False)  # to the end
    assert events == [("remove", "x")]
    page = await box.read(watch, wait=5.0)  # answers at once: nothing more will come
    assert page.ended and page.events == []


async def test_stop_then_read_is_not_found(box: Box) -> None:
    watch = await box.start("/workspace")
    await box.toolbox.watch_stop(box.tenant, box.name, watch)
    with pytest.raises(NotFoundError):
        await box.read(watch)
    with pytest.raises(NotFoundError):
        await box.toolbox.watch_stop(box.tenant, box.name, watch)
    with pytest.raises(NotFoundError):
        await box.read("w999")


async def test_a_path_must_be_an_existing_directory_in_the_sandbox(box: Box) -> None:
    with pytest.raises(NotFoundError) as missing:
        await box.start("/workspace/nope")
    assert missing.value.code == "not_found" and "/workspace/nope" in missing.value.message
    await box.run("echo x > file.txt")
    with pytest.raises(ConflictError) as file:
        await box.start("/workspace/file.txt")
    assert file.value.code == "not_a_directory"
    with pytest.raises(PathOutsideSandboxError):
        await box.start("/etc")


async def test_at_most_64_watches(box: Box) -> None:
    watches = [await box.start("/workspace") for _ in range(64)]
    assert len(set(watches)) == 64
    try:
        with pytest.raises(LimitExceededError) as refused:
            await box.start("/workspace")
        assert refused.value.code == "limit_exceeded"
    finally:
        for watch in watches:
            await box.toolbox.watch_stop(box.tenant, box.name, watch)
    await box.toolbox.watch_stop(box.tenant, box.name, await box.start("/workspace"))


async def test_the_buffer_keeps_the_latest_events(box: Box) -> None:
    """At most MAX_EVENTS (10,000) are kept: an offset reader learns how many it missed; an
    answer holds at most 512 KiB of events, the rest comes with the next read."""
    await box.run("mkdir many")
    watch = await box.start("/workspace/many")
    await box.run("cd many && for i in $(seq 10050); do : > f$i; done", cwd="/workspace")

    pages: list[WatchPage] = []

    async def settled() -> bool:  # the watcher's thread read every event
        pages.append(await box.read(watch, offset=0))
        return pages[-1].first_offset >= 50

    await until(settled)
    page = pages[-1]
    assert (page.first_offset, page.dropped) == (50, 50)
    assert page.events[0].name == "f51"
    names = [e.name for e in page.events]
    answers = 1
    while len(names) < 10_000:
        page = await box.read(watch, offset=page.next_offset)
        assert page.events and page.dropped == 0
        names += [e.name for e in page.events]
        answers += 1
    assert answers > 1
    assert names == [f"f{i}" for i in range(51, 10051)] and page.next_offset == 10_050
