"""System shared memory read in place (a GPU server's path, server/protocol/shm.py with a page-locker): the
registry's mapping, bounds, re-checks, deferred unlock, budget and fallback, with a fake page-locker
(voxserve/testing/fake_hostmem.py), and the pipeline's DMA-only ranges. No GPU needed: the mapping is real, only
the page-lock is faked. Tests never read a view after its segment was truncated (that is the SIGBUS the server
avoids by only DMAing such views)."""

from __future__ import annotations

import builtins
import contextlib
import gc
import logging
import os
import threading
import time
import uuid
import weakref

import grpc
import numpy as np
import pytest
import torch

from voxserve.client import Client, InferenceError
from voxserve.kernels import reference_float64, reference_weights
from voxserve.server.core.errors import ServingError, Status
from voxserve.server.core.leases import Releases
from voxserve.server.core.model import relative_error
from voxserve.server.protocol import shm
from voxserve.server.protocol.shm import SharedMemoryRegistry
from voxserve.testing.fake_hostmem import FakePageLocker

from ..conftest import running_server
from ..records import as_in_one_tick

W, B = reference_weights()
SHAPE = (2, 3, 5, 6, 7)


@contextlib.contextmanager
def _segment(data: bytes):
    """A segment under /dev/shm, as (key, path); removed at the end."""
    name = f"vox_ip_{uuid.uuid4().hex[:10]}"
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.write(data)
    try:
        yield "/" + name, path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _registry(**kw) -> tuple[SharedMemoryRegistry, FakePageLocker]:
    locker = FakePageLocker(**{k: kw.pop(k) for k in ("limit_bytes", "read_only_supported") if k in kw})
    return SharedMemoryRegistry(locker=locker, **kw), locker


def _eventually(condition, timeout_s: float = 10.0) -> bool:
    """Whether ``condition()`` holds within ``timeout_s``: a server thread lets go of a request's tensor just after
    its answer is sent."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return bool(condition())


def _refused(fn) -> ServingError:
    with pytest.raises(ServingError) as err:
        fn()
    return err.value


DATA = np.random.default_rng(7).integers(0, 256, 3 * 4096 + 123, dtype=np.uint8)


def test_an_input_is_a_read_only_view_of_the_locked_mapping_not_a_copy():
    registry, locker = _registry()
    with _segment(DATA.tobytes()) as (key, _):
        registry.register("r", key, 100, 9000)  # an offset that is no page boundary
        view, lease = registry.pinned("r", 16, 5000, "input 'x'")
        assert view.dtype == np.uint8 and not view.flags.writeable
        assert np.array_equal(view, DATA[116:5116])
        # The registered span's pages (from the page it starts in), read-only, locked once.
        assert list(locker.locked.values()) == [(9100, True)]
        assert registry.pinned_bytes == 9100
        data = registry.read("r", 0, 9000, "input 'x'")  # what codec.decode_request calls
        assert np.array_equal(np.frombuffer(data, np.uint8), DATA[100:9100])
        assert registry.copies == 0 and registry.in_place_reads == 2 and registry.in_place_bytes == 14000
        assert registry.in_place(view[10:]) and registry.in_place(np.frombuffer(data, np.uint8))
        assert not registry.in_place(DATA) and not registry.in_place(b"bytes")
        assert locker.locks == 1  # one mapping per region and process, however many reads
        lease.release()
        del view, data
        registry.unregister("r")
        assert locker.locked == {} and locker.unlocks == 1 and registry.pinned_bytes == 0
    registry.close()


def test_slices_outside_the_region_and_unknown_names_are_refused():
    registry, locker = _registry()
    with _segment(DATA.tobytes()) as (key, _):
        registry.register("r", key, 0, 4096)
        for offset, size in ((0, 4097), (4000, 100), (-1, 10), (10, -1)):
            err = _refused(lambda o=offset, s=size: registry.pinned("r", o, s, "input 'x'"))
            assert err.code == Status.INVALID_ARGUMENT and "outside region 'r'" in err.message, err.message
        assert _refused(lambda: registry.pinned("nope", 0, 1, "input 'x'")).code == Status.NOT_FOUND
        assert locker.locks == 0  # nothing mapped for a refused slice
    registry.close()


def test_a_truncated_or_recreated_segment_is_refused_and_its_pages_stay_locked_till_unregistered():
    registry, locker = _registry()
    with _segment(DATA.tobytes()) as (key, path), _segment(DATA.tobytes()) as (other_key, _):
        registry.register("r", key, 0, 8192)
        registry.register("other", other_key, 0, 8192)
        view = registry.pinned("r", 0, 8192, "input 'x'")[0]
        del view  # not read again: the segment is about to shrink
        os.truncate(path, 100)
        err = _refused(lambda: registry.read("r", 0, 8192, "input 'x'"))
        assert err.code == Status.INVALID_ARGUMENT and "now smaller than region 'r'" in err.message, err.message
        assert locker.locked_bytes == 8192  # the pages the DMA would read stay locked, and counted
        ok = registry.read("other", 0, 8192, "input 'x'")  # another client is served
        assert np.array_equal(np.frombuffer(ok, np.uint8), DATA[:8192])
        os.truncate(path, DATA.nbytes)  # grown back: the same file, served again (the client's new bytes)
        assert registry.pinned("r", 0, 10, "input 'x'") is not None
        os.unlink(path)
        with open(path, "wb") as f:  # recreated: another file under the name
            f.write(DATA.tobytes())
        err = _refused(lambda: registry.read("r", 0, 10, "input 'x'"))
        assert err.code == Status.INVALID_ARGUMENT and "was recreated" in err.message, err.message
        gc.collect()
        registry.unregister("r")
        registry.register("r", key, 0, 8192)
        view = registry.pinned("r", 0, 8192, "input 'x'")[0]
        assert np.array_equal(view, DATA[:8192])
        del view, ok
    registry.close()
    assert locker.locked == {}


def test_a_segment_shrunk_before_its_first_use_is_refused_and_locked_once_whole_again():
    registry, locker = _registry()
    with _segment(DATA.tobytes()) as (key, path):
        registry.register("r", key, 0, 8192)
        os.truncate(path, 5000)  # the slice asked for is there, the region's end is not: its pages cannot be locked
        err = _refused(lambda: registry.read("r", 0, 100, "input 'x'"))
        assert err.code == Status.INVALID_ARGUMENT and "now smaller than region 'r'" in err.message, err.message
        assert locker.locks == 0 and registry.copies == 0
        os.truncate(path, 8192)
        assert registry.pinned("r", 0, 100, "input 'x'") is not None and locker.locks == 1
    registry.close()


def test_unregister_while_a_request_reads_the_region_is_deferred_and_counted():
    registry, locker = _registry(max_total_bytes=12000)
    with _segment(DATA.tobytes()) as (key, _):
        registry.register("r", key, 0, 8192)
        view, lease = registry.pinned("r", 0, 4096, "input 'x'")
        piece = np.frombuffer(view.data, np.float32)[256:]  # a request's tensor, sliced by the batcher
        held = weakref.ref(lease)
        del view, lease  # the tensor holds the lease, as a request's does
        registry.unregister("r")
        assert _refused(lambda: registry.status("r")).code == Status.NOT_FOUND  # the name is free at once
        assert locker.locked_bytes == 8192 and registry.draining == 1  # the mapping is not
        assert np.array_equal(piece.view(np.uint8), DATA[1024:4096])
        # Still locked: it counts against --max-shm-bytes until the last reader is gone.
        err = _refused(lambda: registry.register("r", key, 0, 8192))
        assert err.code == Status.RESOURCE_EXHAUSTED and "--max-shm-bytes" in err.message, err.message
        assert held() is not None
        del piece  # the last reference: its finalizer ends the lease
        gc.collect()
        assert held() is None and registry.draining == 0 and locker.locked == {} and locker.unlocks == 1
        registry.register("r", key, 0, 8192)
        _, lease2 = registry.pinned("r", 0, 8192, "input 'x'")
        lease2.release()  # released explicitly (a request's end), its view dropped later
        registry.unregister("r")
        assert locker.locked == {} and registry.draining == 0
    registry.close()


def test_a_refused_page_lock_falls_back_to_a_private_copy_with_one_warning(caplog):
    registry, locker = _registry()
    locker.refuse = True
    with _segment(DATA.tobytes()) as (key, _), caplog.at_level(logging.WARNING, "voxserve.server.protocol.shm"):
        registry.register("a", key, 0, 4096)
        registry.register("b", key, 4096, 4096)
        for name in ("a", "b", "a"):
            assert registry.pinned(name, 0, 4096, "input 'x'") is None
        data = registry.read("b", 0, 4096, "input 'x'")
        assert bytes(data) == DATA[4096:8192].tobytes()
        assert registry.copies == 1 and registry.in_place_reads == 0 and locker.locked == {}
        warnings = [r for r in caplog.records if "page-locking" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
    registry.close()


def test_memlock_limit_locks_what_fits_and_copies_the_rest():
    registry, locker = _registry(limit_bytes=6000)
    with _segment(DATA.tobytes()) as (key, _):
        registry.register("a", key, 0, 4096)
        registry.register("b", key, 4096, 4096)
        assert registry.pinned("a", 0, 4096, "input 'x'") is not None
        assert registry.pinned("b", 0, 4096, "input 'x'") is None
        assert bytes(registry.read("b", 0, 8, "input 'x'")) == DATA[4096:4104].tobytes()
        assert registry.copies == 1 and locker.locked_bytes == 4096
    registry.close()


def test_without_read_only_registration_a_writable_mapping_is_locked():
    registry, locker = _registry(read_only_supported=False)
    with _segment(DATA.tobytes()) as (key, _):
        registry.register("r", key, 0, 4096)
        view = registry.pinned("r", 0, 4096, "input 'x'")[0]
        assert not view.flags.writeable and np.array_equal(view, DATA[:4096])
        assert list(locker.locked.values()) == [(4096, False)]
        del view
    registry.close()
    assert locker.locked == {}


def test_replicas_map_on_first_use_and_follow_an_unregister_through_another(tmp_path):
    a, lock_a = _registry(shared_dir=str(tmp_path))
    b, lock_b = _registry(shared_dir=str(tmp_path))
    with _segment(DATA.tobytes()) as (key, _):
        a.register("r", key, 0, 8192)
        assert lock_a.locks == 0 and lock_b.locks == 0  # mapped on first use, in each process
        view_b = b.pinned("r", 0, 8192, "input 'x'")[0]
        assert np.array_equal(view_b, DATA[:8192]) and lock_b.locks == 1 and lock_a.locks == 0
        a.unregister("r")
        assert _refused(lambda: b.read("r", 0, 1, "input 'x'")).code == Status.NOT_FOUND
        assert b.draining == 1 and lock_b.locked_bytes == 8192  # b's request still reads its mapping
        del view_b
        gc.collect()
        assert lock_b.locked == {} and b.draining == 0
    a.close()
    b.close()


def test_close_unlocks_every_mapping_read_or_not():
    registry, locker = _registry()
    with _segment(DATA.tobytes()) as (key, _):
        registry.register("a", key, 0, 4096)
        registry.register("b", key, 4096, 4096)
        registry.read("a", 0, 4096, "input 'x'")
        kept, lease = registry.pinned("b", 0, 4096, "input 'x'")
        registry.unregister("b")
        assert locker.locked_bytes == 8192
        registry.close()
        assert locker.locked == {} and locker.unlocks == 2
        del kept
        lease.release()  # after close: nothing left to unlock, nothing raised
    assert locker.unlocks == 2


def test_lease_ends_inside_the_owners_locked_section_are_done_when_it_lets_go():
    lock = threading.Lock()
    counts = {"in_use": 2}
    closed = []

    def ended(item):
        counts["in_use"] -= 1
        return item if counts["in_use"] == 0 else None

    releases = Releases(lock, ended, closed.append)
    with releases.locked():
        releases.end("m")  # as a finalizer run by a collection inside the section: queued, not deadlocked
        releases.end("m")
        assert closed == [] and counts["in_use"] == 2
    assert closed == ["m"] and counts["in_use"] == 0


def test_dma_only_ranges_are_found_and_forgotten(monkeypatch):
    from voxserve.server.core import pipeline

    monkeypatch.setattr(pipeline, "_LOCKED", ())
    monkeypatch.setattr(pipeline, "_DMA_ONLY", ())
    base = 1 << 40  # no memory is touched: only addresses are compared
    pipeline.register_page_locked(base, 4096, dma_only=True)
    pipeline.register_page_locked(base + 8192, 4096)
    assert pipeline._registered(base + 10, 100) and pipeline._registered(base + 8192, 4096)
    assert pipeline._within(pipeline._DMA_ONLY, base, 4096)
    assert not pipeline._within(pipeline._DMA_ONLY, base + 8192, 10)  # page-locked, but the CPU may read it
    assert pipeline.touches_dma_only(base + 4000, 200)  # reaches into it without lying in it
    assert pipeline.touches_dma_only(base - 10, 11) and not pipeline.touches_dma_only(base - 10, 10)
    assert not pipeline.touches_dma_only(base + 4096, 4096)
    pipeline.unregister_page_locked(base, 4096)
    assert not pipeline._registered(base, 1) and not pipeline.touches_dma_only(base, 4096)
    assert pipeline._registered(base + 8192, 1)


def test_an_array_in_a_dma_only_range_is_never_read_on_the_host(monkeypatch):
    from voxserve.server.core import pipeline

    monkeypatch.setattr(pipeline, "_DMA_ONLY", ())
    x = np.zeros((4, 1024), np.float32)
    pipeline._check_host_readable(x)  # an ordinary array: fine
    pipeline.register_page_locked(x.ctypes.data + 4096, 4096, dma_only=True)
    try:
        for part in (x, x[:, ::2], x[1:2], x[:2]):  # a non-contiguous view across it, slices of and into it
            with pytest.raises(RuntimeError, match="DMA-only"):
                pipeline._check_host_readable(part)
        pipeline._check_host_readable(x[0])  # beside it
        pipeline._check_host_readable(x[2:])
    finally:
        pipeline.unregister_page_locked(x.ctypes.data + 4096, 4096)


def test_a_server_with_a_page_locker_serves_inputs_in_place_without_copies():
    """The whole protocol path on the CPU with the fake page-locker (the CPU model reads the view: fine here, the
    segment is never truncated; a GPU server only DMAs it, tests/core/test_shm_in_place_gpu.py)."""
    rng = torch.Generator().manual_seed(11)
    x = torch.randn(SHAPE, generator=rng).numpy()
    with running_server() as srv, _segment(x.tobytes()) as (key, path):
        assert srv.wait_ready(), srv.server.load_error
        registry = srv.server.shm
        locker = FakePageLocker()
        registry.locker = locker
        with Client(srv.url) as c:
            c.register_system_shared_memory("in", key, x.nbytes)
            y = c.infer_shared_memory(SHAPE, "in")
            assert relative_error(torch.from_numpy(y), reference_float64(torch.from_numpy(x), W, B)) <= 1e-5
            assert registry.copies == 0 and registry.in_place_reads == 1 and locker.locks == 1
            gc.collect()
            assert registry.draining == 0
            os.truncate(path, 8)
            with pytest.raises(InferenceError) as err:
                c.infer_shared_memory(SHAPE, "in")
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "now smaller" in err.value.message
            c.unregister_system_shared_memory()
            assert _eventually(lambda: locker.locked == {})  # the last view goes with the request's last frame


def test_an_input_read_in_place_takes_nothing_from_the_budget_of_copies():
    """--max-shm-inflight-bytes bounds private copies in flight: an input read in place holds none of it while it
    runs (one request after another: each one's hold is all the budget could show)."""
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5)).numpy()
    with running_server(max_shm_inflight_bytes=x.nbytes) as srv, _segment(x.tobytes()) as (key, _):
        assert srv.wait_ready(), srv.server.load_error
        srv.server.shm.locker = FakePageLocker()
        budget, runner = srv.server.service.shm_budget, srv.server.state.runner
        seen = []
        run = runner.run

        def noting(arr, datatype, timeout_s=None):  # what the budget holds as each request starts executing
            seen.append(budget.used)
            return run(arr, datatype, timeout_s)

        runner.run = noting
        with Client(srv.url) as c:
            c.register_system_shared_memory("in", key, x.nbytes)
            ys = [c.infer_shared_memory(SHAPE, "in") for _ in range(4)]
            c.unregister_system_shared_memory()
        ref = reference_float64(torch.from_numpy(x), W, B)
        assert all(relative_error(torch.from_numpy(y), ref) <= 1e-5 for y in ys)
        assert seen == [0, 0, 0, 0] and budget.used == 0
        assert srv.server.shm.copies == 0


@contextlib.contextmanager
def _two_replicas(tmp_path):
    """Replica a registers region "r" (8192 bytes of DATA's segment); replica b maps it, reading its first half.
    Yields (a, b, b's page locker, the segment's key)."""
    a, _ = _registry(shared_dir=str(tmp_path))
    b, lock_b = _registry(shared_dir=str(tmp_path))
    try:
        with _segment(DATA.tobytes()) as (key, _):
            a.register("r", key, 0, 8192)
            view = b.pinned("r", 0, 4096, "input 'x'")[0]
            assert np.array_equal(view, DATA[:4096]) and lock_b.locks == 1
            del view
            gc.collect()
            yield a, b, lock_b, key
    finally:
        a.close()
        b.close()


def test_a_record_written_anew_within_a_tick_of_the_clock_is_read_again(tmp_path, monkeypatch):
    """System regions' records, as CUDA regions' (test_cuda_shared_memory.py): a region unregistered and registered
    again within one tick of a coarse file clock can leave a record with the old one's inode and mtime. Seen that
    soon after its mtime, the identity vouches for nothing: the other replica reads the new registration's span,
    not the one it mapped before; and a record read again unchanged keeps its mapping."""
    monkeypatch.setattr(shm, "RACY_NS", 1 << 62)  # every record unsettled, however slow this run
    with _two_replicas(tmp_path) as (a, b, lock_b, key):
        view = b.pinned("r", 0, 4096, "input 'x'")[0]  # read again (not settled yet), unchanged: the same mapping
        assert lock_b.locks == 1
        del view
        gc.collect()
        path = a._record_path("r")
        old = os.stat(path)
        a.unregister("r")
        a.register("r", key, 4096, 4096)
        as_in_one_tick(monkeypatch, path, old)  # the new record, with the old one's identity
        (region,) = b.status("r")
        assert (region.offset, region.byte_size) == (4096, 4096)
        monkeypatch.undo()
        assert np.array_equal(b.pinned("r", 0, 4096, "input 'x'")[0], DATA[4096:8192])


def test_a_record_that_cannot_be_read_again_right_now_keeps_its_region(tmp_path, monkeypatch):
    """Read again while its identity cannot vouch for it yet, an unchanged record that fails to read (a passing
    error) leaves the region as it was, with its mapping: not dropped as if unregistered."""
    monkeypatch.setattr(shm, "RACY_NS", 1 << 62)  # every record unsettled, however slow this run
    with _two_replicas(tmp_path) as (a, b, lock_b, _):
        path = a._record_path("r")
        real_open = builtins.open

        def failing(file, *args, **kwargs):
            if os.fspath(file) == path:
                raise OSError(24, "Too many open files")
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", failing)
        assert [r.name for r in b.status("r")] == ["r"]
        monkeypatch.undo()
        assert lock_b.locks == 1 and lock_b.unlocks == 0
