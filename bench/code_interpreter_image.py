"""sandgate benchmark: E2B's code interpreter on the shipped Debian image vs the host root.

    .venv/bin/python bench/code_interpreter_image.py [--n 100] [--creates 10]

Starts a real `sandgate server` (SQLite) and a bwrap worker with `--pool code-interpreter=3`
(its egress gate permitted to reach the Debian mirror's address), measures E2B's code interpreter SDK on the built-in `code-interpreter`
(the host's root: the baseline), then builds the shipped image with `scripts/build-templates`
(Debian bookworm minbase + ipykernel, numpy, pandas, matplotlib: it needs the Debian mirror)
and measures the same on it: create-to-first-`run_code` from the pool and cold, warm
`run_code("1+1")`, idle PSS of a sandbox with its kernel. Also prints how long the build
took. Medians of one run on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench as base  # noqa: E402  (bench/bench.py: its E2B code interpreter measurement)
import stack  # noqa: E402  (bench/stack.py)


def line(what: str, values: list[float]) -> str:
    return f"{what:<46} {base.summary(values)}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100, help="warm run_code samples")
    parser.add_argument("--creates", type=int, default=10, help="create samples")
    args = parser.parse_args()

    mirror = socket.gethostbyname("deb.debian.org")
    with stack.running("--egress-permit", f"{mirror}/32", "--pool=code-interpreter=3") as running:
        url, key = running.url, running.key
        time.sleep(5)  # the pool fills
        host = base.code_interpreter(url, key, args.n, args.creates)
        began = time.perf_counter()
        subprocess.run(
            [str(ROOT / "scripts" / "build-templates"), url, running.admin],
            check=True,
            capture_output=True,
            timeout=1800,
        )
        build_s = time.perf_counter() - began
        base.code_interpreter(url, key, 1, 3)  # the first hand-outs after the image replaced it
        time.sleep(10)  # the filler drops the stale pool and refills it with the image
        image = base.code_interpreter(url, key, args.n, args.creates)

    print(f"sandgate bench code interpreter image  cpus={os.cpu_count()}")
    print(f"build     scripts/build-templates (bootstrap + build)  {build_s:8.1f} s")
    for label, result in (("host root", host), ("image", image)):
        firsts, colds, warm, idle = result
        print(line(f"{label:<9} create-to-first-run_code (pool)", firsts))
        print(line(f"{label:<9} create-to-first-run_code (cold)", colds))
        print(line(f"{label:<9} run_code('1+1') warm", warm))
        if idle is not None:
            print(f"{label:<9} PSS of an idle sandbox with its kernel  {idle:8.1f} MiB")
    ratio = statistics.median(image[0]) / statistics.median(host[0])
    print(f"ratio     image / host root, pooled first run_code  {ratio:.2f}x")


if __name__ == "__main__":
    main()
