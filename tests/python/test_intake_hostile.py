"""Hostile and odd inputs at every entry that takes an array (upload, adopt, the Prefetcher, import_tensor,
PortableTensor and its from_array, a devbridge.ray put), and another bridge's tensor at every entry that
reads one: each is read right or refused with the error the docs name, the same whichever way it arrives.

* a DLPack capsule whose own device is not host memory, whatever ``__dlpack_device__()`` said: refused
  with ``ValueError`` naming the device, never read (it was read as host memory: garbage or a crash);
* a big-endian typed buffer handed to ``PortableTensor(shape, dtype, data)`` / ``import_tensor(buffer,
  dtype=, shape=)``: converted to little-endian bytes, or refused naming the byte order;
* a producer whose export fails, or an object numpy reads no numbers from: ``TypeError`` from
  ``from_array`` as from ``upload``;
* a numpy masked array: refused (``TypeError``) naming it and what to pass;
* a dtype devbridge does not hold: ``ValueError`` from numpy and DLPack input alike; a numpy scalar read
  by import_tensor as upload reads it; a structured dtype named as such;
* another bridge's ``DeviceTensor``: ``ForeignDomain`` from export, export_to, transfer and checkpoint too.
"""

from __future__ import annotations

import ctypes
import io

import numpy as np
import pytest

import devbridge
from devbridge import _intake
from conftest import collect, make_bridge

# The intake suite's bridges: ib on the fake and host, hb on host.
from test_intake import RING, hb, ib  # noqa: F401 - fixtures, used by name


def _array_entries(b):
    """(name, call) for every entry that takes an array, each given the array."""
    def prefetch(a):
        with devbridge.Prefetcher(b, [a], to="device") as it:
            next(it)
    return [
        ("upload", lambda a: b.upload(a, wait=True)),
        ("import_tensor", lambda a: b.import_tensor(a)),
        ("PortableTensor.from_array", lambda a: devbridge.PortableTensor.from_array(a)),
        ("Prefetcher", prefetch),
        ("put", lambda a: _intake._intake(a, "put", any_layout=True)),  # a devbridge.ray put's reading
    ]


# ------------------------------------------------------------------- 1. a capsule whose memory is elsewhere


def _set_capsule_device(capsule, device_type: int):
    """``capsule`` with its DLTensor's device type rewritten (the memory stays the host's: a reader that
    trusted the capsule would read it, and the test sees it read, not a crash)."""
    for name, struct in ((b"dltensor_versioned", _intake._DLManagedTensorVersioned), (b"dltensor", None)):
        try:
            address = _intake._capsule_pointer(capsule, name)
        except ValueError:
            continue
        tensor = struct.from_address(address).dl_tensor if struct else _intake._DLTensor.from_address(address)
        tensor.device.device_type = device_type
        return capsule
    raise AssertionError(f"not a DLPack capsule: {capsule!r}")


class _Liar:
    """A producer whose ``__dlpack_device__()`` says the CPU, and whose capsule says ``device_type``."""

    def __init__(self, inner, device_type: int) -> None:
        self.inner, self.device_type = inner, device_type

    def __dlpack__(self, **kwargs):
        return _set_capsule_device(self.inner.__dlpack__(**kwargs), self.device_type)

    def __dlpack_device__(self):
        return (1, 0)


def _producers(hb):
    """Host producers of several dtypes and routes: numpy (float32: numpy's from_dlpack route), devbridge's
    own tensor (bfloat16: the capsule read directly), torch when it imports (both routes)."""
    bits = np.arange(1, 9, dtype=np.uint16)
    out = [("numpy float32", np.arange(8, dtype=np.float32)),
           ("devbridge bfloat16", hb.upload(bits, dtype="bfloat16", wait=True))]
    try:
        import torch
    except ImportError:
        return out
    return out + [("torch int64", torch.arange(8)), ("torch bfloat16", torch.arange(8).to(torch.bfloat16))]


@pytest.mark.parametrize("device_type, device", [(2, "CUDA"), (4, "OpenCL"), (10, "ROCm"), (7, "Vulkan"),
                                                 (12, "ext dev"), (99, "not host memory")])
def test_a_capsule_on_a_device_is_refused_whatever_dlpack_device_said(hb, device_type, device):
    producers = _producers(hb)
    before = hb.stats()["live_allocations"]
    for label, producer in producers:
        liar = _Liar(producer, device_type)
        entries = _array_entries(hb) + [("adopt", lambda a: hb.adopt(a))]
        for entry, call in entries:
            with pytest.raises(ValueError, match=rf"capsule is on device \({device_type}, 0\) \({device}\)"):
                call(liar)
                pytest.fail(f"{entry} read {label}'s capsule on {device} as host memory")
    collect()
    assert hb.stats()["live_allocations"] == before


@pytest.mark.parametrize("device_type", [1, 3, 11])  # the CPU, CUDA host (pinned), ROCm host (pinned)
def test_a_capsule_in_host_readable_memory_is_read(hb, device_type):
    for label, producer in _producers(hb):
        want = np.asarray(_intake._intake(producer, "upload"))
        got = _intake._intake(_Liar(producer, device_type), "upload")
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), label
        assert devbridge.PortableTensor.from_array(_Liar(producer, device_type)).tobytes() == want.tobytes()


# -------------------------------------------------------------- 2. big-endian buffers with dtype= and shape=


def _big_endian_forms(values: np.ndarray):
    """``values`` as big-endian typed buffers of every kind: a numpy array, its memoryview, ctypes'."""
    be = values.astype(values.dtype.newbyteorder(">"))
    forms = [("ndarray", be), ("memoryview", memoryview(be))]
    ctype = {"f4": ctypes.c_float, "f8": ctypes.c_double, "i4": ctypes.c_int32, "i8": ctypes.c_int64,
             "u2": ctypes.c_uint16}.get(values.dtype.str[1:])
    if ctype is not None:
        forms.append(("ctypes", (ctype.__ctype_be__ * values.size)(*values.tolist())))
    return forms


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "uint16", "float16"])
def test_a_big_endian_buffer_given_a_dtype_keeps_its_values(ib, dtype):
    values = (np.arange(-3, 5) * 3).astype(dtype)
    for form, data in _big_endian_forms(values):
        p = devbridge.PortableTensor(values.shape, dtype, data)
        assert p.tobytes() == values.astype(values.dtype.newbyteorder("<")).tobytes(), form
        assert np.array_equal(p.numpy(), values), form
        with ib.import_tensor(data, dtype=dtype, shape=values.shape) as t:
            assert np.array_equal(t.numpy(), values), form


def test_a_big_endian_buffer_relabelled_to_its_item_size_is_converted_first(ib):
    bits = np.array([0x3F80, 0x4000, 0xC040], np.uint16)  # bfloat16 1.0, 2.0, -3.0
    for form, data in _big_endian_forms(bits):
        p = devbridge.PortableTensor((3,), "bfloat16", data)
        assert p.tobytes() == bits.tobytes(), form
    with ib.upload(bits.astype(">u2"), dtype="bfloat16", wait=True) as t:  # upload's rule: the same
        assert ib.download(t).tobytes() == bits.tobytes()


@pytest.mark.parametrize("dtype, shape", [("uint8", (16,)), ("float64", (2,)), ("int16", (8,))])
def test_a_big_endian_buffer_of_another_item_size_is_refused_naming_its_byte_order(ib, dtype, shape):
    values = np.arange(4, dtype=np.float32)
    before = ib.stats()["live_allocations"]
    for form, data in _big_endian_forms(values):
        with pytest.raises(ValueError, match=r"byte order \(>f4: big-endian\)"):
            devbridge.PortableTensor(shape, dtype, data)
        if form == "ndarray":  # import_tensor reads a numpy array as upload does: converted, then relabelled
            with ib.import_tensor(data, dtype=dtype, shape=shape) as t:
                assert ib.download(t).tobytes() == values.tobytes()
            continue
        with pytest.raises(ValueError, match="big-endian"):
            ib.import_tensor(data, dtype=dtype, shape=shape)
    collect()
    assert ib.stats()["live_allocations"] == before


def test_bytes_and_native_buffers_are_kept_as_they_are():
    a = np.arange(4, dtype=np.float32)
    p = devbridge.PortableTensor((4,), "float32", a)
    assert np.shares_memory(p.numpy(), a), "a native array is kept, not copied"
    raw = a.astype(">f4").tobytes()
    assert devbridge.PortableTensor((16,), "uint8", raw).tobytes() == raw  # bytes say no order: as they are
    assert devbridge.PortableTensor((4,), "uint8", np.arange(4, dtype=">u1")).tobytes() == bytes(range(4))


# --------------------------------------------------------- 3. failed exports and non-arrays: one TypeError


class _Refusing:
    def __dlpack__(self, **kwargs):
        raise BufferError("cannot export this one")

    def __dlpack_device__(self):
        return (1, 0)


def test_a_failed_export_is_the_producers_typeerror_at_every_entry(hb):
    for entry, call in _array_entries(hb):
        with pytest.raises(TypeError, match=r"refused its DLPack export: BufferError: cannot export this one"):
            call(_Refusing())
    torch = pytest.importorskip("torch")
    graded = torch.ones(3, requires_grad=True)
    for entry, call in _array_entries(hb):
        with pytest.raises(TypeError, match=r"refused its DLPack export: .*require.* grad"):
            call(graded)


def test_an_object_numpy_reads_no_numbers_from_is_a_typeerror_at_every_entry(hb):
    tinygrad = pytest.importorskip("tinygrad")
    for thing in (tinygrad.Tensor([1.0, 2.0]), object(), None):
        for entry, call in _array_entries(hb):
            # import_tensor asks for dtype= and shape= for what is no array, as for a buffer
            with pytest.raises(TypeError, match=rf"takes an array .*not {type(thing).__name__}|"
                                                rf"import_tensor of a {type(thing).__name__} needs dtype="):
                call(thing)
    # What numpy reads as numbers stays accepted where the entry takes anything numpy.asarray takes.
    assert devbridge.PortableTensor.from_array([[1, 2], [3, 4]]).shape == (2, 2)
    assert _intake._intake((1.5, 2.5), "put", any_layout=True).dtype == np.float64


# ------------------------------------------------------------------------------------------- 4. masked


@pytest.mark.parametrize("dtype", ["float32", "uint8", "int64"])
@pytest.mark.parametrize("mask", [[0, 1, 0, 1], np.ma.nomask])
def test_a_masked_array_is_refused_at_every_entry_naming_what_to_pass(hb, dtype, mask):
    m = np.ma.MaskedArray(np.arange(4, dtype=dtype), mask=mask)
    m.flags.writeable = False  # adopt's own condition, so that only the mask refuses it
    before = hb.stats()["live_allocations"]
    entries = _array_entries(hb) + [
        ("adopt", lambda a: hb.adopt(a)),
        ("import_tensor with dtype and shape", lambda a: hb.import_tensor(a, dtype=dtype, shape=(4,))),
        ("PortableTensor", lambda a: devbridge.PortableTensor((4,), dtype, a)),
    ]
    for entry, call in entries:
        with pytest.raises(TypeError, match=r"masked array.*a\.filled\(value\).*a\.data"):
            call(m)
            pytest.fail(f"{entry} took a masked array")
    with hb.upload(np.zeros(4, dtype), wait=True) as t:
        out = np.ma.MaskedArray(np.zeros(4, dtype), mask=mask)
        with pytest.raises(TypeError, match=r"out is a numpy masked array.*out\.data"):
            hb.download(t, out)
        assert np.array_equal(hb.download(t, out.data), np.zeros(4, dtype))
    collect()
    assert hb.stats()["live_allocations"] == before


# ----------------------------------------------------------------------------------------- 5. dtypes


def _unheld_producers():
    """(label, array) of dtypes devbridge does not hold, from numpy and from DLPack producers."""
    out = [("numpy complex64", np.zeros(3, np.complex64))]
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3"):
        if hasattr(ml_dtypes, name):
            out.append((f"numpy {name}", np.zeros(3, getattr(ml_dtypes, name))))
    try:
        import torch
        out += [(f"torch {name}", torch.zeros(3, dtype=getattr(torch, name)))
                for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "complex64", "complex128")
                if hasattr(torch, name)]
    except ImportError:
        pass
    try:
        import jax.numpy as jnp
        out += [(f"jax {name}", jnp.zeros(3, getattr(jnp, name)))
                for name in ("float8_e4m3fnuz", "float8_e4m3", "complex64") if hasattr(jnp, name)]
    except ImportError:
        pass
    return out


def test_a_dtype_devbridge_does_not_hold_is_a_valueerror_however_it_arrives(hb):
    before = hb.stats()["live_allocations"]
    for label, array in _unheld_producers():
        for entry, call in _array_entries(hb):
            with pytest.raises(ValueError, match="unknown dtype") as info:
                call(array)
            assert "float8_e4m3fn\"" not in str(info.value), f"{entry}, {label}: read as another float8"
    collect()
    assert hb.stats()["live_allocations"] == before


@pytest.mark.parametrize("scalar", [np.float32(1.5), np.int64(-3), np.bool_(True), np.uint16(7)])
def test_import_tensor_reads_a_numpy_scalar_as_upload_does(ib, scalar):
    with ib.upload(scalar, wait=True) as a, ib.import_tensor(scalar) as b:
        assert (a.shape, a.dtype) == (b.shape, b.dtype) == ((), _intake._dtype_name(scalar.dtype))
        assert ib.download(b).tobytes() == ib.download(a).tobytes() == scalar.tobytes()


@pytest.mark.parametrize("dtype, why", [
    ([("a", "<i4"), ("b", "<f4")], "structured dtype"), (np.dtype("V8"), "raw void dtype"),
])
def test_a_structured_or_void_array_is_named_as_such(hb, dtype, why):
    a = np.zeros(3, dtype)
    for entry, call in _array_entries(hb):
        with pytest.raises(ValueError, match=why):
            call(a)
    with hb.upload(a, dtype="uint64", wait=True) as t:  # its bytes relabelled, as dtype= allows any array
        assert t.dtype == "uint64" and t.shape == (3,)


def test_dtypes_numpy_lacks_are_still_read(hb):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        a = np.arange(4).astype(getattr(ml_dtypes, name))
        for entry, call in _array_entries(hb):
            call(a)


# ------------------------------------------------------------------------------------ 6. another bridge


def test_another_bridges_tensor_is_foreign_domain_at_every_entry(tmp_path):
    a = make_bridge("host", ring_bytes=RING)
    c = make_bridge("host", ring_bytes=RING)
    try:
        x = c.upload(np.arange(4, dtype=np.float32), wait=True)
        calls = [("download", lambda: a.download(x)),
                 ("export", lambda: a.export(x)),
                 ("export with a view", lambda: a.export(x, shape=(2,))),
                 ("export_to", lambda: a.export_to(x, io.BytesIO())),
                 ("transfer", lambda: a.transfer(x, c)),
                 ("checkpoint", lambda: a.checkpoint(tmp_path / "x.safetensors", {"x": x}))]
        for name, call in calls:
            with pytest.raises(devbridge.ForeignDomain) as info:
                call()
            assert isinstance(info.value, devbridge.BridgeError), name
        with pytest.raises(devbridge.ForeignDomain, match="belongs to another bridge"):
            a.export(x)
        x.free()
    finally:
        collect()
        a.close()
        c.close()
