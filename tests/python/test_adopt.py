"""Adopted host memory (Bridge.adopt / Bridge.adopt_host) from Python: an immutable buffer used in place
as a read-only tensor, with no copy, on the backends whose device memory is host memory (host; the fake
underneath, in C++), refused with Unsupported elsewhere.

Every write path is tried against an adopted tensor and must be refused without changing a byte; every
consumer (numpy over DLPack, tinygrad, downloads) must read the buffer itself; and the buffer must stay
held exactly as long as the bridge may read it: past free() while a view reads it, past a restart that
leaves it under a DLPack array, and no longer.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import devbridge
from conftest import require_backend

RING = 1 << 20


def open_bridge(name: str = "host") -> devbridge.Bridge:
    require_backend(name)
    return devbridge.Bridge(backend=name, ring_bytes=RING)


def immutable(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a


def test_an_adopted_array_is_the_tensor_itself_and_every_consumer_reads_it_in_place():
    b = open_bridge()
    a = immutable(np.random.default_rng(0).standard_normal((64, 33), dtype=np.float32))
    before = b.stats()["copies_submitted"]
    t = b.adopt(a)
    assert t.read_only and t.shape == (64, 33) and t.dtype == "float32"
    assert b.stats()["copies_submitted"] == before, "adopting copies nothing"
    assert b.stats()["adopted_allocations"] == 1 and b.stats()["adopted_bytes"] == a.nbytes
    assert b.memory_stats()["allocated_bytes"] == 0
    with t.view() as view:
        assert view.read_only and view.ptr == a.ctypes.data
        n = np.from_dlpack(view)                 # DLPack 1.0: the read-only flag reaches numpy
        assert not n.flags.writeable and np.shares_memory(n, a) and np.array_equal(n, a)
        with pytest.raises(BufferError, match="read-only"):
            view.__dlpack__()                    # the unversioned capsule cannot say read-only
    del n
    assert np.array_equal(t.numpy(), a)          # a download reads it as any allocation
    tinygrad = pytest.importorskip("tinygrad")
    from tinygrad.helpers import Context
    with Context(DEV="CPU"):
        doubled = (t.to_tinygrad() * 2).numpy()
    assert np.array_equal(doubled, a * 2)
    t.free()
    collect()
    assert b.stats()["adopted_allocations"] == 0
    b.close()


def collect() -> None:
    for _ in range(3):
        gc.collect()


def test_every_write_into_an_adopted_tensor_is_refused_and_changes_nothing():
    b = open_bridge()
    a = immutable(np.arange(1024, dtype=np.float32))
    t = b.adopt(a)
    other = b.upload(np.ones(1024, np.float32), wait=True)
    r = b.ring.reserve(4096)
    with pytest.raises(devbridge.InvalidRange, match="read-only"):
        b.host_to_device(r, t.handle, mode="sync")
    with pytest.raises(devbridge.InvalidRange, match="read-only"):
        b.wait(b.host_to_device(r, t.handle, mode="async"))
    with pytest.raises(devbridge.InvalidRange, match="read-only"):
        b.axpy(other.handle, t.handle, 2.0, 1.0)
    region = b.register_host(np.zeros(1024, np.float32), writable=False)
    with pytest.raises(devbridge.InvalidRange, match="read-only"):
        b.host_to_device(region.range(0, 4096), t.handle, mode="sync")
    region.unregister()
    b.ring.release(r)
    assert np.array_equal(a, np.arange(1024, dtype=np.float32)) and np.array_equal(t.numpy(), a)
    # It is a launch's input like any allocation.
    b.axpy(t.handle, other.handle, 2.0, 1.0)
    assert np.array_equal(other.numpy(), a * 2 + 1)
    t.free()
    other.free()
    b.close()


def test_adoption_is_validated():
    b = open_bridge()
    with pytest.raises(ValueError, match="C-contiguous"):
        b.adopt(immutable(np.zeros((8, 8), np.float32))[:, ::2])
    with pytest.raises(ValueError, match="empty"):
        b.adopt(immutable(np.zeros((0, 4), np.float32)))
    with pytest.raises(ValueError, match="item"):
        b.adopt(immutable(np.zeros(8, np.float32)), dtype="float16")
    writable = b.register_host(np.zeros(4096, np.uint8))
    spec = devbridge.ObjectSpec(max_extent=4096, alignment=64, dtype="uint8")
    with pytest.raises(devbridge.InvalidRange, match="read-only"):
        b.adopt_host(writable, spec)             # a writable region could be a copy's source and destination
    ro = b.register_host(immutable(np.zeros(8192, np.uint8)), writable=False)
    with pytest.raises(devbridge.InvalidAlignment):
        b.adopt_host(ro.range(1, 4096), spec)
    with pytest.raises(TypeError, match="RegionRange"):
        b.adopt_host(b.ring.reserve(64), spec)
    assert b.stats()["live_allocations"] == 0
    # The same buffer adopted twice shares one registration.
    a = immutable(np.arange(256, dtype=np.int32))
    t1, t2 = b.adopt(a), b.adopt(a)
    assert b.stats()["adopted_allocations"] == 2 and np.array_equal(t2.numpy(), a)
    t1.free()
    assert np.array_equal(t2.numpy(), a)
    t2.free()
    b.close()


def test_the_buffer_is_held_while_the_bridge_may_read_it_and_no_longer():
    b = open_bridge()
    a = immutable(np.arange(4096, dtype=np.float32))
    regions_before = b.stats()["host_regions"]
    t = b.adopt(a)
    n = np.from_dlpack(t)                        # a DLPack array outlives free(): the free is deferred
    t.free()
    assert b.stats()["adopted_allocations"] == 1
    del n
    collect()
    assert b.stats()["adopted_allocations"] == 0
    b.free(b.alloc(devbridge.ObjectSpec(max_extent=64, alignment=64, dtype="uint8"), 64))  # reaps the region
    assert b.stats()["host_regions"] == regions_before
    # Across a restart: the orphan a DLPack array reads keeps its region (and the buffer) until it goes.
    t = b.adopt(a)
    n = np.from_dlpack(t)
    b.restart(2)
    stats = b.stats()
    assert stats["orphaned_allocations"] == 1 and stats["host_regions"] == 1
    assert np.array_equal(n, a)
    del n
    collect()
    assert b.stats()["orphaned_allocations"] == 0 and b.stats()["host_regions"] == 0
    again = b.adopt(a)                           # the memory registers again in the new generation
    assert np.array_equal(again.numpy(), a)
    again.free()
    b.close()


def test_the_fake_adopts_too_and_refuses_a_use_after_release():
    b = open_bridge("fake")
    b.fake.set_auto_complete(True)
    a = immutable(np.arange(512, dtype=np.uint16))
    t = b.adopt(a)
    assert np.array_equal(t.numpy(), a)
    handle = t.handle
    t.free()
    with pytest.raises(devbridge.UnknownDeviceHandle):
        b.download(handle, dtype="uint16", shape=(512,))
    assert b.stats()["adopted_allocations"] == 0
    b.close()


def test_opencl_adopts_the_registration_buffer_itself():
    b = open_bridge("opencl")
    a = immutable(np.random.default_rng(2).standard_normal(4096, dtype=np.float32))
    t = b.adopt(a)                               # the region's CL_MEM_USE_HOST_PTR buffer, retained
    assert t.read_only and np.array_equal(t.numpy(), a)
    out = b.upload(np.zeros(4096, np.float32), wait=True)
    b.axpy(t.handle, out.handle, 2.0, 0.0)       # a kernel reads it
    assert np.array_equal(out.numpy(), a * 2)
    with pytest.raises(devbridge.InvalidRange, match="read-only"):
        b.axpy(out.handle, t.handle, 1.0, 0.0)
    t.free()
    out.free()
    assert b.stats()["adopted_allocations"] == 0
    b.close()


def test_cuda_refuses_adoption():
    b = open_bridge("cuda")
    with pytest.raises(devbridge.Unsupported, match="adopt_host"):
        b.adopt(immutable(np.zeros(1024, np.float32)))
    assert b.stats()["host_regions"] == 0 and b.stats()["live_allocations"] == 0
    b.close()


def test_memory_only_a_dlpack_capsule_describes_is_adopted_only_when_it_says_read_only():
    """A bfloat16 tensor numpy cannot import is read through its capsule: a producer's writable memory is refused
    as a writable numpy array is (its owner could change the tensor under every view), while a DLPack >= 1.0
    capsule that flags its memory read-only (a devbridge view of adopted memory) is adopted."""
    torch = pytest.importorskip("torch")
    b = devbridge.Bridge(backend="host", ring_bytes=1 << 20)
    try:
        with pytest.raises(ValueError, match="writable"):
            b.adopt(torch.zeros(8, dtype=torch.bfloat16))
        source = b.adopt(immutable(np.arange(8, dtype=np.uint16)), dtype="bfloat16")
        with source.view() as view:
            again = b.adopt(view)
            assert again.read_only and again.dtype == "bfloat16"
            assert np.array_equal(again.numpy().view(np.uint16), np.arange(8, dtype=np.uint16))
            again.free()
        source.free()
    finally:
        b.close()


@pytest.mark.parametrize("backend", ["host", "fake"])
def test_the_buffer_is_let_go_when_the_last_reader_of_a_freed_adopted_tensor_goes(backend, tmp_path):
    # The tensor is freed while a numpy array still reads it; once that array goes, the region is unregistered
    # and the mmap's export ended, with no further call into the bridge: the owner can close its mmap.
    import mmap

    require_backend(backend)
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (1 << 20))
    with open(path, "rb") as f, devbridge.Bridge(backend=backend, ring_bytes=1 << 20) as b:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        a = np.frombuffer(mm, dtype=np.float32)
        t = b.adopt(a)
        x = np.from_dlpack(t)
        t.free()
        assert b.stats()["host_regions"] == 1, "the array still reads it"
        del x, t, a
        gc.collect()
        mm.close()  # BufferError while the bridge held the export
        assert b.stats()["host_regions"] == 0
