"""Every entry that takes an array, and what download gives back.

One intake (``_intake._intake``) reads what upload, adopt, the Prefetcher, import_tensor,
PortableTensor.from_array and a devbridge.ray put are given: numpy, any DLPack producer in host memory
(jax, torch, devbridge's own tensors; bfloat16 and float8 included, which numpy's from_dlpack refuses) or
a buffer. A big-endian array is converted to devbridge's little-endian bytes where the entry copies anyway,
and refused by adopt, which copies nothing. Downloads are bounded by the tensor, read untyped allocations
as bytes, and give bfloat16/float8 as ml_dtypes' types when ml_dtypes is installed (else their bits).

torch cases skip where torch does not import: PyPI's Linux torch wheel (about 0.5 GB) needs the nvidia-*
packages (GBs) even on a CPU, so the suite does not install it.
"""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

import devbridge
from devbridge import _intake
from conftest import auto_bridge, collect, make_bridge, random_array

RING = 1 << 20


@pytest.fixture(params=["fake", "host"])
def ib(request):
    yield from auto_bridge(request.param, ring_bytes=RING)


@pytest.fixture
def hb():
    b = make_bridge("host", ring_bytes=RING)
    yield b
    collect()
    b.close()


@pytest.fixture
def without_ml_dtypes(monkeypatch):
    """As if ml_dtypes were not installed: its import fails (whether or not it was imported already)."""
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    _intake._ml_dtypes.cache_clear()
    yield
    _intake._ml_dtypes.cache_clear()


def raw_bits(rng, dtype: str, n: int) -> np.ndarray:
    """``n`` random elements of ``dtype`` as their raw bytes (no NaN payload games: bit-exact compares)."""
    raw = rng.integers(0, 256, size=n * devbridge.dtype_info(dtype)["itemsize"], dtype=np.uint8)
    if dtype == "bool":
        raw &= 1
    return raw


def bytes_of(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).tobytes()


# ------------------------------------------------------------------------------------- 1. byte order


BIG = (np.arange(5) * 1.5).astype(">f4")
assert BIG.dtype.str == ">f4"


def test_upload_converts_a_big_endian_array_to_its_values(ib):
    with ib.upload(BIG, wait=True) as t:
        assert t.dtype == "float32"
        back = ib.download(t)
        assert back.dtype == np.float32 and np.array_equal(back, BIG)


def test_the_prefetcher_converts_big_endian_batches(ib):
    batches = [{"x": BIG, "y": np.arange(3, dtype=">i8")}]
    with devbridge.Prefetcher(ib, batches, to="device") as it:
        got = next(it)
        assert np.array_equal(got["x"].numpy(), BIG) and np.array_equal(got["y"].numpy(), [0, 1, 2])
        assert got["y"].dtype == "int64"


def test_import_tensor_and_from_array_convert_a_big_endian_array(ib):
    with ib.import_tensor(BIG) as t:
        assert t.dtype == "float32" and np.array_equal(t.numpy(), BIG)
    p = devbridge.PortableTensor.from_array(BIG)
    assert p.tobytes() == BIG.astype("<f4").tobytes()


def test_adopt_refuses_a_big_endian_array_naming_its_dtype(hb):
    a = BIG.copy()
    a.flags.writeable = False
    before = hb.stats()["live_allocations"]
    with pytest.raises(ValueError, match=r"adopt: .*big-endian \(>f4\)"):
        hb.adopt(a)
    assert hb.stats()["live_allocations"] == before


def test_a_ray_put_reads_through_the_same_intake():
    # The worker's put (devbridge.ray) takes anything numpy.asarray takes: the intake with any layout.
    a = np.arange(12, dtype=">i4").reshape(3, 4).T
    got = _intake._intake(a, "put", any_layout=True)
    assert got.flags.c_contiguous and got.dtype == np.dtype("<i4") and np.array_equal(got, a)
    assert np.array_equal(_intake._intake([[1, 2], [3, 4]], "put", any_layout=True), [[1, 2], [3, 4]])


# ------------------------------------------------------------------------------------------ 2. DLPack


JAX_DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "bool"]


@pytest.mark.parametrize("dtype", JAX_DTYPES)
def test_a_jax_array_uploads_bit_exact(ib, rng, dtype):
    jnp = pytest.importorskip("jax.numpy")
    raw = raw_bits(rng, dtype, 300)
    x = jnp.asarray(raw.view(_intake._numpy_dtype(dtype)).reshape(3, 100))
    assert str(x.dtype) == dtype
    with ib.upload(x, wait=True) as t:
        assert t.dtype == dtype and t.shape == (3, 100)
        assert bytes_of(ib.download(t)) == raw.tobytes()


def test_jax_batches_go_through_the_prefetcher_bit_exact(ib, rng):
    jnp = pytest.importorskip("jax.numpy")
    raws = [raw_bits(rng, "bfloat16", 64) for _ in range(3)]
    batches = [(jnp.asarray(r.view(_intake._numpy_dtype("bfloat16"))), jnp.arange(4, dtype=jnp.int32))
               for r in raws]
    with devbridge.Prefetcher(ib, batches, to="device") as it:
        for raw, (x, y) in zip(raws, it):
            assert x.dtype == "bfloat16" and bytes_of(x.numpy()) == raw.tobytes()
            assert y.dtype == "int32" and np.array_equal(y.numpy(), [0, 1, 2, 3])


def test_the_intake_reads_a_dlpack_producer_in_place(hb):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    for x in (jnp.arange(16, dtype=jnp.float32), jnp.arange(16, dtype=jnp.bfloat16)):
        a = _intake._intake(x, "upload")
        assert a.ctypes.data == x.unsafe_buffer_pointer()  # no copy, whichever route numpy allows
        assert _intake._dtype_name(a.dtype) == str(x.dtype)


def test_a_bfloat16_jax_array_is_adopted_in_place_and_outlives_its_producer(hb, rng):
    jnp = pytest.importorskip("jax.numpy")
    raw = raw_bits(rng, "bfloat16", 512)
    x = jnp.asarray(raw.view(_intake._numpy_dtype("bfloat16")))
    t = hb.adopt(x)
    with t.view() as view:
        assert view.ptr == x.unsafe_buffer_pointer()
    del x
    gc.collect()
    assert t.dtype == "bfloat16" and bytes_of(hb.download(t)) == raw.tobytes()
    t.free()


def test_import_tensor_and_from_array_take_dlpack_producers(ib, rng):
    jnp = pytest.importorskip("jax.numpy")
    raw = raw_bits(rng, "float8_e5m2", 40)
    x = jnp.asarray(raw.view(_intake._numpy_dtype("float8_e5m2")).reshape(5, 8))
    with ib.import_tensor(x) as t:
        assert t.dtype == "float8_e5m2" and t.shape == (5, 8) and bytes_of(t.numpy()) == raw.tobytes()
    p = devbridge.PortableTensor.from_array(x)
    assert p.dtype == "float8_e5m2" and p.tobytes() == raw.tobytes()


def test_a_devbridge_tensor_is_a_dlpack_producer_too(rng):
    # numpy's from_dlpack refuses bfloat16: the intake reads devbridge's own capsule.
    src = make_bridge("host", ring_bytes=RING)
    dst = make_bridge("fake", ring_bytes=RING)
    dst.fake.set_auto_complete(True)
    raw = raw_bits(rng, "bfloat16", 100)
    with src.upload(raw.view(np.uint16), dtype="bfloat16", wait=True) as t:
        with dst.upload(t, wait=True) as copy:
            assert copy.dtype == "bfloat16" and bytes_of(dst.download(copy)) == raw.tobytes()
    collect()
    assert src.stats()["live_views"] == 0
    src.close()
    dst.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "bool"])
def test_a_torch_tensor_uploads_bit_exact(ib, rng, dtype):
    torch = pytest.importorskip("torch")
    raw = raw_bits(rng, dtype, 64)
    x = torch.from_numpy(raw.view(np.uint8).copy()).view(getattr(torch, dtype)).reshape(4, -1)
    with ib.upload(x, wait=True) as t:
        assert t.dtype == dtype and t.shape == tuple(x.shape)
        assert bytes_of(ib.download(t)) == raw.tobytes()
    with devbridge.Prefetcher(ib, [x, x], to="device") as it:
        for got in it:
            assert got.dtype == dtype and bytes_of(got.numpy()) == raw.tobytes()


def _lazily_signed(torch):
    """torch tensors whose memory is not their values: (label, tensor, the values)."""
    z = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)
    cases = [
        ("neg view", torch.arange(6, dtype=torch.float32)._neg_view(), -np.arange(6, dtype=np.float32)),
        ("neg view, 2-d int", torch.arange(6, dtype=torch.int64).reshape(2, 3)._neg_view(),
         -np.arange(6, dtype=np.int64).reshape(2, 3)),
        ("imag of a conj", z.conj().imag, np.array([-2, 4, -0.5], np.float32)),  # strided, negative bit
    ]
    for _, tensor, values in cases:
        assert np.array_equal(tensor.resolve_neg().resolve_conj().numpy(), values)  # what torch says they are
    return cases


def test_torch_negative_and_conjugate_views_upload_their_values(ib):
    torch = pytest.importorskip("torch")
    before = ib.stats()["live_allocations"]
    for label, tensor, values in _lazily_signed(torch):
        with ib.upload(tensor, wait=True) as t:
            assert t.dtype == _intake._dtype_name(values.dtype) and t.shape == values.shape, label
            assert np.array_equal(t.numpy(), values), f"{label}: the sign was lost"
        with ib.import_tensor(tensor) as t:
            assert np.array_equal(t.numpy(), values), label
        assert np.array_equal(devbridge.PortableTensor.from_array(tensor).numpy(), values), label
        assert np.array_equal(_intake._intake(tensor, "put", any_layout=True), values), label  # a ray put
        with devbridge.Prefetcher(ib, [(tensor, tensor)], to="device") as it:
            (x, y), = it
            assert np.array_equal(x.numpy(), values) and np.array_equal(y.numpy(), values), label
            del x, y
    assert np.array_equal(torch.arange(3.0)._neg_view().numpy(force=True), [0, -1, -2]), "the source unchanged"
    collect()
    assert ib.stats()["live_allocations"] == before


def test_a_complex_conjugate_view_is_refused_for_its_dtype_not_its_export(ib):
    torch = pytest.importorskip("torch")
    z = torch.tensor([1 + 2j], dtype=torch.complex64).conj()
    with pytest.raises(ValueError, match="complex64"):  # before: "refused its DLPack export" (the conj bit)
        ib.upload(z)


def test_adopt_refuses_a_torch_view_whose_memory_is_not_its_values(hb):
    torch = pytest.importorskip("torch")
    before = hb.stats()["live_allocations"]
    for label, tensor, _ in _lazily_signed(torch):
        with pytest.raises(ValueError, match=r"adopt: the Tensor has torch's negative bit set.*resolve_neg\(\)"):
            hb.adopt(tensor)
    assert hb.stats()["live_allocations"] == before


def test_arrays_without_lazy_bits_are_read_in_place(hb):
    torch = pytest.importorskip("torch")
    x = torch.arange(8, dtype=torch.float32)
    got = _intake._intake(x, "upload")
    assert np.shares_memory(got, x.numpy()), "no resolve (no copy) for a tensor whose memory is its values"
    a = np.arange(4.0)
    assert _intake._intake(a, "upload") is a


class _OnDevice:
    def __dlpack__(self, **kwargs):
        raise AssertionError("never asked: it is not in host memory")

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA


class _Refusing:
    def __dlpack__(self, **kwargs):
        raise BufferError("cannot export this one")

    def __dlpack_device__(self):
        return (1, 0)


def test_producers_that_cannot_be_read_are_refused_clearly(ib):
    before = ib.stats()["live_allocations"]
    with pytest.raises(ValueError, match=r"upload: the _OnDevice lives on DLPack device \(2, 0\) \(CUDA\)"):
        ib.upload(_OnDevice())
    with pytest.raises(ValueError, match=r"Prefetcher batch 0 \(item 1\): .*\(CUDA\)"):
        next(devbridge.Prefetcher(ib, [(np.zeros(4), _OnDevice())], to="device"))
    with pytest.raises(TypeError, match="upload: the _Refusing refused its DLPack export: BufferError: cannot"):
        ib.upload(_Refusing())
    with pytest.raises(ValueError, match="import_tensor: .*CUDA"):
        ib.import_tensor(_OnDevice())
    with pytest.raises(TypeError, match="upload takes an array"):
        ib.upload([1.0, 2.0])
    assert ib.stats()["live_allocations"] == before


# ------------------------------------------------------------------------------------ 3. dtype round trip


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_dtypes_numpy_lacks_come_back_as_ml_dtypes_types_when_installed(ib, rng, dtype):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = raw_bits(rng, dtype, 32).view(getattr(ml_dtypes, dtype))
    with ib.upload(a, wait=True) as t:
        assert t.dtype == dtype
        back = ib.download(t)
        assert back.dtype == a.dtype and bytes_of(back) == bytes_of(a)
        with ib.upload(back, wait=True) as again:  # the round trip keeps the dtype
            assert again.dtype == dtype
        assert ib.export(t).numpy().dtype == a.dtype
        assert np.asarray(ib.export(t)).dtype == a.dtype
        bits = np.empty(32, np.dtype(f"uint{a.itemsize * 8}"))  # an out= of the bits still works
        assert bytes_of(ib.download(t, bits)) == bytes_of(a)


def test_without_ml_dtypes_they_come_back_as_their_bits(ib, rng, without_ml_dtypes):
    raw = raw_bits(rng, "bfloat16", 32)
    with ib.upload(raw.view(np.uint16), dtype="bfloat16", wait=True) as t:
        back = ib.download(t)
        assert back.dtype == np.uint16 and back.tobytes() == raw.tobytes()
        p = ib.export(t)
        assert p.numpy().dtype == np.uint16 and np.asarray(p).dtype == np.uint16 and p.data.format == "H"
    assert devbridge.PortableTensor((2,), "float8_e5m2", b"\x3c\x40").numpy().dtype == np.uint8


# ------------------------------------------------------------------------------ 4. bounded by the tensor


def test_a_download_larger_than_the_tensor_is_refused_naming_both_sizes(ib):
    with ib.upload(np.arange(4, dtype=np.float32), wait=True) as t:
        with pytest.raises(ValueError, match=r"shape \(64,\) float32 \(256 bytes\) is larger than the tensor's "
                                             r"16 bytes \(shape \(4,\) float32\)"):
            ib.download(t, shape=(64,))
        with pytest.raises(ValueError, match="larger than the tensor's 16 bytes"):
            ib.download(t, dtype="float64", shape=(4,))
        assert np.array_equal(ib.download(t, shape=(2, 2)), [[0, 1], [2, 3]])
        assert ib.download(t, dtype="uint8").shape == (16,)  # a relabelling: the tensor's bytes, no more
        with pytest.raises(ValueError, match="past the tensor's 16 bytes"):
            ib.export(t, shape=(64,))
        with pytest.raises(ValueError, match="past the tensor's 16 bytes"):
            ib.export(t, shape=(4,), offset=4)
        with pytest.raises(OverflowError):
            ib.download(t, shape=(2**63,))


# -------------------------------------------------------------------------------- 5. untyped allocations


def test_an_untyped_allocation_downloads_as_its_bytes_as_export_reads_it(ib, rng):
    h = ib.alloc(devbridge.ObjectSpec(1 << 20, 256, "bytes"), 4096)
    data = raw_bits(rng, "uint8", 4096)
    r = ib.ring.reserve(4096)
    ib.ring.ndarray(r, "uint8")[:] = data
    ib.wait(ib.host_to_device(r, h))
    ib.ring.release(r)
    back = ib.download(h)
    assert back.dtype == np.uint8 and back.shape == (4096,) and back.tobytes() == data.tobytes()
    assert ib.export(h).tobytes() == back.tobytes()
    assert ib.download(h, dtype="float32").shape == (1024,)
    assert ib.download(h, dtype="int64", shape=(2, 4)).tobytes() == data[:64].tobytes()
    ib.free(h)


# ------------------------------------------------------------------------------- 6. integers that do not fit


@pytest.mark.parametrize("alignment, error", [(2**64, OverflowError), (-1, OverflowError), (2**70, OverflowError),
                                              (0, devbridge.InvalidAlignment), (3, devbridge.InvalidAlignment),
                                              ("64", TypeError), (64.0, TypeError)])
def test_alignments_raise_what_the_argument_table_says(ib, alignment, error):
    a = np.zeros(4, np.float32)
    before = ib.stats()["live_allocations"]
    with pytest.raises(error):
        devbridge.spec_for_array(a.shape, a.dtype, alignment)
    with pytest.raises(error):
        ib.upload(a, alignment=alignment)
    with pytest.raises(error):
        ib.import_tensor(a, alignment=alignment)
    with pytest.raises(error):
        devbridge.Prefetcher(ib, [a], to="device", alignment=alignment)
    assert ib.stats()["live_allocations"] == before


def test_a_strided_upload_is_refused_with_the_producers_own_remedy(hb):
    """upload copies no strided array into one run of bytes behind the caller's back; the error says how
    to make one, in the producer's own terms."""
    with pytest.raises(ValueError, match=r"not C-contiguous.*pass numpy\.ascontiguousarray\(array\)"):
        hb.upload(np.arange(12, dtype=np.float32).reshape(3, 4).T)
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"not C-contiguous.*pass tensor\.contiguous\(\)"):
        hb.upload(torch.arange(12, dtype=torch.float32).reshape(3, 4).t())
    with hb.upload(torch.arange(12, dtype=torch.float32).reshape(3, 4).t().contiguous(), wait=True) as t:
        assert np.array_equal(t.numpy(), np.arange(12, dtype=np.float32).reshape(3, 4).T)


# A dtype argument is read the way its spelling reads everywhere, or refused: never bytes relabelled as
# something else. numpy's spellings name what numpy means; a C/tinygrad name numpy reads otherwise is
# ambiguous; a byte order the name leaves out is refused; ml_dtypes' IEEE-style float8_e4m3 is not e4m3fn.
@pytest.mark.parametrize("dtype, why", [
    (np.dtype(">f4"), "big-endian"), (">f4", "big-endian"), ("float", "ambiguous"), ("int", "ambiguous"),
    ("float8_e4m3", "unknown dtype"), ("datetime64[s]", "unknown dtype"), ("not-a-dtype", "unknown dtype"),
])
def test_a_dtype_that_would_relabel_bytes_silently_is_refused(ib, dtype, why):
    h = ib.upload(np.array([1.5, -2.0], np.float32), wait=True).handle
    for call in (lambda: ib.download(h, dtype=dtype, shape=(2,)),
                 lambda: ib.import_tensor(np.zeros(8, np.uint8).tobytes(), dtype=dtype, shape=(2,)),
                 lambda: ib.upload(np.zeros(2, np.uint32), dtype=dtype)):
        with pytest.raises(ValueError, match=why):
            call()


def test_ml_dtypes_ieee_float8_e4m3_is_refused_not_read_as_e4m3fn(ib):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if not hasattr(ml_dtypes, "float8_e4m3"):
        pytest.skip("this ml_dtypes has no IEEE-style float8_e4m3")
    with pytest.raises(ValueError, match="float8_e4m3"):
        ib.upload(np.array([np.inf, 1.0], ml_dtypes.float8_e4m3))


@pytest.mark.parametrize("spelling, name", [("<f4", "float32"), ("=f4", "float32"), ("f8", "float64"),
                                            ("long", "int64"), ("half", "float16"), ("dtypes.float", "float32"),
                                            ("fp8e5m2", "float8_e5m2"), (float, "float64"), (np.int16, "int16")])
def test_numpy_spellings_and_unambiguous_aliases_read_as_they_say(ib, spelling, name):
    assert devbridge.dtype_info(spelling)["name"] == name


@pytest.mark.parametrize("scalar", [np.datetime64("2020-01-01"), np.timedelta64(5, "s"), np.bytes_(b"abcdefgh")])
def test_a_numpy_scalar_of_a_dtype_devbridge_lacks_is_refused_not_uploaded_as_its_bytes(ib, scalar):
    with pytest.raises(ValueError, match="unknown dtype"):
        ib.upload(scalar)
    with pytest.raises(ValueError, match="unknown dtype"):
        devbridge.PortableTensor.from_array(scalar)


def test_a_numpy_scalar_uploads_as_a_0d_tensor_of_its_dtype(ib):
    t = ib.upload(np.float64(-0.0), wait=True)
    assert t.shape == () and t.dtype == "float64"
    assert ib.download(t).tobytes() == np.float64(-0.0).tobytes()
