"""The Python API over the bridge contract: allocation, ring, copies, steps, restart, handles, close."""

from __future__ import annotations

import numpy as np
import pytest

import devbridge
from devbridge import _devbridge as ext
from conftest import _backend_available, collect, download, make_bridge, random_array, upload

F32 = devbridge.ObjectSpec(max_extent=1 << 20, alignment=64, dtype="float32")
U8 = devbridge.ObjectSpec(max_extent=1 << 20, alignment=64, dtype="uint8")

CONTRACT_KINDS = [
    "AllocationFailed", "DeviceCopyFailed", "OutputCopyFailed", "InvalidExtent", "InvalidAlignment",
    "InvalidRange", "UnknownDeviceHandle", "OldGenerationHandle", "ForeignDomain", "InvalidViewDType",
    "InvalidTensorView", "AllocationStillInUse", "Backpressure", "Unavailable", "Unsupported", "Closed", "Broken",
]


# ---- errors -----------------------------------------------------------------

@pytest.mark.parametrize("kind", CONTRACT_KINDS)
def test_every_error_kind_surfaces_as_its_own_class(kind):
    cls = getattr(devbridge, kind)
    assert issubclass(cls, devbridge.BridgeError)
    assert cls.kind == kind
    with pytest.raises(cls) as caught:
        ext._raise_for_test(kind, "handle {domain 1, generation 2, id 3} at fault")
    assert caught.value.kind == kind
    assert caught.value.message == "handle {domain 1, generation 2, id 3} at fault"
    assert str(caught.value) == f"{kind}: handle {{domain 1, generation 2, id 3}} at fault"
    assert caught.value.fatal is False


def test_error_raised_from_python_has_the_same_shape():
    error = devbridge.Unsupported("to_tinygrad: no")
    assert str(error) == "Unsupported: to_tinygrad: no" and error.message == "to_tinygrad: no"
    assert error.kind == "Unsupported"


# ---- describe ---------------------------------------------------------------

def test_backend_info_and_stats(bridge, backend_name):
    info = bridge.backend_info()
    assert info["name"] == backend_name
    assert "float32" in info["dtypes"] and "bfloat16" in info["dtypes"]
    if backend_name == "host":
        assert info["device_string"] == "CPU" and info["dlpack_device"] == (1, 0)
    else:
        assert info["device_string"].startswith("CUDA") and info["dlpack_device"][0] == 2
    stats = bridge.stats()
    assert stats["generation"] == 1 == bridge.generation
    assert stats["domain"] == bridge.domain
    assert stats["ring_capacity"] == 64 << 20 == bridge.ring.capacity
    assert stats["live_allocations"] == 0 and stats["live_views"] == 0


def test_list_backends_and_dtypes():
    names = {b["name"]: b for b in devbridge.list_backends()}
    assert names["host"]["available"] and names["fake"]["available"]
    assert "cuda" in names  # listed even where it cannot run, with the reason
    if not names["cuda"]["available"]:
        assert names["cuda"]["reason"]
    for name in ("float32", "float16", "bfloat16", "int32", "uint8"):
        assert name in devbridge.dtypes()
    assert devbridge.dtype_info("bfloat16")["itemsize"] == 2
    assert devbridge.dtype_info(np.float32)["name"] == "float32"
    assert devbridge.dtype_info(np.dtype("int32"))["name"] == "int32"
    with pytest.raises(ValueError, match="unknown dtype"):
        devbridge.ObjectSpec(1024, 64, "float33")


def test_tinygrad_dtypes_are_accepted():
    tinygrad = pytest.importorskip("tinygrad")
    assert devbridge.dtype_info(tinygrad.dtypes.float32)["name"] == "float32"
    assert devbridge.dtype_info(tinygrad.dtypes.bfloat16)["name"] == "bfloat16"
    assert devbridge.dtype_info(tinygrad.dtypes.half)["name"] == "float16"


# ---- allocation -------------------------------------------------------------

def test_alloc_validates_before_the_backend():
    with devbridge.Bridge(backend="fake") as b:
        before = b.fake.live_allocations()
        with pytest.raises(devbridge.InvalidAlignment):
            b.alloc(devbridge.ObjectSpec(1 << 20, 3, "uint8"), 3 * 64)
        with pytest.raises(devbridge.InvalidAlignment):
            b.alloc(devbridge.ObjectSpec(1 << 20, 0, "uint8"), 64)
        with pytest.raises(devbridge.InvalidExtent):
            b.alloc(U8, 0)
        with pytest.raises(devbridge.InvalidExtent):
            b.alloc(U8, (1 << 20) + 64)
        with pytest.raises(devbridge.InvalidExtent):
            b.alloc(U8, 100)  # not a multiple of the alignment
        assert b.fake.live_allocations() == before
        assert not [c for c in b.fake.calls() if c["call"] == "allocate"]


def test_alloc_returns_tagged_handles(bridge):
    h1, h2 = bridge.alloc(F32, 4096), bridge.alloc(F32, 8192)
    assert h1 != h2 and h1 == devbridge.DeviceHandle(h1.domain, h1.generation, h1.id)
    assert (h1.domain, h1.generation) == (bridge.domain, 1)
    assert bridge.extent(h1) == 4096 and bridge.extent(h2) == 8192
    assert bridge.spec(h1).dtype == "float32" and bridge.spec(h1).alignment == 64
    assert bridge.stats()["live_allocations"] == 2
    bridge.free(h1)
    bridge.free(h2)
    assert bridge.stats()["live_allocations"] == 0


# ---- ring -------------------------------------------------------------------

def test_ring_buffers_are_exactly_the_reserved_bytes(bridge, rng):
    ring = bridge.ring
    r = ring.reserve(1000, alignment=256)
    assert r.offset % 256 == 0 and r.len == 1000 and len(r) == 1000
    buf = ring.buffer(r)
    mv = memoryview(buf)
    assert mv.nbytes == 1000 and not mv.readonly
    data = random_array(rng, 1000, "uint8")
    mv[:] = data.tobytes()
    arr = np.frombuffer(buf, dtype=np.uint8)
    assert arr.flags.writeable and np.array_equal(arr, data)
    assert np.shares_memory(arr, ring.ndarray(r, "uint8"))
    assert ring.free_bytes < ring.capacity
    del mv, arr
    ring.release(r)
    assert ring.free_bytes == ring.capacity
    with pytest.raises(devbridge.BridgeError):
        ring.buffer(r)  # no longer reserved


def test_ring_refuses_what_does_not_fit():
    with devbridge.Bridge(backend="fake", ring_bytes=1 << 16) as b:
        r = b.ring.reserve(1 << 15)
        with pytest.raises(devbridge.Backpressure):
            b.ring.reserve((1 << 15) + 4096)
        b.ring.release(r)
        with pytest.raises(devbridge.BridgeError):
            b.ring.release(devbridge.HostRange(r.offset, r.len))  # twice


# ---- copies -----------------------------------------------------------------

@pytest.mark.parametrize("mode", ["async", "sync"])
def test_round_trip_copies_exact_bytes(bridge, rng, mode):
    data = random_array(rng, 4096, "float32")
    h = bridge.alloc(F32, data.nbytes)
    r = bridge.ring.reserve(data.nbytes)
    bridge.ring.ndarray(r, "float32")[:] = data
    e = bridge.host_to_device(r, h, mode=mode)
    assert e.domain == bridge.domain and e.generation == bridge.generation
    assert bridge.wait(e, timeout=None) == "completed"
    assert bridge.copy_status(e) == "completed" and bridge.safe_to_release_host(e)
    bridge.ring.release(r)
    back = download(bridge, h, data.nbytes, "float32", mode=mode)
    assert np.array_equal(back, data)
    bridge.free(h)


def test_copies_at_device_offsets(bridge, rng):
    h = bridge.alloc(U8, 8192)
    whole = random_array(rng, 8192, "uint8")
    upload(bridge, h, whole)
    patch = random_array(rng, 1024, "uint8")
    upload(bridge, h, patch, offset=4096)
    expected = whole.copy()
    expected[4096:5120] = patch
    assert np.array_equal(download(bridge, h, 8192), expected)
    assert np.array_equal(download(bridge, h, 512, offset=4608), expected[4608:5120])


def test_ranges_are_validated(bridge):
    h = bridge.alloc(U8, 4096)
    r = bridge.ring.reserve(4096)
    with pytest.raises(devbridge.InvalidRange):
        bridge.host_to_device(r, h, offset=64)  # past the extent
    with pytest.raises(devbridge.InvalidRange):
        bridge.device_to_host(h, r, offset=(1 << 64) - 64)  # overflowing offset
    with pytest.raises(devbridge.InvalidRange):
        bridge.host_to_device(devbridge.HostRange(r.offset + 4096, 4096), h)  # not reserved
    with pytest.raises(ValueError):
        bridge.host_to_device(r, h, mode="eventually")
    bridge.ring.release(r)
    bridge.free(h)


def test_in_flight_budget_applies_backpressure():
    with devbridge.Bridge(backend="fake", ring_bytes=1 << 16, inflight_bytes=8192) as b:
        h = b.alloc(U8, 8192)
        r1, r2 = b.ring.reserve(8192), b.ring.reserve(4096)
        e1 = b.host_to_device(r1, h)
        with pytest.raises(devbridge.Backpressure):
            b.host_to_device(r2, h, offset=0)
        assert b.stats()["inflight_bytes"] == 8192
        b.fake.complete(e1)
        assert b.wait(e1) == "completed"
        e2 = b.host_to_device(r2, h)
        b.fake.complete(e2)
        assert b.wait(e2) == "completed"


# ---- compute steps ----------------------------------------------------------

def test_steps_pin_allocations(bridge):
    h = bridge.alloc(F32, 4096)
    bridge.begin_step(7, [h])
    with pytest.raises(devbridge.AllocationStillInUse):
        bridge.free(h)
    assert bridge.stats()["active_steps"] == 1
    bridge.end_step(7)
    bridge.free(h)
    with pytest.raises(devbridge.UnknownDeviceHandle):
        bridge.begin_step(8, [h])


def test_axpy_role(bridge, rng):
    x = random_array(rng, 2048, "float32")
    hx, hy = bridge.alloc(F32, x.nbytes), bridge.alloc(F32, x.nbytes)
    upload(bridge, hx, x)
    bridge.axpy(hx, hy, a=2.0, b=1.0)
    y = download(bridge, hy, x.nbytes, "float32")
    np.testing.assert_array_equal(y, (x * np.float32(2) + np.float32(1)).astype(np.float32))


def test_axpy_of_tensors_covers_their_elements_not_their_allocations_rounding(bridge):
    """x of 60 float32 sits in a 256-byte allocation: "all of x" ran over its 64 slots, and the 4 past its data
    (another tensor's old bytes, reused) overwrote y[60:64], which are y's own elements."""
    if bridge.backend == "fake":
        bridge.fake.set_auto_complete(True)
    old = bridge.upload(np.full(64, 7.0, np.float32), wait=True)
    old.free()
    x = bridge.upload(np.arange(60, dtype=np.float32), wait=True)
    y = bridge.upload(np.full(70, -3.0, np.float32), wait=True)
    bridge.axpy(x, y, 2.0, 1.0)
    expected = np.full(70, -3.0, np.float32)
    expected[:60] = np.arange(60, dtype=np.float32) * 2 + 1
    np.testing.assert_array_equal(bridge.download(y), expected)
    bridge.axpy(x, y, 1.0, 0.0, x_offset=200, y_offset=0)  # the rest of x from byte 200: its last 10 elements
    expected[:10] = np.arange(50, 60, dtype=np.float32)
    np.testing.assert_array_equal(bridge.download(y), expected)
    with pytest.raises(devbridge.InvalidRange, match="overlap"):
        bridge.axpy(y, y, 1.0, 0.0, x_offset=0, y_offset=4, nbytes=64)
    x.free()
    y.free()


# ---- handles: forged, foreign, freed, old ----------------------------------

def test_forged_and_foreign_handles_are_refused(bridge):
    h = bridge.alloc(U8, 4096)
    with make_bridge(bridge.backend) as other:
        foreign = other.alloc(U8, 4096)
        for call in (bridge.free, bridge.release, bridge.extent, lambda x: bridge.view(x, "uint8", 4096)):
            with pytest.raises(devbridge.ForeignDomain):
                call(foreign)
        r = bridge.ring.reserve(4096)
        with pytest.raises(devbridge.ForeignDomain):
            bridge.host_to_device(r, foreign)
        with pytest.raises(devbridge.ForeignDomain):
            bridge.copy_status(devbridge.CopyEvent(other.domain, 1, 1))
        bridge.ring.release(r)
    forged = devbridge.DeviceHandle(bridge.domain, bridge.generation, h.id + 12345)
    with pytest.raises(devbridge.UnknownDeviceHandle):
        bridge.free(forged)
    with pytest.raises(devbridge.UnknownDeviceHandle):
        bridge.view(forged, "uint8", 64)
    bridge.free(h)
    with pytest.raises(devbridge.UnknownDeviceHandle):
        bridge.free(h)  # already freed
    with pytest.raises(devbridge.UnknownDeviceHandle):
        bridge.view(h, "uint8", 64)


def test_restart_makes_every_old_handle_raise(bridge, rng):
    h = bridge.alloc(U8, 4096)
    released = bridge.alloc(U8, 4096)
    stepped = bridge.alloc(U8, 4096)
    event = upload(bridge, h, random_array(rng, 4096, "uint8"))
    bridge.begin_step(1, [stepped])
    bridge.restart(2)
    assert bridge.generation == 2
    assert bridge.stats()["live_allocations"] == 0
    r = bridge.ring.reserve(4096)
    old_calls = [
        lambda: bridge.free(h),
        lambda: bridge.release(released),
        lambda: bridge.extent(h),
        lambda: bridge.spec(h),
        lambda: bridge.host_to_device(r, h),
        lambda: bridge.device_to_host(h, r),
        lambda: bridge.view(h, "uint8", 4096),
        lambda: bridge.begin_step(2, [stepped]),
        lambda: bridge.copy_status(event),
        lambda: bridge.wait(event),
        lambda: bridge.safe_to_release_host(event),
    ]
    for call in old_calls:
        with pytest.raises(devbridge.OldGenerationHandle):
            call()
    with pytest.raises(devbridge.OldGenerationHandle):
        bridge.restart(2)  # not greater than the current generation
    with pytest.raises(devbridge.OldGenerationHandle):
        bridge.restart(1)
    new = bridge.alloc(U8, 4096)
    assert new.generation == 2
    data = random_array(rng, 4096, "uint8")
    upload(bridge, new, data)
    assert np.array_equal(download(bridge, new, 4096), data)
    bridge.ring.release(r)


def test_restart_frees_everything_in_the_backend():
    with devbridge.Bridge(backend="fake") as b:
        handles = [b.alloc(U8, 4096) for _ in range(5)]
        r = b.ring.reserve(4096)
        pending = b.host_to_device(r, handles[0])  # never completed: restart cancels it
        assert b.fake.live_allocations() == 5
        b.restart(10)
        assert b.fake.live_allocations() == 0
        assert b.stats()["copies_in_flight"] == 0
        with pytest.raises(devbridge.OldGenerationHandle):
            b.copy_status(pending)
        b.ring.release(r)


# ---- views and lifetimes ----------------------------------------------------

def test_free_with_a_live_view_raises_and_release_defers(bridge):
    h = bridge.alloc(F32, 4096)
    view = bridge.view(h, "float32", (32, 32))
    with pytest.raises(devbridge.AllocationStillInUse):
        bridge.free(h)
    assert bridge.stats()["live_views"] == 1
    view.close()
    assert view.closed and bridge.stats()["live_views"] == 0
    bridge.free(h)

    h = bridge.alloc(F32, 4096)
    with bridge.view(h, "float32", 1024) as view:
        bridge.release(h)  # deferred: the view still holds it
        with pytest.raises(devbridge.UnknownDeviceHandle):
            bridge.view(h, "float32", 1024)  # unusable from the moment of release
        assert bridge.stats()["live_allocations"] == 1
    assert bridge.stats()["live_allocations"] == 0


def test_view_validation(bridge):
    h = bridge.alloc(F32, 4096)
    with pytest.raises(devbridge.InvalidViewDType):
        bridge.view(h, "float16", 2048)
    with pytest.raises(devbridge.InvalidTensorView):
        bridge.view(h, "float32", (33, 32))  # past the extent
    with pytest.raises(devbridge.InvalidTensorView):
        bridge.view(h, "float32", (0, 32))
    with pytest.raises(devbridge.InvalidTensorView):
        bridge.view(h, "float32", 1000, offset=2)  # not a multiple of the element size
    with pytest.raises(devbridge.InvalidTensorView):
        bridge.view(h, "float32", (2, 2), strides=(1,))
    with bridge.view(h, "float32", (8, 16), strides=(64, 2), offset=256) as view:
        assert view.shape == (8, 16) and view.strides == (64, 2) and not view.contiguous
        assert view.ptr == view.data + 256 and view.byte_offset == 256
        assert view.dtype == "float32" and view.itemsize == 4 and view.size == 128
        assert view.handle == h
    with pytest.raises(devbridge.Closed):
        view.ptr
    bridge.free(h)


def test_view_waits_for_uploads_or_refuses(rng):
    import threading

    with devbridge.Bridge(backend="fake") as b:
        h = b.alloc(F32, 4096)
        data = random_array(rng, 1024, "float32")
        r = b.ring.reserve(4096)
        b.ring.ndarray(r, "float32")[:] = data
        event = b.host_to_device(r, h)
        with pytest.raises(devbridge.AllocationStillInUse):
            b.view(h, "float32", 1024, wait=False)
        seen = {}

        def take_view():
            view = b.view(h, "float32", 1024)  # wait=True: returns once the upload is done
            seen["status"] = b.copy_status(event)
            seen["data"] = np.from_dlpack(view).copy()
            view.close()

        worker = threading.Thread(target=take_view)
        worker.start()
        assert b.fake.complete(event)
        worker.join(timeout=120)
        assert not worker.is_alive()
        assert seen["status"] == "completed"
        assert np.array_equal(seen["data"], data)


# ---- close ------------------------------------------------------------------

def test_close_and_context_manager():
    with devbridge.Bridge(backend="fake") as b:
        h = b.alloc(U8, 4096)
        fake = b.fake
    assert b.closed
    assert fake.live_allocations() == 0 and fake.live_host_blocks() == 0
    for call in (lambda: b.alloc(U8, 64), lambda: b.free(h), lambda: b.ring.reserve(64), b.poll):
        with pytest.raises(devbridge.Closed):
            call()
    assert b.stats()["closed"] and b.memory_stats()["reserved_bytes"] == 0  # still there to read
    b.close()  # idempotent


# What exported memory does across close(), and close() waking blocked calls: test_reliability.py.


# ---- threads ----------------------------------------------------------------

def test_many_threads_share_one_bridge(bridge, rng):
    """Blocking calls release the GIL; concurrent round trips, views and exports keep their bytes apart."""
    import threading

    threads, rounds, nbytes = 4, 12, 1 << 16
    seeds = rng.integers(0, 1 << 31, size=threads)
    failures: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            local = np.random.default_rng(seed)
            h = bridge.alloc(U8, nbytes)
            for _ in range(rounds):
                data = random_array(local, nbytes, "uint8")
                upload(bridge, h, data, mode=str(local.choice(["async", "sync"])))
                with bridge.view(h, "uint8", nbytes) as view:
                    if bridge.backend == "host":
                        assert np.array_equal(np.from_dlpack(view), data)
                assert np.array_equal(download(bridge, h, nbytes), data)
            collect()
            bridge.free(h)
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    workers = [threading.Thread(target=worker, args=(int(s),)) for s in seeds]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=600)
    assert not any(w.is_alive() for w in workers)
    assert not failures, failures
    assert bridge.stats()["live_allocations"] == 0 and bridge.stats()["live_views"] == 0


# ---- the OpenCL backend (PoCL in CI) -----------------------------------------

def test_opencl_bridge_moves_bytes_computes_and_names_its_views():
    available, reason = _backend_available("opencl")
    if not available:
        pytest.skip(reason)
    rng = np.random.default_rng(7)
    with devbridge.Bridge(backend="opencl", ring_bytes=1 << 20) as b:
        assert b.backend_info()["name"] == "opencl"
        x = random_array(rng, 4096, "float32")
        hx, hy = b.alloc(F32, x.nbytes), b.alloc(F32, x.nbytes)
        upload(b, hx, x)
        np.testing.assert_array_equal(download(b, hx, x.nbytes, "float32"), x)
        b.axpy(hx, hy, a=3.0, b=-1.0)
        np.testing.assert_array_equal(download(b, hy, x.nbytes, "float32"),
                                      (x * np.float32(3) - np.float32(1)).astype(np.float32))
        with b.view(hy, "float32", 4096) as view:
            # A buffer has no address: the view names the cl_mem, as DLPack's kDLOpenCL does.
            assert view.device == "CL"
            assert view.__dlpack_device__() == (4, 0)
            with pytest.raises(devbridge.Unsupported):
                view.to_tinygrad()
        b.free(hx)
        b.free(hy)


# ------------------------------------------------------------------ arguments the Python layer reads itself


def test_objects_that_own_device_memory_are_neither_copied_nor_pickled():
    """copy.copy of a DeviceTensor shared its handle, and the copy's collection freed what the original still
    used (a Prefetcher copy consumed the original's batches): copying is refused, as for every extension type."""
    import copy
    import pickle

    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 20)
    b.fake.set_auto_complete(True)
    try:
        t = b.upload(np.arange(16, dtype=np.float32), wait=True)
        prefetcher = devbridge.Prefetcher(b, iter([np.zeros(4, np.float32)]), depth=1, to="device")
        for owner in (t, prefetcher, devbridge.ReleaseQueue(b)):
            for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
                with pytest.raises(TypeError, match="cannot be"):
                    attempt(owner)
        assert t.numpy().tolist() == list(range(16)), "the original is untouched"
        prefetcher.close()
        t.free()
    finally:
        b.close()


def test_value_types_compare_unequal_to_none_and_anything_else():
    h = ext.DeviceHandle(1, 1, 1)
    assert h != None and not (h == None) and h != 5  # noqa: E711 - the comparison is the test
    assert ext.HostRange(0, 64) != None  # noqa: E711
    assert None not in [h] and [h, None].index(None) == 1


def test_value_types_copy_and_compare_by_value():
    """ObjectSpec compared by identity (two equal specs were two set members), and copy.copy of a handle, event,
    range or spec raised 'cannot pickle'."""
    import copy
    import pickle

    spec = ext.ObjectSpec(1 << 20, 64, "float32")
    same = ext.ObjectSpec(1 << 20, 64, "float32", "tensor")
    assert spec == same and hash(spec) == hash(same) and len({spec, same}) == 1
    for other in (ext.ObjectSpec(1 << 20, 64, "float16"), ext.ObjectSpec(1 << 20, 128, "float32"),
                  ext.ObjectSpec(1 << 20, 64, "float32", "matrix"), ext.ObjectSpec(1 << 20, 64, None), None, 3):
        assert spec != other
    values = (spec, ext.ObjectSpec(64, 64, None), ext.DeviceHandle(1, 2, 3), ext.CopyEvent(1, 2, 3),
              ext.HostRange(64, 128))
    for value in values:
        assert copy.copy(value) == value and copy.deepcopy(value) == value
    for value in (spec, ext.ObjectSpec(64, 64, None), ext.HostRange(64, 128)):
        assert pickle.loads(pickle.dumps(value)) == value
        assert repr(pickle.loads(pickle.dumps(value))) == repr(value)
    for value in (ext.DeviceHandle(1, 2, 3), ext.CopyEvent(1, 2, 3)):
        with pytest.raises(TypeError):  # another process's bridge 1 is not this one
            pickle.dumps(value)


@pytest.mark.parametrize("timeout, error", [("1", TypeError), (True, TypeError), (-1, ValueError),
                                            (float("nan"), ValueError)])
def test_python_layer_timeouts_and_flags_are_checked(timeout, error):
    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 20)
    try:
        t = b.upload(np.zeros(1024, np.float32))  # the fake leaves its copies pending
        with pytest.raises(error, match="timeout"):
            t.wait(timeout)
        with pytest.raises(error, match="timeout"):
            devbridge.ReleaseQueue(b).drain(timeout)
        for bad in ("x", None, 1):
            with pytest.raises(TypeError, match="wait must be a bool"):
                b.upload(np.zeros(4, np.float32), wait=bad)
        with pytest.raises(TypeError, match="bridge must be a devbridge.Bridge"):
            devbridge.adopt(None, np.zeros(4, np.float32))
        with pytest.raises(TypeError, match="bridge must be a devbridge.Bridge"):
            devbridge.download(None, t)
        for shape in ({}, {2: "a"}, True, {1, 2}, (2, True)):
            with pytest.raises(TypeError, match="shape"):
                devbridge.spec_for_array(shape, "float32")
        b.fake.complete_all()
        assert t.wait(None) and t.wait(float("inf")) and t.wait(10**30)
        t.free()
    finally:
        b.close()
