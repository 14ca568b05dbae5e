"""What the native front end's tests drive it with: the binary as a process, a partner standing in for the Python
front end on its Unix socket, and a scripted engine speaking server/topology/ipc.py's records."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from voxserve.server.topology import ipc

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
SERVER_LIVE = "/inference.GRPCInferenceService/ServerLive"
WATCH = "/grpc.health.v1.Health/Watch"
REPORT = "/voxserve.internal.FrontendReport/Report"
HOLD = "/test.Partner/Hold"  # the partner holds it until the call is cancelled

REPORT_HEADER = struct.Struct("<qI4x")
REPORT_RECORD = struct.Struct("<BBB5xqqqq")  # code, served, input path, elapsed ns, queue ns, samples, input bytes

# The Python front end's server options (server/protocol/server.py), as the supervisor passes them.
GRPC_ARGS = ["--grpc-arg", f"grpc.max_receive_message_length={128 << 20}",
             "--grpc-arg", f"grpc.max_send_message_length={128 << 20}",
             "--grpc-arg", "grpc.max_concurrent_streams=64", "--grpc-arg", "grpc.http.overload_protection=0",
             "--grpc-arg", "grpc.keepalive_time_ms=60000", "--grpc-arg", "grpc.keepalive_timeout_ms=20000",
             "--grpc-arg", "grpc.compression_enabled_algorithms_bitset=1"]


def wait_for(predicate: Callable[[], object], timeout_s: float = 30.0, what: str = "a condition"):
    """Poll ``predicate`` until it is truthy (its value), or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# --- the partner ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Received:
    """One call the partner received."""

    method: str
    messages: list[bytes]
    metadata: list[tuple[str, str | bytes]]
    time_remaining: float | None
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def header(self, key: str) -> list[str | bytes]:
        return [v for k, v in self.metadata if k == key]


@dataclasses.dataclass(frozen=True)
class ReportBody:
    in_progress: int
    # code, served, elapsed ns, queue ns, samples, input bytes, input path (its index in metrics.INPUT_PATHS)
    records: list[tuple[int, int, int, int, int, int, int]]


class Partner:
    """The Python front end's stand-in on ``unix:path``: records every call; answers unary calls with
    b"partner:" + the request (initial metadata x-initial, trailing x-trailer), or with ``fail`` (code, details);
    echoes ModelStreamInfer messages; sends two messages on Watch; holds HOLD until cancelled; parses Report bodies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls: list[Received] = []
        self.reports: list[ReportBody] = []
        self.bad_reports: list[bytes] = []
        self.fail: tuple[grpc.StatusCode, str] | None = None
        self._lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(32), options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        self.server.add_generic_rpc_handlers([_PartnerHandler(self)])
        self.server.add_insecure_port(f"unix:{path}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)

    def received(self, method: str | None = None) -> list[Received]:
        with self._lock:
            return [c for c in self.calls if method is None or c.method == method]

    def _record(self, method: str, messages: list[bytes], context) -> Received:
        call = Received(method, messages, list(context.invocation_metadata()), context.time_remaining())
        with self._lock:
            self.calls.append(call)
        return call

    def report_records(self) -> list[tuple[int, int, int, int, int, int, int]]:
        with self._lock:
            return [r for body in self.reports for r in body.records]

    def unary(self, method: str, request: bytes, context) -> bytes:
        call = self._record(method, [request], context)
        if method == HOLD:
            wait_for(lambda: not context.is_active(), 60, "the held call's cancellation")
            call.cancelled.set()
            return b""
        context.send_initial_metadata((("x-initial", "i1"),))
        context.set_trailing_metadata((("x-trailer", "t1"),))
        if self.fail is not None:
            context.abort(*self.fail)
        return b"partner:" + request

    def report(self, request: bytes, context) -> bytes:
        if len(request) < REPORT_HEADER.size:
            self.bad_reports.append(request)
            return b""
        in_progress, count = REPORT_HEADER.unpack_from(request)
        if len(request) != REPORT_HEADER.size + count * REPORT_RECORD.size:
            self.bad_reports.append(request)
            return b""
        records = []
        for i in range(count):
            code, served, path, *rest = REPORT_RECORD.unpack_from(request, REPORT_HEADER.size + i * REPORT_RECORD.size)
            records.append((code, served, *rest, path))
        with self._lock:
            self.reports.append(ReportBody(in_progress, records))
        return b""

    def stream(self, requests, context):
        messages: list[bytes] = []
        self._record(STREAM_INFER, messages, context)
        context.send_initial_metadata((("x-initial", "s1"),))
        for message in requests:
            messages.append(message)
            yield b"echo:" + message
        context.set_trailing_metadata((("x-trailer", "s2"),))

    def watch(self, request: bytes, context):
        self._record(WATCH, [request], context)
        yield b"first"
        yield b"second"
        context.set_trailing_metadata((("x-trailer", "w1"),))


class _PartnerHandler(grpc.GenericRpcHandler):
    def __init__(self, partner: Partner) -> None:
        self.partner = partner

    def service(self, details):
        method = details.method
        if method == REPORT:
            return grpc.unary_unary_rpc_method_handler(self.partner.report)
        if method == STREAM_INFER:
            return grpc.stream_stream_rpc_method_handler(self.partner.stream)
        if method == WATCH:
            return grpc.unary_stream_rpc_method_handler(self.partner.watch)
        return grpc.unary_unary_rpc_method_handler(lambda request, context: self.partner.unary(method, request,
                                                                                              context))


# --- a scripted engine ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Record:
    """A request record the engine received, with the tensor bytes its block held when it came."""

    kind: int
    id: int
    offset: int
    nbytes: int
    deadline: float
    shape: tuple[int, ...]
    data: bytes  # INFER: the block's bytes; INFER_REGION: none (the tensor is in the client's region)
    received: float  # time.monotonic()
    trailer: bytes = b""  # INFER_REGION: ipc.region_trailer's


class FakeEngine:
    """An engine on ``path`` speaking ipc.py's records (the hello, INFER, INFER_REGION, CANCEL, replies), whose
    answers the test scripts: with ``auto`` every INFER and INFER_REGION is answered at once with rows of 1/cout,
    else it waits for ``reply``. ``cuda_devices``: what its hello says it can open clients' CUDA memory on."""

    def __init__(self, path: Path, device: str = "fake", auto: bool = True, cin: int = 3, cout: int = 16,
                 k: int = 3, cuda_devices: int = 0) -> None:
        self.path, self.device, self.auto, self.cout = path, device, auto, cout
        self.hello = {"engine": 0, "cin": cin, "cout": cout, "k": k, "device": device, "kernel": "fake-kernel",
                      "pid": os.getpid(), "cuda_devices": cuda_devices, "system_shm_in_place": False}
        self.records: list[Record] = []
        self.frontends: list[dict] = []
        self._cv = threading.Condition()
        self._conns: list[socket.socket] = []
        self._send_lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        hello, fds = ipc.read_hello(conn, 1)
        arena = mmap.mmap(fds[0], int(hello["arena_bytes"]))
        os.close(fds[0])
        with self._cv:
            self.frontends.append(hello)
            self._conns.append(conn)
        conn.sendall(ipc.hello_bytes(self.hello))
        buffer = b""
        while True:
            try:
                data = conn.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            buffer += data
            records, used = ipc.requests(buffer, 1 << 16)
            buffer = buffer[used:]
            for fields, trailer in records:
                kind, _dtype, _trailer, req_id, offset, nbytes, deadline, *shape = fields
                record = Record(kind, req_id, offset, nbytes, deadline, tuple(shape),
                                bytes(arena[offset:offset + nbytes]) if kind == ipc.INFER else b"", time.monotonic(),
                                trailer)
                with self._cv:
                    self.records.append(record)
                    self._cv.notify_all()
                if self.auto and kind in (ipc.INFER, ipc.INFER_REGION):
                    self.reply(conn, req_id, shape[0])

    def connection(self, index: int = 0) -> socket.socket:
        with self._cv:
            return self._conns[index]

    def infers(self) -> list[Record]:
        with self._cv:
            return [r for r in self.records if r.kind == ipc.INFER]

    def cancels(self) -> list[Record]:
        with self._cv:
            return [r for r in self.records if r.kind == ipc.CANCEL]

    def wait_records(self, kind: int, count: int, timeout_s: float = 30.0) -> list[Record]:
        with self._cv:
            ok = self._cv.wait_for(lambda: sum(r.kind == kind for r in self.records) >= count, timeout_s)
            assert ok, f"the engine got {sum(r.kind == kind for r in self.records)} records of kind {kind}, not {count}"
            return [r for r in self.records if r.kind == kind]

    def reply(self, conn: socket.socket, req_id: int, n: int, rows: np.ndarray | None = None, queue_ns: int = 7,
              batch: int = 1) -> None:
        out = np.full((n, self.cout), 1 / self.cout, np.float32) if rows is None else rows.astype(np.float32)
        payload = out.tobytes()
        with self._send_lock:
            conn.sendall(ipc.REPLY.pack(ipc.OK, 0, len(payload), req_id, queue_ns, batch) + payload)

    def reply_error(self, conn: socket.socket, req_id: int, code: int, message: str) -> None:
        raw = message.encode()
        with self._send_lock:
            conn.sendall(ipc.REPLY.pack(ipc.ERROR, code, len(raw), req_id, 0, 0) + raw)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._cv:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()


# --- the binary ----------------------------------------------------------------------------------------------


class Native:
    """voxserve-frontend as a process on a free loopback port, connected to ``engines`` and ``partner``; its stderr
    kept in a file (``log()``)."""

    def __init__(self, binary: Path, engines: list[Path | str], partner: Path, log_path: Path, *flags: str,
                 grpc_args: bool = True) -> None:
        argv = [str(binary), *(a for e in engines for a in ("--engine", str(e))), "--listen", "127.0.0.1:0",
                "--partner", f"unix:{partner}", "--name", "native-test", "--report-interval-ms", "20",
                *(GRPC_ARGS if grpc_args else []), *flags]
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - written by the process until it ends
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, text=True)
        first: list[str] = []
        reader = threading.Thread(target=lambda: first.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        line = first[0] if first else ""
        if not line.startswith("listening "):
            self.kill()
            raise RuntimeError(f"voxserve-frontend did not start ({line!r}):\n{self.log()}")
        self.port = int(line.split()[1])
        self.url = f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def counters(self) -> dict[str, int]:
        """The counters line it logs on SIGUSR1, as {name: value}."""
        seen = self.log().count("counters: ")
        self.proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: self.log().count("counters: ") > seen, 30, "the counters line")
        line = [x for x in self.log().splitlines() if "counters: " in x][-1]
        return _parse_counters(line.split("counters: ", 1)[1])

    def stopped_counters(self) -> dict[str, int]:
        line = [x for x in self.log().splitlines() if "stopped: " in x][-1]
        return _parse_counters(line.split("stopped: ", 1)[1])

    def stop(self, timeout_s: float = 60) -> int:
        """SIGTERM, then its exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.wait(timeout_s)

    def wait(self, timeout_s: float = 60) -> int:
        try:
            code = self.proc.wait(timeout_s)
        finally:
            self.kill()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _parse_counters(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(", "):
        name, _, value = part.rpartition(" ")
        out[name] = int(value)
    return out
