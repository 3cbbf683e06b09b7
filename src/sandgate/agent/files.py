"""The file operations of the agent: stat, list, mkdir, move, remove, and open handles.

Handles are per agent (``AgentState.handles``), bounded by ``MAX_HANDLES`` and closed after
``HANDLE_IDLE_SECONDS`` without use; a write handle writes a temp file beside its target and
renames it onto the target when committed. main.py runs the operations on one handle one after
another, in arrival order.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    from sandgate.agent import entries, paths
    from sandgate.agent.paths import Target
    from sandgate.agent.request import AgentError, Header, bool_field, int_field
    from sandgate.agent.state import AgentState, Handle
else:
    import entries
    import paths
    from request import AgentError, bool_field, int_field
    from state import Handle

MAX_READ_LENGTH = entries.MAX_READ_LENGTH
MAX_HANDLES = 64
HANDLE_IDLE_SECONDS = 300.0


# --------------------------------------------------------------------------- file ops


def op_stat(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    return {"entry": paths.lstat_entry(paths.resolve(st.roots, req.get("path")))}, b""


def op_list(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    target = paths.resolve(st.roots, req.get("path"), follow=True)
    prefix = target.spath.rstrip("/") + "/"
    found = []
    with os.scandir(target.real) as it:
        for item in it:
            try:
                item_st = item.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed meanwhile
                continue
            found.append(entries.entry(prefix + item.name, item_st))
    found.sort(key=lambda entry: entry["name"])
    return {"entries": found}, b""


def op_mkdir(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    target = paths.resolve(st.roots, req.get("path"))
    parents = bool_field(req, "parents", True)
    exist_ok = bool_field(req, "exist_ok", parents)  # an existing directory is fine
    found = paths.lstat(target)
    if found is not None:
        if stat.S_ISDIR(found.st_mode) and exist_ok:
            return {"entry": entries.entry(target.spath, found)}, b""
        raise AgentError("exists", f"{target.spath} already exists")
    if parents:
        try:
            os.makedirs(target.real)
        except FileExistsError:  # created meanwhile (a file in a parent gives ENOTDIR)
            if not exist_ok or not os.path.isdir(target.real):
                raise AgentError("exists", f"{target.spath} already exists") from None
    else:
        os.mkdir(target.real)
    return {"entry": paths.lstat_entry(target)}, b""


def op_move(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    src = paths.resolve(st.roots, req.get("src"), name="src")
    dst = paths.resolve(st.roots, req.get("dst"), name="dst")
    overwrite = bool_field(req, "overwrite", False)
    if src.is_root or dst.is_root:
        raise AgentError("invalid_request", "a sandbox root cannot be moved or replaced")
    if paths.lstat(src) is None:
        raise AgentError("not_found", f"{src.spath} does not exist")
    if not overwrite and paths.lstat(dst) is not None:
        raise AgentError("exists", f"{dst.spath} already exists")
    try:
        os.rename(src.real, dst.real)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        _move_across_filesystems(src, dst)
    return {"entry": paths.lstat_entry(dst)}, b""


def _move_across_filesystems(src: Target, dst: Target) -> None:
    """rename(2) cannot cross mounts (/tmp and /workspace may be two): copy, then remove."""
    import shutil

    src_st = os.lstat(src.real)
    dst_st = paths.lstat(dst)
    if stat.S_ISDIR(src_st.st_mode):
        if dst_st is not None:
            if not stat.S_ISDIR(dst_st.st_mode):
                raise AgentError("not_a_directory", f"{dst.spath} is not a directory")
            os.rmdir(dst.real)  # like rename(2): only an empty directory is replaced
        shutil.copytree(src.real, dst.real, symlinks=True)
        shutil.rmtree(src.real)
        return
    if dst_st is not None and stat.S_ISDIR(dst_st.st_mode):
        raise AgentError("is_a_directory", f"{dst.spath} is a directory")
    temp = entries.upload_temp_name(dst.real)
    try:
        shutil.copy2(src.real, temp, follow_symlinks=False)
        os.rename(temp, dst.real)
    except BaseException:
        _unlink_quietly(temp)
        raise
    os.unlink(src.real)


def op_remove(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    target = paths.resolve(st.roots, req.get("path"))
    recursive = bool_field(req, "recursive", False)
    if target.is_root:
        raise AgentError("invalid_request", f"{target.spath} is a sandbox root")
    found = os.lstat(target.real)
    if not stat.S_ISDIR(found.st_mode):
        os.unlink(target.real)  # a symlink is unlinked, never its target
    elif recursive:
        import shutil

        shutil.rmtree(target.real)  # does not follow symlinks
    else:
        os.rmdir(target.real)
    return {}, b""


# --------------------------------------------------------------------------- handles


def _register(st: AgentState, handle: Handle) -> int:
    now = time.monotonic()
    handles = st.handles
    with st.handles_lock:
        idle = [hid for hid, h in handles.items() if now - h.used > HANDLE_IDLE_SECONDS]
        expired = [handles.pop(hid) for hid in idle]
        full = len(handles) >= MAX_HANDLES
        if not full:
            st.next_handle += 1
            hid = st.next_handle
            handles[hid] = handle
    for old in expired:
        with old.lock:
            old.close(discard=True)
    if full:
        handle.close(discard=True)
        raise AgentError("io_error", f"too many open handles (at most {MAX_HANDLES})")
    return hid


def _lookup(st: AgentState, req: Header, kind: str, *, pop: bool = False) -> Handle:
    hid = int_field(req, "handle")
    with st.handles_lock:
        handle = st.handles.pop(hid, None) if pop else st.handles.get(hid)
    if handle is None:
        raise AgentError("not_found", f"no open handle {hid}")
    if handle.kind != kind:
        if pop:
            with st.handles_lock:
                st.handles[hid] = handle
        raise AgentError("invalid_request", f"handle {hid} is not a {kind} handle")
    handle.used = time.monotonic()
    return handle


def drop_uploads(st: AgentState) -> None:
    """The agent is exiting: remove the temp file of every write handle still open."""
    with st.handles_lock:
        for handle in st.handles.values():
            if handle.temp:
                _unlink_quietly(handle.temp)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _open_nofollow(target: Target, flags: int, mode: int = 0o644) -> int:
    try:
        return os.open(target.real, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component became a symlink after resolving
            raise paths.outside(target.spath) from None
        raise


def op_open_read(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    """Open a file for reading: its handle and size. With ``first`` (bytes, at most
    MAX_READ_LENGTH) the answer carries the file's first bytes too, and a file that fits is
    closed at once (``handle`` null, ``eof`` true): a small download in one round trip."""
    first = req.get("first")
    if first is not None:
        first = int_field(req, "first")
        if not 0 < first <= MAX_READ_LENGTH:
            raise AgentError("invalid_request", f"'first' must be between 1 and {MAX_READ_LENGTH}")
    target = paths.resolve(st.roots, req.get("path"), follow=True)
    # O_NONBLOCK so that a FIFO cannot hang the request; only regular files are served.
    fd = _open_nofollow(target, os.O_RDONLY | os.O_NONBLOCK)
    try:
        opened = os.fstat(fd)
        problem = entries.not_readable(opened, target.spath)
        if problem is not None:
            raise AgentError(*problem)
        os.set_blocking(fd, True)
        head = entries.read_up_to(fd, first) if first else b""
    except BaseException:
        os.close(fd)
        raise
    if first and (len(head) < first or len(head) >= opened.st_size):
        os.close(fd)  # all of it is in this answer (what was read is the size it has now)
        return {"handle": None, "size": len(head), "first": len(head), "eof": True}, head
    hid = _register(st, Handle("read", fd, target.spath))
    answer: Header = {"handle": hid, "size": opened.st_size, "offsets": True}
    if first:
        answer.update(first=len(head), eof=False)
    return answer, head


def op_read(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    handle = _lookup(st, req, "read")
    length = int_field(req, "length")
    if not 0 < length <= MAX_READ_LENGTH:
        raise AgentError("invalid_request", f"'length' must be between 1 and {MAX_READ_LENGTH}")
    offset = _offset(req)
    with handle.lock:
        if handle.closed:
            raise AgentError("not_found", "the handle was closed")
        return {}, entries.read_up_to(handle.fd, length, offset)


def op_close_read(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    handle = _lookup(st, req, "read", pop=True)
    with handle.lock:
        handle.close(discard=False)
    return {}, b""


def op_open_write(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    """Open a temp file beside the target: its handle. With ``commit`` true the payload is
    the whole file: written and renamed onto the target at once, the answer its ``entry``
    (a small upload in one round trip)."""
    commit = bool_field(req, "commit", False)
    target = paths.resolve(st.roots, req.get("path"), follow=True)
    if target.is_root or os.path.isdir(target.real):
        raise AgentError("is_a_directory", f"{target.spath} is a directory")
    directory = posixpath.dirname(target.real)
    try:
        os.makedirs(directory, exist_ok=True)
    except FileExistsError:
        raise AgentError("not_a_directory", f"a parent of {target.spath} is a file") from None
    if not paths.inside(os.path.realpath(directory), target.root):  # swapped meanwhile
        raise paths.outside(target.spath)
    temp = entries.upload_temp_name(target.real)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    handle = Handle("write", fd, target.spath, target.real, temp)
    if not commit:
        return {"handle": _register(st, handle), "offsets": True}, b""
    with handle.lock:
        try:
            entries.write_all(handle.fd, payload)
        except BaseException:
            handle.close(discard=True)
            raise
        return {"handle": None, "entry": _commit(handle)}, b""


def _commit(handle: Handle) -> Header:
    """Close the write handle and rename its temp file onto the target (held locked)."""
    try:
        handle.close(discard=False)
        if os.path.isdir(handle.target):
            raise AgentError("is_a_directory", f"{handle.spath} is a directory")
        os.rename(handle.temp, handle.target)
    finally:
        _unlink_quietly(handle.temp)  # nothing left once renamed
    return entries.entry(handle.spath, os.lstat(handle.target))


def op_write(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    handle = _lookup(st, req, "write")
    offset = _offset(req)
    with handle.lock:
        if handle.closed:
            raise AgentError("not_found", "the handle was closed")
        entries.write_all(handle.fd, payload, offset)
    return {"written": len(payload)}, b""


def _offset(req: Header) -> int | None:
    """A read's or write's ``offset`` in its file, if it names one: then it does not depend
    on the handle's position, so a worker may have several of them under way at once and
    in any order (the answers of ``open_read`` and ``open_write`` say ``offsets``)."""
    if req.get("offset") is None:
        return None
    offset = int_field(req, "offset")
    if offset < 0:
        raise AgentError("invalid_request", "'offset' must be at least 0")
    return offset


def op_close_write(st: AgentState, req: Header, payload: bytes) -> tuple[Header, bytes]:
    commit = bool_field(req, "commit")
    handle = _lookup(st, req, "write", pop=True)
    with handle.lock:
        if not commit:
            handle.close(discard=True)
            return {}, b""
        return {"entry": _commit(handle)}, b""
