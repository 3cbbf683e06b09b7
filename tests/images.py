"""Image archives the tests make themselves: a small root file system of the host's own
binaries (dash, coreutils and the libraries they load) and, on top, layers that add,
delete (whiteouts) and replace (opaque directories), saved as an OCI image layout or as an
older `docker save` tarball. Nothing is downloaded.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = tuple(
    f"/usr/bin/{name}"
    for name in ("dash", "cat", "ls", "dd", "id", "rm", "mkdir", "touch", "stat", "head")
)


def _libraries(binary: str) -> set[str]:
    found = set()
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
            found.add(parts[2])
        elif parts and parts[0].startswith("/"):
            found.add(parts[0])
    return found


@dataclass
class Layer:
    """Entries of one layer: path -> bytes (a file), None (a directory) or "->target" (a
    symlink, as a str)."""

    entries: dict[str, bytes | str | None] = field(default_factory=dict)
    gzip: bool = False

    def tar(self) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path, content in self.entries.items():
                info = tarfile.TarInfo(path)
                info.mtime = 1_700_000_000
                if content is None:
                    info.type, info.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(info)
                elif isinstance(content, str):
                    info.type, info.linkname = tarfile.SYMTYPE, content.removeprefix("->")
                    tar.addfile(info)
                else:
                    info.size, info.mode = len(content), 0o755
                    tar.addfile(info, io.BytesIO(content))
        data = buffer.getvalue()
        return gzip.compress(data, mtime=0) if self.gzip else data


def base_layer() -> Layer:
    """A root with a shell and a few tools: the host's binaries and their libraries."""
    layer = Layer()
    for name in ("usr", "usr/bin", "usr/lib", "usr/lib64", "etc", "tmp", "keep", "opq"):
        layer.entries[name] = None
    layer.entries["bin"] = "->usr/bin"
    layer.entries["lib"] = "->usr/lib"
    layer.entries["lib64"] = "->usr/lib64"
    libraries: set[str] = set()
    for tool in TOOLS:
        layer.entries[tool.lstrip("/")] = Path(tool).read_bytes()
        libraries |= _libraries(tool)
    layer.entries["usr/bin/sh"] = "->dash"
    layer.entries["usr/bin/bash"] = "->dash"  # E2B's SDK runs commands with bash -l -c
    for library in sorted(libraries):
        # the name the loader looks for, under /usr (the image's /lib is a link to it)
        relative = "usr/" + library.lstrip("/").removeprefix("usr/")
        parent = os.path.dirname(relative)
        layer.entries.setdefault(parent, None)
        layer.entries[relative] = Path(library).read_bytes()
    loader = os.path.realpath("/lib64/ld-linux-x86-64.so.2")
    layer.entries.setdefault("usr/lib64/ld-linux-x86-64.so.2", "->" + loader)
    layer.entries["etc/passwd"] = b"root:x:0:0:root:/root:/bin/sh\n"
    layer.entries["removed"] = b"deleted by the next layer\n"
    layer.entries["opq/old"] = b"hidden by the next layer's opaque marker\n"
    layer.entries["keep/below"] = b"from the base\n"
    return layer


def top_layer() -> Layer:
    return Layer(
        {
            "etc/greeting": b"hello from the image\n",
            ".wh.removed": b"",
            "opq": None,
            "opq/.wh..wh..opq": b"",
            "opq/new": b"only this\n",
            "keep/above": b"from the top\n",
        },
        gzip=True,
    )


IMAGE_CONFIG = {
    "Env": ["PATH=/usr/bin:/bin", "GREETING=from-config"],
    "WorkingDir": "/app",
    "User": "root",
    "Cmd": ["/bin/sh", "-c", "echo started > /tmp/cmd-ran"],
}


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def oci_archive(
    path: Path,
    layers: list[Layer],
    config: dict[str, object] | None = None,
    *,
    corrupt_layer: int | None = None,
) -> Path:
    """Save `layers` as an OCI image layout tarball; `corrupt_layer`: that layer's blob is
    changed after its digest was taken (a digest mismatch)."""
    blobs: dict[str, bytes] = {}
    descriptors = []
    diff_ids = []
    for index, layer in enumerate(layers):
        data = layer.tar()
        digest = _digest(data)
        diff_ids.append(_digest(gzip.decompress(data) if layer.gzip else data))
        if index == corrupt_layer:
            data = data[:-1] + bytes([data[-1] ^ 1])
        blobs[digest] = data
        media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if layer.gzip else "")
        descriptors.append({"mediaType": media, "digest": digest, "size": len(data)})
    config_doc = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": config if config is not None else IMAGE_CONFIG,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    ).encode()
    blobs[_digest(config_doc)] = config_doc
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": _digest(config_doc),
                "size": len(config_doc),
            },
            "layers": descriptors,
        }
    ).encode()
    blobs[_digest(manifest)] = manifest
    index_doc = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": _digest(manifest),
                    "size": len(manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                }
            ],
        }
    ).encode()
    with tarfile.open(path, "w") as tar:
        _add(tar, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        _add(tar, "index.json", index_doc)
        for digest, data in blobs.items():
            _add(tar, f"blobs/sha256/{digest.removeprefix('sha256:')}", data)
    return path


def docker_archive(
    path: Path, layers: list[Layer], config: dict[str, object] | None = None
) -> Path:
    """Save `layers` (uncompressed) as the older `docker save` format."""
    names = []
    diff_ids = []
    members: dict[str, bytes] = {}
    for index, layer in enumerate(layers):
        data = Layer(layer.entries).tar()
        names.append(f"layer{index}/layer.tar")
        members[names[-1]] = data
        diff_ids.append(_digest(data))
    config_doc = json.dumps(
        {
            "config": config if config is not None else IMAGE_CONFIG,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    ).encode()
    config_name = f"{_digest(config_doc).removeprefix('sha256:')}.json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": ["t:1"], "Layers": names}])
    with tarfile.open(path, "w") as tar:
        _add(tar, "manifest.json", manifest.encode())
        _add(tar, config_name, config_doc)
        for name, data in members.items():
            _add(tar, name, data)
    return path
