"""Disk quotas through the real API, worker and kernel (issue 10, point 2): a tenant cannot
fill the host's disk; writing past the quota stops inside the sandbox, uploads past it are
refused with the quota named, and nothing half-written is left."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.api.conftest import Deployment

pytestmark = pytest.mark.bwrap

FILES = "/api/v1/sandboxes/{}/toolbox/files"
QUOTA_MB = 64


@pytest.fixture
def small(alpha: httpx.Client) -> Iterator[str]:
    r = alpha.post("/api/v1/sandboxes", json={"resources": {"disk_mb": QUOTA_MB}})
    assert r.status_code == 201, r.text
    assert r.json()["resources"]["disk_mb"] == QUOTA_MB
    yield r.json()["name"]
    alpha.delete(f"/api/v1/sandboxes/{r.json()['name']}")


def test_workers_report_the_quota_they_enforce(alpha: httpx.Client) -> None:
    workers = alpha.get("/api/v1/workers").json()["workers"]
    assert workers and all(w["features"]["disk_quota"] is True for w in workers), workers


def test_dd_past_the_quota_stops_inside_and_the_host_keeps_its_space(
    alpha: httpx.Client, small: str, deployment: Deployment
) -> None:
    (image,) = deployment.state_dir.glob(f"*/sandboxes/{small}/disk.img")
    before = os.statvfs("/var/lib")
    ran = alpha.post(
        f"/api/v1/sandboxes/{small}/execute",
        json={"code": "dd if=/dev/zero of=/workspace/big bs=1M count=2000 conv=fsync"},
        timeout=120,
    )
    assert ran.status_code == 200, ran.text
    out = ran.json()
    assert out["exit_code"] != 0
    assert "No space left on device" in out["stderr"], out
    held_mb = os.stat(image).st_blocks * 512 >> 20  # what the host gave the sandbox's disk
    assert held_mb <= QUOTA_MB, held_mb  # 2000 MB asked for: the host gave the quota
    after = os.statvfs("/var/lib")  # (the whole file system: other writers move it too)
    assert (before.f_bavail - after.f_bavail) * after.f_frsize >> 20 < 1000
    # ...and the sandbox goes on: deleting gives the space back
    freed = alpha.post(
        f"/api/v1/sandboxes/{small}/execute",
        json={"code": "rm /workspace/big && echo hi > /workspace/ok && cat /workspace/ok"},
    )
    assert freed.json()["stdout"] == "hi\n", freed.text


def test_an_upload_declared_larger_than_the_quota_is_refused_before_writing(
    alpha: httpx.Client, small: str
) -> None:
    size = (QUOTA_MB + 1) << 20
    r = alpha.put(
        FILES.format(small),
        params={"path": "/workspace/huge.bin"},
        content=b"\0" * size,
    )
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "disk_quota_exceeded"
    assert f"{QUOTA_MB} MiB" in error["message"] and "disk_mb" in error["message"]
    listing = alpha.get(f"{FILES.format(small)}/list", params={"path": "/workspace"})
    assert listing.json()["entries"] == []


def test_a_streamed_upload_that_fills_the_quota_answers_507_and_leaves_nothing(
    alpha: httpx.Client, small: str
) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: only the disk can say it is full
        block = os.urandom(1 << 20)
        for _ in range(QUOTA_MB * 2):
            yield block

    r = alpha.put(
        FILES.format(small), params={"path": "/workspace/stream.bin"}, content=chunks(), timeout=120
    )
    assert r.status_code == 507, r.text
    error = r.json()["error"]
    assert error["code"] == "disk_quota_exceeded"
    assert f"{QUOTA_MB} MiB" in error["message"], error
    assert "/workspace" in error["message"] and "/var/lib" not in error["message"]
    listing = alpha.get(f"{FILES.format(small)}/list", params={"path": "/workspace"})
    assert listing.json()["entries"] == []  # the partial upload was discarded
    df = alpha.post(f"/api/v1/sandboxes/{small}/execute", json={"code": "df -m /workspace"})
    assert df.json()["exit_code"] == 0


def test_the_quota_is_an_own_file_system_not_the_hosts(alpha: httpx.Client, small: str) -> None:
    ran = alpha.post(
        f"/api/v1/sandboxes/{small}/execute",
        json={"code": "stat -f -c '%b %S %c' /workspace /tmp"},
    )
    lines = ran.json()["stdout"].split("\n")[:2]
    for line in lines:
        blocks, block_size, inodes = (int(v) for v in line.split())
        assert blocks * block_size <= QUOTA_MB << 20
        assert inodes <= QUOTA_MB * 64
    host = os.statvfs(Path("/"))
    assert host.f_blocks * host.f_frsize > QUOTA_MB << 21
