"""sandgate benchmark of templates from images, against baselines measured in the same run.

    .venv/bin/python bench/templates.py [--mb 200] [--creates 15]

Makes a ~`--mb` MB OCI image (a small root of the host's binaries, plus a layer of real files
copied from the host's /usr), starts a real `sandgate server` (SQLite) and bwrap worker, and
measures:
- the import (POST /api/v1/templates until its 201: upload, every digest checked, stored);
- the layer unpack alone (`worker/layers.unpack` of the big layer into a fresh directory),
  against `tar -xf` of the same layer as the baseline;
- the first sandbox of the image on the worker (fetch over the tunnel + verify + unpack +
  start), then create-to-running of later cold creates from the cached layers, against cold
  creates of the built-in `default` template in the same run.
Numbers are medians of one run on a shared machine.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import stack  # noqa: E402  (bench/stack.py)
from tests.images import Layer, base_layer, oci_archive, top_layer  # noqa: E402

from sandgate.worker import layers  # noqa: E402

SOURCES = ("/usr/lib/python3", "/usr/lib/python3.11", "/usr/share", "/usr/lib/x86_64-linux-gnu")


def bulk_layer(megabytes: int) -> Layer:
    """Real files from the host's /usr (many small, some large) up to `megabytes`."""
    layer = Layer()
    total = 0
    for source in SOURCES:
        for top, dirs, files in os.walk(source):
            dirs.sort()
            rel_top = "bulk" + top
            layer.entries.setdefault(rel_top, None)
            for name in sorted(files):
                path = os.path.join(top, name)
                if os.path.islink(path) or not os.path.isfile(path):
                    continue
                try:
                    data = Path(path).read_bytes()
                except OSError:
                    continue
                layer.entries[f"{rel_top}/{name}"] = data
                total += len(data)
                if total >= megabytes << 20:
                    return layer
    return layer


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"p50 {statistics.median(values):8.1f} ms   p99 {p99:8.1f} ms   n={len(values)}"


def timed_unpack(tar: bytes, scratch: Path) -> tuple[float, float]:
    ours = scratch / "ours"
    ours.mkdir()
    start = time.perf_counter()
    layers.unpack(io.BytesIO(tar), ours)
    unpack_s = time.perf_counter() - start
    plain = scratch / "tar"
    plain.mkdir()
    tarball = scratch / "layer.tar"
    tarball.write_bytes(tar)
    start = time.perf_counter()
    subprocess.run(["tar", "-xf", str(tarball), "-C", str(plain)], check=True)
    tar_s = time.perf_counter() - start
    shutil.rmtree(ours)
    shutil.rmtree(plain)
    return unpack_s, tar_s


def cold_creates(client: httpx.Client, template: str, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        answer = client.post("/api/v1/sandboxes", json={"template": template, "pool": False})
        elapsed = (time.perf_counter() - start) * 1000
        assert answer.status_code == 201, answer.text
        samples.append(elapsed)
        client.delete(f"/api/v1/sandboxes/{answer.json()['name']}")
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=200, help="size of the image's big layer")
    parser.add_argument("--creates", type=int, default=15, help="cold create samples")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="sandgate-bench-templates-"))
    big = bulk_layer(args.mb)
    big_tar = big.tar()
    archive = oci_archive(work / "image.tar", [base_layer(), big, top_layer()])
    size_mb = archive.stat().st_size / 1e6
    files = sum(1 for v in big.entries.values() if isinstance(v, bytes))

    unpack_s, tar_s = timed_unpack(big_tar, work)

    with stack.running() as running:
        headers = {"Authorization": f"Bearer {running.key}"}
        with httpx.Client(base_url=running.url, headers=headers, timeout=600) as client:
            start = time.perf_counter()
            with open(archive, "rb") as body:
                made = client.post("/api/v1/templates", params={"name": "big"}, content=body)
            import_s = time.perf_counter() - start
            assert made.status_code == 201, made.text

            start = time.perf_counter()
            first = client.post("/api/v1/sandboxes", json={"template": "big", "pool": False})
            first_s = time.perf_counter() - start
            assert first.status_code == 201, first.text
            client.delete(f"/api/v1/sandboxes/{first.json()['name']}")

            cold_default = cold_creates(client, "default", args.creates)
            cold_image = cold_creates(client, "big", args.creates)
    shutil.rmtree(work, ignore_errors=True)

    ratio = statistics.median(cold_image) / statistics.median(cold_default)
    print(f"sandgate bench templates  cpus={os.cpu_count()}  load={os.getloadavg()[0]:.2f}")
    print(f"image     {size_mb:.0f} MB archive, 3 layers, big layer {files} files")
    print(f"baseline  tar -xf of the big layer           {tar_s * 1000:8.0f} ms")
    print(
        f"worker    layers.unpack of the big layer     {unpack_s * 1000:8.0f} ms"
        f"   ({unpack_s / tar_s:.2f}x tar)"
    )
    print(f"API       import (upload, verify, store)      {import_s * 1000:8.0f} ms")
    print(f"API       first create on a worker (fetch+unpack+start) {first_s * 1000:8.0f} ms")
    print(f"baseline  create-to-running, default (cold)  {summary(cold_default)}")
    print(f"API       create-to-running, image (cold)    {summary(cold_image)}")
    print(f"ratio     image / default cold create        {ratio:.2f}x")


if __name__ == "__main__":
    main()
