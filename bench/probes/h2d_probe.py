"""Host-to-device copy bandwidth from pinned memory: each GPU alone, then all GPUs at once (one thread
per GPU), without any of voxserve's code: the hardware's ceiling for feeding the GPUs.

    python bench/probes/h2d_probe.py [--mb 25] [--seconds 3]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch


def copy_loop(gpu: int, src: torch.Tensor, seconds: float, out: dict) -> None:
    torch.cuda.set_device(gpu)
    dst = [torch.empty_like(src, device=f"cuda:{gpu}") for _ in range(2)]
    stream = torch.cuda.Stream(gpu)
    n = 0
    with torch.cuda.stream(stream):
        for i in range(4):  # warm
            dst[i % 2].copy_(src, non_blocking=True)
        stream.synchronize()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for i in range(8):
                dst[i % 2].copy_(src, non_blocking=True)
            n += 8
            stream.synchronize()
        elapsed = time.perf_counter() - t0
    out[gpu] = n * src.numel() * src.element_size() / elapsed / 1e9


def run(gpus: list[int], sources: dict[int, torch.Tensor], seconds: float) -> dict:
    out: dict[int, float] = {}
    threads = [threading.Thread(target=copy_loop, args=(g, sources[g], seconds, out)) for g in gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=25.2)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    count = torch.cuda.device_count()
    numel = int(args.mb * 1e6 / 4)
    shared = torch.randn(numel).pin_memory()
    own = {g: torch.randn(numel).pin_memory() for g in range(count)}  # one buffer per GPU
    for g in range(count):
        print(f"GPU {g} alone: {run([g], {g: shared}, args.seconds)[g]:.1f} GB/s", flush=True)
    if count > 1:
        for label, sources in (("one shared buffer", {g: shared for g in range(count)}), ("a buffer each", own)):
            res = run(list(range(count)), sources, args.seconds)
            per = ", ".join(f"GPU {g} {v:.1f}" for g, v in sorted(res.items()))
            print(f"all {count} at once, {label}: {sum(res.values()):.1f} GB/s ({per})", flush=True)


if __name__ == "__main__":
    main()
