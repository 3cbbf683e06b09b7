"""The scheduling breaker's rules, apart from where its state is kept (the store).

States: `closed` (creates pass), `open` (creates are refused until `open_until`), `half_open`
(one trial create runs; its outcome closes or re-opens the breaker). A sandbox not ready
within the start timeout is a scheduling timeout; `threshold` of them within `window`
seconds (counting only those since the breaker last closed) open it for `open_for` seconds.

Every function here is pure: the store runs `after_timeout` inside the transaction that
records the timeout, with the breaker's row locked, so two instances never both count the
3rd timeout (or neither).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Literal

BreakerStateName = Literal["closed", "open", "half_open"]
SCHEDULING = "scheduling"  # the name of the one breaker sandgate keeps


@dataclass(frozen=True)
class BreakerPolicy:
    threshold: int  # timeouts within the window that open it
    window: float  # seconds
    open_for: float  # seconds it stays open before a trial
    trial_lease: float  # a trial not concluded within this may be taken over by another create


@dataclass(frozen=True)
class BreakerRecord:
    state: BreakerStateName
    updated_at: datetime
    reason: str | None = None  # why it opened
    opened_at: datetime | None = None
    open_until: datetime | None = None
    trial: str | None = None  # the sandbox whose create is the half-open trial
    trial_at: datetime | None = None
    closed_at: datetime | None = None  # timeouts before this no longer count


CLOSED_AT_START = BreakerRecord(state="closed", updated_at=datetime.min)


def window_start(record: BreakerRecord, now: datetime, policy: BreakerPolicy) -> datetime:
    """The first moment whose timeouts count towards opening."""
    start = now - timedelta(seconds=policy.window)
    if record.closed_at is not None and record.closed_at > start:
        return record.closed_at
    return start


def after_timeout(
    record: BreakerRecord,
    counted: int,
    sandbox: str,
    reason: str,
    now: datetime,
    policy: BreakerPolicy,
) -> BreakerRecord | None:
    """The breaker after `sandbox` timed out (`counted` includes it); None: unchanged.

    While half-open only the trial's own timeout decides (a create admitted before the
    breaker opened may still time out then)."""
    if record.state == "half_open":
        if sandbox != record.trial:
            return None
        return _opened(record, f"the trial create timed out too ({reason})", now, policy)
    if record.state == "closed" and counted >= policy.threshold:
        why = (
            f"{counted} sandboxes were not ready within the start timeout in the last "
            f"{policy.window:g} s (the last: {reason})"
        )
        return _opened(record, why, now, policy)
    return None  # already open, or below the threshold


def _opened(
    record: BreakerRecord, reason: str, now: datetime, policy: BreakerPolicy
) -> BreakerRecord:
    return replace(
        record,
        state="open",
        reason=reason,
        opened_at=now,
        open_until=now + timedelta(seconds=policy.open_for),
        trial=None,
        trial_at=None,
        updated_at=now,
    )


@dataclass(frozen=True)
class Verdict:
    """What admission does with a create, given the breaker as read."""

    admit: bool
    try_trial: bool = False  # admit only if this create wins the trial claim
    retry_after: float = 0.0
    message: str = ""


def verdict(record: BreakerRecord, now: datetime, policy: BreakerPolicy) -> Verdict:
    if record.state == "closed":
        return Verdict(admit=True)
    if record.state == "open":
        assert record.open_until is not None
        left = (record.open_until - now).total_seconds()
        if left <= 0:
            return Verdict(admit=False, try_trial=True)
        return Verdict(
            admit=False,
            retry_after=left,
            message=(
                f"the scheduling breaker is open: {record.reason}; it lets one trial create "
                f"through at {record.open_until.isoformat(timespec='seconds')} "
                f"(in {left:.0f} s)"
            ),
        )
    # half_open: one trial runs; a trial left unconcluded (its instance died) is taken over
    assert record.trial_at is not None
    if (now - record.trial_at).total_seconds() > policy.trial_lease:
        return Verdict(admit=False, try_trial=True)
    return Verdict(
        admit=False,
        retry_after=min(policy.trial_lease, 5.0),
        message=(
            f"the scheduling breaker is half-open: a trial create is running and decides "
            f"whether it closes (it opened because {record.reason})"
        ),
    )


def refused_trial_message(record: BreakerRecord) -> str:
    return (
        "the scheduling breaker is half-open: another create won the trial and decides "
        f"whether it closes (it opened because {record.reason})"
    )
