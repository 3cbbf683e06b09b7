"""The agent's view of whether the host's CPUs are saturated (agent/pressure.py): the share of
time some task waited for a CPU, from PSI's running total, with a window and two thresholds."""

from __future__ import annotations

from pathlib import Path

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


def test_a_share_from_busy_on_is_saturated_and_stays_so_until_below_free() -> None:
    totals = Totals()
    cpu = CpuPressure(totals, now=0.0)
    t = 0.0
    for share, expected in (
        (BUSY_FROM - 0.05, False),  # under busy: free
        (BUSY_FROM, True),  # from busy: saturated
        (FREE_BELOW + 0.05, True),  # between the two: as it was (saturated)
        (FREE_BELOW - 0.01, False),  # under free: free
        (FREE_BELOW + 0.05, False),  # between the two: as it was (free)
        (1.0, True),
    ):
        t += 1.0
        assert totals.us is not None
        totals.us += stalled(share, 1.0)
        assert cpu.check(t) is expected, (share, expected)


def test_within_the_window_the_last_measure_stands() -> None:
    totals = Totals()
    cpu = CpuPressure(totals, now=0.0)
    totals.us = stalled(1.0, WINDOW_SECONDS)
    assert cpu.check(WINDOW_SECONDS) is True
    # no stall at all since, but too short a time to measure it over: still saturated
    assert cpu.check(WINDOW_SECONDS * 1.5) is True
    assert cpu.check(WINDOW_SECONDS * 2.5) is False  # a whole window with none: free


def test_without_pressure_information_the_cpus_are_never_saturated() -> None:
    cpu = CpuPressure(never, now=0.0)
    assert cpu.check(10.0) is False
    totals = Totals()
    gone = CpuPressure(totals, now=0.0)
    totals.us = stalled(1.0, 1.0)
    assert gone.check(1.0) is True
    totals.us = None  # the file went away
    assert gone.check(2.0) is False
    assert gone.check(3.0) is False
