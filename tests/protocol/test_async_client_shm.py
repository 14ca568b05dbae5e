"""AsyncClient's shared-memory calls behave as Client's: the same answers, the same default output size, the same
errors (codes and messages) and the same refusals before anything is sent."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import numpy as np
import pytest
import torch

from voxserve.client import AsyncClient, Client, CudaArray, InferenceError, SharedMemoryBuffer

SHAPE = (2, 3, 4, 5, 6)
COUT = 16


def _name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def _sync_outcome(fn):
    try:
        return "ok", fn()
    except InferenceError as exc:
        return exc.code, exc.message
    except ValueError as exc:
        return ValueError, str(exc)


async def _async_outcome(coro):
    try:
        return "ok", await coro
    except InferenceError as exc:
        return exc.code, exc.message
    except ValueError as exc:
        return ValueError, str(exc)


def test_the_same_answers_defaults_and_errors_as_the_blocking_client(server, rng):
    x = torch.randn(SHAPE, generator=rng).numpy()
    out_bytes = SHAPE[0] * COUT * 4
    region = _name("parity")
    with SharedMemoryBuffer(_name("vox_parity"), x.nbytes + 2 * out_bytes) as segment, Client(server.url) as c:
        segment.write(x)

        def sync_calls():
            c.register_system_shared_memory(region, segment.key, segment.size)
            try:
                return [
                    _sync_outcome(lambda: c.system_shared_memory_status(region)),
                    # no output_byte_size: the output's own size, from the model's metadata
                    _sync_outcome(lambda: c.infer_shared_memory(SHAPE, region, output_region=region,
                                                                output_offset=x.nbytes)),
                    _sync_outcome(lambda: segment.read(np.float32, (SHAPE[0], COUT), offset=x.nbytes).copy()),
                    _sync_outcome(lambda: c.infer_shared_memory(SHAPE, region)),
                    _sync_outcome(lambda: c.infer_shared_memory(SHAPE, region, output_region=region,
                                                                output_offset=x.nbytes, output_byte_size=8)),
                    _sync_outcome(lambda: c.infer_shared_memory(SHAPE, "no_such_region")),
                    _sync_outcome(lambda: c.infer_shared_memory(SHAPE, region, datatype="INT8")),
                    _sync_outcome(lambda: c.system_shared_memory_status("no_such_region")),
                    _sync_outcome(lambda: c.register_system_shared_memory(region, segment.key, segment.size)),
                    _sync_outcome(lambda: c.unregister_system_shared_memory("no_such_region")),
                    _sync_outcome(lambda: c.infer_cuda(CudaArray(region, 0, x.nbytes, SHAPE, "FP32", 0),
                                                       CudaArray(region, 0, 8, (1, 2), "FP16", 0))),
                ]
            finally:
                c.unregister_system_shared_memory(region)

        async def async_calls():
            async with AsyncClient(server.url) as a:
                await a.register_system_shared_memory(region, segment.key, segment.size)
                segment.write(np.zeros((SHAPE[0], COUT), np.float32), offset=x.nbytes)
                try:
                    return [
                        await _async_outcome(a.system_shared_memory_status(region)),
                        await _async_outcome(a.infer_shared_memory(SHAPE, region, output_region=region,
                                                                   output_offset=x.nbytes)),
                        ("ok", segment.read(np.float32, (SHAPE[0], COUT), offset=x.nbytes).copy()),
                        await _async_outcome(a.infer_shared_memory(SHAPE, region)),
                        await _async_outcome(a.infer_shared_memory(SHAPE, region, output_region=region,
                                                                   output_offset=x.nbytes, output_byte_size=8)),
                        await _async_outcome(a.infer_shared_memory(SHAPE, "no_such_region")),
                        await _async_outcome(a.infer_shared_memory(SHAPE, region, datatype="INT8")),
                        await _async_outcome(a.system_shared_memory_status("no_such_region")),
                        await _async_outcome(a.register_system_shared_memory(region, segment.key, segment.size)),
                        await _async_outcome(a.unregister_system_shared_memory("no_such_region")),
                        await _async_outcome(a.infer_cuda(CudaArray(region, 0, x.nbytes, SHAPE, "FP32", 0),
                                                          CudaArray(region, 0, 8, (1, 2), "FP16", 0))),
                    ]
                finally:
                    await a.unregister_system_shared_memory(region)
                    assert await a.system_shared_memory_status() == {}

        blocking = sync_calls()
        awaited = asyncio.run(async_calls())

    assert len(blocking) == len(awaited)
    for i, ((kind_b, value_b), (kind_a, value_a)) in enumerate(zip(blocking, awaited, strict=True)):
        assert kind_a == kind_b, (i, kind_b, value_b, kind_a, value_a)
        if isinstance(value_b, np.ndarray):
            np.testing.assert_array_equal(value_a, value_b)
        else:
            assert value_a == value_b, (i, value_b, value_a)
    # what the answers were, so that equal answers are also right ones
    assert blocking[1] == ("ok", None)
    np.testing.assert_array_equal(blocking[2][1], blocking[3][1])  # written in the region = in the response
    assert blocking[4][0] == grpc.StatusCode.INVALID_ARGUMENT  # 8 bytes for 2 x 16 floats
    assert blocking[5][0] == grpc.StatusCode.NOT_FOUND
    assert blocking[6][0] is ValueError and blocking[10][0] is ValueError  # refused before anything is sent
    assert blocking[8][0] == grpc.StatusCode.ALREADY_EXISTS


@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_the_same_client_settings(server, timeout_s):
    async def main():
        async with AsyncClient(server.url, timeout_s=timeout_s) as a:
            return a.timeout_s, a.model, await a._output_width()

    with Client(server.url, timeout_s=timeout_s) as c:
        assert asyncio.run(main()) == (c.timeout_s, c.model, c._output_width()) == (timeout_s, "voxnet", COUT)
