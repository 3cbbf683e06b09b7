"""Workspaces on a worker host: their storage under the deployment's workspace root, mounted
while something uses them, handed to sandboxes through idmapped binds, and their git history.

Layout, under `--workspace-root` (shared by the workers of a deployment; see
docs/decisions/0010-workspaces.md for what the file system must guarantee):

    <root>/<id>/workspace.json  owner, quota, created: written last, so its presence means
                                the workspace is complete; the owner is checked on every use
    <root>/<id>/disk.img        ext4 image of exactly quota_mb (the kernel enforces the quota,
                                history included: `worker/disk.py`)
    <root>/<id>/lock            flock'd by the one worker that has the image mounted

The image, mounted at `<state>/workspace-mounts/<id>` only while a sandbox or a git
operation uses it, holds `files/` (what sandboxes see) and `git/` (its history, never bound
into a sandbox: a tenant can plant neither hooks nor config). Both belong to STORAGE_UID, the
same on every worker, which no sandbox runs as; a sandbox sees the files as its own through
an idmapped bind (`idmap.py`), and git runs as STORAGE_UID (`git_history.py`).

An image is mounted again only through the loop device of its last mount while that device
still backs it: an unmounted file system can live on, held by a copy of this worker's mount
table elsewhere, and a second one made on the same image would read it without its last
changes, then be overwritten by them (`loopmount.py`). The flock is kept until it is gone.

Operations on one workspace are serialised here (one worker has it mounted, and runs them in
turn); across the deployment the control plane holds the workspace's advisory lock around
each and sends the lock's fence: an operation that sees a higher fence arrive stops before
its next git step (the lock it ran under was lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

from sandgate.core.clock import utcnow
from sandgate.core.workspaces import check_id
from sandgate.errors import ConflictError, NotFoundError, WorkerError
from sandgate.worker import disk, idmap, loopmount
from sandgate.worker.git_history import Author, GitHistory

log = logging.getLogger(__name__)

STORAGE_UID: Final = 199999  # owns every workspace's files on disk; below the sandbox uids
META: Final = "workspace.json"
IMAGE: Final = "disk.img"
LOCK: Final = "lock"
FILES: Final = "files"
GIT: Final = "git"
GIT_SLOTS: Final = 4  # workspaces whose git runs at once on one worker (the rest wait)
FAULT_PAUSE: Final = 3.0  # the pause-workspace-git fault's wait between two git steps
LINGER_POLL: Final = (0.01, 1.0)  # first and longest wait between checks of a lingering mount

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Mounted:
    point: Path
    lock_fd: int  # the flock that says this worker has the image mounted
    device: int  # the number of the loop device it is mounted from
    refs: int = 0  # sandboxes and operations using it


@dataclass
class _Lingering:
    """An image unmounted here whose file system lives on, held by a copy of a mount table."""

    device: int  # its loop device: a mount meanwhile mounts that one again
    lock_fd: int  # the flock, kept until the file system is gone (-1: found at start while
    # another worker process here held it)


class WorkspaceHost:
    def __init__(
        self,
        root: Path,
        mounts_dir: Path,
        *,
        storage_uid: int = STORAGE_UID,
        faults: frozenset[str] = frozenset(),
    ) -> None:
        self.root = root
        self.mounts_dir = mounts_dir
        self.storage_uid = storage_uid
        self.pause_steps = "pause-workspace-git" in faults  # a test kills a holder meanwhile
        self.problem: str | None = "not prepared"  # why workspaces cannot be served here
        # workspace id -> its mount while in use (refcounted)
        self.mounted: dict[str, _Mounted] = {}
        # workspace id -> its file system that outlived its unmount here (module docstring)
        self.lingering: dict[str, _Lingering] = {}
        # workspace id -> the task that lets its lingering flock go once the file system is gone
        self._watchers: dict[str, asyncio.Task[None]] = {}
        # workspace id -> the highest lock fence an operation on it arrived with
        self.fences: dict[str, int] = {}
        # workspace id -> serialises its mount, unmount and operations on this worker
        self._locks: dict[str, asyncio.Lock] = {}
        # freezes (True) or thaws the sandboxes here that mount a workspace, around each
        # commit and restore (set by the worker's service, which knows its sandboxes)
        self.freeze: Callable[[str, bool], Awaitable[int]] | None = None
        # bounds the git work running at once on this host, whatever the number of workspaces
        self._git_slots = asyncio.Semaphore(GIT_SLOTS)

    # -- start -------------------------------------------------------------------------
    def prepare(self, *, disk_problem: str | None) -> None:
        """Blocking, once at worker start: leftovers of a crash unmounted, then a probe."""
        # traversable by the storage uid (git runs as it), listable by root alone
        self.mounts_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(self.mounts_dir, 0o711)
        for point in disk.unmount_leftovers(self.mounts_dir):
            log.warning("workspace.leftover_unmounted", extra={"point": str(point)})
        for child in self.mounts_dir.iterdir():
            with contextlib.suppress(OSError):
                child.rmdir()
        self.lingering.update(_left_alive(self.root))  # `watch_lingering` once the loop runs
        if disk_problem is not None:
            self.problem = f"no disk quotas on this host ({disk_problem})"
            return
        try:
            self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
            self.problem = _probe_idmap(self.mounts_dir, self.storage_uid)
        except OSError as exc:
            self.problem = f"cannot use the workspace root {self.root}: {exc}"
        if self.problem is not None:
            log.warning("workspace.unavailable", extra={"reason": self.problem})

    def watch_lingering(self) -> None:
        """In the event loop, after `prepare`: let go of the flocks of the file systems found
        alive at start once each is gone."""
        for ws_id in list(self.lingering):
            self._watch_lingering(ws_id)

    # -- lifecycle -----------------------------------------------------------------------
    async def create(self, ws_id: str, owner: str, quota_mb: int, author: Author) -> dict[str, Any]:
        """Make the workspace (its image, files/, git/ with a first commit); a retry of a
        create that completed returns its head, one by another owner is refused."""
        check_id(ws_id)
        async with self._lock(ws_id):
            meta = self._meta(ws_id)
            if meta is not None:
                if meta.get("owner") != owner:
                    raise ConflictError(f"workspace id {ws_id} is taken")
                return await self._in_mounted(ws_id, owner, lambda git: git.head().to_json())
            return await self._to_end(ws_id, self._make, ws_id, owner, quota_mb, author)

    async def delete(self, ws_id: str, owner: str) -> bool:
        check_id(ws_id)
        async with self._lock(ws_id):
            meta = self._meta(ws_id)
            if meta is None:
                return False
            if meta.get("owner") != owner:
                raise NotFoundError(f"workspace {ws_id} not found")
            if ws_id in self.mounted:
                raise ConflictError(
                    "the workspace is mounted by a sandbox; delete its sandboxes first",
                    code="workspace_in_use",
                )
            await asyncio.to_thread(self._remove, ws_id)
            self.fences.pop(ws_id, None)
            return True

    # -- mounts for sandboxes --------------------------------------------------------------
    async def attach(self, ws_id: str, owner: str) -> Path:
        """The host path of the workspace's files, mounted until `release`; only for the owner
        recorded with the workspace (anyone else: not found, as if it did not exist)."""
        check_id(ws_id)
        async with self._lock(ws_id):
            return await self._attach(ws_id, owner)

    async def release(self, ws_id: str) -> None:
        async with self._lock(ws_id):
            await self._release(ws_id)

    def bind(self, files: Path, target: Path, uid: int) -> None:
        """Blocking: `files` at `target`, seen by `uid` as its own."""
        idmap.bind(files, target, on_disk=self.storage_uid, seen_as=uid)

    # -- git --------------------------------------------------------------------------------
    async def run(
        self, ws_id: str, owner: str, fence: int | None, work: Callable[[GitHistory], T]
    ) -> T:
        """Run `work` (blocking, in a thread) on the workspace's history, in turn with every
        other operation on it here, stopped before any git step once a higher fence arrived
        (`fence` None: a read, which takes no lock)."""
        check_id(ws_id)
        if fence is not None:
            if fence < self.fences.get(ws_id, 0):
                raise _lock_lost(ws_id)
            self.fences[ws_id] = fence
        async with self._lock(ws_id):  # no sandbox binds it meanwhile: attach waits for this
            if fence is None or self.freeze is None:
                return await self._in_mounted(ws_id, owner, work, fence=fence)
            # the sandboxes using it hold still: git sees one tree, and no link the tenant
            # swaps in while git walks it (the jail keeps such a link inside the workspace)
            await self.freeze(ws_id, True)
            try:
                return await self._in_mounted(ws_id, owner, work, fence=fence)
            finally:
                await self.freeze(ws_id, False)

    # -- internals ---------------------------------------------------------------------------
    def _lock(self, ws_id: str) -> asyncio.Lock:
        lock = self._locks.get(ws_id)
        if lock is None:
            lock = self._locks[ws_id] = asyncio.Lock()
        return lock

    async def _in_mounted(
        self, ws_id: str, owner: str, work: Callable[[GitHistory], T], *, fence: int | None = None
    ) -> T:
        files = await self._attach(ws_id, owner)
        try:
            steps = 0

            def check() -> None:
                nonlocal steps
                steps += 1
                if self.pause_steps and steps == 2:  # a step done, the commit not yet written
                    log.critical("fault.pause_workspace_git", extra={"workspace": ws_id})
                    time.sleep(FAULT_PAUSE)
                if fence is not None and self.fences.get(ws_id, 0) > fence:
                    log.warning(
                        "workspace.lock_lost_stopped",
                        extra={"workspace": ws_id, "fence": fence, "step": steps},
                    )
                    raise _lock_lost(ws_id)

            git = GitHistory(
                files.parent / GIT,
                files,
                uid=self.storage_uid,
                gid=self.storage_uid,
                check=check,
            )

            # a cancelled request (its caller went away) must not let the next operation in
            # while this one's git still runs: the thread ends (at its next step, once a
            # newer fence arrived) before the workspace's lock and mount are let go
            async def bounded() -> T:
                async with self._git_slots:
                    return await asyncio.to_thread(work, git)

            return await _to_completion(asyncio.ensure_future(bounded()))
        finally:
            await self._release(ws_id)

    def _dir(self, ws_id: str) -> Path:
        return self.root / ws_id

    def _meta(self, ws_id: str) -> dict[str, Any] | None:
        try:
            meta = json.loads((self._dir(ws_id) / META).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise WorkerError(f"workspace {ws_id}'s record is unreadable: {exc}") from exc
        return meta if isinstance(meta, dict) else None

    async def _attach(self, ws_id: str, owner: str) -> Path:
        if self.problem is not None:
            raise WorkerError(f"this worker cannot serve workspaces: {self.problem}")
        meta = self._meta(ws_id)
        if meta is None or meta.get("owner") != owner:
            raise NotFoundError(f"workspace {ws_id} not found")
        held = self.mounted.get(ws_id)
        if held is None:
            job = asyncio.ensure_future(asyncio.to_thread(self._mount, ws_id))
            try:
                held = await asyncio.shield(job)
            except asyncio.CancelledError:  # the mount goes on: undone once it is made
                with contextlib.suppress(BaseException):
                    await self._to_end(ws_id, self._unmount, ws_id, await job)
                raise
            self.mounted[ws_id] = held
        held.refs += 1
        return held.point / FILES

    async def _release(self, ws_id: str) -> None:
        held = self.mounted.get(ws_id)
        if held is None:
            return
        held.refs -= 1
        if held.refs <= 0:
            del self.mounted[ws_id]
            await self._to_end(ws_id, self._unmount, ws_id, held)

    async def _to_end(self, ws_id: str, work: Callable[..., R], *args: Any) -> R:
        """Run the blocking `work` in a thread to its end even when the caller is cancelled
        meanwhile (a mount or unmount left half seen would leak, its flock with it), then
        watch a file system it left lingering."""
        try:
            return await _to_completion(asyncio.ensure_future(asyncio.to_thread(work, *args)))
        finally:
            self._watch_lingering(ws_id)

    def _mount(self, ws_id: str) -> _Mounted:
        """Blocking: mount the image (again through the loop device its file system lives
        on, if it outlived an unmount), under the flock."""
        left = self.lingering.pop(ws_id, None)
        if left is not None and left.lock_fd >= 0:
            fd = left.lock_fd
        else:
            fd = _try_flock(self._dir(ws_id) / LOCK)
            if fd < 0:
                self._put_back(ws_id, left)
                raise ConflictError(
                    f"workspace {ws_id} is mounted by another worker; retry once its sandboxes "
                    "there are gone",
                    code="workspace_busy",
                )
        point = self.mounts_dir / ws_id
        try:
            point.mkdir(mode=0o711, exist_ok=True)
            device = disk.mount_image(
                self._dir(ws_id) / IMAGE, point, device=None if left is None else left.device
            )
        except BaseException:
            with contextlib.suppress(OSError):
                point.rmdir()
            self._put_back(ws_id, left)  # its file system may still live
            if left is None or fd != left.lock_fd:
                os.close(fd)
            raise
        return _Mounted(point, fd, device)

    def _put_back(self, ws_id: str, left: _Lingering | None) -> None:
        """A lingering entry taken out for a mount or removal that did not happen."""
        if left is not None:
            self.lingering[ws_id] = left

    def _unmount(self, ws_id: str, held: _Mounted) -> None:
        """Blocking: unmount; the flock goes with the file system, or is kept (`lingering`)
        while a copy of this mount table elsewhere holds it alive, so that no other worker
        mounts the image before its last changes are written."""
        try:
            if os.path.ismount(held.point):
                disk.unmount(held.point)
            with contextlib.suppress(OSError):
                held.point.rmdir()
        finally:
            try:
                alive = loopmount.backs(held.device, self._dir(ws_id) / IMAGE)
            except WorkerError as exc:  # not known to be gone: kept, as if alive
                log.warning("workspace.loop_unreadable", extra={"error": exc.message})
                alive = True
            if alive:
                self.lingering[ws_id] = _Lingering(held.device, held.lock_fd)
                log.warning(
                    "workspace.file_system_lingers",
                    extra={"workspace": ws_id, "device": held.device},
                )
            else:
                os.close(held.lock_fd)

    def _watch_lingering(self, ws_id: str) -> None:
        """One task per workspace with a lingering flock, until it is let go."""
        left = self.lingering.get(ws_id)
        if left is None or left.lock_fd < 0:
            return
        running = self._watchers.get(ws_id)
        if running is not None and not running.done():
            return  # it watches whichever entry is there when it wakes
        task = asyncio.get_running_loop().create_task(self._let_go_when_gone(ws_id))
        self._watchers[ws_id] = task
        task.add_done_callback(lambda done: self._forget_watcher(ws_id, done))

    def _forget_watcher(self, ws_id: str, done: asyncio.Task[None]) -> None:
        if self._watchers.get(ws_id) is done:
            del self._watchers[ws_id]

    async def _let_go_when_gone(self, ws_id: str) -> None:
        """Check the lingering file system now and then; once it is gone, let the flock go."""
        wait, longest = LINGER_POLL
        while True:
            await asyncio.sleep(wait)
            wait = min(wait * 2, longest)
            async with self._lock(ws_id):
                left = self.lingering.get(ws_id)
                if left is None or left.lock_fd < 0:
                    return  # mounted again here (with its flock), or deleted
                image = self._dir(ws_id) / IMAGE
                try:
                    if await asyncio.to_thread(loopmount.backs, left.device, image):
                        continue
                except WorkerError as exc:
                    log.warning("workspace.loop_unreadable", extra={"error": exc.message})
                    continue
                del self.lingering[ws_id]
                os.close(left.lock_fd)
                log.info("workspace.file_system_gone", extra={"workspace": ws_id})
                return

    def _make(self, ws_id: str, owner: str, quota_mb: int, author: Author) -> dict[str, Any]:
        where = self._dir(ws_id)
        if where.exists():  # an earlier attempt died before its record: start again
            self._remove(ws_id)
        where.mkdir(mode=0o700)
        try:
            disk.make_image(where / IMAGE, disk_mb=quota_mb)
            held = self._mount(ws_id)
            try:
                for name, mode in ((FILES, 0o755), (GIT, 0o700)):
                    path = held.point / name
                    path.mkdir(mode=mode)
                    os.chown(path, self.storage_uid, self.storage_uid)
                    os.chmod(path, mode)
                git = GitHistory(
                    held.point / GIT, held.point / FILES, uid=self.storage_uid, gid=self.storage_uid
                )
                head: dict[str, Any] = git.init(author).to_json()
            finally:
                self._unmount(ws_id, held)
            record = {
                "id": ws_id,
                "owner": owner,
                "quota_mb": quota_mb,
                "created_at": utcnow().isoformat(),
            }
            part = where / (META + ".part")
            part.write_text(json.dumps(record))
            os.replace(part, where / META)
            return head
        except BaseException:
            self._remove(ws_id)
            raise

    def _remove(self, ws_id: str) -> None:
        where = self._dir(ws_id)
        left = self.lingering.pop(ws_id, None)  # a lingering one goes on into a removed image
        held = left is not None and left.lock_fd >= 0  # its flock, kept: no gap to take it
        fd = left.lock_fd if left is not None and held else -1
        if not held:
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(where / LOCK, os.O_RDWR | os.O_CLOEXEC)
        try:
            if fd >= 0 and not held:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    self._put_back(ws_id, left)
                    raise ConflictError(
                        f"workspace {ws_id} is mounted by another worker; delete its sandboxes "
                        "there first",
                        code="workspace_in_use",
                    ) from None
            (where / META).unlink(missing_ok=True)  # first: it is no longer complete
            shutil.rmtree(where, ignore_errors=True)
        finally:
            if fd >= 0:
                os.close(fd)


async def _to_completion(job: asyncio.Future[T]) -> T:
    """Await `job`; when the caller is cancelled meanwhile, wait for it to end all the same
    (its outcome dropped), then raise the cancellation."""
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await job
        raise


def _lock_lost(ws_id: str) -> ConflictError:
    return ConflictError(
        f"the lock of workspace {ws_id} was lost (its holder's store connection dropped) and "
        "another operation took it; this one stopped before its next step: retry it",
        code="workspace_lock_lost",
    )


def _left_alive(root: Path) -> dict[str, _Lingering]:
    """The workspace images under `root` that a loop device still backs (a file system left
    alive by an earlier worker here, or mounted by another one on this host now): where a
    mount here must mount it again. Each with its flock taken when free (kept until the file
    system is gone, as after an unmount here); else the worker holding it guards it."""
    found: dict[str, _Lingering] = {}
    root = root.resolve()  # as the kernel names the backing file
    for entry in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError, ValueError):
            image = Path(entry.read_text().strip())
            if image.name == IMAGE and image.parent.parent == root:
                device = int(entry.parent.parent.name[4:])
                found[image.parent.name] = _Lingering(device, _try_flock(image.parent / LOCK))
    return found


def _try_flock(lock: Path) -> int:
    """An fd holding the flock on `lock`, or -1 when another holds it."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -1
    return fd


def _probe_idmap(work: Path, uid: int) -> str | None:
    """Why an idmapped bind cannot be made here, or None when one can."""
    source, target = work / ".idmap-probe-src", work / ".idmap-probe-dst"
    try:
        for path in (source, target):
            path.mkdir(mode=0o700, exist_ok=True)
        os.chown(source, uid, uid)
        idmap.bind(source, target, on_disk=uid, seen_as=uid + 1)
        seen = os.stat(target).st_uid
        idmap.unbind(target)
        return None if seen == uid + 1 else "an idmapped mount did not map its owner"
    except (OSError, WorkerError) as exc:
        return f"no idmapped mounts here ({getattr(exc, 'message', None) or exc})"
    finally:
        with contextlib.suppress(OSError, WorkerError):
            idmap.unbind(target)
        for path in (source, target):
            with contextlib.suppress(OSError):
                path.rmdir()
