"""Property-based and fuzz tests of request decoding: any input gets OK or a specific refusal, nothing else.

Short runs here; `python bench/fuzz_infer.py` runs the long (>= 1e5 inputs) version and writes the figures.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from voxserve.client import Client
from voxserve.kernels import reference_float64, reference_weights
from voxserve.proto import pb
from voxserve.server.core.errors import ServingError, Status
from voxserve.server.protocol import codec
from voxserve.server.protocol.shm import SharedMemoryRegistry
from voxserve.server.protocol.status import grpc_code
from voxserve.testing.fuzz import ALLOWED_CODES, Mutator, decode_status, fuzz_server, seed_requests

from ..conftest import REPO

SPEC = codec.ModelSpec("voxnet", "1", cin=3, cout=16, k=3, max_request_samples=64, max_request_voxels=1 << 16)
SHM = SharedMemoryRegistry(4, 1 << 20)

dims = st.one_of(st.integers(-3, 12), st.sampled_from([2**31, 2**32 + 1, 2**62, 2**63 - 1, -(2**63)]))
datatypes = st.sampled_from(["FP32", "FP16", "BF16", "INT8", "FP64", "BYTES", "", "fp32"])


@st.composite
def requests(draw) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name=draw(st.sampled_from(["voxnet", "voxnet", "other", ""])),
                             model_version=draw(st.sampled_from(["", "1", "2"])))
    for _ in range(draw(st.integers(0, 2))):
        t = r.inputs.add(name=draw(st.sampled_from(["input", "input", "x"])), datatype=draw(datatypes),
                         shape=draw(st.lists(dims, min_size=0, max_size=7)))
        if draw(st.booleans()):
            t.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=300)))
        if draw(st.integers(0, 4)) == 0:
            t.parameters["shared_memory_region"].string_param = draw(st.sampled_from(["r", "", "../x", "a/b"]))
            t.parameters["shared_memory_byte_size"].int64_param = draw(st.integers(-(2**63), 2**63 - 1))
            t.parameters["shared_memory_offset"].int64_param = draw(st.integers(-(2**63), 2**63 - 1))
    if draw(st.booleans()):
        # Often exactly the size the declared shape needs, so decoding gets past the byte-count check.
        shape = list(r.inputs[0].shape) if r.inputs else []
        n = int(np.prod(shape, dtype=object)) if shape and all(0 < d < 64 for d in shape) else 0
        size = draw(st.sampled_from([n * 4, n * 2, max(0, n * 4 - 1), 0, 7]))
        r.raw_input_contents.append(bytes(size))
    for _ in range(draw(st.integers(0, 2))):
        r.outputs.add(name=draw(st.sampled_from(["output", "output", "probs"])))
    return r


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_any_structured_request_is_decoded_or_refused_specifically(request):
    try:
        decoded = codec.decode_request(request, SPEC, SHM)
    except ServingError as exc:
        assert grpc_code(exc.code) in ALLOWED_CODES and exc.code != Status.OK
        assert exc.message
        return
    # Accepted: the view matches what the request declared, within the limits.
    t = request.inputs[0]
    assert decoded.array.shape == tuple(t.shape) and decoded.datatype == t.datatype
    assert decoded.samples <= SPEC.max_request_samples


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=2048))
def test_any_bytes_are_decoded_or_refused_specifically(data):
    assert decode_status(data, SPEC, SHM) in ALLOWED_CODES


def test_mutated_requests_in_process():
    mutator = Mutator(seed_requests(), seed=np.random.SeedSequence().entropy % 2**32)
    print("mutator seed", mutator.seed)
    codes = {}
    for _ in range(20_000):
        code = decode_status(mutator.next(), SPEC, SHM)
        assert code in ALLOWED_CODES
        codes[code] = codes.get(code, 0) + 1
    # The mutations reach past the parser: some inputs are accepted, and several kinds of refusal occur.
    assert codes.get(grpc.StatusCode.OK, 0) > 0
    assert len(codes) >= 3, codes


def test_mutated_requests_over_grpc_leave_the_server_correct(server):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    report = fuzz_server(server.url, 1500, seed=seed, workers=2, timeout_s=30)
    assert report.inputs == 1500
    assert not report.failures, (seed, [(c, d) for c, d, _ in report.failures])
    assert report.codes.get("OK", 0) > 0 and report.codes.get("INVALID_ARGUMENT", 0) > 0, report.codes
    # Still serving, still right.
    x = np.random.default_rng().standard_normal((2, 3, 6, 7, 8), dtype=np.float32)
    w, b = reference_weights()
    import torch

    with Client(server.url, timeout_s=30) as c:
        y = c.infer(x)
    ref = reference_float64(torch.from_numpy(x), w, b).numpy()
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) <= 1e-5


def test_coverage_guided_fuzzing_short_run():
    pytest.importorskip("atheris")
    proc = subprocess.run([sys.executable, "bench/fuzz_infer.py", "--engine", "atheris", "--inputs", "3000",
                           "--no-report"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "atheris: 3000 inputs" in proc.stdout, proc.stdout[-2000:]


def _agrees_with_protobuf(data: bytes) -> None:
    """The zero-copy parser accepts exactly what protobuf accepts, with the same content: its walk of the fields
    (forced, whatever the message's length) and the parse the server makes of a message of that length."""
    from google.protobuf.message import DecodeError

    from voxserve.server.protocol.wire import parse_infer_request

    try:
        expected = pb.ModelInferRequest.FromString(data)
    except DecodeError:
        expected = None
    for whole_below in (0, len(data) + 1):
        try:
            parsed = parse_infer_request(data, whole_below)
        except DecodeError:
            parsed = None
        assert (parsed is None) == (expected is None)
        if parsed is not None:
            assert [bytes(v) for v in parsed.raw] == list(expected.raw_input_contents)
            rest = pb.ModelInferRequest()
            rest.CopyFrom(expected)
            rest.ClearField("raw_input_contents")
            assert parsed.message == rest


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=512))
def test_zero_copy_parser_agrees_with_protobuf_on_any_bytes(data):
    _agrees_with_protobuf(data)


def test_zero_copy_parser_agrees_with_protobuf_on_mutated_requests():
    mutator = Mutator(seed_requests(), seed=int(np.random.SeedSequence().entropy % 2**32), byte_level=0.7)
    for _ in range(20_000):
        _agrees_with_protobuf(mutator.next())


def test_zero_copy_parser_views_the_received_bytes():
    from voxserve.client import build_request
    from voxserve.server.protocol.wire import WHOLE_PARSE_BYTES, parse_infer_request

    x = np.random.default_rng().standard_normal((16, 3, 5, 6, 7), dtype=np.float32)
    data = build_request(x, "voxnet", "FP32", request_id="r1").SerializeToString()
    assert len(data) >= WHOLE_PARSE_BYTES
    parsed = parse_infer_request(data)
    assert parsed.message.id == "r1" and list(parsed.message.inputs[0].shape) == [16, 3, 5, 6, 7]
    assert parsed.raw[0].obj is data  # a view of gRPC's buffer, not a copy
    assert np.array_equal(np.frombuffer(parsed.raw[0], np.float32).reshape(x.shape), x)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=300)
       | st.integers(0, 70_000).map(lambda n: np.random.default_rng(n).standard_normal(n, dtype=np.float32).tolist()))
def test_typed_contents_read_from_their_wire_form_are_the_fields_values(values):
    """contents.fp32_contents read from its packed wire form (wire.packed_floats) holds the very bits of the
    repeated field, however many values (lengths whose varint takes one to three bytes), -0.0, infinities, NaNs;
    parsed from a client's bytes as from a message built here."""
    from voxserve.server.protocol.wire import packed_floats

    contents = pb.InferTensorContents(fp32_contents=values)
    for message in (contents, pb.InferTensorContents.FromString(contents.SerializeToString())):
        got = packed_floats(message)
        assert got.dtype == np.float32 and got.shape == (len(values),)
        assert got.tobytes() == np.asarray(message.fp32_contents, dtype=np.float32).tobytes()


def test_mutated_requests_on_one_stream_get_in_band_answers(server):
    """ModelStreamInfer: each mutated message gets its own answer on the stream (a response or an error
    message naming an allowed status), and the stream itself ends OK."""
    mutator = Mutator(seed_requests(), seed=int(np.random.SeedSequence().entropy % 2**32))
    bodies = [mutator.next() for _ in range(400)]
    with grpc.insecure_channel(server.url) as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        answers = [pb.ModelStreamInferResponse.FromString(raw) for raw in stream(iter(bodies), timeout=120)]
    assert len(answers) == len(bodies)
    allowed = {code.name for code in ALLOWED_CODES}
    for a in answers:
        if a.error_message:
            assert a.error_message.split(":", 1)[0] in allowed, a.error_message
        else:
            assert a.infer_response.outputs[0].name == "output"
    assert any(a.error_message for a in answers) and any(not a.error_message for a in answers)
