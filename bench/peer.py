"""sandgate's full sandboxed path side by side with SWE-ReX's one hop, in the same run.

    .venv/bin/python bench/peer.py [--rounds 10] [--n 100] [--files 20] [--size 1048576]

SWE-ReX (PyPI `swe-rex`) runs `swerex-remote`: one FastAPI process on the host that runs
commands and reads and writes files itself, no sandbox at all. This script installs it into
a venv of its own (`~/.cache/sandgate-bench/swerex`, made once), starts it on a free port,
starts a sandgate server (SQLite) and one bwrap worker (bench/stack.py), creates one
sandbox, and then interleaves rounds so both see the same machine:

    echo   sandgate `POST /api/v1/sandboxes/{name}/execute {"language": "sh", "code": "echo ok"}`
           SWE-ReX  `POST /execute {"command": "echo ok", "shell": true}`
           (both run `/bin/sh -c "echo ok"`: SWE-ReX's shell is /bin/sh; sandgate's default
           language, bash, is measured too, beside the ratio)
    file   sandgate `PUT …/toolbox/files?path=` with the bytes, then `GET` them back
           SWE-ReX  `POST /write_file {"path", "content"}`, then `POST /read_file`

Both through one keep-alive httpx client each, the payload the same printable bytes (SWE-ReX
carries files as JSON strings). Each round: `--n` echoes and `--files` write+reads on each,
after warm-ups. Prints p50/p99 of every kind and the ratios sandgate/SWE-ReX (below 1: sandgate
is faster). Medians of one run on a shared machine: quote them with the command.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import string
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import free_port, running

PEER_VENV = Path.home() / ".cache" / "sandgate-bench" / "swerex"
PEER_VERSION = "swe-rex==1.4.0"


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def line(label: str, values: list[float]) -> str:
    return (
        f"{label:<28} p50 {statistics.median(values):8.2f} ms   p99 {pct(values, 99):8.2f} ms"
        f"   (n={len(values)})"
    )


def peer_exe() -> Path:
    exe = PEER_VENV / "bin" / "swerex-remote"
    if not exe.exists():
        print(f"installing {PEER_VERSION} into {PEER_VENV} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        subprocess.run(
            [str(PEER_VENV / "bin" / "pip"), "install", "--quiet", PEER_VERSION], check=True
        )
    return exe


def start_peer(token: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(peer_exe()), "--host", "127.0.0.1", "--port", str(port), "--auth-token", token],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/is_alive", headers={"X-API-Key": token}).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("swerex-remote exited at start")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("swerex-remote did not answer within 60 s")


def timed(action: Callable[[], None], times: int, into: list[float]) -> None:
    for _ in range(times):
        start = time.perf_counter()
        action()
        into.append((time.perf_counter() - start) * 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--n", type=int, default=100, help="echoes per round on each side")
    parser.add_argument("--files", type=int, default=20, help="write+reads per round on each")
    parser.add_argument("--size", type=int, default=1 << 20, help="bytes of each file")
    args = parser.parse_args()

    token = secrets.token_hex(16)
    peer, peer_url = start_peer(token)
    payload = "".join(secrets.choice(string.ascii_letters) for _ in range(256)).encode()
    payload = (payload * (args.size // len(payload) + 1))[: args.size]
    text = payload.decode()
    results: dict[str, list[float]] = {
        k: [] for k in ("sg echo", "peer echo", "sg file", "peer file", "sg bash")
    }
    try:
        with running(capacity=4) as stack:
            sg = httpx.Client(
                base_url=stack.url, headers={"Authorization": f"Bearer {stack.key}"}, timeout=60
            )
            ex = httpx.Client(base_url=peer_url, headers={"X-API-Key": token}, timeout=60)
            made = sg.post("/api/v1/sandboxes", json={"timeout": 3600})
            made.raise_for_status()
            files = f"/api/v1/sandboxes/{made.json()['name']}/toolbox/files"
            execute = f"/api/v1/sandboxes/{made.json()['name']}/execute"
            peer_path = f"/tmp/sandgate-peer-{os.getpid()}.txt"

            def sg_echo() -> None:
                got = sg.post(execute, json={"language": "sh", "code": "echo ok"}).json()
                assert got["stdout"] == "ok\n", got

            def sg_bash() -> None:
                got = sg.post(execute, json={"code": "echo ok"}).json()
                assert got["stdout"] == "ok\n", got

            def peer_echo() -> None:
                got = ex.post("/execute", json={"command": "echo ok", "shell": True}).json()
                assert got["stdout"] == "ok\n", got

            def sg_file() -> None:
                assert sg.put(files, params={"path": "bench.txt"}, content=payload).is_success
                assert sg.get(files, params={"path": "bench.txt"}).content == payload

            def peer_file() -> None:
                written = ex.post("/write_file", json={"path": peer_path, "content": text})
                assert written.is_success, written.text
                assert ex.post("/read_file", json={"path": peer_path}).json()["content"] == text

            for action in (sg_echo, peer_echo, sg_file, peer_file, sg_bash):  # warm-ups
                timed(action, 10, [])
            for r in range(args.rounds):
                timed(sg_echo, args.n, results["sg echo"])
                timed(peer_echo, args.n, results["peer echo"])
                timed(sg_file, args.files, results["sg file"])
                timed(peer_file, args.files, results["peer file"])
                timed(sg_bash, args.n // 4, results["sg bash"])
                print(f"round {r + 1}/{args.rounds} done", flush=True)
            Path(peer_path).unlink(missing_ok=True)
    finally:
        peer.terminate()
        peer.wait(10)

    mib = args.size / (1 << 20)
    print()
    print(line("sandgate execute echo", results["sg echo"]))
    print(line("SWE-ReX  execute echo", results["peer echo"]))
    print(line("sandgate execute echo (bash)", results["sg bash"]))
    print(line(f"sandgate {mib:g} MiB write+read", results["sg file"]))
    print(line(f"SWE-ReX  {mib:g} MiB write+read", results["peer file"]))
    print()
    for kind, target in (("echo", 1.0), ("file", 0.5)):
        ours = statistics.median(results[f"sg {kind}"])
        theirs = statistics.median(results[f"peer {kind}"])
        verdict = "met" if ours / theirs <= target else "not met"
        print(
            f"ratio {kind:<5} sandgate/SWE-ReX p50 {ours / theirs:5.2f}x   target <= {target}x: {verdict}"
        )


if __name__ == "__main__":
    main()
