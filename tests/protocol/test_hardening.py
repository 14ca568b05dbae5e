"""Attacks and careless clients: each test is one that the server once failed (lock-outs, memory bombs, echoed
strings, miscounted requests, protocol edges), run against a real server over real gRPC."""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import signal
import threading
import time
import urllib.request
import weakref

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from voxserve.client import Client, InferenceError, build_request, parse_response
from voxserve.kernels import reference_float64
from voxserve.kernels.reference import reference_weights
from voxserve.proto import pb, pb_grpc
from voxserve.server.core.errors import ServingError
from voxserve.server.protocol import admission
from voxserve.server.protocol.admission import ByteBudget
from voxserve.server.protocol.shm import SHM_DIR

from ..conftest import running_server, serve_process
from ..e2e.test_lifecycle import _wait_for

FP32_TOL = 1e-5
TOKEN = "t" * 32
AUTH = (("authorization", f"Bearer {TOKEN}"),)
LONG = "n" * 16_000


def _x(n: int = 2, shape=(5, 6, 7)) -> np.ndarray:
    return np.random.default_rng().standard_normal((n, 3, *shape), dtype=np.float32)


def _relerr(y: np.ndarray, x: np.ndarray) -> float:
    w, b = reference_weights()
    ref = reference_float64(torch.from_numpy(x), w, b)
    return float(torch.linalg.vector_norm(torch.from_numpy(y).double() - ref) / torch.linalg.vector_norm(ref))


def _counted(srv, code: str, model: str = "voxnet") -> float:
    labels = {"model": model, "code": code}
    return srv.server.metrics.registry.get_sample_value("voxserve_requests_total", labels) or 0.0


def _infer_raw(url: str, request: pb.ModelInferRequest, **kwargs) -> pb.ModelInferResponse:
    with grpc.insecure_channel(url) as ch:
        return pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(request, timeout=30, **kwargs)


def _rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _connection(url: str) -> grpc.aio.Channel:
    """A channel with a connection of its own (channels of equal arguments otherwise share one)."""
    return grpc.aio.insecure_channel(url, options=[("grpc.use_local_subchannel_pool", 1)])


async def _idle_streams(url: str, count: int, metadata=(), watch: bool = False):
    """``count`` calls on one connection that send nothing (ModelStreamInfer) or watch health (Watch), open."""
    channel = _connection(url)
    never = asyncio.Event()

    async def silence():
        await never.wait()
        yield pb.ModelInferRequest()  # pragma: no cover - never reached

    if watch:
        stub = health_pb2_grpc.HealthStub(channel)
        calls = [stub.Watch(health_pb2.HealthCheckRequest(), metadata=metadata) for _ in range(count)]
    else:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelStreamInfer(silence(), metadata=metadata) for _ in range(count)]
    return channel, calls


async def _hang_up(*held) -> None:
    """Cancel the calls and close the channel of each (channel, calls)."""
    for channel, calls in held:
        for call in calls:
            call.cancel()
        await channel.close()


# --- 1. idle streams cannot lock anyone out -------------------------------------------------------------------


def test_a_connection_full_of_idle_streams_leaves_room_for_everyone_else():
    with running_server(max_concurrent_rpcs=16, max_streams_per_connection=8) as srv:
        assert srv.wait_ready()

        async def attack():
            channel, calls = await _idle_streams(srv.url, 40)  # more than the server-wide limit, on one connection
            watch_channel, watches = await _idle_streams(srv.url, 4, watch=True)
            try:
                await asyncio.sleep(0.2)  # let the calls reach the server (they are refused or queue, never end)
                assert srv.server.limiter.active <= 16
                x = _x()
                async with _connection(srv.url) as other:
                    stub = pb_grpc.GRPCInferenceServiceStub(other)
                    for _ in range(5):
                        response = await stub.ModelInfer(build_request(x, "voxnet", "FP32"), timeout=10)
                        assert _relerr(parse_response(response), x) <= FP32_TOL
            finally:
                await _hang_up((channel, calls), (watch_channel, watches))

        asyncio.run(attack())


def test_a_connection_busy_at_its_stream_limit_loses_no_call():
    """A client keeping as many calls open on one connection as --max-streams-per-connection (or more: they wait on
    its side) is never refused a stream. gRPC's overload protection counted a call against the limit until the
    handler's call object was released, a moment after its answer, so such a client's next call was often reset
    with REFUSED_STREAM (UNAVAILABLE 'Stream removed')."""
    with running_server(max_concurrent_rpcs=64, max_streams_per_connection=8) as srv:
        assert srv.wait_ready()
        x = np.random.default_rng().standard_normal((1, 3, 4, 4, 4), dtype=np.float32)
        body = build_request(x, "voxnet", "FP32")

        async def load(concurrency: int, seconds: float) -> tuple[int, list[str]]:
            async with _connection(srv.url) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                stop = asyncio.get_running_loop().time() + seconds
                ok, errors = 0, []

                async def worker():
                    nonlocal ok
                    while asyncio.get_running_loop().time() < stop:
                        try:
                            await stub.ModelInfer(body, timeout=30)
                            ok += 1
                        except grpc.aio.AioRpcError as exc:
                            errors.append(f"{exc.code().name}: {exc.details()}")

                await asyncio.gather(*(worker() for _ in range(concurrency)))
                return ok, errors

        for concurrency in (8, 16):
            ok, errors = asyncio.run(load(concurrency, 2.0))
            assert ok > 0 and not errors, (concurrency, ok, len(errors), errors[:3])


def test_the_server_wide_limit_refuses_with_its_flag_and_counts(monkeypatch):
    monkeypatch.setattr(admission, "PREEMPT_IDLE_S", 600.0)  # no stream idle long enough to be ended for another
    monkeypatch.setattr(admission, "IDLE_STREAM_YIELD_S", 600.0)  # (no stream yields for being idle that long)
    with running_server(max_concurrent_rpcs=8, max_streams_per_connection=4) as srv:
        assert srv.wait_ready()

        async def attack():
            held = [await _idle_streams(srv.url, 4) for _ in range(2)]  # two connections at their share: 8 slots
            try:
                await _wait_for_active(srv, 8)
                before = _counted(srv, "RESOURCE_EXHAUSTED")
                async with _connection(srv.url) as other:
                    stub = pb_grpc.GRPCInferenceServiceStub(other)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.ModelInfer(build_request(_x(), "voxnet", "FP32"), timeout=10)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "--max-concurrent-rpcs" in err.value.details()
                assert _counted(srv, "RESOURCE_EXHAUSTED") == before + 1
            finally:
                await _hang_up(*held)

        asyncio.run(attack())


def test_a_front_ends_refusal_says_the_limit_is_its_own():
    """With --frontends N each front end applies --max-concurrent-rpcs to its own connections: its refusal says
    so, not that the whole server is full (the native front end's says the same: tests/native)."""
    async def refuse(scope: str) -> str:
        limiter = admission.RpcLimiter(1, scope=scope)
        limiter.admit("a", "/m")
        with pytest.raises(ServingError) as err:
            limiter.admit("b", "/m")
        return err.value.message

    assert asyncio.run(refuse("front end")) == ("this front end has 1 RPCs in progress, its limit "
                                                "(--max-concurrent-rpcs, each front end's own); retry later")
    assert asyncio.run(refuse("")).startswith("the server has 1 RPCs in progress")


async def _wait_for_active(srv, count: int) -> None:
    for _ in range(200):
        if srv.server.limiter.active == count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{srv.server.limiter.active} RPCs in progress, not {count}")


async def _ended_for_another(call) -> bool:
    """Whether ``call`` ended UNAVAILABLE because its slot went to another connection's call."""
    try:
        while True:
            await asyncio.wait_for(call.read(), 0.05)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        return False
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "ended for another client's call" in err.details() and "--max-concurrent-rpcs" in err.details()
        return True


async def _infer_on(channel, x: np.ndarray) -> np.ndarray:
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    return parse_response(await stub.ModelInfer(build_request(x, "voxnet", "FP32"), timeout=10))


async def _refused_holding_the_most(srv, channel, x: np.ndarray) -> None:
    """The server full, a call of the connection holding the most slots: refused, and nothing ended for it."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _infer_on(channel, x)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert srv.server.limiter.preempted == 0


def test_idle_streams_over_many_connections_yield_their_slots_to_others(monkeypatch):
    """The server full of idle streams from two connections: every other connection is still served, taking its
    slot from the connection holding the most; a connection that already holds the most is refused."""
    monkeypatch.setattr(admission, "PREEMPT_IDLE_S", 0.05)
    monkeypatch.setattr(admission, "IDLE_STREAM_YIELD_S", 600.0)  # (no stream yields for being idle that long)
    with running_server(max_concurrent_rpcs=8, max_streams_per_connection=8) as srv:
        assert srv.wait_ready()

        async def attack():
            a_channel, watches = await _idle_streams(srv.url, 5, watch=True)
            b_channel, streams = await _idle_streams(srv.url, 3)
            others = [_connection(srv.url)]
            try:
                await _wait_for_active(srv, 8)
                await asyncio.sleep(0.1)
                x = _x()

                await _refused_holding_the_most(srv, a_channel, x)  # A
                # B is served, and ends one of A's watchers (5 -> 4): the server has room again.
                assert _relerr(await _infer_on(b_channel, x), x) <= FP32_TOL
                assert srv.server.limiter.preempted == 1
                # Full again (one more idle stream, of a fresh connection): a stream of another fresh connection is
                # served too, and ends another of A's (4 -> 3).
                refill, idle = await _idle_streams(srv.url, 1)
                await _wait_for_active(srv, 8)
                await asyncio.sleep(0.1)
                stream = pb_grpc.GRPCInferenceServiceStub(others[0]).ModelStreamInfer()
                await stream.write(build_request(x, "voxnet", "FP32"))
                response = await stream.read()
                assert not response.error_message
                assert _relerr(parse_response(response.infer_response), x) <= FP32_TOL
                await stream.done_writing()
                assert srv.server.limiter.preempted == 2
                assert [await _ended_for_another(call) for call in watches].count(True) == 2
                assert not any([await _ended_for_another(call) for call in streams + idle])
                await _hang_up((refill, idle))
            finally:
                await _hang_up((a_channel, watches), (b_channel, streams), *((ch, ()) for ch in others))

        asyncio.run(attack())


def test_infer_calls_that_never_send_their_message_lock_nobody_out(monkeypatch):
    """ModelInfer calls opened and left without their message (no deadline), one per connection over eight
    connections, held every slot for good: each connection held one, no more than a newcomer's share, so nothing
    was ended for anyone. Now a call whose message has not come PREEMPT_IDLE_S after it began is ended for any
    newcomer while the server is full, the one waiting longest first, UNAVAILABLE saying why; health and
    inference of other connections are served."""
    monkeypatch.setattr(admission, "PREEMPT_IDLE_S", 0.05)
    with running_server(max_concurrent_rpcs=8, max_streams_per_connection=8) as srv:
        assert srv.wait_ready()

        async def attack():
            never = asyncio.Event()

            async def nothing():
                await never.wait()
                yield pb.ModelInferRequest()  # pragma: no cover - never reached

            def silent(channel) -> list:
                infer = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer",
                                             request_serializer=pb.ModelInferRequest.SerializeToString,
                                             response_deserializer=pb.ModelInferResponse.FromString)
                return [infer(nothing())]

            held = []
            for _ in range(8):
                channel = _connection(srv.url)
                held.append((channel, silent(channel)))
                await asyncio.sleep(0.01)  # (in turn: the first waits longest)
            other = _connection(srv.url)
            try:
                await _wait_for_active(srv, 8)
                await asyncio.sleep(0.1)
                ready = await pb_grpc.GRPCInferenceServiceStub(other).ServerReady(pb.ServerReadyRequest(), timeout=10)
                assert ready.ready and srv.server.limiter.preempted == 1
                x = _x()
                assert _relerr(await _infer_on(other, x), x) <= FP32_TOL
                assert srv.server.limiter.preempted == 1  # (a slot was free again)
                refill = _connection(srv.url)
                held.append((refill, silent(refill)))  # full again
                await _wait_for_active(srv, 8)
                await asyncio.sleep(0.1)
                assert _relerr(await _infer_on(other, x), x) <= FP32_TOL
                assert srv.server.limiter.preempted == 2
                ended = [i for i, (_, calls) in enumerate(held) if calls[0].done()]
                assert ended == [0, 1], ended  # the two waiting longest
                for i in ended:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await held[i][1][0]
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "still arriving" in err.value.details()
                assert _counted(srv, "UNAVAILABLE") == 2
            finally:
                await _hang_up(*held, (other, ()))

        asyncio.run(attack())


def test_an_infer_call_whose_message_has_come_is_never_ended_for_another(monkeypatch):
    """Both slots held by one connection's ModelInfer calls, their requests in hand (waiting for their batch to
    fill): another connection's call is refused, and they are answered."""
    monkeypatch.setattr(admission, "PREEMPT_IDLE_S", 0.05)
    with running_server(max_concurrent_rpcs=2, max_streams_per_connection=4, max_queue_delay_ms=1500,
                        max_batch=64) as srv:
        assert srv.wait_ready()

        async def go():
            a, c = _connection(srv.url), _connection(srv.url)
            try:
                x = _x()
                stub = pb_grpc.GRPCInferenceServiceStub(a)
                calls = [stub.ModelInfer(build_request(x, "voxnet", "FP32"), timeout=30) for _ in range(2)]
                await _wait_for_active(srv, 2)
                await asyncio.sleep(0.3)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pb_grpc.GRPCInferenceServiceStub(c).ServerReady(pb.ServerReadyRequest(), timeout=10)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                for call in calls:
                    assert _relerr(parse_response(await call), x) <= FP32_TOL
                assert srv.server.limiter.preempted == 0
            finally:
                await _hang_up((a, ()), (c, ()))

        asyncio.run(go())


def test_a_stream_holds_no_more_request_bytes_than_one_call_may():
    """Requests padded with a large unknown parameter, written on one stream without waiting for answers: the
    stream takes in no more of them at once than --max-message-bytes holds (here one, each being over half of it),
    while each waits for its batch to fill; all are answered, in order."""
    with running_server(max_message_bytes=1 << 20, max_queue_delay_ms=300, max_batch=64) as srv:
        assert srv.wait_ready()
        batcher = srv.server.state.runner.batcher
        x = _x(1)

        async def go():
            channel = _connection(srv.url)
            try:
                stream = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer()
                for i in range(4):
                    request = build_request(x, "voxnet", "FP32", request_id=str(i))
                    request.parameters["padding"].string_param = "p" * (600 << 10)
                    await stream.write(request)
                await stream.done_writing()
                depths: list[int] = []
                answers: list[pb.ModelStreamInferResponse] = []

                async def watch() -> None:
                    while len(answers) < 4:
                        depths.append(batcher.depth)
                        await asyncio.sleep(0.005)

                watcher = asyncio.ensure_future(watch())
                async for response in stream:
                    answers.append(response)
                await watcher
                assert [a.infer_response.id for a in answers] == ["0", "1", "2", "3"]
                assert not any(a.error_message for a in answers)
                assert all(_relerr(parse_response(a.infer_response), x) <= FP32_TOL for a in answers)
                assert max(depths) == 1, depths
            finally:
                await channel.close()

        asyncio.run(go())


def test_an_idle_stream_ends_gracefully_for_another_and_a_busy_one_never(monkeypatch):
    monkeypatch.setattr(admission, "PREEMPT_IDLE_S", 0.05)
    monkeypatch.setattr(admission, "IDLE_STREAM_YIELD_S", 600.0)  # (no stream yields for being idle that long)
    with running_server(max_concurrent_rpcs=2, max_streams_per_connection=4, max_queue_delay_ms=1500,
                        max_batch=64) as srv:
        assert srv.wait_ready()

        async def attack():
            x = _x()
            channel, idle = await _idle_streams(srv.url, 2)  # idle: one is ended (gracefully) for another's call
            await _wait_for_active(srv, 2)
            await asyncio.sleep(0.1)
            async with _connection(srv.url) as other:
                response = await pb_grpc.GRPCInferenceServiceStub(other).ModelInfer(
                    build_request(x, "voxnet", "FP32"), timeout=10)
                assert _relerr(parse_response(response), x) <= FP32_TOL
            assert [await _ended_for_another(call) for call in idle].count(True) == 1
            assert srv.server.limiter.preempted == 1
            await _hang_up((channel, idle))
            await _wait_for_active(srv, 0)
            async with _connection(srv.url) as mine:
                stub = pb_grpc.GRPCInferenceServiceStub(mine)
                busy = [stub.ModelStreamInfer() for _ in range(2)]
                for call in busy:  # each request waits in the batch queue for 1.5 s: its stream is busy
                    await call.write(build_request(x, "voxnet", "FP32"))
                await _wait_for_active(srv, 2)
                await asyncio.sleep(0.3)
                async with _connection(srv.url) as other:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await pb_grpc.GRPCInferenceServiceStub(other).ModelInfer(
                            build_request(x, "voxnet", "FP32"), timeout=10)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                for call in busy:
                    response = await call.read()
                    assert _relerr(parse_response(response.infer_response), x) <= FP32_TOL
                    await call.done_writing()
                assert srv.server.limiter.preempted == 1

        asyncio.run(attack())


def test_idle_streams_one_per_connection_yield_to_newcomers_once_idle_long_enough(monkeypatch):
    """Idle streams, one on each of eight connections, held every slot until --stream-idle-timeout-s (60 s): each
    connection held one, no more than a newcomer's share, so nothing was ended for anyone, and reopening them
    kept everyone out for good. Now a stream idle for IDLE_STREAM_YIELD_S is ended for any newcomer while the
    server is full, the longest idle first, UNAVAILABLE saying why; one idle for less is not."""
    monkeypatch.setattr(admission, "IDLE_STREAM_YIELD_S", 0.5)
    with running_server(max_concurrent_rpcs=8, max_streams_per_connection=8) as srv:
        assert srv.wait_ready()

        async def attack():
            held = []
            for _ in range(8):
                held.append(await _idle_streams(srv.url, 1))
                await asyncio.sleep(0.02)  # (in turn: the first is idle longest)
            other = _connection(srv.url)
            try:
                await _wait_for_active(srv, 8)
                x = _x()
                await asyncio.sleep(0.6)
                assert _relerr(await _infer_on(other, x), x) <= FP32_TOL
                ready = await pb_grpc.GRPCInferenceServiceStub(other).ServerReady(pb.ServerReadyRequest(), timeout=10)
                assert ready.ready and srv.server.limiter.preempted == 1  # (the first call's slot was free again)
                held.append(await _idle_streams(srv.url, 1))  # full again, by a stream idle for less
                await _wait_for_active(srv, 8)
                assert _relerr(await _infer_on(other, x), x) <= FP32_TOL
                assert srv.server.limiter.preempted == 2
                ended = [i for i, (_, calls) in enumerate(held) if await _ended_for_another(calls[0])]
                assert ended == [0, 1], ended  # the longest idle, in turn; not the newest
            finally:
                await _hang_up(*held, (other, ()))

        asyncio.run(attack())


def test_connections_one_slot_apart_do_not_end_each_others_streams(monkeypatch):
    """Ending a stream of a connection that holds just one slot more would only let it end one in return: the
    newcomer is refused instead, and nothing is ended."""
    monkeypatch.setattr(admission, "PREEMPT_IDLE_S", 0.05)
    monkeypatch.setattr(admission, "IDLE_STREAM_YIELD_S", 600.0)  # (no stream yields for being idle that long)
    with running_server(max_concurrent_rpcs=4, max_streams_per_connection=4) as srv:
        assert srv.wait_ready()

        async def attack():
            held = [await _idle_streams(srv.url, n) for n in (2, 1, 1)]  # connections holding 2, 1 and 1
            try:
                await _wait_for_active(srv, 4)
                await asyncio.sleep(0.1)
                with pytest.raises(grpc.aio.AioRpcError) as err:  # from the connection holding 1: 2 <= 1 + 1
                    await pb_grpc.GRPCInferenceServiceStub(held[1][0]).ModelInfer(
                        build_request(_x(), "voxnet", "FP32"), timeout=10)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert srv.server.limiter.preempted == 0
            finally:
                await _hang_up(*held)

        asyncio.run(attack())


def test_a_stream_just_answered_is_not_idle(monkeypatch):
    """A stream's answer counts as activity: right after a slow request is answered, its stream is not ended for
    a newcomer as if it had been idle since the request arrived."""
    monkeypatch.setattr(admission, "PREEMPT_IDLE_S", 0.5)
    monkeypatch.setattr(admission, "IDLE_STREAM_YIELD_S", 600.0)  # (no stream yields for being idle that long)
    with running_server(max_concurrent_rpcs=2, max_streams_per_connection=4, max_queue_delay_ms=800,
                        max_batch=64) as srv:
        assert srv.wait_ready()

        async def attack():
            x = _x()
            async with _connection(srv.url) as mine, _connection(srv.url) as other:
                stub = pb_grpc.GRPCInferenceServiceStub(mine)
                streams = [stub.ModelStreamInfer() for _ in range(2)]
                for call in streams:  # both wait in the batch queue for 0.8 s, then are answered together
                    await call.write(build_request(x, "voxnet", "FP32"))
                for call in streams:
                    response = await call.read()
                    assert _relerr(parse_response(response.infer_response), x) <= FP32_TOL
                with pytest.raises(grpc.aio.AioRpcError) as err:  # at once: neither has been idle for 0.5 s
                    await pb_grpc.GRPCInferenceServiceStub(other).ModelInfer(
                        build_request(x, "voxnet", "FP32"), timeout=10)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert srv.server.limiter.preempted == 0
                for call in streams:
                    await call.done_writing()

        asyncio.run(attack())


def test_unauthenticated_probes_hold_no_slot_for_long(tmp_path):
    """With --open-health anyone may Watch; such watchers are bounded per connection and end after the timeout."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    with running_server(auth_token_file=str(tokens), open_health=True, max_concurrent_rpcs=8,
                        max_streams_per_connection=4, stream_idle_timeout_s=0.5) as srv:
        assert srv.wait_ready()

        async def attack():
            held = [await _idle_streams(srv.url, 4, watch=True) for _ in range(2)]
            unauthenticated, streams = await _idle_streams(srv.url, 4)  # refused before they take a slot
            try:
                for _, calls in held:
                    for call in calls:
                        assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
                for call in streams:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call.read()
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                for _, calls in held:  # the watchers end on their own
                    for call in calls:
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await call.read()
                        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                        assert "--stream-idle-timeout-s" in err.value.details()
                x = _x()
                response = await pb_grpc.GRPCInferenceServiceStub(unauthenticated).ModelInfer(
                    build_request(x, "voxnet", "FP32"), metadata=AUTH, timeout=10)
                assert _relerr(parse_response(response), x) <= FP32_TOL
            finally:
                await _hang_up(*held, (unauthenticated, streams))

        asyncio.run(attack())


def test_idle_streams_are_closed_but_busy_ones_are_not():
    with running_server(stream_idle_timeout_s=0.3, max_queue_delay_ms=600, max_batch=64) as srv:
        assert srv.wait_ready()

        async def go():
            async with grpc.aio.insecure_channel(srv.url) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                idle = stub.ModelStreamInfer()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await idle.read()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "idle" in err.value.details() and "--stream-idle-timeout-s" in err.value.details()

                # A request that waits in the queue longer than the idle timeout keeps its stream open.
                busy = stub.ModelStreamInfer()
                x = _x()
                await busy.write(build_request(x, "voxnet", "FP32"))
                answer = await busy.read()
                assert not answer.error_message
                assert _relerr(parse_response(answer.infer_response), x) <= FP32_TOL
                with pytest.raises(grpc.aio.AioRpcError) as err:  # then idle: closed
                    await busy.read()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        asyncio.run(go())


# --- 2. compression bombs ----------------------------------------------------------------------------------------


def _bomb(nbytes: int) -> pb.ModelInferRequest:
    """A request whose one tensor is ``nbytes`` of zeros: gzip shrinks it about a thousandfold."""
    request = pb.ModelInferRequest(model_name="voxnet")
    request.inputs.add(name="input", datatype="FP32", shape=[nbytes // (4 * 3 * 64**3), 3, 64, 64, 64])
    request.raw_input_contents.append(bytes(nbytes))
    return request


def test_compressed_requests_are_refused_before_inflating(tmp_path):
    bomb = _bomb(96 * 1024 * 1024)
    with serve_process(tmp_path / "log", "--device", "cpu", "--max-message-bytes", str(64 * 1024 * 1024)) as srv:
        with Client(srv.url, timeout_s=5) as c:
            _wait_for(c.is_ready, 120, "the server to be ready")
        rss_before = _rss_bytes(srv.proc.pid)
        codes = []

        def send():
            options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 1 << 30)]
            with grpc.insecure_channel(srv.url, options=options) as ch:
                stub = pb_grpc.GRPCInferenceServiceStub(ch)
                codes.append(_rpc_error(lambda: stub.ModelInfer(bomb, timeout=60,
                                                                compression=grpc.Compression.Gzip)).code())

        senders = [threading.Thread(target=send) for _ in range(4)]
        for t in senders:
            t.start()
        with Client(srv.url) as c:  # others are served meanwhile
            x = _x()
            assert _relerr(c.infer(x), x) <= FP32_TOL
        for t in senders:
            t.join()
        assert codes == [grpc.StatusCode.UNIMPLEMENTED] * 4
        assert _rss_bytes(srv.proc.pid) - rss_before < 100 * 1024 * 1024


def test_compression_when_enabled_is_bounded_by_the_message_limit():
    with running_server(grpc_compression=True, max_message_bytes=4 * 1024 * 1024) as srv:
        assert srv.wait_ready()
        x = _x()
        options = [("grpc.max_send_message_length", 1 << 30)]
        with grpc.insecure_channel(srv.url, options=options) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            response = stub.ModelInfer(build_request(x, "voxnet", "FP32"), timeout=30,
                                       compression=grpc.Compression.Gzip)
            assert _relerr(parse_response(response), x) <= FP32_TOL
            ended = ("RESOURCE_EXHAUSTED", "CANCELLED")
            before = sum(_counted(srv, c) for c in ended)
            err = _rpc_error(lambda: stub.ModelInfer(_bomb(8 * 1024 * 1024), timeout=30,
                                                     compression=grpc.Compression.Gzip))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Refused by the transport, counted all the same once the servicer has seen the call end: as
            # RESOURCE_EXHAUSTED, or CANCELLED when the end reaches it as a cancel (grpcio ends a call over the limit
            # and one its client reset alike: inference.py's ModelInfer).
            _wait_for(lambda: sum(_counted(srv, c) for c in ended) == before + 1, 10, "the refusal to be counted")
            assert _counted(srv, "OK") == 1


# --- 3, 4. what a client sends is bounded where it is echoed -------------------------------------------------------


def test_request_ids_are_capped(server):
    x = _x()
    ok = _infer_raw(server.url, build_request(x, "voxnet", "FP32", request_id="i" * 256))
    assert ok.id == "i" * 256
    err = _rpc_error(lambda: _infer_raw(server.url, build_request(x, "voxnet", "FP32", request_id="i" * 257)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 256" in err.details()

    async def stream():
        async with grpc.aio.insecure_channel(server.url) as ch:
            call = pb_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer()
            await call.write(build_request(x, "voxnet", "FP32", request_id="j" * 100_000))
            answer = await call.read()
            await call.done_writing()
            return answer

    answer = asyncio.run(stream())
    assert answer.error_message.startswith("INVALID_ARGUMENT") and answer.infer_response.id == ""


@pytest.mark.parametrize("field", ["model_name", "input_name", "datatype", "output_name", "model_version"])
def test_long_names_get_their_own_error_not_the_transports(server, field):
    request = build_request(_x(), "voxnet", "FP32")
    if field == "model_name":
        request.model_name = LONG
    elif field == "model_version":
        request.model_version = LONG
    elif field == "input_name":
        request.inputs[0].name = LONG
    elif field == "datatype":
        request.inputs[0].datatype = LONG
    else:
        request.outputs.add(name=LONG)
    err = _rpc_error(lambda: _infer_raw(server.url, request))
    assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), err
    assert len(err.details()) < 400 and "16000 characters" in err.details()


def test_a_long_rank_is_quoted_short(server):
    request = build_request(_x(), "voxnet", "FP32")
    del request.inputs[0].shape[:]
    request.inputs[0].shape.extend([1] * 5000)
    err = _rpc_error(lambda: _infer_raw(server.url, request))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and len(err.details()) < 400


@pytest.fixture
def shm_input():
    """``make(x)``: a /dev/shm segment holding ``x``'s bytes, its name returned; removed after the test."""
    paths = []

    def make(x: np.ndarray) -> str:
        name = f"voxserve-hardening-{os.getpid()}-{len(paths)}"
        paths.append(f"{SHM_DIR}/{name}")
        with open(paths[-1], "wb") as f:
            f.write(x.tobytes())
        return name

    yield make
    for path in paths:
        os.unlink(path)


def test_shared_memory_bytes_in_flight_are_bounded(shm_input):
    x = _x(4, (8, 8, 8))
    name = shm_input(x)
    # Room for two requests' copies at a time; six are sent at once.
    with running_server(max_shm_inflight_bytes=2 * x.nbytes) as srv:
        assert srv.wait_ready()
        registry = srv.server.shm
        live, peak = [0], [0]
        lock = threading.Lock()

        def tracked(n: int):  # the server's copies, in memory whose release the test sees
            buffer = np.empty(n, np.uint8)
            with lock:
                live[0] += n
                peak[0] = max(peak[0], live[0])

            def freed() -> None:
                with lock:
                    live[0] -= n

            weakref.finalize(buffer, freed)
            return memoryview(buffer)

        registry.allocate = tracked
        budget = srv.server.service.shm_budget
        budget_peak = [0]
        acquire = budget.acquire

        async def acquire_and_note(nbytes: int) -> None:
            await acquire(nbytes)
            budget_peak[0] = max(budget_peak[0], budget.used)
            assert budget.used <= budget.limit

        budget.acquire = acquire_and_note
        with Client(srv.url) as c:
            c.register_system_shared_memory("in", name, x.nbytes)

            async def many():  # six at once
                return await asyncio.gather(*(asyncio.to_thread(c.infer_shared_memory, x.shape, "in")
                                              for _ in range(6)))

            for y in asyncio.run(many()):
                assert _relerr(y, x) <= FP32_TOL
            # The copies alive at once, as their memory sees it, stay within the budget: a request's room is given
            # back once its copy is freed, not when its answer is sent.
            assert 0 < peak[0] <= 2 * x.nbytes
            assert budget_peak[0] == 2 * x.nbytes  # the budget was full, and requests waited for room
            srv.server.service.shm_budget.limit = x.nbytes - 1  # one request alone is now over the limit
            with pytest.raises(InferenceError) as err:
                c.infer_shared_memory(x.shape, "in")
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-shm-inflight-bytes" in err.value.message


def test_a_cancelled_shared_memory_request_keeps_its_room_until_its_copy_is_freed(shm_input):
    """A request that ends (its deadline) while its copy is still being made leaves that copy in a thread: its room
    in the budget is given back only once the copy is freed, so copies alive never outnumber the budget's room."""
    x = _x(4, (8, 8, 8))
    name = shm_input(x)
    with running_server(max_shm_inflight_bytes=x.nbytes) as srv:
        assert srv.wait_ready()
        registry, budget = srv.server.shm, srv.server.service.shm_budget
        allocate, proceed, copying = registry.allocate, threading.Event(), threading.Event()

        def slow(n: int):  # a copy that takes as long as the test says
            copying.set()
            assert proceed.wait(30)
            return allocate(n)

        registry.allocate = slow
        with Client(srv.url) as c:
            c.register_system_shared_memory("in", name, x.nbytes)
            with Client(srv.url, timeout_s=0.3) as hasty, pytest.raises(InferenceError) as err:
                hasty.infer_shared_memory(x.shape, "in")
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert copying.is_set()
            time.sleep(0.2)  # the server has seen the deadline pass by now
            assert budget.used == x.nbytes  # the copy is still under way: its room is still taken
            registry.allocate = allocate
            proceed.set()
            deadline = time.monotonic() + 10
            while budget.used and time.monotonic() < deadline:
                time.sleep(0.02)
            assert budget.used == 0  # the copy was made, nobody wanted it, it was freed: room given back
            assert _relerr(c.infer_shared_memory(x.shape, "in"), x) <= FP32_TOL


def test_a_finished_requests_copy_is_freed_by_its_last_reference(shm_input):
    """With the garbage collector off, a finished request's copy is freed (and its room given back) as soon as
    the request ends: nothing the server keeps between requests still refers to it."""
    x = _x(4, (8, 8, 8))
    name = shm_input(x)
    with running_server(max_shm_inflight_bytes=x.nbytes) as srv:
        assert srv.wait_ready()
        budget = srv.server.service.shm_budget
        with Client(srv.url) as c:
            c.register_system_shared_memory("in", name, x.nbytes)
            gc.disable()
            try:
                for _ in range(3):
                    assert _relerr(c.infer_shared_memory(x.shape, "in"), x) <= FP32_TOL
                    deadline = time.monotonic() + 2.0  # far below the budget's fallback (COPY_RELEASE_GRACE_S)
                    while budget.used and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert budget.used == 0
            finally:
                gc.enable()


def test_byte_budget_grants_in_order_and_cancelled_waits_take_nothing():
    async def go():
        budget = ByteBudget(10, "thing", "--flag")
        await budget.acquire(6)
        second = asyncio.ensure_future(budget.acquire(6))
        third = asyncio.ensure_future(budget.acquire(3))  # fits now, but waits behind the second
        await asyncio.sleep(0)
        assert not second.done() and not third.done() and budget.used == 6
        second.cancel()
        await asyncio.wait_for(third, 5)  # the cancelled wait took nothing; the next one got its room
        assert second.cancelled() and budget.used == 9
        budget.release(9)
        assert budget.used == 0
        with pytest.raises(Exception, match="--flag 10"):
            await budget.acquire(11)

    asyncio.run(go())


# --- 7. a drain does not wait for idle streams ----------------------------------------------------------------------


def test_sigterm_with_idle_streams_open_exits_at_once_and_answers_what_was_accepted(tmp_path):
    with serve_process(tmp_path / "log", "--device", "cpu", "--grace-period-s", "60",
                       "--max-queue-delay-ms", "1500", "--max-batch", "64") as srv:
        with Client(srv.url, timeout_s=5) as c:
            _wait_for(c.is_ready, 120, "the server to be ready")

        async def go():
            async with _connection(srv.url) as ch:
                stub = pb_grpc.GRPCInferenceServiceStub(ch)
                watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                idle = stub.ModelStreamInfer()
                busy = stub.ModelStreamInfer()
                x = _x()
                await busy.write(build_request(x, "voxnet", "FP32"))  # waits in the queue for 1.5 s
                await asyncio.sleep(0.3)
                srv.proc.send_signal(signal.SIGTERM)
                # The streams stay open on this side, unread: the server must not wait for them (grace: 60 s).
                assert await asyncio.to_thread(srv.proc.wait, 15) == 0
                answer = await busy.read()  # accepted before the signal: answered
                assert not answer.error_message and _relerr(parse_response(answer.infer_response), x) <= FP32_TOL
                codes = []
                for call in (busy, idle):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call.read()
                    codes.append(err.value.code())
                assert codes == [grpc.StatusCode.UNAVAILABLE] * 2
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.aio.AioRpcError):
                    await watch.read()

        asyncio.run(go())
    assert "Traceback" not in srv.log and "CancelledError" not in srv.log


# --- 10, 12, 13, 14, 15. protocol edges ----------------------------------------------------------------------------


def test_model_ready_for_a_wrong_name_reveals_nothing(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    with running_server(auth_token_file=str(tokens), open_health=True) as srv:
        assert srv.wait_ready()
        with grpc.insecure_channel(srv.url) as ch:
            stub = pb_grpc.GRPCInferenceServiceStub(ch)
            assert stub.ModelReady(pb.ModelReadyRequest(name="voxnet"), timeout=10).ready
            err = _rpc_error(lambda: stub.ModelReady(pb.ModelReadyRequest(name="guess"), timeout=10))
            assert err.code() == grpc.StatusCode.NOT_FOUND and "voxnet" not in err.details()
            err = _rpc_error(lambda: stub.ModelReady(pb.ModelReadyRequest(name="voxnet", version="9"), timeout=10))
            assert err.code() == grpc.StatusCode.NOT_FOUND and "'1'" not in err.details()


def test_requests_for_unknown_models_are_counted_apart(server):
    before = _counted(server, "NOT_FOUND", "unknown"), _counted(server, "NOT_FOUND")
    for name in ("nope", "other", LONG):
        err = _rpc_error(lambda n=name: _infer_raw(server.url, build_request(_x(), n, "FP32")))
        assert err.code() == grpc.StatusCode.NOT_FOUND
    assert (_counted(server, "NOT_FOUND", "unknown"), _counted(server, "NOT_FOUND")) == (before[0] + 3, before[1])


def test_reflection_v1_and_v1alpha(server):
    from grpc_reflection.v1alpha import reflection_pb2

    def services(method: str) -> set[str]:
        with grpc.insecure_channel(server.url) as ch:
            call = ch.stream_stream(method, request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            [reply] = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
            return {s.name for s in reply.list_services_response.service}

    for version in ("v1", "v1alpha"):
        listed = services(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo")
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health",
                "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= listed


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_are_refused_naming_the_sample(server, bad):
    x = _x(4)
    x[2, 1, 1, 2, 3] = bad
    with Client(server.url) as c:
        with pytest.raises(InferenceError) as err:
            c.infer(x)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sample 2 (of 4" in err.value.message
        good = np.delete(x, 2, axis=0)
        assert _relerr(c.infer(good), good) <= FP32_TOL


# --- 11. every request counted once, under the code its client saw ---------------------------------------------------


def _requests_total(metrics_port: int) -> collections.Counter[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    counts: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        if line.startswith('voxserve_requests_total{') and 'model="voxnet"' in line:
            counts[line.split('code="')[1].split('"')[0]] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def test_a_deadline_storm_is_counted_as_the_clients_saw_it(tmp_path):
    """1000 requests at concurrency 50, every other one with a 50 ms deadline, against a server that holds each
    batch up to 60 ms for more (so it does not depend on how fast the host is): they expire queued, in execution or
    on the way back, or make it. (The connection may open more streams than the 50 in flight: a stream
    the client has reset stays open on the server until its handler ends, and streams past the limit are refused by
    the transport, which the server never sees.)"""
    with serve_process(tmp_path / "log", "--device", "cpu", "--max-queue-delay-ms", "60",
                       "--max-streams-per-connection", "256") as srv:
        with Client(srv.url, timeout_s=5) as c:
            _wait_for(c.is_ready, 120, "the server to be ready")
        before = _requests_total(srv.metrics_port)
        request = build_request(_x(1, (16, 32, 32)), "voxnet", "FP32")
        seen: collections.Counter[str] = collections.Counter()

        async def storm():
            async with _connection(srv.url) as ch:
                stub = pb_grpc.GRPCInferenceServiceStub(ch)
                left = [1000]

                async def worker():
                    while left[0] > 0:
                        left[0] -= 1
                        try:
                            await stub.ModelInfer(request, timeout=0.05 if left[0] % 2 else 5.0)
                            seen["OK"] += 1
                        except grpc.aio.AioRpcError as exc:
                            seen[exc.code().name] += 1

                await asyncio.gather(*(worker() for _ in range(50)))

        asyncio.run(storm())
        assert sum(seen.values()) == 1000 and seen["DEADLINE_EXCEEDED"] > 0 and seen["OK"] > 0

        def counted():
            after = _requests_total(srv.metrics_port)
            return {code: n for code, n in (after - before).items() if n}

        # A call whose deadline passes before gRPC hands it to the servicer (on the client, or waiting in gRPC's
        # core for the event loop) ends unseen: the server counts what its servicer saw, each once, as the client did.
        _wait_for(lambda: sum(counted().values()) >= 980, 30, "the requests to be counted")
        server = counted()
        assert server.get("OK", 0) == seen["OK"], (dict(seen), server)
        expired = server.get("DEADLINE_EXCEEDED", 0)
        ended = expired + server.get("CANCELLED", 0)
        assert 0.98 * seen["DEADLINE_EXCEEDED"] <= ended <= seen["DEADLINE_EXCEEDED"], (dict(seen), server)
        # A cancellation is the deadline's when it comes near enough to it (inference.DEADLINE_SLACK_S): under CPU
        # contention the client's and the server's clocks for one deadline drift apart, and a few are CANCELLED.
        assert expired >= 0.95 * seen["DEADLINE_EXCEEDED"], (dict(seen), server)
        assert set(server) <= {"OK", "DEADLINE_EXCEEDED", "CANCELLED"}, server
    assert "Traceback" not in srv.log and "ERROR" not in srv.log


def test_statistics_publish_from_two_threads_at_once(tmp_path):
    """The periodic publish runs on a thread that shutdown's final publish can overlap: neither may fail."""
    from voxserve.server.core.stats import ModelStats

    stats = ModelStats()
    stats.share(str(tmp_path), "frontend-1")
    errors: list[BaseException] = []

    def publish_many() -> None:
        try:
            for _ in range(300):
                stats.publish()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=publish_many) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
