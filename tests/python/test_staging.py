"""The staging layer: spec_for_array, upload/download, DeviceTensor, ReleaseQueue, release_host_after.

Runs on fake (auto-completing unless a test drives completions), host, and OpenCL where it is available
(CUDA with DEVBRIDGE_TEST_BACKEND=cuda). Every bridge has a 1 MiB ring, so multi-MiB arrays are chunked.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import devbridge
from conftest import collect, make_bridge, random_array, require_backend, require_dtype, run_in_threads

RING = 1 << 20


@pytest.fixture(params=["fake", "host", "opencl", "cuda"])
def sb(request):
    name = request.param
    require_backend(name)
    b = make_bridge(name, ring_bytes=RING)
    if name == "fake":
        b.fake.set_auto_complete(True)
    yield b
    collect()
    b.close()


def data(rng, shape, dtype):
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    return np.asarray(random_array(rng, shape, dtype))


def quiet(b):
    s = b.stats()
    return s["ring_used"], s["copies_in_flight"], s["ring_reservations"]


# ------------------------------------------------------------------------------------- spec_for_array


def test_spec_for_array_rounds_the_extent_up():
    spec, extent = devbridge.spec_for_array((3, 5), "float32")
    assert extent == 256 and spec.max_extent == 256 and spec.alignment == 256 and spec.dtype == "float32"
    spec, extent = devbridge.spec_for_array(1000, np.float64, alignment=4096)
    assert extent == 8192 and spec.dtype == "float64"
    assert devbridge.spec_for_array((), "uint8", alignment=1)[1] == 1
    assert devbridge.spec_for_array((64,), "int32")[1] == 256
    spec2, extent2 = devbridge.ObjectSpec.for_array((3, 5), "float32")
    assert extent2 == 256 and repr(spec2) == repr(devbridge.spec_for_array((3, 5), "float32")[0])


def test_spec_for_array_refuses_what_cannot_be_allocated():
    with pytest.raises(OverflowError):
        devbridge.spec_for_array((2**62, 8), "float32")
    with pytest.raises(OverflowError):
        devbridge.spec_for_array((2**64 - 1,), "uint8")  # fits, but not once rounded up to 256
    with pytest.raises(ValueError, match="empty"):
        devbridge.spec_for_array((3, 0), "float32")
    with pytest.raises(ValueError, match="negative"):
        devbridge.spec_for_array((3, -1), "float32")
    with pytest.raises(devbridge.InvalidAlignment):
        devbridge.spec_for_array((4,), "float32", alignment=3)
    with pytest.raises(TypeError):
        devbridge.spec_for_array("12", "float32")
    with pytest.raises(TypeError):
        devbridge.spec_for_array((1.5,), "float32")
    # More dimensions than a view has: refused when the tensor gets its shape, not at its first view.
    with pytest.raises(ValueError, match=f"9 dimensions.*at most {devbridge.MAX_RANK}"):
        devbridge.spec_for_array((1,) * (devbridge.MAX_RANK + 1), "float32")
    devbridge.spec_for_array((1,) * devbridge.MAX_RANK, "float32")


# --------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", ["float32", "int8", "float16", "bool", "uint64"])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5, 2), (1000, 33)])
def test_round_trip_is_bit_exact(sb, rng, dtype, shape):
    require_dtype(sb, dtype)
    a = data(rng, shape, dtype)
    before = sb.stats()["live_allocations"]
    t = sb.upload(a, wait=True)
    assert t.shape == shape and t.dtype == dtype and t.nbytes == a.nbytes and t.ready()
    assert sb.extent(t.handle) % 256 == 0 and sb.extent(t.handle) >= a.nbytes
    out = sb.download(t)
    assert out.dtype == a.dtype and out.shape == a.shape
    assert out.tobytes() == a.tobytes()
    assert t.numpy().tobytes() == a.tobytes()
    assert quiet(sb) == (0, 0, 0)
    t.free()
    t.free()  # idempotent
    assert sb.stats()["live_allocations"] == before


def test_empty_and_non_contiguous_arrays_are_refused(sb):
    before = sb.stats()["live_allocations"]
    with pytest.raises(ValueError, match="empty"):
        sb.upload(np.zeros((4, 0), np.float32))
    a = np.arange(64, dtype=np.float32).reshape(8, 8)
    with pytest.raises(ValueError, match="C-contiguous"):
        sb.upload(a[:, ::2])
    with pytest.raises(ValueError, match="C-contiguous"):
        sb.upload(np.asfortranarray(a))
    with pytest.raises(TypeError):
        sb.upload([1.0, 2.0])
    with pytest.raises(ValueError, match="itemsize|bytes"):
        sb.upload(a, dtype="float64")
    assert sb.stats()["live_allocations"] == before and quiet(sb) == (0, 0, 0)


def test_any_buffer_protocol_object_uploads(sb):
    with sb.upload(bytearray(b"devbridge!" * 100), wait=True) as t:
        assert t.dtype == "uint8" and t.shape == (1000,)
        assert sb.download(t).tobytes() == b"devbridge!" * 100


def test_numpy_reads_a_device_tensor_as_an_array_by_a_download(sb, rng):
    # np.asarray(t) made a 0-d object array holding the tensor, and np.sum(t) returned the tensor itself.
    a = random_array(rng, (3, 50), "float32")
    with sb.upload(a, wait=True) as t:
        got = np.asarray(t)
        assert got.dtype == np.float32 and got.shape == (3, 50) and np.array_equal(got, a)
        assert np.sum(t) == np.sum(a) and np.array_equal(np.asarray(t, dtype=np.float64), a.astype(np.float64))
        with pytest.raises(ValueError, match="avoid copy.*np.from_dlpack"):
            np.asarray(t, copy=False) if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else t.__array__(copy=False)
        got[0, 0] = 7  # a copy: the tensor keeps its bytes
        assert sb.download(t)[0, 0] == a[0, 0]
    assert quiet(sb) == (0, 0, 0)


def test_dtype_relabels_the_bytes(sb, rng):
    bits = random_array(rng, (300,), "uint16")
    with sb.upload(bits, dtype="bfloat16", wait=True) as t:
        assert t.dtype == "bfloat16" and sb.spec(t.handle).dtype == "bfloat16"
        back = sb.download(t)  # bfloat16: ml_dtypes' type where installed, else its bits (test_intake.py)
        assert back.dtype == devbridge._intake._numpy_dtype("bfloat16") and np.array_equal(back.view(np.uint16), bits)


def test_chunked_upload_and_download_larger_than_the_ring(sb, rng):
    a = data(rng, (3 << 20) // 4, "float32")  # 3 MiB through a 1 MiB ring
    if sb.backend == "fake":
        sb.fake.clear_calls()
    t = sb.upload(a)
    assert t.wait() is True
    if sb.backend == "fake":
        copies = [c for c in sb.fake.calls() if c["call"] == "copy_h2d"]
        assert len(copies) > 3 and sum(c["bytes"] for c in copies) == a.nbytes
        assert max(c["bytes"] for c in copies) <= RING // 4
    out = np.empty_like(a)
    assert sb.download(t, out) is out
    assert np.array_equal(out, a)
    assert quiet(sb) == (0, 0, 0)
    t.free()


def test_download_into_out_is_checked(sb, rng):
    a = data(rng, (16, 16), "int32")
    with sb.upload(a, wait=True) as t:
        out = np.zeros(256, np.int32)  # any shape of the same size
        sb.download(t, out)
        assert np.array_equal(out.reshape(16, 16), a)
        with pytest.raises(ValueError, match="dtype"):
            sb.download(t, np.zeros((16, 16), np.float32))
        with pytest.raises(ValueError, match="elements"):
            sb.download(t, np.zeros((16, 15), np.int32))
        with pytest.raises(ValueError, match="C-contiguous"):
            sb.download(t, np.zeros((16, 32), np.int32)[:, ::2])
        ro = np.zeros((16, 16), np.int32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            sb.download(t, ro)
        with pytest.raises(TypeError):
            sb.download(t, [0] * 256)
        with pytest.raises(TypeError):
            sb.download("not a tensor")
    assert quiet(sb) == (0, 0, 0)


def test_download_of_a_handle(sb, rng):
    a = data(rng, (1024,), "float32")
    t = sb.upload(a, wait=True)
    assert np.array_equal(devbridge.download(sb, t.handle, dtype="float32", shape=(32, 32)), a.reshape(32, 32))
    whole = sb.download(t.handle)  # the allocation's dtype, the whole extent
    assert whole.dtype == np.float32 and np.array_equal(whole[: a.size], a)
    with pytest.raises(devbridge.InvalidRange):
        sb.download(t.handle, shape=(2048,))
    t.free()


def test_device_tensor_as_context_manager_frees(sb, rng):
    before = sb.stats()["live_allocations"]
    with sb.upload(data(rng, (64,), "float32"), wait=True) as t:
        assert sb.stats()["live_allocations"] == before + 1
        assert "DeviceTensor" in repr(t) and "float32" in repr(t)
    assert t.freed and sb.stats()["live_allocations"] == before
    with pytest.raises(devbridge.Closed):
        t.view()


def test_free_with_a_live_view_is_deferred(sb, rng):
    before = sb.stats()["live_allocations"]
    a = data(rng, (8, 8), "float32")
    with sb.upload(a, wait=True) as t:
        view = t.view()
        assert view.shape == (8, 8) and view.dtype == "float32"
    assert sb.stats()["live_allocations"] == before + 1  # the view still reads it
    view.close()
    assert sb.stats()["live_allocations"] == before


def test_to_tinygrad_equals_the_data(sb, rng):
    pytest.importorskip("tinygrad")
    a = data(rng, (32, 16), "float32")
    with sb.upload(a, wait=True) as t:
        try:
            tensor = t.to_tinygrad()
        except devbridge.Unsupported as error:
            pytest.skip(f"{sb.backend}: {error}")
        assert tensor.shape == (32, 16)
        assert np.array_equal(tensor.numpy(), a)
        del tensor
        collect()


def test_numpy_via_dlpack(sb, rng):
    a = data(rng, (10, 10), "int16")
    with sb.upload(a, wait=True) as t:
        if t.__dlpack_device__()[0] != 1:  # kDLCPU: numpy reads only host memory
            pytest.skip(f"{sb.backend} memory is not host memory")
        view = np.from_dlpack(t)
        assert np.array_equal(view, a)
        del view
        gc.collect()


# ----------------------------------------------------------------------------- fake: completions, failures


@pytest.fixture
def fake(fake_bridge):
    return fake_bridge  # 1 MiB ring, completions driven by the test


def test_upload_without_wait_returns_before_the_copies_complete(fake, rng):
    a = data(rng, (1000,), "float32")
    t = fake.upload(a)
    assert not t.ready() and fake.stats()["ring_used"] > 0
    assert t.wait(timeout=0.01) is False
    assert "pending" in repr(t)
    fake.fake.complete_all()
    assert t.ready() and quiet(fake) == (0, 0, 0)  # ready() handed the range back
    fake.fake.set_auto_complete(True)
    assert np.array_equal(t.numpy(), a)
    t.free()


@pytest.mark.parametrize("nth", [1, 3, 12])
def test_a_chunk_failing_at_submit_leaves_nothing_behind(fake, rng, nth):
    fake.fake.set_auto_complete(True)
    before = fake.stats()["live_allocations"], fake.fake.live_allocations()
    a = data(rng, (3 << 20,), "uint8")  # 12 chunks of 256 KiB
    fake.fake.inject("copy_h2d", "copy_failed_at_submit", nth=nth)
    with pytest.raises(devbridge.DeviceCopyFailed, match=f"upload chunk {nth - 1} "):
        fake.upload(a)
    assert quiet(fake) == (0, 0, 0)
    assert (fake.stats()["live_allocations"], fake.fake.live_allocations()) == before
    with fake.upload(a, wait=True) as t:  # the bridge is fine
        assert np.array_equal(t.numpy(), a)


def test_a_chunk_failing_at_completion_leaves_nothing_behind(fake, rng):
    fake.fake.set_auto_complete(True)
    before = fake.stats()["live_allocations"]
    a = data(rng, (3 << 20,), "uint8")
    fake.fake.inject("copy_h2d", "copy_failed_at_completion", nth=5)
    with pytest.raises(devbridge.DeviceCopyFailed, match="upload chunk 4 .*bytes 1048576"):
        fake.upload(a, wait=True)
    assert quiet(fake) == (0, 0, 0) and fake.stats()["live_allocations"] == before

    fake.fake.inject("copy_h2d", "copy_failed_at_completion", nth=2)
    t = fake.upload(a)  # no wait: the failure surfaces at wait()/ready(), the ranges go back anyway
    # Worded as upload(wait=True) words it: the device offset and the handle too (they were left out).
    with pytest.raises(devbridge.DeviceCopyFailed,
                       match=fr"upload chunk 1 \(bytes \d+\.\.\d+ of {a.nbytes}, device offset \d+ of handle "
                             fr"\{{domain {t.handle.domain}, generation 1, id {t.handle.id:#x}\}}\): "):
        t.wait()
    with pytest.raises(devbridge.DeviceCopyFailed, match="upload chunk 1 "):
        t.ready()
    assert quiet(fake) == (0, 0, 0)
    t.free()
    assert fake.stats()["live_allocations"] == before


def test_a_download_chunk_failing_leaves_nothing_behind(fake, rng):
    fake.fake.set_auto_complete(True)
    a = data(rng, (3 << 20,), "uint8")
    with fake.upload(a, wait=True) as t:
        fake.fake.inject("copy_d2h", "copy_failed_at_completion", nth=2)
        with pytest.raises(devbridge.OutputCopyFailed, match="download chunk 1 "):
            fake.download(t)
        assert quiet(fake) == (0, 0, 0)
        fake.fake.inject("copy_d2h", "copy_failed_at_submit", nth=7)
        with pytest.raises(devbridge.OutputCopyFailed, match="download chunk 6 "):
            fake.download(t)
        assert quiet(fake) == (0, 0, 0)
        assert np.array_equal(fake.download(t), a)


def test_a_ring_held_by_the_caller_is_backpressure_and_nothing_leaks(fake, rng):
    fake.fake.set_auto_complete(True)
    before = fake.stats()["live_allocations"]
    held = fake.ring.reserve(RING)
    with pytest.raises(devbridge.Backpressure, match="upload chunk 0"):
        fake.upload(data(rng, (4096,), "uint8"))
    assert fake.stats()["live_allocations"] == before
    fake.ring.release(held)
    assert quiet(fake) == (0, 0, 0)


def test_uploads_wait_for_room_held_by_earlier_uploads(fake, rng):
    fake.fake.set_auto_complete(True)
    arrays = [data(rng, (700_000,), "uint8") for _ in range(4)]
    tensors = [fake.upload(a) for a in arrays]  # each needs ring room the previous ones still hold
    for t, a in zip(tensors, arrays):
        assert np.array_equal(t.numpy(), a)
        t.free()
    assert quiet(fake) == (0, 0, 0)


def _count_copy_queries(monkeypatch) -> list[str]:
    """The bridge calls a tensor makes about its copies (wait, copy_status), from now on."""
    calls: list[str] = []
    for name in ("wait", "copy_status"):
        real = getattr(devbridge.Bridge, name)
        monkeypatch.setattr(devbridge.Bridge, name, lambda self, *args, _real=real, _name=name, **kwargs: (
            calls.append(_name), _real(self, *args, **kwargs))[1])
    return calls


@pytest.mark.parametrize("seen_by", ["wait", "ready"])
def test_a_tensor_forgets_its_copies_once_it_saw_them_complete(fake, rng, seen_by, monkeypatch):
    a = data(rng, (700_000,), "uint8")  # 3 chunks of the 1 MiB ring, all in flight at once
    t = fake.upload(a)
    assert not t.ready()
    fake.fake.complete_all()
    calls = _count_copy_queries(monkeypatch)
    assert (t.wait() if seen_by == "wait" else t.ready()) is True
    assert len(calls) == 3, "each copy's completion was asked for once"
    calls.clear()
    fake.fake.set_auto_complete(True)
    assert np.array_equal(t.numpy(), a)
    with t.view() as view:
        assert view.shape == a.shape
    assert t.ready() and t.wait() and "ready" in repr(t)
    assert calls == [], "a ready tensor asked the bridge about its finished copies again"
    t.free()
    assert quiet(fake) == (0, 0, 0)


def test_a_failed_copy_is_still_raised_on_every_wait(fake, rng):
    fake.fake.set_auto_complete(True)
    fake.fake.inject("copy_h2d", "copy_failed_at_completion", nth=2)
    t = fake.upload(data(rng, (3 << 20,), "uint8"))
    for _ in range(2):
        with pytest.raises(devbridge.DeviceCopyFailed, match="upload chunk 1 "):
            t.wait()
        with pytest.raises(devbridge.DeviceCopyFailed, match="upload chunk 1 "):
            t.ready()
    t.free()


@pytest.mark.parametrize("seen", ["waited", "not waited", "wait=True"])
def test_after_a_restart_a_finished_upload_names_its_handle_not_a_copy(sb, rng, seen):
    a = data(rng, (3 << 20,), "uint8")
    t = sb.upload(a, wait=seen == "wait=True")
    if seen == "waited":
        assert t.wait() and t.ready()
    sb.restart(sb.generation + 1)  # quiesces: a copy still in flight ends first
    generation = t.handle.generation
    expected = (rf"handle \{{domain {t.handle.domain}, generation {generation}, id 0x{t.handle.id:x}\}} is from "
                rf"generation {generation}, the bridge is at generation {generation + 1}")
    uses = {"numpy()": t.numpy, "view()": t.view, "from_dlpack": lambda: np.from_dlpack(t),
            "download": lambda: sb.download(t), "wait()": t.wait, "ready()": t.ready,
            "to_tinygrad()": t.to_tinygrad}
    for name, use in uses.items():
        with pytest.raises(devbridge.OldGenerationHandle) as caught:
            use()
        message = str(caught.value)
        assert "chunk" not in message and "copy event" not in message, f"{name}: {message}"
        assert caught.match(expected), f"{name}: {message}"
    with pytest.raises(devbridge.OldGenerationHandle, match=expected):
        sb.download(t.handle)  # the same words
    t.free()  # a restart retired it: nothing to free, nothing raised


def test_after_close_a_finished_upload_names_its_handle_not_a_copy(sb, rng):
    t = sb.upload(data(rng, (3 << 20,), "uint8"))
    done = sb.upload(data(rng, (1000,), "float32"), wait=True)
    assert t.wait()
    sb.close()
    for tensor in (t, done):
        for use in (tensor.numpy, tensor.view, tensor.wait, tensor.ready, lambda: np.from_dlpack(tensor)):
            with pytest.raises(devbridge.Closed) as caught:
                use()
            assert "chunk" not in str(caught.value) and repr(tensor.handle) in str(caught.value), str(caught.value)
        tensor.free()


# ----------------------------------------------------------------------------------- ReleaseQueue & co


def _staged_copy(b, h, nbytes=4096):
    r = b.ring.reserve(nbytes)
    return r, b.host_to_device(r, h)


def test_release_queue_releases_completed_and_failed_ranges(fake):
    h = fake.alloc(devbridge.ObjectSpec(1 << 20, 64, "uint8"), 8192)
    q = devbridge.ReleaseQueue(fake)
    r1, e1 = _staged_copy(fake, h)
    q.add(r1, e1)
    assert q.reap() == 0 and len(q) == 1
    fake.fake.complete(e1)
    assert q.reap() == 1 and len(q) == 0
    fake.fake.inject("copy_h2d", "copy_failed_at_completion")
    r2, e2 = _staged_copy(fake, h)
    q.add(r2, e2)
    fake.fake.complete_all()
    with pytest.raises(devbridge.DeviceCopyFailed):
        q.reap()  # the range went back, and the failure is raised once
    assert q.reap() == 0 and quiet(fake) == (0, 0, 0)
    with pytest.raises(TypeError):
        q.add("range", e1)
    fake.free(h)


def test_release_queue_drains_and_is_a_context_manager(fake):
    h = fake.alloc(devbridge.ObjectSpec(1 << 20, 64, "uint8"), 8192)
    with devbridge.ReleaseQueue(fake) as q:
        for _ in range(3):
            q.add(*_staged_copy(fake, h, 1024))
        assert q.drain(timeout=0.01) is False and len(q) == 3
        fake.fake.set_auto_complete(True)
        fake.fake.complete_all()
    assert len(q) == 0 and quiet(fake) == (0, 0, 0)
    fake.free(h)


def test_bridge_release_host_after_needs_no_polling(fake):
    h = fake.alloc(devbridge.ObjectSpec(1 << 20, 64, "uint8"), 1 << 20)
    for _ in range(2):
        r, e = _staged_copy(fake, h, RING // 2)
        fake.release_host_after(r, e)
    assert fake.stats()["ring_releases_pending"] == 2
    with pytest.raises(devbridge.Backpressure):
        fake.ring.reserve(RING // 2)  # both copies still read their ranges
    fake.fake.complete_all()
    r = fake.ring.reserve(RING // 2)  # the bridge released them before looking for room: no poll, no release
    fake.ring.release(r)
    assert quiet(fake) == (0, 0, 0) and fake.stats()["ring_releases_pending"] == 0
    # A failed copy's range goes back too; its error stays the event's, raised by whoever waits for it.
    fake.fake.inject("copy_h2d", "copy_failed_at_completion")
    r, e = _staged_copy(fake, h)
    fake.release_host_after(r, e)
    fake.fake.complete_all()
    with pytest.raises(devbridge.DeviceCopyFailed):
        fake.wait(e)  # applies the completion: the range is back
    assert quiet(fake) == (0, 0, 0)
    # An event already settled releases at once.
    r, e = _staged_copy(fake, h)
    fake.fake.complete_all()
    fake.wait(e)
    fake.release_host_after(r, e)
    assert quiet(fake) == (0, 0, 0)
    fake.free(h)


def test_release_when_safe_is_release_host_after_bound_in_the_extension(fake):
    # One mechanism, in the core: nothing attached to the extension's classes at import.
    ext = devbridge._devbridge
    assert "release_when_safe" in ext.Bridge.__dict__ and "release_host_after" in ext.Bridge.__dict__
    assert "reserve" in ext.HostRing.__dict__ and not callable(getattr(ext.HostRing.reserve, "__code__", None))
    assert not hasattr(fake.ring, "release_when_safe")
    h = fake.alloc(devbridge.ObjectSpec(1 << 20, 64, "uint8"), 8192)
    r, e = _staged_copy(fake, h)
    fake.release_when_safe(r, e)
    assert fake.stats()["ring_releases_pending"] == 1
    fake.fake.complete_all()
    fake.poll()
    assert quiet(fake) == (0, 0, 0) and fake.stats()["ring_releases_pending"] == 0
    fake.free(h)


def test_release_host_after_refuses_wrong_events_and_ranges(fake):
    other = make_bridge("fake", ring_bytes=RING)
    try:
        h = fake.alloc(devbridge.ObjectSpec(1 << 20, 64, "uint8"), 8192)
        r, e = _staged_copy(fake, h)
        h2 = other.alloc(devbridge.ObjectSpec(1 << 20, 64, "uint8"), 8192)
        r2, e2 = _staged_copy(other, h2)
        with pytest.raises(devbridge.ForeignDomain):
            fake.release_host_after(r, e2)
        with pytest.raises(devbridge.InvalidRange, match="release_host_after"):
            fake.release_host_after(devbridge.HostRange(r.offset, r.len // 2), e)
        with pytest.raises(TypeError):
            fake.release_host_after("range", e)
        fake.release_host_after(r, e)
        with pytest.raises(devbridge.InvalidRange, match="already waiting"):
            fake.release_host_after(r, e)
        # A restart releases the waiting ranges once the device is idle; the old event is refused then.
        fake.restart(fake.generation + 1)
        assert quiet(fake) == (0, 0, 0) and fake.stats()["ring_releases_pending"] == 0
        r = fake.ring.reserve(64)
        with pytest.raises(devbridge.OldGenerationHandle):
            fake.release_host_after(r, e)
        fake.ring.release(r)
        other.fake.complete_all()
        other.wait(e2)
        other.ring.release(r2)
    finally:
        other.close()


def test_waiting_reserve_is_woken_by_a_pending_release(fake):
    import threading

    h = fake.alloc(devbridge.ObjectSpec(1 << 20, 64, "uint8"), 1 << 20)
    r, e = _staged_copy(fake, h, RING)
    fake.release_host_after(r, e)
    got = []
    waiter = threading.Thread(target=lambda: got.append(fake.ring.reserve(RING // 2, timeout=10.0)))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive()  # the copy still reads the whole ring
    fake.fake.complete_all()  # nobody polls: the waiting reserve applies the completion itself
    waiter.join(10.0)
    assert not waiter.is_alive() and len(got) == 1
    fake.ring.release(got[0])
    assert quiet(fake) == (0, 0, 0)
    fake.free(h)


def test_release_host_after_on_any_backend(sb):
    h = sb.alloc(devbridge.ObjectSpec(1 << 20, 64, "uint8"), 4096)
    r, e = _staged_copy(sb, h)
    sb.release_host_after(r, e)
    sb.wait(e)  # the bridge applies the completion and releases the range with it
    assert quiet(sb) == (0, 0, 0)
    sb.free(h)


@pytest.mark.parametrize("backend", ["host", "fake"])
def test_threads_sharing_a_small_ring_wait_for_each_others_room(backend):
    """Uploads and downloads from several threads through a ring that holds one of them at a time: a call short of
    room another call's chunks hold waits for them to finish (PYTHON.md: Backpressure only when nothing of the
    staging layer's holds the room) instead of failing beside a neighbour that is only busy."""

    b = make_bridge(backend, ring_bytes=1 << 20)
    if backend == "fake":
        b.fake.set_auto_complete(True)
    try:
        data = np.arange(200000, dtype=np.float32)  # 800 KB: ring chunks, not a registration

        def work():
            for _ in range(40):
                t = b.upload(data, wait=True)
                assert np.array_equal(t.numpy(), data)
                t.free()

        failures = run_in_threads(work, 3)
        assert not failures, failures[:3]
        assert b.stats()["live_allocations"] == 0
    finally:
        b.close()


def test_a_tensor_dropped_without_free_is_freed_when_collected(sb):
    """As the memory of any Python object: temporary tensors (b.download(b.upload(a))) leave nothing behind; one
    a view still reads goes once the view does; adopted memory goes back to its owner."""
    b = sb
    data = np.arange(4096, dtype=np.float32)
    before = b.stats()["live_allocations"]
    for _ in range(20):
        assert np.array_equal(b.download(b.upload(data, wait=True)), data)
    collect()
    assert b.stats()["live_allocations"] == before
    view = b.upload(data, wait=True).view()
    collect()
    assert b.stats()["live_allocations"] == before + 1, "the view still reads it"
    if view.__dlpack_device__()[0] == 1:  # a DLPack array on the CPU outlives the view and holds it too
        arr = np.from_dlpack(view)
        view.close()
        assert np.array_equal(arr, data)
        del arr
    else:
        view.close()
    collect()
    assert b.stats()["live_allocations"] == before
    if b.backend == "host":
        frozen = np.ones(1024, np.float32)
        frozen.flags.writeable = False
        for _ in range(3):
            b.adopt(frozen).numpy()
        collect()
        assert b.stats()["adopted_allocations"] == 0 and b.stats()["host_regions"] == 0


def test_uploads_side_by_side_are_refused_at_once_when_the_caller_holds_the_ring():
    # The ring frees in order: a range the caller keeps blocks its next lap. One thread's uploads then get
    # Backpressure at once; threads side by side each waited 60 s (kWaitForOtherTransfers) for room they
    # took one another to hold while none held any, again on every call.
    import time

    require_backend("host")
    with devbridge.Bridge(backend="host", ring_bytes=8 << 20) as b:
        kept = b.ring.reserve(4096)
        slowest: list[float] = []

        def uploads():
            tensors = []
            for k in range(40):
                started = time.monotonic()
                try:
                    tensors.append(b.upload(np.ones(70_000, np.float32), wait=bool(k % 2)))
                except devbridge.Backpressure:
                    pass
                slowest.append(time.monotonic() - started)
                if len(tensors) > 8:
                    tensors.clear()

        errors = run_in_threads(uploads, 3, timeout=120)
        assert not errors, errors
        assert max(slowest) < 20, f"an upload waited {max(slowest):.1f} s for room nobody but the caller held"
        b.ring.release(kept)
        b.upload(np.ones(70_000, np.float32), wait=True)  # the ring laps again


@pytest.mark.parametrize("use", ["view", "numpy"])
def test_a_tensor_freed_by_another_thread_during_a_call_is_closed_not_an_unknown_handle(use):
    """Another thread's free() that overtakes a call after its own check (the probe saw 2-8 % of calls): the
    caller is told Closed, as after the free, not UnknownDeviceHandle naming a handle it never freed. The
    other thread is played by the tensor's wait(), which the call makes after its check."""
    with make_bridge("host") as b:
        t = b.upload(np.arange(16, dtype=np.float32), wait=True)
        real_wait = t.wait

        def wait_then_freed_elsewhere(timeout=None):
            done = real_wait(timeout)
            t.free()
            return done

        t.wait = wait_then_freed_elsewhere
        with pytest.raises(devbridge.Closed, match="was freed .by another thread. during the call"):
            getattr(t, use)()
        assert b.stats()["live_allocations"] == 0
