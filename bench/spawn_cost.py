"""What one spawn costs an event loop, by loop and by how much memory the process holds.

    .venv/bin/python bench/spawn_cost.py [--mib 10,1000] [--n 30]

For each resident size (touched, so the pages exist), starts `/bin/true` `--n` times with
`asyncio.create_subprocess_exec` on asyncio's own loop and on uvloop, and prints the median
time to its exit. uvloop spawns through libuv's `fork`, which copies the process's page
tables; CPython's subprocess uses `vfork`. Why the worker runs on asyncio's loop
(docs/benchmarks.md, "Scale, session 12").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import uvloop


async def spawn_times(n: int) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec("/bin/true")
        await process.wait()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--mib", default="10,1000")
    parser.add_argument("--n", type=int, default=30)
    args = parser.parse_args()
    loops: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop,
        "uvloop": uvloop.new_event_loop,
    }
    for mib in (int(m) for m in args.mib.split(",")):
        held = bytearray(mib << 20)
        for i in range(0, len(held), 4096):
            held[i] = 1  # resident, not only reserved
        for name, factory in loops.items():
            with asyncio.Runner(loop_factory=factory) as runner:
                p50 = runner.run(spawn_times(args.n))
            print(f"{mib:>6} MiB resident  {name:<8} spawn to exit p50 {p50:7.2f} ms", flush=True)
        del held


if __name__ == "__main__":
    main()
