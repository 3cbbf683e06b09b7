"""What one sandbox may hold, bounded by the operator: the deployment's caps and defaults.

A tenant asks (`resources` in a create); the deployment fills in its defaults for what was
not asked and refuses what is above its caps, naming the cap. Pure: no IO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

from sandgate.errors import ResourceCapError

RESOURCES = ("memory_mb", "cpus", "pids", "disk_mb")
FLAGS = MappingProxyType(
    {
        "memory_mb": "--max-memory-mb",
        "cpus": "--max-cpus",
        "pids": "--max-pids",
        "disk_mb": "--max-disk-mb",
    }
)


@dataclass(frozen=True)
class ResourceCaps:
    max_memory_mb: int = 4096
    max_cpus: float = 4.0
    max_pids: int = 1024
    max_disk_mb: int = 10240  # /workspace and /tmp together
    default_memory_mb: int = 512
    default_cpus: float = 1.0
    default_pids: int = 256
    default_disk_mb: int = 1024

    def problem(self) -> str | None:
        """Why these caps are inconsistent (a default above its cap), or None."""
        for name in RESOURCES:
            default, cap = getattr(self, f"default_{name}"), getattr(self, f"max_{name}")
            if not (math.isfinite(default) and math.isfinite(cap)):
                return f"{name} must be a finite number (default {default:g}, cap {cap:g})"
            if default > cap:
                return f"the default {name} ({default:g}) is above its cap ({cap:g})"
        return None


def resolve(asked: dict[str, int | float | None], caps: ResourceCaps) -> dict[str, int | float]:
    """The resources a sandbox gets: what was asked, else the default; refused above a cap."""
    granted: dict[str, int | float] = {}
    for name in RESOURCES:
        value = asked.get(name)
        if value is None:
            value = getattr(caps, f"default_{name}")
        cap = getattr(caps, f"max_{name}")
        if value > cap:
            raise ResourceCapError(
                f"{name} {value:g} is above this deployment's cap of {cap:g} per sandbox "
                f"({FLAGS[name]}); ask for at most {cap:g}",
                cap=f"max_{name}",
                value=cap,
            )
        granted[name] = value
    return granted
