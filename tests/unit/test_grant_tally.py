"""GrantTally: the sandboxes a worker holds, with what they were granted kept summed."""

from __future__ import annotations

import random

import pytest

from sandgate.core import placement
from sandgate.worker.runtime.base import SandboxSpec
from sandgate.worker.state import GrantTally


def summed(specs: list[SandboxSpec]) -> dict[str, int]:
    return {name: sum(int(getattr(s, name)) for s in specs) for name in placement.BUDGETED}


def test_the_sums_follow_every_kind_of_change() -> None:
    """Random puts, replacements, deletes, pops, setdefaults, updates and clears: the kept
    sums always equal the sums taken afresh over what is held."""
    rng = random.Random(17)
    tally: GrantTally[SandboxSpec] = GrantTally(lambda spec: spec)
    for step in range(3000):
        name = f"s{rng.randrange(40)}"
        spec = SandboxSpec(name, memory_mb=rng.choice((64, 256, 512)), disk_mb=rng.randrange(9))
        match step % 7:
            case 0 | 1:
                tally[name] = spec  # new, or a replacement of the same name
            case 2:
                tally.pop(name, None)
            case 3:
                if name in tally:
                    del tally[name]
            case 4:
                tally.setdefault(name, spec)
            case 5:
                tally.update({name: spec, f"{name}x": spec})
            case 6 if step % 500 == 6:
                tally.clear()
        assert tally.granted == summed(list(tally.values()))
    assert len(tally) == len(list(tally)) and all(name in tally for name in tally)


def test_a_missing_name_changes_nothing() -> None:
    tally: GrantTally[SandboxSpec] = GrantTally(lambda spec: spec)
    tally["a"] = SandboxSpec("a", memory_mb=100, disk_mb=10)
    with pytest.raises(KeyError):
        del tally["b"]
    assert tally.pop("b", None) is None
    assert tally.granted == {"memory_mb": 100, "disk_mb": 10}
    assert tally.get("a") is tally["a"] and tally.get("b") is None
