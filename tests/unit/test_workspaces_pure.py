"""The workspace rules (core/workspaces.py): names, mount paths, the lock key."""

from __future__ import annotations

import pytest

from sandgate.core.workspaces import (
    WorkspaceMount,
    check_mount_path,
    check_name,
    check_quota,
    lock_key,
    new_workspace_id,
    parse_mounts,
)
from sandgate.errors import InvalidRequestError


def test_names() -> None:
    assert check_name("proj-1.a_b") == "proj-1.a_b"
    for bad in ("", "-x", "Upper", "a/b", "x" * 64, None, 3, "m1\n", "a\nb"):
        with pytest.raises(InvalidRequestError):
            check_name(bad)


def test_mount_paths() -> None:
    for good in ("/workspace", "/workspace/data", "/mnt/x", "/home/user/proj", "/data/a.b"):
        assert check_mount_path(good) == good
    for bad in (
        "workspace",
        "/",
        "/mnt",
        "/etc/x",
        "/proc/x",
        "/usr/lib",
        "/tmp/x",
        "/mnt/../etc",
        "/mnt//x",
        "/mnt/x/",
        "/mnt/./x",
        "/mnt/a b",
        "/opt/sandgate/x",
        "//mnt/x",  # normpath keeps a leading //, and it dodged the overlap check
        "/mnt/x\n",
        "/mnt/x\n/y",
    ):
        with pytest.raises(InvalidRequestError):
            check_mount_path(bad)


def test_parse_mounts_shapes() -> None:
    assert parse_mounts("a", None) == (WorkspaceMount("a", "/workspace"),)
    assert parse_mounts(None, [{"name": "a", "path": "/mnt/a"}, "b"]) == (
        WorkspaceMount("a", "/mnt/a"),
        WorkspaceMount("b", "/workspace"),
    )
    assert parse_mounts(None, {"/data/x": "a"}) == (WorkspaceMount("a", "/data/x"),)
    assert parse_mounts(None, None) == ()


@pytest.mark.parametrize(
    "workspace,workspaces",
    [
        ("a", ["a"]),  # the same workspace twice
        ("a", [{"name": "b", "path": "/workspace/sub"}]),  # nested paths
        (None, [{"name": "a", "path": "/mnt/x"}, {"name": "b", "path": "/mnt/x"}]),
        (None, [{"name": "a", "extra": 1}]),
        (None, "a"),
        (None, [f"w{i}" for i in range(9)]),
        (None, [{"name": "a", "path": "/mnt/x"}, {"name": "b", "path": "//mnt/x"}]),
        (None, [{"name": "a", "path": "//mnt/x"}, {"name": "b", "path": "/mnt/x/y"}]),
    ],
)
def test_parse_mounts_refuses(workspace: object, workspaces: object) -> None:
    with pytest.raises(InvalidRequestError):
        parse_mounts(workspace, workspaces)


def test_quota_and_ids() -> None:
    assert check_quota(64, most=1024) == 64
    for bad in (8, 2048, True, 1.5, "64"):
        with pytest.raises(InvalidRequestError):
            check_quota(bad, most=1024)
    a, b = new_workspace_id(), new_workspace_id()
    assert a != b and a.startswith("ws-") and len(a) == 23
    assert lock_key(a) == lock_key(a) != lock_key(b)
    assert -(2**63) <= lock_key(a) < 2**63
