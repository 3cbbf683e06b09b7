"""worker/export.py: a sandbox's overlay upper directory as an OCI layer, and back."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from sandgate.worker import export, layers


@pytest.fixture
def upper(tmp_path: Path) -> Path:
    root = tmp_path / "upper"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "new.conf").write_text("x=1\n")
    os.chmod(root / "etc" / "new.conf", 0o4755)  # set-uid: dropped
    os.mknod(root / "etc" / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))  # a deletion
    (root / "srv" / "data").mkdir(parents=True)
    os.setxattr(root / "srv" / "data", "trusted.overlay.opaque", b"y")
    (root / "srv" / "data" / "only").write_bytes(b"\x00\x01")
    os.symlink("/etc/shadow", root / "srv" / "shadow-link")
    os.symlink("/root", root / "srv" / "dir-link")  # a link to a directory: kept as a link
    os.mkfifo(root / "srv" / "pipe")
    # sandgate's mount points: not the image's
    for name in ("workspace", "tmp", "dev", "proc", "opt/sandgate", "opt/sandgate-host/usr"):
        (root / name).mkdir(parents=True)
    (root / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    return root


def test_export_then_unpack_gives_the_same_changes(upper: Path, tmp_path: Path) -> None:
    out = tmp_path / "layer.tar"
    digest, size, entries = export.export_upper(upper, out, max_bytes=1 << 30)
    assert digest.startswith("sha256:") and size == out.stat().st_size and entries > 0
    with tarfile.open(out) as tar:
        names = tar.getnames()
        members = {m.name: m for m in tar.getmembers()}
    assert "etc/.wh.gone" in names and "srv/data/.wh..wh..opq" in names
    assert not any(n.split("/")[0] in ("workspace", "tmp", "dev", "proc") for n in names)
    assert not any(n.startswith("opt/sandgate") for n in names) and "etc/hosts" not in names
    assert members["srv/shadow-link"].issym(), "a symlink is kept as a link, never followed"
    assert members["srv/dir-link"].issym() and members["srv/dir-link"].linkname == "/root"
    assert not any(n.startswith("srv/dir-link/") for n in names)
    assert members["etc/new.conf"].mode == 0o755 and members["etc/new.conf"].uid == 0
    assert members["srv/pipe"].isfifo()
    again = tmp_path / "again"
    again.mkdir()
    with open(out, "rb") as f:
        layers.unpack(f, again)
    assert (again / "etc" / "new.conf").read_text() == "x=1\n"
    assert stat.S_ISCHR(os.lstat(again / "etc" / "gone").st_mode)
    assert os.getxattr(again / "srv" / "data", "trusted.overlay.opaque") == b"y"
    assert os.readlink(again / "srv" / "shadow-link") == "/etc/shadow"


def test_the_same_changes_give_the_same_layer(upper: Path, tmp_path: Path) -> None:
    first = export.export_upper(upper, tmp_path / "a.tar", max_bytes=1 << 30)
    second = export.export_upper(upper, tmp_path / "b.tar", max_bytes=1 << 30)
    assert first == second


def test_a_file_that_shrinks_during_the_export_is_padded() -> None:
    data = io.BytesIO(b"abc")
    exact = export._Exactly(data, 5)
    assert exact.read(10) == b"abc\x00\x00" and exact.read(10) == b""


def test_an_empty_upper_is_an_empty_layer(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    _, _, entries = export.export_upper(empty, tmp_path / "layer.tar", max_bytes=1 << 30)
    assert entries == 0


def test_a_sparse_file_past_the_quota_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "upper"
    root.mkdir()
    with open(root / "huge", "wb") as f:
        f.truncate(1 << 40)  # a terabyte that takes no blocks
    with pytest.raises(export.ExportError, match="larger than the sandbox's disk quota"):
        export.export_upper(root, tmp_path / "layer.tar", max_bytes=64 << 20)
    assert (tmp_path / "layer.tar").stat().st_size < 1 << 20


def test_deep_trees_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "upper"
    deep = root
    for _ in range(export.MAX_DEPTH + 2):
        deep = deep / "d"
    deep.mkdir(parents=True)
    with pytest.raises(export.ExportError, match="nest deeper"):
        export.export_upper(root, tmp_path / "layer.tar", max_bytes=1 << 30)
