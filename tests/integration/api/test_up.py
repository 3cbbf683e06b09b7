"""`sandgate up`, the all-in-one default, driven as a user would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from sandgate.cli.up import default_state_dir
from sandgate.worker.main import runtime_scope
from tests.integration.api.conftest import RUNTIME, free_port, wait_until
from tests.statedirs import remove_state

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root to set up")
TEST_STATE_ROOT = Path("/var/lib/sandgate-test")


def start_up(
    data_dir: Path,
    state_dir: Path | None,
    port: int,
    started: list[subprocess.Popen[str]] | None = None,
) -> tuple[subprocess.Popen[str], str]:
    """Start `sandgate up` (its default state dir when `state_dir` is None), adding it to
    `started`; wait for its banner."""
    args = ["up", "--port", str(port), "--data-dir", str(data_dir), "--runtime", RUNTIME]
    if state_dir is not None:
        args += ["--state-dir", str(state_dir)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandgate", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    if started is not None:
        started.append(proc)
    assert proc.stdout is not None
    banner = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        banner.append(line)
        if line.startswith("Ctrl-C"):
            break
    text = "".join(banner)
    assert f"http://127.0.0.1:{port}" in text, text
    assert "curl" in text
    key = next(line.split()[2] for line in banner if line.startswith("API key:"))
    return proc, key


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.stdout is not None:
            proc.stdout.close()


def kill(proc: subprocess.Popen[str]) -> None:
    """What a test that failed half-way leaves: nothing (Ctrl-C, then SIGKILL)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@dataclass
class Launched:
    """What a test started, stopped and removed whatever happens to it."""

    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    dirs: list[Path] = field(default_factory=list)

    def up(
        self, data_dir: Path, state_dir: Path | None, port: int
    ) -> tuple[subprocess.Popen[str], str]:
        return start_up(data_dir, state_dir, port, self.procs)

    def dir(self, path: Path | None = None) -> Path:
        """A directory to remove at the end (by default a new worker state dir)."""
        path = path if path is not None else TEST_STATE_ROOT / uuid.uuid4().hex[:10]
        self.dirs.append(path)
        return path


@pytest.fixture
def launched() -> Iterator[Launched]:
    started = Launched()
    try:
        yield started
    finally:
        for proc in started.procs:
            kill(proc)
        for path in started.dirs:
            remove_state(path)


def api(port: int, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


def wait_for_worker(c: httpx.Client) -> None:
    wait_until(
        lambda: any(w["connected"] for w in c.get("/api/v1/workers").json()["workers"]),
        timeout=60,
        what="the local worker",
    )


def create(c: httpx.Client, timeout: float = 30.0) -> str:
    """A new sandbox's name, retrying a 503 with the same Idempotency-Key as clients do (right
    after a restart the worker may not be attached yet)."""
    key = uuid.uuid4().hex
    deadline = time.monotonic() + timeout
    while True:
        created = c.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": key})
        if created.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert created.status_code in (200, 201), created.text
    return str(created.json()["name"])


def run_echo(c: httpx.Client, name: str) -> None:
    out = c.post(f"/api/v1/sandboxes/{name}/execute", json={"language": "bash", "code": "echo ok"})
    assert out.status_code == 200, out.text
    assert out.json()["stdout"] == "ok\n" and out.json()["exit_code"] == 0


def create_and_run(c: httpx.Client) -> str:
    """A new sandbox that ran `echo ok`; its name."""
    name = create(c)
    run_echo(c, name)
    return name


def sandbox_workspace(name: str) -> Path:
    """The sandbox's /workspace as its own processes see it (its disk is mounted in its mount
    namespace only): found through a process of its cgroup whose root holds a workspace."""
    found = subprocess.run(
        ["find", "/sys/fs/cgroup", "-name", "cgroup.procs", "-path", f"*/{name}/*"],
        capture_output=True,
        text=True,
    ).stdout.split()
    for procs in found:
        for pid in Path(procs).read_text().split():
            workspace = Path(f"/proc/{pid}/root/workspace")
            try:
                if workspace.is_dir():
                    return workspace
            except OSError:
                continue  # gone meanwhile
    raise AssertionError(f"no process of sandbox {name} sees a /workspace")


def workspace_uid(name: str) -> int | None:
    """The uid the running bwrap sandbox's workspace belongs to (its leased uid); other
    runtimes lease none."""
    return sandbox_workspace(name).stat().st_uid if RUNTIME == "bwrap" else None


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_no_leftovers(state_dir: Path, names: Iterable[str], uids: Iterable[int | None]) -> None:
    """No process, cgroup, mount or directory of these sandboxes, nor the worker's cgroups."""
    for name in names:
        assert not (state_dir / "local" / "sandboxes" / name).exists(), name
        found = subprocess.run(
            ["find", "/sys/fs/cgroup", "-name", name], capture_output=True, text=True
        ).stdout
        assert found == "", found
    scope = runtime_scope("local", state_dir / "local")  # the worker's own cgroup parents
    found = subprocess.run(
        ["find", "/sys/fs/cgroup", "-name", scope], capture_output=True, text=True
    ).stdout
    assert found == "", found
    if RUNTIME == "bwrap":  # a uid leased again by another worker on the host is not ours
        left = [p for uid in uids if uid is not None for p in _processes_of(uid)]
        assert [p for p in left if _in_scope_or_none(p, scope)] == [], left
    assert str(state_dir) not in Path("/proc/mounts").read_text()


def _processes_of(uid: int) -> list[int]:
    """Live (not zombie) processes running as `uid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                pass  # gone meanwhile
    return found


def _in_scope_or_none(pid: int, scope: str) -> bool:
    """In this worker's cgroups, or in no sandbox cgroup at all (escaped)."""
    try:
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    return scope in cgroups or "/sandgate/" not in cgroups


@needs_root
def test_up_serves_and_cleans_up_on_ctrl_c(tmp_path: Path, launched: Launched) -> None:
    data_dir = tmp_path / "data"
    state_dir = launched.dir()
    port = free_port()
    proc, key = launched.up(data_dir, state_dir, port)
    key_file = data_dir / "api-key"
    assert key_file.read_text().strip() == key
    assert (key_file.stat().st_mode & 0o777) == 0o600
    with api(port, key) as c:
        wait_for_worker(c)
        first = c.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "up-1"})
        again = c.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "up-1"})
        assert first.status_code == 201 and again.status_code == 200
        assert again.headers["Idempotent-Replayed"] == "true"
        name = first.json()["name"]
        assert again.json()["name"] == name
        run_echo(c, name)
        files = f"/api/v1/sandboxes/{name}/toolbox/files"
        assert c.put(files, params={"path": "in.txt"}, content=b"data").status_code == 200
        assert c.get(files, params={"path": "in.txt"}).content == b"data"
        second = c.post("/api/v1/sandboxes", json={}).json()["name"]
        uid = workspace_uid(second)
        assert c.delete(f"/api/v1/sandboxes/{name}").status_code == 204
    stop(proc)
    # Ctrl-C removed every sandbox it started: no process, cgroup, mount or directory left
    assert_no_leftovers(state_dir, [second], [uid])

    # a second run reuses the data dir and the key
    proc2, key2 = launched.up(data_dir, state_dir, port)
    assert key2 == key
    with api(port, key) as c:
        assert c.get("/api/v1/sandboxes").status_code == 200
    stop(proc2)


@needs_root
def test_sigkill_of_up_takes_its_worker_and_sandboxes_and_up_starts_again(
    tmp_path: Path, launched: Launched
) -> None:
    data_dir = tmp_path / "data"
    state_dir = launched.dir()
    port = free_port()
    proc, key = launched.up(data_dir, state_dir, port)
    with api(port, key) as c:
        wait_for_worker(c)
        name = create_and_run(c)
    uid = workspace_uid(name)
    (worker,) = children(proc.pid)
    proc.kill()
    proc.wait()
    wait_until(lambda: not alive(worker), timeout=30, what="the worker to die with `up`")
    assert_no_leftovers(state_dir, [name], [uid])

    # at once, on the same data dir: the first try works
    proc2, key2 = launched.up(data_dir, state_dir, port)
    assert key2 == key
    with api(port, key) as c:
        wait_for_worker(c)
        fresh = create_and_run(c)
        fresh_uid = workspace_uid(fresh)
        assert c.get(f"/api/v1/sandboxes/{name}").json()["state"] == "error"
    stop(proc2)
    assert_no_leftovers(state_dir, [name, fresh], [uid, fresh_uid])


@needs_root
def test_a_dead_worker_is_restarted_and_the_api_stays_up(
    tmp_path: Path, launched: Launched
) -> None:
    state_dir = launched.dir()
    port = free_port()
    proc, key = launched.up(tmp_path / "data", state_dir, port)
    statuses: list[int | str] = []
    done = threading.Event()

    def execute_in_a_loop(name: str) -> None:
        with api(port, key) as c:
            while not done.is_set():
                try:
                    answer = c.post(
                        f"/api/v1/sandboxes/{name}/execute",
                        json={"language": "bash", "code": "echo ok"},
                    )
                    statuses.append(answer.status_code)
                except httpx.HTTPError as exc:
                    statuses.append(type(exc).__name__)
                time.sleep(0.05)

    with api(port, key) as c:
        wait_for_worker(c)
        old = create_and_run(c)
        uids = [workspace_uid(old)]
        looper = threading.Thread(target=execute_in_a_loop, args=(old,))
        looper.start()
        try:
            wait_until(lambda: len(statuses) >= 3, what="executes before the kill")
            (worker,) = children(proc.pid)
            os.kill(worker, signal.SIGKILL)
            wait_until(
                lambda: [p for p in children(proc.pid) if p != worker],
                timeout=30,
                what="a new worker",
            )
            wait_until(
                lambda: c.get(f"/api/v1/sandboxes/{old}").json()["state"] == "error",
                timeout=30,
                what="the old sandbox reported error",
            )
            new = create(c)  # on the new worker
            uids.append(workspace_uid(new))
            run_echo(c, new)
        finally:
            done.set()
            looper.join(timeout=70)
    assert proc.poll() is None, "the API stopped with its worker"
    assert len(statuses) > 3
    # while the worker was away: answers or refusals to retry, never a 500 nor a dropped link
    assert all(s in (409, 503) or (isinstance(s, int) and s < 300) for s in statuses), statuses
    stop(proc)
    assert_no_leftovers(state_dir, [old, new], uids)


@needs_root
def test_two_ups_in_two_directories_coexist_with_their_default_state_dirs(
    tmp_path: Path, launched: Launched
) -> None:
    # one where sandbox uids can traverse to the data dir (state inside it), one where they
    # cannot (a 0700 parent, as a home directory: state under /var/lib/sandgate-up)
    open_parent = launched.dir()
    open_parent.mkdir(parents=True, mode=0o755)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    data_dirs = [open_parent / ".sandgate", private / ".sandgate"]
    states = [data_dirs[0] / "state", launched.dir(default_state_dir(data_dirs[1]))]
    assert states[1].is_relative_to("/var/lib/sandgate-up")
    ports = [free_port(), free_port()]
    procs = [launched.up(d, None, port)[0] for d, port in zip(data_dirs, ports, strict=True)]
    names, uids = [], []
    for data_dir, state, port in zip(data_dirs, states, ports, strict=True):
        key = (data_dir / "api-key").read_text().strip()
        with api(port, key) as c:
            wait_for_worker(c)
            names.append(create_and_run(c))
        assert (state / "local" / "sandboxes" / names[-1]).is_dir()
        if RUNTIME == "bwrap":
            assert sandbox_workspace(names[-1]).is_dir()
        uids.append(workspace_uid(names[-1]))
    assert [p.poll() for p in procs] == [None, None]
    assert (data_dirs[0].stat().st_mode & 0o777) == 0o711  # traversed, not listed
    for data_dir in data_dirs:
        for secret in ("api-key", "worker-token", "secret", "sandgate.db"):
            assert ((data_dir / secret).stat().st_mode & 0o777) == 0o600, secret
    for proc, state, name, uid in zip(procs, states, names, uids, strict=True):
        stop(proc)
        assert_no_leftovers(state, [name], [uid])


def _one_line_error(args: list[str], env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "sandgate", "up", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode != 0
    output = (result.stdout + result.stderr).strip()
    assert "Traceback" not in output
    assert len(output.splitlines()) == 1, output
    return output


def test_a_port_in_use_is_one_line_naming_it(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _one_line_error(
            ["--port", str(port), "--data-dir", str(tmp_path / "data"), "--runtime", "process"]
        )
    assert line.startswith("error: ") and f"port {port}" in line and "--port" in line


@needs_root
def test_missing_bwrap_is_one_line_saying_what_to_install(tmp_path: Path) -> None:
    no_bwrap = tmp_path / "bin"  # a PATH without bwrap; the machine's stays as it is
    no_bwrap.mkdir()
    line = _one_line_error(
        ["--port", str(free_port()), "--data-dir", str(tmp_path / "data"), "--runtime", "bwrap"],
        env={**os.environ, "PATH": str(no_bwrap)},
    )
    assert "bwrap not found" in line and "apt-get install -y bubblewrap" in line, line
    assert "--runtime process" in line


@needs_root
def test_the_cli_next_to_the_data_dir_calls_the_port_up_serves_on(
    tmp_path: Path, launched: Launched
) -> None:
    project = tmp_path / "project"
    port = free_port()
    proc, key = launched.up(project / ".sandgate", launched.dir(), port)
    assert (project / ".sandgate" / "url").read_text().strip() == f"http://127.0.0.1:{port}"
    with api(port, key) as c:
        wait_for_worker(c)
        # as a user types it in the directory holding .sandgate: no --url, no environment
        env = {k: v for k, v in os.environ.items() if not k.startswith("SANDGATE_")}
        created = subprocess.run(
            [sys.executable, "-m", "sandgate", "sandbox", "create"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert created.returncode == 0, created.stderr
        name = created.stdout.strip()
        assert c.get(f"/api/v1/sandboxes/{name}").json()["state"] == "running"
    stop(proc)
