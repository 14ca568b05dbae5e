"""An image's size and its start time: `run -d` to `voxserve health` passing (weights loaded, warm-up matched
float64), a few times, with podman or docker. Prints one markdown table row per image.

    python bench/image_start.py voxserve voxserve:cuda [--runs 3] [--engine podman]

Results: bench/results/image.md.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_seconds(engine: str, image: str, timeout_s: float = 600) -> float:
    port, name = _free_port(), f"voxserve-start-{_free_port()}"
    health = [str(Path(sys.executable).parent / "voxserve"), "health", "--url", f"localhost:{port}", "--timeout-s", "2"]
    t0 = time.monotonic()
    subprocess.run([engine, "run", "-d", "--name", name, "-p", f"{port}:8001", image], check=True,
                   capture_output=True)
    try:
        while subprocess.run(health, capture_output=True).returncode != 0:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{image} not ready in {timeout_s} s")
            time.sleep(0.2)
        return time.monotonic() - t0
    finally:
        subprocess.run([engine, "rm", "-f", name], capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("images", nargs="+")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engine", default="podman" if shutil.which("podman") else "docker")
    args = ap.parse_args()
    print("| image | size (GB) | torch | start to ready, s (median of runs; all runs) |")
    print("|---|---:|---|---|")
    for image in args.images:
        size = int(subprocess.run([args.engine, "image", "inspect", "--format", "{{.Size}}", image], check=True,
                                  capture_output=True, text=True).stdout)
        torch = subprocess.run([args.engine, "run", "--rm", "--entrypoint", "python", image, "-c",
                                "import torch; print(torch.__version__, 'CUDA', torch.version.cuda)"],
                               check=True, capture_output=True, text=True).stdout.strip()
        runs = [start_seconds(args.engine, image) for _ in range(args.runs)]
        print(f"| `{image}` | {size / 1e9:.2f} | {torch} | {statistics.median(runs):.1f} "
              f"({', '.join(f'{r:.1f}' for r in runs)}) |", flush=True)


if __name__ == "__main__":
    main()
