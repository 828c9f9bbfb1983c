"""DLPack export of views: numpy.from_dlpack is zero-copy, the deleter ends the lease, stream rules."""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

import devbridge
from conftest import download, random_array, upload

F32 = devbridge.ObjectSpec(max_extent=1 << 20, alignment=64, dtype="float32")


@pytest.fixture(params=["host", "fake"])
def cpu_bridge(request):
    """Backends whose views are host memory numpy can read."""
    b = devbridge.Bridge(backend=request.param, ring_bytes=1 << 20)
    if request.param == "fake":
        b.fake.set_auto_complete(True)  # these tests are about views, not completions
    yield b
    gc.collect()
    b.close()


def test_from_dlpack_is_zero_copy(cpu_bridge, rng):
    b = cpu_bridge
    x = random_array(rng, (32, 16), "float32")
    h = b.alloc(F32, x.nbytes)
    upload(b, h, x)
    with b.view(h, "float32", x.shape) as view:
        assert view.__dlpack_device__() == (1, 0)
        arr = np.from_dlpack(view)
        assert arr.__array_interface__["data"][0] == view.ptr
        assert arr.shape == x.shape and arr.dtype == np.float32
        np.testing.assert_array_equal(arr, x)
        # Same memory both ways: a write through numpy is what the device holds.
        y = random_array(rng, x.shape, "float32")
        arr[...] = y
        np.testing.assert_array_equal(download(b, h, x.nbytes, "float32").reshape(x.shape), y)
        # And a second export aliases the first.
        assert np.shares_memory(arr, np.from_dlpack(view))
    del arr
    gc.collect()
    b.free(h)


def test_strided_and_offset_views_export_their_layout(cpu_bridge, rng):
    b = cpu_bridge
    x = random_array(rng, (16, 16), "float32")
    h = b.alloc(F32, x.nbytes)
    upload(b, h, x)
    # Every other column of rows 1.., starting one row in.
    with b.view(h, "float32", (15, 8), strides=(16, 2), offset=16 * 4) as view:
        arr = np.from_dlpack(view)
        assert arr.strides == (16 * 4, 2 * 4)
        np.testing.assert_array_equal(arr, x[1:, ::2])
    del arr
    gc.collect()
    b.free(h)


def test_the_deleter_ends_the_lease(cpu_bridge):
    b = cpu_bridge
    h = b.alloc(F32, 4096)
    view = b.view(h, "float32", 1024)
    arr = np.from_dlpack(view)
    assert b.stats()["live_views"] == 2
    view.close()
    assert b.stats()["live_views"] == 1
    with pytest.raises(devbridge.AllocationStillInUse):
        b.free(h)  # numpy still reads it
    del arr
    gc.collect()
    assert b.stats()["live_views"] == 0
    b.free(h)


def test_an_unconsumed_capsule_ends_its_lease(cpu_bridge):
    b = cpu_bridge
    h = b.alloc(F32, 4096)
    with b.view(h, "float32", 1024) as view:
        capsule = view.__dlpack__()
        assert type(capsule).__name__ == "PyCapsule"
        assert b.stats()["live_views"] == 2
        del capsule
        gc.collect()
        assert b.stats()["live_views"] == 1
    b.free(h)


def capsule_name(capsule) -> str:
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    return get_name(capsule).decode()


def test_capsule_abi_follows_max_version(cpu_bridge):
    b = cpu_bridge
    h = b.alloc(F32, 4096)
    with b.view(h, "float32", 1024) as view:
        assert capsule_name(view.__dlpack__()) == "dltensor"  # a consumer that names no version
        assert capsule_name(view.__dlpack__(max_version=(0, 8))) == "dltensor"
        assert capsule_name(view.__dlpack__(max_version=(1, 0))) == "dltensor_versioned"
        assert capsule_name(view.__dlpack__(max_version=(1, 3))) == "dltensor_versioned"
        # numpy asks for the versioned ABI, whose flags say the memory is writable.
        assert np.from_dlpack(view).flags.writeable
    gc.collect()
    assert b.stats()["live_views"] == 0
    b.free(h)


def test_stream_and_device_arguments_follow_the_spec(cpu_bridge):
    b = cpu_bridge
    h = b.alloc(F32, 4096)
    with b.view(h, "float32", 1024) as view:
        for ok in ({}, {"stream": None}, {"stream": -1}, {"stream": np.int64(-1)}, {"max_version": (1, 0)},
                   {"max_version": (0, 8)},
                   {"dl_device": (1, 0)}, {"copy": False}, {"copy": None}):
            capsule = view.__dlpack__(**ok)
            del capsule
        for stream in (0, 1, 2, 12345):
            with pytest.raises(BufferError):
                view.__dlpack__(stream=stream)  # host memory has no stream
        with pytest.raises(BufferError):
            view.__dlpack__(dl_device=(2, 0))
        arr = np.from_dlpack(view, device="cpu")
        assert arr.size == 1024
        del arr
    gc.collect()
    assert b.stats()["live_views"] == 0
    b.free(h)


def test_closed_and_stale_views_do_not_export(cpu_bridge):
    b = cpu_bridge
    h = b.alloc(F32, 4096)
    view = b.view(h, "float32", 1024)
    view.close()
    with pytest.raises(devbridge.Closed):
        view.__dlpack__()
    view = b.view(h, "float32", 1024)
    array = np.from_dlpack(view)
    b.restart(b.generation + 1)
    with pytest.raises(devbridge.OldGenerationHandle):
        np.from_dlpack(view)
    assert b.stats()["orphaned_allocations"] == 1  # the array still leases the old memory
    array[:] = 1.0  # still valid memory (ASan-clean), just no longer the worker's
    view.close()
    del array
    assert b.stats()["orphaned_allocations"] == 0


def test_dtypes_export_with_the_right_codes(cpu_bridge, rng):
    b = cpu_bridge
    for dtype in ("int8", "int32", "uint16", "uint64", "float16", "float64", "bool"):
        spec = devbridge.ObjectSpec(1 << 16, 64, dtype)
        h = b.alloc(spec, 1024)
        raw = random_array(rng, 1024, "uint8")
        if dtype == "bool":
            raw = (raw & 1).astype(np.uint8)
        upload(b, h, raw)
        n = 1024 // np.dtype(dtype).itemsize
        with b.view(h, dtype, n) as view:
            arr = np.from_dlpack(view)
            assert arr.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(arr.view(np.uint8), raw)
            del arr
        gc.collect()
        b.free(h)


@pytest.mark.parametrize("stream", ["current", "side"])
def test_torch_consumes_cuda_views_in_place(backend_name, rng, stream):
    """CUDA views through DLPack: zero-copy into torch, on torch's stream (GPU machines only)."""
    if backend_name != "cuda":
        pytest.skip("CUDA views only")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    # torch computes in the device's primary context: a bridge there (no cuda_context).
    b = devbridge.Bridge(backend="cuda")
    try:
        x = random_array(rng, (256, 128), "float32")
        h = b.alloc(F32, x.nbytes)
        upload(b, h, x)
        side = torch.cuda.Stream() if stream == "side" else torch.cuda.current_stream()
        with b.view(h, "float32", x.shape) as view:
            assert view.__dlpack_device__() == (2, b.backend_info()["device_ordinal"])
            with torch.cuda.stream(side):
                t = torch.from_dlpack(view)  # torch passes its stream: ordered after the bridge's work
                assert t.is_cuda and t.data_ptr() == view.ptr and tuple(t.shape) == x.shape
                np.testing.assert_array_equal(t.cpu().numpy(), x)
                t.mul_(2)
            side.synchronize()
            assert b.stats()["live_views"] == 2
        np.testing.assert_array_equal(download(b, h, x.nbytes, "float32").reshape(x.shape), x * 2)
        del t
        gc.collect()
        assert b.stats()["live_views"] == 0
        b.free(h)
    finally:
        gc.collect()
        b.close()


def test_a_consumer_that_calls_the_deleter_and_then_raises_does_not_double_free():
    """torch 2.15 calls the deleter of an OpenCL tensor it cannot take, raises, and leaves the
    capsule named "dltensor", so its destructor calls the deleter again: the export must survive it
    (it aborted the process), and the view's lease must end exactly once."""
    class DLManagedTensor(ctypes.Structure):
        _fields_ = [("dl_tensor", ctypes.c_byte * 48), ("manager_ctx", ctypes.c_void_p),
                    ("deleter", ctypes.CFUNCTYPE(None, ctypes.c_void_p))]

    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    with devbridge.Bridge(backend="host") as bridge:
        t = bridge.upload(np.arange(8, dtype=np.float32), wait=True)
        view = t.view()
        for _ in range(3):
            capsule = view.__dlpack__()
            managed = DLManagedTensor.from_address(get_pointer(capsule, b"dltensor"))
            managed.deleter(ctypes.addressof(managed))  # the consumer's deleter call...
            managed.deleter(ctypes.addressof(managed))  # ...and a second one
            del capsule  # the capsule's destructor calls it once more
        view.close()
        assert bridge.stats()["live_views"] == 0
        t.free()


def test_torch_refusing_an_opencl_view_raises_instead_of_aborting():
    torch = pytest.importorskip("torch")
    try:
        bridge = devbridge.Bridge(backend="opencl")
    except devbridge.BridgeError as e:
        pytest.skip(f"no OpenCL here: {e}")
    with bridge:
        t = bridge.upload(np.arange(8, dtype=np.float32), wait=True)
        view = t.view()
        with pytest.raises(Exception):
            torch.from_dlpack(view)  # torch 2.15 cannot take an OpenCL device
        gc.collect()
        view.close()
        assert bridge.stats()["live_views"] == 0
        t.free()


def test_copy_true_hands_the_consumer_a_copy_of_its_own(cpu_bridge):
    """DLPack's copy=True: the producer copies (row-major, flagged a copy in a versioned capsule) and holds
    nothing of the bridge's; writes into the copy do not reach the tensor."""
    b = cpu_bridge
    data = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = b.upload(data, wait=True)
    with b.view(t.handle, "float32", (4, 6)) as view:
        copied = np.from_dlpack(view, copy=True)
        assert copied.flags.writeable and np.array_equal(copied, data)
        assert not np.shares_memory(copied, np.from_dlpack(view))
        copied[:] = -1
    # A strided view (every other column, reversed rows) copies as its elements read.
    with b.view(t.handle, "float32", (4, 3), strides=(-6, 2), offset=18 * 4) as strided:
        assert np.array_equal(np.from_dlpack(strided, copy=True), data[::-1, ::2])
    assert np.array_equal(t.numpy(), data), "the copy's writes stayed in the copy"
    gc.collect()
    assert b.stats()["live_views"] == 0
    t.free()
