"""Where a batch-1 call's time goes: GPU time per graph replay vs the host's cost of replaying.

    python bench/probes/small_batch_probe.py
"""

import argparse
import statistics
import time

import torch

from voxserve.kernels import reference_weights
from voxserve.kernels.graphs import GraphCache


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    w, b = (t.cuda() for t in reference_weights())
    for shape in ((1, 3, 16, 32, 32), (8, 3, 16, 32, 32)):
        x = torch.randn(shape, device="cuda")
        cache = GraphCache(w, b, min_uses=1)
        cache.note(x)
        entry = cache.lookup(x)
        for _ in range(20):
            entry.replay()
        torch.cuda.synchronize()
        gpu = []
        for _ in range(200):  # one replay alone on an idle GPU: its device time
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            entry.replay()
            e.record()
            e.synchronize()
            gpu.append(s.elapsed_time(e) * 1e3)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):  # host cost: replays enqueued back to back
            entry.replay()
        host = (time.perf_counter() - t0) / 2000 * 1e6
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):  # a full round trip: replay and wait
            entry.replay()
            torch.cuda.synchronize()
        trip = (time.perf_counter() - t0) / 500 * 1e6
        print(f"{shape}: GPU time per replay {statistics.median(gpu):.1f} us, host enqueue {host:.1f} us/replay, "
              f"replay + sync round trip {trip:.1f} us")


if __name__ == "__main__":
    main()
