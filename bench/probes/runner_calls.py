"""Python calls per request through the runner's GPU path (server/core/runner.py) with the stand-in pipeline of
voxserve/testing/fake_pipeline.py: the batcher, the enqueue, the completion watcher and the collect, with no GPU
and no IPC. A count of calls does not swing with a shared VM's noise as its timings do, so it shows what a change
to that path saves before a device measures it (bench/cpu_split.py: the engines' CPU per execution).

    python bench/probes/runner_calls.py [--samples 8] [--concurrency 16] [--requests 320] [--top 25]

Requests of --samples samples at --concurrency; the model's max_batch is 8, so 8 makes one execution per request
(as full batches on the GPU), 1 lets the batcher merge them. Prints calls per request in all and the functions
that make the most.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats

import numpy as np

from voxserve.server.core.batching import BatchingConfig
from voxserve.server.core.runner import Runner
from voxserve.server.core.stats import ModelStats
from voxserve.server.metrics import Metrics
from voxserve.testing.fake_pipeline import FakeGpuModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--submit-thread", action="store_true", help="enqueue on the submit thread (the default "
                        "enqueues on the loop, as the engine of --frontends does)")
    args = parser.parse_args()
    model = FakeGpuModel(max_batch=8)
    runner = Runner([model], ModelStats(), Metrics("voxnet", gpu_metrics=False), BatchingConfig(True, 0.0, 4096),
                    enqueue_on_loop=not args.submit_thread)
    x = np.random.default_rng().standard_normal((args.samples, 3, 2, 2, 2), dtype=np.float32)
    each = max(1, args.requests // args.concurrency)

    async def load(per_worker: int) -> None:
        async def worker() -> None:
            for _ in range(per_worker):
                await runner.run(x, "FP32")

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(load(5))  # warm: the watcher, the batcher's task
        profile = cProfile.Profile()
        profile.enable()
        loop.run_until_complete(load(each))
        profile.disable()
        loop.run_until_complete(runner.close())
    finally:
        model.pipeline.close()
        loop.close()
    n = each * args.concurrency
    stats = pstats.Stats(profile)
    print(f"{stats.total_calls / n:.0f} Python calls per request ({n} requests of {args.samples} samples at "
          f"concurrency {args.concurrency}; the submit {'thread' if args.submit_thread else 'on the loop'})")
    rows = sorted(((v[1], key) for key, v in stats.stats.items()), reverse=True)[: args.top]
    for calls, (path, line, name) in rows:
        print(f"{calls / n:7.1f}  {name} ({path.rsplit('/', 3)[-1] if path != '~' else 'built-in'}:{line})")


if __name__ == "__main__":
    main()
