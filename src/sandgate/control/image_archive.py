"""What an uploaded template archive holds: its layers (where in the file, their digests)
and its image config, every digest checked against the bytes before anything is stored.

Three kinds, told apart by their contents:

- an **OCI image layout** in a tar (``oci-layout`` + ``index.json`` + ``blobs/sha256/…``;
  also what ``docker save`` writes since Docker 25): index → manifest → config and layers,
  each blob's sha256 and size checked against its descriptor;
- a **docker save** tarball of the older format (``manifest.json``, ``<id>/layer.tar``):
  each layer's sha256 checked against the config's ``rootfs.diff_ids``;
- anything else is a **root file system** tarball (plain or gzip): one layer, no config.

Blocking (it reads the file): call it in a thread.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from sandgate.core.layer_rules import LayerRuleError, Tally, max_unpacked
from sandgate.errors import InvalidRequestError

MAX_LAYERS = 40  # what one overlay mount stacks (worker/rootfs.py: its options fit a page)
MAX_JSON = 4 << 20  # an index, manifest or config larger than this is not one
READ_CHUNK = 1 << 20
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)


class ArchiveError(InvalidRequestError):
    """The archive is not a usable image: the message says what is wrong with it."""

    code = "invalid_template_archive"


@dataclass(frozen=True)
class ArchiveLayer:
    member: str | None  # its tar member in the archive; None: the archive itself
    digest: str  # sha256:<hex> of its bytes as stored (compressed, if it is)
    size: int
    media: str  # "tar" or "tar+gzip"


@dataclass(frozen=True)
class ImageConfig:
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    user: str = ""
    cmd: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedArchive:
    kind: str  # "oci", "docker" or "rootfs"
    layers: list[ArchiveLayer]
    config: ImageConfig


def parse(path: Path) -> ParsedArchive:
    """Read and check the archive at `path` (see the module docstring)."""
    try:
        return _parse(path)
    except (AttributeError, TypeError, KeyError, ValueError, RecursionError) as exc:
        if isinstance(exc, ArchiveError):
            raise
        # a JSON document of the wrong shape (a string where an object belongs, ...)
        raise ArchiveError(f"the archive's index, manifest or config is malformed: {exc}") from None


def _parse(path: Path) -> ParsedArchive:
    with open(path, "rb") as raw:
        head = raw.read(4)
        if head[:4] == ZSTD_MAGIC:
            raise ArchiveError("zstd-compressed archives are not supported: send it as tar or gzip")
    if head[:2] == GZIP_MAGIC:
        return _rootfs(path, "tar+gzip")  # an image archive is never compressed as a whole
    try:
        tar = tarfile.open(path, mode="r:")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ArchiveError(f"the archive is not a tar file: {exc}") from None
    with tar:
        try:
            members = {m.name.removeprefix("./"): m for m in tar.getmembers()}
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise ArchiveError(f"the archive is truncated or corrupt: {exc}") from None
        length = path.stat().st_size
        for member in members.values():
            if member.isfile() and member.offset_data + member.size > length:
                raise ArchiveError(f"the archive is truncated at {member.name}")
        _check_end(path, tar.offset)
        if "index.json" in members and "oci-layout" in members:
            return _oci(tar, members)
        if "manifest.json" in members:
            return _docker(tar, members)
    return _rootfs(path, "tar")


def _check_end(path: Path, offset: int) -> None:
    """A tar ends with two zero blocks where its last member ends: tarfile stops quietly at
    a short or corrupt header, so anything else there is a truncated or corrupt archive."""
    with open(path, "rb") as f:
        f.seek(offset)
        end = f.read(1024)
    if len(end) < 1024 or end.strip(b"\0"):
        raise ArchiveError(
            f"the archive is truncated or corrupt after {offset} bytes (no end-of-archive "
            "marker where its members end)"
        )


def file_digest(path: Path) -> tuple[str, int]:
    """The sha256 digest (sha256:<hex>) and size of a file."""
    return _hash(_chunks_of_file(path))


def _rootfs(path: Path, media: str) -> ParsedArchive:
    digest, size = file_digest(path)
    with open(path, "rb") as raw:
        _check_layer(raw, media, size, "the root file system")
    layer = ArchiveLayer(member=None, digest=digest, size=size, media=media)
    return ParsedArchive("rootfs", [layer], ImageConfig())


def _check_layer(raw: IO[bytes], media: str, size: int, what: str) -> None:
    """Read the layer through as a worker will unpack it (layer_rules): a corrupt,
    truncated or unsafe layer is refused here, not found by every create after."""
    tally = Tally(max_unpacked(size, media == "tar+gzip"))
    try:
        stream: Any = gzip.GzipFile(fileobj=raw) if media == "tar+gzip" else raw
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                tally.add(member)
        while stream.read(READ_CHUNK):  # to the end: a gzip trailer's CRC is checked
            pass
    except LayerRuleError as exc:
        raise ArchiveError(f"{what}: {exc.message}") from None
    except (OSError, EOFError, tarfile.TarError, zlib.error, ValueError, OverflowError) as exc:
        raise ArchiveError(f"{what} is truncated or corrupt: {exc}") from None


def _oci(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo]) -> ParsedArchive:
    index = _json(tar, members, "index.json")
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(manifests, list) or not manifests:
        raise ArchiveError("index.json lists no manifest")
    descriptor = _pick_manifest(tar, members, manifests)
    manifest = _json_blob(tar, members, descriptor)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("config"), dict):
        raise ArchiveError("the image manifest has no config")
    config = _json_blob(tar, members, manifest["config"])
    layers: list[ArchiveLayer] = []
    for entry in manifest.get("layers") or []:
        if not isinstance(entry, dict):
            raise ArchiveError("a layer descriptor of the manifest is not an object")
        member = _blob_member(members, entry)
        media = _media(str(entry.get("mediaType", "")))
        digest, size = _hash(_chunks_of_member(tar, member))
        _check_descriptor(entry, digest, size)
        _check_member_layer(tar, member, media, f"layer {digest}")
        layers.append(ArchiveLayer(member.name, digest, size, media))
    return ParsedArchive("oci", _bounded(layers), _config(config))


def _pick_manifest(
    tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], manifests: list[Any]
) -> dict[str, Any]:
    """The linux/amd64 (else the first) image manifest, through nested indexes."""
    for _depth in range(4):
        chosen = next(
            (
                m
                for m in manifests
                if isinstance(m, dict)
                and (m.get("platform") or {}).get("os", "linux") == "linux"
                and (m.get("platform") or {}).get("architecture", "amd64") == "amd64"
            ),
            manifests[0],
        )
        if not isinstance(chosen, dict):
            raise ArchiveError("a manifest descriptor of index.json is not an object")
        if chosen.get("mediaType") not in INDEX_TYPES:
            return chosen
        nested = _json_blob(tar, members, chosen)
        listed = nested.get("manifests") if isinstance(nested, dict) else None
        if not isinstance(listed, list) or not listed:
            raise ArchiveError("a nested image index lists no manifest")
        manifests = listed
    raise ArchiveError("image indexes nest too deep")


def _docker(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo]) -> ParsedArchive:
    manifest = _json(tar, members, "manifest.json")
    if not isinstance(manifest, list) or not manifest or not isinstance(manifest[0], dict):
        raise ArchiveError("manifest.json lists no image")
    entry = manifest[0]
    config_name = str(entry.get("Config", ""))
    config = _json(tar, members, config_name)
    diff_ids = ((config or {}).get("rootfs") or {}).get("diff_ids") or []
    names = entry.get("Layers") or []
    if not isinstance(names, list) or not isinstance(diff_ids, list):
        raise ArchiveError("manifest.json's Layers and the config's rootfs.diff_ids must be lists")
    if len(names) != len(diff_ids):
        raise ArchiveError(
            f"manifest.json names {len(names)} layers but the config has {len(diff_ids)} diff_ids"
        )
    layers: list[ArchiveLayer] = []
    for name, want in zip(names, diff_ids, strict=True):
        member = members.get(str(name).removeprefix("./"))
        if member is None or not member.isfile():
            raise ArchiveError(f"layer {name!r} named by manifest.json is not in the archive")
        digest, size = _hash(_chunks_of_member(tar, member))
        if digest != want:
            raise ArchiveError(f"digest mismatch: layer {name} is {digest}, its config says {want}")
        _check_member_layer(tar, member, "tar", f"layer {name}")
        layers.append(ArchiveLayer(member.name, digest, size, "tar"))
    return ParsedArchive("docker", _bounded(layers), _config(config))


def _check_member_layer(
    tar: tarfile.TarFile, member: tarfile.TarInfo, media: str, what: str
) -> None:
    stream = tar.extractfile(member)
    if stream is None:  # pragma: no cover - checked to be a file
        raise ArchiveError(f"{what} is not a file")
    _check_layer(stream, media, member.size, what)


def _bounded(layers: list[ArchiveLayer]) -> list[ArchiveLayer]:
    if not layers:
        raise ArchiveError("the image has no layers")
    if len(layers) > MAX_LAYERS:
        raise ArchiveError(f"the image has {len(layers)} layers; at most {MAX_LAYERS}: squash it")
    return layers


def _config(config: Any) -> ImageConfig:
    if not isinstance(config, dict):
        raise ArchiveError("the image config is not an object")
    inner = config.get("config") or {}
    if not isinstance(inner, dict):
        raise ArchiveError("the image config's config is not an object")
    env: dict[str, str] = {}
    for item in inner.get("Env") or []:
        key, sep, value = str(item).partition("=")
        if sep and key:
            env[key] = value
    entrypoint = inner.get("Entrypoint") or []
    cmd = inner.get("Cmd") or []
    return ImageConfig(
        env=env,
        workdir=str(inner.get("WorkingDir") or ""),
        user=str(inner.get("User") or ""),
        cmd=[str(x) for x in [*entrypoint, *cmd]],
    )


def _media(media_type: str) -> str:
    if media_type.endswith(("+gzip", ".gzip", "tar.gzip")):
        return "tar+gzip"
    if media_type.endswith("+zstd") or media_type.endswith(".zstd"):
        raise ArchiveError("zstd-compressed layers are not supported: save the image with gzip")
    if media_type.endswith(("tar", ".tar")) or media_type == "":
        return "tar"
    raise ArchiveError(f"layer media type {media_type!r} is not a tar layer")


def _blob_member(
    members: dict[str, tarfile.TarInfo], descriptor: dict[str, Any]
) -> tarfile.TarInfo:
    digest = str(descriptor.get("digest", ""))
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64:
        raise ArchiveError(f"descriptor digest {digest!r} is not sha256:<64 hex>")
    member = members.get(f"blobs/sha256/{hexdigest}")
    if member is None or not member.isfile():
        raise ArchiveError(f"blob {digest} is not in the archive")
    return member


def _check_descriptor(descriptor: dict[str, Any], digest: str, size: int) -> None:
    if digest != descriptor.get("digest"):
        raise ArchiveError(f"digest mismatch: blob {descriptor.get('digest')} holds {digest}")
    declared = descriptor.get("size")
    if isinstance(declared, int) and declared != size:
        raise ArchiveError(f"blob {digest} is {size} bytes, its descriptor says {declared}")


def _json_blob(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], descriptor: Any) -> Any:
    if not isinstance(descriptor, dict):
        raise ArchiveError("a descriptor is not an object")
    member = _blob_member(members, descriptor)
    data = _read_small(tar, member)
    _check_descriptor(descriptor, "sha256:" + hashlib.sha256(data).hexdigest(), len(data))
    return _loads(data, member.name)


def _json(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], name: str) -> Any:
    member = members.get(name)
    if member is None or not member.isfile():
        raise ArchiveError(f"{name} is not in the archive")
    return _loads(_read_small(tar, member), name)


def _read_small(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    if member.size > MAX_JSON:
        raise ArchiveError(f"{member.name} is {member.size} bytes: too large for a JSON document")
    return b"".join(_chunks_of_member(tar, member))


def _loads(data: bytes, name: str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArchiveError(f"{name} is not JSON: {exc}") from None


def _chunks_of_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> Iterator[bytes]:
    stream = tar.extractfile(member)
    if stream is None:
        raise ArchiveError(f"{member.name} is not a file")
    try:
        while chunk := stream.read(READ_CHUNK):
            yield chunk
    except (OSError, EOFError, tarfile.TarError) as exc:
        raise ArchiveError(f"the archive is truncated at {member.name}: {exc}") from None
    if stream.tell() != member.size:
        raise ArchiveError(f"the archive is truncated at {member.name}")


def _chunks_of_file(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            yield chunk


def _hash(chunks: Iterator[bytes]) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    for chunk in chunks:
        digest.update(chunk)
        size += len(chunk)
    return "sha256:" + digest.hexdigest(), size


def open_layer(path: Path, layer: ArchiveLayer) -> tuple[IO[bytes], tarfile.TarFile | None]:
    """The layer's bytes as stored, and the tar to close after (None: the file itself)."""
    if layer.member is None:
        return open(path, "rb"), None
    tar = tarfile.open(path, mode="r:")
    stream = tar.extractfile(layer.member)
    if stream is None:  # pragma: no cover - parse() checked it is a file
        tar.close()
        raise ArchiveError(f"{layer.member} is not a file")
    return stream, tar
