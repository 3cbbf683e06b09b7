"""Reading an uploaded template archive (control/image_archive.py): OCI layouts, older
`docker save` tarballs and root file system tarballs, every digest and size checked."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandgate.control.image_archive import (
    MAX_LAYERS,
    ZSTD_MAGIC,
    ArchiveError,
    ImageConfig,
    open_layer,
    parse,
)
from tests.images import IMAGE_CONFIG, Layer, docker_archive, oci_archive


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def two_layers() -> list[Layer]:
    return [
        Layer({"etc": None, "etc/hostname": b"box\n", "bin": "->usr/bin", "removed": b"x"}),
        Layer({"etc/greeting": b"hello\n", ".wh.removed": b""}, gzip=True),
    ]


def members_of(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        out = []
        for member in tar.getmembers():
            stream = tar.extractfile(member)
            assert stream is not None
            out.append((member.name, stream.read()))
        return out


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


def rewrite(
    path: Path, *, replace: dict[str, bytes] | None = None, drop: frozenset[str] = frozenset()
) -> Path:
    """The archive at `path` again, with members replaced or dropped (the order kept)."""
    replace = replace or {}
    members = [(n, replace.get(n, d)) for n, d in members_of(path) if n not in drop]
    return write_tar(path, members)


def member(path: Path, name: str) -> bytes:
    return dict(members_of(path))[name]


def edit_index(path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    index = json.loads(member(path, "index.json"))
    edit(index)
    return rewrite(path, replace={"index.json": json.dumps(index).encode()})


def edit_manifest(path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """Change the OCI image manifest, and its descriptor in index.json to match it."""
    index = json.loads(member(path, "index.json"))
    descriptor = index["manifests"][0]
    old_blob = "blobs/sha256/" + descriptor["digest"].removeprefix("sha256:")
    manifest = json.loads(member(path, old_blob))
    edit(manifest)
    data = json.dumps(manifest).encode()
    descriptor["digest"], descriptor["size"] = digest_of(data), len(data)
    members = [
        (n, json.dumps(index).encode() if n == "index.json" else d)
        for n, d in members_of(path)
        if n != old_blob
    ]
    members.append(("blobs/sha256/" + digest_of(data).removeprefix("sha256:"), data))
    return write_tar(path, members)


def refused(path: Path, word: str) -> ArchiveError:
    with pytest.raises(ArchiveError) as caught:
        parse(path)
    assert caught.value.code == "invalid_template_archive"
    assert word in caught.value.message
    return caught.value


# -- archives that parse ----------------------------------------------------------------------


def test_an_oci_archive_parses_with_its_digests_and_config(tmp_path: Path) -> None:
    layers = two_layers()
    path = oci_archive(tmp_path / "oci.tar", layers)
    parsed = parse(path)
    assert parsed.kind == "oci"
    blobs = [layer.tar() for layer in layers]
    assert [x.digest for x in parsed.layers] == [digest_of(b) for b in blobs]
    assert [x.size for x in parsed.layers] == [len(b) for b in blobs]
    assert [x.media for x in parsed.layers] == ["tar", "tar+gzip"]
    assert [x.member for x in parsed.layers] == [
        "blobs/sha256/" + digest_of(b).removeprefix("sha256:") for b in blobs
    ]
    assert parsed.config == ImageConfig(
        env={"PATH": "/usr/bin:/bin", "GREETING": "from-config"},
        workdir="/app",
        user="root",
        cmd=["/bin/sh", "-c", "echo started > /tmp/cmd-ran"],
    )
    for layer, want in zip(parsed.layers, blobs, strict=True):
        stream, tar = open_layer(path, layer)
        try:
            assert stream.read() == want
        finally:
            stream.close()
            if tar is not None:
                tar.close()


def test_the_entrypoint_comes_before_the_cmd_and_odd_env_items_are_dropped(
    tmp_path: Path,
) -> None:
    config: dict[str, object] = {
        "Entrypoint": ["/usr/bin/tini", "--"],
        "Cmd": ["python", "-m", "app"],
        "Env": ["A=1", "B=x=y", "EMPTY=", "NOEQUALS", "=nokey"],
    }
    parsed = parse(oci_archive(tmp_path / "oci.tar", two_layers(), config))
    assert parsed.config.cmd == ["/usr/bin/tini", "--", "python", "-m", "app"]
    assert parsed.config.env == {"A": "1", "B": "x=y", "EMPTY": ""}
    assert (parsed.config.workdir, parsed.config.user) == ("", "")


def test_a_docker_save_archive_parses(tmp_path: Path) -> None:
    layers = two_layers()
    path = docker_archive(tmp_path / "docker.tar", layers)
    parsed = parse(path)
    assert parsed.kind == "docker"
    blobs = [Layer(layer.entries).tar() for layer in layers]  # docker save: uncompressed
    assert [x.digest for x in parsed.layers] == [digest_of(b) for b in blobs]
    assert [x.size for x in parsed.layers] == [len(b) for b in blobs]
    assert [x.media for x in parsed.layers] == ["tar", "tar"]
    assert [x.member for x in parsed.layers] == ["layer0/layer.tar", "layer1/layer.tar"]
    assert parsed.config.env["GREETING"] == "from-config"
    assert parsed.config.cmd == IMAGE_CONFIG["Cmd"]
    stream, tar = open_layer(path, parsed.layers[1])
    try:
        assert stream.read() == blobs[1]
    finally:
        stream.close()
        assert tar is not None
        tar.close()


@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tar.gz"])
def test_a_root_file_system_tarball_is_one_layer(compress: bool, tmp_path: Path) -> None:
    data = Layer({"bin": None, "bin/sh": b"#!shell\n", "etc/os-release": b"ID=t\n"}, compress).tar()
    path = tmp_path / ("rootfs.tar.gz" if compress else "rootfs.tar")
    path.write_bytes(data)
    parsed = parse(path)
    assert parsed.kind == "rootfs"
    assert len(parsed.layers) == 1
    (layer,) = parsed.layers
    assert layer.member is None
    assert (layer.digest, layer.size) == (digest_of(data), len(data))
    assert layer.media == ("tar+gzip" if compress else "tar")
    assert parsed.config == ImageConfig()
    stream, tar = open_layer(path, layer)
    with stream:
        assert tar is None
        assert stream.read() == data


def test_exactly_max_layers_is_accepted(tmp_path: Path) -> None:
    layers = [Layer({f"f{i}": str(i).encode()}) for i in range(MAX_LAYERS)]
    assert len(parse(oci_archive(tmp_path / "oci.tar", layers)).layers) == MAX_LAYERS


# -- refusals ---------------------------------------------------------------------------------


def test_a_truncated_archive_is_refused(tmp_path: Path) -> None:
    path = oci_archive(tmp_path / "oci.tar", two_layers())
    with tarfile.open(path) as tar:
        blob = next(m for m in tar.getmembers() if m.name.startswith("blobs/") and m.size > 4096)
        cut = blob.offset_data + blob.size // 2
    path.write_bytes(path.read_bytes()[:cut])
    refused(path, "truncated")


def test_a_truncated_gzip_root_file_system_is_refused(tmp_path: Path) -> None:
    data = gzip.compress(Layer({"big": bytes(range(256)) * 4096}).tar(), mtime=0)
    path = tmp_path / "rootfs.tar.gz"
    path.write_bytes(data[: len(data) // 2])
    refused(path, "truncated or corrupt")


def test_a_root_file_system_tar_truncated_inside_a_header_is_refused(tmp_path: Path) -> None:
    data = Layer({"a": b"x" * 600, "b": b"y" * 600}).tar()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        second = tar.getmember("b").offset
    path = tmp_path / "rootfs.tar"
    path.write_bytes(data[: second + 100])  # all of "a", and a fifth of the header of "b"
    refused(path, "truncated")


def test_a_corrupted_layer_is_a_digest_mismatch(tmp_path: Path) -> None:
    refused(oci_archive(tmp_path / "oci.tar", two_layers(), corrupt_layer=1), "digest mismatch")


def test_a_layer_blob_of_another_size_than_its_descriptor_is_refused(tmp_path: Path) -> None:
    path = oci_archive(tmp_path / "oci.tar", two_layers())

    def grow(manifest: dict[str, Any]) -> None:
        manifest["layers"][0]["size"] += 1

    error = refused(edit_manifest(path, grow), "descriptor says")
    assert "bytes" in error.message


def test_a_manifest_of_another_size_than_its_descriptor_is_refused(tmp_path: Path) -> None:
    path = oci_archive(tmp_path / "oci.tar", two_layers())

    def shrink(index: dict[str, Any]) -> None:
        index["manifests"][0]["size"] -= 1

    refused(edit_index(path, shrink), "descriptor says")


def test_a_missing_layer_blob_is_refused(tmp_path: Path) -> None:
    layers = two_layers()
    path = oci_archive(tmp_path / "oci.tar", layers)
    gone = "blobs/sha256/" + digest_of(layers[0].tar()).removeprefix("sha256:")
    refused(rewrite(path, drop=frozenset({gone})), "not in the archive")


def test_a_missing_config_blob_is_refused(tmp_path: Path) -> None:
    path = oci_archive(tmp_path / "oci.tar", two_layers())

    def elsewhere(manifest: dict[str, Any]) -> None:
        manifest["config"]["digest"] = "sha256:" + "0" * 64

    refused(edit_manifest(path, elsewhere), "not in the archive")


@pytest.mark.parametrize(
    "index", [{"schemaVersion": 2, "manifests": []}, {"schemaVersion": 2}, [], "x"]
)
def test_an_index_without_manifests_is_refused(index: object, tmp_path: Path) -> None:
    path = oci_archive(tmp_path / "oci.tar", two_layers())
    refused(rewrite(path, replace={"index.json": json.dumps(index).encode()}), "no manifest")


def test_an_index_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = oci_archive(tmp_path / "oci.tar", two_layers())
    refused(rewrite(path, replace={"index.json": b"{not json"}), "not JSON")


def test_a_zstd_archive_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "image.tar.zst"
    path.write_bytes(ZSTD_MAGIC + b"\x00" * 1024)
    refused(path, "zstd")


def test_a_zstd_layer_is_refused(tmp_path: Path) -> None:
    path = oci_archive(tmp_path / "oci.tar", two_layers())

    def zstd(manifest: dict[str, Any]) -> None:
        manifest["layers"][0]["mediaType"] = "application/vnd.oci.image.layer.v1.tar+zstd"

    refused(edit_manifest(path, zstd), "zstd")


@pytest.mark.parametrize(
    "data", [b"this is not a tar archive\n" * 64, b"", b"\x1f"], ids=["text", "empty", "byte"]
)
def test_a_file_that_is_no_tar_is_refused(data: bytes, tmp_path: Path) -> None:
    path = tmp_path / "garbage"
    path.write_bytes(data)
    refused(path, "not a tar")


def test_more_than_max_layers_are_refused(tmp_path: Path) -> None:
    layers = [Layer({f"f{i}": str(i).encode()}) for i in range(MAX_LAYERS + 1)]
    error = refused(oci_archive(tmp_path / "oci.tar", layers), "layers")
    assert str(MAX_LAYERS) in error.message


def test_an_image_without_layers_is_refused(tmp_path: Path) -> None:
    refused(oci_archive(tmp_path / "oci.tar", []), "no layers")


def test_a_docker_manifest_naming_fewer_layers_than_diff_ids_is_refused(tmp_path: Path) -> None:
    path = docker_archive(tmp_path / "docker.tar", two_layers())
    manifest = json.loads(member(path, "manifest.json"))
    manifest[0]["Layers"] = manifest[0]["Layers"][:1]
    fewer = rewrite(path, replace={"manifest.json": json.dumps(manifest).encode()})
    error = refused(fewer, "diff_ids")
    assert "1 layers" in error.message and "2 diff_ids" in error.message


def test_a_docker_layer_of_other_bytes_than_its_diff_id_is_refused(tmp_path: Path) -> None:
    path = docker_archive(tmp_path / "docker.tar", two_layers())
    other = Layer({"etc/hostname": b"tampered\n"}).tar()
    refused(rewrite(path, replace={"layer0/layer.tar": other}), "digest mismatch")


def test_a_docker_manifest_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = docker_archive(tmp_path / "docker.tar", two_layers())
    refused(rewrite(path, replace={"manifest.json": b"[{"}), "not JSON")


def _platform_a_string(path: Path) -> Path:
    def edit(index: dict[str, Any]) -> None:
        index["manifests"][0]["platform"] = "linux/amd64"

    return edit_index(oci_archive(path, two_layers()), edit)


def _layers_a_number(path: Path) -> Path:
    def edit(manifest: dict[str, Any]) -> None:
        manifest["layers"] = 5

    return edit_manifest(oci_archive(path, two_layers()), edit)


def _docker_config_a_list(path: Path) -> Path:
    archive = docker_archive(path, two_layers())
    config_name = json.loads(member(archive, "manifest.json"))[0]["Config"]
    return rewrite(archive, replace={config_name: b"[1]"})


def _env_a_number(path: Path) -> Path:
    return oci_archive(path, two_layers(), {"Env": 5})


@pytest.mark.parametrize(
    "make",
    [_platform_a_string, _layers_a_number, _docker_config_a_list, _env_a_number],
    ids=["platform-a-string", "layers-a-number", "docker-config-a-list", "env-a-number"],
)
def test_json_of_the_wrong_shape_is_refused_as_an_archive_error(
    make: Callable[[Path], Path], tmp_path: Path
) -> None:
    with pytest.raises(ArchiveError) as caught:
        parse(make(tmp_path / "image.tar"))
    assert caught.value.code == "invalid_template_archive"
