"""The C ABI's checkpoints against Python's: a file libdevbridge_c writes restores with devbridge.restore
(its checksum verified) and loads with safetensors.numpy, and a file Python writes restores through the C
ABI bit-exact. Skipped where no libdevbridge_c.so with the checkpoint calls is built under build/."""
from __future__ import annotations

import ctypes
import pathlib

import numpy as np
import pytest
import safetensors.numpy

import devbridge

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_DTYPES = {"float32": 11, "int8": 1, "int16": 2, "int64": 4}  # DEVBRIDGE_DTYPE_*


class _Handle(ctypes.Structure):
    _fields_ = [("domain", ctypes.c_uint64), ("generation", ctypes.c_uint64), ("id", ctypes.c_uint64)]


class _OpenOptions(ctypes.Structure):  # only its size and the fields this test sets; the rest stay 0
    _fields_ = [("size", ctypes.c_uint64), ("backend", ctypes.c_char_p), ("device", ctypes.c_char_p),
                ("backend_options", ctypes.c_void_p), ("backend_option_count", ctypes.c_uint64),
                ("generation", ctypes.c_uint64), ("ring_bytes", ctypes.c_uint64), ("rest", ctypes.c_uint8 * 48)]


class _PortableView(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint64), ("dtype", ctypes.c_int32), ("rank", ctypes.c_uint32),
                ("dims", ctypes.POINTER(ctypes.c_int64)), ("data", ctypes.c_void_p), ("len", ctypes.c_uint64)]


class _CheckpointEntry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("handle", _Handle), ("dtype", ctypes.c_int32), ("rank", ctypes.c_uint32),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


class _RestoredTensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("handle", _Handle), ("dtype", ctypes.c_int32), ("rank", ctypes.c_uint32),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


class _Restored(ctypes.Structure):
    _fields_ = [("count", ctypes.c_uint64), ("tensors", ctypes.POINTER(_RestoredTensor)),
                ("generation", ctypes.c_uint64)]


def _sanitized(build: pathlib.Path) -> bool:
    """A sanitizer build's library aborts the process that loads it without the runtime preloaded."""
    try:
        return "-fsanitize" in (build / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        return False


def _load() -> ctypes.CDLL | None:
    """The newest built libdevbridge_c.so that loads here (not a sanitizer build) and has restore."""
    for library in sorted(_ROOT.glob("build/*/src/c_api/libdevbridge_c.so"), key=lambda p: -p.stat().st_mtime):
        if _sanitized(library.parents[2]):
            continue
        try:
            lib = ctypes.CDLL(str(library))
        except OSError:
            continue
        if hasattr(lib, "devbridge_restore"):
            return lib
    return None


_LIB = _load()
pytestmark = pytest.mark.skipif(_LIB is None, reason="no libdevbridge_c.so with devbridge_restore under build/")

if _LIB is not None:
    _P = ctypes.POINTER
    for name, args in {
        "devbridge_open": [_P(_OpenOptions), _P(ctypes.c_void_p)],
        "devbridge_import_tensor": [ctypes.c_void_p, _P(_PortableView), ctypes.c_void_p, _P(_Handle)],
        "devbridge_export_tensor": [ctypes.c_void_p, _Handle, ctypes.c_int32, _P(ctypes.c_int64), ctypes.c_uint32,
                                    ctypes.c_uint64, _P(ctypes.c_void_p)],
        "devbridge_portable_describe": [ctypes.c_void_p, _P(_PortableView)],
        "devbridge_checkpoint": [ctypes.c_void_p, ctypes.c_char_p, _P(_CheckpointEntry), ctypes.c_uint64,
                                 ctypes.c_uint64],
        "devbridge_restore": [ctypes.c_void_p, ctypes.c_char_p, _P(_P(_Restored))],
        "devbridge_free_device": [ctypes.c_void_p, _Handle],
    }.items():
        getattr(_LIB, name).argtypes = args
        getattr(_LIB, name).restype = ctypes.c_int32
    _LIB.devbridge_portable_free.argtypes = [ctypes.c_void_p]
    _LIB.devbridge_restored_free.argtypes = [_P(_Restored)]
    _LIB.devbridge_destroy.argtypes = [ctypes.c_void_p]
    _LIB.devbridge_last_error_message.restype = ctypes.c_char_p


def _ok(status: int) -> None:
    assert status == 0, _LIB.devbridge_last_error_message().decode()


@pytest.fixture()
def c_bridge():
    options = _OpenOptions(size=ctypes.sizeof(_OpenOptions), backend=b"host", generation=5, ring_bytes=1 << 16)
    bridge = ctypes.c_void_p()
    _ok(_LIB.devbridge_open(ctypes.byref(options), ctypes.byref(bridge)))
    yield bridge
    _LIB.devbridge_destroy(bridge)


def _dims(shape) -> ctypes.Array:
    return (ctypes.c_int64 * max(len(shape), 1))(*shape)


ARRAYS = {
    "layer.weight": np.random.default_rng(3).standard_normal((300, 200), dtype=np.float32),  # 3.6x the C ring
    "embed": np.arange(-40, 37, dtype=np.int16).reshape(7, 11),
    "step": np.array([12345], dtype=np.int64),
    "mask": np.array([[1, -2, 3]], dtype=np.int8),
}


def _c_checkpoint(bridge: ctypes.c_void_p, path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
    """Imports each array into the C bridge and checkpoints them all through the C ABI."""
    entries = (_CheckpointEntry * len(arrays))()
    dims = [_dims(a.shape) for a in arrays.values()]  # alive until the call returns
    for entry, shape, (name, a) in zip(entries, dims, arrays.items()):
        view = _PortableView(size=ctypes.sizeof(_PortableView), dtype=_DTYPES[str(a.dtype)], rank=a.ndim, dims=shape,
                             data=a.ctypes.data, len=a.nbytes)
        handle = _Handle()
        _ok(_LIB.devbridge_import_tensor(bridge, ctypes.byref(view), None, ctypes.byref(handle)))
        entry.name, entry.handle, entry.dtype, entry.rank, entry.dims = name.encode(), handle, view.dtype, a.ndim, shape
    _ok(_LIB.devbridge_checkpoint(bridge, str(path).encode(), entries, len(arrays), 0))


def test_c_written_checkpoint_restores_in_python(c_bridge, tmp_path):
    path = tmp_path / "from_c.safetensors"
    _c_checkpoint(c_bridge, path, ARRAYS)

    info = devbridge.checkpoint_info(path)
    assert info["metadata"]["generation"] == "5" and info["metadata"]["checksum"].startswith("crc32:")
    with devbridge.Bridge(backend="host", ring_bytes=1 << 20) as bridge:
        restored = devbridge.restore(bridge, path)  # verifies the checksum
        assert set(restored) == set(ARRAYS)
        for name, a in ARRAYS.items():
            got = devbridge.export(bridge, restored[name]).numpy()
            assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes()
    from safetensors.numpy import load_file
    loaded = load_file(str(path))
    assert {name: a.tobytes() for name, a in loaded.items()} == {name: a.tobytes() for name, a in ARRAYS.items()}

    # One flipped data byte: Python's restore refuses the C-written checksum.
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with devbridge.Bridge(backend="host", ring_bytes=1 << 20) as bridge, pytest.raises(devbridge.CheckpointError):
        devbridge.restore(bridge, path)


def test_python_written_checkpoint_restores_through_c(c_bridge, tmp_path):
    path = tmp_path / "from_python.safetensors"
    with devbridge.Bridge(backend="host", ring_bytes=1 << 20, generation=9) as bridge:
        tensors = {name: bridge.upload(a, wait=True) for name, a in ARRAYS.items()}
        bridge.checkpoint(path, tensors)
        for t in tensors.values():
            t.free()

    restored = ctypes.POINTER(_Restored)()
    _ok(_LIB.devbridge_restore(c_bridge, str(path).encode(), ctypes.byref(restored)))
    try:
        assert restored.contents.count == len(ARRAYS) and restored.contents.generation == 9
        for i in range(restored.contents.count):
            row = restored.contents.tensors[i]
            a = ARRAYS[row.name.decode()]
            assert row.dtype == _DTYPES[str(a.dtype)] and tuple(row.dims[k] for k in range(row.rank)) == a.shape
            portable = ctypes.c_void_p()
            _ok(_LIB.devbridge_export_tensor(c_bridge, row.handle, row.dtype, row.dims, row.rank, 0,
                                             ctypes.byref(portable)))
            view = _PortableView(size=ctypes.sizeof(_PortableView))
            _ok(_LIB.devbridge_portable_describe(portable, ctypes.byref(view)))
            assert ctypes.string_at(view.data, view.len) == a.tobytes()
            _LIB.devbridge_portable_free(portable)
            _ok(_LIB.devbridge_free_device(c_bridge, row.handle))
    finally:
        _LIB.devbridge_restored_free(restored)


def test_c_and_python_write_the_same_bytes(c_bridge, tmp_path):
    arrays = dict(ARRAYS, **{"b\u00e9ta\x7f": np.array([1, 2], dtype=np.int8)})  # escaped as json.dumps does
    _c_checkpoint(c_bridge, tmp_path / "c.safetensors", arrays)
    with devbridge.Bridge(backend="host", ring_bytes=1 << 20, generation=5) as bridge:
        tensors = {name: bridge.upload(a, wait=True) for name, a in arrays.items()}
        bridge.checkpoint(tmp_path / "python.safetensors", tensors)
        for t in tensors.values():
            t.free()
    assert (tmp_path / "c.safetensors").read_bytes() == (tmp_path / "python.safetensors").read_bytes()


def test_a_name_a_c_string_cannot_carry_is_refused_not_cut_short(c_bridge, tmp_path):
    # "a", "a\0b" and "a\0c" are three tensors (valid JSON, safetensors and Python keep them apart); as C
    # strings all three would read "a".
    path = tmp_path / "nul_names.safetensors"
    with devbridge.Bridge(backend="host", ring_bytes=1 << 20) as bridge:
        bridge.checkpoint(path, {name: bridge.upload(np.array([i], np.uint8), wait=True)
                                 for i, name in enumerate(["a", "a\0b", "a\0c"])})
    restored = ctypes.POINTER(_Restored)()
    status = _LIB.devbridge_restore(c_bridge, str(path).encode(), ctypes.byref(restored))
    message = _LIB.devbridge_last_error_message().decode()
    assert status != 0 and "NUL character" in message and r"'a\x00b'" in message, (status, message)
    assert not restored


def test_c_and_python_refuse_a_chosen_unrestorable_tensor_in_the_same_words(c_bridge, tmp_path):
    # One selection (checkpoint::select_tensors) behind both: the C ABI adds only the operation it was.
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"empty": np.zeros((0, 4), np.float32), "w": np.ones(4, np.float32)}, str(path))
    with devbridge.Bridge(backend="host", ring_bytes=1 << 20) as bridge, \
            pytest.raises(devbridge.CheckpointError) as by_python:
        devbridge.restore(bridge, str(path))
    assert "tensor 'empty'" in str(by_python.value)
    restored = ctypes.POINTER(_Restored)()
    status = _LIB.devbridge_restore(c_bridge, str(path).encode(), ctypes.byref(restored))
    assert status != 0 and not restored
    assert _LIB.devbridge_last_error_message().decode() == f"restore: {by_python.value}"
