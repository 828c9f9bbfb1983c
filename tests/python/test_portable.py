"""Portable tensors: PortableTensor, export/import, transfer, checkpoint/restore (issue #12).

The matrix runs every dtype over every ordered pair of the backends this machine runs (fake, host,
OpenCL where available; CUDA with DEVBRIDGE_TEST_BACKEND=cuda). Every bridge has a 1 MiB ring and the
matrix tensors are 1.5 MiB, so every path is chunked. Bad input must leave nothing behind: the
bridge's live allocations, ring reservations and copies in flight (and the fake backend's own count)
are checked after each refusal.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import io
import itertools
import json
import os
import stat
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy

import devbridge
from conftest import collect, make_bridge, require_backend, require_dtype
from portable_child import tensors_for

RING = 1 << 20
MATRIX_BYTES = 3 * RING // 2
BACKENDS = ("fake", "host", "opencl", "cuda")
DTYPES = devbridge.dtypes()
# safetensors.numpy has no bfloat16/float8: those go through the package's raw (de)serializer instead.
NUMPY_DTYPES = [d for d in DTYPES if d not in ("bfloat16", "float8_e4m3fn", "float8_e5m2")]
HERE = Path(__file__).resolve().parent


def skip_unless_runs(name: str) -> None:
    require_backend(name)


def open_bridge(name: str, **options) -> devbridge.Bridge:
    skip_unless_runs(name)
    b = make_bridge(name, ring_bytes=RING, **options)
    if name == "fake":
        b.fake.set_auto_complete(True)
    return b


@pytest.fixture
def bridges(request):
    """open(name) -> a bridge on that backend (skipping the test when it cannot run), closed at the end."""
    opened = []

    def open_(name: str, **options) -> devbridge.Bridge:
        opened.append(open_bridge(name, **options))
        return opened[-1]

    yield open_
    collect()
    for b in opened:
        b.close()


@pytest.fixture(params=["fake", "host", "opencl", "cuda"])
def pb(request, bridges):
    return bridges(request.param)


def bits(rng, dtype: str, shape) -> np.ndarray:
    """Random bits of ``dtype`` as the numpy array devbridge downloads it as (bool: 0/1 only)."""
    if dtype == "bool":
        return rng.integers(0, 2, size=shape, dtype=np.uint8).view(np.bool_)
    size = devbridge.dtype_info(dtype)["itemsize"]
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * size, dtype=np.uint8)
    return raw.view(devbridge._intake._numpy_dtype(dtype)).reshape(shape)


def matrix_shape(dtype: str) -> tuple[int, int]:
    return (MATRIX_BYTES // (257 * devbridge.dtype_info(dtype)["itemsize"]), 257)


def footprint(b: devbridge.Bridge) -> tuple[int, ...]:
    """What a failed call must not leave behind."""
    s = b.stats()
    own = (b.fake.live_allocations(),) if b.backend_info()["name"] == "fake" else ()
    return (s["live_allocations"], s["ring_reservations"], s["copies_in_flight"]) + own


def settled_footprint(b: devbridge.Bridge) -> tuple[int, ...]:
    """``footprint`` once completions the backend still owes have been applied."""
    for _ in range(200):
        b.poll()
        s = b.stats()
        if not s["copies_in_flight"]:
            break
        time.sleep(0.005)
    return footprint(b)


# ----------------------------------------------------------------------------------------- the matrix


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("src_name,dst_name", list(itertools.product(BACKENDS, BACKENDS)))
def test_every_dtype_round_trips_between_every_pair(bridges, rng, tmp_path, dtype, src_name, dst_name):
    src, dst = bridges(src_name), bridges(dst_name)
    a = bits(rng, dtype, matrix_shape(dtype))
    if dtype not in src.backend_info()["dtypes"]:  # OpenCL without cl_khr_fp16: float16
        before = footprint(src)
        with pytest.raises(devbridge.UnsupportedDType, match=f"dtype {dtype}"):
            src.upload(a, dtype=dtype, wait=True)
        assert settled_footprint(src) == before
        return
    before = footprint(dst)
    x = src.upload(a, dtype=dtype, wait=True)
    if dtype not in dst.backend_info()["dtypes"]:  # every way in is refused, naming the dtype; nothing allocated
        with pytest.raises(devbridge.UnsupportedDType, match=f"dtype {dtype}"):
            devbridge.transfer(src, x, dst)
        with pytest.raises(devbridge.UnsupportedDType, match=f"dtype {dtype}"):
            dst.import_tensor(src.export(x))
        path = tmp_path / "state.safetensors"
        src.checkpoint(path, {"x": x})
        with pytest.raises(devbridge.UnsupportedDType, match=f"tensor 'x' is {dtype}"):
            dst.restore(path)
        x.free()
        assert settled_footprint(dst) == before
        return

    moved = devbridge.transfer(src, x, dst)
    assert (moved.shape, moved.dtype) == (a.shape, dtype)
    assert dst.download(moved).tobytes() == a.tobytes()

    exported = src.export(x)
    assert (exported.shape, exported.dtype) == (a.shape, dtype)
    assert exported.tobytes() == a.tobytes()
    imported = dst.import_tensor(exported)
    assert dst.download(imported).tobytes() == a.tobytes()

    path = tmp_path / "state.safetensors"
    src.checkpoint(path, {"x": x})
    restored = dst.restore(path)
    assert list(restored) == ["x"] and restored["x"].dtype == dtype and restored["x"].shape == a.shape
    assert dst.download(restored["x"]).tobytes() == a.tobytes()

    for t in (moved, imported, restored["x"]):
        t.free()
    x.free()
    assert settled_footprint(dst) == before


# ---------------------------------------------------------------------------------------- PortableTensor


def test_portable_tensor_is_read_by_numpy_without_a_copy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = devbridge.PortableTensor((3, 4), "float32", a)
    view = np.asarray(t)
    assert view.dtype == np.float32 and view.shape == (3, 4) and np.shares_memory(view, a)
    assert np.shares_memory(t.numpy(), a) and t.data.shape == (3, 4) and t.data.format == "f"
    a[0, 0] = 42
    assert view[0, 0] == 42 and t.nbytes == 48 and t.size == 12 and t.itemsize == 4
    assert t == devbridge.PortableTensor.from_array(a) and t != devbridge.PortableTensor((12,), "float32", a)
    if sys.version_info >= (3, 12):
        assert memoryview(t).shape == (3, 4)


def test_portable_tensor_follows_numpys_copy_protocol():
    # numpy 2's __array__(dtype=None, copy=None): copy=False never copies, and a dtype that needs a copy is
    # ValueError, as for an ndarray; before, np.asarray(t, np.float64, copy=False) returned a converted copy.
    a = np.arange(4, dtype=np.float32)
    t = devbridge.PortableTensor.from_array(a)
    over = t.numpy()  # from_array copied a into t's own bytes
    with pytest.raises(ValueError, match="copy"):
        np.asarray(a, dtype=np.float64, copy=False)  # what an ndarray does
    with pytest.raises(ValueError, match="Unable to avoid copy.*float32.*float64"):
        np.asarray(t, dtype=np.float64, copy=False)
    with pytest.raises(ValueError, match="Unable to avoid copy"):
        t.__array__(np.int32, copy=False)
    for kwargs in ({}, {"dtype": np.float32}, {"copy": False}, {"dtype": np.float32, "copy": False},
                   {"copy": None}):
        same = np.asarray(t, **kwargs)
        assert same.dtype == np.float32 and np.shares_memory(same, over), kwargs
        assert np.shares_memory(t.__array__(**kwargs), over), kwargs
    for kwargs in ({"copy": True}, {"dtype": np.float32, "copy": True}):
        fresh = np.asarray(t, **kwargs)
        assert fresh.dtype == np.float32 and np.array_equal(fresh, a) and not np.shares_memory(fresh, over), kwargs
        assert not np.shares_memory(t.__array__(**kwargs), over), kwargs
    for kwargs in ({"dtype": np.float64}, {"dtype": np.float64, "copy": None}, {"dtype": np.float64, "copy": True}):
        converted = np.asarray(t, **kwargs)
        assert converted.dtype == np.float64 and np.array_equal(converted, a), kwargs
        assert not np.shares_memory(converted, over), kwargs
    assert np.array(t, copy=False).base is not None and np.shares_memory(np.array(t, copy=False), over)


def test_portable_tensor_of_dtypes_numpy_lacks_reads_their_bits():
    bits16 = np.array([0x3F80, 0x4000], dtype=np.uint16)  # bfloat16 1.0, 2.0
    t = devbridge.PortableTensor((2,), "bfloat16", bits16)
    # ml_dtypes' types where it is installed, else the bits (test_intake.py checks both)
    numpy_dtype = devbridge._intake._numpy_dtype
    assert np.asarray(t).dtype == numpy_dtype("bfloat16") and np.array_equal(np.asarray(t).view(np.uint16), bits16)
    assert devbridge.PortableTensor((2,), "float8_e5m2", b"\x3c\x40").numpy().dtype == numpy_dtype("float8_e5m2")


def test_from_array_makes_bytes_row_major_and_little_endian():
    a = np.arange(12, dtype=">i4").reshape(3, 4).T  # big-endian and not C-contiguous
    t = devbridge.PortableTensor.from_array(a)
    assert t.shape == (4, 3) and t.dtype == "int32"
    assert t.tobytes() == np.ascontiguousarray(a.astype("<i4")).tobytes()
    assert devbridge.PortableTensor.from_array(np.zeros(3, np.uint16), dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="relabels"):
        devbridge.PortableTensor.from_array(np.zeros(3, np.uint16), dtype="float32")


def test_portable_tensor_refuses_bad_input():
    with pytest.raises(ValueError, match="holds 40 bytes; the buffer has 36"):
        devbridge.PortableTensor((10,), "float32", bytes(36))
    with pytest.raises(ValueError, match="unknown dtype"):
        devbridge.PortableTensor((1,), "complex64", bytes(8))
    with pytest.raises(TypeError):
        devbridge.PortableTensor((1,), None, bytes(4))
    with pytest.raises(TypeError):
        devbridge.PortableTensor((1,), 4, bytes(4))
    with pytest.raises(TypeError, match="buffer"):
        devbridge.PortableTensor((1,), "float32", [1.0])
    with pytest.raises(ValueError, match="C-contiguous"):
        devbridge.PortableTensor((4,), "float32", np.zeros(8, np.float32)[::2])
    with pytest.raises(ValueError, match="negative"):
        devbridge.PortableTensor((-1,), "float32", b"")
    with pytest.raises(TypeError):
        devbridge.PortableTensor("4", "float32", bytes(16))


# ------------------------------------------------------------------------------------------ export/import


def test_strided_views_export_their_logical_row_major_contents(pb, rng):
    a = rng.standard_normal((64, 48)).astype(np.float32)
    with pb.upload(a, wait=True) as x:
        transposed = pb.export(x, "float32", (48, 64), (1, 48))
        assert np.array_equal(transposed.numpy(), a.T)
        every_other = pb.export(x, "float32", (32, 24), (96, 2), offset=4)
        assert np.array_equal(every_other.numpy(), a[::2, 1::2])
        reversed_rows = pb.export(x.handle, "float32", (64,), (-48,), offset=63 * 48 * 4)
        assert np.array_equal(reversed_rows.numpy(), a[::-1, 0])
        moved = devbridge.transfer(pb, x, pb, shape=(48, 64), strides=(1, 48))
        assert np.array_equal(pb.download(moved), a.T)
        moved.free()


def test_export_of_a_handle_reads_its_whole_extent(pb, rng):
    a = rng.integers(0, 255, 1000, dtype=np.uint8)
    h = pb.alloc(devbridge.ObjectSpec(1024, 256, "bytes"), 1024)
    r = pb.ring.reserve(1000)
    pb.ring.ndarray(r, "uint8")[:] = a
    pb.wait(pb.host_to_device(r, h))
    pb.ring.release(r)
    t = pb.export(h)
    assert t.dtype == "uint8" and t.shape == (1024,) and t.tobytes()[:1000] == a.tobytes()
    assert pb.export(h, "int32", (250,)).tobytes() == a.tobytes()
    pb.free(h)


def test_export_streams_into_a_buffer_or_a_file_and_imports_from_either(pb, rng, tmp_path):
    a = rng.standard_normal((600, 700)).astype(np.float64)  # 3.4 MB through a 1 MiB ring
    before = footprint(pb)
    with pb.upload(a, wait=True) as x:
        out = bytearray(a.nbytes)
        t = pb.export(x, out=out)
        assert bytes(out) == a.tobytes() and np.shares_memory(np.asarray(t), np.frombuffer(out, np.uint8))
        with pytest.raises(ValueError, match="out has 7 bytes"):
            pb.export(x, out=bytearray(7))
        with pytest.raises(ValueError, match="read-only"):
            pb.export(x, out=bytes(a.nbytes))
        with pytest.raises(TypeError):
            pb.export(x, out=[0] * a.nbytes)
        path = tmp_path / "x.bin"
        with open(path, "wb") as f:
            assert devbridge.export_to(pb, x, f) == a.nbytes
        assert path.read_bytes() == a.tobytes()
        with open(path, "rb") as f, pb.import_tensor(f, dtype="float64", shape=a.shape) as y:
            assert np.array_equal(pb.download(y), a)
        with open(path, "rb") as f:
            f.seek(8)
            with pytest.raises(devbridge.CheckpointError, match="ends 8 bytes early"):
                pb.import_tensor(f, dtype="float64", shape=a.shape)
        with devbridge.import_tensor(pb, bytes(out), dtype="float64", shape=a.shape) as z:
            assert np.array_equal(z.numpy(), a)
        with pb.import_tensor(a) as w:
            assert np.array_equal(w.numpy(), a)
    assert settled_footprint(pb) == before


class _Writer:
    """A file-like whose write() returns ``count(n)`` for n bytes handed, and keeps what it says it took."""

    def __init__(self, count):
        self.count, self.took, self.calls = count, bytearray(), 0

    def write(self, data):
        self.calls += 1
        if self.calls > 100:  # before the fix, a write that took nothing was called for ever
            raise AssertionError("write() called again and again")
        n = self.count(len(data))
        if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= len(data):
            self.took += bytes(data[:n])
        return n


def test_export_to_stops_on_a_write_that_takes_nothing_or_claims_what_it_cannot(bridges):
    b = bridges("host")
    a = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: past a pipe's buffer
    with b.upload(a, wait=True) as x:
        halves = _Writer(lambda n: (n + 1) // 2)  # takes part: the rest is handed again
        assert b.export_to(x, halves) == a.nbytes and bytes(halves.took) == a.tobytes()
        assert b.export_to(x, _Writer(lambda n: np.int64(n))) == a.nbytes  # numpy's integers count
        for count, error, words in [(lambda n: 0, OSError, r"took nothing at byte 0, 3 times running"),
                                    (lambda n: 2**40, OSError, rf"returned {2**40} at byte 0, handed \d+ bytes"),
                                    (lambda n: -1, OSError, r"returned -1 at byte 0"),
                                    (lambda n: True, TypeError, r"returned True at byte 0, not the number"),
                                    (lambda n: "all", TypeError, r"returned 'all'")]:
            with pytest.raises(error, match=words):
                b.export_to(x, _Writer(count))
        read, write = os.pipe()  # a raw, non-blocking file: write() returns None when it would block
        os.set_blocking(write, False)
        with open(read, "rb", buffering=0), open(write, "wb", buffering=0) as raw:
            with pytest.raises(BlockingIOError, match=r"write\(\) to .*FileIO.* moved nothing at byte \d+: the "
                                                      r"file is non-blocking") as caught:
                b.export_to(x, raw)  # the bytes past the pipe's buffer were silently dropped
            assert caught.value.errno == errno.EAGAIN
    # The error's frames still hold a buffer over the tensor's bytes (the chunk export_to was writing): the
    # tensor's memory stays until they are let go.
    del caught
    gc.collect()
    assert footprint(b) == (0, 0, 0)


def test_import_from_a_file_refuses_what_readinto_cannot_have_read(bridges):
    b = bridges("host")

    class Reader(io.RawIOBase):
        def __init__(self, count):
            self.count = count

        def readable(self):
            return True

        def readinto(self, view):
            return self.count(len(view))

    for count, error, words in [(lambda n: None, BlockingIOError, r"readinto\(\) from .* moved nothing at byte 0"),
                                (lambda n: n + 5, OSError, r"returned 21 at byte 0, handed 16"),
                                (lambda n: -1, OSError, r"returned -1"),
                                (lambda n: True, TypeError, r"returned True")]:
        with pytest.raises(error, match=words):
            b.import_tensor(Reader(count), dtype="float32", shape=(4,))
    with b.import_tensor(Reader(lambda n: np.int64(n)), dtype="float32", shape=(4,)) as y:
        assert y.shape == (4,)
    assert footprint(b) == (0, 0, 0)


def test_import_into_a_callers_spec(pb):
    t = devbridge.PortableTensor.from_array(np.arange(100, dtype=np.int16))
    with pb.import_tensor(t, devbridge.ObjectSpec(4096, 64, "int16")) as x:
        assert pb.extent(x.handle) == 256 and pb.spec(x.handle).max_extent == 4096
        assert np.array_equal(x.numpy(), np.arange(100, dtype=np.int16))
    with pb.import_tensor(t, devbridge.ObjectSpec(4096, 64, "bytes")) as x:
        assert x.dtype == "int16"
    before = footprint(pb)
    with pytest.raises(ValueError, match="does not fit the spec's max_extent of 128"):
        pb.import_tensor(t, devbridge.ObjectSpec(128, 64, "int16"))
    with pytest.raises(ValueError, match="dtype is float32"):
        pb.import_tensor(t, devbridge.ObjectSpec(4096, 64, "float32"))
    with pytest.raises(TypeError, match="ObjectSpec"):
        pb.import_tensor(t, {"max_extent": 4096})
    assert footprint(pb) == before


def test_import_and_export_refuse_bad_arguments(pb):
    before = footprint(pb)
    with pytest.raises(TypeError, match="dtype= and shape="):
        pb.import_tensor(b"\0" * 16)
    with pytest.raises(TypeError, match="dtype= and shape="):
        pb.import_tensor(io.BytesIO(b"\0" * 16), dtype="float32")
    with pytest.raises(ValueError, match="unknown dtype"):
        pb.import_tensor(b"\0" * 16, dtype="complex64", shape=(2,))
    with pytest.raises(ValueError, match="holds 12 bytes; the buffer has 16"):
        pb.import_tensor(b"\0" * 16, dtype="float32", shape=(3,))
    with pytest.raises(ValueError, match="empty"):
        pb.import_tensor(np.zeros((0, 3), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        pb.import_tensor(np.zeros((4, 4), np.float32)[:, ::2])
    with pb.import_tensor(np.arange(4, dtype=">f4")) as big:  # converted to little-endian, values kept
        assert np.array_equal(big.numpy(), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="differs"):
        pb.import_tensor(devbridge.PortableTensor((2,), "int8", b"ab"), dtype="uint8")
    with pytest.raises(TypeError, match="Bridge"):
        devbridge.import_tensor("host", b"ab", dtype="uint8", shape=(2,))
    with pb.upload(np.zeros(64, np.float32), wait=True) as x:
        with pytest.raises(TypeError, match="DeviceTensor or a DeviceHandle"):
            pb.export("x")
        with pytest.raises(TypeError):
            pb.export(x, offset="4")
        with pytest.raises(TypeError):
            pb.export(x, offset=4.0)
        with pytest.raises(OverflowError):
            pb.export(x, offset=-1)
        with pytest.raises(OverflowError):
            pb.export(x, offset=2**64)
        with pytest.raises(TypeError):
            pb.export(x, strides="ab")
        with pytest.raises(devbridge.InvalidTensorView, match="handle"):
            pb.export(x, shape=(65,))  # past the extent: the view's own check names the handle
        with pytest.raises(TypeError, match="write"):
            pb.export_to(x, "file.bin")
    with pytest.raises(devbridge.Closed):
        pb.export(x)
    assert settled_footprint(pb) == before


# ---------------------------------------------------------------------------------------------- transfer


# (Two fakes are peers: their transfer goes device to device, tested below, not through the rings.)
@pytest.mark.parametrize("src_name,dst_name", [("fake", "host"), ("host", "fake")])
def test_a_failed_transfer_leaves_nothing_on_the_destination(bridges, rng, src_name, dst_name):
    src, dst = bridges(src_name), bridges(dst_name)
    x = src.upload(rng.standard_normal(600_000).astype(np.float32), wait=True)  # 2.4 MB: several chunks
    fake = src if src_name == "fake" else dst
    call = "copy_d2h" if fake is src else "copy_h2d"
    kind = devbridge.OutputCopyFailed if fake is src else devbridge.DeviceCopyFailed
    before = footprint(dst)
    fake.fake.inject(call, "copy_failed_at_submit", nth=2)
    with pytest.raises(kind, match=r"transfer of .*chunk 1 \(bytes"):
        devbridge.transfer(src, x, dst)
    assert settled_footprint(dst) == before
    fake.fake.inject(call, "copy_failed_at_completion", nth=3)
    with pytest.raises(kind, match=r"transfer of .*chunk 2"):
        src.transfer(x, dst)
    assert settled_footprint(dst) == before
    if dst_name == "fake":
        dst.fake.inject("allocate", "allocation_failed")
        dst.fake.inject("allocate", "allocation_failed", nth=2)  # and the bridge's one retry
        with pytest.raises(devbridge.AllocationFailed, match="transfer of"):
            devbridge.transfer(src, x, dst)
        assert settled_footprint(dst) == before
    assert settled_footprint(src)[:3] == (1, 0, 0)  # the source keeps only its tensor
    with pytest.raises(TypeError, match="dst_bridge"):
        devbridge.transfer(src, x, "host")


# ------------------------------------------------------------------------------- checkpoint and restore


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_a_checkpoint_loads_with_the_safetensors_package_and_its_files_restore(pb, rng, tmp_path, dtype):
    require_dtype(pb, dtype)
    arrays = {"a": bits(rng, dtype, (33, 17)), "b.scalar": bits(rng, dtype, ()), "c": bits(rng, dtype, (5000,))}
    tensors = {name: pb.upload(a, wait=True) for name, a in arrays.items()}
    ours = tmp_path / "ours.safetensors"
    meta = pb.checkpoint(ours, tensors, metadata={"step": "12"})
    loaded = safetensors.numpy.load_file(str(ours))
    assert set(loaded) == set(arrays)
    for name, a in arrays.items():
        assert loaded[name].dtype == a.dtype and loaded[name].shape == a.shape
        assert loaded[name].tobytes() == a.tobytes()
    with safetensors.safe_open(str(ours), framework="numpy") as f:
        assert f.metadata() == meta and meta["step"] == "12"
        assert meta["generation"] == str(pb.generation) and meta["checksum"].startswith("crc32:")

    theirs = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(arrays, str(theirs))
    restored = pb.restore(theirs)
    assert set(restored) == set(arrays)
    for name, a in arrays.items():
        assert restored[name].dtype == dtype and restored[name].shape == a.shape
        assert pb.download(restored[name]).tobytes() == a.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_survives_the_safetensors_packages_raw_reader_and_writer(bridges, rng, tmp_path, dtype):
    b = bridges("host")
    a = bits(rng, dtype, (7, 9))
    path = tmp_path / "x.safetensors"
    b.checkpoint(path, {"x": b.upload(a, dtype=dtype, wait=True)})
    [(name, info)] = safetensors.deserialize(path.read_bytes())
    assert name == "x" and info["shape"] == [7, 9] and bytes(info["data"]) == a.tobytes()
    assert info["dtype"] == devbridge._devbridge._safetensors_name(dtype)

    theirs = tmp_path / "theirs.safetensors"
    spec = safetensors.TensorSpec(dtype=dtype, shape=[7, 9], data_ptr=a.ctypes.data, data_len=a.nbytes)
    safetensors.serialize_file({"y": spec}, str(theirs))
    restored = b.restore(theirs)
    assert restored["y"].dtype == dtype and b.download(restored["y"]).tobytes() == a.tobytes()


def test_a_checkpoint_is_laid_out_as_safetensors_expects(bridges, tmp_path):
    b = bridges("host")
    tensors = {"u8": b.upload(np.arange(3, dtype=np.uint8), wait=True),
               "f64": b.upload(np.arange(3, dtype=np.float64), wait=True),
               "f16": b.upload(np.arange(5, dtype=np.float16), wait=True)}
    path = tmp_path / "layout.safetensors"
    b.checkpoint(path, tensors)
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    assert (8 + length) % 8 == 0 and raw[8:9] == b"{"
    header = json.loads(raw[8:8 + length])
    # widest first, so each tensor starts aligned to its itemsize
    assert [header[n]["data_offsets"] for n in ("f64", "f16", "u8")] == [[0, 24], [24, 34], [34, 37]]
    assert json.loads(header["__metadata__"]["dtypes"]) == {"f16": "float16", "f64": "float64", "u8": "uint8"}
    assert header["__metadata__"]["format"] == "devbridge-checkpoint"
    info = devbridge.checkpoint_info(path)
    assert info["tensors"]["f16"] == {"dtype": "float16", "shape": (5,), "nbytes": 10}
    assert [p.name for p in tmp_path.iterdir()] == ["layout.safetensors"]  # no temporary left behind


def test_a_checkpoint_of_thousands_of_small_tensors_round_trips_and_names_the_one_that_fails(pb, rng, tmp_path):
    """A mixture-of-experts shape: thousands of tiny tensors of several dtypes, one file, read back bit-exact
    by the safetensors package and by restore; a tensor that cannot be read (freed) is named, and no file
    or temporary is left."""
    b = pb
    arrays = {f"layers.{i // 64}.experts.{i % 64}.{kind}": bits(rng, dtype, shape)
              for i in range(1500)
              for kind, dtype, shape in (("w", "float16", (8, 4)), ("b", "float32", (3,)), ("n", "int64", ()))}
    tensors = {name: b.upload(array, wait=True) for name, array in arrays.items()}
    path = tmp_path / "experts.safetensors"
    b.checkpoint(path, tensors)
    back = safetensors.numpy.load_file(str(path))
    assert back.keys() == arrays.keys()
    # Bits, not values: random float16 bits hold NaNs.
    assert all(back[name].dtype == array.dtype and back[name].tobytes() == array.tobytes()
               for name, array in arrays.items())
    restored = b.restore(path)
    assert all(b.download(restored[name]).tobytes() == arrays[name].tobytes()
               for name in ("layers.0.experts.0.w", "layers.23.experts.27.n", "layers.5.experts.9.b"))
    tensors["layers.11.experts.7.b"].free()
    old = path.read_bytes()
    with pytest.raises(devbridge.Closed, match=r"checkpoint .*tensor 'layers\.11\.experts\.7\.b'"):
        b.checkpoint(path, tensors)
    assert path.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["experts.safetensors"]


def test_checkpoint_replaces_a_file_atomically_and_a_failure_keeps_the_old_one(bridges, rng, tmp_path):
    b = bridges("fake")
    path = tmp_path / "state.safetensors"
    first = rng.standard_normal(400_000).astype(np.float32)
    x = b.upload(first, wait=True)
    b.checkpoint(str(path), {"x": x})
    old = path.read_bytes()
    b.fake.inject("copy_d2h", "copy_failed_at_submit", nth=3)
    with pytest.raises(devbridge.OutputCopyFailed, match=r"checkpoint .*tensor 'x'.*chunk 2"):
        b.checkpoint(path, {"x": x})
    assert path.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["state.safetensors"]
    assert footprint(b)[:3] == (1, 0, 0)


def test_supervisor_flow_checkpoint_restart_restore(pb, rng, tmp_path):
    arrays = {"w": rng.standard_normal((512, 600)).astype(np.float32), "step": np.array(7, np.int64)}
    tensors = {name: pb.upload(a, wait=True) for name, a in arrays.items()}
    path = tmp_path / "worker.safetensors"
    pb.checkpoint(path, tensors)
    pb.restart(pb.generation + 1)
    with pytest.raises(devbridge.OldGenerationHandle):
        pb.export(tensors["w"].handle)
    restored = pb.restore(path)
    assert devbridge.checkpoint_info(path)["metadata"]["generation"] == str(pb.generation - 1)
    for name, a in arrays.items():
        assert restored[name].handle.generation == pb.generation
        assert pb.download(restored[name]).tobytes() == a.tobytes()


@pytest.mark.parametrize("backend", ["fake", "host", "opencl"])
def test_a_killed_worker_leaves_a_checkpoint_a_new_process_restores(bridges, tmp_path, backend):
    skip_unless_runs(backend)
    path = tmp_path / "worker.safetensors"
    child = subprocess.Popen([sys.executable, str(HERE / "portable_child.py"), backend, str(path), "5"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # let it die in the middle of a later checkpoint
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    b = bridges(backend)
    restored = b.restore(path)  # a whole checkpoint, whichever it was: the checksum is verified
    versions = [tensors_for(5), tensors_for(6)]
    got = {name: b.download(t).tobytes() for name, t in restored.items()}
    assert any(got == {name: a.tobytes() for name, (a, _) in v.items()} for v in versions)
    assert {name: t.dtype for name, t in restored.items()} == {n: d for n, (_, d) in versions[0].items()}


# ------------------------------------------------------------------------------------------ bad files


def _write_checkpoint(b, path, rng) -> dict[str, np.ndarray]:
    arrays = {"big": rng.standard_normal(300_000).astype(np.float32), "small": rng.integers(0, 9, 100, np.int64)}
    b.checkpoint(path, {name: b.upload(a, wait=True) for name, a in arrays.items()})
    return arrays


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])


def _flip_data_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01
    path.write_bytes(bytes(raw))


def _set(field, value, name="big"):
    def edit(header):
        header[name][field] = value
    return edit


BAD_FILES = {
    "empty file": (lambda p: p.write_bytes(b""), r"not a safetensors file: 0 bytes"),
    "text": (lambda p: p.write_bytes(b"hello, this is not a checkpoint"), r"not a safetensors file"),
    "header not json": (lambda p: p.write_bytes((16).to_bytes(8, "little") + b"\xff" * 16), r"not JSON"),
    "header a list": (lambda p: p.write_bytes((8).to_bytes(8, "little") + b"[1,2,3] "), r"not a JSON object"),
    "huge header length": (lambda p: p.write_bytes((2**63).to_bytes(8, "little") + b"{}"), r"header length"),
    "truncated header": (lambda p: p.write_bytes(p.read_bytes()[:40]), r"truncated"),
    "truncated data": (lambda p: p.write_bytes(p.read_bytes()[:-100]), r"truncated: its tensors need"),
    "trailing bytes": (lambda p: p.write_bytes(p.read_bytes() + b"junk"), r"4 bytes follow"),
    "flipped data byte": (_flip_data_byte, r"corrupt: the data's checksum"),
    "wrong checksum": (lambda p: _rewrite_header(p, lambda h: h["__metadata__"].update(checksum="sha256:" + "ab" * 32)),
                       r"corrupt: the data's checksum"),
    "malformed checksum": (lambda p: _rewrite_header(p, lambda h: h["__metadata__"].update(checksum="md5:1")),
                           r"without a valid checksum"),
    "unknown dtype": (lambda p: _rewrite_header(p, _set("dtype", "C64")), r"tensor 'big': dtype 'C64'"),
    "shape and extent disagree": (lambda p: _rewrite_header(p, _set("shape", [300_001])),
                                  r"tensor 'big': shape \(300001,\) of float32 is 1200004 bytes"),
    "negative dimension": (lambda p: _rewrite_header(p, _set("shape", [-1])), r"tensor 'big': shape"),
    "gap": (lambda p: _rewrite_header(p, _set("data_offsets", [8, 808], name="small")), r"tensor 'small' starts"),
    "empty tensor": (lambda p: _rewrite_header(p, lambda h: h.update(
        empty={"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]})), r"tensor 'empty'.*empty"),
    "metadata not strings": (lambda p: _rewrite_header(p, lambda h: h["__metadata__"].update(step=3)),
                             r"__metadata__ is not a map"),
    "dtypes disagree": (lambda p: _rewrite_header(p, lambda h: h["__metadata__"].update(
        dtypes=json.dumps({"big": "int32"}))), r"tensor 'big': the metadata records dtype 'int32'"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_file_is_a_clear_error_and_restores_nothing(pb, rng, tmp_path, case):
    spoil, message = BAD_FILES[case]
    path = tmp_path / "bad.safetensors"
    _write_checkpoint(pb, path, rng)
    collect()
    before = settled_footprint(pb)
    spoil(path)
    with pytest.raises(devbridge.CheckpointError, match=message) as caught:
        pb.restore(path)
    assert "bad.safetensors" in str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert settled_footprint(pb) == before


def _data_section(path) -> bytes:
    raw = Path(path).read_bytes()
    return raw[8 + int.from_bytes(raw[:8], "little"):]


@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])
def test_each_checksum_is_the_data_sections_and_restore_verifies_it(bridges, rng, tmp_path, algorithm):
    b = bridges("host")
    arrays = {"w": rng.standard_normal((700, 500), dtype=np.float32), "i": bits(rng, "int16", (3000,))}
    tensors = {name: b.upload(a, wait=True) for name, a in arrays.items()}
    path = tmp_path / "x.safetensors"
    kwargs = {} if algorithm == "crc32" else {"checksum": "sha256"}  # crc32 is the default
    meta = b.checkpoint(path, tensors, **kwargs)
    data = _data_section(path)
    expected = f"{zlib.crc32(data):08x}" if algorithm == "crc32" else hashlib.sha256(data).hexdigest()
    assert meta["checksum"] == f"{algorithm}:{expected}"
    assert safetensors.safe_open(str(path), framework="numpy").metadata()["checksum"] == meta["checksum"]
    restored = b.restore(path)  # a 1 MiB ring: many chunks, hashed on the checksum thread as they pass
    for name, a in arrays.items():
        assert b.download(restored[name]).tobytes() == a.tobytes()
        restored[name].free()
    collect()
    before = settled_footprint(b)
    _flip_data_byte(path)
    with pytest.raises(devbridge.CheckpointError, match=rf"corrupt: the data's checksum is {algorithm}:"):
        b.restore(path)
    assert settled_footprint(b) == before
    for t in tensors.values():
        t.free()


def test_a_sha256_checkpoint_from_before_crc32_still_restores(bridges, rng, tmp_path):
    """Files of format_version 1 written before crc32 became the default carry sha256: restore verifies them."""
    b = bridges("host")
    a = rng.standard_normal(300_000, dtype=np.float32)
    path = tmp_path / "old.safetensors"
    x = b.upload(a, wait=True)
    b.checkpoint(path, {"big": x})
    _rewrite_header(path, lambda h: h["__metadata__"].update(
        checksum="sha256:" + hashlib.sha256(_data_section(path)).hexdigest()))
    restored = b.restore(path)
    assert b.download(restored["big"]).tobytes() == a.tobytes()
    restored["big"].free()
    _flip_data_byte(path)
    with pytest.raises(devbridge.CheckpointError, match="corrupt"):
        b.restore(path)
    x.free()


def test_the_checksum_argument_is_checked(pb, rng, tmp_path):
    x = pb.upload(bits(rng, "uint8", (64,)), wait=True)
    with pytest.raises(TypeError, match="checksum"):
        pb.checkpoint(tmp_path / "x", {"x": x}, checksum=None)
    with pytest.raises(ValueError, match="checksum 'md5'"):
        pb.checkpoint(tmp_path / "x", {"x": x}, checksum="md5")
    assert not list(tmp_path.iterdir())  # refused before any file
    x.free()


def test_a_checksum_can_be_skipped_but_not_faked(bridges, rng, tmp_path):
    b = bridges("host")
    path = tmp_path / "x.safetensors"
    _write_checkpoint(b, path, rng)
    _flip_data_byte(path)
    with pytest.raises(devbridge.CheckpointError):
        b.restore(path)
    assert set(b.restore(path, verify=False)) == {"big", "small"}  # the caller's explicit choice


@pytest.mark.parametrize("nth,failing", [(1, "small"), (2, "big")])
def test_a_tensor_the_destination_cannot_hold_frees_the_others(bridges, rng, tmp_path, nth, failing):
    b = bridges("fake")
    path = tmp_path / "x.safetensors"
    _write_checkpoint(b, path, rng)
    collect()
    before = settled_footprint(b)
    b.fake.inject("allocate", "allocation_failed", nth=nth)  # as a device out of memory refuses it,
    b.fake.inject("allocate", "allocation_failed", nth=nth + 1)  # and again when the bridge retries
    with pytest.raises(devbridge.AllocationFailed, match=f"restore .*x.safetensors.*tensor '{failing}'"):
        b.restore(path)
    assert settled_footprint(b) == before
    b.fake.inject("copy_h2d", "copy_failed_at_completion", nth=3)  # small is 1 chunk, big's 2nd
    with pytest.raises(devbridge.DeviceCopyFailed, match=r"tensor 'big': upload chunk 1"):
        b.restore(path)
    assert settled_footprint(b) == before


def test_checkpoint_and_restore_refuse_bad_arguments(pb, tmp_path):
    x = pb.upload(np.zeros(16, np.float32), wait=True)
    before = footprint(pb)
    with pytest.raises(TypeError, match="path"):
        pb.checkpoint(3, {"x": x})
    with pytest.raises(TypeError, match="path"):
        pb.checkpoint(str(tmp_path / "x").encode(), {"x": x})
    with pytest.raises(ValueError, match="empty"):
        pb.checkpoint("", {"x": x})
    with pytest.raises(TypeError, match="mapping"):
        pb.checkpoint(tmp_path / "x", [x])
    with pytest.raises(TypeError, match="names must be str"):
        pb.checkpoint(tmp_path / "x", {3: x})
    with pytest.raises(ValueError, match="cannot name a tensor"):
        pb.checkpoint(tmp_path / "x", {"__metadata__": x})
    with pytest.raises(TypeError, match="tensor 'x'.*DeviceTensor or a DeviceHandle"):
        pb.checkpoint(tmp_path / "x", {"x": np.zeros(3)})
    with pytest.raises(TypeError, match="str to str"):
        pb.checkpoint(tmp_path / "x", {"x": x}, metadata={"step": 3})
    with pytest.raises(ValueError, match="devbridge's own"):
        pb.checkpoint(tmp_path / "x", {"x": x}, metadata={"checksum": "mine"})
    with pytest.raises(TypeError, match="path"):
        pb.restore(None)
    with pytest.raises(TypeError, match="verify"):
        pb.restore(tmp_path / "x", verify="yes")
    with pytest.raises(FileNotFoundError):
        pb.restore(tmp_path / "missing.safetensors")
    assert list(tmp_path.iterdir()) == [] and footprint(pb) == before
    x.free()


# ----------------------------------------------------------------------------- the direct path (copy_to_peer)

def test_transfer_between_backends_with_a_direct_path_goes_device_to_device(bridges, rng):
    """Two fakes are peers (as two CUDA bridges are): transfer copies device to device, through neither ring."""
    src, dst = bridges("fake"), bridges("fake")
    data = rng.standard_normal((300, 7)).astype(np.float32)
    x = src.upload(data)
    src.fake.clear_calls()
    dst.fake.clear_calls()
    y = devbridge.transfer(src, x, dst)
    assert np.array_equal(dst.download(y), data)
    copies = [c for c in src.fake.calls() + dst.fake.calls() if c["call"] in ("copy_h2d", "copy_d2h")]
    assert [c["call"] for c in copies] == ["copy_d2h"], "only download() above: the transfer itself used no ring"
    # A window (strided) has no direct path: staged, still exact.
    z = devbridge.transfer(src, x, dst, shape=(300, 3), strides=(7, 1))
    assert np.array_equal(dst.download(z), data[:, :3])


def test_copy_to_peer_validates_both_sides_and_says_when_there_is_no_path(bridges):
    src, dst, host = bridges("fake"), bridges("fake"), bridges("host")
    x = src.alloc(devbridge.ObjectSpec(4096, 64, "uint8"), 4096)
    y = dst.alloc(devbridge.ObjectSpec(4096, 64, "uint8"), 4096)
    h = host.alloc(devbridge.ObjectSpec(4096, 64, "uint8"), 4096)
    assert src.copy_to_peer(x, dst, y, 4096)
    assert not src.copy_to_peer(x, host, h, 4096)
    with pytest.raises(devbridge.InvalidRange):
        src.copy_to_peer(x, dst, y, 100, offset=4000)
    with pytest.raises(OverflowError):
        src.copy_to_peer(x, dst, y, -1)
    with pytest.raises(TypeError):
        src.copy_to_peer(x, dst, y, "8")
    for b, handle in ((src, x), (dst, y), (host, h)):
        b.free(handle)


def test_replacing_a_checkpoint_frees_the_old_file_after_the_call(bridges, rng, tmp_path):
    """The replaced file keeps a second name through the rename (so the rename frees nothing inline); that
    name goes on a thread of its own, and nothing but the new file is left."""
    from devbridge import _checkpoint_write

    b = bridges("host")
    path = tmp_path / "state.safetensors"
    first, second = (rng.standard_normal(100_000).astype(np.float32) for _ in range(2))
    b.checkpoint(path, {"x": b.upload(first, wait=True)})
    b.checkpoint(path, {"x": b.upload(second, wait=True)})
    assert np.array_equal(safetensors.numpy.load_file(str(path))["x"], second)
    _checkpoint_write._UNLINKER.submit(lambda: None).result()  # the unlinker's queue has run
    assert [p.name for p in tmp_path.iterdir()] == ["state.safetensors"]


def test_the_checkpoint_hasher_holds_no_buffer_once_its_hash_is_done(monkeypatch):
    """Large chunks are hashed on a pool thread while they are written. The pool's work item, and what it
    was given, lives on until its thread drops it, which can be after the wait for the hash returned. A
    buffer over a chunk lent to a sink must not be held then (BufferError once the sink returns): the
    checkpoint hands the hasher the lent memoryview itself today, which is released all the same, but a
    view derived from it would be held. Here every work item lingers after it ran, as on a busy machine."""
    import concurrent.futures.thread as pool_thread

    from devbridge import _checkpoint_write

    run = pool_thread._WorkItem.run

    def run_then_linger(self):
        run(self)
        time.sleep(0.05)  # the work item still alive in the pool's thread

    monkeypatch.setattr(pool_thread._WorkItem, "run", run_then_linger)
    hasher = _checkpoint_write._Hasher("crc32")
    try:
        data = bytearray(b"x" * 4096)
        view = memoryview(data)
        hasher.submit(view).result()
        del view  # the last reference, unless the pool still holds one
        data.extend(b"y")  # refused (BufferError) while anything still exports the bytearray
    finally:
        hasher.close()
    assert hasher.checksum() == f"crc32:{zlib.crc32(b'x' * 4096):08x}"


@pytest.mark.parametrize("refusal", ["ENOSPC at preallocation", "EIO at fsync"])
def test_a_checkpoint_the_file_system_refuses_names_the_file_and_keeps_the_old_one(bridges, tmp_path, monkeypatch,
                                                                                  refusal):
    """A full file system (seen when the file's blocks are reserved, before a byte is written) or a failed
    write: the OSError keeps its errno (and so its type), names the checkpoint, its size and the temporary
    file, and says the old file is kept; nothing is left beside it."""
    from devbridge import _checkpoint_write

    b = bridges("host")
    path = tmp_path / "c.safetensors"
    with b.upload(np.ones(1000, np.float32), wait=True) as old:
        b.checkpoint(path, {"a": old})
    code = errno.ENOSPC if refusal.startswith("ENOSPC") else errno.EIO

    def refuse(*args):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(_checkpoint_write.os, "posix_fallocate" if code == errno.ENOSPC else "fsync", refuse)
    with b.upload(np.ones(1 << 18, np.float32), wait=True) as new:
        with pytest.raises(OSError) as caught:
            b.checkpoint(path, {"a": new})
    monkeypatch.undo()
    assert caught.value.errno == code
    message = str(caught.value)
    assert f"checkpoint {str(path)!r} (" in message and "bytes, written beside it as '.c.safetensors." in message
    assert message.endswith(f"{os.strerror(code)}; the old file is kept")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]
    restored = b.restore(path)
    assert restored["a"].shape == (1000,)
    restored["a"].free()


def test_a_refused_first_checkpoint_says_nothing_was_written(bridges, tmp_path, monkeypatch):
    # With no old file there is none to keep: the message said "the old file is kept" all the same.
    from devbridge import _checkpoint_write

    b = bridges("host")
    path = tmp_path / "new.safetensors"

    def refuse(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_checkpoint_write.os, "posix_fallocate", refuse)
    with b.upload(np.ones(1000, np.float32), wait=True) as t:
        with pytest.raises(OSError) as caught:
            b.checkpoint(path, {"a": t})
    monkeypatch.undo()
    assert str(caught.value).endswith(f"{os.strerror(errno.ENOSPC)}; nothing was written")
    assert list(tmp_path.iterdir()) == []


def test_a_file_system_that_cannot_preallocate_still_takes_a_checkpoint(bridges, tmp_path, monkeypatch):
    from devbridge import _checkpoint_write

    def unsupported(*args):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(_checkpoint_write.os, "posix_fallocate", unsupported)
    b = bridges("host")
    with b.upload(np.arange(100, dtype=np.float32), wait=True) as t:
        b.checkpoint(tmp_path / "c.safetensors", {"a": t})
    assert np.array_equal(safetensors.numpy.load_file(tmp_path / "c.safetensors")["a"], np.arange(100, dtype=np.float32))


def test_files_given_the_wrong_way_are_refused_naming_the_remedy(bridges, tmp_path):
    """A text-mode file, a directory for a checkpoint's path, a directory that does not exist: each is
    refused before anything is written, saying what to do, and nothing is left behind."""
    b = bridges("host")
    with b.upload(np.arange(10, dtype=np.float32), wait=True) as t:
        with open(tmp_path / "t.txt", "w") as text:
            with pytest.raises(TypeError, match=r"export_to writes bytes: open the file in binary mode \('wb'\)"):
                b.export_to(t, text)
        with open(tmp_path / "t.txt") as text:
            with pytest.raises(TypeError, match=r"import_tensor reads bytes: open the file in binary mode \('rb'\)"):
                b.import_tensor(text, dtype="float32", shape=(2,))
        (tmp_path / "dir").mkdir()
        with pytest.raises(IsADirectoryError, match=r"checkpoint '.*dir': it is a directory; name a file"):
            b.checkpoint(tmp_path / "dir", {"t": t})
        with pytest.raises(FileNotFoundError, match=r"checkpoint '.*missing/c.safetensors': cannot make its "
                                                    r"temporary file in '.*missing': No such file or directory; "
                                                    r"nothing was written"):
            b.checkpoint(tmp_path / "missing" / "c.safetensors", {"t": t})
        # A FIFO (or a device: as root, /dev/null) is never replaced by the rename, directly or through a link.
        os.mkfifo(tmp_path / "fifo")
        os.symlink("fifo", tmp_path / "to-fifo")
        for name in ("fifo", "to-fifo"):
            with pytest.raises(OSError, match=r"it is not a regular file \(a FIFO, a device, a socket\)"):
                b.checkpoint(tmp_path / name, {"t": t})
        assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode) and os.path.islink(tmp_path / "to-fifo")
        os.unlink(tmp_path / "fifo")
        os.unlink(tmp_path / "to-fifo")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "t.txt"] and not any((tmp_path / "dir").iterdir())


def test_a_strided_float8_export_reads_its_logical_contents(bridges):
    # ml_dtypes gives float8_e5m2 the typestr "<f1", which numpy's as_strided refuses: the gather is on bits.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    b = bridges("host")
    bits = np.arange(12, dtype=np.uint8).reshape(3, 4)
    for dtype in ("float8_e5m2", "float8_e4m3fn"):
        x = b.upload(bits.view(getattr(ml_dtypes, dtype)), wait=True)
        p = b.export(x, shape=(4, 3), strides=(1, 4))
        assert p.tobytes() == bits.T.tobytes()
        x.free()


def test_export_into_a_typed_array_of_another_dtype_is_refused(bridges):
    b = bridges("host")
    x = b.upload(np.array([1.0, -2.5], np.float32), wait=True)
    for out in (np.zeros(2, ">f4"), np.zeros(1, np.float64), np.zeros(2, np.int32)):
        with pytest.raises(ValueError, match=r"out has dtype .*the data is float32"):
            b.export(x, out=out)
    same, raw = np.zeros(2, np.float32), np.zeros(8, np.uint8)
    b.export(x, out=same)
    b.export(x, out=raw)
    assert same.tolist() == [1.0, -2.5] and raw.tobytes() == same.tobytes()
    x.free()
