"""Between the gRPC front ends and the engine (``--frontends``): the records on their Unix socket and the
staging arena the tensors travel in.

Each front end owns an arena: a memfd it hands to every engine once, over the socket (SCM_RIGHTS), at
connection. A request's tensor is put in the arena (or already is: shared-memory inputs are read straight
into it), and the front end sends a fixed-size record naming its place, shape, datatype and deadline. The
engine views those bytes in place (no copy) and answers each request with exactly one reply record: the
output rows, or a status code and message. The arena space of a request is reused only after that reply,
so an engine never reads memory that was handed to another request.

Records are little-endian structs; every request and reply carries the request's id.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import mmap
import os
import socket
import struct
import threading
import time
import weakref
from collections import OrderedDict

import numpy as np

# kind, datatype, 2 pad, bytes that follow the record, request id, offset (in the arena; INFER_REGION: in the
# region), byte count, deadline (time.monotonic(); NaN: none), shape (N, Cin, D, H, W)
REQUEST = struct.Struct("<BB2xIQQQd5Q")
# INFER: the tensor is in the front end's arena. INFER_REGION: in a client's region, whose kind and name follow the
# record (region_trailer). CONTROL: an operation on the CUDA regions (``control_payload`` follows). CANCEL: forget one.
INFER, CANCEL, INFER_REGION, CONTROL = 1, 2, 3, 4
# kind, status code value (core.errors.Status), 2 pad, payload bytes, request id, queue ns, samples of its execution
REPLY = struct.Struct("<BB2xIQQQ")
OK, ERROR = 1, 2
# A hello is a 4-byte length and that many bytes of JSON.
HELLO_LENGTH = struct.Struct("<I")

# A record's datatype is its index in voxserve.datatypes.INPUT_DATATYPES.

ALIGN = 256  # arena blocks start on this boundary (vector copies, DMA)


class Arena:
    """A memfd of ``capacity`` bytes handed out as blocks in ring order.

    A block is a ctypes array over the mapping; it returns to the ring when the last Python object viewing
    it (numpy or torch, however derived) is gone, so its space cannot be reused while anything, the
    request in flight to an engine included, still reads it. Blocks are reclaimed oldest first: a block
    held long holds back the space after it, never corrupts it. Thread-safe (shared-memory inputs are read
    into it from worker threads).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.fd = os.memfd_create("voxserve-arena", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, capacity)  # sparse: pages exist once written
        self._map = mmap.mmap(self.fd, capacity)
        self.address = ctypes.addressof(ctypes.c_uint8.from_buffer(self._map))
        self._lock = threading.Lock()
        self._blocks: OrderedDict[int, list] = OrderedDict()  # ring start -> [size, released]
        self._head = 0  # ring position of the next block (positions grow; the offset is position % capacity)
        self._tail = 0  # ring position of the oldest block still held
        self.largest = capacity // 2  # the most one block may take: two in flight at least

    def try_allocate(self, nbytes: int) -> tuple[int, memoryview] | None:
        """(offset, writable view of nbytes) or None while the ring has no room; ValueError above ``largest``."""
        if nbytes > self.largest:
            raise ValueError(f"{nbytes} bytes is more than an arena block may hold ({self.largest})")
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            start = self._head
            if start % self.capacity + size > self.capacity:  # does not fit before the end: wrap
                start += self.capacity - start % self.capacity
            if start + size - self._tail > self.capacity:
                return None
            self._head = start + size
            self._blocks[start] = [size, False]
            if len(self._blocks) == 1:
                self._tail = start
        offset = start % self.capacity
        block = (ctypes.c_uint8 * nbytes).from_buffer(self._map, offset)
        weakref.finalize(block, self._release, start)
        return offset, memoryview(block).cast("B")

    async def allocate(self, nbytes: int) -> tuple[int, memoryview]:
        """try_allocate, waiting (politely) for room while earlier requests finish."""
        delay = 0.0002
        while True:
            got = self.try_allocate(nbytes)
            if got is not None:
                return got
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.005)

    def allocate_now(self, nbytes: int) -> memoryview:
        """A block if one is free at once, else private memory (SharedMemoryRegistry.allocate's contract)."""
        got = self.try_allocate(nbytes) if nbytes <= self.largest else None
        # Private memory: numpy's, whose release the server's budget of shared-memory copies can see.
        return got[1] if got is not None else np.empty(nbytes, np.uint8).data

    def offset_of(self, array: np.ndarray) -> int | None:
        """Where ``array`` (contiguous) lies in the arena, or None if it lies elsewhere."""
        if not array.flags.c_contiguous:
            return None
        offset = array.ctypes.data - self.address
        return offset if offset >= 0 and offset + array.nbytes <= self.capacity else None

    def _release(self, start: int) -> None:
        with self._lock:
            self._blocks[start][1] = True
            while self._blocks:
                first, (_size, released) = next(iter(self._blocks.items()))
                if not released:
                    self._tail = first
                    return
                del self._blocks[first]
            self._tail = self._head

    @property
    def in_use(self) -> int:
        """Bytes between the oldest held block and the next free position (wrap gaps included)."""
        with self._lock:
            return self._head - self._tail

    def close(self) -> None:
        os.close(self.fd)  # the mapping stays until the last block is gone


class Outbox:
    """Records for one peer, sent together once per event-loop iteration: the replies to a batch's requests
    (or the records of the requests a front end took in one iteration) go in one write and one system call,
    and the peer reads them in one wake-up. Nothing waits longer than the iteration in progress."""

    __slots__ = ("_loop", "_parts", "_writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._loop = asyncio.get_running_loop()
        self._parts: list[bytes] = []

    def put(self, record: bytes) -> None:
        if not self._parts:
            self._loop.call_soon(self._flush)
        self._parts.append(record)

    def _flush(self) -> None:
        data = b"".join(self._parts)
        self._parts.clear()
        if not self._writer.is_closing():
            self._writer.write(data)


def replies(buffer: bytearray) -> tuple[list[tuple[tuple, bytes]], int]:
    """The whole reply records at the start of ``buffer``: [(header, payload)], and the bytes they span."""
    out, pos, size = [], 0, REPLY.size
    while len(buffer) - pos >= size:
        header = REPLY.unpack_from(buffer, pos)
        end = pos + size + header[2]
        if end > len(buffer):
            break
        out.append((header, bytes(buffer[pos + size : end])))
        pos = end
    return out, pos


def requests(buffer: bytes, max_trailer: int) -> tuple[list[tuple[tuple, bytes]], int]:
    """The whole request records at the start of ``buffer``: [(fields, the bytes that follow it)], and the bytes
    they span. ValueError for a record announcing more than ``max_trailer`` bytes after it: no request has that
    many, the stream is corrupt (it cannot be resynchronized)."""
    out, pos, size, view = [], 0, REQUEST.size, memoryview(buffer)
    while len(buffer) - pos >= size:
        fields = REQUEST.unpack_from(buffer, pos)
        if fields[2] > max_trailer:
            raise ValueError(f"a request record announces {fields[2]} bytes after it, more than any request has "
                             f"({max_trailer})")
        end = pos + size + fields[2]
        if end > len(buffer):
            break
        out.append((fields, bytes(view[pos + size : end]) if fields[2] else b""))
        pos = end
    return out, pos


REGION_KINDS = {"cuda": b"c", "system": b"s"}  # an INFER_REGION trailer's first byte; the region's name follows
# ... or this byte: a CUDA region's input whose output the engine writes into a CUDA region itself; then the input
# name's length and the output's offset (RESULT), the input region's name, the output region's name.
WITH_RESULT = b"o"
RESULT = struct.Struct("<HQ")


def region_trailer(kind: str, name: str, result: tuple[str, int] | None = None) -> bytes:
    """An INFER_REGION record's trailer: the input's region (``kind``, ``name``) and, for a CUDA input, the CUDA region
    and offset its output goes to (``result``), if the engine is to write it there."""
    if result is None:
        return REGION_KINDS[kind] + name.encode()
    if kind != "cuda":
        raise ValueError("only a CUDA region's input has its output written by the engine")
    raw = name.encode()
    return WITH_RESULT + RESULT.pack(len(raw), result[1]) + raw + result[0].encode()


def parse_region(trailer: bytes) -> tuple[str, str, tuple[str, int] | None]:
    """(kind, region name, result: (output region, offset) or None) of an INFER_REGION trailer; ValueError for one
    that is not."""
    if trailer[:1] == WITH_RESULT:
        if len(trailer) < 1 + RESULT.size:
            raise ValueError("an INFER_REGION record's output region is cut short")
        length, offset = RESULT.unpack_from(trailer, 1)
        names = trailer[1 + RESULT.size:]
        if length > len(names):
            raise ValueError("an INFER_REGION record's input region name is cut short")
        return "cuda", names[:length].decode(), (names[length:].decode(), offset)
    kind = next((k for k, v in REGION_KINDS.items() if trailer[:1] == v), None)
    if kind is None:
        raise ValueError(f"an INFER_REGION record names no region kind ({trailer[:1]!r})")
    return kind, trailer[1:].decode(), None


def control_payload(operation: dict, data: bytes = b"") -> bytes:
    """A CONTROL record's trailer: the operation as length-prefixed JSON, then its bytes (an output to write)."""
    body = json.dumps(operation).encode()
    return HELLO_LENGTH.pack(len(body)) + body + data


def parse_control(payload: bytes) -> tuple[dict, bytes]:
    (length,) = HELLO_LENGTH.unpack_from(payload)
    return json.loads(payload[HELLO_LENGTH.size : HELLO_LENGTH.size + length]), payload[HELLO_LENGTH.size + length:]


def deadline_of(timeout_s: float | None) -> float:
    return float("nan") if timeout_s is None else time.monotonic() + timeout_s


def timeout_of(deadline: float) -> float | None:
    return None if deadline != deadline else deadline - time.monotonic()


def read_hello(sock: socket.socket, max_fds: int = 0) -> tuple[dict, list[int]]:
    """A length-prefixed JSON hello (and up to ``max_fds`` descriptors with it) from a blocking socket."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 65536, max_fds) if max_fds else (sock.recv(65536), [], 0, 0)
    if len(data) < HELLO_LENGTH.size:
        raise ConnectionError("the peer closed the connection during the hello")
    (length,) = HELLO_LENGTH.unpack_from(data)
    while len(data) < HELLO_LENGTH.size + length:
        more = sock.recv(65536)
        if not more:
            raise ConnectionError("the peer closed the connection during the hello")
        data += more
    return json.loads(data[HELLO_LENGTH.size : HELLO_LENGTH.size + length]), list(fds)


def hello_bytes(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return HELLO_LENGTH.pack(len(body)) + body
