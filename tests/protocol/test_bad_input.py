"""Every malformed request gets a specific status and a sentence naming the field, value and limit."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from voxserve.client import Client, build_request
from voxserve.proto import pb, pb_grpc

from ..conftest import running_server

OK_SHAPE = (1, 3, 4, 4, 4)
IA = grpc.StatusCode.INVALID_ARGUMENT


def _good() -> pb.ModelInferRequest:
    return build_request(np.ones(OK_SHAPE, np.float32), "voxnet", "FP32")


def _with(shape=OK_SHAPE, datatype="FP32", nbytes=None, **fields) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=fields.pop("model_name", "voxnet"), **fields)
    r.inputs.add(name="input", datatype=datatype, shape=list(shape))
    n = int(np.prod(shape, dtype=object)) * 4 if nbytes is None else nbytes
    r.raw_input_contents.append(b"\0" * n)
    return r


def _typed(values, datatype="FP32", field="fp32_contents", shape=OK_SHAPE) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="voxnet")
    t = r.inputs.add(name="input", datatype=datatype, shape=list(shape))
    getattr(t.contents, field).extend(values)
    return r


def _mutate(fn) -> pb.ModelInferRequest:
    r = _good()
    fn(r)
    return r


N_OK = int(np.prod(OK_SHAPE))
CASES = {
    "unknown model": (_with(model_name="nope"), grpc.StatusCode.NOT_FOUND, "model 'nope' is not served here"),
    "unknown version": (_mutate(lambda r: setattr(r, "model_version", "7")), grpc.StatusCode.NOT_FOUND,
                        "no version '7'"),
    "unknown input": (_mutate(lambda r: setattr(r.inputs[0], "name", "x")), IA, "unknown input 'x'"),
    "no inputs": (pb.ModelInferRequest(model_name="voxnet"), IA, "has 0 inputs"),
    "duplicate input": (_mutate(lambda r: (r.inputs.append(r.inputs[0]), r.raw_input_contents.append(b"")))
                        , IA, "has 2 inputs ['input', 'input']"),
    "unknown output": (_mutate(lambda r: setattr(r.outputs[0], "name", "probs")), IA, "unknown output 'probs'"),
    "duplicate output": (_mutate(lambda r: r.outputs.add(name="output")), IA, "requested 2 times"),
    "rank 4": (_with(shape=(1, 3, 4, 4)), IA, "rank 4"),
    "rank 6": (_with(shape=(1, 3, 4, 4, 4, 1)), IA, "rank 6"),
    "wrong Cin": (_with(shape=(1, 4, 4, 4, 4)), IA, "4 channels (dimension 1); the model expects Cin=3"),
    "spatial < k": (_with(shape=(1, 3, 4, 2, 4)), IA, "H=2 is smaller than the kernel size k=3"),
    "zero dim": (_with(shape=(0, 3, 4, 4, 4), nbytes=0), IA, "dimension 0 (N) is 0"),
    "negative dim": (_with(shape=(1, 3, -4, 4, 4), nbytes=4), IA, "dimension 2 (D) is -4"),
    "overflowing shape": (_with(shape=(1, 3, 2**40, 2**40, 2**40), nbytes=64), grpc.StatusCode.RESOURCE_EXHAUSTED,
                          "holds 1329227995784915872903807060280344576 voxels"),
    "int64 extremes": (_with(shape=(2**63 - 1, 3, 2**63 - 1, 3, 3), nbytes=64), grpc.StatusCode.RESOURCE_EXHAUSTED,
                       "at most 1024 are accepted"),
    "too many voxels": (_with(shape=(1, 3, 512, 512, 512), nbytes=64), grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "134217728 voxels (N x D x H x W); at most 33554432"),
    "too many samples": (_with(shape=(5000, 3, 3, 3, 3), nbytes=16), grpc.StatusCode.RESOURCE_EXHAUSTED,
                         "at most 1024"),
    "bytes short": (_with(nbytes=N_OK * 4 - 4), IA, f"needs {N_OK * 4} bytes; raw_input_contents[0] holds"),
    "bytes long": (_with(nbytes=N_OK * 4 + 1), IA, f"holds {N_OK * 4 + 1}"),
    "fp16 byte count": (_with(datatype="FP16", nbytes=N_OK * 4), IA, f"of FP16 needs {N_OK * 2} bytes"),
    "unsupported datatype": (_with(datatype="INT8"), IA, "datatype 'INT8'; supported: FP32, FP16, BF16"),
    "bogus datatype": (_with(datatype="FLOAT"), IA, "datatype 'FLOAT'"),
    "two raw entries": (_mutate(lambda r: r.raw_input_contents.append(b"")), IA, "raw_input_contents has 2 entries"),
    "no data": (_mutate(lambda r: r.ClearField("raw_input_contents")), IA, "carries no data"),
    "raw and typed": (_mutate(lambda r: r.inputs[0].contents.fp32_contents.append(1.0)), IA, "sets both"),
    "typed wrong length": (_typed([1.0] * (N_OK - 1)), IA, f"needs {N_OK} values; contents.fp32_contents holds"),
    "typed wrong field": (_typed([1] * N_OK, field="int_contents"), IA, "sets contents.int_contents"),
    "typed fp16": (_typed([1] * N_OK, datatype="FP16", field="uint_contents"), IA, "FP16 travels only in raw"),
    "shared memory and raw": (_mutate(lambda r: r.inputs[0].parameters["shared_memory_region"].MergeFrom(
        pb.InferParameter(string_param="r0"))), IA, "must carry no other data"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_gets_specific_status(server, case):
    request, code, fragment = CASES[case]
    with grpc.insecure_channel(server.url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, timeout=30)
        assert err.value.code() == code, err.value.details()
        assert fragment in err.value.details()
        # and the server keeps serving everyone else
        assert len(stub.ModelInfer(_good(), timeout=30).raw_output_contents[0]) == 16 * 4


def test_garbage_bytes_are_invalid_argument(server):
    with grpc.insecure_channel(server.url) as ch:
        raw = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for junk in (b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", bytes(range(256)) * 3):
            with pytest.raises(grpc.RpcError) as err:
                raw(junk, timeout=30)
            assert err.value.code() == IA, err.value.details()
            assert "ModelInferRequest" in err.value.details()
        # The other methods are answered the same way (ModelInfer checks for itself, the rest through a wrapper).
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary("/inference.GRPCInferenceService/ModelMetadata")(b"\xff\xff\xff\xff", timeout=30)
        assert err.value.code() == IA and "ModelMetadataRequest" in err.value.details()
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        assert stub.ModelInfer(_good(), timeout=30).outputs[0].name == "output"


def test_message_over_limit_is_resource_exhausted(rng):
    with running_server(max_message_bytes=64 * 1024) as srv:
        assert srv.wait_ready()
        x = np.zeros((1, 3, 32, 32, 32), np.float32)  # 393 kB
        with Client(srv.url) as c, pytest.raises(Exception) as err:
            c.infer(x)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "65536" in err.value.message


def test_other_metadata_rpcs_name_the_model(server):
    with grpc.insecure_channel(server.url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        for call, req in ((stub.ModelMetadata, pb.ModelMetadataRequest(name="x")),
                          (stub.ModelConfig, pb.ModelConfigRequest(name="x")),
                          (stub.ModelReady, pb.ModelReadyRequest(name="x")),
                          (stub.ModelStatistics, pb.ModelStatisticsRequest(name="x"))):
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'x'" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(name="nope"), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in err.value.details()
