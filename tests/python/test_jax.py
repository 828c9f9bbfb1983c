"""jax as a DLPack consumer of devbridge views (host memory: the host and fake backends).

jax arrays are immutable, so they are the consumer the writes-under-view guard exists for: an upload
into an allocation a jax array reads is refused by default, and the array keeps the values it had.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import devbridge
from conftest import collect, random_array, views_settle

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jax.config.update("jax_enable_x64", True)  # float64 and 64-bit integers arrive as themselves


@pytest.fixture(params=["host", "fake"])
def jb(request):
    b = devbridge.Bridge(backend=request.param, ring_bytes=1 << 20)
    if request.param == "fake":
        b.fake.set_auto_complete(True)
    yield b
    collect()
    b.close()


def _filled(b, data: np.ndarray, alignment: int = 4096):
    """An allocation holding `data` (aligned as XLA wants for zero-copy import)."""
    h = b.alloc(devbridge.ObjectSpec(1 << 24, alignment, data.dtype.name),
                max(alignment, -(-data.nbytes // alignment) * alignment))
    r = b.ring.reserve(data.nbytes)
    b.ring.ndarray(r, "uint8")[:] = np.frombuffer(data.tobytes(), np.uint8)
    b.wait(b.host_to_device(r, h))
    b.ring.release(r)
    return h


def test_jax_reads_a_view_zero_copy_and_holds_its_lease(jb, rng):
    x = random_array(rng, (32, 32), "float32")
    h = _filled(jb, x)
    view = jb.view(h, "float32", x.shape)
    a = jnp.from_dlpack(view)
    assert a.unsafe_buffer_pointer() == view.ptr  # the same memory, not a copy
    np.testing.assert_array_equal(np.asarray(a), x)
    np.testing.assert_allclose(np.asarray(a * 2 + 1), x * 2 + 1, rtol=1e-6)
    view.close()
    assert jb.stats()["live_views"] == 1  # the jax array's own lease
    with pytest.raises(devbridge.AllocationStillInUse, match="held by a DLPack consumer"):
        jb.free(h)
    del a
    assert views_settle(jb) == 0
    jb.free(h)


def test_an_upload_under_a_jax_array_is_refused_and_the_array_keeps_its_values(jb, rng):
    x = random_array(rng, 1024, "float32")
    h = _filled(jb, x)
    with jb.view(h, "float32", 1024) as view:
        a = jnp.from_dlpack(view)
    r = jb.ring.reserve(x.nbytes)
    jb.ring.ndarray(r, "float32")[:] = 0
    with pytest.raises(devbridge.AllocationStillInUse, match="1 live view held by a DLPack consumer"):
        jb.host_to_device(r, h)
    np.testing.assert_array_equal(np.asarray(a), x)  # immutable, as jax promises
    del a
    assert views_settle(jb) == 0
    jb.wait(jb.host_to_device(r, h))  # nobody reads it any more
    jb.ring.release(r)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8",
                                   "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2"])
def test_every_dtype_jax_has_arrives_bit_exact(jb, rng, dtype):
    raw = rng.integers(0, 256, size=256 * devbridge.dtype_info(dtype)["itemsize"], dtype=np.uint8)
    if dtype == "bool":
        raw = (raw & 1).astype(np.uint8)
    h_typed = jb.alloc(devbridge.ObjectSpec(1 << 24, 4096, dtype), 4096)
    r = jb.ring.reserve(raw.nbytes)
    jb.ring.ndarray(r, "uint8")[:] = raw
    jb.wait(jb.host_to_device(r, h_typed))
    jb.ring.release(r)
    with jb.view(h_typed, dtype, 256) as view:
        a = jnp.from_dlpack(view)
    assert str(a.dtype) == dtype
    assert np.asarray(a).view(np.uint8).tobytes() == raw.tobytes()
    del a


def test_a_jax_array_outlives_a_restart_and_a_close(rng):
    b = devbridge.Bridge(backend="host", ring_bytes=1 << 20)
    x = random_array(rng, 512, "float32")
    h = _filled(b, x)
    with b.view(h, "float32", 512) as view:
        a = jnp.from_dlpack(view)
    b.restart(2)
    assert b.stats()["orphaned_allocations"] == 1
    np.testing.assert_array_equal(np.asarray(a), x)  # the memory stays until the array lets go
    b.close()
    np.testing.assert_array_equal(np.asarray(a + 0), x)
    del a
    gc.collect()


def test_imports_by_jax_leave_nothing_behind():
    """XLA takes a capsule by renaming it and clearing its destructor, which DLPack allows: the export is then the
    deleter's alone to free. Measured as the C heap's bytes in use (glibc's mallinfo2) over thousands of imports."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc without mallinfo2")
    libc.mallinfo2.restype = MallInfo2
    b = devbridge.Bridge(backend="host", ring_bytes=1 << 20)
    try:
        t = b.upload(np.arange(1024, dtype=np.float32), wait=True)
        with t.view() as view:
            for _ in range(1000):  # jax's own caches settle first
                jax.dlpack.from_dlpack(view)
            collect()
            before = libc.mallinfo2().uordblks
            imports = 20000
            for _ in range(imports):
                jax.dlpack.from_dlpack(view)
            collect()
            grown = (libc.mallinfo2().uordblks - before) / imports
        assert grown < 64, f"{grown:.0f} bytes of C heap kept per import"
        assert views_settle(b) == 0
        t.free()
    finally:
        b.close()
