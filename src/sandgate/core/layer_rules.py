"""What an image layer (a tar) may hold, checked where it is imported and where it is
unpacked: names that stay below its root, no sparse members, a bounded member count, and
files that add up to a bounded size. Pure: it looks at `tarfile.TarInfo` records only.
"""

from __future__ import annotations

import tarfile

from sandgate.errors import InvalidRequestError

MAX_MEMBERS = 2_000_000  # files, directories and links in one layer
EXPANSION = 20  # a compressed layer may unpack to this many times its size, plus:
EXPANSION_SLACK = 1 << 30


class LayerRuleError(InvalidRequestError):
    """The layer breaks a rule: its message says which member and why."""

    code = "invalid_template_archive"


def member_parts(name: str) -> list[str]:
    """A member's path as components below the layer's root; refuses a way out."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise LayerRuleError(f"layer member {name!r} leaves the root (it holds '..')")
    return parts


def max_unpacked(blob_size: int, compressed: bool) -> int:
    """The most bytes of files a layer of `blob_size` bytes may unpack to."""
    return blob_size * EXPANSION + EXPANSION_SLACK if compressed else blob_size


class Tally:
    """Counts a layer's members as they are read and refuses the one that breaks a rule."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.members = 0
        self.bytes = 0

    def add(self, member: tarfile.TarInfo) -> list[str]:
        parts = member_parts(member.name)
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise LayerRuleError(f"the layer has more than {MAX_MEMBERS} members")
        if member.issparse():
            raise LayerRuleError(f"layer member {member.name!r} is a sparse file: not supported")
        if member.isreg():
            self.bytes += member.size
            if self.bytes > self.max_bytes:
                raise LayerRuleError(
                    f"the layer unpacks to more than {self.max_bytes} bytes (at {member.name!r})"
                )
        return parts
