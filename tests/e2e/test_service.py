"""The Open Inference Protocol service, in process on an ephemeral port, driven by our client over gRPC."""

from __future__ import annotations

import asyncio
import socket

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from voxserve.client import AsyncClient, Client, InferenceError, build_request
from voxserve.datatypes import bf16_bits_to_float32, float32_to_bf16_bits
from voxserve.kernels import reference_float64, reference_weights
from voxserve.proto import pb, pb_grpc
from voxserve.server.app import VoxServer
from voxserve.server.core.model import relative_error
from voxserve.server.core.weights import WeightsError
from voxserve.server.settings import Settings

from ..conftest import running_server

W, B = reference_weights()
# FP16/BF16 travel rounded; the server widens them exactly and computes in fp32,
# so against a float64 reference on the rounded values the fp32 bound holds.
FP32_TOL = 1e-5


def _ref(x: np.ndarray) -> torch.Tensor:
    return reference_float64(torch.from_numpy(np.ascontiguousarray(x)), W, B)


def _random(rng: torch.Generator, shape) -> np.ndarray:
    return torch.randn(shape, generator=rng).numpy()


@pytest.mark.parametrize("shape", [(2, 3, 16, 32, 32), (1, 3, 3, 3, 3), (3, 3, 5, 9, 17), (5, 3, 4, 11, 6)])
def test_fp32_results_match_float64(server, rng, shape):
    x = _random(rng, shape)
    with Client(server.url) as c:
        y = c.infer(x)
    assert y.shape == (shape[0], 16) and y.dtype == np.float32
    assert relative_error(torch.from_numpy(y), _ref(x)) <= FP32_TOL
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)


def test_fp16_wire(server, rng):
    x = _random(rng, (2, 3, 6, 7, 8)).astype(np.float16)
    with Client(server.url) as c:
        y = c.infer(x, datatype="FP16")
    assert relative_error(torch.from_numpy(y), _ref(x.astype(np.float32))) <= FP32_TOL


def test_bf16_wire(server, rng):
    x = _random(rng, (2, 3, 6, 7, 8))
    rounded = bf16_bits_to_float32(float32_to_bf16_bits(x))
    assert np.abs(rounded - x).max() <= np.abs(x).max() * 2**-8  # it really was rounded to bf16
    with Client(server.url) as c:
        y = c.infer(x, datatype="BF16")
    assert relative_error(torch.from_numpy(y), _ref(rounded)) <= FP32_TOL


def test_typed_contents_in_typed_contents_out(server, rng):
    x = _random(rng, (2, 3, 4, 5, 6))
    request = pb.ModelInferRequest(model_name="voxnet", id="typed-1")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    with grpc.insecure_channel(server.url) as ch:
        response = pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(request)
    assert response.id == "typed-1" and not response.raw_output_contents
    out = response.outputs[0]
    assert (out.name, out.datatype, list(out.shape)) == ("output", "FP32", [2, 16])
    y = np.asarray(out.contents.fp32_contents, dtype=np.float32).reshape(2, 16)
    assert relative_error(torch.from_numpy(y), _ref(x)) <= FP32_TOL


def test_large_request_runs_in_max_batch_pieces(rng):
    with running_server(max_batch=3) as srv:
        assert srv.wait_ready()
        x = _random(rng, (8, 3, 4, 4, 5))
        with Client(srv.url) as c:
            y = c.infer(x)
            stats = c.model_statistics()
        assert relative_error(torch.from_numpy(y), _ref(x)) <= FP32_TOL
        sizes = {b.batch_size: b.compute_infer.count for b in stats.batch_stats}
        # warm-up runs outside the request path; the request ran as 3 + 3 + 2
        assert sizes.get(3, 0) >= 2 and sizes.get(2, 0) >= 1


def test_async_client(server, rng):
    async def go():
        async with AsyncClient(server.url) as c:
            assert await c.is_live() and await c.is_ready()
            xs = [_random(rng, (1, 3, 5, 5, 5)) for _ in range(4)]
            ys = await asyncio.gather(*(c.infer(x) for x in xs))
            return xs, ys

    xs, ys = asyncio.run(go())
    for x, y in zip(xs, ys, strict=True):
        assert relative_error(torch.from_numpy(y), _ref(x)) <= FP32_TOL


def test_metadata_and_config(server):
    with Client(server.url) as c:
        meta = c.server_metadata()
        assert meta.name == "voxserve" and "statistics" in meta.extensions
        m = c.model_metadata()
        assert m.name == "voxnet" and list(m.versions) == ["1"]
        # Each tensor once (generic v2 clients send one input per entry); the other datatypes are in the config.
        assert [(t.name, t.datatype, tuple(t.shape)) for t in m.inputs] == [("input", "FP32", (-1, 3, -1, -1, -1))]
        assert [(t.name, t.datatype, tuple(t.shape)) for t in m.outputs] == [("output", "FP32", (-1, 16))]
        cfg = c.model_config()
        assert cfg.name == "voxnet" and cfg.max_batch_size == server.settings.max_batch
        assert [(i.name, list(i.dims)) for i in cfg.input] == [("input", [3, -1, -1, -1])]
        assert [(o.name, list(o.dims)) for o in cfg.output] == [("output", [16])]
        assert cfg.parameters["device"].string_value == "cpu"
        assert cfg.parameters["kernel"].string_value == "reference-cpu"
        assert cfg.parameters["accepted_input_datatypes"].string_value == "FP32,FP16,BF16"
        assert cfg.dynamic_batching.max_queue_delay_microseconds == int(server.settings.max_queue_delay_ms * 1000)


def test_statistics_count_real_work(server, rng):
    with Client(server.url) as c:
        before = c.model_statistics()
        c.infer(_random(rng, (3, 3, 4, 4, 4)))
        with pytest.raises(InferenceError):
            c.infer(_random(rng, (1, 3, 2, 4, 4)))
        after = c.model_statistics()
    s0, s1 = before.inference_stats, after.inference_stats
    assert after.inference_count - before.inference_count == 3
    assert after.execution_count - before.execution_count == 1
    assert s1.success.count - s0.success.count == 1 and s1.success.ns > s0.success.ns
    assert s1.fail.count - s0.fail.count == 1
    assert s1.compute_infer.count - s0.compute_infer.count == 1 and s1.compute_infer.ns > s0.compute_infer.ns
    assert s1.queue.count - s0.queue.count == 1
    assert after.last_inference >= before.last_inference > 0


def test_health_v1_and_ready(server):
    with grpc.insecure_channel(server.url) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "inference.GRPCInferenceService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    with Client(server.url) as c:
        assert c.is_live() and c.is_ready()


def test_reflection_lists_services(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.url) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names


def test_stream_infer_reports_errors_in_band(server, rng):
    x = _random(rng, (1, 3, 4, 4, 4))
    good = build_request(x, "voxnet", "FP32")
    bad = build_request(_random(rng, (1, 3, 1, 4, 4)), "voxnet", "FP32")
    with grpc.insecure_channel(server.url) as ch:
        replies = list(pb_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer(iter([good, bad, good])))
    assert [bool(r.error_message) for r in replies] == [False, True, False]
    assert replies[1].error_message.startswith("INVALID_ARGUMENT") and "D=1" in replies[1].error_message


def _executions(stub) -> int:
    return stub.ModelStatistics(pb.ModelStatisticsRequest(name="voxnet")).model_stats[0].execution_count


def test_requests_on_one_stream_run_together_and_are_answered_in_order(rng):
    """A stream's requests are not served one after another: with a long queue delay, eight of them sent
    back to back share an execution or two (one at a time would take eight), and the answers still come in
    the order of the requests, each with its id and its own rows."""
    xs = [_random(rng, (1, 3, 4, 5, 6)) for _ in range(8)]
    requests = [build_request(x, "voxnet", "FP32") for x in xs]
    for i, r in enumerate(requests):
        r.id = f"r{i}"
    bad = build_request(_random(rng, (1, 3, 1, 5, 6)), "voxnet", "FP32")
    bad.id = "bad"
    with running_server(max_queue_delay_ms=400) as srv:
        assert srv.wait_ready()
        with grpc.insecure_channel(srv.url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            before = _executions(stub)
            replies = list(stub.ModelStreamInfer(iter([*requests[:4], bad, *requests[4:]]), timeout=60))
            ran = _executions(stub) - before
    assert [r.infer_response.id for r in replies] == ["r0", "r1", "r2", "r3", "bad", "r4", "r5", "r6", "r7"]
    assert replies[4].error_message.startswith("INVALID_ARGUMENT")
    good = replies[:4] + replies[5:]
    for x, r in zip(xs, good, strict=True):
        assert not r.error_message
        out = np.frombuffer(r.infer_response.raw_output_contents[0], np.float32).reshape(1, -1).copy()
        assert relative_error(torch.from_numpy(out), _ref(x)) <= 1e-5
    assert ran <= 2, f"{ran} executions for 8 requests sent together on one stream"


def test_a_cancelled_stream_drops_its_requests(rng):
    """Cancelling a stream cancels the requests it has in progress: under a long queue delay none of them is
    executed after the stream is gone."""
    import threading
    import time

    hold = threading.Event()
    requests = [build_request(_random(rng, (1, 3, 4, 5, 6)), "voxnet", "FP32") for _ in range(3)]

    def sent():
        yield from requests
        hold.wait(30)  # the stream stays open until it is cancelled

    with running_server(max_queue_delay_ms=1500) as srv:
        assert srv.wait_ready()
        with grpc.insecure_channel(srv.url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            before = _executions(stub)
            call = stub.ModelStreamInfer(sent())
            time.sleep(0.5)  # taken in and queued, waiting for the batch to fill
            call.cancel()
            hold.set()
            time.sleep(2.0)  # past the queue delay: a request still queued would have run by now
            assert _executions(stub) == before


def test_async_client_streams_requests_and_gets_outputs_in_order(server, rng):
    xs = [_random(rng, (n, 3, 4, 5, 6)) for n in (1, 3, 2, 1, 4)]
    bad = _random(rng, (1, 3, 2, 5, 6))  # D=2 is smaller than the kernel

    async def main():
        async with AsyncClient(server.url) as c:
            outs = [y async for y in c.infer_stream(xs)]

            async def arrays():  # an async source, refused half-way
                yield xs[0]
                yield bad
                yield xs[1]

            got = []
            with pytest.raises(InferenceError) as err:
                async for y in c.infer_stream(arrays()):
                    got.append(y)
            return outs, got, err.value

    outs, got, error = asyncio.run(main())
    assert [o.shape for o in outs] == [(x.shape[0], 16) for x in xs]
    for x, y in zip(xs, outs, strict=True):
        assert relative_error(torch.from_numpy(y), _ref(x)) <= 1e-5
    assert len(got) == 1 and relative_error(torch.from_numpy(got[0]), _ref(xs[0])) <= 1e-5
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "D=2" in str(error)


def test_start_up_objects_are_frozen_once_ready():
    """Once ready, what start-up left is out of the garbage collector's full collections (server/core/heap.py)."""
    import gc

    gc.unfreeze()
    with running_server() as srv:
        assert srv.wait_ready()
        assert gc.get_freeze_count() > 10_000  # modules, torch, weights: far more in practice
    gc.unfreeze()


def test_weights_file_and_custom_shape(tmp_path, rng):
    from voxserve.server.core import weights as weights_io

    w = torch.randn(5, 2, 4, 4, 4, generator=rng) * 0.2
    b = torch.randn(5, generator=rng) * 0.1
    path = tmp_path / "w.safetensors"
    weights_io.save(weights_io.check(w, b, "test"), path)
    with running_server(weights=str(path), model_name="other") as srv:
        assert srv.wait_ready()
        x = _random(rng, (2, 2, 4, 6, 5))
        with Client(srv.url, model="other") as c:
            y = c.infer(x)
            assert list(c.model_metadata().outputs[0].shape) == [-1, 5]
        assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), w, b)) <= FP32_TOL


@pytest.mark.parametrize(("content", "message"), [
    (b"not a safetensors file", "not a readable safetensors file"),
    (b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":", "not a readable safetensors file"),  # truncated header
    (None, "does not exist"),
])
def test_unusable_weights_stop_start_up_before_any_port_opens(tmp_path, content, message):
    path = tmp_path / "w.safetensors"
    if content is not None:
        path.write_bytes(content)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(host="127.0.0.1", grpc_port=port, http_port=0, metrics_port=-1, device="cpu",
                        weights=str(path))

    async def start() -> None:
        await VoxServer(settings).start()

    with pytest.raises(WeightsError, match=message):
        asyncio.run(start())
    with socket.socket() as s:  # never a half-ready server: nothing was listening
        assert s.connect_ex(("127.0.0.1", port)) != 0
