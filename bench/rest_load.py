"""A closed-loop load driver for the Open Inference Protocol's REST form (any v2 REST server: voxserve's REST port,
Triton's HTTP endpoint), reporting as the gRPC driver does (``voxserve.client.bench.LevelResult``), so its rows
sit in the same tables.

Requests are built once (JSON, or JSON + binary tensors with Triton's extension) and sent as bytes by aiohttp's
client: N workers, each on a keep-alive connection of its own (HTTP/1.1 carries one request at a time). Spread
over load processes with ``voxserve.client.bench.run_level_processes(..., driver=run_rest_level,
driver_options={"json_length": ...})``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp
import numpy as np

from voxserve.client.bench import LevelResult, level_gate
from voxserve.datatypes import to_wire

HEADER_LENGTH = "Inference-Header-Content-Length"


def rest_body(x: np.ndarray, datatype: str = "FP32", binary: bool = True) -> tuple[bytes, int | None]:
    """An inference request body for ``x`` and the length of its JSON part (None: all JSON). Binary: the tensor's
    wire bytes after the JSON, and the output asked for in binary too; else every value a JSON number."""
    tensor: dict = {"name": "input", "shape": list(x.shape), "datatype": datatype}
    if binary:
        raw = to_wire(x, datatype)
        tensor["parameters"] = {"binary_data_size": len(raw)}
        header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
        return header + raw, len(header)
    tensor["data"] = np.asarray(x, np.float32).ravel().tolist()
    return json.dumps({"inputs": [tensor]}).encode(), None


async def run_rest_level(url: str, payload: bytes, samples: int, tensor_bytes: int, concurrency: int, *,
                         duration_s: float | None, requests: int | None, model: str, target: str,
                         timeout_s: float = 120.0, ready: Callable[[], None] | None = None,
                         json_length: int | None = None, **_grpc_only) -> LevelResult:
    """Drive one concurrency level of POST /v2/models/{model}/infer at ``url`` (host:port) with the body
    ``payload`` (``json_length``: its JSON part's, when binary tensors follow); exactly one of duration_s /
    requests bounds it. The gRPC driver's other options (connections, streaming, credentials, statistics) do not
    apply: each worker has its own connection."""
    body = payload
    headers = {"Content-Type": "application/octet-stream" if json_length else "application/json"}
    if json_length:
        headers[HEADER_LENGTH] = str(json_length)
    endpoint = f"http://{url}/v2/models/{model}/infer"
    result = LevelResult(target, concurrency, 0, 0, 0.0, samples, tensor_bytes, len(body))
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        async with session.get(f"http://{url}/v2/health/ready") as response:  # connected, and the server is up
            await response.read()
        if ready is not None:
            ready()
        result.wall_start = time.time()
        started = time.perf_counter()
        more = level_gate(requests, duration_s)

        async def worker() -> None:
            while more():
                t0 = time.perf_counter()
                try:
                    async with session.post(endpoint, data=body, headers=headers) as response:
                        answer = await response.read()
                        if response.status != 200:
                            result.errors += 1
                            result.failures[(f"HTTP {response.status}", answer[:300].decode(errors="replace"))] += 1
                            continue
                    result.latencies_ms.append((time.perf_counter() - t0) * 1e3)
                    result.requests += 1
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    result.errors += 1
                    result.failures[(type(exc).__name__, str(exc))] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.seconds = time.perf_counter() - started
        result.wall_end = time.time()
    return result
