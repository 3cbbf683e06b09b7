"""`execute` of `echo ok` on this checkout against another, interleaved in one run.

    .venv/bin/python bench/execute_ab.py --baseline /path/to/another/checkout [--n 2000]
        [--language sh|bash|python] [--block 1]

Two servers and workers (bench/files.py's `deployment`: the baseline's runs its `src` first
on PYTHONPATH, e.g. `git worktree add /tmp/base <commit>`), one sandbox each; every request
goes to both, each first every other time, so both see the same machine from one moment to
the next (`--block N`: N requests back to back to one, then N to the other, as one client's
commands come: what the agent does after an answer must then be done before the next
request). Prints both p50s and their ratio. On a noisy machine this resolves 1-2 % where
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


def echo(client: httpx.Client, files: str, language: str) -> float:
    execute = files.removesuffix("/toolbox/files") + "/execute"
    started = time.perf_counter()
    ran = client.post(execute, json={"language": language, "code": "echo ok"})
    took = (time.perf_counter() - started) * 1000
    assert ran.json()["stdout"] == "ok\n", ran.text
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout")
    parser.add_argument("--n", type=int, default=2000, help="requests to each")
    parser.add_argument("--warm", type=int, default=100, help="first requests not counted")
    parser.add_argument("--language", default="sh", choices=("sh", "bash", "python"))
    parser.add_argument(
        "--block",
        type=int,
        default=1,
        help="requests sent to one before the other (1: alternate every request; more: "
        "back to back, as one client's commands come)",
    )
    args = parser.parse_args()
    with ExitStack() as stacks:
        ours = stacks.enter_context(deployment(None))
        theirs = stacks.enter_context(deployment(args.baseline))
        mine: list[float] = []
        base: list[float] = []
        turns = [(ours, mine), (theirs, base)]
        for i in range(0, args.n + args.warm, args.block):
            for (client, files), times in turns if (i // args.block) % 2 == 0 else turns[::-1]:
                times.extend(echo(client, files, args.language) for _ in range(args.block))
        ours_p50 = statistics.median(mine[args.warm :])
        base_p50 = statistics.median(base[args.warm :])
        print(
            f"execute echo ({args.language}) p50 {ours_p50:.3f} ms   baseline p50 {base_p50:.3f} ms   "
            f"ratio {ours_p50 / base_p50:.3f}x   (n={args.n} each)"
        )


if __name__ == "__main__":
    main()
