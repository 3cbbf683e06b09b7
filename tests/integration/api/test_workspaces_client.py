"""Persistent workspaces through the SDK (`sg.workspaces`, `sandboxes.create(workspace=...)`)
and the `sandgate workspace` commands, against a real server (SQLite) and a real bwrap worker:
create, mount, write, commit, log, diff, restore, delete, and the errors a user sees."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from sandgate.client import (
    AsyncSandgate,
    Commit,
    ConflictError,
    FileStat,
    NotFoundError,
    Sandgate,
    Workspace,
    WorkspaceMount,
)
from tests.integration.api.conftest import (
    Deployment,
    own_deployment,
)

pytestmark = pytest.mark.bwrap


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with own_deployment(tmp_path_factory, "workspaces-client") as deployment:
        yield deployment


@pytest.fixture
def sg(dep: Deployment) -> Iterator[Sandgate]:
    with Sandgate(dep.url, dep.keys["alpha"]) as client:
        yield client


def cli(dep: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandgate", *args],
        env={
            **os.environ,
            "SANDGATE_URL": dep.url,
            "SANDGATE_API_KEY": dep.keys["alpha"],
            "COLUMNS": "200",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
    return result.stdout


def test_sdk_history_of_a_mounted_workspace(dep: Deployment, sg: Sandgate) -> None:
    ws = sg.workspaces.create("sdk-proj", quota_mb=32)
    assert isinstance(ws, Workspace)
    assert ws.quota_mb == 32 and ws.head and ws.id and ws.mounted_by == []
    first_head = ws.head
    with pytest.raises(ConflictError) as exists:
        sg.workspaces.create("sdk-proj")
    assert exists.value.code == "workspace_exists"

    box = sg.sandboxes.create(workspace=ws)
    assert box.workspaces == [WorkspaceMount(name="sdk-proj", path="/workspace")]
    assert ws.refresh().mounted_by == [box.name]
    assert box.run("echo one > a.txt").ok

    one = ws.commit("first files")
    assert one.created and one.commit.subject == "first files" and one.skipped == ()
    assert ws.head == one.commit.sha and one.commit.parents == (first_head,)
    assert not ws.commit("nothing new").created

    assert box.run("echo two > a.txt && echo b > b.txt").ok
    two = ws.commit("second")
    log = ws.log()
    assert [c.subject for c in log[:2]] == ["second", "first files"]
    assert log[-1].sha == first_head and all(isinstance(c, Commit) for c in log)
    # one commit a page: every page is followed through `next`
    assert [c.sha for c in ws.iter_log(page_size=1)] == [c.sha for c in log]
    assert [c.sha for c in ws.log(limit=2)] == [two.commit.sha, one.commit.sha]

    shown = ws.diff(two.commit)
    assert shown.commit == two.commit and not shown.truncated
    assert set(shown.files) == {
        FileStat(path="a.txt", added=1, deleted=1),
        FileStat(path="b.txt", added=1, deleted=0),
    }
    assert "+two" in shown.patch and "-one" in shown.patch

    restored = ws.restore(one.commit.sha)
    assert restored.created and ws.head == restored.commit.sha
    assert box.run("cat a.txt; ls").stdout.split() == ["one", "a.txt"]

    # the asyncio flavour reads the same history
    async def history() -> tuple[str | None, list[str]]:
        async with AsyncSandgate(dep.url, dep.keys["alpha"]) as client:
            again = await client.workspaces.get("sdk-proj")
            return again.head, [c.sha for c in await again.log(limit=None)]

    head, shas = asyncio.run(history())
    assert head == restored.commit.sha and shas[0] == head and one.commit.sha in shas

    assert "sdk-proj" in [w.name for w in sg.workspaces.list()]
    with pytest.raises(ConflictError) as busy:
        ws.delete()
    assert busy.value.code == "workspace_in_use"
    box.delete()
    ws.delete()
    with pytest.raises(NotFoundError):
        sg.workspaces.get("sdk-proj")


def test_sdk_mount_shapes_and_missing_workspaces(sg: Sandgate) -> None:
    with pytest.raises(NotFoundError) as missing:
        sg.workspaces.get("nope")
    assert missing.value.status == 404 and "nope" in missing.value.message
    with pytest.raises(NotFoundError):
        sg.sandboxes.create(workspace="nope")

    ws = sg.workspaces.create("shapes", quota_mb=16)
    box = sg.sandboxes.create(workspaces={"/mnt/shapes": "shapes"})
    try:
        assert box.workspaces == [WorkspaceMount(name="shapes", path="/mnt/shapes")]
        assert box.run("echo x > /mnt/shapes/f").ok
    finally:
        box.delete()
    box = sg.sandboxes.create(workspaces=[{"name": "shapes", "path": "/mnt/s"}])
    try:
        assert box.run("cat /mnt/s/f").stdout == "x\n"
    finally:
        box.delete()
    ws.delete()


def test_cli_workspace_commands(dep: Deployment) -> None:
    assert ok(cli(dep, "workspace", "create", "cli-proj", "--quota-mb", "32")).strip() == "cli-proj"
    name = ok(cli(dep, "sandbox", "create", "--workspace", "cli-proj:/mnt/p")).strip()
    ok(cli(dep, "sandbox", "exec", name, "--", "echo hi > /mnt/p/f.txt"))

    committed = ok(cli(dep, "workspace", "commit", "cli-proj", "-m", "add f"))
    assert committed.strip().endswith("add f"), committed
    log = json.loads(ok(cli(dep, "workspace", "log", "cli-proj", "--json")))
    assert log[0]["message"].startswith("add f") and len(log) == 2
    new, root = log[0]["sha"], log[-1]["sha"]
    assert committed.startswith(new[:12])
    assert ok(cli(dep, "workspace", "log", "cli-proj", "--limit", "1")).count("\n") == 1

    shown = ok(cli(dep, "workspace", "diff", "cli-proj", new))
    stat, _, patch = shown.partition("\n\ndiff --git")
    assert f"commit {new}" in stat and "f.txt | +1 -0" in stat and "1 file(s) changed" in stat
    assert "+hi" in patch, shown

    info = ok(cli(dep, "workspace", "info", "cli-proj"))
    assert f"mounted by: {name}" in info and "quota:      32 MB" in info
    assert "cli-proj" in ok(cli(dep, "workspace", "list", "-q")).split()

    restored = ok(cli(dep, "workspace", "restore", "cli-proj", root[:12]))
    assert restored.strip(), restored
    out = ok(cli(dep, "sandbox", "exec", name, "--", "ls -A /mnt/p | wc -l"))
    assert out.strip() == "0"

    ok(cli(dep, "sandbox", "rm", name))
    assert ok(cli(dep, "workspace", "delete", "cli-proj")).strip() == "cli-proj"


def test_cli_errors(dep: Deployment) -> None:
    missing = cli(dep, "workspace", "info", "nope")
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.strip() == "error: workspace nope not found", missing.stderr
    mount = cli(dep, "sandbox", "create", "--workspace", "nope")
    assert mount.returncode == 1 and "workspace nope" in mount.stderr, mount.stderr
    bad = cli(dep, "sandbox", "create", "--workspace", "proj:")
    assert bad.returncode == 2 and "NAME:PATH" in bad.stderr, bad.stderr
