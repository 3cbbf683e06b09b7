"""envd's `filesystem.Filesystem` Connect service over the toolbox's file operations.

Paths are E2B's: relative ones are below the home directory, and `/home/user` is the
sandbox's `/workspace` (api.e2b.caller.sandbox_path). `ListDir` with a depth walks
directories level by level, one toolbox call per directory. Watches are the agent's
(inotify): `WatchDir` streams its events; `CreateWatcher` / `GetWatcherEvents` /
`RemoveWatcher` (what the sync SDK polls) keep their cursor in the agent, so any instance can
serve the next poll.
"""

from __future__ import annotations

import contextlib
import stat
from collections.abc import AsyncIterator
from types import MappingProxyType
from typing import Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof
from protobuf.wkt import Timestamp

from sandgate.api.e2b.caller import (
    EnvdCaller,
    OnToolbox,
    as_connect,
    caller,
    sandbox_path,
)
from sandgate.api.e2b.envd_pb.filesystem import filesystem_connect
from sandgate.api.e2b.envd_pb.filesystem import filesystem_pb as pb
from sandgate.control.replies import Entry
from sandgate.control.toolbox import WatchEvent
from sandgate.errors import SandgateError

MAX_DEPTH = 16  # ListDir: deeper asks are cut here
MAX_ENTRIES = 100_000  # ListDir: entries in one answer
KEEPALIVE_SECONDS = 25.0
TYPES = MappingProxyType(
    {
        "file": pb.FileType.FILE,
        "dir": pb.FileType.DIRECTORY,
        "symlink": pb.FileType.SYMLINK,
    }
)
EVENTS = MappingProxyType(
    {
        "create": pb.EventType.CREATE,
        "write": pb.EventType.WRITE,
        "remove": pb.EventType.REMOVE,
        "rename": pb.EventType.RENAME,
        "chmod": pb.EventType.CHMOD,
    }
)


def entry_info(entry: Entry) -> pb.EntryInfo:
    mode = int(entry.mode, 8)
    kind = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK}.get(entry.type, 0)
    return pb.EntryInfo(
        name=entry.name,
        type=TYPES.get(entry.type, pb.FileType.UNSPECIFIED),
        path=entry.path,
        size=entry.size,
        mode=mode,
        permissions=stat.filemode(kind | mode),
        owner="user",
        group="user",
        modified_time=Timestamp.from_datetime(entry.mtime),
        is_symlink=entry.type == "symlink",
    )


def _path(raw: str) -> str:
    if not raw:
        raise ConnectError(Code.INVALID_ARGUMENT, "path is required")
    return sandbox_path(raw)


class FilesystemService(OnToolbox, filesystem_connect.Filesystem):
    """The `filesystem.Filesystem` service (its protocol: `filesystem_connect.Filesystem`)."""

    async def stat(
        self, request: pb.StatRequest, ctx: RequestContext[pb.StatRequest, pb.StatResponse]
    ) -> pb.StatResponse:
        who = caller()
        with as_connect(who.sandbox):
            entry = await self.toolbox.stat(who.tenant, who.sandbox, _path(request.path))
        return pb.StatResponse(entry=entry_info(entry))

    async def make_dir(
        self,
        request: pb.MakeDirRequest,
        ctx: RequestContext[pb.MakeDirRequest, pb.MakeDirResponse],
    ) -> pb.MakeDirResponse:
        who = caller()
        path = _path(request.path)
        with as_connect(who.sandbox):
            entry = await self.toolbox.mkdir(
                who.tenant, who.sandbox, path, parents=True, exist_ok=False
            )
        return pb.MakeDirResponse(entry=entry_info(entry))

    async def move(
        self, request: pb.MoveRequest, ctx: RequestContext[pb.MoveRequest, pb.MoveResponse]
    ) -> pb.MoveResponse:
        who = caller()
        source, destination = _path(request.source), _path(request.destination)
        with as_connect(who.sandbox):
            entry = await self.toolbox.move(
                who.tenant, who.sandbox, source, destination, overwrite=True
            )
        return pb.MoveResponse(entry=entry_info(entry))

    async def remove(
        self, request: pb.RemoveRequest, ctx: RequestContext[pb.RemoveRequest, pb.RemoveResponse]
    ) -> pb.RemoveResponse:
        who = caller()
        with as_connect(who.sandbox):
            await self.toolbox.remove(who.tenant, who.sandbox, _path(request.path), recursive=True)
        return pb.RemoveResponse()

    async def list_dir(
        self,
        request: pb.ListDirRequest,
        ctx: RequestContext[pb.ListDirRequest, pb.ListDirResponse],
    ) -> pb.ListDirResponse:
        who = caller()
        depth = min(max(request.depth, 1), MAX_DEPTH)
        found: list[pb.EntryInfo] = []
        level = [_path(request.path)]
        with as_connect(who.sandbox):
            for _ in range(depth):
                below: list[str] = []
                for directory in level:
                    for entry in await self.toolbox.list_dir(who.tenant, who.sandbox, directory):
                        found.append(entry_info(entry))
                        if entry.type == "dir":
                            below.append(entry.path)
                if len(found) > MAX_ENTRIES:
                    raise ConnectError(
                        Code.RESOURCE_EXHAUSTED,
                        f"more than {MAX_ENTRIES} entries: list with a smaller depth",
                    )
                level = below
                if not level:
                    break
        return pb.ListDirResponse(entries=found)

    # -- watches ----------------------------------------------------------------------------
    async def watch_dir(
        self,
        request: pb.WatchDirRequest,
        ctx: RequestContext[pb.WatchDirRequest, pb.WatchDirResponse],
    ) -> AsyncIterator[pb.WatchDirResponse]:
        who = caller()
        path = _path(request.path)
        with as_connect(who.sandbox):
            watch_id = await self.toolbox.watch_start(
                who.tenant, who.sandbox, path, recursive=request.recursive
            )
        try:
            started: Oneof[Literal["start"], pb.WatchDirResponse.StartEvent]
            started = Oneof("start", pb.WatchDirResponse.StartEvent())
            yield pb.WatchDirResponse(event=started)
            offset = 0
            while True:
                with as_connect(who.sandbox):
                    page = await self.toolbox.watch_read(
                        who.tenant, who.sandbox, watch_id, offset, wait=KEEPALIVE_SECONDS
                    )
                for event in page.events:
                    happened: Oneof[Literal["filesystem"], pb.FilesystemEvent]
                    happened = Oneof(
                        "filesystem", await self._event(who, event, request.include_entry)
                    )
                    yield pb.WatchDirResponse(event=happened)
                offset = page.next_offset
                if page.ended:
                    return
                if not page.events:
                    keepalive: Oneof[Literal["keepalive"], pb.WatchDirResponse.KeepAlive]
                    keepalive = Oneof("keepalive", pb.WatchDirResponse.KeepAlive())
                    yield pb.WatchDirResponse(event=keepalive)
        finally:
            await self._stop_quietly(who, watch_id)

    async def _event(
        self, who: EnvdCaller, event: WatchEvent, include_entry: bool
    ) -> pb.FilesystemEvent:
        message = pb.FilesystemEvent(
            name=event.name, type=EVENTS.get(event.type, pb.EventType.UNSPECIFIED)
        )
        if include_entry and event.type not in ("remove", "rename"):
            with contextlib.suppress(SandgateError):  # gone again since
                message.entry = entry_info(
                    await self.toolbox.stat(who.tenant, who.sandbox, event.path)
                )
        return message

    async def _stop_quietly(self, who: EnvdCaller, watch_id: str) -> None:
        with contextlib.suppress(SandgateError):
            await self.toolbox.watch_stop(who.tenant, who.sandbox, watch_id)

    async def create_watcher(
        self,
        request: pb.CreateWatcherRequest,
        ctx: RequestContext[pb.CreateWatcherRequest, pb.CreateWatcherResponse],
    ) -> pb.CreateWatcherResponse:
        who = caller()
        with as_connect(who.sandbox):
            watch_id = await self.toolbox.watch_start(
                who.tenant, who.sandbox, _path(request.path), recursive=request.recursive
            )
        return pb.CreateWatcherResponse(watcher_id=watch_id)

    async def get_watcher_events(
        self,
        request: pb.GetWatcherEventsRequest,
        ctx: RequestContext[pb.GetWatcherEventsRequest, pb.GetWatcherEventsResponse],
    ) -> pb.GetWatcherEventsResponse:
        who = caller()
        with as_connect(who.sandbox):
            page = await self.toolbox.watch_read(
                who.tenant, who.sandbox, request.watcher_id, None, wait=0.0
            )
            events = [await self._event(who, event, False) for event in page.events]
        return pb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(
        self,
        request: pb.RemoveWatcherRequest,
        ctx: RequestContext[pb.RemoveWatcherRequest, pb.RemoveWatcherResponse],
    ) -> pb.RemoveWatcherResponse:
        who = caller()
        with as_connect(who.sandbox):
            await self.toolbox.watch_stop(who.tenant, who.sandbox, request.watcher_id)
        return pb.RemoveWatcherResponse()
