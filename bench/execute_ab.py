"""`execute` of `echo ok` on this checkout against another, interleaved in one run.

    .venv/bin/python bench/execute_ab.py --baseline /path/to/another/checkout [--n 2000]
        [--language sh|bash|python] [--block 1]
    .venv/bin/python bench/execute_ab.py --baseline ... --clients 8 [--seconds 5] [--rounds 6]

Two servers and workers (bench/files.py's `deployment`: the baseline's runs its `src` first
on PYTHONPATH, e.g. `git worktree add /tmp/base <commit>`), one sandbox each; every request
goes to both, each first every other time, so both see the same machine from one moment to
the next (`--block N`: N requests back to back to one, then N to the other, as one client's
commands come: what the agent does after an answer must then be done before the next
request). Prints both p50s and their ratio. On a noisy machine this resolves 1-2 % where
separate runs of bench/bench.py or bench/peer.py, minutes apart, differ by 10-50 %; two
deployments of the same code give 0.99-1.01.

`--clients K`: throughput instead of latency, as bench/bench.py measures it: K sandboxes in
each deployment, one client each sending `execute` back to back for `--seconds`, to one
deployment and then the other (the first alternating), `--rounds` times; prints each round's
requests per second, both medians and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
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


def sandboxes(client: httpx.Client, files: str, count: int) -> list[str]:
    """The execute URLs of `count` sandboxes: the deployment's own and new ones."""
    first = files.removesuffix("/toolbox/files")
    urls = [f"{first}/execute"]
    while len(urls) < count:
        made = client.post("/api/v1/sandboxes", json={"timeout": 3600, "pool": False})
        made.raise_for_status()
        urls.append(f"{first.rsplit('/', 1)[0]}/{made.json()['name']}/execute")
    return urls


def throughput(client: httpx.Client, urls: list[str], seconds: float) -> float:
    """Requests per second of one client per URL, each back to back, for `seconds`."""
    counts = [0] * len(urls)
    stop_at = time.monotonic() + seconds

    def hammer(slot: int) -> None:
        with httpx.Client(base_url=client.base_url, headers=client.headers, timeout=60) as own:
            while time.monotonic() < stop_at:
                ran = own.post(urls[slot], json={"code": "echo ok"})
                counts[slot] += ran.status_code == 200

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(len(urls))]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.monotonic() - began)


def compare_throughput(turns: list[tuple[httpx.Client, str]], args: argparse.Namespace) -> None:
    urls = [sandboxes(client, files, args.clients) for client, files in turns]
    rates: list[list[float]] = [[], []]
    for i in range(args.rounds):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            rates[which].append(throughput(turns[which][0], urls[which], args.seconds))
        print(f"round {i + 1}: {rates[0][-1]:.1f} / baseline {rates[1][-1]:.1f} req/s", flush=True)
    ours, base = statistics.median(rates[0]), statistics.median(rates[1])
    print(
        f"execute throughput, {args.clients} clients: {ours:.1f} req/s   baseline {base:.1f} "
        f"req/s   ratio {ours / base:.3f}x   ({args.rounds} rounds of {args.seconds:g} s each)"
    )


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
    parser.add_argument("--clients", type=int, default=0, help="throughput with this many")
    parser.add_argument("--seconds", type=float, default=5.0, help="each throughput window")
    parser.add_argument("--rounds", type=int, default=6, help="throughput windows of each")
    args = parser.parse_args()
    with ExitStack() as stacks:
        capacity = max(4, args.clients + 4)  # and the worker's warm pool
        ours = stacks.enter_context(deployment(None, capacity))
        theirs = stacks.enter_context(deployment(args.baseline, capacity))
        if args.clients:
            compare_throughput([ours, theirs], args)
            return
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
