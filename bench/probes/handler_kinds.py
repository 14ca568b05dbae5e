"""What the kind of a gRPC handler costs per request: a trivial ModelInfer sink registered four ways (unary-unary or
stream-unary reading its one message with ``context.read()``, each with and without protobuf parsing the request),
driven by the same closed loop; the sink process's CPU microseconds per request.

    python bench/probes/handler_kinds.py [--concurrency 16] [--seconds 5] [--rounds 2]

voxserve registers ModelInfer as stream-unary (server/protocol/service.py) so that a message the transport refuses
still reaches it and is counted; this measures whether that costs anything.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys

import grpc
import numpy as np

from voxserve.client import build_request
from voxserve.proto import pb
from voxserve.testing.load import closed_loop, cpu_seconds

KINDS = ("unary", "unary, parsed", "stream-unary", "stream-unary, parsed")


def _serve(kind: str, ports) -> None:
    async def main() -> None:
        reply = pb.ModelInferResponse(model_name="sink").SerializeToString()

        async def unary(request, context):
            return reply

        async def stream_unary(requests, context):
            await context.read()
            return reply

        parse = {"request_deserializer": pb.ModelInferRequest.FromString} if kind.endswith("parsed") else {}
        handler = (grpc.stream_unary_rpc_method_handler(stream_unary, **parse) if kind.startswith("stream")
                   else grpc.unary_unary_rpc_method_handler(unary, **parse))
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", {"ModelInfer": handler}),))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    body = build_request(np.zeros((1, 3, 3, 3, 3), np.float32), "voxnet", "FP32").SerializeToString()
    ctx = multiprocessing.get_context("spawn")
    print(f"{os.cpu_count()} CPU cores; requests of {len(body)} bytes, {args.concurrency} outstanding")
    for _ in range(args.rounds):
        for kind in KINDS:
            ports = ctx.Queue()
            sink = ctx.Process(target=_serve, args=(kind, ports), daemon=True)
            sink.start()
            try:
                url = f"127.0.0.1:{ports.get(timeout=60)}"
                asyncio.run(closed_loop(url, body, args.concurrency, 1.5))  # warm
                before = cpu_seconds(sink.pid)
                report = asyncio.run(closed_loop(url, body, args.concurrency, args.seconds))
                used = cpu_seconds(sink.pid) - before
                print(f"{kind:>22}: {report.rate():7.0f} req/s, sink {used / max(report.ok, 1) * 1e6:5.0f} us/request",
                      flush=True)
            finally:
                sink.terminate()
                sink.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
