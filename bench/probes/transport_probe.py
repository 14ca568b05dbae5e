"""Where a large request's time goes on loopback, and what a small one costs a Python gRPC server.

One question, measured side by side on this host: for one reference batch (25 MB) sent over loopback, how long
do a memcpy, a plain TCP socket, and trivial gRPC sinks (sync and asyncio servers; asyncio's loop and uvloop;
default and tuned HTTP/2 settings) take per message, and how much CPU does a sink spend per batch-1 request
(196 KB) under concurrent load, on each loop? Every server runs in a process of its own; the client is one
blocking grpcio channel (large messages) or `voxserve bench` (small ones).

    python bench/probes/transport_probe.py [--messages 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc
import numpy as np

BIG = 128 * 3 * 16 * 32 * 32 * 4  # the reference batch, FP32
LIMITS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]
# HTTP/2 settings tried for large messages, on both ends (gRPC core's channel arguments).
TUNINGS: dict[str, list[tuple[str, int]]] = {
    "default": [],
    "max frame 16 MB": [("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1)],
    "stream window 64 MB": [("grpc.http2.lookahead_bytes", 64 << 20)],
    "write buffer 64 MB": [("grpc.http2.write_buffer_size", 64 << 20)],
    "read chunk 4 MB": [("grpc.experimental.tcp_read_chunk_size", 4 << 20),
                        ("grpc.experimental.tcp_min_read_chunk_size", 1 << 20),
                        ("grpc.experimental.tcp_max_read_chunk_size", 16 << 20)],
}
TUNINGS["all of these"] = [kv for name, kvs in TUNINGS.items() for kv in kvs]
METHOD = "/inference.GRPCInferenceService/ModelInfer"


def _tcp_server(ready, size):
    srv = socket.create_server(("127.0.0.1", 0))
    ready.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(size)
    view = memoryview(buf)
    while True:
        got = 0
        while got < size:
            n = conn.recv_into(view[got:])
            if n == 0:
                return
            got += n
        conn.sendall(b"k")


def _grpc_server(ready, kind, loop, options):
    reply = b"\x0a\x04sink"
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(4), options=LIMITS + options)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService",
            {"ModelInfer": grpc.unary_unary_rpc_method_handler(lambda req, ctx: reply)}),))
        ready.put(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        server.wait_for_termination()
        return

    async def main():
        async def handle(request, context):
            return reply
        server = grpc.aio.server(options=LIMITS + options)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", {"ModelInfer": grpc.unary_unary_rpc_method_handler(handle)}),))
        ready.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    if loop == "uvloop":
        import uvloop
        factory = uvloop.new_event_loop
    else:
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


class Child:
    def __init__(self, target, *args):
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        self.proc = ctx.Process(target=target, args=(ready, *args), daemon=True)
        self.proc.start()
        self.port = ready.get(timeout=60)

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        self.proc.terminate()
        self.proc.join(10)


def _median_ms(fn, messages: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    times = []
    for _ in range(messages):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def memcpy_ms(messages: int) -> tuple[float, float]:
    src = np.random.default_rng(0).integers(0, 255, BIG, dtype=np.uint8)
    dst = np.empty_like(src)
    return _median_ms(lambda: np.copyto(dst, src), messages)


def tcp_ms(messages: int) -> tuple[float, float]:
    child = Child(_tcp_server, BIG)
    payload = os.urandom(BIG)
    with socket.create_connection(("127.0.0.1", child.port)) as s:
        def one():
            s.sendall(payload)
            s.recv(1)
        result = _median_ms(one, messages)
    child.stop()
    return result


def grpc_ms(kind: str, loop: str, tuning: str, messages: int) -> tuple[float, float]:
    options = TUNINGS[tuning]
    child = Child(_grpc_server, kind, loop, options)
    payload = os.urandom(BIG)
    with grpc.insecure_channel(f"127.0.0.1:{child.port}", options=LIMITS + options) as channel:
        call = channel.unary_unary(METHOD)
        result = _median_ms(lambda: call(payload, timeout=60), messages)
    child.stop()
    return result


def small_cpu(loop: str, duration: float, processes: int) -> dict:
    child = Child(_grpc_server, "aio", loop, [])
    c0 = child.cpu_s()
    out = subprocess.run([sys.executable, "-m", "voxserve", "bench", "--url", f"127.0.0.1:{child.port}",
                          "--batch", "1", "--concurrency", "64", "--duration", str(duration), "--processes",
                          str(processes), "--connections", "16", "--json"], capture_output=True, text=True)
    cpu = child.cpu_s() - c0
    child.stop()
    level = json.loads(out.stdout)["levels"][0]
    return {"req_s": level["requests_per_s"], "p99_ms": level["p99_ms"],
            "cpu_us": cpu / max(level["requests"], 1) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=30, help="25 MB messages per row")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds of batch-1 load per row")
    ap.add_argument("--processes", type=int, default=4, help="client processes for the batch-1 rows")
    ap.add_argument("--out", help="also write the report here")
    args = ap.parse_args()
    try:
        import uvloop  # noqa: F401
        loops = ["asyncio", "uvloop"]
    except ImportError:
        loops = ["asyncio"]
    lines = [f"# Loopback transport for large and small requests ({platform.node()}, {os.cpu_count()} cores)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; grpcio {grpc.__version__}, "
             f"Python {platform.python_version()}", f"- command: `python bench/probes/transport_probe.py "
             f"--messages {args.messages} --duration {args.duration} --processes {args.processes}`", "",
             f"## One {BIG / 1e6:.1f} MB message, one at a time (p50 and best of {args.messages})", "",
             "| path | p50 ms | best ms |", "|---|---:|---:|"]

    def row(name, result):
        lines.append(f"| {name} | {result[0]:.2f} | {result[1]:.2f} |")
        print(lines[-1], flush=True)

    row("memcpy of the bytes (numpy, one thread)", memcpy_ms(args.messages))
    row("plain TCP socket (sendall, recv_into a reused buffer)", tcp_ms(args.messages))
    for tuning in TUNINGS:
        row(f"gRPC sync server, {tuning}", grpc_ms("sync", "-", tuning, args.messages))
    for loop in loops:
        for tuning in ("default", "all of these"):
            row(f"gRPC asyncio server ({loop}), {tuning}", grpc_ms("aio", loop, tuning, args.messages))
    lines += ["", f"## Batch-1 requests (196 KB), c=64 over 16 connections from {args.processes} client processes",
              "", "| sink loop | req/s | p99 ms | sink CPU us per request |", "|---|---:|---:|---:|"]
    for loop in loops:
        r = small_cpu(loop, args.duration, args.processes)
        lines.append(f"| {loop} | {r['req_s']:.0f} | {r['p99_ms']:.1f} | {r['cpu_us']:.0f} |")
        print(lines[-1], flush=True)
    report = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    print(report)


if __name__ == "__main__":
    main()
