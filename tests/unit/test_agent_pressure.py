"""The agent's view of whether the host's CPUs are saturated (agent/pressure.py): the share of
time some task waited for a CPU, from PSI's running total, with a window and two thresholds."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandgate.agent.pressure import (
    BUSY_FROM,
    FREE_BELOW,
    WINDOW_SECONDS,
    CpuPressure,
    never,
    read_stalled_us,
)

PSI = (
    "some avg10=1.00 avg60=2.00 avg300=3.00 total={}\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
)


class Totals:
    """A stall total the test moves on by hand."""

    def __init__(self) -> None:
        self.us: int | None = 0

    def __call__(self) -> int | None:
        return self.us


def stalled(share: float, seconds: float) -> int:
    return round(share * seconds * 1e6)


def test_the_some_total_is_read_from_the_kernels_format(tmp_path: Path) -> None:
    psi = tmp_path / "cpu"
    psi.write_text(PSI.format(123456789))
    assert read_stalled_us(str(psi)) == 123456789


def test_no_file_or_another_format_is_no_pressure_to_read(tmp_path: Path) -> None:
    assert read_stalled_us(str(tmp_path / "missing")) is None
    odd = tmp_path / "odd"
    for text in ("", "full avg10=0.00 total=5\n", "some avg10=1.00 total=x\n", "some total\n"):
        odd.write_text(text)
        assert read_stalled_us(str(odd)) is None, text


def test_the_hosts_own_file_is_read_where_it_has_one() -> None:
    if not Path("/proc/pressure/cpu").exists():
        pytest.skip("this kernel has no PSI")
    first = read_stalled_us("/proc/pressure/cpu")
    assert first is not None
    second = read_stalled_us("/proc/pressure/cpu")
    assert second is not None and second >= first


def started(totals: Totals, at: float = 0.0) -> CpuPressure:
    """A CpuPressure past its first check (which only reads where the first measure starts:
    nothing is read at the agent's start)."""
    cpu = CpuPressure(totals, now=at)
    assert cpu.check(at) is False
    return cpu


def test_nothing_is_read_before_the_first_check() -> None:
    reads: list[int] = []

    def read() -> int:
        reads.append(1)
        return 0

    cpu = CpuPressure(read, now=0.0)
    assert reads == []
    assert cpu.check(5.0) is False  # the start of the first measure, not a measure
    assert reads == [1]


def test_a_share_from_busy_on_is_saturated_and_stays_so_until_below_free() -> None:
    totals = Totals()
    cpu = started(totals)
    t = 0.0
    for share, expected in (
        (BUSY_FROM - 0.05, False),  # under busy: free
        (BUSY_FROM, True),  # from busy: saturated
        (FREE_BELOW + 0.05, True),  # between the two: as it was (saturated)
        (FREE_BELOW - 0.01, False),  # under free: free
        (FREE_BELOW + 0.05, False),  # between the two: as it was (free)
        (1.0, True),
        (-1.0, False),  # a total that went back (it never does): free, and the new base
        (1.0, True),
    ):
        t += 1.0
        assert totals.us is not None
        totals.us += stalled(share, 1.0)
        assert cpu.check(t) is expected, (share, expected)


def test_within_the_window_the_last_measure_stands() -> None:
    totals = Totals()
    cpu = started(totals)
    totals.us = stalled(1.0, WINDOW_SECONDS)
    assert cpu.check(WINDOW_SECONDS) is True
    # no stall at all since, but too short a time to measure it over: still saturated
    assert cpu.check(WINDOW_SECONDS * 1.5) is True
    assert cpu.check(WINDOW_SECONDS * 2.5) is False  # a whole window with none: free


def test_without_pressure_information_the_cpus_are_never_saturated() -> None:
    reads: list[int] = []

    def none() -> int | None:
        reads.append(1)
        return never()

    cpu = CpuPressure(none, now=0.0)
    for t in (0.0, 1.0, 10.0):
        assert cpu.check(t) is False
    assert reads == [1]  # found missing at the first check, never read again


def test_a_read_that_fails_counts_as_free_and_is_tried_again() -> None:
    totals = Totals()
    cpu = started(totals)
    totals.us = stalled(1.0, 1.0)
    assert cpu.check(1.0) is True
    stalled_then = totals.us
    totals.us = None  # out of descriptors, say
    assert cpu.check(2.0) is False
    totals.us = stalled_then + stalled(1.0, 2.0)  # saturated since the last good measure
    assert cpu.check(3.0) is True
