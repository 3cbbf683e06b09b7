"""`execute` of `echo ok` on this checkout against another, interleaved in one run.

    .venv/bin/python bench/execute_ab.py --baseline /path/to/another/checkout [--n 2000]

Two servers and workers (bench/files.py's `deployment`: the baseline's runs its `src` first
on PYTHONPATH, e.g. `git worktree add /tmp/base <commit>`), one sandbox each; every request
goes to both, each first every other time, so both see the same machine from one moment to
the next. Prints both p50s and their ratio. On a noisy machine this resolves 1-2 % where
separate runs of bench/bench.py or bench/peer.py, minutes apart, differ by 10-50 %; two
deployments of the same code give 0.99-1.01.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from files import deployment


def echo(client: httpx.Client, files: str) -> float:
    execute = files.removesuffix("/toolbox/files") + "/execute"
    started = time.perf_counter()
    ran = client.post(execute, json={"language": "sh", "code": "echo ok"})
    took = (time.perf_counter() - started) * 1000
    assert ran.json()["stdout"] == "ok\n", ran.text
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout")
    parser.add_argument("--n", type=int, default=2000, help="requests to each")
    parser.add_argument("--warm", type=int, default=100, help="first requests not counted")
    args = parser.parse_args()
    with ExitStack() as stacks:
        ours = stacks.enter_context(deployment(None))
        theirs = stacks.enter_context(deployment(args.baseline))
        mine: list[float] = []
        base: list[float] = []
        for i in range(args.n + args.warm):
            if i % 2:
                base.append(echo(*theirs))
                mine.append(echo(*ours))
            else:
                mine.append(echo(*ours))
                base.append(echo(*theirs))
        ours_p50 = statistics.median(mine[args.warm :])
        base_p50 = statistics.median(base[args.warm :])
        print(
            f"execute echo p50 {ours_p50:.3f} ms   baseline p50 {base_p50:.3f} ms   "
            f"ratio {ours_p50 / base_p50:.3f}x   (n={args.n} each)"
        )


if __name__ == "__main__":
    main()
