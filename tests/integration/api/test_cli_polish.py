"""What a new user found (issue 16, item 6), against a real server (SQLite) and a real bwrap
worker: a sandbox as a context manager (deleted when the block ends), `timeout` after an
extend, `sandgate cp -r` both ways, `sandgate sandbox info` / `extend`, `exec` with no
command, and `sandgate sandbox stdin` / `kill` on a running `cat`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sandgate.client import AsyncSandgate, NotFoundError, Sandbox, Sandgate
from tests.integration.api.conftest import (
    Deployment,
    own_deployment,
)

pytestmark = pytest.mark.bwrap


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with own_deployment(tmp_path_factory, "cli-polish") as deployment:
        yield deployment


@pytest.fixture
def sg(dep: Deployment) -> Iterator[Sandgate]:
    with Sandgate(dep.url, dep.keys["alpha"]) as client:
        yield client


@pytest.fixture
def box(sg: Sandgate) -> Iterator[Sandbox]:
    with sg.sandboxes.create(timeout=120, metadata={"suite": "polish"}) as made:
        yield made


def cli(
    dep: Deployment, *args: str, stdin: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandgate", *args],
        env={
            **os.environ,
            "SANDGATE_URL": dep.url,
            "SANDGATE_API_KEY": dep.keys["alpha"],
            "COLUMNS": "200",
        },
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    return result.stdout


def gone(sg: Sandgate, name: str) -> bool:
    try:
        sg.sandboxes.get(name)
    except NotFoundError:
        return True
    return False


def test_sandbox_as_context_manager_is_deleted_when_the_block_ends(sg: Sandgate) -> None:
    with sg.sandboxes.create(timeout=60) as box:
        assert box.run("echo in").stdout == "in\n"
    assert box.state == "deleted" and gone(sg, box.name)

    with pytest.raises(RuntimeError, match="the block failed"), sg.sandboxes.create() as failing:
        raise RuntimeError("the block failed")
    assert gone(sg, failing.name)

    with sg.sandboxes.create() as early:  # deleted inside the block: the exit is no error
        early.delete()
    assert early.state == "deleted" and gone(sg, early.name)


def test_async_sandbox_as_context_manager(dep: Deployment, sg: Sandgate) -> None:
    async def scenario() -> list[str]:
        names = []
        async with AsyncSandgate(dep.url, dep.keys["alpha"]) as client:
            async with client.sandboxes.create(timeout=60) as box:
                names.append(box.name)
                assert (await box.run("echo in")).stdout == "in\n"
            assert box.state == "deleted"
            with pytest.raises(KeyError):
                async with await client.sandboxes.create() as other:
                    names.append(other.name)
                    raise KeyError("boom")
            async with client.sandboxes.create() as early:
                names.append(early.name)
                await early.delete()
            # still a coroutine: awaited, or run as a task
            plain = await asyncio.create_task(client.sandboxes.create())
            names.append(plain.name)
            await plain.delete()
        return names

    names = asyncio.run(scenario())
    assert len(names) == 4 and all(gone(sg, name) for name in names)


def test_extend_updates_timeout_and_expiry(dep: Deployment, sg: Sandgate, box: Sandbox) -> None:
    assert box.timeout == 120
    before = box.expires_at
    assert before is not None and box.started_at is not None
    box.set_timeout(900)
    assert box.expires_at is not None and box.expires_at > before
    left = (box.expires_at - datetime.now(UTC)).total_seconds()
    assert 890 < left <= 900
    assert box.timeout == (box.expires_at - box.started_at).total_seconds()
    assert 900 <= box.timeout < 960  # its life from start: what it lived so far, plus 900
    assert sg.sandboxes.get(box.name).timeout == box.timeout  # a refresh agrees

    async def extend_async() -> tuple[float, float]:
        async with AsyncSandgate(dep.url, dep.keys["alpha"]) as client:
            handle = await client.sandboxes.get(box.name)
            await handle.set_timeout(1800)
            assert handle.expires_at is not None
            return handle.timeout, (handle.expires_at - datetime.now(UTC)).total_seconds()

    timeout, left = asyncio.run(extend_async())
    assert 1800 <= timeout < 1860 and 1790 < left <= 1800


def test_cp_recursive_both_ways(dep: Deployment, box: Sandbox, tmp_path: Path) -> None:
    tree = tmp_path / "proj"
    (tree / "sub" / "deeper").mkdir(parents=True)
    (tree / "empty").mkdir()
    (tree / "a.txt").write_text("alpha\n")
    (tree / "sub" / "b.bin").write_bytes(bytes(range(256)) * 64)
    (tree / "sub" / "deeper" / "c.txt").write_text("gamma\n")
    (tree / "link").symlink_to(tree / "a.txt")

    # without -r: a usage error that says how
    refused = cli(dep, "cp", str(tree), f"{box.name}:up")
    assert refused.returncode == 2 and "is a directory: add -r" in refused.stderr

    # into a path that does not exist: it becomes the copy (the symlink is left out)
    copied = cli(dep, "cp", "-r", str(tree), f"{box.name}:up")
    ok(copied)
    assert "skipped" in copied.stderr and "link" in copied.stderr
    assert box.files.read("up/a.txt") == b"alpha\n"
    assert box.files.read("up/sub/b.bin") == bytes(range(256)) * 64
    assert box.files.read("/workspace/up/sub/deeper/c.txt") == b"gamma\n"
    assert box.files.stat("up/empty").is_dir and not box.files.exists("up/link")
    # into a directory that exists: inside it, under its own name
    ok(cli(dep, "cp", "-r", str(tree), f"{box.name}:up"))
    assert box.files.read("up/proj/sub/deeper/c.txt") == b"gamma\n"

    refused = cli(dep, "cp", f"{box.name}:up", str(tmp_path / "back"))
    assert refused.returncode == 2 and "is a directory: add -r" in refused.stderr
    assert not (tmp_path / "back").exists()

    ok(cli(dep, "cp", "-r", f"{box.name}:up", str(tmp_path / "back")))
    back = tmp_path / "back"
    assert (back / "a.txt").read_text() == "alpha\n"
    assert (back / "sub" / "b.bin").read_bytes() == bytes(range(256)) * 64
    assert (back / "sub" / "deeper" / "c.txt").read_text() == "gamma\n"
    assert (back / "proj" / "sub" / "deeper" / "c.txt").read_text() == "gamma\n"
    assert (back / "empty").is_dir() and not list((back / "empty").iterdir())
    # into a local directory that exists: inside it, under the remote name
    ok(cli(dep, "cp", "-R", f"{box.name}:up/sub/deeper", str(back)))
    assert (back / "deeper" / "c.txt").read_text() == "gamma\n"

    # -r with a single file still copies the file; a file in the way of a tree is an error
    ok(cli(dep, "cp", "-r", f"{box.name}:up/a.txt", str(tmp_path / "single.txt")))
    assert (tmp_path / "single.txt").read_text() == "alpha\n"
    clash = cli(dep, "cp", "-r", str(tree), f"{box.name}:up/a.txt")
    assert clash.returncode == 2 and "not a directory" in clash.stderr


def test_info_and_extend(dep: Deployment, box: Sandbox) -> None:
    shown = ok(cli(dep, "sandbox", "info", box.name))
    lines = dict(line.split(":", 1) for line in shown.splitlines())
    values = {key: value.strip() for key, value in lines.items()}
    assert values["name"] == box.name and values["state"] == "running"
    assert values["template"] == "default" and values["worker"] == "w1"
    assert "memory_mb=" in values["resources"] and "cpus=" in values["resources"]
    assert values["network"] == "off (loopback only)" and values["workspaces"] == "-"
    assert values["metadata"] == "suite=polish" and values["timeout"] == "120 s from start"
    assert "(in " in values["expires"]

    raw = json.loads(ok(cli(dep, "sandbox", "info", box.name, "--json")))
    assert raw["name"] == box.name and raw["state"] == "running" and raw["timeout"] == 120
    assert raw["metadata"]["suite"] == "polish" and raw["resources"] == box.resources
    assert raw["network"] is False and raw["workspaces"] == []

    said = ok(cli(dep, "sandbox", "extend", box.name, "--timeout", "3600"))
    assert said.startswith(f"{box.name} expires ") and said.rstrip().endswith(
        ("(in 1h 00m)", "(in 59m 59s)")
    )
    after = json.loads(ok(cli(dep, "sandbox", "info", box.name, "--json")))
    expires = datetime.fromisoformat(after["expires_at"])
    assert 3590 < (expires - datetime.now(UTC)).total_seconds() <= 3600
    assert after["timeout"] >= 3600 and box.refresh().expires_at == expires

    missing = cli(dep, "sandbox", "info", "sbx-nosuchthing0")
    assert missing.returncode == 1 and missing.stderr.startswith("error: ")


def test_exec_without_a_command_says_how(dep: Deployment, box: Sandbox) -> None:
    result = cli(dep, "sandbox", "exec", box.name)
    assert result.returncode == 2
    assert "no command to run" in result.stderr and "--code" in result.stderr
    assert f"sandgate sandbox exec {box.name} -- ls -la" in result.stderr.replace("\n", "")
    both = cli(dep, "sandbox", "exec", box.name, "--code", "echo", "--", "ls")
    assert both.returncode == 2 and "not both" in both.stderr


def test_process_stdin_then_kill(dep: Deployment, box: Sandbox) -> None:
    cat = box.processes.start("cat")
    ok(cli(dep, "sandbox", "stdin", box.name, str(cat.pid), "hello\n"))
    piped = cli(dep, "sandbox", "stdin", box.name, str(cat.pid), "-", stdin="from a pipe\n")
    ok(piped)
    deadline = time.monotonic() + 10
    seen = b""
    while b"from a pipe" not in seen and time.monotonic() < deadline:
        seen = b"".join(e.data for e in cat.output(follow=False))
    assert seen == b"hello\nfrom a pipe\n"
    assert cat.refresh().state == "running"

    nothing = cli(dep, "sandbox", "stdin", box.name, str(cat.pid))
    assert nothing.returncode == 2 and "nothing to send" in nothing.stderr
    ok(cli(dep, "sandbox", "kill", box.name, str(cat.pid), "--signal", "KILL"))
    assert cat.wait(timeout=10) == 137

    # --close ends its input: cat writes what it got and exits 0; default signal is TERM
    closing = box.processes.start("cat")
    ok(cli(dep, "sandbox", "stdin", box.name, str(closing.pid), "last\n", "--close"))
    assert closing.wait(timeout=10) == 0
    assert b"".join(e.data for e in closing.output()) == b"last\n"
    sleeper = box.processes.start("sleep 60")
    ok(cli(dep, "sandbox", "kill", box.name, str(sleeper.pid)))
    assert sleeper.wait(timeout=10) == 143

    late = cli(dep, "sandbox", "stdin", box.name, str(closing.pid), "more")
    assert late.returncode == 1 and late.stderr.startswith("error: ")
    bad = cli(dep, "sandbox", "kill", box.name, str(sleeper.pid), "--signal", "NOPE")
    assert bad.returncode == 2 and "no signal" in bad.stderr
