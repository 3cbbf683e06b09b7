"""What a worker can hold: its host's budget for all its sandboxes together and the most one
sandbox may get there. Pure: the worker checks a start against it, the control plane a
placement (exactly, in the store's insert), both with these rules.

A worker reports, in its features, under `enforces`:

    {"budget": {"memory_mb": 21504, "disk_mb": 80000}, "sandbox_max": {"memory_mb": 21504,
     "cpus": 2, "pids": 8192, "disk_mb": 80000}, "overcommit": {"memory": 1.0, "disk": 1.0}}

`budget` bounds the sum of what the sandboxes on the worker were granted; `sandbox_max` one
sandbox (a request above it can never run there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sandgate.core.caps import RESOURCES

BUDGETED = ("memory_mb", "disk_mb")  # summed over a worker's sandboxes
PER_SANDBOX = RESOURCES  # what one sandbox is granted: the same names the caps bound


def usage(resources: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """The sum of the budgeted resources of these sandboxes (a missing one counts 0)."""
    total = dict.fromkeys(BUDGETED, 0)
    for granted in resources:
        for name in BUDGETED:
            value = granted.get(name)
            if isinstance(value, int | float):
                total[name] += int(value)
    return total


def budget_of(enforces: Any) -> dict[str, int] | None:
    """The budget in a worker's `enforces`, or None (an older worker: slots only)."""
    budget = enforces.get("budget") if isinstance(enforces, dict) else None
    if not isinstance(budget, dict):
        return None
    return {k: int(v) for k, v in budget.items() if k in BUDGETED and isinstance(v, int | float)}


def sandbox_max_of(enforces: Any) -> dict[str, float]:
    """The most one sandbox may get, from a worker's `enforces` (untrusted: filtered)."""
    most = enforces.get("sandbox_max") if isinstance(enforces, dict) else None
    if not isinstance(most, dict):
        return {}
    return {k: v for k, v in most.items() if k in PER_SANDBOX and isinstance(v, int | float)}


def too_large(need: Mapping[str, Any], sandbox_max: Mapping[str, float]) -> str | None:
    """The first resource `need` asks more of than one sandbox may get, or None."""
    for name in PER_SANDBOX:
        value, most = need.get(name), sandbox_max.get(name)
        if isinstance(value, int | float) and most is not None and value > most:
            return name
    return None


def short_of(
    need: Mapping[str, Any], used: Mapping[str, int], budget: Mapping[str, int]
) -> str | None:
    """The first budgeted resource that adding `need` to `used` would take past `budget`."""
    for name in BUDGETED:
        value = need.get(name)
        if name in budget and isinstance(value, int | float):
            if used.get(name, 0) + value > budget[name]:
                return name
    return None


def room(need: Mapping[str, Any], used: Mapping[str, int], budget: Mapping[str, int]) -> float:
    """How much room is left after `need`, as the smallest fraction of any budget (for
    choosing the emptiest worker); 1.0 without a budget."""
    fractions = [
        (budget[name] - used.get(name, 0) - float(need.get(name) or 0)) / budget[name]
        for name in BUDGETED
        if budget.get(name)
    ]
    return min(fractions, default=1.0)
