"""System shared memory: register/infer/unregister round trips, and hostile names, keys, offsets and sizes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid

import grpc
import numpy as np
import pytest
import torch

from voxserve.client import AsyncClient, Client, InferenceError, SharedMemoryBuffer, build_shm_request
from voxserve.datatypes import to_wire
from voxserve.kernels import reference_float64, reference_weights
from voxserve.proto import pb, pb_grpc
from voxserve.server.core.model import relative_error

from ..conftest import running_server

W, B = reference_weights()
SHAPE = (2, 3, 5, 6, 7)


def _name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client(server):
    with Client(server.url) as c:
        yield c
        c.unregister_system_shared_memory()


@contextlib.contextmanager
def _segment(data: bytes):
    """A segment under /dev/shm written directly (so a test can replace it), as (key, path); removed at the end."""
    name = _name("vox_seg")
    path = f"/dev/shm/{name}"
    replace_segment(path, data)
    try:
        yield "/" + name, path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def replace_segment(path: str, data: bytes) -> None:
    """Put a new file with ``data`` under ``path``, as a client that unlinks its segment and creates it again. The
    new file exists while the old one does, so it is another inode whatever the file system reuses."""
    with open(path + ".new", "wb") as f:
        f.write(data)
    os.rename(path + ".new", path)


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(InferenceError) as err:
        fn()
    return err.value.code, err.value.message


@pytest.mark.parametrize("datatype", ["FP32", "FP16"])
def test_round_trip_input_and_output_in_shared_memory(client, rng, datatype):
    x = torch.randn(SHAPE, generator=rng).numpy()
    wire = to_wire(x, datatype)
    out_bytes = SHAPE[0] * 16 * 4
    with SharedMemoryBuffer(_name("vox_in"), 64 + len(wire)) as inp, SharedMemoryBuffer(_name("vox_out"), 256) as out:
        inp.write(np.frombuffer(wire, np.uint8), offset=64)
        client.register_system_shared_memory("in", inp.key, len(wire), offset=64)
        client.register_system_shared_memory("out", out.key, out_bytes + 8, offset=8)
        assert client.system_shared_memory_status() == {"in": (inp.key, 64, len(wire)),
                                                         "out": (out.key, 8, out_bytes + 8)}
        y_resp = client.infer_shared_memory(SHAPE, "in", datatype=datatype)
        assert client.infer_shared_memory(SHAPE, "in", datatype=datatype, output_region="out",
                                          output_offset=4) is None
        y_shm = out.read(np.float32, (SHAPE[0], 16), offset=8 + 4)
        xin = torch.from_numpy(x.astype(np.float16).astype(np.float32) if datatype == "FP16" else x)
        ref = reference_float64(xin, W, B)
        assert relative_error(torch.from_numpy(y_resp), ref) <= 1e-5
        assert np.array_equal(y_shm, y_resp)
        client.unregister_system_shared_memory("in")
        assert set(client.system_shared_memory_status()) == {"out"}
        code, message = _code(lambda: client.infer_shared_memory(SHAPE, "in"))
        assert code == grpc.StatusCode.NOT_FOUND and "'in' is not registered" in message


def test_hostile_registrations(client, tmp_path):
    nbytes = 4096
    with SharedMemoryBuffer(_name("vox_h"), nbytes) as buf:
        reg = client.register_system_shared_memory
        cases = [
            (lambda: reg("bad/name", buf.key, 16), grpc.StatusCode.INVALID_ARGUMENT, "region name"),
            (lambda: reg("r", "../../etc/passwd", 16), grpc.StatusCode.INVALID_ARGUMENT, "not a path"),
            (lambda: reg("r", "/dev/shm/x", 16), grpc.StatusCode.INVALID_ARGUMENT, "not a path"),
            (lambda: reg("r", "..", 16), grpc.StatusCode.INVALID_ARGUMENT, "not a path"),
            (lambda: reg("r", _name("absent"), 16), grpc.StatusCode.NOT_FOUND, "no shared-memory segment"),
            (lambda: reg("r", buf.key, 0), grpc.StatusCode.INVALID_ARGUMENT, "must be > 0"),
            (lambda: reg("r", buf.key, nbytes, offset=1), grpc.StatusCode.INVALID_ARGUMENT, "exceeds the segment"),
            (lambda: reg("r", buf.key, 2 * nbytes), grpc.StatusCode.INVALID_ARGUMENT, "exceeds the segment"),
            (lambda: reg("r", buf.key, 2**63), grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-shm-bytes"),
        ]
        for fn, code, fragment in cases:
            got, message = _code(fn)
            assert got == code and fragment in message, (got, message)
        link = _name("vox_link")
        os.symlink("/etc/hostname", f"/dev/shm/{link}")
        try:
            got, message = _code(lambda: reg("r", link, 4))
            assert got == grpc.StatusCode.INVALID_ARGUMENT, message
        finally:
            os.unlink(f"/dev/shm/{link}")
        reg("r", buf.key, nbytes)
        got, _ = _code(lambda: reg("r", buf.key, nbytes))
        assert got == grpc.StatusCode.ALREADY_EXISTS
        got, message = _code(lambda: client.unregister_system_shared_memory("nope"))
        assert got == grpc.StatusCode.NOT_FOUND


def test_hostile_offsets_and_sizes_in_requests(server, client):
    x = np.ones(SHAPE, np.float32)
    with SharedMemoryBuffer(_name("vox_r"), x.nbytes) as buf:
        buf.write(x)
        client.register_system_shared_memory("r", buf.key, x.nbytes)
        stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.url))

        def send(mutate):
            request = build_shm_request(SHAPE, "voxnet", "FP32", "r", output_region="r",
                                        output_byte_size=SHAPE[0] * 16 * 4)
            mutate(request)
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(request, timeout=30)
            return err.value.code(), err.value.details()

        def p(tensor, key):
            return tensor.parameters[key]

        cases = [
            (lambda r: p(r.inputs[0], "shared_memory_offset").MergeFrom(pb.InferParameter(int64_param=8)),
             "outside region"),
            (lambda r: p(r.inputs[0], "shared_memory_offset").MergeFrom(pb.InferParameter(int64_param=-4)),
             "must be >= 0"),
            (lambda r: p(r.inputs[0], "shared_memory_byte_size").MergeFrom(pb.InferParameter(int64_param=12)),
             "needs"),
            (lambda r: p(r.inputs[0], "shared_memory_offset").MergeFrom(pb.InferParameter(int64_param=2**62)),
             "outside region"),
            (lambda r: p(r.outputs[0], "shared_memory_offset").MergeFrom(pb.InferParameter(int64_param=x.nbytes)),
             "outside region"),
            (lambda r: p(r.outputs[0], "shared_memory_byte_size").MergeFrom(pb.InferParameter(int64_param=4)),
             "is less than"),
            # the protocol requires a byte size on every shared-memory tensor, the output's too (Triton refuses
            # a request without; so does this server, so that a client tried here works there)
            (lambda r: r.outputs[0].parameters.pop("shared_memory_byte_size"), "sets no 'shared_memory_byte_size'"),
            (lambda r: r.inputs[0].parameters.pop("shared_memory_byte_size"), "sets no 'shared_memory_byte_size'"),
            (lambda r: p(r.inputs[0], "shared_memory_region").MergeFrom(pb.InferParameter(int64_param=3)),
             "must be a string"),
            (lambda r: r.raw_input_contents.append(b"\0" * x.nbytes), "must carry no other data"),
        ]
        for mutate, fragment in cases:
            code, message = send(mutate)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in message, (code, message)
        # the client shrinks the segment under a registered region: refused, not a crash
        os.truncate(f"/dev/shm{buf.key}", 64)
        code, message = _code(lambda: client.infer_shared_memory(SHAPE, "r"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "now smaller" in message
        os.truncate(f"/dev/shm{buf.key}", x.nbytes)
        assert client.infer_shared_memory(SHAPE, "r").shape == (2, 16)


def test_client_states_the_output_byte_size():
    with pytest.raises(ValueError, match="output_byte_size is required"):
        build_shm_request(SHAPE, "voxnet", "FP32", "in", output_region="out")
    request = build_shm_request(SHAPE, "voxnet", "FP32", "in", output_region="out", output_byte_size=128)
    assert request.outputs[0].parameters["shared_memory_byte_size"].int64_param == 128


def test_region_limits():
    with running_server(max_shm_regions=1, max_shm_bytes=1024) as srv, Client(srv.url) as c, \
            SharedMemoryBuffer(_name("vox_l"), 4096) as buf:
        assert srv.wait_ready()
        code, message = _code(lambda: c.register_system_shared_memory("big", buf.key, 2048))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-shm-bytes" in message
        c.register_system_shared_memory("a", buf.key, 512)
        code, message = _code(lambda: c.register_system_shared_memory("b", buf.key, 256))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-shm-regions" in message


def test_reads_land_in_the_allocators_memory_and_survive_an_unregister_meanwhile():
    from voxserve.server.protocol.shm import SharedMemoryRegistry

    registry = SharedMemoryRegistry()
    data = np.arange(1024, dtype=np.uint8)
    with SharedMemoryBuffer(_name("vox_r"), data.nbytes) as buf:
        buf.write(data)
        registry.register("r", buf.key, 0, data.nbytes)
        given = []

        def allocate(n):  # as the GPU server's pinned allocator: read() fills what it hands out
            view = memoryview(bytearray(n))
            given.append(view)
            registry.unregister("r")  # the region's own descriptor closes while the copy is to start
            return view

        registry.allocate = allocate
        out = registry.read("r", 16, 512, "input 'x'")
        assert out is given[0] and bytes(out) == data[16:528].tobytes()
        with pytest.raises(Exception, match="not registered"):
            registry.read("r", 0, 1, "input 'x'")
    registry.close()


def test_a_recreated_or_removed_segment_is_refused_until_registered_again(client):
    """The server keeps the registered file open; a segment recreated under the same name (or removed) must not
    be served silently from the old file, nor written to: refused until the region is registered again."""
    x1 = np.ones(SHAPE, np.float32)
    x2 = np.full(SHAPE, -2.0, np.float32)
    out_bytes = SHAPE[0] * 16 * 4
    ref1, ref2 = (reference_float64(torch.from_numpy(x), W, B) for x in (x1, x2))
    with _segment(x1.tobytes()) as (key, path), _segment(bytes(out_bytes)) as (out_key, out_path):
        client.register_system_shared_memory("in", key, x1.nbytes)
        client.register_system_shared_memory("out", out_key, out_bytes)
        assert relative_error(torch.from_numpy(client.infer_shared_memory(SHAPE, "in")), ref1) <= 1e-5

        replace_segment(path, x2.tobytes())
        code, message = _code(lambda: client.infer_shared_memory(SHAPE, "in"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message)
        assert f"segment '{key}' was recreated after region 'in' was registered" in message, message
        assert "register the region again" in message
        assert client.system_shared_memory_status("in") == {"in": (key, 0, x1.nbytes)}  # still registered
        client.unregister_system_shared_memory("in")
        client.register_system_shared_memory("in", key, x2.nbytes)
        assert relative_error(torch.from_numpy(client.infer_shared_memory(SHAPE, "in")), ref2) <= 1e-5

        # Writes are checked the same way: the output does not go to the file the client no longer has.
        replace_segment(out_path, bytes(out_bytes))
        code, message = _code(lambda: client.infer_shared_memory(SHAPE, "in", output_region="out"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "was recreated" in message, (code, message)
        os.unlink(out_path)
        code, message = _code(lambda: client.infer_shared_memory(SHAPE, "in", output_region="out"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message)
        assert f"segment '{out_key}' was removed after region 'out' was registered" in message, message


def test_names_and_keys_with_a_trailing_newline_are_refused(client):
    with SharedMemoryBuffer(_name("vox_nl"), 64) as buf:
        code, message = _code(lambda: client.register_system_shared_memory("r\n", buf.key, 16))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "region name 'r\\n'" in message, (code, message)
        code, message = _code(lambda: client.register_system_shared_memory("r", buf.key + "\n", 16))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a path" in message, (code, message)
        assert client.system_shared_memory_status() == {}


def test_long_names_and_keys_are_cut_in_error_messages(client):
    """A 16,000-character value quoted whole would overflow the status trailer (the client would see the
    transport's RESOURCE_EXHAUSTED instead of the server's answer)."""
    long = "a" * 16000
    with SharedMemoryBuffer(_name("vox_long"), 64) as buf:
        cases = [
            (lambda: client.register_system_shared_memory(long, buf.key, 16), grpc.StatusCode.INVALID_ARGUMENT,
             "region name"),
            (lambda: client.register_system_shared_memory("r", long, 16), grpc.StatusCode.INVALID_ARGUMENT,
             "not a path"),
            (lambda: client.unregister_system_shared_memory(long), grpc.StatusCode.NOT_FOUND, "is not registered"),
            (lambda: client.system_shared_memory_status(long), grpc.StatusCode.NOT_FOUND, "is not registered"),
            (lambda: client.infer_shared_memory(SHAPE, long), grpc.StatusCode.NOT_FOUND, "is not registered"),
        ]
        for fn, want, fragment in cases:
            code, message = _code(fn)
            assert code == want and fragment in message, (code, message[:300])
            assert len(message) < 300 and "a" * 64 + "... (16000 characters)" in message, message[:300]


def test_the_asyncio_client_has_the_same_system_shared_memory_calls(server, rng):
    x = torch.randn(SHAPE, generator=rng).numpy()
    out_bytes = SHAPE[0] * 16 * 4

    async def main() -> tuple[np.ndarray, np.ndarray]:
        async with AsyncClient(server.url) as c:
            with SharedMemoryBuffer(_name("vox_async"), x.nbytes + out_bytes) as segment:
                segment.write(x)
                await c.register_system_shared_memory("async_io", segment.key, segment.size)
                assert await c.system_shared_memory_status("async_io") == {
                    "async_io": (segment.key, 0, segment.size)}
                answered = await c.infer_shared_memory(SHAPE, "async_io")
                assert await c.infer_shared_memory(SHAPE, "async_io", output_region="async_io",
                                                   output_offset=x.nbytes) is None
                written = segment.read(np.float32, (SHAPE[0], 16), offset=x.nbytes)
                await c.unregister_system_shared_memory("async_io")
                assert await c.system_shared_memory_status() == {}
                return answered, written

    answered, written = asyncio.run(main())
    np.testing.assert_array_equal(answered, written)
    assert relative_error(torch.from_numpy(written.copy()), reference_float64(torch.from_numpy(x), W, B)) <= 1e-5
