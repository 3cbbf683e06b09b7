"""The sandbox seccomp filter, built with libseccomp through ctypes.

Default action ALLOW; EPERM for syscalls a sandbox never needs and that widen the kernel
attack surface or could undo the isolation (mounts, namespaces, ptrace, bpf, io_uring, keys,
kernel modules, device nodes, ...). `clone` is refused only when it asks for a new namespace
(one MASKED_EQ rule per CLONE_NEW* flag); `clone3` answers ENOSYS so glibc falls back to
`clone`, whose flags the filter can see (clone3 passes them in memory). `socket` and
`socketpair` answer EAFNOSUPPORT for every address family but `ALLOWED_FAMILIES`, and an
AF_NETLINK socket answers EPROTONOSUPPORT for every netlink protocol but
`ALLOWED_NETLINK_PROTOCOLS`.

The program is exported once as raw BPF (what `bwrap --seccomp FD` reads) and written to a
file; every sandbox gets a fresh read-only fd of that file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import socket
from pathlib import Path

from sandgate.errors import WorkerError

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ = 4
SCMP_CMP_GT = 6
SCMP_CMP_MASKED_EQ = 7
ARG_MASK = (1 << 64) - 1
NR_SCMP_ERROR = -1


def SCMP_ACT_ERRNO(code: int) -> int:  # named after the libseccomp macro
    return 0x00050000 | (code & 0x0000FFFF)


DENY_EPERM: tuple[str, ...] = (
    # mounts and the new mount API
    "mount",
    "umount2",
    "pivot_root",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    # namespaces
    "unshare",
    "setns",
    # other processes' memory
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "process_madvise",
    # kernel attack surface
    "bpf",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "perf_event_open",
    "userfaultfd",
    "open_by_handle_at",
    "name_to_handle_at",
    # kernel / machine state
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "mknod",
    "mknodat",
    "swapon",
    "swapoff",
    "reboot",
)

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NS_FLAGS: tuple[int, ...] = (
    CLONE_NEWNS,
    CLONE_NEWUTS,
    CLONE_NEWIPC,
    CLONE_NEWUSER,
    CLONE_NEWPID,
    CLONE_NEWNET,
    CLONE_NEWCGROUP,
)

# Address families a sandbox may open sockets of: an allowlist, because the kernel keeps adding
# families and each is its own protocol code (AF_VSOCK reaches the hypervisor, AF_PACKET,
# AF_ALG, AF_KEY, AF_RDS, AF_TIPC, AF_XDP, AF_CAN, AF_BLUETOOTH... have all had exploitable
# bugs), while sandboxed programs need only these four: local sockets, IPv4, IPv6, and netlink
# (glibc's getaddrinfo/getifaddrs and `ip` read the sandbox's own interfaces over
# NETLINK_ROUTE). Any other value, including one with bits above the int the kernel reads,
# answers EAFNOSUPPORT, as for a family this kernel was built without. (socketcall(2), the
# multiplexer of some 32-bit ABIs, hides its arguments in memory; those ABIs are killed.)
ALLOWED_FAMILIES: tuple[int, ...] = (
    socket.AF_UNIX,
    socket.AF_INET,
    socket.AF_INET6,
    socket.AF_NETLINK,
)
SOCKET_SYSCALLS = ("socket", "socketpair")

# Netlink protocols an AF_NETLINK socket may be opened with (socket(2)'s third argument): only
# NETLINK_ROUTE, all glibc (getifaddrs, if_nameindex, getaddrinfo's AI_ADDRCONFIG), Python,
# node/libuv and `ip` use. Each other protocol is its own kernel code: NETLINK_AUDIT,
# NETLINK_KOBJECT_UEVENT, NETLINK_NETFILTER, NETLINK_GENERIC (and every genetlink family behind
# it), NETLINK_XFRM, NETLINK_SOCK_DIAG... They answer EPROTONOSUPPORT, the errno of a protocol
# this kernel was built without (libaudit, for one, then treats audit as absent; `ss` reads
# /proc/net instead of sock_diag). The full 64-bit argument is compared, as for the family.
NETLINK_ROUTE = 0
ALLOWED_NETLINK_PROTOCOLS: tuple[int, ...] = (NETLINK_ROUTE,)


def refused_family_blocks(allowed: tuple[int, ...]) -> list[tuple[int, int]]:
    """(mask, value) pairs such that a 64-bit argument (the family, or a netlink protocol) is
    outside `allowed` exactly when `arg & mask == value` for one pair, or `arg > max(allowed)`.

    libseccomp takes one comparison per argument in a rule and ORs the rules of one action,
    so each gap below an allowed value is cut into aligned power-of-two blocks."""
    blocks: list[tuple[int, int]] = []
    lo = 0
    for end in sorted(set(allowed)):  # the gap is [lo, end)
        while lo < end:
            size = lo & -lo if lo else 1 << 64
            while lo + size > end:
                size >>= 1
            blocks.append((ARG_MASK & ~(size - 1), lo))
            lo += size
        lo = end + 1
    return blocks


class _ArgCmp(ctypes.Structure):
    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


def _load_libseccomp() -> ctypes.CDLL:
    names = ["libseccomp.so.2"]
    found = ctypes.util.find_library("seccomp")
    if found and found not in names:
        names.append(found)
    last: OSError | None = None
    for name in names:
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as exc:
            last = exc
            continue
        lib.seccomp_init.argtypes = [ctypes.c_uint32]
        lib.seccomp_init.restype = ctypes.c_void_p
        lib.seccomp_release.argtypes = [ctypes.c_void_p]
        lib.seccomp_release.restype = None
        lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
        lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
        lib.seccomp_rule_add_array.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.POINTER(_ArgCmp),
        ]
        lib.seccomp_rule_add_array.restype = ctypes.c_int
        lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.seccomp_export_bpf.restype = ctypes.c_int
        return lib
    raise WorkerError(
        f"libseccomp is not available ({last}); install it with `apt-get install -y libseccomp2`"
    )


def export_bpf() -> bytes:
    """Build the sandbox filter for the native architecture and return its raw BPF program.

    Other architectures' syscall ABIs (i386 via int 0x80, x32) hit libseccomp's default
    bad-arch action, which kills the thread that made the call (the call never runs).
    """
    lib = _load_libseccomp()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise WorkerError("seccomp_init failed")
    try:

        def resolve(name: str) -> int | None:
            nr = int(lib.seccomp_syscall_resolve_name(name.encode()))
            return None if nr == NR_SCMP_ERROR else nr

        def add(action: int, nr: int, cmps: list[_ArgCmp]) -> None:
            array = (_ArgCmp * len(cmps))(*cmps) if cmps else None
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array)
            if rc < 0:
                raise WorkerError(f"seccomp_rule_add_array({nr}) failed: {os.strerror(-rc)}")

        for name in DENY_EPERM:
            nr = resolve(name)
            if nr is not None:  # unknown to this libseccomp/arch: nothing to block
                add(SCMP_ACT_ERRNO(errno.EPERM), nr, [])
        clone = resolve("clone")
        if clone is None:
            raise WorkerError("libseccomp does not know the clone syscall")
        for flag in CLONE_NS_FLAGS:
            add(SCMP_ACT_ERRNO(errno.EPERM), clone, [_ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag)])
        clone3 = resolve("clone3")
        if clone3 is not None:
            add(SCMP_ACT_ERRNO(errno.ENOSYS), clone3, [])
        refuse_family = SCMP_ACT_ERRNO(errno.EAFNOSUPPORT)
        refuse_protocol = SCMP_ACT_ERRNO(errno.EPROTONOSUPPORT)
        for name in SOCKET_SYSCALLS:
            nr = resolve(name)
            if nr is None:
                raise WorkerError(f"libseccomp does not know the {name} syscall")
            add(refuse_family, nr, [_ArgCmp(0, SCMP_CMP_GT, max(ALLOWED_FAMILIES), 0)])
            for mask, value in refused_family_blocks(ALLOWED_FAMILIES):
                add(refuse_family, nr, [_ArgCmp(0, SCMP_CMP_MASKED_EQ, mask, value)])
            # AF_NETLINK exactly (any other value of the first argument is refused above or is
            # another allowed family): its protocol, the third argument, against the allowlist
            netlink = _ArgCmp(0, SCMP_CMP_EQ, socket.AF_NETLINK, 0)
            top = max(ALLOWED_NETLINK_PROTOCOLS)
            add(refuse_protocol, nr, [netlink, _ArgCmp(2, SCMP_CMP_GT, top, 0)])
            for mask, value in refused_family_blocks(ALLOWED_NETLINK_PROTOCOLS):
                add(refuse_protocol, nr, [netlink, _ArgCmp(2, SCMP_CMP_MASKED_EQ, mask, value)])

        fd = os.memfd_create("sandgate-seccomp", os.MFD_CLOEXEC)
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc < 0:
                raise WorkerError(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            size = os.lseek(fd, 0, os.SEEK_END)
            program = os.pread(fd, size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
    if not program or len(program) % 8:
        raise WorkerError(f"seccomp_export_bpf produced {len(program)} bytes, not a BPF program")
    return program


def write_filter(path: Path) -> bytes:
    """Export the filter and write it (0644, atomically) to `path`; returns the program."""
    program = export_bpf()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(program)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return program


def open_filter(path: Path) -> int:
    """A fresh read-only fd of the filter file for one bwrap's `--seccomp FD`.

    It is close-on-exec here; the caller hands it to the child with `pass_fds`."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
