"""Resource caps and defaults, pure."""

from __future__ import annotations

import pytest

from sandgate.core.caps import ResourceCaps, resolve
from sandgate.errors import ResourceCapError


def test_defaults_fill_what_was_not_asked() -> None:
    caps = ResourceCaps(default_memory_mb=128, default_cpus=0.5, default_pids=64)
    got = resolve({"memory_mb": None, "cpus": 2.0}, caps)
    assert got == {"memory_mb": 128, "cpus": 2.0, "pids": 64, "disk_mb": 1024}


def test_a_value_at_the_cap_is_granted_and_above_it_refused_naming_it() -> None:
    caps = ResourceCaps(max_pids=100)
    assert resolve({"pids": 100}, caps)["pids"] == 100
    with pytest.raises(ResourceCapError) as refused:
        resolve({"pids": 101}, caps)
    assert refused.value.cap == "max_pids" and refused.value.value == 100
    assert "--max-pids" in refused.value.message


def test_a_default_above_its_cap_is_a_problem() -> None:
    assert ResourceCaps().problem() is None
    assert "memory_mb" in (ResourceCaps(max_memory_mb=256).problem() or "")


def test_an_infinite_cap_is_a_problem() -> None:
    assert "finite" in (ResourceCaps(max_cpus=float("inf")).problem() or "")
    assert "finite" in (ResourceCaps(max_memory_mb=float("nan")).problem() or "")  # type: ignore[arg-type]
