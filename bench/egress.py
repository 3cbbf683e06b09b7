"""sandgate benchmark: what the egress gate costs a sandbox's connections.

    .venv/bin/python bench/egress.py [--mb 100] [--n 200]

Starts the tests' own "internet" hosts in a network namespace (tests/nethosts.py), a real
`sandgate server` (SQLite) and a bwrap worker whose gate may reach them, and runs one client
script three ways in the same run:

* **direct**: the host's /usr/bin/python3, straight to the test host (the baseline);
* **gate, open**: inside a sandbox with `network: true` (the gate dials the address asked);
* **gate, allowlist**: inside a sandbox with `{"allow_out": ["allowed.test"]}` (the gate
  reads the Host header and dials the name, resolved through its DNS cache).

It measures the throughput of one `--mb` MB HTTP download, and the time from `connect()` to
the first byte of a small HTTP response (`--n` fresh connections; median and p90), which is
what the gate adds to each connection. And what a sandbox's network namespace costs a cold
create (create-to-running, `--creates` each, `pool: false`): a worker started with
`--no-network` (bwrap's own empty namespace: the baseline) against a gated worker, for
`network: false` (a namespace of the worker's, loopback only) and `network: true` (plus its
link). Medians of one run on a shared machine: compare the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import stack  # noqa: E402  (bench/stack.py)
from tests.nethosts import internet_hosts  # noqa: E402

CLIENT = r"""
import json, socket, statistics, sys, time
name, address, mb, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def request(path):
    s = socket.create_connection((address, 80), timeout=30)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
    return s

firsts = []
for _ in range(n):
    began = time.perf_counter()
    s = request("/")
    s.recv(1)
    firsts.append((time.perf_counter() - began) * 1000)
    s.close()
began = time.perf_counter()
s = request(f"/bytes/{mb * 1000000}")
got = 0
while chunk := s.recv(1 << 20):
    got += len(chunk)
seconds = time.perf_counter() - began
firsts.sort()
print(json.dumps({
    "first_byte_ms_median": statistics.median(firsts),
    "first_byte_ms_p90": firsts[int(len(firsts) * 0.9)],
    "download_mb_s": got / 1e6 / seconds,
    "bytes": got,
}))
"""


def in_sandbox(client: httpx.Client, network: object, argv: list[str]) -> dict[str, float]:
    made = client.post("/api/v1/sandboxes", json={"network": network}, timeout=60)
    made.raise_for_status()
    name = made.json()["name"]
    try:
        client.put(
            f"/api/v1/sandboxes/{name}/toolbox/files",
            params={"path": "/workspace/client.py"},
            content=textwrap.dedent(CLIENT).encode(),
        ).raise_for_status()
        ran = client.post(
            f"/api/v1/sandboxes/{name}/execute",
            json={"code": "python3 /workspace/client.py " + " ".join(argv), "timeout": 600},
            timeout=700,
        )
        ran.raise_for_status()
        body = ran.json()
        if body["exit_code"] != 0:
            raise SystemExit(f"the client failed in the sandbox: {body['stderr']}")
        result: dict[str, float] = json.loads(body["stdout"])
        return result
    finally:
        client.delete(f"/api/v1/sandboxes/{name}")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def cold_create(client: httpx.Client, network: object) -> float:
    """ms from the create request to its answer (running), then the sandbox is deleted."""
    began = time.perf_counter()
    made = client.post("/api/v1/sandboxes", json={"network": network, "pool": False}, timeout=60)
    made.raise_for_status()
    took = (time.perf_counter() - began) * 1000
    client.delete(f"/api/v1/sandboxes/{made.json()['name']}")
    time.sleep(0.6)  # the worker's teardown and spare namespaces are made in between
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=100, help="MB of the download")
    parser.add_argument("--n", type=int, default=200, help="connections timed")
    parser.add_argument("--creates", type=int, default=15, help="cold creates of each kind")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, internet_hosts(Path(tmp)) as net:
        ip = net.addresses["allowed.test"]
        argv = ["allowed.test", ip, str(args.mb), str(args.n)]
        script = Path(tmp) / "client.py"
        script.write_text(textwrap.dedent(CLIENT))
        direct_run = subprocess.run(
            ["/usr/bin/python3", str(script), *argv], capture_output=True, text=True, check=True
        )
        results = {"direct": json.loads(direct_run.stdout)}
        worker_args = ("--egress-permit", net.subnet, "--egress-resolver", net.resolver)
        with stack.running(*worker_args) as gated, stack.running("--no-network") as plain:
            with (
                httpx.Client(base_url=gated.url, headers=auth(gated.key)) as client,
                httpx.Client(base_url=plain.url, headers=auth(plain.key)) as baseline,
            ):
                results["gate, open"] = in_sandbox(client, True, argv)
                results["gate, allowlist"] = in_sandbox(
                    client, {"allow_out": ["allowed.test"]}, argv
                )
                kinds = {
                    "--no-network worker (baseline)": (baseline, False),
                    "gated worker, network: false": (client, False),
                    "gated worker, network: true": (client, True),
                }
                creates: dict[str, list[float]] = {kind: [] for kind in kinds}
                for _ in range(args.creates):  # interleaved: the machine's drift hits all alike
                    for kind, (where, network) in kinds.items():
                        creates[kind].append(cold_create(where, network))
    base = results["direct"]
    print(f"{args.mb} MB download, {args.n} connections timed to the first byte")
    print(f"{'path':<18}{'MB/s':>10}{'× direct':>10}{'1st byte ms':>13}{'p90':>8}{'+ms':>8}")
    for path, r in results.items():
        print(
            f"{path:<18}{r['download_mb_s']:>10.0f}"
            f"{r['download_mb_s'] / base['download_mb_s']:>10.2f}"
            f"{r['first_byte_ms_median']:>13.2f}{r['first_byte_ms_p90']:>8.2f}"
            f"{r['first_byte_ms_median'] - base['first_byte_ms_median']:>8.2f}"
        )
    reference = statistics.median(creates["--no-network worker (baseline)"])
    print(f"\ncold create-to-running, n={args.creates} each")
    print(f"{'worker and sandbox':<34}{'p50 ms':>9}{'max ms':>9}{'× baseline':>12}")
    for kind in sorted(creates, key=lambda k: not k.startswith("--")):
        took = creates[kind]
        p50 = statistics.median(took)
        print(f"{kind:<34}{p50:>9.1f}{max(took):>9.1f}{p50 / reference:>12.2f}")


if __name__ == "__main__":
    main()
