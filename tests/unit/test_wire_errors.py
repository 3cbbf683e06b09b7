"""Errors cross tunnels and peer links as codes with their details, read back into the same
class by one table (errors.WIRE_CODES), never recognised by their message."""

from __future__ import annotations

import pytest

from sandgate import errors as e


@pytest.mark.parametrize(
    "error",
    [
        e.ResourceCapError("too big", cap="worker_max_cpus", value=2.0),
        e.LimitExceededError("slow down", limit="rps", retry_after=1.5, code="rate_limited"),
        e.UnavailableError("later", retry_after=7.0, code="queue_timeout"),
        e.ConflictError("sandbox s is not running", code="not_running"),
        e.DiskQuotaExceededError("quota full"),
        e.PathOutsideSandboxError("outside"),
        e.NoCapacityError("full", retry_after=5.0),
    ],
)
def test_an_error_comes_back_as_its_class_with_its_details(error: e.SandgateError) -> None:
    back = e.from_wire(e.to_wire(error))
    assert type(back) is type(error)
    assert (back.code, back.message, back.details()) == (error.code, error.message, error.details())


def test_every_domain_class_code_is_in_the_table() -> None:
    pending: list[type[e.SandgateError]] = [e.SandgateError]
    seen = []
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__ == "sandgate.errors" and cls is not e.SandgateError:
            seen.append(cls)
    store_only = {"idempotency_conflict", "quota_conflict", "capacity_conflict"}
    missing = [c.__name__ for c in seen if c.code not in e.WIRE_CODES and c.code not in store_only]
    assert missing == []


def test_an_unknown_code_or_a_forged_detail_is_a_worker_error_not_a_crash() -> None:
    unknown = e.from_wire({"code": "made_up", "message": "x"})
    assert type(unknown) is e.WorkerError and unknown.code == "made_up"
    forged = e.from_wire(
        {"code": "resource_cap_exceeded", "message": "m", "details": {"value": "NaN?", "cap": 1}}
    )
    assert isinstance(forged, e.ResourceCapError) and forged.value == 0.0 and forged.cap == "1"
    nan = e.from_wire(
        {"code": "unavailable", "message": "m", "details": {"retry_after": float("nan")}}
    )
    assert isinstance(nan, e.UnavailableError) and nan.retry_after == 1.0
    assert isinstance(e.from_wire({}), e.WorkerError)
