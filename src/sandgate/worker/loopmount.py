"""An ext4 image mounted in-process: a loop device configured by ioctl, the file system made
by the new mount API (``fsopen``/``fsconfig``/``fsmount``, Linux >= 5.2; ``LOOP_CONFIGURE``,
Linux >= 5.8).

Why not ``mount -o loop``: util-linux reads the whole mount table and scans the loop devices
before it sets one up, so with one disk mounted per held sandbox a mount cost grew with the
sandboxes on the worker (33.9 ms alone at 10, 48.8 ms at 500: docs/benchmarks.md), plus two
process spawns. Here it is a handful of syscalls whatever the count.

`mount_detached` gives a **detached** mount, an fd not in any mount table: the worker reads
and writes it through ``/proc/<its pid>/fd/N`` and a sandbox's own mount namespace can move it
into place (`root_step.py`), so the worker's mount table, which every sandbox start copies,
does not grow with the sandboxes. `attach` puts it in the caller's table instead.

The loop device detaches itself once the file system is gone (``LO_FLAGS_AUTOCLEAR``): when
the last mount of it is unmounted and the last fd to it closed. That can be later than our
unmount: a process that copied our mount table meanwhile (any new mount namespace made with
private propagation, a sandbox's namespace while it is torn down) holds the file system alive
with its unwritten changes. Mounting the same image then through a second loop device would
make a second file system on one file: it reads the image without those changes, and the
first one writes them over it when it finally goes. So a mount given the device of the
image's last mount (`mount_detached(device=...)`) mounts that device again while it still
backs the image, and the kernel hands back the live file system. Blocking: call in a thread.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
from pathlib import Path
from typing import Final, NamedTuple

from sandgate.errors import WorkerError

# <linux/loop.h>
_LOOP_CTL_GET_FREE: Final = 0x4C82
_LOOP_CONFIGURE: Final = 0x4C0A
_LOOP_GET_STATUS64: Final = 0x4C05
_LO_FLAGS_AUTOCLEAR: Final = 4
_LO_NAME_SIZE: Final = 64
# the common syscall table (x86_64 and aarch64 alike)
_SYS_MOVE_MOUNT: Final = 429
_SYS_FSOPEN: Final = 430
_SYS_FSCONFIG: Final = 431
_SYS_FSMOUNT: Final = 432
_FSOPEN_CLOEXEC: Final = 1
_FSCONFIG_SET_FLAG: Final = 0
_FSCONFIG_SET_STRING: Final = 1
_FSCONFIG_CMD_CREATE: Final = 6
_FSMOUNT_CLOEXEC: Final = 1
_MOUNT_ATTR_NOSUID: Final = 0x2
_MOUNT_ATTR_NODEV: Final = 0x4
_MOUNT_ATTR_NOATIME: Final = 0x10
_AT_FDCWD: Final = -100
_MOVE_MOUNT_F_EMPTY_PATH: Final = 0x4
_BUSY_RETRIES: Final = 32  # another thread or process took the free device first
# a loop device that backs nothing (ENXIO: unbound, or being detached since Linux 6.11), or
# is no more (ENOENT, ENODEV)
_GONE: Final = frozenset({errno.ENOENT, errno.ENXIO, errno.ENODEV})


class _LoopInfo64(ctypes.Structure):
    _fields_ = (
        ("lo_device", ctypes.c_uint64),
        ("lo_inode", ctypes.c_uint64),
        ("lo_rdevice", ctypes.c_uint64),
        ("lo_offset", ctypes.c_uint64),
        ("lo_sizelimit", ctypes.c_uint64),
        ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32),
        ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32),
        ("lo_file_name", ctypes.c_char * _LO_NAME_SIZE),
        ("lo_crypt_name", ctypes.c_char * _LO_NAME_SIZE),
        ("lo_encrypt_key", ctypes.c_uint8 * 32),
        ("lo_init", ctypes.c_uint64 * 2),
    )


class _LoopConfig(ctypes.Structure):
    _fields_ = (
        ("fd", ctypes.c_uint32),
        ("block_size", ctypes.c_uint32),
        ("info", _LoopInfo64),
        ("reserved", ctypes.c_uint64 * 8),
    )


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> int:
    if result < 0:
        raise WorkerError(f"{what}: {os.strerror(ctypes.get_errno())}")
    return result


def _loop_device(image_fd: int, name: bytes) -> tuple[int, int]:
    """A free loop device now backed by `image_fd`, detaching itself when unused: its fd and
    its number."""
    config = _LoopConfig()
    config.fd = image_fd
    config.info.lo_flags = _LO_FLAGS_AUTOCLEAR
    config.info.lo_file_name = name[: _LO_NAME_SIZE - 1]
    try:
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise WorkerError(f"no loop devices here (/dev/loop-control: {exc.strerror})") from exc
    try:
        for _ in range(_BUSY_RETRIES):
            number = fcntl.ioctl(control, _LOOP_CTL_GET_FREE)
            device = os.open(f"/dev/loop{number}", os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(device, _LOOP_CONFIGURE, config)
            except OSError as exc:
                os.close(device)
                if exc.errno == errno.EBUSY:
                    continue
                raise WorkerError(f"cannot set up loop device {number}: {exc.strerror}") from exc
            return device, number
    except OSError as exc:
        raise WorkerError(f"cannot find a free loop device: {exc.strerror}") from exc
    finally:
        os.close(control)
    raise WorkerError("cannot set up a loop device: every free one was taken first; retry")


class Detached(NamedTuple):
    fd: int  # the detached mount (close-on-exec)
    device: int  # the number of the loop device under it


def mount_detached(image: Path, *, device: int | None = None) -> Detached:
    """Mount the ext4 file system in `image` nosuid, nodev, noatime, with discard (what the
    sandbox deletes goes back to the host), as a detached mount. `device`: the loop device
    of the image's last mount; while it still backs the image its file system lives on, and
    it is mounted again rather than a second one made (see the module's docstring)."""
    if platform.machine() not in ("x86_64", "aarch64"):
        raise WorkerError(f"the mount API is not wired for {platform.machine()}")
    image_fd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    loop = fs = -1
    try:
        number = -1
        if device is not None:
            loop = _open_backing(device, os.fstat(image_fd))
            number = device
        if loop < 0:
            loop, number = _loop_device(image_fd, os.fsencode(image))
        what = f"cannot mount the file system in {image}"
        fs = _check(_libc.syscall(_SYS_FSOPEN, b"ext4", ctypes.c_uint(_FSOPEN_CLOEXEC)), what)
        options = (
            (_FSCONFIG_SET_STRING, b"source", f"/dev/loop{number}".encode()),
            (_FSCONFIG_SET_FLAG, b"discard", None),
            (_FSCONFIG_CMD_CREATE, None, None),
        )
        for command, key, value in options:
            _check(
                _libc.syscall(
                    _SYS_FSCONFIG, fs, ctypes.c_uint(command), key, value, ctypes.c_int(0)
                ),
                what,
            )
        attrs = _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | _MOUNT_ATTR_NOATIME
        mount_fd = _check(
            _libc.syscall(_SYS_FSMOUNT, fs, ctypes.c_uint(_FSMOUNT_CLOEXEC), ctypes.c_uint(attrs)),
            what,
        )
        return Detached(mount_fd, number)
    finally:
        for fd in (fs, loop, image_fd):  # the mount holds the device, the device the file
            if fd >= 0:
                os.close(fd)


def backs(device: int, image: Path) -> bool:
    """Whether loop device `device` still backs `image`: a file system of it lives on."""
    try:
        st = os.stat(image)
    except FileNotFoundError:
        return False
    fd = _open_backing(device, st)
    if fd < 0:
        return False
    os.close(fd)
    return True


def _open_backing(device: int, image: os.stat_result) -> int:
    """An fd of loop device `device` if it is backed by the file `image` describes (held
    open, it cannot detach meanwhile), else -1."""
    # read-only: the status needs no more, and a close after a write open would have udev
    # probe the device
    try:
        fd = os.open(f"/dev/loop{device}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _GONE:
            return -1
        raise WorkerError(f"cannot open loop device {device}: {exc.strerror}") from exc
    info = _LoopInfo64()
    try:
        fcntl.ioctl(fd, _LOOP_GET_STATUS64, info)
    except OSError as exc:
        os.close(fd)
        if exc.errno in _GONE:
            return -1
        raise WorkerError(f"cannot read loop device {device}: {exc.strerror}") from exc
    # the kernel's dev_t encoding (`new_encode_dev`), decoded to compare with the stat's
    major = (info.lo_device & 0xFFF00) >> 8
    minor = (info.lo_device & 0xFF) | ((info.lo_device >> 12) & 0xFFF00)
    if os.makedev(major, minor) != image.st_dev or info.lo_inode != image.st_ino:
        os.close(fd)
        return -1
    return fd


def attach(mount_fd: int, target: Path) -> None:
    """Put the detached mount `mount_fd` (this module's, or an `open_tree` clone: idmap.py)
    at `target` in the caller's mount table."""
    _check(
        _libc.syscall(
            _SYS_MOVE_MOUNT,
            mount_fd,
            b"",
            _AT_FDCWD,
            os.fsencode(target),
            ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH),
        ),
        f"cannot mount at {target}",
    )


def fd_path(mount_fd: int) -> Path:
    """A path of the detached mount's root while the fd is open: for this process, and for
    root's tools it runs (no other uid may follow another process's descriptors)."""
    return Path(f"/proc/{os.getpid()}/fd/{mount_fd}")
