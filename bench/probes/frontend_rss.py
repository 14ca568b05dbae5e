"""A --frontends front end's resident memory, and whether torch is loaded in it.

    python bench/probes/frontend_rss.py [--device cpu|cuda] [--frontends N]

Starts ``voxserve serve --frontends N`` (engines on --device), waits until the server is ready, then reads
VmRSS and the mapped libraries of each front-end process (found by its role in /proc/PID/environ) and prints
one line per front end.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

from voxserve.client import Client


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _frontends() -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if b"VOXSERVE_ROLE=frontend" in f.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--frontends", type=int, default=1)
    args = parser.parse_args()
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "voxserve", "serve", "--device", args.device, "--frontends",
                             str(args.frontends), "--host", "127.0.0.1", "--grpc-port", str(port),
                             "--metrics-port", "-1", "--http-port", "-1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Client(f"127.0.0.1:{port}", timeout_s=2) as client:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if client.is_ready():
                        break
                except Exception:
                    pass
                time.sleep(0.5)
            else:
                print("the server did not become ready")
                return 1
        for pid in _frontends():
            with open(f"/proc/{pid}/status") as f:
                rss = next(line.split(":", 1)[1].strip() for line in f if line.startswith("VmRSS"))
            with open(f"/proc/{pid}/maps") as f:
                torch_loaded = "libtorch" in f.read()
            print(f"front end pid {pid} (engines on {args.device}): VmRSS {rss}, libtorch mapped: {torch_loaded}")
        return 0
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
