"""Files through the full path as their size grows: upload and download p50 per size.

    .venv/bin/python bench/files.py [--sizes 1048576,1048577,8388608,33554432] [--n 12]
                                    [--baseline /path/to/another/checkout]

Starts a sandgate server (SQLite) and one bwrap worker (bench/stack.py), creates one
sandbox, and for each size (random bytes) does `--n` uploads (`PUT …/toolbox/files`) each
followed by a download (`GET`) of the same file, checking the bytes. A file of at most one
chunk (`file_chunk_bytes`, 1 MiB) goes in one call each way; a larger one through a handle in
the sandbox, a call per chunk. Prints p50 and p99 of each and the milliseconds per MiB.

With `--baseline`, a second server and worker run that checkout's code (its `src` first on
PYTHONPATH: e.g. `git worktree add /tmp/base <commit>`), and every upload and download is
done on both, alternating (each goes first every other time), so both see the same machine;
each line then shows the baseline's p50 beside this checkout's and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import running


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


@contextmanager
def deployment(code: Path | None, capacity: int = 4) -> Iterator[tuple[httpx.Client, str]]:
    """A stack running this checkout's code, or that of `code`: a client and the files URL
    of a new sandbox."""
    before = os.environ.get("PYTHONPATH")
    if code is not None:
        os.environ["PYTHONPATH"] = str(code / "src")
    try:
        with running(capacity=capacity) as stack:
            if code is not None:  # the children have it; this process's next ones must not
                os.environ.pop("PYTHONPATH")
                if before is not None:
                    os.environ["PYTHONPATH"] = before
            client = httpx.Client(
                base_url=stack.url, headers={"Authorization": f"Bearer {stack.key}"}, timeout=120
            )
            made = client.post("/api/v1/sandboxes", json={"timeout": 3600})
            made.raise_for_status()
            yield client, f"/api/v1/sandboxes/{made.json()['name']}/toolbox/files"
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def round_trip(client: httpx.Client, files: str, data: bytes) -> tuple[float, float]:
    """One upload then one download of `data`: their milliseconds."""
    started = time.perf_counter()
    put = client.put(files, params={"path": "bench.bin"}, content=data)
    uploaded = time.perf_counter()
    got = client.get(files, params={"path": "bench.bin"})
    downloaded = time.perf_counter()
    assert put.is_success, put.text
    assert got.content == data, f"{len(data)} bytes came back different"
    return (uploaded - started) * 1000, (downloaded - uploaded) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="1048576,1048577,8388608,33554432")
    parser.add_argument("--n", type=int, default=12, help="uploads and downloads per size")
    parser.add_argument("--baseline", type=Path, help="another checkout, measured alongside")
    args = parser.parse_args()
    with ExitStack() as stacks:
        ours = stacks.enter_context(deployment(None))
        theirs = stacks.enter_context(deployment(args.baseline)) if args.baseline else None
        for size in (int(s) for s in args.sizes.split(",")):
            data = os.urandom(size)
            times: dict[str, list[float]] = {k: [] for k in ("up", "down", "base up", "base down")}
            for i in range(args.n + 2):  # the first two warm up
                if theirs is not None and i % 2:  # each goes first every other time
                    base_up, base_down = round_trip(*theirs, data)
                up, down = round_trip(*ours, data)
                if theirs is not None and not i % 2:
                    base_up, base_down = round_trip(*theirs, data)
                if i >= 2:
                    times["up"].append(up)
                    times["down"].append(down)
                    if theirs is not None:
                        times["base up"].append(base_up)
                        times["base down"].append(base_down)
            mib = size / (1 << 20)
            for kind, key in (("upload", "up"), ("download", "down")):
                values = times[key]
                p50 = statistics.median(values)
                line = (
                    f"{mib:9.3f} MiB {kind:<8}  p50 {p50:8.2f} ms  p99 {pct(values, 99):8.2f} ms"
                    f"  {p50 / mib:6.2f} ms/MiB"
                )
                if theirs is not None:
                    base = statistics.median(times[f"base {key}"])
                    line += f"   baseline p50 {base:8.2f} ms   ratio {p50 / base:5.2f}x"
                print(line, flush=True)


if __name__ == "__main__":
    main()
