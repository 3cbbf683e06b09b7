"""Unpacking one untrusted image layer into an overlayfs lower directory (worker/layers.py).

The tars are built in memory member by member; the tests run as root (whiteouts are
character devices, opaque directories carry a trusted.* attribute).
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from sandgate.errors import InvalidRequestError
from sandgate.worker.layers import OPAQUE_XATTR, LayerError, UnpackStats, layer_name, unpack

Member = tuple[tarfile.TarInfo, bytes | None]


def regular(name: str, data: bytes = b"", mode: int = 0o644) -> Member:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 1_700_000_000
    return info, data


def directory(name: str, mode: int = 0o755) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    return info, None


def symlink(name: str, target: str) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info, None


def hardlink(name: str, target: str) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.LNKTYPE, target
    return info, None


def device(name: str, kind: bytes = tarfile.CHRTYPE) -> Member:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.devmajor, info.devminor = kind, 0o666, 1, 3
    return info, None


def tar_bytes(*members: Member, compress: bool = False) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    raw = buffer.getvalue()
    return gzip.compress(raw, mtime=0) if compress else raw


def unpack_members(dest: Path, *members: Member, compress: bool = False) -> UnpackStats:
    return unpack(io.BytesIO(tar_bytes(*members, compress=compress)), dest)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A stand-in for the layer store: the layer being unpacked and a sibling beside it."""
    path = tmp_path / "store"
    path.mkdir()
    (path / "sibling").write_bytes(b"another layer's file\n")
    return path


@pytest.fixture
def dest(store: Path) -> Path:
    path = store / "layer"
    path.mkdir()
    return path


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# -- names that would leave the layer ---------------------------------------------------------


@pytest.mark.parametrize("name", ["../x", "a/../../x", "a/..", "./../x"])
def test_a_name_holding_dotdot_is_refused(name: str, store: Path, dest: Path) -> None:
    with pytest.raises(LayerError, match=r"'\.\.'"):
        unpack_members(dest, regular(name, b"escaped\n"))
    assert not (store / "x").exists()
    assert not (store.parent / "x").exists()
    assert tree(store) == ["layer", "sibling"]


def test_an_absolute_name_lands_inside_dest(dest: Path) -> None:
    unpack_members(dest, regular("/etc/x", b"inside\n"))
    assert (dest / "etc" / "x").read_bytes() == b"inside\n"
    assert (dest / "etc").is_dir()


@pytest.mark.parametrize(
    "second",
    [
        regular("evil/pwned", b"written through the link\n"),
        directory("evil/sub"),
        symlink("evil/link", "/"),
        regular("evil/deeper/pwned", b"x"),
        regular("evil/.wh.victim"),
        regular("evil/.wh..wh..opq"),
    ],
    ids=["file", "dir", "symlink", "deeper", "whiteout", "opaque"],
)
def test_nothing_is_created_through_a_symlink(
    second: Member, dest: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = tmp_path_factory.mktemp("outside-")
    (outside / "victim").write_bytes(b"must survive\n")
    with pytest.raises(LayerError, match="symlink"):
        unpack_members(dest, symlink("evil", str(outside)), second)
    assert tree(outside) == ["victim"]
    assert (outside / "victim").read_bytes() == b"must survive\n"
    assert OPAQUE_XATTR not in os.listxattr(outside)
    assert (dest / "evil").is_symlink()  # kept as it is: a link, never followed


def test_a_hard_link_through_a_symlink_is_refused(
    dest: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = tmp_path_factory.mktemp("outside-")
    (outside / "secret").write_bytes(b"host secret\n")
    with pytest.raises(LayerError, match="symlink"):
        unpack_members(dest, symlink("evil", str(outside)), hardlink("stolen", "evil/secret"))
    assert not (dest / "stolen").exists()
    assert os.stat(outside / "secret").st_nlink == 1


def test_a_whiteout_named_dot_dot_at_the_root_does_not_reach_outside_dest(
    store: Path, dest: Path
) -> None:
    # `.wh...` is the whiteout of "..": the directory above the layer is not the layer's to
    # delete (in the worker it is the store's .incoming, where other layers are unpacked)
    with pytest.raises(LayerError):
        unpack_members(dest, regular(".wh..."))
    assert tree(store) == ["layer", "sibling"], "the whiteout deleted files outside dest"


# -- whiteouts and opaque directories ---------------------------------------------------------


def test_a_whiteout_becomes_a_character_device_0_0(dest: Path) -> None:
    stats = unpack_members(dest, regular(".wh.gone"), directory("etc"), regular("etc/.wh.passwd"))
    for path in (dest / "gone", dest / "etc" / "passwd"):
        st = os.stat(path, follow_symlinks=False)
        assert stat.S_ISCHR(st.st_mode)
        assert st.st_rdev == 0
        assert os.major(st.st_rdev) == 0 and os.minor(st.st_rdev) == 0
    assert not (dest / ".wh.gone").exists()
    assert not (dest / "etc" / ".wh.passwd").exists()
    assert stats.whiteouts == 2


def test_a_whiteout_replaces_an_earlier_entry_of_the_same_layer(dest: Path) -> None:
    unpack_members(dest, directory("d"), regular("d/inner", b"x"), regular(".wh.d"))
    assert stat.S_ISCHR(os.stat(dest / "d", follow_symlinks=False).st_mode)


def test_an_empty_whiteout_is_refused(dest: Path) -> None:
    with pytest.raises(LayerError, match="not a whiteout of a name"):
        unpack_members(dest, regular("dir/.wh."))


def test_an_opaque_marker_sets_the_overlay_attribute_on_its_directory(dest: Path) -> None:
    stats = unpack_members(
        dest,
        directory("opq"),
        regular("opq/.wh..wh..opq"),
        regular("opq/new", b"only this\n"),
        regular("later/.wh..wh..opq"),  # before (without) its directory's own entry
    )
    assert os.getxattr(dest / "opq", OPAQUE_XATTR) == b"y"
    assert os.getxattr(dest / "later", OPAQUE_XATTR) == b"y"
    assert not (dest / "opq" / ".wh..wh..opq").exists()
    assert (dest / "opq" / "new").read_bytes() == b"only this\n"
    assert OPAQUE_XATTR not in os.listxattr(dest)
    assert stats.whiteouts == 2


# -- modes, devices, replacement --------------------------------------------------------------


def test_setuid_and_setgid_bits_are_stripped(dest: Path) -> None:
    unpack_members(
        dest,
        regular("suid", b"#!/bin/sh\n", mode=0o4755),
        regular("sgid", b"#!/bin/sh\n", mode=0o2711),
        regular("both", b"#!/bin/sh\n", mode=0o6777),
        directory("shared", mode=0o2775),
        directory("tmp", mode=0o1777),
    )
    assert stat.S_IMODE(os.stat(dest / "suid").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(dest / "sgid").st_mode) == 0o711
    assert stat.S_IMODE(os.stat(dest / "both").st_mode) == 0o777
    assert stat.S_IMODE(os.stat(dest / "shared").st_mode) == 0o775
    assert stat.S_IMODE(os.stat(dest / "tmp").st_mode) == 0o1777  # sticky is kept


def test_device_nodes_are_skipped(dest: Path) -> None:
    stats = unpack_members(
        dest, device("null"), device("sda", tarfile.BLKTYPE), regular("kept", b"k")
    )
    assert tree(dest) == ["kept"]
    assert stats.skipped_devices == 2


def test_a_later_file_replaces_a_directory(dest: Path) -> None:
    unpack_members(
        dest,
        directory("d"),
        directory("d/sub"),
        regular("d/sub/inner", b"old\n"),
        regular("d", b"now a file\n"),
    )
    assert (dest / "d").is_file()
    assert (dest / "d").read_bytes() == b"now a file\n"
    assert tree(dest) == ["d"]


def test_later_entries_replace_files_and_links(dest: Path) -> None:
    unpack_members(
        dest,
        regular("f", b"first\n"),
        regular("f", b"second\n"),
        symlink("l", "/etc/passwd"),
        regular("l", b"no longer a link\n"),
        regular("was-file", b"x"),
        directory("was-file", mode=0o750),
    )
    assert (dest / "f").read_bytes() == b"second\n"
    assert not (dest / "l").is_symlink()
    assert (dest / "l").read_bytes() == b"no longer a link\n"
    assert (dest / "was-file").is_dir()
    assert stat.S_IMODE(os.stat(dest / "was-file").st_mode) == 0o750


def test_a_symlink_is_stored_as_written(dest: Path) -> None:
    unpack_members(dest, symlink("bin", "usr/bin"), symlink("abs", "/etc/shadow"))
    assert os.readlink(dest / "bin") == "usr/bin"
    assert os.readlink(dest / "abs") == "/etc/shadow"


# -- hard links -------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["usr/bin/a", "/usr/bin/a", "./usr/bin/a"])
def test_a_hard_link_within_the_layer_works(target: str, dest: Path) -> None:
    unpack_members(dest, regular("usr/bin/a", b"binary\n", mode=0o755), hardlink("b", target))
    a, b = os.stat(dest / "usr" / "bin" / "a"), os.stat(dest / "b")
    assert (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)
    assert a.st_nlink == 2
    assert (dest / "b").read_bytes() == b"binary\n"


@pytest.mark.parametrize("target", ["missing", "usr/missing", "no/such/dir/file"])
def test_a_hard_link_to_a_missing_target_is_refused(target: str, dest: Path) -> None:
    with pytest.raises(LayerError):
        unpack_members(dest, directory("usr"), hardlink("b", target))
    assert not (dest / "b").exists()


def test_a_hard_link_leaving_the_layer_is_refused(dest: Path) -> None:
    with pytest.raises(LayerError, match=r"'\.\.'"):
        unpack_members(dest, hardlink("passwd", "../../../etc/passwd"))


# -- unreadable streams, stats ----------------------------------------------------------------


def test_a_truncated_gzip_layer_is_refused(dest: Path) -> None:
    data = tar_bytes(regular("big", os.urandom(256 << 10)), regular("after", b"x"), compress=True)
    with pytest.raises(LayerError, match="cannot be read"):
        unpack(io.BytesIO(data[: len(data) // 2]), dest)
    assert not (dest / "after").exists()


def test_a_stream_that_is_no_tar_is_refused(dest: Path) -> None:
    with pytest.raises(LayerError, match="cannot be read"):
        unpack(io.BytesIO(b"this is not a tar archive\n" * 100), dest)


def test_a_gzip_layer_unpacks_and_counts(dest: Path) -> None:
    stats = unpack_members(
        dest, directory("etc"), regular("etc/a", b"12345"), regular("b", b"678"), compress=True
    )
    assert (dest / "etc" / "a").read_bytes() == b"12345"
    assert (stats.files, stats.bytes, stats.whiteouts, stats.skipped_devices) == (2, 8, 0, 0)


# -- layer names ------------------------------------------------------------------------------


def test_layer_name_is_the_hex_of_a_sha256_digest() -> None:
    hexdigest = "0123456789abcdef" * 4
    assert layer_name(f"sha256:{hexdigest}") == hexdigest


@pytest.mark.parametrize(
    "digest",
    [
        "",
        "sha256:",
        "sha256:" + "a" * 63,
        "sha256:" + "a" * 65,
        "sha256:" + "A" * 64,
        "sha256:" + "g" * 64,
        "sha512:" + "a" * 64,
        "a" * 64,
        "sha256:../" + "a" * 61,
    ],
)
def test_layer_name_refuses_anything_else(digest: str) -> None:
    with pytest.raises(InvalidRequestError, match="sha256"):
        layer_name(digest)
