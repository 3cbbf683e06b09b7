"""Toolbox files through the real API, tunnel, worker and in-sandbox agent."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import httpx
import pytest

FILES = "/api/v1/sandboxes/{}/toolbox/files"


def test_upload_download_and_operations(alpha: httpx.Client, sandbox: str) -> None:
    base = FILES.format(sandbox)
    put = alpha.put(base, params={"path": "/workspace/a/b/hello.txt"}, content=b"hello\n")
    assert put.status_code == 200, put.text
    assert put.json()["size"] == 6
    assert put.json()["path"] == "/workspace/a/b/hello.txt"

    got = alpha.get(base, params={"path": "/workspace/a/b/hello.txt"})
    assert got.content == b"hello\n"
    assert got.headers["content-length"] == "6"

    ran = alpha.post(f"/api/v1/sandboxes/{sandbox}/execute", json={"code": "cat a/b/hello.txt"})
    assert ran.json()["stdout"] == "hello\n"

    stat = alpha.get(f"{base}/stat", params={"path": "a/b/hello.txt"}).json()
    assert stat["type"] == "file" and stat["name"] == "hello.txt"

    listing = alpha.get(f"{base}/list", params={"path": "/workspace/a/b"}).json()["entries"]
    assert [e["name"] for e in listing] == ["hello.txt"]
    assert set(listing[0]) >= {"name", "path", "type", "size", "mode", "mtime"}

    made = alpha.post(f"{base}/mkdir", json={"path": "/workspace/x/y"})
    assert made.status_code == 201 and made.json()["type"] == "dir"
    moved = alpha.post(
        f"{base}/move",
        json={"source": "/workspace/a/b/hello.txt", "destination": "/workspace/x/y/h.txt"},
    )
    assert moved.status_code == 200 and moved.json()["path"] == "/workspace/x/y/h.txt"
    assert alpha.get(base, params={"path": "/workspace/a/b/hello.txt"}).status_code == 404

    conflict = alpha.post(
        f"{base}/move", json={"source": "/workspace/x/y/h.txt", "destination": "/workspace/x"}
    )
    assert conflict.status_code == 409

    assert alpha.delete(base, params={"path": "/workspace/x"}).status_code == 409  # not empty
    assert (
        alpha.delete(base, params={"path": "/workspace/x", "recursive": "true"}).status_code == 204
    )
    assert alpha.get(f"{base}/stat", params={"path": "/workspace/x"}).status_code == 404

    tmp = alpha.put(base, params={"path": "/tmp/t.bin"}, content=b"\x00\xff")
    assert tmp.status_code == 200
    assert alpha.get(base, params={"path": "/tmp/t.bin"}).content == b"\x00\xff"


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "../../etc/passwd",
        "/workspace/../etc/shadow",
        "/workspace/../../../root/.bashrc",
        "/proc/self/environ",
        "/",
        "/workspace/link-out/passwd",
        "/workspace/link-out/new-file",
    ],
)
def test_paths_outside_are_refused(alpha: httpx.Client, sandbox: str, path: str) -> None:
    alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute",
        json={"code": "ln -sfn /etc link-out; ln -sfn /etc/passwd file-link"},
    )
    base = FILES.format(sandbox)
    assert alpha.get(base, params={"path": path}).status_code == 403
    assert alpha.put(base, params={"path": path}, content=b"x").status_code == 403
    assert alpha.get(f"{base}/stat", params={"path": path}).status_code in (403,)
    response = alpha.delete(base, params={"path": path})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "path_outside_sandbox"


def test_symlink_pointing_out_is_not_followed(alpha: httpx.Client, sandbox: str) -> None:
    alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute", json={"code": "ln -sfn /etc/passwd file-link"}
    )
    base = FILES.format(sandbox)
    response = alpha.get(base, params={"path": "/workspace/file-link"})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "path_outside_sandbox"
    # the link itself is in the workspace: stat shows it, delete removes only the link
    assert (
        alpha.get(f"{base}/stat", params={"path": "/workspace/file-link"}).json()["type"]
        == "symlink"
    )
    assert alpha.delete(base, params={"path": "/workspace/file-link"}).status_code == 204
    check = alpha.post(
        f"/api/v1/sandboxes/{sandbox}/execute", json={"code": "head -c 4 /etc/passwd"}
    )
    assert check.json()["stdout"] == "root"


def test_large_file_round_trip(alpha: httpx.Client, sandbox: str) -> None:
    size = 100 << 20
    block = os.urandom(1 << 20)
    expected = hashlib.sha256(block * 100).hexdigest()

    def stream() -> Iterator[bytes]:
        for _ in range(size // len(block)):
            yield block

    put = alpha.put(FILES.format(sandbox), params={"path": "big.bin"}, content=stream())
    assert put.status_code == 200, put.text
    assert put.json()["size"] == size
    remote = alpha.post(f"/api/v1/sandboxes/{sandbox}/execute", json={"code": "sha256sum big.bin"})
    assert remote.json()["stdout"].split()[0] == expected

    digest = hashlib.sha256()
    received = 0
    with alpha.stream("GET", FILES.format(sandbox), params={"path": "big.bin"}) as response:
        assert response.status_code == 200
        assert response.headers["content-length"] == str(size)
        for chunk in response.iter_bytes():
            digest.update(chunk)
            received += len(chunk)
    assert received == size
    assert digest.hexdigest() == expected
