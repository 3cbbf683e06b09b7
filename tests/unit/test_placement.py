"""A worker's budget and per-sandbox maximum, pure (core.placement)."""

from __future__ import annotations

from sandgate.core import placement

FEATURES = {
    "enforces": {
        "budget": {"memory_mb": 2048, "disk_mb": 10_000},
        "sandbox_max": {"memory_mb": 2048, "cpus": 2.0, "pids": 8192, "disk_mb": 10_000},
    }
}


def test_usage_sums_what_was_granted_and_counts_a_missing_value_as_nothing() -> None:
    grants: list[dict[str, float]] = [
        {"memory_mb": 512, "disk_mb": 1024, "cpus": 1.0},
        {"memory_mb": 256},
    ]
    assert placement.usage(grants) == {"memory_mb": 768, "disk_mb": 1024}


def test_a_sandbox_too_large_for_the_host_is_named() -> None:
    most = placement.sandbox_max_of(FEATURES["enforces"])
    assert placement.too_large({"memory_mb": 2048, "cpus": 2.0}, most) is None
    assert placement.too_large({"memory_mb": 512, "cpus": 4.0}, most) == "cpus"
    assert placement.too_large({"pids": 100_000}, most) == "pids"


def test_the_budget_refuses_the_one_that_does_not_fit() -> None:
    budget = placement.budget_of(FEATURES["enforces"])
    assert budget == {"memory_mb": 2048, "disk_mb": 10_000}
    used = {"memory_mb": 1536, "disk_mb": 2048}
    assert placement.short_of({"memory_mb": 512, "disk_mb": 1024}, used, budget) is None
    assert placement.short_of({"memory_mb": 513, "disk_mb": 1024}, used, budget) == "memory_mb"
    assert placement.short_of({"memory_mb": 1, "disk_mb": 8000}, used, budget) == "disk_mb"


def test_room_is_the_tightest_budget_left() -> None:
    budget = {"memory_mb": 1000, "disk_mb": 1000}
    assert placement.room({"memory_mb": 500}, {"disk_mb": 900}, budget) == 0.1
    assert placement.room({}, {}, {}) == 1.0


def test_an_older_worker_without_a_budget_is_counted_by_slots_only() -> None:
    assert placement.budget_of({"runtime": "bwrap"}.get("enforces")) is None
    assert placement.sandbox_max_of(None) == {}
    assert placement.too_large({"memory_mb": 10**6}, {}) is None


def test_every_budgeted_resource_is_a_field_of_a_workers_sandbox_spec() -> None:
    # the worker sums a budget over its sandboxes' specs by these names (service._check_budget)
    from dataclasses import fields

    from sandgate.worker.runtime.base import SandboxSpec

    spec = SandboxSpec(name="s")
    assert set(placement.BUDGETED) <= {f.name for f in fields(SandboxSpec)}
    assert all(spec.resources()[name] == getattr(spec, name) for name in placement.BUDGETED)
