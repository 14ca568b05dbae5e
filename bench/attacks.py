"""Hostile clients against a voxserve child process: what each attack costs the server (resident memory,
threads), what it does to a well-behaved client beside it, and what the attacker is told.

    python bench/attacks.py                                       # every attack; the table on stdout
    python bench/attacks.py --attacks idle-streams,metrics        # some of them
    cd /tmp && /path/to/other/venv/bin/python /work/main/bench/attacks.py --label before --out FILE

The server is ``python -m voxserve serve --device cpu`` started with this interpreter (sys.executable), a fresh
one per attack, so the script run by the interpreter of another tree's environment measures that tree's code
(run it from a directory without a voxserve/ of its own: Python puts the current directory first on the
path). Flags that only newer servers have are passed only when ``serve --help`` lists them; an attack that
needs one is skipped otherwise. Everything is loopback, and every loop is bounded in count and time.

Per attack: the server's RSS (VmRSS of its process tree, sampled every 50 ms) before, at peak and a few
seconds after; its thread count before and at peak; the good client's latency (batch-1 requests of
(1, 3, 16, 32, 32) FP32, one at a time, on a connection of its own) and its failures; the attacker's codes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import gzip
import os
import platform
import re
import selectors
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

import voxserve
from voxserve.client import AsyncClient, Client, InferenceError, build_request, build_shm_request
from voxserve.client.bench import INFER_METHOD, STREAM_METHOD
from voxserve.proto import pb
from voxserve.testing.load import ServerProcess

TREE = Path(voxserve.__file__).resolve().parents[1]  # the code under test: the tree this interpreter imports
MODEL = "voxnet"
SERVER_ARGS = ["--device", "cpu", "--grace-period-s", "1"]  # a short drain: abandoned work does not delay the next
CLIENT_MAX_BYTES = 512 * 1024 * 1024

SAMPLE_INTERVAL_S = 0.05
SAMPLE_LIMIT_S = 600.0
SETTLE_S = 2.0  # "after" is read this long after the attack ended
ATTACK_LIMIT_S = 90.0

GOOD_SHAPE = (1, 3, 16, 32, 32)
GOOD_TIMEOUT_S = 5.0
GOOD_INTERVAL_S = 0.05  # at most 20 requests a second: a client that does not add load of its own
GOOD_MAX_REQUESTS = 10_000
GOOD_MIN_S = 3.0  # the good client runs at least this long, even when the attack is refused at once

HOLD_S = 3.0  # how long idle streams, unread responses and half-sent scrapes are held
BIG_TIMEOUT_S = 6.0  # the deadline of the attacker's large requests

IDLE_CONNECTIONS, IDLE_PER_CONNECTION = 4, 64
BOMB_SHAPE, BOMB_REQUESTS = (32, 3, 64, 64, 64), 4  # 32 * 3 * 64**3 * 4 bytes = 96 MiB of zeros
ID_CLIENTS, ID_CHARS = 8, 50_000_000
SHM_SHAPE, SHM_REQUESTS = (1024, 3, 32, 32, 32), 12  # 384 MiB a request
CHURN_CLIENTS, CHURN_S, CHURN_BYTES = 8, 6.0, 1 << 20  # registration churn: clients, seconds, segment size
HOL_SHAPE, HOL_REQUESTS = (512, 3, 16, 32, 32), 3  # 96 MiB a request
STORM_REQUESTS, STORM_CONCURRENCY, STORM_TIMEOUT_S = 1000, 50, 0.1
HTTP_CONNECTIONS = 800
HTTP_PARTIAL = b"GET /metrics HTTP/1.1\r\n"
HTTP_HOLD_S = 8.0  # the old server accepts a backlog of 5 at a time: its threads take seconds to pile up
SPREAD_CONNECTIONS = 32  # one slot each: the server runs with --max-concurrent-rpcs 32
SPREAD_FLAGS = ["--max-concurrent-rpcs", str(SPREAD_CONNECTIONS), "--max-streams-per-connection", "8"]
SPREAD_SERVER = f"server with {' '.join(SPREAD_FLAGS)}"
TRICKLE_S = 0.05  # a slow body's pace: a byte this often
HELD = "held (cancelled by the attacker)"
NEVER_OPENED = "never opened (waited on the client's side)"


def channel_options() -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", CLIENT_MAX_BYTES), ("grpc.max_send_message_length", CLIENT_MAX_BYTES),
            ("grpc.use_local_subchannel_pool", 1)]  # a connection of its own per channel


def server_flags() -> str:
    """The server's `serve --help`, to find which flags this tree's server accepts."""
    return subprocess.run([sys.executable, "-m", "voxserve", "serve", "--help"], capture_output=True, text=True,
                          timeout=60, check=True).stdout


def git_state(tree: Path) -> str:
    """The tree's short commit, with "+ uncommitted changes (paths)" when git status lists a changed tracked
    file, "+ untracked files (paths)" when it lists only untracked ones."""
    try:
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=30, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(tree), "status", "--porcelain"], capture_output=True, text=True,
                                timeout=30, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown commit (not a git tree)"
    if not status:
        return commit
    paths = [line[3:] for line in status]
    shown = ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
    if all(line.startswith("??") for line in status):
        return f"{commit} + untracked files ({shown})"
    return f"{commit} + uncommitted changes ({shown})"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


# --- what the server uses -------------------------------------------------------------------------------------


def _tree_usage(pids: list[int]) -> tuple[float, int]:
    """VmRSS (MB) and Threads of the given processes, added up; a process gone meanwhile counts 0."""
    rss_kb = threads = 0
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                rss_kb += int(line.split()[1])
            elif line.startswith("Threads:"):
                threads += int(line.split()[1])
    return rss_kb / 1024, threads


class Sampler:
    """The server's RSS and thread count every SAMPLE_INTERVAL_S, on a thread, as (time, MB, threads)."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.samples: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + SAMPLE_LIMIT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            rss, threads = _tree_usage(self.server.pids())
            self.samples.append((time.monotonic(), rss, threads))
            self._stop.wait(SAMPLE_INTERVAL_S)

    def now(self) -> tuple[float, int]:
        """A fresh reading (MB, threads)."""
        return _tree_usage(self.server.pids())

    def peak(self, since: float) -> tuple[float, int]:
        window = [s for s in self.samples if s[0] >= since]
        return max((s[1] for s in window), default=0.0), max((s[2] for s in window), default=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def scrape(server: ServerProcess, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=timeout_s) as r:
        return r.read().decode()


_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")


def metric_values(text: str, name: str, key: str) -> Counter:
    """{label ``key``'s value: sample value} of metric ``name`` in a Prometheus text exposition."""
    values: Counter = Counter()
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            values[labels.get(key, "")] += int(float(m.group(3)))
    return values


async def wait_inflight(server: ServerProcess, predicate: Callable[[int], bool], limit_s: float) -> int:
    """Poll voxserve_inflight_requests until ``predicate`` holds or ``limit_s`` passes; the last value read."""
    deadline = time.monotonic() + limit_s
    value = -1
    while time.monotonic() < deadline:
        try:
            text = await asyncio.to_thread(scrape, server, 2.0)
            value = sum(metric_values(text, "voxserve_inflight_requests", "model").values())
        except OSError:
            pass
        if predicate(value):
            break
        await asyncio.sleep(0.05)
    return value


# --- the well-behaved client ----------------------------------------------------------------------------------


class GoodClient:
    """Batch-1 FP32 requests, one at a time and at most one per GOOD_INTERVAL_S, on a connection of its own."""

    def __init__(self, url: str) -> None:
        self.channel = grpc.insecure_channel(url, options=channel_options())
        self.call = self.channel.unary_unary(INFER_METHOD)
        x = np.random.default_rng(0).standard_normal(GOOD_SHAPE, dtype=np.float32)
        self.body = build_request(x, MODEL, "FP32").SerializeToString()
        self.codes: Counter = Counter()
        self.latencies_s: list[float] = []
        self.began: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.call(self.body, timeout=30, wait_for_ready=True)  # connected and warm; not counted

    def begin(self) -> None:
        if self.began is None:
            self.began = time.monotonic()
            self._thread.start()

    def end(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(GOOD_TIMEOUT_S + 5)

    def close(self) -> None:
        self.end()
        self.channel.close()

    def _run(self) -> None:
        for _ in range(GOOD_MAX_REQUESTS):
            if self._stop.is_set():
                return
            t0 = time.perf_counter()
            try:
                self.call(self.body, timeout=GOOD_TIMEOUT_S)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            elapsed = time.perf_counter() - t0
            self.codes[code] += 1
            if code == "OK":
                self.latencies_s.append(elapsed)
            self._stop.wait(max(0.0, GOOD_INTERVAL_S - elapsed))

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q)) * 1e3 if self.latencies_s else float("nan")


# --- the attacks ----------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    codes: Counter = field(default_factory=Counter)  # what the attacker was told
    notes: list[str] = field(default_factory=list)


async def unary(call, body: bytes, timeout_s: float, compression=None, details: Counter | None = None) -> str:
    """One call's final code; ``details`` counts the (code, message) of a failure."""
    try:
        await call(body, timeout=timeout_s, compression=compression)
        return "OK"
    except grpc.RpcError as exc:
        if details is not None:
            details[(exc.code().name, exc.details() or "")] += 1
        return exc.code().name


def _reply_code(data: bytes) -> str:
    """What an HTTP attacker was told: the reply's protocol and status ("HTTP/1.1 503"), or that none came."""
    return " ".join(data.split(b"\r\n")[0].decode("latin-1").split()[:2]) if data else "closed, no reply"


def aio_channel(server: ServerProcess) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(server.url, options=channel_options())


async def idle_streams(server: ServerProcess, good: GoodClient, connections: int = IDLE_CONNECTIONS,
                       per_connection: int = IDLE_PER_CONNECTION) -> Outcome:
    out = Outcome()
    channels = [aio_channel(server) for _ in range(connections)]
    try:
        calls = [ch.stream_stream(STREAM_METHOD)(timeout=HOLD_S + 30) for ch in channels
                 for _ in range(per_connection)]
        # A stream over the server's per-connection limit waits on the client's side: it never opens.
        waits = [asyncio.ensure_future(c.wait_for_connection()) for c in calls]
        done, pending = await asyncio.wait(waits, timeout=5)
        for w in pending:
            w.cancel()
        opened = sum(1 for w in done if w.exception() is None)
        out.notes.append(f"{opened} of {len(calls)} streams opened within 5 s")
        good.begin()
        await asyncio.sleep(HOLD_S)
        for c, w in zip(calls, waits, strict=True):
            if c.done():
                out.codes[(await c.code()).name] += 1
            else:
                out.codes[HELD if w in done else NEVER_OPENED] += 1
                c.cancel()
    finally:
        for ch in channels:
            await ch.close()
    return out


async def spread_calls(server: ServerProcess, good: GoodClient,
                       open_call: Callable[[grpc.aio.Channel], object]) -> Outcome:
    """One call of ``open_call``'s on each of SPREAD_CONNECTIONS connections for HOLD_S, each opened again (on its
    connection) as soon as it ends: a persistent attacker. The codes are those of the calls that ended."""
    out = Outcome()
    channels = [aio_channel(server) for _ in range(SPREAD_CONNECTIONS)]
    deadline = time.monotonic() + 0.5 + HOLD_S

    async def hold(channel: grpc.aio.Channel) -> None:
        while time.monotonic() < deadline:
            call = open_call(channel)
            try:
                await asyncio.wait_for(asyncio.shield(call.code()), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                out.codes[HELD] += 1
                call.cancel()
                return
            out.codes[(await call.code()).name] += 1
            await asyncio.sleep(0.01)

    try:
        holders = [asyncio.ensure_future(hold(ch)) for ch in channels]
        await asyncio.sleep(0.5)
        good.begin()
        await asyncio.gather(*holders)
    finally:
        for ch in channels:
            await ch.close()
    return out


async def _silence():
    await asyncio.Event().wait()
    yield b""  # pragma: no cover - never reached


def idle_stream(channel: grpc.aio.Channel):
    return channel.stream_stream(STREAM_METHOD)(_silence())


def silent_infer(channel: grpc.aio.Channel):
    return channel.stream_unary(INFER_METHOD)(_silence())


async def slow_bodies(server: ServerProcess, good: GoodClient) -> Outcome:
    """A REST inference request on each of SPREAD_CONNECTIONS connections whose body arrives a byte every TRICKLE_S
    (never idle for long, far slower than any real body), each sent again on a new connection once answered."""
    out = Outcome()
    head = (f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{{").encode()

    def begun() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", server.http_port))
        s.sendall(head)
        s.setblocking(False)
        return s

    def attack() -> None:
        socks = [begun() for _ in range(SPREAD_CONNECTIONS)]
        try:
            time.sleep(0.5)
            good.begin()
            deadline = time.monotonic() + HOLD_S
            while time.monotonic() < deadline:
                for i, s in enumerate(socks):
                    try:
                        data = s.recv(64)
                    except BlockingIOError:  # not answered: a byte more
                        with contextlib.suppress(OSError):
                            s.send(b" ")
                        continue
                    except OSError:
                        data = b""
                    out.codes[_reply_code(data)] += 1
                    s.close()
                    socks[i] = begun()
                time.sleep(TRICKLE_S)
            out.codes[HELD] += len(socks)
        finally:
            for s in socks:
                s.close()

    await asyncio.to_thread(attack)
    return out


async def compression_bomb(server: ServerProcess, good: GoodClient) -> Outcome:
    out = Outcome()
    body = build_request(np.zeros(BOMB_SHAPE, np.float32), MODEL, "FP32").SerializeToString()
    out.notes.append(f"{BOMB_REQUESTS} x {len(body) / 2**20:.0f} MiB, about {len(gzip.compress(body)) / 1024:.0f} KiB "
                     f"each gzipped")
    async with aio_channel(server) as ch:
        call = ch.unary_unary(INFER_METHOD)
        tasks = [asyncio.create_task(unary(call, body, BIG_TIMEOUT_S, grpc.Compression.Gzip))
                 for _ in range(BOMB_REQUESTS)]
        good.begin()
        out.codes.update(await asyncio.gather(*tasks))
    return out


async def huge_request_id(server: ServerProcess, good: GoodClient) -> Outcome:
    return await asyncio.to_thread(_huge_request_id, server, good)


def _huge_request_id(server: ServerProcess, good: GoodClient) -> Outcome:
    """Blocking gRPC: its streams send from a thread each, and a status the server sends while the client is still
    writing stays the server's (grpc.aio reports such a call as INTERNAL "Internal error from Core")."""
    out = Outcome()
    x = np.zeros(GOOD_SHAPE, np.float32)
    body = build_request(x, MODEL, "FP32", request_id="i" * ID_CHARS).SerializeToString()
    out.notes.append(f"{ID_CLIENTS} streams on {ID_CLIENTS} connections, half gzip, half uncompressed; "
                     f"{len(body) / 1e6:.0f} MB each, responses unread for {HOLD_S:.0f} s")
    release = threading.Event()

    def requests():
        yield body
        release.wait(HOLD_S + 10)  # the stream stays open, its one request sent, until the attacker reads

    channels = [grpc.insecure_channel(server.url, options=channel_options()) for _ in range(ID_CLIENTS)]
    try:
        calls = [ch.stream_stream(STREAM_METHOD)(requests(), timeout=HOLD_S + 10,
                                                 compression=grpc.Compression.Gzip if i % 2 == 0 else None)
                 for i, ch in enumerate(channels)]
        good.begin()
        time.sleep(HOLD_S)
        details: Counter = Counter()
        for i, c in enumerate(calls):  # each read is bounded by its call's deadline
            label = "gzip" if i % 2 == 0 else "plain"
            try:
                response = pb.ModelStreamInferResponse.FromString(next(c))
                code = response.error_message.split(":", 1)[0] if response.error_message else "OK"
            except StopIteration:
                code = c.code().name
            except grpc.RpcError as exc:
                code = exc.code().name
                details[(code, exc.details() or "")] += 1
            out.codes[f"{label} {code}"] += 1
        for (code, message), n in sorted(details.items()):
            out.notes.append(f"{code} {n}: {message!r}")
        release.set()
        for c in calls:
            c.cancel()
    finally:
        release.set()
        for ch in channels:
            ch.close()
    return out


async def shared_memory(server: ServerProcess, good: GoodClient) -> Outcome:
    out = Outcome()
    size = int(np.prod(SHM_SHAPE)) * 4
    name = f"voxserve-attack-{os.getpid()}"
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)  # sparse: the segment costs the client nothing, the server's copies do
        os.close(fd)
        with Client(server.url, timeout_s=10) as c:
            c.register_system_shared_memory("attack", "/" + name, size)
        body = build_shm_request(SHM_SHAPE, MODEL, "FP32", "attack").SerializeToString()
        out.notes.append(f"{SHM_REQUESTS} x {size / 2**20:.0f} MiB from one sparse segment")
        async with aio_channel(server) as ch:
            call = ch.unary_unary(INFER_METHOD)
            tasks = [asyncio.create_task(unary(call, body, BIG_TIMEOUT_S)) for _ in range(SHM_REQUESTS)]
            good.begin()
            out.codes.update(await asyncio.gather(*tasks))
    finally:
        try:
            with Client(server.url, timeout_s=10) as c:
                c.unregister_system_shared_memory("attack")
        except Exception as exc:  # the server may be gone: the segment goes anyway
            out.notes.append(f"unregister failed: {exc}")
        path.unlink(missing_ok=True)
    return out


async def no_attack(server: ServerProcess, good: GoodClient) -> Outcome:
    """The good client alone, for the other rows' latencies to be read against."""
    good.begin()
    await asyncio.sleep(GOOD_MIN_S)
    return Outcome()


async def registration_churn(server: ServerProcess, good: GoodClient) -> Outcome:
    """Clients registering and unregistering a region as fast as the server answers: the control plane's cost."""
    out = Outcome()
    name = f"voxserve-churn-{os.getpid()}"
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)

    async def churn(i: int) -> None:
        async with AsyncClient(server.url, timeout_s=10) as c:
            end = time.monotonic() + CHURN_S
            while time.monotonic() < end:
                try:
                    await c.register_system_shared_memory(f"churn-{i}", "/" + name, CHURN_BYTES)
                    out.codes["OK"] += 1
                except InferenceError as exc:
                    out.codes[exc.code.name] += 1
                finally:  # also after a failure: a region left registered would fail every later round
                    with contextlib.suppress(InferenceError):
                        await c.unregister_system_shared_memory(f"churn-{i}")

    try:
        os.ftruncate(fd, CHURN_BYTES)
        os.close(fd)
        good.begin()
        await asyncio.gather(*(churn(i) for i in range(CHURN_CLIENTS)))
        out.notes.append(f"{CHURN_CLIENTS} clients, each registering and unregistering its own region of one "
                         f"{CHURN_BYTES >> 20} MiB segment for {CHURN_S:.0f} s: {out.codes['OK']} rounds "
                         f"({out.codes['OK'] / CHURN_S:.0f} a second)")
    finally:
        path.unlink(missing_ok=True)
    return out


async def head_of_line(server: ServerProcess, good: GoodClient) -> Outcome:
    out = Outcome()
    body = build_request(np.zeros(HOL_SHAPE, np.float32), MODEL, "FP32").SerializeToString()
    async with aio_channel(server) as ch:
        call = ch.unary_unary(INFER_METHOD)
        tasks = [asyncio.create_task(unary(call, body, BIG_TIMEOUT_S)) for _ in range(HOL_REQUESTS)]
        seen = await wait_inflight(server, lambda n: n >= HOL_REQUESTS, 5.0)
        out.notes.append(f"{HOL_REQUESTS} x {len(body) / 2**20:.0f} MiB; {seen} in flight when the good client began")
        good.begin()
        out.codes.update(await asyncio.gather(*tasks))
    return out


async def deadline_storm(server: ServerProcess, good: GoodClient) -> Outcome:
    out = Outcome()
    before = metric_values(await asyncio.to_thread(scrape, server), "voxserve_requests_total", "code")
    body = good.body
    todo = iter(range(STORM_REQUESTS))
    details: Counter = Counter()
    async with aio_channel(server) as ch:
        call = ch.unary_unary(INFER_METHOD)

        async def worker() -> None:
            for _ in todo:
                out.codes[await unary(call, body, STORM_TIMEOUT_S, details=details)] += 1

        good.begin()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(STORM_CONCURRENCY))), 60)
    await asyncio.to_thread(good.end)  # its requests too must be over before the second scrape
    left = await wait_inflight(server, lambda n: n == 0, 10.0)
    after = metric_values(await asyncio.to_thread(scrape, server), "voxserve_requests_total", "code")
    server_counts = Counter({k: after[k] - before[k] for k in after if after[k] - before[k]})
    client_counts = out.codes + good.codes
    out.notes.append(f"server voxserve_requests_total difference: {_codes(server_counts)}; clients (storm + good "
                     f"client): {_codes(client_counts)}; match: {'yes' if server_counts == client_counts else 'NO'}"
                     + (f" ({left} still in flight)" if left else ""))
    for (code, message), n in sorted(details.items()):
        if code != "DEADLINE_EXCEEDED":
            out.notes.append(f"storm {code} {n}: {message!r}")
    return out


async def metrics_half_sent(server: ServerProcess, good: GoodClient) -> Outcome:
    out = Outcome()

    def attack() -> None:
        address = ("127.0.0.1", server.metrics_port)
        sel = selectors.DefaultSelector()
        socks: list[socket.socket] = []
        connected: list[socket.socket] = []
        try:
            for _ in range(HTTP_CONNECTIONS):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(address)
                socks.append(s)
                sel.register(s, selectors.EVENT_WRITE)
            deadline = time.monotonic() + 5
            pending = len(socks)
            while pending and time.monotonic() < deadline:
                for key, _ in sel.select(0.1):
                    s = key.fileobj
                    sel.unregister(s)
                    pending -= 1
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        try:
                            s.send(HTTP_PARTIAL)
                            connected.append(s)
                        except OSError:
                            out.codes["reset before the request line"] += 1
                    else:
                        out.codes["connect failed"] += 1
            if pending:
                out.codes["connect timed out (5 s)"] += pending
            good.begin()
            t0 = time.monotonic()
            time.sleep(1.0)
            threads_early = _tree_usage(server.pids())[1]
            out.notes.append("scrape during: " + _timed_scrape(server))
            time.sleep(max(0.0, t0 + HTTP_HOLD_S - time.monotonic()))
            out.notes.append(f"server threads 1 s into the hold {threads_early}, at its end "
                             f"({HTTP_HOLD_S:.0f} s) {_tree_usage(server.pids())[1]}")
            for s in connected:
                try:
                    data = s.recv(64)
                except BlockingIOError:
                    out.codes["open, no reply"] += 1
                    continue
                except OSError:
                    out.codes["reset"] += 1
                    continue
                out.codes[_reply_code(data)] += 1
        finally:
            sel.close()
            for s in socks:
                s.close()
        time.sleep(1.0)
        out.notes.append("scrape 1 s after closing them: " + _timed_scrape(server))

    await asyncio.to_thread(attack)
    return out


def _timed_scrape(server: ServerProcess) -> str:
    t0 = time.perf_counter()
    try:
        text = scrape(server)
        ok = "voxserve_requests_total" in text or "voxserve_model_ready" in text
        return f"{'200' if ok else '200 without voxserve metrics'} in {(time.perf_counter() - t0) * 1e3:.0f} ms"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code} in {(time.perf_counter() - t0) * 1e3:.0f} ms"
    except OSError as exc:
        return f"failed after {(time.perf_counter() - t0) * 1e3:.0f} ms ({type(exc).__name__}: {exc})"


@dataclass
class Attack:
    key: str
    title: str
    run: Callable[[ServerProcess, GoodClient], Awaitable[Outcome]]
    flags: list[str] = field(default_factory=list)  # server flags beyond SERVER_ARGS (only newer servers have them)


ATTACKS = [
    Attack("none", "0 none (the good client alone)", no_attack),
    Attack("idle-streams", f"1 idle streams ({IDLE_CONNECTIONS} x {IDLE_PER_CONNECTION}, {HOLD_S:.0f} s)",
           idle_streams),
    Attack("idle-streams-one-connection", f"1b idle streams on one connection (1 x "
           f"{IDLE_CONNECTIONS * IDLE_PER_CONNECTION}, {HOLD_S:.0f} s)",
           functools.partial(idle_streams, connections=1, per_connection=IDLE_CONNECTIONS * IDLE_PER_CONNECTION)),
    Attack("idle-streams-timeout", "1c idle streams (as 1), server with --stream-idle-timeout-s 1", idle_streams,
           ["--stream-idle-timeout-s", "1"]),
    Attack("idle-streams-spread", f"1d idle streams one per connection, reopened when ended ({SPREAD_CONNECTIONS} x "
           f"1, {HOLD_S:.0f} s), " + SPREAD_SERVER, functools.partial(spread_calls, open_call=idle_stream),
           SPREAD_FLAGS),
    Attack("silent-infer", f"1e ModelInfer without its message, one per connection, reopened when ended "
           f"({SPREAD_CONNECTIONS} x 1, {HOLD_S:.0f} s), " + SPREAD_SERVER,
           functools.partial(spread_calls, open_call=silent_infer), SPREAD_FLAGS),
    Attack("slow-bodies", f"1f REST bodies a byte every {TRICKLE_S * 1e3:.0f} ms, one per connection, sent again "
           f"when answered ({SPREAD_CONNECTIONS} x 1, {HOLD_S:.0f} s), " + SPREAD_SERVER, slow_bodies, SPREAD_FLAGS),
    Attack("compression-bomb", f"2 compression bomb ({BOMB_REQUESTS} x 96 MiB zeros, gzip)", compression_bomb),
    Attack("compression-bomb-accepted", "2b compression bomb, server with --grpc-compression", compression_bomb,
           ["--grpc-compression"]),
    Attack("huge-id", f"3 huge request id ({ID_CLIENTS} x {ID_CHARS // 1_000_000} MB id, unread)", huge_request_id),
    Attack("huge-id-accepted", "3b huge request id, server with --grpc-compression", huge_request_id,
           ["--grpc-compression"]),
    Attack("shared-memory", f"4 shared memory ({SHM_REQUESTS} x {SHM_SHAPE})", shared_memory),
    Attack("registration-churn", f"4b shared-memory registration churn ({CHURN_CLIENTS} clients, {CHURN_S:.0f} s)",
           registration_churn),
    Attack("head-of-line", f"5 head-of-line ({HOL_REQUESTS} x {HOL_SHAPE})", head_of_line),
    Attack("deadline-storm", f"6 deadline storm ({STORM_REQUESTS} x {STORM_TIMEOUT_S * 1e3:.0f} ms deadline, "
           f"{STORM_CONCURRENCY} at once)", deadline_storm),
    Attack("metrics", f"7 /metrics half-sent ({HTTP_CONNECTIONS} connections)", metrics_half_sent),
]


@dataclass
class Result:
    attack: Attack
    rss: tuple[float, float, float] = (0.0, 0.0, 0.0)  # before, peak, after (MB)
    threads: tuple[int, int] = (0, 0)  # before, peak
    good: GoodClient | None = None
    outcome: Outcome = field(default_factory=Outcome)
    skipped: str = ""


def run_attack(attack: Attack) -> Result:
    result = Result(attack)
    try:
        server = ServerProcess([*SERVER_ARGS, *attack.flags])
    except (RuntimeError, TimeoutError) as exc:
        result.skipped = f"the server did not start: {str(exc).splitlines()[0]}"
        return result
    with server:
        sampler = Sampler(server)
        try:
            good = GoodClient(server.url)
        except grpc.RpcError as exc:
            sampler.stop()
            result.skipped = f"the good client's first request failed: {exc.code().name}"
            return result
        result.good = good
        try:
            time.sleep(0.5)  # idle readings once the good client's connection is up
            rss_before, threads_before = sampler.now()
            t0 = time.monotonic()
            try:
                result.outcome = asyncio.run(asyncio.wait_for(attack.run(server, good), ATTACK_LIMIT_S))
            except Exception as exc:
                result.outcome.notes.append(f"the attack stopped: {type(exc).__name__}: {exc}")
            if good.began is not None:
                time.sleep(max(0.0, good.began + GOOD_MIN_S - time.monotonic()))
            good.end()
            time.sleep(SETTLE_S)
            rss_after, _ = sampler.now()
            rss_peak, threads_peak = sampler.peak(t0)
            result.rss = (rss_before, rss_peak, rss_after)
            result.threads = (threads_before, threads_peak)
            if not server.alive():
                result.outcome.notes.append(f"**the server exited** with code {server.proc.returncode}; last log: "
                                            + " / ".join(server.log_text().strip().splitlines()[-2:])[-300:])
        finally:
            good.close()
            sampler.stop()
            server.close(10)
    return result


def _codes(counts: Counter) -> str:
    return ", ".join(f"{code} {n}" for code, n in sorted(counts.items())) or "none"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _ms(value: float) -> str:
    return "-" if np.isnan(value) else f"{value:.0f}"


def table(results: list[Result], label: str) -> list[str]:
    lines = ["| attack | version | server RSS MB before / peak / after | threads before / peak | good client p50 / "
             "p99 ms | good client answers | attacker codes | notes |",
             "|---|---|---:|---:|---:|---|---|---|"]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.attack.title} | {label} | | | | | | not run: {r.skipped} |")
            continue
        g = r.good
        assert g is not None
        lines.append(f"| {r.attack.title} | {label} | {r.rss[0]:.0f} / {r.rss[1]:.0f} / {r.rss[2]:.0f} | "
                     f"{r.threads[0]} / {r.threads[1]} | {_ms(g.percentile_ms(50))} / {_ms(g.percentile_ms(99))} | "
                     f"{_codes(g.codes)} | {_cell(_codes(r.outcome.codes))} | {_cell('; '.join(r.outcome.notes))} |")
    return lines


def render(results: list[Result], label: str, elapsed_s: float, load: tuple[float, float, float]) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = f"cd {shlex.quote(os.getcwd())} && {shlex.join([sys.executable, *sys.argv])}"
    lines = [
        f"## Hostile clients: {label} ({now})",
        "",
        f"- date: {now}; machine: {platform.node() or 'unknown'}, {os.cpu_count()} cores, {cpu_model()}; "
        f"CPython {platform.python_version()}; load average at the start {load[0]:.1f} (1 min), {load[1]:.1f} (5 min)",
        f"- code: {TREE} at {git_state(TREE)}",
        f"- command: `{command}` ({elapsed_s:.0f} s)",
        f"- server: `python -m voxserve serve {shlex.join(SERVER_ARGS)}` on loopback, a fresh child process per "
        f"attack; RSS and threads of its process tree from /proc every {SAMPLE_INTERVAL_S * 1e3:.0f} ms, "
        f"\"after\" {SETTLE_S:.0f} s after the attack ended",
        f"- good client: {GOOD_SHAPE} FP32 requests one at a time (at most one per "
        f"{GOOD_INTERVAL_S * 1e3:.0f} ms, {GOOD_TIMEOUT_S:.0f} s deadline) on a connection of its own while the "
        f"attack runs (at least {GOOD_MIN_S:.0f} s); latency of its OK answers; the attacker's large requests "
        f"have a {BIG_TIMEOUT_S:.0f} s deadline; client and server share the machine's cores",
        "",
        *table(results, label),
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default="all",
                        help=f"comma-separated, of: {', '.join(a.key for a in ATTACKS)} (default: all)")
    parser.add_argument("--label", default="", help="the version's name in the table (default: the tree's path)")
    parser.add_argument("--out", default="", help="append the results as a markdown section to this file")
    args = parser.parse_args(argv)
    keys = [a.key for a in ATTACKS] if args.attacks == "all" else args.attacks.split(",")
    unknown = set(keys) - {a.key for a in ATTACKS}
    if unknown:
        parser.error(f"unknown attacks: {', '.join(sorted(unknown))}")
    label = args.label or str(TREE)
    help_text = server_flags()
    load = os.getloadavg()
    t0 = time.perf_counter()
    results = []
    for attack in (a for a in ATTACKS if a.key in keys):
        missing = [f for f in attack.flags if f.startswith("--") and f not in help_text]
        if missing:
            results.append(Result(attack, skipped=f"this server has no {', '.join(missing)}"))
            continue
        print(f"{attack.title} ...", file=sys.stderr, flush=True)
        results.append(run_attack(attack))
    text = render(results, label, time.perf_counter() - t0, load)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
