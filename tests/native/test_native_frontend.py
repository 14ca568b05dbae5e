"""voxserve-frontend, the native front end (server/native/): the binary itself, against a real engine (that of a
`voxserve serve --frontends 1 --device cpu`, whose Python front end answers the same requests for comparison) and
against scripted engines (tests/native/harness.py), with a partner of the test's own standing in for the Python
front end on its Unix socket. Skipped, with the build's reason, where the binary cannot be built."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from voxserve.client import build_request, parse_response
from voxserve.kernels import reference_float64, reference_weights
from voxserve.proto import pb
from voxserve.server.core.model import relative_error
from voxserve.server.native import build
from voxserve.server.topology import ipc
from voxserve.testing.load import ServerProcess

from ..certs import CertificateAuthority
from .harness import HOLD, INFER, REPORT, SERVER_LIVE, STREAM_INFER, WATCH, FakeEngine, Native, Partner, wait_for

OK, CANCELLED, INVALID_ARGUMENT, DEADLINE_EXCEEDED = 0, 1, 3, 4
RESOURCE_EXHAUSTED, UNAVAILABLE, UNAUTHENTICATED = 8, 14, 16
DENIED = "missing or invalid credentials: send 'authorization: Bearer <token>' metadata"


@pytest.fixture(scope="module")
def binary() -> Path:
    problem = build.problem()
    if problem is not None:
        pytest.skip(f"voxserve-frontend cannot be built here: {problem}")
    return build.build()


@pytest.fixture
def toolchain() -> None:
    """The build tools and libraries themselves (a machine given a prebuilt binary may lack them)."""
    try:
        build._toolchain()
    except build.NativeBuildError as exc:
        pytest.skip(f"no toolchain to build voxserve-frontend here: {exc}")


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for Unix sockets (their paths are limited to 107 bytes; pytest's tmp_path can be longer)."""
    path = Path(tempfile.mkdtemp(prefix="vxn-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def partner(sock_dir: Path) -> Iterator[Partner]:
    p = Partner(sock_dir / "partner.sock")
    yield p
    p.stop()


@pytest.fixture
def engine(sock_dir: Path) -> Iterator[FakeEngine]:
    e = FakeEngine(sock_dir / "engine.sock")
    yield e
    e.close()


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[ServerProcess, str]]:
    """A ready `voxserve serve --frontends 1 --device cpu` and its engine's socket (from the engine process's
    environment, as bench/probes/native_frontend/compare.py finds it)."""
    with ServerProcess(["--frontends", "1", "--device", "cpu"]) as server:
        (_pid, engine_socket), = engines(server)
        yield server, engine_socket


def engines(server: ServerProcess) -> list[tuple[int, str]]:
    """(pid, socket) of each engine process of ``server``."""
    found = []
    for pid in server.pids():
        with contextlib.suppress(OSError):
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            if env.get("VOXSERVE_ROLE") == "engine":
                found.append((pid, env["VOXSERVE_ENGINE_SOCKET"]))
    return found


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) for the block, then continued, whatever happens in it."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def native(binary: Path, engines, partner: Partner | Path, *flags: str, name: str = "native") -> Iterator[Native]:
    path = partner.path if isinstance(partner, Partner) else partner
    fe = Native(binary, list(engines), path, path.parent / f"{name}.log", *flags)
    try:
        yield fe
    finally:
        fe.kill()
        print(fe.log())


def infer(url: str, payload: bytes, timeout: float | None = 30, metadata=None, credentials=None):
    """(code number, details, response bytes or None, initial metadata, trailing metadata) of one ModelInfer."""
    return unary(url, INFER, payload, timeout, metadata, credentials)


def unary(url: str, method: str, payload: bytes, timeout: float | None = 30, metadata=None, credentials=None):
    options = [("grpc.max_send_message_length", 1 << 27), ("grpc.max_receive_message_length", 1 << 27)]
    channel = (grpc.secure_channel(url, credentials, options=options) if credentials is not None
               else grpc.insecure_channel(url, options=options))
    with channel:
        try:
            response, call = channel.unary_unary(method).with_call(payload, timeout=timeout, metadata=metadata)
            return 0, call.details(), response, dict(call.initial_metadata()), dict(call.trailing_metadata())
        except grpc.RpcError as exc:
            return (exc.code().value[0], exc.details(), None, dict(exc.initial_metadata() or ()),
                    dict(exc.trailing_metadata() or ()))


def request(shape=(1, 3, 3, 3, 3), datatype: str = "FP32", request_id: str = "r", seed: int = 0,
            scale: float = 1.0) -> pb.ModelInferRequest:
    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * scale
    return build_request(x, "voxnet", datatype, request_id=request_id)


def typed_request(x: np.ndarray) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="voxnet", id="typed")
    r.inputs.add(name="input", datatype="FP32", shape=list(x.shape)).contents.fp32_contents.extend(x.ravel().tolist())
    return r


def raw_field(raw: bytes) -> bytes:
    """A raw_input_contents entry as its wire bytes (field 7, length-delimited)."""
    return pb.ModelInferRequest(raw_input_contents=[raw]).SerializeToString()


def reordered(req: pb.ModelInferRequest, where: str) -> bytes:
    """``req``'s bytes with its one raw_input_contents entry first, or between its names and its tensors (the
    concatenation of messages' bytes is their merge)."""
    (raw,) = req.raw_input_contents
    rest = pb.ModelInferRequest()
    rest.CopyFrom(req)
    rest.ClearField("raw_input_contents")
    if where == "first":
        return raw_field(raw) + rest.SerializeToString()
    names = pb.ModelInferRequest(model_name=rest.model_name, id=rest.id).SerializeToString()
    rest.ClearField("model_name")
    rest.ClearField("id")
    return names + raw_field(raw) + rest.SerializeToString()


def reports_settled(partner: Partner, count: int):
    return lambda: len(partner.report_records()) >= count


# --- the fast path against the Python front end ----------------------------------------------------------------


def test_fast_path_answers_are_the_python_front_ends_to_the_bit(binary, real, partner):
    server, engine_socket = real
    rng = np.random.default_rng()
    cases = []  # (the input, the request, its bytes)
    for datatype in ("FP32", "FP16", "BF16"):
        # the last shape's tensor (over 32 KiB) is taken from the message's slices, the others parsed with it
        for shape in ((1, 3, 3, 3, 3), (2, 3, 5, 4, 6), (3, 3, 8, 9, 7), (2, 3, 12, 20, 24)):
            x = rng.standard_normal(shape, dtype=np.float32) * 3
            req = build_request(x, "voxnet", datatype, request_id=f"{datatype}-{shape[0]}")
            cases.append((x, req, req.SerializeToString()))
    x = rng.standard_normal((2, 3, 12, 20, 24), dtype=np.float32)
    req = build_request(x, "voxnet", "FP32", request_id="reordered")
    for order in ("first", "middle"):  # raw_input_contents not last
        cases.append((x, req, reordered(req, order)))
    x = rng.standard_normal((2, 3, 4, 4, 4), dtype=np.float32)
    cases.append((x, typed_request(x), typed_request(x).SerializeToString()))
    versioned = build_request(x, "voxnet", "FP32")
    versioned.model_version = "1"
    versioned.ClearField("outputs")  # no output requested: the same answer
    cases.append((x, versioned, versioned.SerializeToString()))
    W, B = reference_weights()
    with native(binary, [engine_socket], partner) as fe:
        for x, req, payload in cases:
            code_a, _, a, _, _ = infer(server.url, payload)
            code_b, details, b, _, _ = infer(fe.url, payload)
            assert (code_a, code_b) == (OK, OK), details
            assert b == a  # the serialised responses, byte for byte
            response = pb.ModelInferResponse.FromString(b)
            typed = req.inputs[0].HasField("contents")
            assert bool(response.raw_output_contents) != typed  # typed answered typed, raw answered raw
            y = parse_response(response)
            assert y.shape == (x.shape[0], 16)
            if req.inputs[0].datatype == "FP32":
                assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), W, B)) <= 1e-5
        assert partner.received(INFER) == []  # every one on the fast path
        counters = fe.counters()
        assert counters["infer records"] == len(cases)
        assert counters["tensors from the wire"] == 5  # the large ones
        assert counters["their slices"] > 5


def test_a_non_finite_output_is_the_python_front_ends_invalid_argument(binary, real, partner):
    server, engine_socket = real
    x = np.random.default_rng(3).standard_normal((4, 3, 3, 3, 3), dtype=np.float32)
    x[1, 0, 0, 0, 0] = np.nan
    x[3, 2, 1, 1, 1] = np.inf
    payload = build_request(x, "voxnet", "FP32").SerializeToString()
    with native(binary, [engine_socket], partner) as fe:
        python = infer(server.url, payload)
        ours = infer(fe.url, payload)
    assert python[0] == INVALID_ARGUMENT
    assert ours[:2] == python[:2]
    assert "sample 1 (of 4; 2 such)" in ours[1]


# --- everything else goes to the partner -----------------------------------------------------------------------


def not_fast_path() -> dict[str, bytes]:
    """ModelInfer requests the fast path must not take, each as its bytes."""
    def edited(edit) -> bytes:
        r = request()
        edit(r)
        return r.SerializeToString()

    def shm(r):
        r.inputs[0].parameters["shared_memory_region"].string_param = "region"

    def classification(r):
        r.outputs[0].parameters["classification"].int64_param = 3

    def rank4(r):
        del r.inputs[0].shape[:]
        r.inputs[0].shape.extend([1, 3, 3, 3])

    def fp16_typed(r):
        r.ClearField("raw_input_contents")
        r.inputs[0].datatype = "FP16"
        r.inputs[0].contents.fp32_contents.extend([0.0] * 81)

    return {
        "a tensor parameter": edited(shm),
        "an output parameter": edited(classification),
        "rank 4": edited(rank4),
        "another model": edited(lambda r: setattr(r, "model_name", "other")),
        "bytes 4 short": edited(lambda r: r.raw_input_contents.__setitem__(0, r.raw_input_contents[0][:-4])),
        "FP16 typed": edited(fp16_typed),
        "an id of 300 bytes": edited(lambda r: setattr(r, "id", "x" * 300)),
        "1025 samples": edited(lambda r: r.inputs[0].shape.__setitem__(0, 1025)),
        "not a message": b"\xff\xff\xff",
    }


def test_calls_the_fast_path_does_not_take_reach_the_partner_unchanged(binary, engine, partner):
    cases = not_fast_path()
    metadata = (("x-custom", "v1"), ("x-voxserve-peer", "forged"), ("x-blob-bin", b"\x00\x01\xff"))
    with native(binary, [engine.path], partner) as fe:
        for name, payload in cases.items():
            code, details, response, initial, trailing = infer(fe.url, payload, timeout=30, metadata=metadata)
            assert (code, response) == (OK, b"partner:" + payload), name
            assert (initial.get("x-initial"), trailing.get("x-trailer")) == ("i1", "t1"), name
        partner.fail = (grpc.StatusCode.NOT_FOUND, "the partner says no")
        code, details, _, initial, trailing = infer(fe.url, cases["rank 4"])
        assert (code, details, initial.get("x-initial"), trailing.get("x-trailer")) == (
            5, "the partner says no", "i1", "t1")
        assert engine.infers() == []
    received = partner.received(INFER)
    assert [c.messages for c in received] == [[p] for p in cases.values()] + [[cases["rank 4"]]]
    for c in received[:len(cases)]:
        assert c.header("x-custom") == ["v1"]
        assert c.header("x-blob-bin") == [b"\x00\x01\xff"]
        (peer,) = c.header("x-voxserve-peer")  # the client's own replaced, not added to
        assert peer.startswith("ipv4:127.0.0.1:")
        # (gRPC rounds a timeout up to the units it sends it in, at each hop)
        assert c.time_remaining is not None and 0 < c.time_remaining <= 31
    assert partner.report_records() == []  # the partner counts what it answers itself


def test_a_call_without_a_deadline_reaches_the_partner_without_one(binary, engine, partner):
    with native(binary, [engine.path], partner) as fe:
        assert unary(fe.url, SERVER_LIVE, b"live?", timeout=None)[:3] == (OK, "", b"partner:live?")
    (call,) = partner.received(SERVER_LIVE)
    assert call.time_remaining is None or call.time_remaining > 1e6


def test_streams_are_forwarded_both_ways(binary, engine, partner):
    with native(binary, [engine.path], partner) as fe, grpc.insecure_channel(fe.url) as channel:
        messages = [b"one", b"two", b"three" * 1000]
        stream = channel.stream_stream(STREAM_INFER)(iter(messages), timeout=30, metadata=(("x-custom", "s"),))
        assert list(stream) == [b"echo:" + m for m in messages]
        assert stream.code() == grpc.StatusCode.OK
        assert dict(stream.initial_metadata())["x-initial"] == "s1"
        assert dict(stream.trailing_metadata())["x-trailer"] == "s2"
        watch = channel.unary_stream(WATCH)(b"watch", timeout=30)
        assert list(watch) == [b"first", b"second"]
        assert dict(watch.trailing_metadata())["x-trailer"] == "w1"
    (streamed,) = partner.received(STREAM_INFER)
    assert streamed.messages == messages and streamed.header("x-custom") == ["s"]
    assert [c.messages for c in partner.received(WATCH)] == [[b"watch"]]


def test_a_cancelled_forwarded_call_is_cancelled_at_the_partner(binary, engine, partner):
    with native(binary, [engine.path], partner) as fe, grpc.insecure_channel(fe.url) as channel:
        future = channel.unary_unary(HOLD).future(b"hold", timeout=60)
        wait_for(lambda: partner.received(HOLD), what="the held call at the partner")
        future.cancel()
        (held,) = partner.received(HOLD)
        assert held.cancelled.wait(30)
        # and a deadline passing does the same
        late = channel.unary_unary(HOLD).future(b"late", timeout=2)
        with pytest.raises(grpc.RpcError) as exc:
            late.result()
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert partner.received(HOLD)[1].cancelled.wait(30)
        wait_for(lambda: fe.counters()["forwarded calls in progress"] == 0, what="the forwards to end")


def test_internal_methods_are_refused_and_never_forwarded(binary, engine, partner):
    with native(binary, [engine.path], partner) as fe:
        assert infer(fe.url, request().SerializeToString())[0] == OK
        code, details, *_ = unary(fe.url, REPORT, b"from a client")
        assert code == 12 and details == "Method not found!"
        code, *_ = unary(fe.url, "/voxserve.internal.Anything/Else", b"from a client")
        assert code == 12
        wait_for(reports_settled(partner, 1), what="the report of the ModelInfer")
    assert [c.method for c in partner.received() if c.method.startswith("/voxserve.internal.")] == []
    assert partner.bad_reports == []


def test_the_partner_unreachable_is_unavailable_and_its_reports_wait(binary, engine, sock_dir):
    with native(binary, [engine.path], sock_dir / "later.sock") as fe:  # a partner that is not there (yet)
        code, *_ = unary(fe.url, SERVER_LIVE, b"live?")
        assert code == UNAVAILABLE
        assert infer(fe.url, request().SerializeToString())[0] == OK
        wait_for(lambda: "did not take a report" in fe.log(), what="the failed report's log line")
        late = Partner(sock_dir / "later.sock")  # it comes up: the waiting record goes, calls go through
        try:
            wait_for(reports_settled(late, 1), what="the waiting record")
            assert [r[0] for r in late.report_records()] == [OK]
            wait_for(lambda: unary(fe.url, SERVER_LIVE, b"live?")[0] == OK, what="a forwarded call")
        finally:
            late.stop()


def test_fast_path_0_forwards_every_call(binary, engine, partner):
    payload = request().SerializeToString()
    with native(binary, [engine.path], partner, "--fast-path", "0") as fe:
        assert infer(fe.url, payload)[2] == b"partner:" + payload
    assert engine.infers() == []
    assert [c.messages for c in partner.received(INFER)] == [[payload]]


# --- accounting ------------------------------------------------------------------------------------------------


def test_reports_count_every_fast_path_call_once_with_its_code(binary, real, partner):
    _server, engine_socket = real
    shapes = [(1, 3, 3, 3, 3), (2, 3, 4, 5, 6), (3, 3, 3, 4, 3)]
    nan = np.full((2, 3, 3, 3, 3), np.nan, np.float32)
    with native(binary, [engine_socket], partner) as fe:
        for i, shape in enumerate(shapes):
            assert infer(fe.url, request(shape, "FP16" if i == 1 else "FP32", seed=i).SerializeToString())[0] == OK
        assert infer(fe.url, build_request(nan, "voxnet", "FP32").SerializeToString())[0] == INVALID_ARGUMENT
        for payload in not_fast_path().values():  # forwarded: the partner counts those itself
            infer(fe.url, payload)
        assert fe.stop() == 0
    records = partner.report_records()
    assert Counter(r[0] for r in records) == {OK: 3, INVALID_ARGUMENT: 1}
    ok_records = [r for r in records if r[0] == OK]
    # served, samples, input bytes, in the order the calls came
    assert [(r[1], r[4], r[5]) for r in ok_records] == [
        (1, 1, 81 * 4), (1, 2, 2 * 3 * 4 * 5 * 6 * 2), (1, 3, 3 * 3 * 3 * 4 * 3 * 4)]
    assert all(r[2] > 0 and r[3] >= 0 for r in records)
    (failed,) = [r for r in records if r[0] == INVALID_ARGUMENT]
    assert (failed[4], failed[5]) == (2, nan.nbytes)
    assert partner.bad_reports == []
    assert partner.reports[-1].in_progress == 0


# --- tokens and TLS --------------------------------------------------------------------------------------------


def test_tokens_are_checked_on_the_fast_path_and_forwarded_calls_carry_them(binary, engine, partner, sock_dir):
    token = "s3cret-token-0123456789"
    digests = sock_dir / "digests"
    digests.write_text(hashlib.sha256(b"another-token-abcdefgh").hexdigest() + "\n"
                       + hashlib.sha256(token.encode()).hexdigest() + "\n")
    payload = request().SerializeToString()
    with native(binary, [engine.path], partner, "--token-digests", str(digests)) as fe:
        assert infer(fe.url, payload, metadata=(("authorization", f"Bearer {token}"),))[0] == OK
        assert infer(fe.url, payload, metadata=(("authorization", f"bEaReR   {token}  "),))[0] == OK
        for metadata in [(("authorization", "Bearer wrong-token-0123456789"),), None,
                         (("authorization", token),), (("authorization", "Bearer "),)]:
            assert infer(fe.url, payload, metadata=metadata)[:3] == (UNAUTHENTICATED, DENIED, None)
        # forwarded calls are the partner's to check: their metadata goes with them
        assert unary(fe.url, SERVER_LIVE, b"x", metadata=(("authorization", "Bearer whatever"),))[0] == OK
        assert fe.stop() == 0
    assert len(engine.infers()) == 2  # the refused ones were never read
    assert partner.received(SERVER_LIVE)[0].header("authorization") == ["Bearer whatever"]
    assert Counter(r[0] for r in partner.report_records()) == {OK: 2, UNAUTHENTICATED: 4}


def test_a_bad_digest_file_is_exit_2(binary, engine, partner, sock_dir):
    digests = sock_dir / "digests"
    digests.write_text("not-a-digest\n")
    proc = subprocess.run([str(binary), "--engine", str(engine.path), "--listen", "127.0.0.1:0", "--partner",
                           f"unix:{partner.path}", "--token-digests", str(digests)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "line 1 is not a lowercase hex SHA-256 digest" in proc.stderr


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_on_the_public_port(binary, engine, partner, sock_dir, mutual):
    ca = CertificateAuthority(sock_dir, "server")
    issued = ca.issue("localhost", server=True)
    clients = CertificateAuthority(sock_dir, "clients")
    client = clients.issue("client", server=False)
    flags = ["--tls-cert", str(issued.cert), "--tls-key", str(issued.key)]
    if mutual:
        flags += ["--tls-client-ca", str(clients.path)]
    payload = request().SerializeToString()
    with native(binary, [engine.path], partner, *flags) as fe:
        url = fe.url  # (the certificate names 127.0.0.1)
        plain = grpc.ssl_channel_credentials(ca.path.read_bytes())
        with_cert = grpc.ssl_channel_credentials(ca.path.read_bytes(), client.key.read_bytes(),
                                                 client.cert.read_bytes())
        assert infer(url, payload, credentials=with_cert, timeout=10)[0] == OK
        assert infer(url, payload, credentials=plain, timeout=10)[0] == (UNAVAILABLE if mutual else OK)
        assert infer(url, payload, timeout=10)[0] == UNAVAILABLE  # no TLS at all
        assert unary(url, SERVER_LIVE, b"x", credentials=with_cert, timeout=10)[0] == OK  # forwarded as well


# --- limits, several engines, a lost engine ---------------------------------------------------------------------


@pytest.fixture
def held(sock_dir: Path) -> Iterator[FakeEngine]:
    e = FakeEngine(sock_dir / "held.sock", auto=False)
    yield e
    e.close()


@pytest.mark.parametrize(("limits", "in_flight", "refusal"), [
    (["--max-concurrent-rpcs", "2"], 2,
     (RESOURCE_EXHAUSTED, "this front end has 2 RPCs in progress, its limit (--max-concurrent-rpcs, each front end's "
                          "own); retry later")),
    (["--max-queue-size", "1"], 1,
     (UNAVAILABLE, "model 'voxnet' is overloaded: this front end has 1 requests waiting for the engine, its limit "
                   "(--max-queue-size 1); retry later")),
])
def test_the_rpc_and_queue_limits(binary, held, partner, limits, in_flight, refusal):
    payload = request().SerializeToString()
    with native(binary, [held.path], partner, *limits) as fe, grpc.insecure_channel(fe.url) as channel:
        futures = [channel.unary_unary(INFER).future(payload, timeout=60) for _ in range(in_flight)]
        held.wait_records(ipc.INFER, in_flight)
        assert infer(fe.url, payload)[:2] == refusal
        for record in held.infers():
            held.reply(held.connection(), record.id, 1)
        assert all(f.result() for f in futures)
        last = channel.unary_unary(INFER).future(payload, timeout=60)  # room again
        held.reply(held.connection(), held.wait_records(ipc.INFER, in_flight + 1)[-1].id, 1)
        assert last.result()
        assert fe.stop() == 0
    assert Counter(r[0] for r in partner.report_records()) == {OK: in_flight + 1, refusal[0]: 1}


def test_each_request_goes_to_the_engine_with_the_fewest_outstanding(binary, sock_dir, partner):
    engines = [FakeEngine(sock_dir / f"e{i}.sock", device=f"cpu:{i}", auto=False) for i in range(2)]
    payload = request().SerializeToString()
    try:
        with native(binary, [e.path for e in engines], partner) as fe, grpc.insecure_channel(fe.url) as channel:
            futures, replied = [], set()

            def send(expected: list[int]) -> None:
                futures.append(channel.unary_unary(INFER).future(payload, timeout=60))
                wait_for(lambda: [len(e.infers()) for e in engines] == expected,
                         what=f"records on the engines {expected}")

            def answer(e: FakeEngine) -> None:
                for record in e.infers():
                    if record.id not in replied:
                        replied.add(record.id)
                        e.reply(e.connection(), record.id, 1)

            send([1, 0])  # a tie: the first
            send([1, 1])
            send([2, 1])
            answer(engines[0])  # 0 outstanding there, 1 on engine 1
            wait_for(lambda: fe.counters()["pending"] == 1, what="engine 0's answers")
            send([3, 1])
            send([4, 1])  # a tie again
            send([4, 2])
            answer(engines[0])
            answer(engines[1])
            assert all(f.result() for f in futures)
            # each engine got the same arena (one memfd, handed to both) and this front end's name
            assert [e.frontends[0]["frontend"] for e in engines] == ["native-test", "native-test"]
    finally:
        for e in engines:
            e.close()


def test_lost_engines_fail_their_calls_and_then_every_call(binary, sock_dir, partner):
    engines = [FakeEngine(sock_dir / f"e{i}.sock", device=f"cpu:{i}", auto=False) for i in range(2)]
    payload = request().SerializeToString()
    try:
        with native(binary, [e.path for e in engines], partner) as fe, grpc.insecure_channel(fe.url) as channel:
            first = channel.unary_unary(INFER).future(payload, timeout=60)
            engines[0].wait_records(ipc.INFER, 1)
            engines[0].close()
            with pytest.raises(grpc.RpcError) as exc:
                first.result()
            assert (exc.value.code(), exc.value.details()) == (
                grpc.StatusCode.UNAVAILABLE, "the engine on cpu:0 stopped (it closed the connection); retry")
            second = channel.unary_unary(INFER).future(payload, timeout=60)  # the one left takes it
            engines[1].wait_records(ipc.INFER, 1)
            engines[1].close()
            with pytest.raises(grpc.RpcError):
                second.result()
            assert infer(fe.url, payload)[:2] == (
                UNAVAILABLE, "the engine(s) on cpu:0, cpu:1 stopped (engine connection lost: it closed the "
                "connection); this replica must be restarted, retry on another")
            assert fe.counters()["arena bytes held"] == 0
    finally:
        for e in engines:
            e.close()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_a_reply_announcing_gigabytes_takes_memory_only_as_its_bytes_come(binary, held, partner):
    """The reply reader made room for a reply's announced payload at once: a reply header announcing 3 GiB (a corrupt
    or hostile engine stream) made the front end allocate and zero 3 GiB. Its buffer now grows with what arrives,
    as the Python front end's does, and the front end goes on serving until the engine hangs up."""
    payload = request().SerializeToString()
    with native(binary, [held.path], partner) as fe, grpc.insecure_channel(fe.url) as channel:
        first = channel.unary_unary(INFER).future(payload, timeout=60)
        (record,) = held.wait_records(ipc.INFER, 1)
        held.reply(held.connection(), record.id, 1)
        first.result()
        before = _rss_bytes(fe.proc.pid)
        held.connection().sendall(ipc.REPLY.pack(ipc.OK, 0, 3 << 30, 1 << 40, 0, 0) + b"\0" * 1024)
        time.sleep(1.0)
        assert _rss_bytes(fe.proc.pid) - before < 256 << 20
        assert fe.proc.poll() is None


# --- cancellation, deadlines, the arena ------------------------------------------------------------------------


def test_a_cancelled_call_sends_cancel_and_its_block_waits_for_the_reply(binary, held, partner):
    big = request((4, 3, 8, 8, 8), seed=1)
    small = request((1, 3, 3, 3, 3), seed=2)
    with native(binary, [held.path], partner) as fe, grpc.insecure_channel(fe.url) as channel:
        cancelled = channel.unary_unary(INFER).future(big.SerializeToString(), timeout=60)
        (first,) = held.wait_records(ipc.INFER, 1)
        assert first.data == big.raw_input_contents[0] and not np.isnan(first.deadline)
        cancelled.cancel()
        (cancel,) = held.wait_records(ipc.CANCEL, 1)
        assert cancel.id == first.id
        # Its block stays reserved until the engine answers: the next request's lies elsewhere.
        later = channel.unary_unary(INFER).future(small.SerializeToString(), timeout=60)
        second = held.wait_records(ipc.INFER, 2)[1]
        assert second.offset >= first.offset + first.nbytes or second.offset + second.nbytes <= first.offset
        assert second.data == small.raw_input_contents[0]
        held.reply_error(held.connection(), first.id, CANCELLED, "cancelled")
        held.reply(held.connection(), second.id, 1)
        assert parse_response(pb.ModelInferResponse.FromString(later.result())).shape == (1, 16)
        counters = fe.counters()
        assert (counters["pending"], counters["arena bytes held"], counters["cancel records"]) == (0, 0, 1)
        # with nothing held, the ring goes on after the last block
        third = channel.unary_unary(INFER).future(small.SerializeToString(), timeout=60)
        record = held.wait_records(ipc.INFER, 3)[2]
        held.reply(held.connection(), record.id, 1)
        assert third.result()
        assert fe.stop() == 0
    assert Counter(r[0] for r in partner.report_records()) == {OK: 2, CANCELLED: 1}


def test_a_cancelled_calls_block_is_not_reused_before_the_engines_reply(binary, held, partner):
    """In a 1 MiB ring, A and B take the first 768 KiB; A is cancelled; C (384 KiB) fits only where A was, so it
    waits until the engine answers A."""
    a, b, c = (request((1, 3, 32, 32, 32), seed=i, request_id=name) for i, name in enumerate("abc"))
    assert len(a.raw_input_contents[0]) == 384 << 10
    with native(binary, [held.path], partner, "--arena-bytes", str(1 << 20)) as fe, \
            grpc.insecure_channel(fe.url) as channel:
        first = channel.unary_unary(INFER).future(a.SerializeToString(), timeout=60)
        held.wait_records(ipc.INFER, 1)
        second = channel.unary_unary(INFER).future(b.SerializeToString(), timeout=60)
        ra, rb = held.wait_records(ipc.INFER, 2)
        assert (ra.offset, rb.offset) == (0, 384 << 10)
        first.cancel()
        held.wait_records(ipc.CANCEL, 1)
        third = channel.unary_unary(INFER).future(c.SerializeToString(), timeout=60)
        wait_for(lambda: fe.counters()["waiting"] == 1, what="C waiting for room")
        assert len(held.infers()) == 2
        held.reply_error(held.connection(), ra.id, CANCELLED, "cancelled")
        rc = held.wait_records(ipc.INFER, 3)[2]
        assert (rc.offset, rc.data) == (0, c.raw_input_contents[0])
        held.reply(held.connection(), rb.id, 1)
        held.reply(held.connection(), rc.id, 1)
        assert second.result() and third.result()
        counters = fe.counters()
        assert (counters["pending"], counters["waiting"], counters["arena bytes held"]) == (0, 0, 0)


def test_deadlines_travel_in_the_record_and_cancel_when_they_pass(binary, held, partner):
    payload = request().SerializeToString()
    with native(binary, [held.path], partner) as fe, grpc.insecure_channel(fe.url) as channel:
        before = time.monotonic()
        timed = channel.unary_unary(INFER).future(payload, timeout=2)
        (record,) = held.wait_records(ipc.INFER, 1)
        assert before < record.deadline <= record.received + 2  # CLOCK_MONOTONIC seconds, as time.monotonic()
        with pytest.raises(grpc.RpcError) as exc:
            timed.result()
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        (cancel,) = held.wait_records(ipc.CANCEL, 1)
        assert cancel.id == record.id
        untimed = channel.unary_unary(INFER).future(payload)
        record = held.wait_records(ipc.INFER, 2)[1]
        assert np.isnan(record.deadline)
        held.reply_error(held.connection(), cancel.id, CANCELLED, "cancelled")
        held.reply(held.connection(), record.id, 1)
        assert untimed.result()
        assert fe.counters()["arena bytes held"] == 0
        assert fe.stop() == 0
    assert Counter(r[0] for r in partner.report_records()) == {OK: 1, DEADLINE_EXCEEDED: 1}


def test_calls_waiting_for_arena_room_are_cancelled_and_later_calls_work_on_a_real_engine(binary, real, partner):
    """The prototype's burst: 12 calls of 3 MB into an 8 MiB arena (two fit at once, the rest wait for room), half
    cancelled by the client, half by a short deadline; then a plain call, which is answered; nothing stays held.
    The engine is paused while the burst arrives, so the first calls keep their room however fast it would be."""
    server, engine_socket = real
    (engine_pid, _), = engines(server)
    x = np.random.default_rng(1).standard_normal((16, 3, 16, 32, 32), dtype=np.float32)
    payload = build_request(x, "voxnet", "FP32").SerializeToString()
    with native(binary, [engine_socket], partner, "--arena-bytes", str(8 << 20)) as fe, \
            grpc.insecure_channel(fe.url, options=[("grpc.max_send_message_length", 1 << 27)]) as channel:
        with paused(engine_pid):
            futures = [channel.unary_unary(INFER).future(payload, timeout=0.05 if i % 2 else 60) for i in range(12)]
            wait_for(lambda: fe.counters()["waiting"] > 0, what="calls waiting for arena room")
            for future in futures[::2]:
                future.cancel()
        for future in futures:
            with contextlib.suppress(grpc.RpcError, grpc.FutureCancelledError):
                future.result()
        wait_for(lambda: fe.counters()["pending"] == 0, 120, "the engine's replies")
        assert infer(fe.url, request().SerializeToString())[0] == OK
        counters = fe.counters()
        assert counters["cancel records"] > 0
        assert counters["replies"] == counters["infer records"]
        assert (counters["waiting"], counters["arena blocks held"], counters["arena bytes held"]) == (0, 0, 0)


# --- draining, the command line, the build -----------------------------------------------------------------------


def test_sigterm_answers_the_call_in_flight_then_exits_0(binary, held, partner):
    payload = request().SerializeToString()
    with native(binary, [held.path], partner, "--grace-period-s", "30") as fe, \
            grpc.insecure_channel(fe.url) as channel:
        in_flight = channel.unary_unary(INFER).future(payload, timeout=60)
        (record,) = held.wait_records(ipc.INFER, 1)
        fe.proc.send_signal(15)
        wait_for(lambda: "draining" in fe.log(), what="the drain")
        wait_for(lambda: refuses(fe.port), what="the port to close")  # Shutdown has begun
        held.reply(held.connection(), record.id, 1)
        assert parse_response(pb.ModelInferResponse.FromString(in_flight.result())).shape == (1, 16)
        assert fe.wait() == 0
        assert fe.stopped_counters()["arena bytes held"] == 0
    assert [r[0] for r in partner.report_records()] == [OK]
    assert partner.reports[-1].in_progress == 0


def refuses(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--bogus", "1"], "unknown flag --bogus"),
    (["--engine"], "--engine needs a value"),
    (["--engine", "e.sock", "--listen", "127.0.0.1:0"], "--partner unix:PATH is required"),
    (["--engine", "e.sock", "--listen", "x:0", "--partner", "/no/scheme"], "--partner takes unix:PATH"),
    (["--engine", "e.sock", "--listen", "x:0", "--partner", "unix:p", "--fast-path", "2"], "--fast-path takes 0 or 1"),
    (["--engine", "e.sock", "--listen", "x:0", "--partner", "unix:p", "--max-queue-size", "many"],
     "--max-queue-size takes an integer"),
])
def test_a_mistake_on_the_command_line_is_exit_2(binary, argv, message):
    proc = subprocess.run([str(binary), *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


def test_a_port_in_use_by_another_process_is_exit_1(binary, engine, partner):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([str(binary), "--engine", str(engine.path), "--listen", f"127.0.0.1:{port}",
                               "--partner", f"unix:{partner.path}"],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "cannot serve on" in proc.stderr


def test_the_build_is_cached_and_a_prebuilt_binary_can_be_named(binary, monkeypatch, tmp_path):
    assert build.problem() is None
    assert build.build() == binary  # from the cache: same sources, same toolchain
    monkeypatch.setenv(build.ENV_BINARY, str(tmp_path / "absent"))
    with pytest.raises(build.NativeBuildError, match="is not an executable file"):
        build.build()
    assert "is not an executable file" in (build.problem() or "")
    monkeypatch.setenv(build.ENV_BINARY, str(binary))
    assert build.build() == binary


def test_a_missing_tool_is_named_with_its_debian_package(toolchain, monkeypatch):
    real_which = shutil.which
    monkeypatch.delenv(build.ENV_BINARY, raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None if name in ("protoc", "g++") else real_which(name))
    with pytest.raises(build.NativeBuildError) as exc:
        build.build()
    message = str(exc.value)
    assert "missing g++, protoc" in message and "(Debian: g++ protobuf-compiler-grpc)" in message
    assert ("sudo apt-get install g++ pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler-grpc libssl-dev"
            in message)


def test_a_missing_library_is_named_with_its_debian_package(binary, toolchain, monkeypatch):
    monkeypatch.delenv(build.ENV_BINARY, raising=False)
    monkeypatch.setattr(build, "PKG_CONFIG_PACKAGES", ("grpc++", "libcrypto", "voxserve-no-such-package"))
    monkeypatch.setitem(build.DEBIAN_PACKAGES, "voxserve-no-such-package", "libnothing-dev")
    with pytest.raises(build.NativeBuildError,
                       match=r"missing voxserve-no-such-package \(pkg-config\) \(Debian: libnothing-dev\)"):
        build.build()


def test_concurrent_builds_wait_for_each_other(binary, toolchain, monkeypatch, tmp_path):
    """Two builders of the same sources into an empty cache: one compiles (here a stand-in that copies the built
    binary), the other waits on the lock and takes its result."""
    monkeypatch.delenv(build.ENV_BINARY, raising=False)
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path))
    compiled = []
    entered = threading.Event()

    def compile_(tools, cflags, libs, work: Path, target_dir: Path) -> None:
        compiled.append(threading.get_ident())
        entered.set()
        time.sleep(0.5)  # (the other builder reaches the lock meanwhile)
        shutil.copy(binary, work / build.BINARY_NAME)

    monkeypatch.setattr(build, "_compile", compile_)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(build.build())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compiled) == 1 and len(set(results)) == 1 and results[0].exists()



def test_a_model_infer_without_a_message_reaches_the_partner(binary, engine, partner):
    """A client that half-closes without sending anything: the partner answers it (it has no message to parse)."""
    with native(binary, [engine.path], partner) as fe, grpc.insecure_channel(fe.url) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            channel.stream_unary(INFER)(iter([]), timeout=30)
        # the partner's gRPC answers it before any handler of its own runs
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "requires exactly one request message" in exc.value.details()
        assert infer(fe.url, request().SerializeToString())[0] == OK  # and the next call is served
    assert len(engine.infers()) == 1


# --- a large request's tensor, taken from the message's bytes ------------------------------------------------------


def test_a_large_tensor_is_copied_from_the_messages_slices_wherever_it_lies(binary, engine, partner):
    req = request((4, 3, 32, 32, 32), seed=5)  # 1.5 MiB: received in many slices
    (raw,) = req.raw_input_contents
    payloads = [req.SerializeToString(), reordered(req, "first"), reordered(req, "middle")]
    # Not a sequence of fields the walk takes, but messages protobuf takes (an unknown field): parsed whole, and
    # served just the same.
    group = b"\xa3\x06\x08\x01\xa4\x06"  # field 100, a group holding field 1 = 1
    payloads.append(req.SerializeToString() + group)
    payloads.append(req.SerializeToString() + b"\x38\x01")  # field 7 as a varint
    with native(binary, [engine.path], partner) as fe:
        for payload in payloads:
            code, details, response, _, _ = infer(fe.url, payload)
            assert code == OK, details
            assert parse_response(pb.ModelInferResponse.FromString(response)).shape == (4, 16)
        counters = fe.counters()
        assert counters["tensors from the wire"] == 3
        assert counters["their slices"] > 3 * 4  # (each tensor lay in many)
    assert [r.data == raw for r in engine.infers()] == [True] * 5
    assert [r.shape for r in engine.infers()] == [(4, 3, 32, 32, 32)] * 5
    assert partner.received(INFER) == []


def test_large_requests_the_walk_refuses_or_protobuf_rejects_reach_the_partner_unchanged(binary, engine, partner):
    req = request((2, 3, 16, 16, 16), seed=6)  # 96 KiB
    payload = req.SerializeToString()
    cases = {
        "raw_input_contents twice": payload + raw_field(req.raw_input_contents[0]),
        "wire type 7": payload + b"\x0f\x00",
        "cut short": payload[:-1],
        "a length past the end": payload + b"\x1a\x05ab",
        "an input that does not parse": payload + b"\x2a\x02\xff\xff",  # walked, then refused by protobuf
    }
    with native(binary, [engine.path], partner) as fe:
        for name, body in cases.items():
            code, _, response, initial, trailing = infer(fe.url, body)
            assert (code, response) == (OK, b"partner:" + body), name
            assert (initial.get("x-initial"), trailing.get("x-trailer")) == ("i1", "t1"), name
        partner.fail = (grpc.StatusCode.INVALID_ARGUMENT, "the partner's parse error")
        assert infer(fe.url, cases["cut short"])[:2] == (INVALID_ARGUMENT, "the partner's parse error")
        assert fe.counters()["tensors from the wire"] == 0
    assert engine.infers() == []
    assert [c.messages for c in partner.received(INFER)] == [[b] for b in cases.values()] + [[cases["cut short"]]]


# --- CUDA shared memory on the fast path ------------------------------------------------------------------------


class Regions:
    """A regions directory whose records are written as the server writes them: CUDA regions by a
    CudaSharedMemoryRegistry over a fake device layer of 8 devices, system regions by a SharedMemoryRegistry."""

    def __init__(self, path: Path) -> None:
        from voxserve.server.protocol.cudashm import CudaSharedMemoryRegistry
        from voxserve.server.protocol.shm import SharedMemoryRegistry
        from voxserve.testing.fake_devicemem import FakeDeviceMemory

        path.mkdir()
        self.path = path
        self.devices = FakeDeviceMemory(8)
        self.system = SharedMemoryRegistry(64, 1 << 30, str(path))
        self.cuda = CudaSharedMemoryRegistry(self.devices, 64, self.system, str(path))
        self.system.cuda = self.cuda
        self.segments: list = []

    def register(self, name: str, byte_size: int, device: int = 0) -> None:
        import asyncio

        asyncio.run(self.cuda.register(name, self.devices.export(byte_size, device), device, byte_size))

    def unregister(self, name: str) -> None:
        import asyncio

        asyncio.run(self.cuda.unregister(name))

    def register_system(self, name: str, byte_size: int) -> None:
        from voxserve.client import SharedMemoryBuffer

        segment = SharedMemoryBuffer(f"vxn_{os.getpid()}_{name}", byte_size)
        self.segments.append(segment)
        self.system.register(name, segment.key, 0, byte_size)

    def close(self) -> None:
        self.cuda.close()
        for segment in self.segments:
            segment.close()


@pytest.fixture
def regions(sock_dir: Path) -> Iterator[Regions]:
    r = Regions(sock_dir / "regions")
    yield r
    r.close()


def cuda_engines(sock_dir: Path, devices: list[str], auto: bool = True) -> list[FakeEngine]:
    return [FakeEngine(sock_dir / f"e{i}.sock", device=d, auto=auto, cuda_devices=8) for i, d in enumerate(devices)]


def in_region(shape=(1, 3, 3, 3, 3), datatype: str = "FP32", region: str = "in", offset: int = 0,
              output: tuple[str, int] | None = None, request_id: str = "r") -> pb.ModelInferRequest:
    """A request whose input lies at ``offset`` of CUDA region ``region``; its output in the response, or at
    ``output`` (region, offset)."""
    from voxserve.client import build_shm_request

    r = build_shm_request(shape, "voxnet", datatype, region, offset, *(output or (None, 0)),
                          shape[0] * 16 * 4 if output else None)
    r.id = request_id
    return r


def python_answer(r: pb.ModelInferRequest, rows: np.ndarray) -> pb.ModelInferResponse:
    """What the Python front end answers ``r`` with when the engine's rows are ``rows`` (codec.encode_response)."""
    from voxserve.server.protocol import codec

    out = r.outputs[0].parameters if r.outputs else {}
    output_shm = (codec.SharedMemoryRef(out["shared_memory_region"].string_param, 0, rows.nbytes)
                  if "shared_memory_region" in out else None)
    spec = codec.ModelSpec("voxnet", "1", 3, 16, 3, 1024)
    return codec.encode_response(r, spec, rows, codec.InferInput(np.zeros(1), "FP32", False, output_shm))


def test_a_cuda_region_request_goes_by_region_to_the_least_busy_engine_on_its_device(binary, sock_dir, partner,
                                                                                      regions):
    engines = cuda_engines(sock_dir, ["cuda:1", "cuda:0", "cuda:0"], auto=False)
    regions.register("in", 1 << 20, device=0)
    regions.register("out", 4096, device=0)
    regions.register("far", 4096, device=5)  # on a device no engine executes on
    plain = in_region(offset=512)
    with_output = in_region((2, 3, 3, 3, 3), "FP16", offset=1024, output=("out", 256), request_id="o")
    far = in_region(region="far", request_id="f")
    try:
        with native(binary, [e.path for e in engines], partner, "--regions-dir", str(regions.path)) as fe, \
                grpc.insecure_channel(fe.url) as channel:
            assert "(CUDA shared memory too)" in fe.log()
            futures = []
            # cuda:0's engines, the one with the fewest outstanding each time (the first on a tie); the far
            # region's on the first live engine (the one that registered it, as in remote.RemoteRunner.run)
            for r, expected in ((plain, [0, 1, 0]), (with_output, [0, 1, 1]), (far, [1, 1, 1])):
                futures.append(channel.unary_unary(INFER).future(r.SerializeToString(), timeout=60))
                wait_for(lambda expected=expected: [len(e.records) for e in engines] == expected,
                         what=f"records on the engines {expected}")
            rows = np.random.default_rng(1).random((2, 16), dtype=np.float32)
            for e in engines:
                (record,) = e.records
                e.reply(e.connection(), record.id, record.shape[0], rows[: record.shape[0]])
            for r, future in zip((plain, with_output, far), futures, strict=True):
                response = pb.ModelInferResponse.FromString(future.result())
                assert response == python_answer(r, rows[: r.inputs[0].shape[0]])
            assert fe.stop() == 0
        # No wire bytes, no arena: INFER_REGION records naming the regions and offsets
        got = [(rec.kind, rec.offset, rec.nbytes, rec.shape, ipc.parse_region(rec.trailer))
               for e in engines for rec in e.records]
        assert got == [(ipc.INFER_REGION, 0, 324, (1, 3, 3, 3, 3), ("cuda", "far", None)),
                       (ipc.INFER_REGION, 512, 324, (1, 3, 3, 3, 3), ("cuda", "in", None)),
                       (ipc.INFER_REGION, 1024, 324, (2, 3, 3, 3, 3), ("cuda", "in", ("out", 256)))]
        # each one reported once, its bytes on the CUDA path (metrics.INPUT_PATHS[2])
        assert sorted((r[0], r[4], r[5], r[6]) for r in partner.report_records()) == [
            (OK, 1, 324, 2), (OK, 1, 324, 2), (OK, 2, 324, 2)]
        assert partner.received(INFER) == []
        assert "of which by region 3," in fe.log()
    finally:
        for e in engines:
            e.close()


def region_cases(regions: Regions) -> dict[str, bytes]:
    """Requests in CUDA shared memory the fast path must not take (the Python front end's: each is refused there,
    or served another way), as their bytes; ``regions`` gets the regions they name."""
    regions.register("in", 4096)
    regions.register("out", 4096)
    regions.register("dev1", 4096, device=1)
    regions.register_system("sys", 4096)
    (regions.path / "r-cut").write_text('{"kind": "cuda", "handle": "AAAA')  # a record being written

    def edited(edit, r: pb.ModelInferRequest | None = None) -> bytes:
        r = r if r is not None else in_region(output=("out", 0))
        edit(r)
        return r.SerializeToString()

    def param(tensor, key: str, kind: str, value) -> None:
        setattr(tensor.parameters[f"shared_memory_{key}"], kind, value)

    def wire_output(r):
        param(r.outputs.add(name="output"), "region", "string_param", "out")
        param(r.outputs[0], "byte_size", "int64_param", 64)

    return {
        "an unregistered region": edited(lambda r: None, in_region(region="nope")),
        "a system region": edited(lambda r: None, in_region(region="sys")),
        "a region whose record is being written": edited(lambda r: None, in_region(region="cut")),
        "a name that is no region's": edited(lambda r: None, in_region(region="../regions/r-in")),
        "byte size an element short": edited(lambda r: param(r.inputs[0], "byte_size", "int64_param", 320)),
        "no byte size": edited(lambda r: r.inputs[0].parameters.pop("shared_memory_byte_size")),
        "an offset off a whole element": edited(lambda r: param(r.inputs[0], "offset", "int64_param", 2)),
        "beyond the region": edited(lambda r: param(r.inputs[0], "offset", "uint64_param", 4096 - 320)),
        "an offset beyond any region": edited(lambda r: param(r.inputs[0], "offset", "uint64_param", 2**64 - 4)),
        "an offset as a string": edited(lambda r: param(r.inputs[0], "offset", "string_param", "0")),
        "a negative offset": edited(lambda r: param(r.inputs[0], "offset", "int64_param", -4)),
        "a region as a number": edited(lambda r: param(r.inputs[0], "region", "int64_param", 1)),
        "raw contents too": edited(lambda r: r.raw_input_contents.append(b"\0" * 324)),
        "typed contents too": edited(lambda r: r.inputs[0].contents.fp32_contents.extend([0.0] * 81)),
        "another input parameter": edited(lambda r: setattr(r.inputs[0].parameters["priority"], "int64_param", 1)),
        "an output byte size short": edited(lambda r: param(r.outputs[0], "byte_size", "int64_param", 60)),
        "an output without a byte size": edited(lambda r: r.outputs[0].parameters.pop("shared_memory_byte_size")),
        "an output off a whole float": edited(lambda r: param(r.outputs[0], "offset", "int64_param", 2)),
        "an output beyond its region": edited(lambda r: param(r.outputs[0], "offset", "int64_param", 4096 - 60)),
        "an output on another device": edited(lambda r: param(r.outputs[0], "region", "string_param", "dev1")),
        "an output in a system region": edited(lambda r: param(r.outputs[0], "region", "string_param", "sys")),
        "an output in no region": edited(lambda r: param(r.outputs[0], "region", "string_param", "nope")),
        "classification": edited(lambda r: setattr(r.outputs[0].parameters["classification"], "int64_param", 3)),
        "a wire input's output in a CUDA region": edited(wire_output, request()),
        "two outputs": edited(lambda r: r.outputs.add(name="output")),
        "an input of 1025 samples": edited(lambda r: r.inputs[0].shape.__setitem__(0, 1025)),
    }


def test_cuda_region_requests_the_fast_path_does_not_take_reach_the_partner_unchanged(binary, sock_dir, partner,
                                                                                       regions):
    (engine,) = cuda_engines(sock_dir, ["cuda:0"])
    cases = region_cases(regions)
    try:
        with native(binary, [engine.path], partner, "--regions-dir", str(regions.path)) as fe:
            for name, payload in cases.items():
                assert infer(fe.url, payload)[:3] == (OK, "", b"partner:" + payload), name
            assert engine.records == []
    finally:
        engine.close()
    assert [c.messages for c in partner.received(INFER)] == [[p] for p in cases.values()]
    assert partner.report_records() == []


@pytest.mark.parametrize("how", ["without --regions-dir", "engines without CUDA shared memory", "--fast-path 0"])
def test_without_cuda_shared_memory_in_the_engines_or_the_flag_region_requests_reach_the_partner(
        binary, sock_dir, partner, regions, how):
    engine = FakeEngine(sock_dir / "e.sock", device="cuda:0", cuda_devices=0 if "engines" in how else 1)
    regions.register("in", 4096)
    payload = in_region().SerializeToString()
    flags = [] if how == "without --regions-dir" else ["--regions-dir", str(regions.path)]
    flags += ["--fast-path", "0"] if how == "--fast-path 0" else []
    try:
        with native(binary, [engine.path], partner, *flags) as fe:
            assert infer(fe.url, payload)[:3] == (OK, "", b"partner:" + payload)
            assert "(CUDA shared memory too)" not in fe.log()
        assert engine.records == []
    finally:
        engine.close()


def test_a_region_unregistered_or_registered_anew_is_read_again(binary, sock_dir, partner, regions):
    """A record is cached by its file's identity: a region unregistered goes to the partner (NOT_FOUND there), one
    registered again is checked against its new size."""
    (engine,) = cuda_engines(sock_dir, ["cuda:0"])
    payload = in_region(offset=1024).SerializeToString()
    regions.register("in", 4096)
    try:
        with native(binary, [engine.path], partner, "--regions-dir", str(regions.path)) as fe:
            assert infer(fe.url, payload)[0] == OK and len(engine.records) == 1
            regions.unregister("in")
            assert infer(fe.url, payload)[2] == b"partner:" + payload
            regions.register("in", 1200)  # too small for the tensor at 1024 now
            assert infer(fe.url, payload)[2] == b"partner:" + payload
            regions.unregister("in")
            regions.register("in", 1024 + 324)
            assert infer(fe.url, payload)[0] == OK and len(engine.records) == 2
    finally:
        engine.close()
    assert len(partner.received(INFER)) == 2


def test_a_record_rewritten_with_its_old_identity_soon_after_it_was_read_is_read_again(binary, sock_dir, partner,
                                                                                        regions):
    """Coarse file clocks: a region unregistered and registered again within one tick can leave a record with the old
    one's inode, size and mtime (here: rewritten in place, its mtime put back). Read that soon after its mtime, the
    identity vouches for nothing: the front end reads the record again and checks the request against it."""
    (engine,) = cuda_engines(sock_dir, ["cuda:0"])
    payload = in_region(offset=1024).SerializeToString()
    regions.register("in", 4096)
    record = regions.path / "r-in"
    try:
        with native(binary, [engine.path], partner, "--regions-dir", str(regions.path)) as fe:
            assert infer(fe.url, payload)[0] == OK and len(engine.records) == 1  # read and cached
            before = os.stat(record)
            text = record.read_text()
            assert '"byte_size": 4096' in text
            with open(record, "r+") as f:  # the same inode and size: 1200 bytes, too few for the tensor at 1024
                f.write(text.replace('"byte_size": 4096', '"byte_size": 1200'))
            os.utime(record, ns=(before.st_atime_ns, before.st_mtime_ns))
            after = os.stat(record)
            assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size,
                                                                        before.st_mtime_ns)
            assert infer(fe.url, payload)[2] == b"partner:" + payload
    finally:
        engine.close()
    assert len(engine.records) == 1


def test_a_cancelled_region_request_sends_cancel_and_takes_no_arena_room(binary, sock_dir, partner, regions):
    """A region's request holds no arena block: it goes out while wire requests wait for room, and cancelled it
    sends CANCEL as they do."""
    (engine,) = cuda_engines(sock_dir, ["cuda:0"], auto=False)
    regions.register("in", 4096)
    big = request((8, 3, 32, 32, 32)).SerializeToString()  # 3 MiB: one fills half of a 6 MiB arena ...
    try:
        with native(binary, [engine.path], partner, "--regions-dir", str(regions.path), "--arena-bytes",
                    str(6 << 20)) as fe, grpc.insecure_channel(fe.url, options=[
                        ("grpc.max_send_message_length", 1 << 27)]) as channel:
            held = [channel.unary_unary(INFER).future(big, timeout=60) for _ in range(3)]
            wait_for(lambda: fe.counters()["waiting"] == 1, what="a wire request waiting for arena room")
            region_call = channel.unary_unary(INFER).future(in_region().SerializeToString(), timeout=60)
            (record,) = engine.wait_records(ipc.INFER_REGION, 1)
            region_call.cancel()
            (cancel,) = engine.wait_records(ipc.CANCEL, 1)
            assert cancel.id == record.id
            for r in engine.infers():
                engine.reply(engine.connection(), r.id, 8)
            engine.reply(engine.connection(), record.id, 1)  # (the reply to a cancelled one frees nothing)
            wait_for(lambda: len(engine.infers()) == 3, what="the waiting request sent")
            engine.reply(engine.connection(), engine.infers()[-1].id, 8)
            assert all(f.result() for f in held)
            assert fe.counters()["pending"] == 0
            assert fe.stop() == 0  # (the last report goes out as it stops)
    finally:
        engine.close()
    assert Counter(r[0] for r in partner.report_records()) == {OK: 3, CANCELLED: 1}
