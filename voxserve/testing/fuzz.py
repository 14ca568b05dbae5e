"""Fuzzing ModelInfer: structure-aware and byte-level mutations of valid requests, and the property they must keep.

The property: whatever bytes arrive, the server answers with a status from ``ALLOWED_CODES`` (success, or a
specific refusal naming the problem), promptly, and keeps serving. Never UNKNOWN/INTERNAL (an unhandled
exception), never a hang (DEADLINE_EXCEEDED), never a crash.

``Mutator`` works like libprotobuf-mutator: it parses a seed into the message, changes fields to values
chosen to hit edge cases (extreme dimensions, wrong datatypes, hostile shared-memory parameters, duplicated
or missing tensors), and on some inputs also damages the serialised bytes (bit flips, truncation,
insertions, splices), so both the protobuf layer and the validation behind it are exercised.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from voxserve.client.bench import INFER_METHOD
from voxserve.proto import pb

ALLOWED_CODES = frozenset({
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
})

_DIMS = (-(2**63), -(2**31), -1, 0, 1, 2, 3, 4, 5, 7, 16, 1023, 1024, 1025, 2**31 - 1, 2**31, 2**32 + 3, 2**62,
         2**63 - 1)
_DATATYPES = ("FP32", "FP16", "BF16", "FP64", "INT8", "UINT8", "BOOL", "BYTES", "fp32", "", "F" * 300,
              "FP32\x00", "\u00e9")
_NAMES = ("input", "output", "", "Input", "input ", "x" * 1000, "../input", "\x00")
_REGIONS = ("", "r", "in", "../../etc/passwd", "/dev/shm/x", "a/b", "\x00", "é", "r" * 4096)
_PARAMS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size", "binary_data_size",
           "priority", "timeout", "")
_INTS = (-(2**63), -1, 0, 1, 7, 64, 4096, 2**31 - 1, 2**32, 2**63 - 1)


def seed_requests(cin: int = 3, k: int = 3, model: str = "voxnet") -> list[pb.ModelInferRequest]:
    """Valid requests of every kind the server accepts (small shapes), the starting points for mutation."""
    rng = np.random.default_rng(0)
    seeds = []
    for datatype, dtype in (("FP32", np.float32), ("FP16", np.float16), ("BF16", np.uint16)):
        x = rng.standard_normal((2, cin, k, k + 1, k + 2)).astype(dtype)
        r = pb.ModelInferRequest(model_name=model, id="seed")
        r.inputs.add(name="input", datatype=datatype, shape=list(x.shape))
        r.outputs.add(name="output")
        r.raw_input_contents.append(x.tobytes())
        seeds.append(r)
    typed = pb.ModelInferRequest(model_name=model, model_version="1")
    t = typed.inputs.add(name="input", datatype="FP32", shape=[1, cin, k, k, k])
    t.contents.fp32_contents.extend(rng.standard_normal(cin * k**3).astype(np.float32).tolist())
    seeds.append(typed)
    shm = pb.ModelInferRequest(model_name=model)
    t = shm.inputs.add(name="input", datatype="FP32", shape=[1, cin, k, k, k])
    t.parameters["shared_memory_region"].string_param = "region"
    t.parameters["shared_memory_offset"].int64_param = 0
    t.parameters["shared_memory_byte_size"].int64_param = 4 * cin * k**3
    o = shm.outputs.add(name="output")
    o.parameters["shared_memory_region"].string_param = "out"
    seeds.append(shm)
    return seeds


@dataclass
class Mutator:
    seeds: list[pb.ModelInferRequest]
    seed: int = 0
    byte_level: float = 0.3  # share of inputs whose serialised bytes are also damaged
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._corpus = [s.SerializeToString() for s in self.seeds]

    def __iter__(self) -> Iterator[bytes]:
        while True:
            yield self.next()

    def next(self) -> bytes:
        r = self.rng
        msg = pb.ModelInferRequest.FromString(r.choice(self._corpus))
        for _ in range(r.randint(1, 3)):
            r.choice(self._FIELD_MUTATIONS)(self, msg)
        data = msg.SerializeToString()
        if r.random() < self.byte_level:
            for _ in range(r.randint(1, 4)):
                data = r.choice(self._BYTE_MUTATIONS)(self, data)
        return data

    # --- structure-aware mutations --------------------------------------------------

    def _tensor(self, msg: pb.ModelInferRequest):
        return msg.inputs[self.rng.randrange(len(msg.inputs))] if msg.inputs else msg.inputs.add(name="input")

    def _shape(self, msg):
        t, r = self._tensor(msg), self.rng
        shape = list(t.shape)
        op = r.randrange(4)
        if op == 0 and shape:
            shape[r.randrange(len(shape))] = r.choice(_DIMS)
        elif op == 1:
            shape.insert(r.randrange(len(shape) + 1), r.choice(_DIMS))
        elif op == 2 and shape:
            del shape[r.randrange(len(shape))]
        else:
            shape = [r.choice(_DIMS) for _ in range(r.randint(0, 8))]
        del t.shape[:]
        t.shape.extend(shape)

    def _datatype(self, msg):
        self._tensor(msg).datatype = self.rng.choice(_DATATYPES)

    def _raw(self, msg):
        r = self.rng
        if not msg.raw_input_contents:
            msg.raw_input_contents.append(r.randbytes(r.choice((0, 1, 3, 4, 64, 4096))))
            return
        i = r.randrange(len(msg.raw_input_contents))
        raw = msg.raw_input_contents[i]
        op = r.randrange(5)
        if op == 0:
            raw = raw[: r.randrange(len(raw) + 1)]
        elif op == 1:
            raw = raw + r.randbytes(r.choice((1, 2, 4, 100)))
        elif op == 2:
            msg.raw_input_contents.append(raw)
        elif op == 3:
            raw = b""
        else:  # NaN, inf and denormal payloads of the right length
            values = np.frombuffer(raw[: len(raw) // 4 * 4], np.float32).copy()
            if values.size:
                values[r.randrange(values.size)] = r.choice((np.nan, np.inf, -np.inf, 1e-45, 3.4e38))
            raw = values.tobytes()
        if op != 2:
            msg.raw_input_contents[i] = raw

    def _tensors(self, msg):
        r = self.rng
        op = r.randrange(5)
        if op == 0 and msg.inputs:
            msg.inputs.append(msg.inputs[0])
        elif op == 1:
            del msg.inputs[:]
        elif op == 2:
            self._tensor(msg).name = r.choice(_NAMES)
        elif op == 3:
            msg.outputs.add(name=r.choice(_NAMES))
        else:
            del msg.outputs[:]

    def _parameters(self, msg):
        r = self.rng
        target = self._tensor(msg) if r.random() < 0.6 else (
            msg.outputs[0] if msg.outputs else msg.outputs.add(name="output"))
        key = r.choice(_PARAMS)
        p = target.parameters[key]
        kind = r.randrange(4)
        if kind == 0:
            p.string_param = r.choice(_REGIONS)
        elif kind == 1:
            p.int64_param = r.choice(_INTS)
        elif kind == 2:
            p.uint64_param = r.choice([v for v in _INTS if v >= 0] + [2**64 - 1])
        else:
            p.bool_param = r.random() < 0.5

    def _typed(self, msg):
        r = self.rng
        t = self._tensor(msg)
        name = r.choice(("fp32_contents", "int_contents", "int64_contents", "uint_contents", "bool_contents",
                         "fp64_contents", "bytes_contents", "uint64_contents"))
        values = getattr(t.contents, name)
        n = r.choice((0, 1, 5, 81, 1000))
        if name == "bytes_contents":
            values.extend(r.randbytes(3) for _ in range(n))
        elif name == "bool_contents":
            values.extend(r.random() < 0.5 for _ in range(n))
        elif name in ("fp32_contents", "fp64_contents"):
            values.extend(r.choice((0.0, 1.5, float("nan"), float("inf"), -1e30)) for _ in range(n))
        else:
            values.extend(r.randrange(0, 100) for _ in range(n))

    def _model(self, msg):
        r = self.rng
        if r.random() < 0.5:
            msg.model_name = r.choice(("voxnet", "", "other", "voxnet\x00", "v" * 5000))
        else:
            msg.model_version = r.choice(("", "1", "2", "-1", "\xff"))
        if r.random() < 0.2:
            msg.id = r.choice(("", "x" * 10000, "\x00id"))

    _FIELD_MUTATIONS = (_shape, _shape, _datatype, _raw, _raw, _tensors, _parameters, _parameters, _typed, _model)

    # --- byte-level mutations -------------------------------------------------------

    def _flip(self, data: bytes) -> bytes:
        if not data:
            return data
        b = bytearray(data)
        i = self.rng.randrange(len(b))
        b[i] ^= 1 << self.rng.randrange(8)
        return bytes(b)

    def _truncate(self, data: bytes) -> bytes:
        return data[: self.rng.randrange(len(data) + 1)]

    def _insert(self, data: bytes) -> bytes:
        i = self.rng.randrange(len(data) + 1)
        junk = self.rng.choice((b"\xff" * 10, b"\x80" * 11, b"\x0a\xff\xff\xff\xff\x0f", self.rng.randbytes(8)))
        return data[:i] + junk + data[i:]

    def _delete(self, data: bytes) -> bytes:
        if not data:
            return data
        i = self.rng.randrange(len(data))
        return data[:i] + data[i + self.rng.randint(1, 16):]

    def _splice(self, data: bytes) -> bytes:
        other = self.rng.choice(self._corpus)
        return data[: self.rng.randrange(len(data) + 1)] + other[self.rng.randrange(len(other) + 1):]

    _BYTE_MUTATIONS = (_flip, _flip, _truncate, _insert, _delete, _splice)


# --- drivers ----------------------------------------------------------------------


@dataclass
class FuzzReport:
    inputs: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    failures: list[tuple[str, str, bytes]] = field(default_factory=list)  # (code, details, the input)
    slowest_s: float = 0.0

    def record(self, code: grpc.StatusCode, details: str, data: bytes, seconds: float) -> None:
        self.inputs += 1
        self.codes[code.name] = self.codes.get(code.name, 0) + 1
        self.slowest_s = max(self.slowest_s, seconds)
        if code not in ALLOWED_CODES and len(self.failures) < 20:
            self.failures.append((code.name, details, data))


def decode_status(data: bytes, spec, shm=None) -> grpc.StatusCode:
    """The in-process half of the property: parse and validate ``data`` as the server does.

    Returns OK or the refusal's code; any other exception propagates (that is a bug)."""
    from voxserve.server.core.errors import ServingError
    from voxserve.server.protocol import codec
    from voxserve.server.protocol.service import MalformedRequest, _tolerant_parser
    from voxserve.server.protocol.status import grpc_code

    request = _tolerant_parser(pb.ModelInferRequest)(data)
    try:
        if isinstance(request, MalformedRequest):
            raise request.error()
        codec.decode_request(request.message, spec, shm, request.raw)
    except ServingError as exc:
        assert exc.message, "a refusal must say why"
        return grpc_code(exc.code)
    return grpc.StatusCode.OK


def fuzz_server(url: str, inputs: int, *, seed: int = 0, workers: int = 4, timeout_s: float = 30.0,
                progress=None, credentials=None) -> FuzzReport:
    """Send ``inputs`` mutated ModelInfer bodies to a running server from ``workers`` threads.

    A call that outlives ``timeout_s`` comes back DEADLINE_EXCEEDED: a hang, and a failure."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from voxserve.client.client import DEFAULT_MAX_MESSAGE_BYTES, _channel_options
    from voxserve.client.security import PLAINTEXT

    credentials = credentials or PLAINTEXT
    report = FuzzReport()
    lock = threading.Lock()
    mutators = [Mutator(seed_requests(), seed=seed * 1000 + w) for w in range(workers)]
    quota = [inputs // workers + (1 if w < inputs % workers else 0) for w in range(workers)]

    def work(w: int) -> None:
        with credentials.channel(url, _channel_options(DEFAULT_MAX_MESSAGE_BYTES)) as channel:
            call = channel.unary_unary(INFER_METHOD)
            for _ in range(quota[w]):
                data = mutators[w].next()
                t0 = time.perf_counter()
                try:
                    call(data, timeout=timeout_s, metadata=credentials.metadata())
                    code, details = grpc.StatusCode.OK, ""
                except grpc.RpcError as exc:
                    code, details = exc.code(), exc.details() or ""
                with lock:
                    report.record(code, details, data, time.perf_counter() - t0)
                    if progress is not None and report.inputs % 1000 == 0:
                        progress(report)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(work, range(workers)))
    return report
