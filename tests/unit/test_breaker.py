"""The scheduling breaker's rules (pure): when it opens, what a create is told, the trial."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from sandgate.core import breaker
from sandgate.core.breaker import BreakerPolicy, BreakerRecord

NOW = datetime(2026, 11, 30, 12, tzinfo=UTC)
POLICY = BreakerPolicy(threshold=3, window=600.0, open_for=60.0, trial_lease=40.0)
CLOSED = BreakerRecord(state="closed", updated_at=NOW)


def test_opens_on_the_threshold_not_before() -> None:
    assert breaker.after_timeout(CLOSED, 2, "sb", "slow", NOW, POLICY) is None
    opened = breaker.after_timeout(CLOSED, 3, "sb", "slow", NOW, POLICY)
    assert opened is not None and opened.state == "open"
    assert opened.open_until == NOW + timedelta(seconds=60)
    assert opened.reason is not None and "3 sandboxes" in opened.reason and "slow" in opened.reason
    # already open: more timeouts change nothing (the open period is not extended)
    assert breaker.after_timeout(opened, 4, "sb", "slow", NOW, POLICY) is None


def test_only_the_trials_timeout_reopens_a_half_open_breaker() -> None:
    half = BreakerRecord(state="half_open", updated_at=NOW, reason="r", trial="sb", trial_at=NOW)
    later = NOW + timedelta(seconds=5)
    assert breaker.after_timeout(half, 5, "an-older-create", "slow", later, POLICY) is None
    reopened = breaker.after_timeout(half, 6, "sb", "slow", later, POLICY)
    assert reopened is not None and reopened.state == "open" and reopened.trial is None
    assert reopened.open_until == later + timedelta(seconds=60)
    assert reopened.reason is not None and "trial" in reopened.reason


def test_the_window_starts_at_the_last_close() -> None:
    assert breaker.window_start(CLOSED, NOW, POLICY) == NOW - timedelta(seconds=600)
    recently = replace(CLOSED, closed_at=NOW - timedelta(seconds=10))
    assert breaker.window_start(recently, NOW, POLICY) == NOW - timedelta(seconds=10)


def test_verdicts() -> None:
    assert breaker.verdict(CLOSED, NOW, POLICY).admit
    opened = breaker.after_timeout(CLOSED, 3, "sb", "slow", NOW, POLICY)
    assert opened is not None
    during = breaker.verdict(opened, NOW + timedelta(seconds=20), POLICY)
    assert not during.admit and not during.try_trial
    assert during.retry_after == 40.0
    assert "breaker is open" in during.message and "in 40 s" in during.message
    after = breaker.verdict(opened, NOW + timedelta(seconds=60), POLICY)
    assert not after.admit and after.try_trial
    half = replace(opened, state="half_open", trial="sb", trial_at=NOW + timedelta(seconds=60))
    running = breaker.verdict(half, NOW + timedelta(seconds=70), POLICY)
    assert not running.try_trial and "half-open" in running.message
    abandoned = breaker.verdict(half, NOW + timedelta(seconds=101), POLICY)
    assert abandoned.try_trial  # the trial's lease ran out: another create may take it
