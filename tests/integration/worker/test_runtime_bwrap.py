"""The bwrap runtime against the real kernel: isolation, limits, cleanup.

Needs root, bubblewrap and cgroups. Sandboxes run probe commands (not the agent) and print
what they observe as JSON on stdout.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandgate.errors import InvalidRequestError, WorkerError
from sandgate.worker import cgroups
from sandgate.worker.cgroups import SandboxCgroups
from sandgate.worker.runtime.base import RunningSandbox, SandboxSpec
from sandgate.worker.runtime.bwrap import BwrapRuntime
from tests.integration.worker.conftest import UID_BASE, UID_COUNT, Env, other_runtime

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap"),
]

PY = ["/usr/bin/python3", "-I", "-S", "-c"]


def uniq(prefix: str = "s") -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


@dataclass
class Result:
    rc: int
    out: str
    err: str
    uid: int

    def json(self) -> Any:
        assert self.rc == 0, f"probe failed rc={self.rc}\nstdout={self.out}\nstderr={self.err}"
        return json.loads(self.out)


async def run_async(
    rt: BwrapRuntime, argv: list[str], spec: SandboxSpec | None = None, wait_s: float = 60
) -> Result:
    spec = spec or SandboxSpec(name=uniq())
    sb = await rt.start(spec, argv=argv)
    try:
        out, _ = await asyncio.wait_for(sb.process.communicate(b""), wait_s)
        err = sb.private["log_path"].read_text(errors="replace")
        assert sb.process.returncode is not None
        return Result(sb.process.returncode, out.decode(errors="replace"), err, sb.private["uid"])
    finally:
        await rt.stop(sb)


def run(rt: BwrapRuntime, argv: list[str], spec: SandboxSpec | None = None) -> Result:
    return asyncio.run(run_async(rt, argv, spec))


def py(code: str, *args: str) -> list[str]:
    return [*PY, textwrap.dedent(code), *args]


async def readline(sb: RunningSandbox, wait_s: float = 30) -> str:
    assert sb.process.stdout is not None
    line = await asyncio.wait_for(sb.process.stdout.readline(), wait_s)
    assert line, f"sandbox exited early: {sb.private['log_path'].read_text()}"
    return line.decode().strip()


def procs_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def proc_file(pid: int, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


def cat_as(uid: int, path: Path) -> subprocess.CompletedProcess[str]:
    """Read `path` on the host as `uid` (no namespaces)."""
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "cat", str(path)]
    return subprocess.run(argv, capture_output=True, text=True)


def cgroup_file(sb: RunningSandbox, name: str) -> Path:
    cg: SandboxCgroups = sb.private["cgroups"]
    for d in cg.dirs:
        if (d / name).exists():
            return d / name
    raise AssertionError(f"no cgroup of {sb.spec.name} has {name}")


STATUS_PROBE = """
import json, os, socket
st = {}
for line in open("/proc/self/status"):
    k, _, v = line.partition(":")
    st[k] = v.strip()
with open("/workspace/owned", "w") as f:
    f.write("x")
print(json.dumps({
    "uid": os.getuid(), "gid": os.getgid(), "euid": os.geteuid(), "groups": os.getgroups(),
    "CapEff": st["CapEff"], "CapPrm": st["CapPrm"], "CapBnd": st["CapBnd"],
    "CapAmb": st["CapAmb"], "NoNewPrivs": st["NoNewPrivs"], "Seccomp": st["Seccomp"],
    "hostname": socket.gethostname(), "env": dict(os.environ), "cwd": os.getcwd(),
    "pid1": open("/proc/1/cmdline", "rb").read().decode(errors="replace"),
}), flush=True)
import sys
sys.stdin.read()
"""


# ------------------------------------------------------------------ identity


def test_features_on_this_host(rt: BwrapRuntime) -> None:
    f = rt.features()
    assert f["runtime"] == "bwrap"
    assert f["user_namespace"] and f["seccomp"] and f["no_new_privs"]
    assert f["network"] == "none"
    assert f["capabilities"] == "none"
    assert set(f["limits"]) == {"memory", "pids", "cpu"}
    print("\nfeatures:", json.dumps(f, sort_keys=True))  # noqa: T201


def test_identity_caps_seccomp_and_distinct_host_uids(rt: BwrapRuntime) -> None:
    async def main() -> None:
        a = await rt.start(
            SandboxSpec(name=uniq("a"), env={"FOO": "bar baz"}), argv=py(STATUS_PROBE)
        )
        b = await rt.start(SandboxSpec(name=uniq("b")), argv=py(STATUS_PROBE))
        try:
            ra, rb = json.loads(await readline(a)), json.loads(await readline(b))
            assert a.private["uid"] != b.private["uid"]
            for sb, r in ((a, ra), (b, rb)):
                host_uid = sb.private["uid"]
                assert UID_BASE <= host_uid < UID_BASE + UID_COUNT
                assert (r["uid"], r["gid"], r["euid"]) == (1000, 1000, 1000)
                assert r["groups"] in ([1000], [])
                assert int(r["CapEff"], 16) == 0
                assert int(r["CapPrm"], 16) == 0
                assert int(r["CapAmb"], 16) == 0
                assert r["NoNewPrivs"] == "1"
                assert r["Seccomp"] == "2"
                assert r["hostname"] == sb.spec.name
                assert r["cwd"] == "/workspace"
                # the host sees the sandbox's files and processes as the leased uid
                assert (sb.workspace / "owned").stat().st_uid == host_uid
                assert sb.workspace.stat().st_uid == host_uid
                assert sb.workspace.stat().st_mode & 0o777 == 0o700
                status = proc_file(sb.process.pid, "status").decode()
                uid_line = next(x for x in status.splitlines() if x.startswith("Uid:"))
                assert uid_line.split()[1:] == [str(host_uid)] * 4
                # bwrap's options (host paths, env values) are not in any cmdline
                assert "workspace" not in r["pid1"].split("--", 1)[0]
                host_cmdline = proc_file(sb.process.pid, "cmdline")
                assert b"bar baz" not in host_cmdline
                assert str(rt.state_dir).encode() not in host_cmdline
            assert ra["env"]["FOO"] == "bar baz"
            assert ra["env"]["HOME"] == "/workspace"
            assert ra["env"]["PATH"] == "/usr/local/bin:/usr/bin:/bin"
            assert "PYTEST_CURRENT_TEST" not in ra["env"]
            assert "FOO" not in rb["env"]
        finally:
            await rt.stop(a)
            await rt.stop(b)

    asyncio.run(main())


# ------------------------------------------------------------------ escapes

ESCAPE_PROBE = r"""
import ctypes, errno, json, os, platform, stat, subprocess, threading, time
libc = ctypes.CDLL(None, use_errno=True)
r = {}

def cerr(rc):
    return "ok" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")

def oserr(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))

def run(*argv):
    return subprocess.run(argv, capture_output=True).returncode

r["unshare_user"] = cerr(libc.unshare(0x10000000))
r["unshare_mount"] = cerr(libc.unshare(0x00020000))
r["unshare_net"] = cerr(libc.unshare(0x40000000))
r["unshare_U_bin"] = run("unshare", "-U", "true")
r["unshare_m_bin"] = run("unshare", "-m", "true")
r["unshare_r_bin"] = run("unshare", "-r", "true")
r["mount_bin"] = run("mount", "-t", "tmpfs", "none", "/tmp")
r["mount"] = cerr(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
r["bind_remount"] = cerr(libc.mount(b"/usr", b"/usr", None, 0x1000 | 0x20, None))
r["umount"] = cerr(libc.umount2(b"/usr", 2))
r["mknod"] = oserr(lambda: os.mknod("/tmp/null", 0o600 | stat.S_IFCHR, os.makedev(1, 3)))
r["chroot"] = oserr(lambda: os.chroot("/tmp"))
r["setuid0"] = oserr(lambda: os.setuid(0))
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
r["ptrace_attach"] = cerr(libc.ptrace(16, child, None, None))
r["ptrace_traceme"] = cerr(libc.ptrace(0, 0, None, None))
os.kill(child, 9)
os.waitpid(child, 0)
if platform.machine() == "x86_64":
    r["clone_newuser"] = cerr(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0))
    r["clone_newns"] = cerr(libc.syscall(56, 0x00020000 | 17, 0, 0, 0, 0))
    r["clone_newnet"] = cerr(libc.syscall(56, 0x40000000 | 17, 0, 0, 0, 0))
    r["clone3"] = cerr(libc.syscall(435, 0, 0))
    r["bpf"] = cerr(libc.syscall(321, 0, 0, 0))
    r["io_uring_setup"] = cerr(libc.syscall(425, 1, 0))
    r["keyctl"] = cerr(libc.syscall(250, 0, 0, 0, 0, 0))
    r["perf_event_open"] = cerr(libc.syscall(298, 0, 0, -1, -1, 0))
    r["userfaultfd"] = cerr(libc.syscall(323, 0))
    r["setns"] = cerr(libc.syscall(308, 0, 0))
    r["pivot_root"] = cerr(libc.syscall(155, b"/tmp", b"/tmp"))
    r["fsopen"] = cerr(libc.syscall(430, b"tmpfs", 0))
r["kmsg"] = oserr(lambda: open("/proc/kmsg", "rb").read(1))
# what must keep working
pid = os.fork()
if pid == 0:
    os._exit(7)
r["fork"] = os.WEXITSTATUS(os.waitpid(pid, 0)[1])
t = threading.Thread(target=lambda: r.__setitem__("thread", "ok"))
t.start()
t.join()
r["subprocess"] = run("/bin/sh", "-c", "exit 3")
r["bash"] = subprocess.run(
    ["bash", "-c", "echo $((6*7))"], capture_output=True, text=True
).stdout.strip()
print(json.dumps(r))
"""


def test_namespaces_mounts_ptrace_and_dangerous_syscalls_are_refused(rt: BwrapRuntime) -> None:
    r = run(rt, py(ESCAPE_PROBE)).json()
    for key in ("unshare_user", "unshare_mount", "unshare_net", "mount", "bind_remount"):
        assert r[key] == "EPERM", (key, r)
    assert r["umount"] == "EPERM", r
    for key in ("unshare_U_bin", "unshare_m_bin", "unshare_r_bin", "mount_bin"):
        assert r[key] != 0, (key, r)
    assert r["mknod"] == "EPERM", r
    assert r["chroot"] == "EPERM", r
    assert r["setuid0"] in ("EPERM", "EINVAL"), r  # uid 0 is not even mapped
    assert r["ptrace_attach"] == "EPERM", r
    assert r["ptrace_traceme"] == "EPERM", r
    assert r["kmsg"] in ("EPERM", "EACCES"), r
    if "clone3" in r:
        for key in ("clone_newuser", "clone_newns", "clone_newnet", "bpf", "io_uring_setup"):
            assert r[key] == "EPERM", (key, r)
        for key in ("keyctl", "perf_event_open", "userfaultfd", "setns", "pivot_root", "fsopen"):
            assert r[key] == "EPERM", (key, r)
        assert r["clone3"] == "ENOSYS", r
    assert r["fork"] == 7
    assert r["thread"] == "ok"
    assert r["subprocess"] == 3
    assert r["bash"] == "42"


SOCKET_PROBE = r"""
import ctypes, errno, json, platform, socket
libc = ctypes.CDLL(None, use_errno=True)
r = {"families": {}}

def name(e):
    return errno.errorcode.get(e, str(e))

def attempt(fn):
    try:
        fn().close()
        return "ok"
    except OSError as e:
        return name(e.errno)

def pair(family):
    a, b = socket.socketpair(family, socket.SOCK_STREAM)
    b.close()
    return a

for family in range(64):
    r["families"][family] = attempt(lambda: socket.socket(family, socket.SOCK_DGRAM))
r["vsock_stream"] = attempt(lambda: socket.socket(40, socket.SOCK_STREAM))
r["socketpair_vsock"] = attempt(lambda: pair(40))
r["socketpair_unix"] = attempt(lambda: pair(socket.AF_UNIX))
if platform.machine() == "x86_64":  # socket(2) is 41: bits above the int are refused too
    for key, family in (("vsock_high_bits", (1 << 32) | 40), ("inet_high_bits", (1 << 32) | 2)):
        fd = libc.syscall(41, ctypes.c_long(family), socket.SOCK_STREAM, 0)
        r[key] = name(ctypes.get_errno()) if fd < 0 else "ok"
# what must keep working: TCP over the sandbox's lo, AF_UNIX, netlink (if_nameindex)
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.bind(("127.0.0.1", 0))
srv.listen(1)
cli = socket.create_connection(srv.getsockname())
conn, _ = srv.accept()
cli.sendall(b"ping")
r["tcp"] = conn.recv(4).decode()
u1, u2 = socket.socketpair()
u1.sendall(b"pong")
r["unix"] = u2.recv(4).decode()
r["interfaces"] = [n for _, n in socket.if_nameindex()]
print(json.dumps(r))
"""


def test_socket_families_outside_the_allowlist_are_refused(rt: BwrapRuntime) -> None:
    r = run(rt, py(SOCKET_PROBE)).json()
    allowed = {socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK}
    for family, outcome in r["families"].items():
        if int(family) in allowed:
            assert outcome == "ok", (family, r)
        else:  # AF_VSOCK (40), AF_PACKET (17), AF_ALG (38), AF_KEY (15), AF_XDP (44), ...
            assert outcome == "EAFNOSUPPORT", (family, r)
    assert r["vsock_stream"] == "EAFNOSUPPORT", r
    assert r["socketpair_vsock"] == "EAFNOSUPPORT", r
    assert r["socketpair_unix"] == "ok", r
    if "vsock_high_bits" in r:
        assert r["vsock_high_bits"] == r["inet_high_bits"] == "EAFNOSUPPORT", r
    assert r["tcp"] == "ping"
    assert r["unix"] == "pong"
    assert r["interfaces"] == ["lo"]


NETLINK_PROBE = r"""
import ctypes, errno, json, platform, socket, subprocess
libc = ctypes.CDLL(None, use_errno=True)
NL, RAW = socket.AF_NETLINK, socket.SOCK_RAW
r = {"protocols": {}}

def name(e):
    return errno.errorcode.get(e, str(e))

def attempt(fn):
    try:
        fn().close()
        return "ok"
    except OSError as e:
        return name(e.errno)

for proto in range(40):  # MAX_LINKS is 32: the rest the kernel refuses itself
    r["protocols"][proto] = attempt(lambda: socket.socket(NL, RAW, proto))
r["route_dgram"] = attempt(lambda: socket.socket(NL, socket.SOCK_DGRAM, 0))
r["pair_uevent"] = attempt(lambda: socket.socketpair(NL, RAW, 15)[0])
if platform.machine() == "x86_64":  # socket(2) is 41: bits above the int are refused too
    for key, proto in (("uevent_high_bits", (1 << 32) | 15), ("route_high_bits", 1 << 32)):
        fd = libc.syscall(41, NL, RAW, ctypes.c_long(proto))
        r[key] = name(ctypes.get_errno()) if fd < 0 else "ok"
# what must keep working over NETLINK_ROUTE: if_nameindex, getaddrinfo(AI_ADDRCONFIG), `ip`
r["interfaces"] = [n for _, n in socket.if_nameindex()]
r["lo_index"] = socket.if_nametoindex("lo")
r["addrconfig"] = len(socket.getaddrinfo("127.0.0.1", 80, flags=socket.AI_ADDRCONFIG))
ip = subprocess.run(["/usr/sbin/ip", "-o", "addr"], capture_output=True, text=True)
r["ip_rc"], r["ip_out"], r["ip_err"] = ip.returncode, ip.stdout, ip.stderr
print(json.dumps(r))
"""


@pytest.mark.skipif(not os.path.exists("/usr/sbin/ip"), reason="needs iproute2")
def test_netlink_only_route(rt: BwrapRuntime) -> None:
    r = run(rt, py(NETLINK_PROBE)).json()
    assert r["protocols"]["0"] == "ok", r  # NETLINK_ROUTE
    for proto, outcome in r["protocols"].items():
        if proto != "0":  # NETLINK_SOCK_DIAG 4, NETLINK_AUDIT 9, NETFILTER 12, KOBJECT_UEVENT 15,
            assert outcome == "EPROTONOSUPPORT", (proto, r)  # GENERIC 16, ...
    assert r["route_dgram"] == "ok", r
    assert r["pair_uevent"] == "EPROTONOSUPPORT", r
    if "uevent_high_bits" in r:
        assert r["uevent_high_bits"] == r["route_high_bits"] == "EPROTONOSUPPORT", r
    assert r["interfaces"] == ["lo"], r
    assert r["lo_index"] == 1, r
    assert r["addrconfig"] >= 1, r
    assert r["ip_rc"] == 0, r
    assert " lo " in r["ip_out"] and "127.0.0.1/8" in r["ip_out"], r


PID1_PROBE = r"""
import json, os, sys
print(json.dumps({
    "environ": open("/proc/1/environ", "rb").read().decode(errors="replace"),
    "self_environ": open("/proc/self/environ", "rb").read().decode(errors="replace"),
}), flush=True)
sys.stdin.read()
"""


def test_pid1_environment_holds_nothing_of_the_host(
    rt: BwrapRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a worker started from its state dir: neither that path nor a PWD may reach pid 1
    monkeypatch.chdir(rt.state_dir)

    async def main() -> None:
        sb = await rt.start(SandboxSpec(name=uniq("e")), argv=py(PID1_PROBE))
        try:
            r = json.loads(await readline(sb))
            host_environ = proc_file(sb.process.pid, "environ")
            host_cwd = os.readlink(f"/proc/{sb.process.pid}/cwd")
        finally:
            await rt.stop(sb)
        # documented in bwrap.py: the chain from the worker to bwrap's pid 1 has no variables
        assert r["environ"] == "", r
        assert "PWD=" not in r["environ"]
        assert str(rt.state_dir) not in r["environ"] + r["self_environ"]
        # the command's: bwrap's --setenv list, plus the PWD of its --chdir
        assert "PWD=/workspace\0" in r["self_environ"]
        # on the host, the outer bwrap runs in / with nothing of the worker's environment
        assert host_environ == b""
        assert host_cwd == "/"

    asyncio.run(main())


FS_PROBE = r"""
import errno, json, os, sys
r = {"write": {}, "exists": {}}
def try_write(path, mode="w"):
    try:
        with open(path, mode) as f:
            f.write("1")
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
for p in ["/usr/x", "/etc/x", "/x", "/opt/sandgate/x", "/opt/sandgate/agent.py", "/etc/passwd",
          "/workspace/x", "/tmp/x", "/dev/shm/x"]:
    r["write"][p] = try_write(p, "a" if p.endswith((".py", "passwd")) else "w")
for p in ["/proc/sys/kernel/hostname", "/proc/sys/vm/overcommit_ratio", "/proc/sysrq-trigger"]:
    r["write"][p] = try_write(p)
for p in ["/root", "/home", "/work", "/var", "/run", "/sys", "/srv", "/mnt", "/boot",
          "/etc/shadow", "/etc/gshadow", "/etc/ssh", "/etc/hostname", "/etc/resolv.conf",
          "/usr", "/etc/passwd", "/etc/ssl/certs", "/opt/sandgate/frames.py", *sys.argv[1:]]:
    r["exists"][p] = os.path.exists(p)
r["root_entries"] = sorted(os.listdir("/"))
r["etc_entries"] = sorted(os.listdir("/etc"))
r["passwd"] = open("/etc/passwd").read()
r["hosts"] = open("/etc/hosts").read()
print(json.dumps(r))
"""


def test_filesystem_view(rt: BwrapRuntime, env: Env) -> None:
    other = rt.sandboxes_dir / "someone-else" / "workspace"
    hidden = [str(rt.state_dir), str(env.root), str(other), "/var/lib/sandgate"]
    r = run(rt, py(FS_PROBE, *hidden)).json()
    w, e = r["write"], r["exists"]
    for p in ("/usr/x", "/etc/x", "/x", "/opt/sandgate/x", "/opt/sandgate/agent.py", "/etc/passwd"):
        assert w[p] in ("EROFS", "EACCES", "EPERM"), (p, w[p])
    for p in ("/workspace/x", "/tmp/x", "/dev/shm/x"):
        assert w[p] == "ok", (p, w[p])
    for p in ("/proc/sys/kernel/hostname", "/proc/sys/vm/overcommit_ratio"):
        assert w[p] in ("EROFS", "EACCES", "EPERM"), (p, w[p])
    assert w["/proc/sysrq-trigger"] in ("EROFS", "EACCES", "EPERM", "ENOENT")
    for p in ("/root", "/home", "/work", "/var", "/run", "/sys", "/srv", "/mnt", "/boot"):
        assert not e[p], p
    for p in ("/etc/shadow", "/etc/gshadow", "/etc/ssh", "/etc/hostname", "/etc/resolv.conf"):
        assert not e[p], p
    for p in hidden:
        assert not e[p], p
    assert e["/usr"] and e["/etc/passwd"] and e["/opt/sandgate/frames.py"]
    assert "sandbox:x:1000:1000::/workspace:/bin/bash" in r["passwd"]
    assert "127.0.0.1\tlocalhost" in r["hosts"]
    assert set(r["root_entries"]) <= {
        "bin", "sbin", "lib", "lib64", "lib32", "libx32", "usr", "etc", "dev", "proc", "tmp",
        "workspace", "opt",
    }  # fmt: skip
    assert "shadow" not in r["etc_entries"]
    # the host's real /proc/sys value was not changed
    assert Path("/proc/sys/kernel/hostname").read_text().strip() != "1"


def test_other_sandbox_workspace_is_unreachable(rt: BwrapRuntime) -> None:
    async def main() -> None:
        probe = py("import sys; print('up', flush=True); sys.stdin.read()")
        a = await rt.start(SandboxSpec(name=uniq("a")), argv=probe)
        b = await rt.start(SandboxSpec(name=uniq("b")), argv=probe)
        try:
            await readline(a)
            await readline(b)
            (a.workspace / "secret").write_text("a's data")
            os.chown(a.workspace / "secret", a.private["uid"], a.private["uid"])
            # inside b, a's host path does not exist at all
            check = py(
                "import os, sys; print(os.path.exists(sys.argv[1]), os.path.exists('/var'))",
                str(a.workspace / "secret"),
            )
            r = await run_async(rt, check)
            assert r.out.split() == ["False", "False"], r
            # and even on the host, b's uid cannot enter a's workspace (0700, owned by a)
            res = cat_as(b.private["uid"], a.workspace / "secret")
            assert res.returncode != 0 and "Permission denied" in res.stderr, res
        finally:
            await rt.stop(a)
            await rt.stop(b)

    asyncio.run(main())


# ------------------------------------------------------------------ pid / uts / net


PROC_PROBE = r"""
import json, os, socket
procs = {}
for e in os.listdir("/proc"):
    if e.isdigit():
        try:
            procs[e] = open(f"/proc/{e}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            pass
print(json.dumps({"procs": procs, "hostname": socket.gethostname(), "uname": os.uname().nodename}))
"""


def test_pid_and_uts_namespace(rt: BwrapRuntime) -> None:
    name = uniq("h")
    r = run(rt, py(PROC_PROBE), SandboxSpec(name=name)).json()
    assert r["hostname"] == r["uname"] == name
    procs = r["procs"]
    assert "1" in procs and "bwrap" in procs["1"]
    assert len(procs) <= 3, procs
    joined = " ".join(procs.values())
    for host_proc in ("postgres", "pytest", "systemd", "sshd", "uvicorn"):
        assert host_proc not in joined


NET_PROBE = r"""
import errno, json, socket, sys
def connect(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect((host, port))
        return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e)) if e.errno else type(e).__name__
    finally:
        s.close()
devs = sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:])
try:
    socket.getaddrinfo("example.com", 80)
    dns = "resolved"
except OSError as e:
    dns = type(e).__name__
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen()
own = connect("127.0.0.1", srv.getsockname()[1])
print(json.dumps({"devs": devs, "host_port": connect("127.0.0.1", int(sys.argv[1])),
                  "pg": connect("127.0.0.1", 5432), "far": connect("198.51.100.1", 80),
                  "dns": dns, "own_loopback": own}))
"""


def _host_devs() -> list[str]:
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return sorted(line.split(":")[0].strip() for line in lines)


def test_no_network_by_default(rt: BwrapRuntime) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        r = run(rt, py(NET_PROBE, str(port))).json()
    assert r["devs"] == ["lo"]
    assert r["host_port"] == "ECONNREFUSED"
    assert r["pg"] == "ECONNREFUSED"
    assert r["far"] in ("ENETUNREACH", "EHOSTUNREACH")
    assert r["dns"] != "resolved"
    assert r["own_loopback"] == "connected"


# ------------------------------------------------------------------ limits


MEMORY_PROBE = r"""
chunks = []
for i in range(1, 9):
    chunks.append(b"\x01" * (64 << 20))
    print(i * 64, flush=True)
"""


def test_memory_limit_kills_the_hog(rt: BwrapRuntime) -> None:
    if not rt.features()["limits"]["memory"]:
        pytest.skip("no memory limit on this host")

    async def main() -> tuple[Result, str, str]:
        sb = await rt.start(SandboxSpec(name=uniq("m"), memory_mb=128), argv=py(MEMORY_PROBE))
        try:
            limit = cgroup_file(sb, "memory.limit_in_bytes").read_text().strip()
            out, _ = await asyncio.wait_for(sb.process.communicate(), 60)
            oom = cgroup_file(sb, "memory.oom_control").read_text()
            assert sb.process.returncode is not None
            res = Result(sb.process.returncode, out.decode(), sb.private["log_path"].read_text(), 0)
            return res, limit, oom
        finally:
            await rt.stop(sb)

    res, limit, oom = asyncio.run(main())
    assert limit == str(128 << 20)
    assert res.rc != 0, res
    assert res.rc == 137 or "MemoryError" in res.err, res
    reached = [int(x) for x in res.out.split()]
    assert max(reached, default=0) <= 128, res
    if res.rc == 137:
        assert "oom_kill 1" in oom or "under_oom" in oom, oom


PIDS_PROBE = r"""
import os, time
n = 0
while n < 300:
    try:
        pid = os.fork()
    except BlockingIOError:
        print("EAGAIN", n, flush=True)
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    n += 1
else:
    print("NOLIMIT", n, flush=True)
"""


def test_pids_limit_stops_a_fork_loop(rt: BwrapRuntime) -> None:
    if not rt.features()["limits"]["pids"]:
        pytest.skip("no pids limit on this host")

    async def main() -> tuple[str, str]:
        sb = await rt.start(SandboxSpec(name=uniq("p"), pids=32), argv=py(PIDS_PROBE))
        try:
            line = await readline(sb)
            return line, cgroup_file(sb, "pids.max").read_text().strip()
        finally:
            await rt.stop(sb)

    line, pids_max = asyncio.run(main())
    assert pids_max == "32"
    word, count = line.split()
    assert word == "EAGAIN", line
    assert 0 < int(count) < 32
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


CPU_PROBE = r"""
import json, time
start, cpu0 = time.monotonic(), time.process_time()
while time.monotonic() - start < 1.0:
    pass
print(json.dumps({"cpu": time.process_time() - cpu0}), flush=True)
"""


def test_cpu_quota(rt: BwrapRuntime) -> None:
    if not rt.features()["limits"]["cpu"]:
        pytest.skip("no cpu limit on this host")

    async def main() -> tuple[dict[str, float], str, str]:
        sb = await rt.start(SandboxSpec(name=uniq("c"), cpus=0.5), argv=py(CPU_PROBE))
        try:
            quota = cgroup_file(sb, "cpu.cfs_quota_us").read_text().strip()
            period = cgroup_file(sb, "cpu.cfs_period_us").read_text().strip()
            return json.loads(await readline(sb)), quota, period
        finally:
            await rt.stop(sb)

    r, quota, period = asyncio.run(main())
    assert (quota, period) == ("50000", "100000")
    assert r["cpu"] < 0.75, r  # at most ~0.5 s of CPU in 1 s of wall time


# ------------------------------------------------------------------ lifecycle


MARKER_PROBE = r"""
import os, sys, time
for i in range(3):
    if os.fork() == 0:
        if i == 0:
            os.setsid()
        time.sleep(1000)
        os._exit(0)
print("ready", flush=True)
time.sleep(1000)
"""


def _cgroup_leaf_dirs(worker: str, name: str) -> list[Path]:
    host = cgroups.CgroupHost.detect()
    return [d / name for d in host.worker_dirs(worker) if (d / name).exists()]


def test_stop_leaves_nothing_and_is_idempotent(rt: BwrapRuntime) -> None:
    marker = f"sgmark-{secrets.token_hex(6)}"

    async def main() -> None:
        sb = await rt.start(SandboxSpec(name=uniq("k")), argv=py(MARKER_PROBE, marker))
        assert await readline(sb) == "ready"
        uid = sb.private["uid"]
        assert len(procs_with(marker)) >= 4
        leaves = _cgroup_leaf_dirs(rt.worker_name, sb.spec.name)
        assert len(leaves) >= 3
        sandbox_dir = sb.private["sandbox_dir"]
        assert sandbox_dir.is_dir()
        t = time.perf_counter()
        await rt.stop(sb)
        print(f"\nstop: {(time.perf_counter() - t) * 1000:.1f} ms")  # noqa: T201
        assert procs_with(marker) == []
        assert all(not d.exists() for d in leaves)
        assert not sandbox_dir.exists()
        assert sb.process.returncode is not None
        lease = rt.uids.try_lease(uid)
        assert lease is not None, "uid still leased after stop"
        lease.release()
        await rt.stop(sb)  # harmless

    asyncio.run(main())


def test_failed_start_is_rolled_back(rt: BwrapRuntime) -> None:
    host = cgroups.CgroupHost.detect()

    async def main() -> None:
        held = rt.uids.held()
        # a leaf cgroup already exists: the start fails after the uid, dirs and some cgroups
        name = uniq("f")
        blocker = host.worker_dirs(rt.worker_name)[-1] / name
        blocker.mkdir()
        try:
            with pytest.raises(WorkerError, match="cgroup"):
                await rt.start(SandboxSpec(name=name), argv=["/bin/true"])
        finally:
            blocker.rmdir()
        assert rt.uids.held() == held
        assert not (rt.sandboxes_dir / name).exists()
        assert _cgroup_leaf_dirs(rt.worker_name, name) == []

        # a duplicate name fails and leaves the running sandbox alone
        probe = py("import sys; print('up', flush=True); sys.stdin.read()")
        sb = await rt.start(SandboxSpec(name=uniq("d")), argv=probe)
        try:
            assert await readline(sb) == "up"
            with pytest.raises(WorkerError, match="already exists"):
                await rt.start(SandboxSpec(name=sb.spec.name), argv=["/bin/true"])
            assert rt.uids.held() == held | {sb.private["uid"]}
            assert sb.workspace.is_dir() and sb.process.returncode is None
            assert len(_cgroup_leaf_dirs(rt.worker_name, sb.spec.name)) >= 3
        finally:
            await rt.stop(sb)
        assert rt.uids.held() == held

    asyncio.run(main())
    with pytest.raises(InvalidRequestError):
        asyncio.run(rt.start(SandboxSpec(name="../etc"), argv=["/bin/true"]))
    with pytest.raises(InvalidRequestError):
        asyncio.run(rt.start(SandboxSpec(name="ok", env={"A=B": "x"}), argv=["/bin/true"]))


def test_prepare_cleans_up_a_discarded_runtime(env: Env) -> None:
    rt1 = other_runtime(env)
    worker = rt1.worker_name
    marker = f"sgmark-{secrets.token_hex(6)}"

    async def main() -> None:
        await rt1.prepare()
        sb = await rt1.start(SandboxSpec(name=uniq("l")), argv=py(MARKER_PROBE, marker))
        assert await readline(sb) == "ready"
        sandbox_dir = sb.private["sandbox_dir"]
        assert len(procs_with(marker)) >= 4
        # the runtime is dropped without stop(); a new one for the same worker starts up
        rt2 = env.runtime(worker)
        await rt2.prepare()
        assert procs_with(marker) == []
        assert not sandbox_dir.exists()
        assert _cgroup_leaf_dirs(worker, sb.spec.name) == []
        await asyncio.wait_for(sb.process.wait(), 5)
        sb.private["lease"].release()  # in a real crash the kernel drops the flock

    asyncio.run(main())


CRASH_CHILD = r"""
import asyncio, sys
from pathlib import Path
from sandgate.worker.runtime.base import SandboxSpec
from sandgate.worker.runtime.bwrap import BwrapRuntime

state, agent, worker, lock_dir, base, count, marker = sys.argv[1:]

async def main():
    rt = BwrapRuntime(Path(state), Path(agent), worker_name=worker, uid_base=int(base),
                      uid_count=int(count), uid_lock_dir=Path(lock_dir))
    await rt.prepare()
    sb = await rt.start(SandboxSpec(name="crashy"), argv=[
        "/usr/bin/python3", "-I", "-S", "-c",
        "import time; print('ready', flush=True); time.sleep(1000)", marker])
    line = await sb.process.stdout.readline()
    print(sb.private["uid"], line.decode().strip(), flush=True)
    await asyncio.sleep(1000)

asyncio.run(main())
"""


def test_crashed_worker_leaves_are_cleaned_and_uid_freed(env: Env) -> None:
    worker = f"t-{secrets.token_hex(3)}"
    env.workers.append(worker)
    marker = f"sgmark-{secrets.token_hex(6)}"
    state = env.root / "state" / worker
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CRASH_CHILD,
            str(state),
            str(env.agent_dir),
            worker,
            str(env.lock_dir),
            str(UID_BASE),
            str(UID_COUNT),
            marker,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        uid_s, ready = child.stdout.readline().split()
        assert ready == "ready"
        uid = int(uid_s)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    deadline = time.monotonic() + 5
    while procs_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert procs_with(marker) == [], "--die-with-parent did not end the sandbox"
    rt2 = env.runtime(worker)
    assert (state / "sandboxes" / "crashy").exists()
    asyncio.run(rt2.prepare())
    assert not (state / "sandboxes" / "crashy").exists()
    assert _cgroup_leaf_dirs(worker, "crashy") == []
    lease = rt2.uids.try_lease(uid)
    assert lease is not None, "a dead worker's uid lease was not freed"
    lease.release()


def test_start_latency(rt: BwrapRuntime) -> None:
    async def main() -> tuple[list[float], list[float]]:
        starts, firsts = [], []
        for _ in range(20):
            t = time.perf_counter()
            sb = await rt.start(SandboxSpec(name=uniq("t")), argv=["/bin/echo", "hi"])
            starts.append((time.perf_counter() - t) * 1000)
            try:
                assert await readline(sb) == "hi"
                firsts.append((time.perf_counter() - t) * 1000)
            finally:
                await rt.stop(sb)
        return starts, firsts

    starts, firsts = asyncio.run(main())
    print(  # noqa: T201
        f"\nstart(): median {statistics.median(starts):.2f} ms, max {max(starts):.2f} ms; "
        f"until first output of /bin/echo: median {statistics.median(firsts):.1f} ms"
    )
