"""The Python SDK (`sandgate.client`) against a real server, worker and bwrap sandboxes.

Faults are made by the tests' one fault proxy (tests/faultproxy.py, opened by the
`fault_proxy` fixture) between the SDK and the server (an outside system, the network, is the
only double): with an HTTP rule it drops a connection after the server has answered, or cuts
an answer after some bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from sandgate.client import (
    APIConnectionError,
    AsyncSandgate,
    AuthenticationError,
    CodeContext,
    ConflictError,
    ExecJob,
    ExecJobTimeoutError,
    ExecutionError,
    InvalidRequestError,
    NotFoundError,
    OutputMessage,
    PermissionDeniedError,
    Result,
    Sandbox,
    Sandgate,
    Terminal,
    UnavailableError,
)
from tests.faultproxy import OpenProxy, Seen, first_n
from tests.integration.api.conftest import (
    Deployment,
    deployment,  # noqa: F401 (the session fixture, shared with the API tests' module)
    free_port,
    start_deployment,
    wait_until,
)
from tests.integration.api.test_up import start_up, stop
from tests.statedirs import remove_state

BIG = 50 * 1024 * 1024


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture
def sg(deployment: Deployment) -> Iterator[Sandgate]:  # noqa: F811 (pytest fixture injection)
    with Sandgate(deployment.url, deployment.keys["alpha"]) as client:
        yield client


@pytest.fixture
def box(sg: Sandgate) -> Iterator[Sandbox]:
    created = sg.sandboxes.create(metadata={"test": "sdk"})
    yield created
    with contextlib.suppress(NotFoundError):
        created.delete()


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("big") / "big.bin"
    digest = hashlib.sha256()
    with path.open("wb") as handle:
        for _ in range(BIG // (1 << 20)):
            piece = os.urandom(1 << 20)
            digest.update(piece)
            handle.write(piece)
    return path, digest.hexdigest()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while piece := handle.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


# ------------------------------------------------------------------------------ sandboxes


def test_sandbox_lifecycle(sg: Sandgate) -> None:
    tag = uuid.uuid4().hex
    box = sg.sandboxes.create(timeout=120, metadata={"tag": tag}, env={"GREETING": "hej"})
    assert box.state == "running" and box.name.startswith("sbx-")
    assert box.metadata["tag"] == tag and box.timeout == 120
    assert box.run("echo $GREETING").stdout == "hej\n"

    got = sg.sandboxes.get(box.name)
    assert got.name == box.name and got.created_at == box.created_at
    assert [s.name for s in sg.sandboxes.list(metadata={"tag": tag})] == [box.name]
    assert box.name in {s.name for s in sg.sandboxes.list(state="running")}

    before = box.expires_at
    assert before is not None
    box.set_timeout(3000)
    assert box.expires_at is not None and box.expires_at > before

    box.delete()
    assert box.state == "deleted"
    with pytest.raises(NotFoundError) as caught:
        sg.sandboxes.get(box.name)
    assert caught.value.status == 404 and caught.value.code == "not_found"
    assert sg.sandboxes.list(metadata={"tag": tag}) == []
    assert [s.state for s in sg.sandboxes.list(state="deleted", metadata={"tag": tag})] == [
        "deleted"
    ]
    with pytest.raises(NotFoundError):
        sg.sandboxes.delete(box.name)  # no retry happened: a second delete is a 404


def test_list_walks_every_page(sg: Sandgate) -> None:
    tag = uuid.uuid4().hex
    made = {sg.sandboxes.create(metadata={"page": tag}).name for _ in range(5)}
    try:
        listed = sg.sandboxes.list(metadata={"page": tag}, page_size=2)
        assert [s.name for s in listed] == sorted(made)
    finally:
        for name in made:
            sg.sandboxes.delete(name)


def test_run(box: Sandbox) -> None:
    result = box.run("echo out; echo err >&2; exit 3")
    assert (result.stdout, result.stderr, result.exit_code) == ("out\n", "err\n", 3)
    assert not result.ok and not result.timed_out and result.duration_ms >= 0
    assert box.run("print(6 * 7)", language="python").stdout == "42\n"
    assert box.run("pwd; echo $X", cwd="/tmp", env={"X": "y"}).stdout == "/tmp\ny\n"
    slow = box.run("sleep 5", timeout=0.5)
    assert slow.timed_out and slow.exit_code == 124


def test_errors_carry_status_and_code(deployment: Deployment, sg: Sandgate, box: Sandbox) -> None:  # noqa: F811
    with pytest.raises(NotFoundError) as missing:
        sg.sandboxes.get("sbx-doesnotexist")
    assert missing.value.code == "not_found" and "not found" in missing.value.message

    with Sandgate(deployment.url, "sg_not_a_key", max_retries=0) as stranger:
        with pytest.raises(AuthenticationError) as refused:
            stranger.sandboxes.list()
    assert refused.value.status == 401 and refused.value.code == "unauthorized"

    with pytest.raises(InvalidRequestError) as invalid:
        sg.sandboxes.create(resources={"memory_mb": 1})
    assert invalid.value.status == 422 and invalid.value.code == "validation_error"
    with pytest.raises(NotFoundError) as bad:
        sg.sandboxes.create(template="no-such-template")
    assert bad.value.status == 404 and bad.value.code == "template_not_found"

    with pytest.raises(PermissionDeniedError) as outside:
        box.files.read("../../etc/passwd")
    assert outside.value.code == "path_outside_sandbox"
    box.files.mkdir("d")
    with pytest.raises(ConflictError):
        box.files.mkdir("d", parents=False)

    with Sandgate(deployment.url, deployment.keys["beta"]) as beta:
        with pytest.raises(NotFoundError):
            beta.sandboxes.get(box.name)  # another tenant's sandbox does not exist for beta


def test_default_url_and_key(
    deployment: Deployment,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.delenv("SANDGATE_API_KEY", raising=False)
    monkeypatch.setenv("SANDGATE_URL", deployment.url)
    monkeypatch.chdir(tmp_path)
    with Sandgate(max_retries=0) as anonymous, pytest.raises(AuthenticationError):
        anonymous.sandboxes.list()  # no key anywhere: the server says so
    (tmp_path / ".sandgate").mkdir()
    (tmp_path / ".sandgate" / "api-key").write_text(deployment.keys["alpha"] + "\n")
    with Sandgate() as from_file:
        assert from_file.url == deployment.url
        from_file.sandboxes.list()
    monkeypatch.setenv("SANDGATE_API_KEY", deployment.keys["beta"])
    with Sandgate() as from_env:
        assert isinstance(from_env.sandboxes.list(), list)


# ------------------------------------------------------------------------------ files


def test_files_50mb_streamed_both_ways(
    box: Sandbox, big_file: tuple[Path, str], tmp_path: Path
) -> None:
    path, digest = big_file
    seen: list[tuple[int, int | None]] = []
    tracemalloc.start()
    try:
        entry = box.files.write("data/big.bin", path, progress=lambda d, t: seen.append((d, t)))
        _, upload_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        out = tmp_path / "back.bin"
        size = box.files.download("data/big.bin", out)
        _, download_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert entry.size == BIG and entry.path == "/workspace/data/big.bin" and entry.type == "file"
    assert size == BIG and sha256_of(out) == digest
    # streamed: never the whole file in memory on the client
    assert upload_peak < 12 << 20, upload_peak
    assert download_peak < 12 << 20, download_peak
    assert seen[-1] == (BIG, BIG) and len(seen) >= 50
    assert box.run("sha256sum data/big.bin").stdout.split()[0] == digest
    assert [p.name for p in tmp_path.iterdir()] == ["back.bin"]  # no partial file left


def test_file_operations(box: Sandbox, tmp_path: Path) -> None:
    assert box.files.write("a/b/hello.txt", "hello\n").size == 6
    assert box.files.read("a/b/hello.txt") == b"hello\n"
    with (tmp_path / "src.bin").open("wb") as handle:
        handle.write(b"\x00\xffxyz")
    with (tmp_path / "src.bin").open("rb") as handle:
        handle.read(2)  # a file object is sent from where it stands
        assert box.files.write("/tmp/t.bin", handle).size == 3
    assert box.files.read("/tmp/t.bin") == b"xyz"
    sink = (tmp_path / "sink.bin").open("wb")
    with sink:
        assert box.files.download("/tmp/t.bin", sink) == 3
    assert (tmp_path / "sink.bin").read_bytes() == b"xyz"

    stat = box.files.stat("a/b/hello.txt")
    assert stat.name == "hello.txt" and stat.type == "file" and not stat.is_dir
    assert [e.name for e in box.files.list("a/b")] == ["hello.txt"]
    assert box.files.mkdir("x/y").is_dir
    moved = box.files.move("a/b/hello.txt", "x/y/h.txt")
    assert moved.path == "/workspace/x/y/h.txt"
    assert not box.files.exists("a/b/hello.txt") and box.files.exists("x/y/h.txt")
    with pytest.raises(ConflictError):
        box.files.remove("x")  # not empty
    box.files.remove("x", recursive=True)
    with pytest.raises(NotFoundError):
        box.files.stat("x")


# ------------------------------------------------------------------------------ processes


def test_process_output_stdin_and_kill(box: Sandbox) -> None:
    process = box.processes.start("for i in 1 2 3; do echo line $i; done; echo oops >&2")
    assert process.pid > 0 and process.state in ("running", "exited")
    events = list(process.output())
    stdout = b"".join(e.data for e in events if e.stream == "stdout")
    stderr = b"".join(e.data for e in events if e.stream == "stderr")
    assert (stdout, stderr) == (b"line 1\nline 2\nline 3\n", b"oops\n")
    assert [e.offset for e in events] == sorted(e.offset for e in events)
    assert process.exit_code == 0 and process.wait() == 0

    binary = box.processes.start(r"printf 'a\xff\xfeb'")
    assert b"".join(e.data for e in binary.output()) == b"a\xff\xfeb"  # base64 on the wire

    cat = box.processes.start("cat")
    assert cat.send_stdin("hello\n") == 6
    assert cat.send_stdin(b"\x00bytes\n") == 7
    cat.close_stdin()
    assert b"".join(e.data for e in cat.output()) == b"hello\n\x00bytes\n"
    assert cat.exit_code == 0

    sleeper = box.processes.start("sleep 300", env={"A": "b"}, cwd="/tmp")
    assert sleeper.refresh().state == "running"
    sleeper.kill()
    assert sleeper.wait(timeout=10) == 128 + 15

    doomed = box.processes.start("sleep 300")
    doomed.kill("KILL")
    assert doomed.wait(timeout=10) == 128 + 9

    listed = {p.pid: p for p in box.processes.list()}
    assert listed[cat.pid].exit_code == 0 and listed[sleeper.pid].state == "exited"
    assert box.processes.get(cat.pid).command == "cat"
    with pytest.raises(NotFoundError):
        box.processes.get(999_999)


def test_output_is_live(box: Sandbox) -> None:
    process = box.processes.start("echo first; read go; echo second")
    stream = process.output()
    assert next(stream).data == b"first\n"
    assert process.refresh().state == "running"  # not held back until the exit: it waits on us
    process.send_stdin(b"go\n")
    assert [e.data for e in stream] == [b"second\n"]
    assert process.exit_code == 0


def test_two_followers_get_10000_lines_in_order(box: Sandbox) -> None:
    process = box.processes.start("for i in $(seq 1 10000); do echo line-$i; done")
    expected = "".join(f"line-{i}\n" for i in range(1, 10001)).encode()
    results: list[bytes] = [b"", b""]

    def follow(slot: int) -> None:
        results[slot] = b"".join(e.data for e in box.processes.get(process.pid).output())

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results[0] == expected and results[1] == expected


def test_output_resumes_where_a_broken_stream_stopped(
    deployment: Deployment,  # noqa: F811
    box: Sandbox,
    fault_proxy: OpenProxy,
) -> None:
    # output spread over time, so it arrives as many small events
    process = box.processes.start("for i in $(seq 1 400); do echo n$i; sleep 0.005; done")
    expected = "".join(f"n{i}\n" for i in range(1, 401)).encode()
    stream_path = f"/api/v1/sandboxes/{box.name}/toolbox/processes/{process.pid}/stream"
    # the first two streams are cut after 2000 bytes of answer (mid-event, most likely)
    proxy = fault_proxy(deployment.url, rule=first_n(2, "GET", "/stream", 2000))
    with Sandgate(proxy.url, deployment.keys["alpha"]) as client:
        again = client.sandboxes.get(box.name).processes.get(process.pid)
        received = b"".join(e.data for e in again.output())
        streams = proxy.count("GET", stream_path)
    assert received == expected
    assert again.exit_code == 0
    offsets = [int(s.target.split("offset=")[1]) for s in streams]
    assert len(offsets) == 3 and offsets[0] == 0 and 0 < offsets[1] <= offsets[2]


# ------------------------------------------------------------------------------ exec jobs


def test_exec_job_submit_wait_get_list(
    deployment: Deployment,  # noqa: F811
    sg: Sandgate,
    box: Sandbox,
) -> None:
    job = box.submit_exec_job("pwd; echo $X; echo err >&2", env={"X": "y"}, cwd="/tmp")
    assert isinstance(job, ExecJob) and job.id and not job.replayed
    assert (job.sandbox, job.command, job.timeout) == (box.name, "pwd; echo $X; echo err >&2", 30)
    assert job.state in ("queued", "running", "succeeded") and job.created_at is not None
    done = box.wait_exec_job(job.id, timeout=30)
    assert (done.id, done.state, done.exit_code) == (job.id, "succeeded", 0)
    assert (done.stdout, done.stderr, done.error) == ("/tmp\ny\n", "err\n", None)
    assert done.ok and done.done and not done.stdout_truncated and not done.stderr_truncated
    created, started, finished = done.created_at, done.started_at, done.finished_at
    assert created is not None and started is not None and finished is not None
    assert created <= started <= finished

    failing = box.submit_exec_job("echo bad; exit 3")
    failed = sg.wait_exec_job(failing.id, timeout=30)  # the client finds any job by id
    assert (failed.state, failed.exit_code, failed.stdout) == ("failed", 3, "bad\n")
    assert failed.done and not failed.ok and failed.error
    slow = box.wait_exec_job(box.submit_exec_job("sleep 5", timeout=0.5).id, timeout=30)
    assert (slow.state, slow.exit_code) == ("failed", 124)
    assert slow.error is not None and "timed out" in slow.error

    sleeper = box.submit_exec_job("sleep 2; echo woke")
    began = time.monotonic()
    with pytest.raises(ExecJobTimeoutError) as waited:
        box.wait_exec_job(sleeper.id, timeout=0.3, poll=0.1)
    # it waited its whole timeout (a lower bound, never flaky) and gave up before the job's
    # 2 s were over: the job is still queued or running (below)
    assert time.monotonic() - began >= 0.3
    assert isinstance(waited.value, TimeoutError) and waited.value.status is None
    assert waited.value.job.id == sleeper.id and waited.value.job.state in ("queued", "running")
    assert box.wait_exec_job(sleeper.id, timeout=30).stdout == "woke\n"  # it went on

    assert sg.get_exec_job(job.id) == done
    assert box.get_exec_job(failing.id).exit_code == 3
    listed = box.list_exec_jobs()
    assert [j.id for j in listed] == [sleeper.id, slow.id, failing.id, job.id]  # newest first
    # lists carry no output: the job read by id has it
    assert listed[-1] == dataclasses.replace(done, stdout="", stderr="")
    assert [j.id for j in box.list_exec_jobs(limit=2)] == [sleeper.id, slow.id]

    with pytest.raises(NotFoundError) as missing:
        sg.get_exec_job("0" * 32)
    assert missing.value.code == "not_found"
    with Sandgate(deployment.url, deployment.keys["beta"]) as beta:
        with pytest.raises(NotFoundError):
            beta.get_exec_job(job.id)  # another tenant's job does not exist for beta
    with pytest.raises(NotFoundError):
        replace(box, name="sbx-nothere").submit_exec_job("true")
    with pytest.raises(ValueError):
        box.wait_exec_job(job.id, poll=0)


def test_exec_job_idempotency_key_runs_once(box: Sandbox) -> None:
    key = f"job-{uuid.uuid4().hex}"
    command = "echo ran >> /workspace/runs; echo done"
    first = box.submit_exec_job(command, idempotency_key=key)
    second = box.submit_exec_job(command, idempotency_key=key)
    assert second.id == first.id and second.replayed and not first.replayed
    finished = box.wait_exec_job(first.id, timeout=30)
    assert (finished.state, finished.stdout) == ("succeeded", "done\n")
    third = box.submit_exec_job(command, idempotency_key=key)  # after it finished: the result
    assert (third.id, third.state, third.stdout, third.replayed) == (
        first.id,
        "succeeded",
        "done\n",
        True,
    )
    assert box.files.read("runs") == b"ran\n"  # the command ran once
    assert [j.id for j in box.list_exec_jobs()] == [first.id]

    with pytest.raises(InvalidRequestError) as reused:
        box.submit_exec_job("echo other >> /workspace/runs", idempotency_key=key)
    assert reused.value.status == 422 and reused.value.code == "idempotency_key_reused"
    with pytest.raises(InvalidRequestError):
        box.submit_exec_job(command, timeout=5, idempotency_key=key)  # another body, too
    assert box.files.read("runs") == b"ran\n"
    other = box.submit_exec_job(command)  # no key: a new uuid4 per call, so a new job
    assert other.id != first.id and box.wait_exec_job(other.id, timeout=30).ok
    assert box.files.read("runs") == b"ran\nran\n"


def test_a_retried_exec_job_submit_runs_once(
    deployment: Deployment,  # noqa: F811
    box: Sandbox,
    fault_proxy: OpenProxy,
) -> None:
    path = f"/api/v1/sandboxes/{box.name}/exec-jobs"
    # the first two answers are lost after the server accepted the job
    proxy = fault_proxy(deployment.url, rule=first_n(2, "POST", "/exec-jobs"))
    with Sandgate(proxy.url, deployment.keys["alpha"], max_retries=3) as client:
        through = client.sandboxes.get(box.name)
        job = through.submit_exec_job("echo once >> /workspace/retried")
        submits = proxy.count("POST", path)
        done = through.wait_exec_job(job.id, timeout=30)
    assert len(submits) == 3 and job.replayed
    keys = {s.headers["idempotency-key"] for s in submits}
    assert len(keys) == 1 and uuid.UUID(keys.pop()).version == 4
    assert done.ok
    assert box.files.read("retried") == b"once\n"
    assert [j.id for j in box.list_exec_jobs()] == [job.id]


# ------------------------------------------------------------------------------ terminals


class Screen:
    """What a terminal printed so far; `expect` waits for text after the last match."""

    def __init__(self, term: Terminal) -> None:
        self.term = term
        self.seen = b""
        self.mark = 0

    def expect(self, wanted: bytes, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while (found := self.seen.find(wanted, self.mark)) < 0:
            left = deadline - time.monotonic()
            assert left > 0, f"no {wanted!r} in {self.seen[self.mark :]!r}"
            data = self.term.recv(timeout=left)
            assert data is not None, f"the terminal ended before {wanted!r}: {self.seen!r}"
            self.seen += data
        self.mark = found + len(wanted)


def test_pty_echo_resize_and_exit(box: Sandbox) -> None:
    with box.pty(cols=100, rows=30) as term:
        screen = Screen(term)
        term.send(b"stty size; echo h''i\r")
        screen.expect(b"30 100")
        screen.expect(b"hi\r\n")
        term.resize(120, 40)
        term.send("stty size\r")
        screen.expect(b"40 120")
        term.send(b"sleep 30\r")
        time.sleep(0.3)
        term.send(b"\x03")  # Ctrl-C reaches the remote foreground job
        term.send(b"echo after-$((6*7))\r")
        screen.expect(b"after-42")
        term.send(b"exit 7\r")
        while term.recv(timeout=10) is not None:
            pass
        assert term.exit_code == 7
    with box.pty(command="echo one-shot") as term:
        Screen(term).expect(b"one-shot")
        while term.recv(timeout=10) is not None:
            pass
        assert term.exit_code == 0


def test_pty_errors(deployment: Deployment, box: Sandbox) -> None:  # noqa: F811
    with Sandgate(deployment.url, "sg_wrong", max_retries=0) as stranger:
        with pytest.raises(AuthenticationError) as refused:
            replace(box, _api=stranger._api).pty()
    assert refused.value.status == 401
    with pytest.raises(NotFoundError):
        replace(box, name="sbx-nothere").pty()
    token = box.pty_token(ttl=30)
    assert token.token and token.expires_at is not None


# ------------------------------------------------------------------------------ retries


def test_a_retried_create_makes_one_sandbox(
    deployment: Deployment,  # noqa: F811
    fault_proxy: OpenProxy,
) -> None:
    tag = uuid.uuid4().hex
    # the server creates the sandbox twice over... or would, without one Idempotency-Key:
    # the first two answers are lost after the server has made the sandbox
    proxy = fault_proxy(deployment.url, rule=first_n(2, "POST", "/api/v1/sandboxes"))
    with Sandgate(proxy.url, deployment.keys["alpha"], max_retries=3) as client:
        box = client.sandboxes.create(metadata={"tag": tag})
        creates = proxy.count("POST", "/api/v1/sandboxes")
    try:
        assert len(creates) == 3
        keys = {s.headers["idempotency-key"] for s in creates}
        assert len(keys) == 1 and uuid.UUID(keys.pop()).version == 4
        with Sandgate(deployment.url, deployment.keys["alpha"]) as direct:
            found = direct.sandboxes.list(metadata={"tag": tag})
            assert [s.name for s in found] == [box.name]
            assert found[0].run("echo ok").stdout == "ok\n"
    finally:
        with Sandgate(deployment.url, deployment.keys["alpha"]) as direct:
            direct.sandboxes.delete(box.name)


def test_a_given_idempotency_key_is_used_and_reused(
    deployment: Deployment,  # noqa: F811
    fault_proxy: OpenProxy,
) -> None:
    tag = uuid.uuid4().hex
    key = f"mine-{tag}"
    proxy = fault_proxy(deployment.url, rule=first_n(1, "POST", "/api/v1/sandboxes"))
    with Sandgate(proxy.url, deployment.keys["alpha"]) as client:
        box = client.sandboxes.create(metadata={"tag": tag}, idempotency_key=key)
        again = client.sandboxes.create(metadata={"tag": tag}, idempotency_key=key)
        creates = proxy.count("POST", "/api/v1/sandboxes")
    try:
        assert {s.headers["idempotency-key"] for s in creates} == {key}
        assert again.name == box.name
        with Sandgate(deployment.url, deployment.keys["alpha"]) as direct:
            assert len(direct.sandboxes.list(metadata={"tag": tag})) == 1
    finally:
        with Sandgate(deployment.url, deployment.keys["alpha"]) as direct:
            direct.sandboxes.delete(box.name)


def test_execute_is_not_retried_once_sent(
    deployment: Deployment,  # noqa: F811
    box: Sandbox,
    fault_proxy: OpenProxy,
) -> None:
    proxy = fault_proxy(deployment.url, rule=first_n(1, "POST", "/execute"))
    with Sandgate(proxy.url, deployment.keys["alpha"], max_retries=3) as client:
        through = client.sandboxes.get(box.name)
        with pytest.raises(APIConnectionError):
            through.run("echo ran >> /workspace/runs")
        assert len(proxy.count("POST", f"/api/v1/sandboxes/{box.name}/execute")) == 1
    assert box.files.read("runs") == b"ran\n"  # it ran once, and only once


def test_connect_errors_are_retried_even_for_execute(
    deployment: Deployment,  # noqa: F811
    box: Sandbox,
    fault_proxy: OpenProxy,
) -> None:
    port = free_port()

    def later() -> None:
        time.sleep(0.7)  # the first attempts find nothing listening
        fault_proxy(deployment.url, port=port)  # a plain forwarder, stopped after the test

    timer = threading.Thread(target=later)
    timer.start()
    try:
        with Sandgate(f"http://127.0.0.1:{port}", deployment.keys["alpha"], max_retries=6) as c:
            sandbox = replace(box, _api=c._api)
            began = time.monotonic()
            assert sandbox.run("echo once >> /workspace/count").exit_code == 0
            assert time.monotonic() - began >= 0.6
    finally:
        timer.join()
    assert box.files.read("count") == b"once\n"


@pytest.mark.slow
def test_503_is_retried_after_retry_after(tmp_path: Path) -> None:
    dep = start_deployment(tmp_path, worker=False)
    try:
        with Sandgate(dep.url, dep.keys["alpha"], max_retries=0) as impatient:
            with pytest.raises(UnavailableError) as full:
                impatient.sandboxes.create()
        assert full.value.status == 503 and full.value.code == "no_capacity"
        assert full.value.retry_after is not None and full.value.retry_after >= 1

        tag = uuid.uuid4().hex
        result: list[Sandbox] = []
        with Sandgate(dep.url, dep.keys["alpha"], max_retries=3) as patient:
            began = time.monotonic()
            creating = threading.Thread(
                target=lambda: result.append(patient.sandboxes.create(metadata={"tag": tag}))
            )
            creating.start()
            dep.start_worker()
            creating.join(timeout=60)
            assert result, "the create never succeeded"
            assert time.monotonic() - began >= full.value.retry_after * 0.9
            assert [s.name for s in patient.sandboxes.list(metadata={"tag": tag})] == [
                result[0].name
            ]
            result[0].delete()
    finally:
        dep.stop()
        remove_state(dep.state_dir)  # its mounts first (tests/statedirs.py)


# ------------------------------------------------------------------------------ code contexts

LIVE = "import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')\nx + 1"


def test_run_code_keeps_state_streams_and_reports_errors(box: Sandbox) -> None:
    first = box.run_code("x = 41")
    assert (first.results, first.error, first.execution_count) == ([], None, 1)
    assert first.context == "default"
    seen: list[tuple[OutputMessage, float]] = []
    execution = box.run_code(LIVE, on_stdout=lambda m: seen.append((m, time.monotonic())))
    returned = time.monotonic()
    assert execution.text == "42" and execution.execution_count == 2
    assert "".join(execution.stdout) == "first\nsecond\n" and execution.stderr == []
    assert [m.text for m, _ in seen] == execution.stdout and seen[0][0].stream == "stdout"
    assert seen[0][0].timestamp is not None
    assert returned - seen[0][1] > 1.5, "the first line came as it was printed, not at the end"
    (main,) = execution.results
    assert main.is_main_result and main.formats() == ["text/plain"]

    errors: list[ExecutionError] = []
    failed = box.run_code("import sys; print('oops', file=sys.stderr); 1/0", on_error=errors.append)
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert "division by zero" in failed.error.value and "ZeroDivision" in failed.error.traceback
    assert errors == [failed.error] and failed.stderr == ["oops\n"] and not failed.ok
    assert box.run_code("x").text == "41", "a failed run keeps the state"

    shown: list[Result] = []
    html = "from IPython.display import HTML, display\ndisplay(HTML('<b>hi</b>'))\n7"
    both = box.run_code(html, on_result=shown.append)
    assert [r.html for r in shown] == ["<b>hi</b>", None] and shown == both.results
    assert both.text == "7" and not shown[0].is_main_result
    env = box.run_code("import os; os.environ.get('ONLY')", env={"ONLY": "here"})
    assert env.text == "'here'"
    late = box.run_code("import time; time.sleep(30)", timeout=1)
    assert late.error is not None and late.error.name == "TimeoutError"


def test_code_contexts_are_isolated_restart_and_delete(box: Sandbox) -> None:
    box.run_code("x = 'default'")
    ctx = box.contexts.create(cwd="/tmp")
    assert isinstance(ctx, CodeContext) and (ctx.language, ctx.cwd) == ("python", "/tmp")
    isolated = box.run_code("x", context=ctx)
    assert isolated.error is not None and isolated.error.name == "NameError"
    assert isolated.context == ctx.id
    assert box.run_code("import os; x = os.getcwd()", context=ctx.id).error is None
    assert box.run_code("x", context=ctx).text == "'/tmp'"
    assert box.run_code("x").text == "'default'"
    assert {c.id for c in box.contexts.list()} == {"default", ctx.id}

    assert box.contexts.restart(ctx) == ctx
    forgot = box.run_code("x", context=ctx)
    assert forgot.error is not None and forgot.error.name == "NameError"
    assert box.run_code("x").text == "'default'", "only that context restarted"

    box.contexts.delete(ctx)
    wait_until(lambda: ctx.id not in {c.id for c in box.contexts.list()}, what="deleted")
    with pytest.raises(NotFoundError):
        box.run_code("1", context=ctx)
    with pytest.raises(NotFoundError):
        box.contexts.restart(ctx)
    with pytest.raises(NotFoundError):
        box.contexts.delete(ctx)  # (a retried delete that answers 404 counts as done)
    with pytest.raises(InvalidRequestError):
        box.contexts.create(language="cobol")
    with pytest.raises(InvalidRequestError):
        box.run_code("1", timeout=10**9)


# ------------------------------------------------------------------------------ async


def test_async_client(deployment: Deployment, big_file: tuple[Path, str], tmp_path: Path) -> None:  # noqa: F811
    path, digest = big_file
    tag = uuid.uuid4().hex

    async def scenario() -> None:
        async with (
            AsyncSandgate(deployment.url, deployment.keys["alpha"]) as client,
        ):
            box = await client.sandboxes.create(metadata={"tag": tag})
            try:
                assert [s.name for s in await client.sandboxes.list(metadata={"tag": tag})] == [
                    box.name
                ]
                assert (await client.sandboxes.get(box.name)).state == "running"
                result = await box.run("echo hi; exit 2")
                assert (result.stdout, result.exit_code) == ("hi\n", 2)

                assert (await box.files.write("big.bin", path)).size == BIG
                assert await box.files.download("big.bin", tmp_path / "back.bin") == BIG
                with pytest.raises(NotFoundError):
                    await box.files.read("missing")

                cat = await box.processes.start("cat; echo done >&2")
                await cat.send_stdin("ping\n")
                await cat.close_stdin()
                events = [e async for e in cat.output()]
                assert b"".join(e.data for e in events if e.stream == "stdout") == b"ping\n"
                assert [e.data for e in events if e.stream == "stderr"] == [b"done\n"]
                assert cat.exit_code == 0 and await cat.wait() == 0
                sleeper = await box.processes.start("sleep 300")
                await sleeper.kill()
                assert await sleeper.wait(timeout=10) == 143

                async with box.pty(cols=90, rows=20) as term:
                    await term.send(b"stty size\r")
                    seen = b""
                    while b"20 90" not in seen:
                        data = await term.recv(timeout=10)
                        assert data is not None
                        seen += data
                    await term.send(b"exit 4\r")
                    while await term.recv(timeout=10) is not None:
                        pass
                    assert term.exit_code == 4
            finally:
                await box.delete()
            with pytest.raises(NotFoundError):
                await client.sandboxes.get(box.name)

    asyncio.run(scenario())
    assert sha256_of(tmp_path / "back.bin") == digest


def test_async_retried_create_makes_one_sandbox(
    deployment: Deployment,  # noqa: F811
    fault_proxy: OpenProxy,
) -> None:
    tag = uuid.uuid4().hex
    proxy = fault_proxy(deployment.url, rule=first_n(2, "POST", "/api/v1/sandboxes"))

    async def scenario() -> list[Seen]:
        async with AsyncSandgate(proxy.url, deployment.keys["alpha"]) as client:
            box = await client.sandboxes.create(metadata={"tag": tag})
            assert (await box.run("echo ok")).stdout == "ok\n"
            listed = await client.sandboxes.list(metadata={"tag": tag})
            assert [s.name for s in listed] == [box.name]
            await box.delete()
        return proxy.count("POST", "/api/v1/sandboxes")

    creates = asyncio.run(scenario())
    assert len(creates) == 3 and len({s.headers["idempotency-key"] for s in creates}) == 1


def test_async_exec_jobs(deployment: Deployment) -> None:  # noqa: F811
    async def scenario() -> None:
        async with AsyncSandgate(deployment.url, deployment.keys["alpha"]) as client:
            box = await client.sandboxes.create(metadata={"test": "sdk-async-jobs"})
            try:
                key = f"job-{uuid.uuid4().hex}"
                command = "echo ran >> /workspace/runs; echo out; exit 2"
                job = await box.submit_exec_job(command, env={"A": "b"}, idempotency_key=key)
                again = await box.submit_exec_job(command, env={"A": "b"}, idempotency_key=key)
                assert again.id == job.id and again.replayed and not job.replayed
                done = await box.wait_exec_job(job.id, timeout=30)
                assert (done.state, done.exit_code, done.stdout) == ("failed", 2, "out\n")
                assert await client.get_exec_job(job.id) == done
                assert await client.wait_exec_job(job.id) == done
                assert (await box.get_exec_job(job.id)).id == job.id
                assert [j.id for j in await box.list_exec_jobs(limit=5)] == [job.id]
                assert await box.files.read("runs") == b"ran\n"
                with pytest.raises(InvalidRequestError) as reused:
                    await box.submit_exec_job("true", idempotency_key=key)
                assert reused.value.code == "idempotency_key_reused"

                sleeper = await box.submit_exec_job("sleep 2")
                with pytest.raises(ExecJobTimeoutError) as waited:
                    await client.wait_exec_job(sleeper.id, timeout=0.2, poll=0.05)
                assert waited.value.job.state in ("queued", "running")
                assert (await box.wait_exec_job(sleeper.id, timeout=30)).ok
                with pytest.raises(NotFoundError):
                    await client.get_exec_job("0" * 32)
            finally:
                await box.delete()

    asyncio.run(scenario())


def test_async_run_code_and_contexts(deployment: Deployment) -> None:  # noqa: F811
    async def scenario() -> None:
        async with AsyncSandgate(deployment.url, deployment.keys["alpha"]) as client:
            box = await client.sandboxes.create(metadata={"test": "sdk-async-code"})
            try:
                assert (await box.run_code("x = 41")).execution_count == 1
                seen: list[float] = []
                errors: list[str] = []

                async def on_stdout(message: OutputMessage) -> None:  # a coroutine is awaited
                    seen.append(time.monotonic())

                execution = await box.run_code(LIVE, on_stdout=on_stdout)
                assert execution.text == "42" and len(seen) == 2
                assert time.monotonic() - seen[0] > 1.5, "streamed live"
                failed = await box.run_code("1/0", on_error=lambda e: errors.append(e.name))
                assert failed.error is not None and errors == ["ZeroDivisionError"]

                ctx = await box.contexts.create()
                missing = await box.run_code("x", context=ctx)
                assert missing.error is not None and missing.error.name == "NameError"
                await box.run_code("y = 2", context=ctx.id)
                assert (await box.run_code("y * 21", context=ctx)).text == "42"
                listed = {c.id for c in await box.contexts.list()}
                assert listed == {"default", ctx.id}
                await box.contexts.restart(ctx.id)
                forgot = await box.run_code("y", context=ctx)
                assert forgot.error is not None and forgot.error.name == "NameError"
                await box.contexts.delete(ctx)
                for _ in range(100):
                    if ctx.id not in {c.id for c in await box.contexts.list()}:
                        break
                    await asyncio.sleep(0.05)
                with pytest.raises(NotFoundError):
                    await box.run_code("1", context=ctx)
            finally:
                await box.delete()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ sandgate up


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root to set up")
def test_sdk_against_sandgate_up(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    big_file: tuple[Path, str],
    fault_proxy: OpenProxy,
) -> None:
    path, digest = big_file
    state_dir = Path("/var/lib/sandgate-test") / uuid.uuid4().hex[:10]
    port = free_port()
    proc, key = start_up(tmp_path / ".sandgate", state_dir, port)
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as c:
            wait_until(
                lambda: any(w["connected"] for w in c.get("/api/v1/workers").json()["workers"]),
                what="the local worker",
            )
        # the defaults a user of `sandgate up` gets: the key from ./.sandgate/api-key
        monkeypatch.chdir(tmp_path)
        monkeypatch.delenv("SANDGATE_API_KEY", raising=False)
        monkeypatch.delenv("SANDGATE_URL", raising=False)
        tag = uuid.uuid4().hex
        proxy = fault_proxy(url, rule=first_n(1, "POST", "/api/v1/sandboxes"))
        with Sandgate(proxy.url) as client:
            box = client.sandboxes.create(metadata={"tag": tag})
            assert len(proxy.count("POST", "/api/v1/sandboxes")) == 2
            assert [s.name for s in client.sandboxes.list(metadata={"tag": tag})] == [box.name]
            assert box.run("echo $((6*7))").stdout == "42\n"
            assert box.files.write("big.bin", path).size == BIG
            assert box.files.download("big.bin", tmp_path / "back.bin") == BIG
            assert sha256_of(tmp_path / "back.bin") == digest
            box.delete()
    finally:
        stop(proc)
        remove_state(state_dir)  # its mounts first (tests/statedirs.py)
