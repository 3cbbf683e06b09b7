"""sandgate benchmark of the port proxy: a small GET to a server inside a sandbox.

    .venv/bin/python bench/ports.py [--requests 400] [--rounds 5] [--concurrency 8]
                                    [--download-mb 64]

Starts a real `sandgate server` (SQLite) and bwrap worker, a sandbox without network (2 CPUs,
so the in-sandbox client is not starved by its own server), and in it the test server (tests/port_server.py: Python's http.server, threaded). Then measures
requests/s of `GET /hello.txt` (6 bytes), each on a new connection:
- baseline: a client inside the sandbox itself (urllib, one request after another; then
  `--concurrency` threads), which is the best any proxy can do;
- through the control plane from the host: the path form with the API key, and the preview
  URL (its token cookie, no key), one after another and `--concurrency` at once (httpx).
Each round is `--requests` requests; the numbers are medians over `--rounds` rounds of one
run on a shared machine, and the ratio is proxy / in-sandbox. Last, one large GET
(`--download-mb` MiB of random bytes) in MB/s, in the sandbox and through the proxy (the
median of 3).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import stack  # noqa: E402  (bench/stack.py)
from tests.port_server import ports, start  # noqa: E402

PORT = 8000

DOWNLOAD = """
import sys, time, urllib.request
started = time.perf_counter()
size = 0
with urllib.request.urlopen(sys.argv[1]) as answer:
    while chunk := answer.read(1 << 20):
        size += len(chunk)
print(size / (time.perf_counter() - started) / 1e6)
"""

INSIDE = """
import sys, threading, time, urllib.request
url, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def run(count):
    for _ in range(count):
        with urllib.request.urlopen(url) as answer:
            assert answer.read() == b"hello\\n"
workers = [threading.Thread(target=run, args=(n // threads,)) for _ in range(threads)]
started = time.perf_counter()
for w in workers: w.start()
for w in workers: w.join()
print((n // threads) * threads / (time.perf_counter() - started))
"""


def run_inside(client: httpx.Client, name: str, program: str, args: str) -> float:
    """Run a Python program in the sandbox; the number it prints."""
    put = client.put(
        f"/api/v1/sandboxes/{name}/toolbox/files",
        params={"path": "bench_program.py"},
        content=program.encode(),
    )
    assert put.status_code == 200, put.text
    ran = client.post(
        f"/api/v1/sandboxes/{name}/execute",
        json={"code": f"python3 bench_program.py {args}", "timeout": 300},
        timeout=330,
    )
    assert ran.status_code == 200 and ran.json()["exit_code"] == 0, ran.text
    return float(ran.json()["stdout"])


def inside(client: httpx.Client, name: str, n: int, threads: int) -> float:
    """Requests/s of a client inside the sandbox, to its own 127.0.0.1."""
    return run_inside(client, name, INSIDE, f"http://127.0.0.1:{PORT}/hello.txt {n} {threads}")


def download(client: httpx.Client, path: str) -> float:
    """MB/s of one GET through the proxy."""
    started = time.perf_counter()
    size = 0
    with client.stream("GET", path) as answer:
        assert answer.status_code == 200
        for chunk in answer.iter_bytes():
            size += len(chunk)
    return size / (time.perf_counter() - started) / 1e6


def sequential(client: httpx.Client, path: str, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        answer = client.get(path)
        assert answer.status_code == 200 and answer.content == b"hello\n", answer.text
    return n / (time.perf_counter() - started)


def concurrent(
    url: str, headers: dict[str, str], cookies: httpx.Cookies, path: str, n: int, width: int
) -> float:
    async def run() -> float:
        limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
        async with httpx.AsyncClient(
            base_url=url, headers=headers, cookies=cookies, limits=limits, timeout=60
        ) as client:

            async def one_lane(count: int) -> None:
                for _ in range(count):
                    answer = await client.get(path)
                    assert answer.status_code == 200, answer.text

            started = time.perf_counter()
            await asyncio.gather(*(one_lane(n // width) for _ in range(width)))
            return (n // width) * width / (time.perf_counter() - started)

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=400, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--download-mb", type=int, default=64)
    args = parser.parse_args()
    n, width = args.requests, args.concurrency

    results: dict[str, list[float]] = {}

    def record(label: str, value: float) -> None:
        results.setdefault(label, []).append(value)

    with stack.running() as running:
        headers = {"Authorization": f"Bearer {running.key}"}
        with httpx.Client(base_url=running.url, headers=headers, timeout=60) as client:
            made = client.post(
                "/api/v1/sandboxes",
                json={"network": False, "timeout": 3600, "resources": {"cpus": 2}},
            )
            assert made.status_code == 201, made.text
            name = made.json()["name"]
            start(client, name, PORT)
            path = f"{ports(name, PORT)}/hello.txt"
            preview = client.post(f"{ports(name, PORT)}/preview").json()
            with httpx.Client(timeout=60) as browser:
                assert browser.get(preview["url"]).status_code == 200  # sets the cookie
                for _ in range(args.rounds):
                    record("inside 1", inside(client, name, n, 1))
                    record("key 1", sequential(client, path, n))
                    record("preview 1", sequential(browser, f"{running.url}{path}", n))
                    record(f"inside {width}", inside(client, name, n, width))
                    record(
                        f"key {width}",
                        concurrent(running.url, headers, httpx.Cookies(), path, n, width),
                    )
                    record(
                        f"preview {width}",
                        concurrent(running.url, {}, browser.cookies, path, n, width),
                    )
            mib = args.download_mb
            big = client.post(
                f"/api/v1/sandboxes/{name}/execute",
                json={"code": f"head -c {mib}M /dev/urandom > big.bin"},
            )
            assert big.json()["exit_code"] == 0, big.text
            for _ in range(3):
                url = f"http://127.0.0.1:{PORT}/big.bin"
                record("download inside", run_inside(client, name, DOWNLOAD, url))
                record("download proxy", download(client, f"{ports(name, PORT)}/big.bin"))
            client.delete(f"/api/v1/sandboxes/{name}")

    median = {label: statistics.median(values) for label, values in results.items()}
    print(
        f"sandgate bench ports  cpus={os.cpu_count()}  load={os.getloadavg()[0]:.2f}  "
        f"{n} requests x {args.rounds} rounds, GET of 6 bytes, a new connection each"
    )
    for lanes in (1, width):
        base = median[f"inside {lanes}"]
        print(f"baseline  in the sandbox, urllib, {lanes:2d} at once      {base:8.0f} req/s")
        for label, what in (("key", "path form + API key"), ("preview", "preview URL cookie ")):
            value = median[f"{label} {lanes}"]
            print(
                f"proxy     {what}, {lanes:2d} at once {value:8.0f} req/s   "
                f"({value / base:.2f}x in-sandbox, {1000 / value * lanes:.1f} ms each)"
            )
    base, value = median["download inside"], median["download proxy"]
    print(f"baseline  in the sandbox, one {mib} MiB GET          {base:8.0f} MB/s")
    print(
        f"proxy     path form + API key, one {mib} MiB GET   {value:8.0f} MB/s"
        f"   ({value / base:.2f}x in-sandbox)"
    )


if __name__ == "__main__":
    main()
