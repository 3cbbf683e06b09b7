"""heap.keep_large_buffers: MiB buffers made and dropped over and over are not page-faulted
in anew each time (what glibc's defaults did: docs/benchmarks.md, "Session 14")."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROGRAM = """
import resource, sys
from sandgate import heap
if sys.argv[1] == "tuned":
    heap.keep_large_buffers()
def burst():  # a request's buffers: a body, its frame, a copy; all dropped at its end
    held = [bytearray(1 << 20) for _ in range(3)]
    for b in held:
        b[::4096] = b"x" * len(b[::4096])  # touch every page
burst()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    burst()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    ran = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True
    )
    return int(ran.stdout)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_large_buffers_are_reused_not_faulted_in_again() -> None:
    # 50 bursts of 3 MiB: 38,400 pages if each burst is new memory
    assert faults("tuned") < 2_000
    assert faults("default") > 10_000  # what the setting is for: glibc's own defaults
