"""tinygrad computes directly on the bridge's memory: view().to_tinygrad()."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import devbridge
from conftest import collect, download, make_bridge, random_array, upload

tinygrad = pytest.importorskip("tinygrad")
from tinygrad import Tensor  # noqa: E402

F32 = devbridge.ObjectSpec(max_extent=64 << 20, alignment=256, dtype="float32")


def expected_device(backend_name: str) -> str:
    return "CPU" if backend_name == "host" else "CUDA"


def test_tinygrad_computes_on_uploaded_data(bridge, backend_name, rng):
    a = random_array(rng, (64, 48), "float32")
    w = random_array(rng, (48, 32), "float32")
    ha, hw = bridge.alloc(F32, a.nbytes), bridge.alloc(F32, w.nbytes)
    ra, rw = bridge.ring.reserve(a.nbytes), bridge.ring.reserve(w.nbytes)
    bridge.ring.ndarray(ra, "float32")[:] = a.ravel()
    bridge.ring.ndarray(rw, "float32")[:] = w.ravel()
    ea, ew = bridge.host_to_device(ra, ha), bridge.host_to_device(rw, hw)  # async, in flight

    with bridge.view(ha, "float32", a.shape) as va, bridge.view(hw, "float32", w.shape) as vw:
        assert bridge.copy_status(ea) == "completed" and bridge.copy_status(ew) == "completed"
        ta, tw = va.to_tinygrad(), vw.to_tinygrad()
        assert ta.shape == a.shape and ta.dtype == tinygrad.dtypes.float32
        assert ta.device == expected_device(backend_name)

        total = (ta * 2 + 1).sum().item()
        np.testing.assert_allclose(total, float((a.astype(np.float64) * 2 + 1).sum()), rtol=1e-4)
        product = (ta @ tw).numpy()
        np.testing.assert_allclose(product, a @ w, rtol=1e-4, atol=1e-4)

    bridge.ring.release(ra)
    bridge.ring.release(rw)
    # Download the operands back: tinygrad read them without moving them.
    np.testing.assert_array_equal(download(bridge, ha, a.nbytes, "float32").reshape(a.shape), a)
    del ta, tw
    collect()
    bridge.free(ha)
    bridge.free(hw)


def test_handoff_is_zero_copy(backend_name, rng):
    # Writing under a live view is what this test needs to see: the bridge must allow it.
    bridge = make_bridge(backend_name, writes_under_view="allow")
    first = random_array(rng, 1024, "float32")
    h = bridge.alloc(F32, first.nbytes)
    r = bridge.ring.reserve(first.nbytes)
    bridge.ring.ndarray(r, "float32")[:] = first
    bridge.wait(bridge.host_to_device(r, h))
    with bridge.view(h, "float32", 1024) as view:
        t = view.to_tinygrad()
        np.testing.assert_allclose((t + 0).numpy(), first)
        # New bytes land in the same memory; the same tensor sees them.
        second = random_array(rng, 1024, "float32")
        bridge.ring.ndarray(r, "float32")[:] = second
        bridge.wait(bridge.host_to_device(r, h, mode="sync"))
        np.testing.assert_allclose((t + 0).numpy(), second)
    bridge.ring.release(r)
    del t
    collect()
    bridge.close()


def test_write_through_tinygrad_is_seen_by_a_download(bridge, rng):
    x = random_array(rng, (32, 32), "float32")
    h = bridge.alloc(F32, x.nbytes)
    upload(bridge, h, x)
    with bridge.view(h, "float32", x.shape) as view:
        t = view.to_tinygrad()
        t.assign(t * 3 + 1).realize()
        devbridge.tinygrad_synchronize(t)
    back = download(bridge, h, x.nbytes, "float32").reshape(x.shape)
    np.testing.assert_allclose(back, x * 3 + 1, rtol=1e-5, atol=1e-6)  # tinygrad may fuse to an FMA
    del t
    collect()


def test_tensor_keeps_its_own_lease(bridge, rng):
    x = random_array(rng, 256, "float32")
    h = bridge.alloc(F32, x.nbytes)
    upload(bridge, h, x)
    view = bridge.view(h, "float32", 256)
    t = view.to_tinygrad()
    view.close()  # the tensor's lease is its own
    with pytest.raises(devbridge.AllocationStillInUse):
        bridge.free(h)
    lazy = t * 2  # not realized: it still reads the bridge's memory
    del t
    collect()
    with pytest.raises(devbridge.AllocationStillInUse):
        bridge.free(h)
    np.testing.assert_allclose(lazy.numpy(), x * 2)
    del lazy
    collect()
    assert bridge.stats()["live_views"] == 0
    bridge.free(h)


def test_to_tinygrad_waits_for_uploads_in_flight(rng):
    with devbridge.Bridge(backend="fake", writes_under_view="allow") as b:  # the upload goes under a view
        x = random_array(rng, 1024, "float32")
        h = b.alloc(F32, x.nbytes)
        r = b.ring.reserve(x.nbytes)
        b.ring.ndarray(r, "float32")[:] = x
        view = b.view(h, "float32", 1024)  # before the upload: nothing in flight yet
        event = b.host_to_device(r, h)
        seen = {}

        def hand_off():
            t = view.to_tinygrad()
            seen["status_at_handoff"] = b.copy_status(event)
            seen["values"] = t.numpy()

        worker = threading.Thread(target=hand_off)
        worker.start()
        assert b.fake.complete(event)
        worker.join(timeout=300)
        assert not worker.is_alive()
        assert seen["status_at_handoff"] == "completed"
        np.testing.assert_array_equal(seen["values"], x)
        view.close()
        collect()


def test_non_contiguous_views_are_refused_clearly(bridge):
    h = bridge.alloc(F32, 4096)
    with bridge.view(h, "float32", (16, 16), strides=(64, 2)) as view:
        with pytest.raises(devbridge.Unsupported, match="contiguous"):
            view.to_tinygrad()
    view.close()
    with pytest.raises(devbridge.Closed):
        view.to_tinygrad()
    bridge.free(h)


# ---- addresses tinygrad's kernels cannot load through ------------------------
# tinygrad's kernels load and store float4/int4 (16 bytes) with aligned vector instructions: handed an
# address that is not a multiple of 16, the process died (SIGSEGV) at the first kernel. Each case runs in a
# subprocess, so a regression is a failed test, not a dead pytest.

_HANDOFF_SCRIPT = r"""
import sys
import numpy as np, devbridge
mode, dtype, offset = sys.argv[1], sys.argv[2], int(sys.argv[3])
b = devbridge.Bridge(backend="host")
if mode == "view":    # an allocation viewed at a byte offset
    a = (np.arange(4096) % 100).astype(dtype)
    x = b.upload(a, wait=True)
    n = 256
    expected = a[offset // a.itemsize: offset // a.itemsize + n]
    view = b.view(x.handle, dtype, (n,), offset=offset)
else:                 # adopt() of a read-only array that starts offset bytes into its buffer
    base = (np.arange(4096 + 16) % 100).astype(dtype)
    start = (-base.ctypes.data % 64 + offset) // base.itemsize
    expected = base[start: start + 1024]
    expected.flags.writeable = False
    view = b.adopt(expected).view()
print("address mod 64:", view.ptr % 64, flush=True)
try:
    t = view.to_tinygrad()
except devbridge.Unsupported as error:
    print("UNSUPPORTED", error, flush=True)
    sys.exit(0)
got = (t + t).numpy()
t.sum().realize()
print("COMPUTED", np.array_equal(got, expected + expected), flush=True)
"""


def _hand_off_in_a_subprocess(mode: str, dtype: str, offset: int, dev: str = "CPU"):
    import os
    import subprocess
    import sys

    env = dict(os.environ, DEV=dev)
    done = subprocess.run([sys.executable, "-c", _HANDOFF_SCRIPT, mode, dtype, str(offset)], env=env,
                          capture_output=True, text=True, errors="replace", timeout=300)
    assert done.returncode == 0, f"rc {done.returncode} (-11: SIGSEGV): {done.stdout}{done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.parametrize("mode, dtype, offset", [
    ("view", "float32", 4), ("view", "float32", 8), ("view", "float32", 12), ("view", "float32", 36),
    ("view", "int32", 24), ("adopt", "float32", 4), ("adopt", "int32", 8),
])
def test_an_unaligned_address_is_refused_not_a_crash(backend_name, mode, dtype, offset):
    if backend_name != "host":
        pytest.skip("the crashing kernels are tinygrad's CPU ones (the refusal itself: the next test)")
    out = _hand_off_in_a_subprocess(mode, dtype, offset)
    assert "UNSUPPORTED" in out, out
    assert "not a multiple of 16 bytes" in out and "load and store up to 16 bytes" in out
    assert (f"byte offset {offset}" if mode == "view" else "adopted memory") in out
    assert "bridge.upload(array)" in out and "bridge.download(" in out  # what to do instead


@pytest.mark.parametrize("dtype, offset", [("float32", 16), ("float32", 32), ("float32", 48), ("int32", 16),
                                           ("float16", 16), ("int8", 48), ("float64", 16)])
def test_a_view_at_a_multiple_of_16_bytes_is_handed_over(backend_name, dtype, offset):
    if backend_name != "host":
        pytest.skip("a subprocess on tinygrad's CPU device")
    out = _hand_off_in_a_subprocess("view", dtype, offset)
    assert "COMPUTED True" in out, out


@pytest.mark.parametrize("dtype, offset", [("float32", 4), ("float16", 2), ("float16", 8), ("uint8", 1),
                                           ("int8", 15), ("float64", 8), ("bfloat16", 6)])
def test_every_dtype_needs_an_address_that_is_a_multiple_of_16(bridge, dtype, offset):
    # The rule is the width of tinygrad's vectors, not the dtype: refused before tinygrad sees the address.
    h = bridge.alloc(devbridge.ObjectSpec(1 << 16, 256, "bytes"), 4096)
    with bridge.view(h, dtype, (64,), offset=offset) as view:
        with pytest.raises(devbridge.Unsupported, match=f"byte offset {offset} .*not a multiple of 16 bytes"):
            view.to_tinygrad()
    assert bridge.stats()["live_views"] == 0, "the refused hand-off's lease was closed"
    bridge.free(h)


def test_the_llvm_renderer_needs_32_bytes(backend_name):
    # tinygrad's LLVM renderer declares every buffer argument "align 32" (its CPUAllocator promises 0x20).
    if backend_name != "host":
        pytest.skip("a subprocess on tinygrad's CPU device")
    import os
    import subprocess
    import sys

    script = r"""
import numpy as np, devbridge
from tinygrad import Device
try:
    renderer = type(Device["CPU"].renderer).__name__
except Exception as error:
    print("NO LLVM", error); raise SystemExit(0)
b = devbridge.Bridge(backend="host")
x = b.upload(np.arange(1024, dtype=np.float32), wait=True)
for offset in (16, 32):
    try:
        b.view(x.handle, "float32", (64,), offset=offset).to_tinygrad()
        print(renderer, offset, "HANDED")
    except devbridge.Unsupported as error:
        print(renderer, offset, "UNSUPPORTED", error)
"""
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, DEV="CPU:LLVM"),
                          capture_output=True, text=True, errors="replace", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    if "NO LLVM" in done.stdout:
        pytest.skip(f"tinygrad's LLVM renderer is not usable here: {done.stdout}")
    lines = done.stdout.splitlines()
    assert lines[0].startswith("CPULLVMRenderer 16 UNSUPPORTED") and "not a multiple of 32 bytes" in lines[0], lines
    assert lines[1] == "CPULLVMRenderer 32 HANDED", lines


def test_views_from_before_a_restart_are_refused(bridge):
    h = bridge.alloc(F32, 4096)
    view = bridge.view(h, "float32", 1024)
    bridge.restart(bridge.generation + 1)
    with pytest.raises(devbridge.OldGenerationHandle):
        view.to_tinygrad()
    with pytest.raises(devbridge.OldGenerationHandle):
        view.ptr
    assert bridge.stats()["orphaned_allocations"] == 1
    view.close()  # ends, and frees the memory the old generation kept for it
    assert bridge.stats()["orphaned_allocations"] == 0


@pytest.mark.parametrize("dtype", ["float16", "int32", "uint8", "bfloat16"])
def test_other_dtypes(bridge, backend_name, rng, dtype):
    spec = devbridge.ObjectSpec(1 << 20, 64, dtype)
    if dtype == "bfloat16":
        bits = rng.integers(0x3F00, 0x4000, size=256, dtype=np.uint16)  # finite values in [0.5, 2)
        raw = bits.view(np.uint8)
    else:
        raw = random_array(rng, 256, dtype).view(np.uint8)
    h = bridge.alloc(spec, raw.nbytes)
    upload(bridge, h, raw)
    with bridge.view(h, dtype, 256) as view:
        if dtype == "bfloat16":
            try:
                t = view.to_tinygrad()
            except devbridge.UnsupportedDType as error:
                # tinygrad's CPU device compiles with a clang that has no __bf16 here (Debian 12's clang 14):
                # refused at the hand-off, not a compiler error at the first kernel (test_bfloat16_...).
                assert "cannot compile bfloat16 (__bf16)" in str(error), error
                assert bridge.stats()["live_views"] == 1, "the refused hand-off's lease was closed"
                return
            assert t.dtype == tinygrad.dtypes.bfloat16
            np.testing.assert_array_equal(t.bitcast(tinygrad.dtypes.uint16).numpy(), bits)
            widened = (bits.astype(np.uint32) << 16).view(np.float32)  # bfloat16's exact float32
            np.testing.assert_array_equal(t.cast(tinygrad.dtypes.float32).numpy(), widened)  # a kernel over it
        else:
            t = view.to_tinygrad()
            np.testing.assert_array_equal(t.numpy(), raw.view(dtype))
    del t
    collect()


# ---- bfloat16 on tinygrad's CPU device --------------------------------------
# Its C renderer declares bfloat16 buffers __bf16, which clang 14 (Debian 12's, scripts/setup.sh's) refuses on
# x86-64. Before, to_tinygrad() handed the tensor over and every kernel over it, .numpy() included, failed in
# clang (subprocess.CalledProcessError, "__bf16 is not supported on this target").

_BF16_SCRIPT = r"""
import numpy as np, devbridge
from tinygrad import dtypes
bits = np.array([0x3FC0, 0xC010, 0x3F80, 0x40E0], np.uint16)  # 1.5, -2.25, 1, 7
with devbridge.Bridge(backend="host") as b:
    x = b.upload(bits, dtype="bfloat16", wait=True)
    try:
        t = x.to_tinygrad()
    except devbridge.UnsupportedDType as error:
        print("REFUSED", error)
        raise SystemExit(0)
    try:
        print("COMPUTED", (t.cast(dtypes.float32) * 2).numpy().tolist())
    except Exception as error:
        print("FAILED", type(error).__name__)
"""


@pytest.mark.parametrize("dev", ["CPU", "CPU:X86"])
def test_bfloat16_either_computes_or_is_refused_at_the_hand_off(backend_name, dev):
    if backend_name != "host":
        pytest.skip("a subprocess on tinygrad's CPU device")
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _BF16_SCRIPT], env=dict(os.environ, DEV=dev),
                          capture_output=True, text=True, errors="replace", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    out = done.stdout
    if dev == "CPU:X86":  # tinygrad's own x86 code: no clang, and bfloat16 computes
        assert "COMPUTED [3.0, -4.5, 2.0, 14.0]" in out, out + done.stderr[-2000:]
        return
    assert "REFUSED" in out or "COMPUTED [3.0, -4.5, 2.0, 14.0]" in out, out + done.stderr[-2000:]
    if "REFUSED" in out:
        assert "UnsupportedDType" in out and "cannot compile bfloat16 (__bf16)" in out
        for way_round in ("DEV=CPU:X86", "array.view(numpy.uint16)", ".bitcast(dtypes.float32)", "bridge.download"):
            assert way_round in out, way_round


def test_the_bfloat16_probe_reports_the_compilers_error():
    from devbridge import _tinygrad

    assert _tinygrad._bfloat16_compile_error("/nonexistent/cc", "x86_64", ()) is None  # tinygrad will say why
    assert _tinygrad._bfloat16_compile_error("false", "x86_64", ()) == "false exited with status 1"


def test_a_prefetcher_of_bfloat16_batches_is_refused_at_batch_0_or_computes(bridge, backend_name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from devbridge import _tinygrad

    values = np.array([1.5, -2.25, 1.0, 7.0], ml_dtypes.bfloat16)
    device = expected_device(backend_name)
    refusal = _tinygrad._bfloat16_refusal(_tinygrad._tinygrad_names(), device)
    it = devbridge.Prefetcher(bridge, [{"x": values}], to="tinygrad")
    if refusal is None:
        out = next(it)
        np.testing.assert_array_equal(out["x"].cast(tinygrad.dtypes.float32).numpy(), values.astype(np.float32))
        del out
    else:
        with pytest.raises(devbridge.UnsupportedDType,
                           match=r"Prefetcher batch 0 \(key 'x'\): to_tinygrad: .* cannot compile bfloat16"):
            next(it)
        assert it.closed
    it.close()
    collect()
    assert bridge.stats()["live_views"] == 0 and bridge.stats()["live_allocations"] == 0


# ---- how the tensor is built ------------------------------------------------
# to_tinygrad() builds the tensor Tensor.from_blob would, without its slow
# general path (python/devbridge/_tinygrad.py). These pin down that the two
# are the same graph, that the check guarding the direct path passes with
# the tinygrad installed here, and that the from_blob fallback still works.


def test_direct_construction_is_the_graph_from_blob_builds(bridge):
    from tinygrad.uop.ops import Ops

    from devbridge import _tinygrad

    assert _tinygrad._fast_path_ok(), "the direct construction no longer matches this tinygrad: hand-offs are slow"
    h = bridge.alloc(F32, 32 * 48 * 4)
    with bridge.view(h, "float32", (32, 48)) as view:
        t = view.to_tinygrad()
        ref = Tensor.from_blob(view.ptr, (32, 48), dtype=tinygrad.dtypes.float32, device=t.device)
        assert t.uop.op is ref.uop.op is Ops.RESHAPE
        assert t.uop.src[1] is ref.uop.src[1]  # the same interned shape
        buffer, ref_buffer = t.uop.src[0].buffer, ref.uop.src[0].buffer
        assert t.uop.src[0].op is Ops.BUFFER and buffer is t.uop.buffer
        assert (buffer.device, buffer.size, buffer.dtype) == (ref_buffer.device, ref_buffer.size, ref_buffer.dtype)
        assert buffer.options.external_ptr == ref_buffer.options.external_ptr == view.ptr
        assert t.uop.is_realized and hasattr(buffer, "_devbridge_lease")
        np.testing.assert_array_equal((t * 2 + 1).numpy(), (ref * 2 + 1).numpy())
    del t, ref, buffer, ref_buffer
    collect()
    assert bridge.stats()["live_views"] == 0
    bridge.free(h)


@pytest.mark.parametrize("shape", [(), (256,), (4, 8, 8)], ids=["rank0", "rank1", "rank3"])
def test_ranks(bridge, rng, shape):
    x = random_array(rng, shape, "float32")
    h = bridge.alloc(F32, 256 * 4)
    upload(bridge, h, np.asarray(x))
    with bridge.view(h, "float32", shape) as view:
        t = view.to_tinygrad()
        assert t.shape == shape
        np.testing.assert_array_equal((t + 0).numpy(), x)
    del t
    collect()
    bridge.free(h)


def test_from_blob_fallback(bridge, rng, monkeypatch):
    from devbridge import _tinygrad

    monkeypatch.setattr(_tinygrad, "_fast_path_ok", lambda: False)  # as if this tinygrad's internals had changed
    x = random_array(rng, (16, 16), "float32")
    h = bridge.alloc(F32, x.nbytes)
    upload(bridge, h, x)
    view = bridge.view(h, "float32", x.shape)
    t = view.to_tinygrad()
    view.close()
    np.testing.assert_allclose((t * 2).numpy(), x * 2)
    with pytest.raises(devbridge.AllocationStillInUse):
        bridge.free(h)  # the fallback's tensor holds its lease too
    del t
    collect()
    bridge.free(h)


# ---- tinygrad's default device -----------------------------------------------
# Tensors made without device= land on tinygrad's default device; on a machine
# with an OpenCL driver that is CL, and mixing it with a CPU view's tensor fails.


class _Default:
    """Stands in for tinygrad's Device: only its default device matters here."""

    def __init__(self, name):
        self.name = name

    def canonicalize(self, device):
        assert device is None
        return self.name


@pytest.fixture
def default_device(monkeypatch):
    from devbridge import _tinygrad

    names = _tinygrad._tinygrad_names()
    monkeypatch.setattr(_tinygrad, "_warned_device_pairs", set())

    def choose(name):
        monkeypatch.setattr(names, "Device", _Default(name))

    return choose


def test_a_default_device_that_differs_is_warned_once(bridge, default_device):
    h = bridge.alloc(F32, 1024)
    with bridge.view(h, "float32", 256) as view:
        default_device("CL")
        with pytest.warns(devbridge.DeviceMismatchWarning) as caught:
            t1 = view.to_tinygrad()
            t2 = view.to_tinygrad()  # the same pair again: no second warning
        assert len(caught) == 1
        message = str(caught[0].message)
        assert t1.device in message and "CL" in message and "DEV=" in message and "device=" in message
        assert caught[0].filename == __file__  # it points at the caller's line
        default_device("NULL")  # another default: warned once more
        with pytest.warns(devbridge.DeviceMismatchWarning, match="NULL"):
            t3 = view.to_tinygrad()
    del t1, t2, t3
    collect()
    bridge.free(h)


def test_no_warning_when_the_default_is_the_views_device(bridge, default_device):
    import warnings

    h = bridge.alloc(F32, 1024)
    with bridge.view(h, "float32", 256) as view:
        default_device("CPU" if view.device == "CPU" else view.device.replace(":0", ""))
        with warnings.catch_warnings():
            warnings.simplefilter("error", devbridge.DeviceMismatchWarning)
            t = view.to_tinygrad()
    del t
    collect()
    bridge.free(h)


def test_the_prefetcher_warns_at_the_consumers_loop(bridge, default_device):
    default_device("CL")
    with pytest.warns(devbridge.DeviceMismatchWarning) as caught:
        for x in devbridge.Prefetcher(bridge, [np.zeros(16, np.float32)] * 3, to="tinygrad"):
            pass
    assert len(caught) == 1 and caught[0].filename == __file__
    del x
    collect()


# ---- importing tinygrad -----------------------------------------------------
# Only a ModuleNotFoundError for tinygrad itself means "not installed". Before, every ImportError was reported
# as "tinygrad is not installed (pip install tinygrad)", sending the user to install a package they have.


class _TinygradImport:
    """A meta path finder making ``import tinygrad`` raise ``error`` (as a broken install, or an earlier import
    interrupted half way, does)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def find_spec(self, name, path=None, target=None):
        import importlib.util

        return importlib.util.spec_from_loader(name, self) if name == "tinygrad" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.error


@pytest.fixture
def fresh_import(monkeypatch):
    """``import tinygrad`` runs again (and everything is put back afterwards)."""
    import sys

    from devbridge import _tinygrad

    monkeypatch.setattr(_tinygrad, "_tinygrad_module", None)
    monkeypatch.delitem(sys.modules, "tinygrad")

    def failing_with(error: BaseException) -> None:
        monkeypatch.setattr(sys, "meta_path", [_TinygradImport(error), *sys.meta_path])

    return failing_with


@pytest.mark.parametrize("error", [
    ImportError("libfoo.so: cannot open shared object file"),
    ModuleNotFoundError("No module named 'tinygrad_dependency'", name="tinygrad_dependency"),
], ids=["ImportError", "a-dependency-missing"])
def test_a_tinygrad_that_fails_to_import_says_so_with_its_cause(fake_bridge, fresh_import, error):
    fresh_import(error)
    with pytest.raises(devbridge.Unavailable, match="tinygrad is installed but failed to import") as caught:
        devbridge.Prefetcher(fake_bridge, [np.ones(4, np.float32)], to="tinygrad")
    assert str(error) in str(caught.value) and type(error).__name__ in str(caught.value)
    assert "not installed" not in str(caught.value)
    assert caught.value.__cause__ is error


def test_a_tinygrad_that_is_not_installed_says_so(fresh_import, monkeypatch):
    import sys

    from devbridge import _tinygrad

    monkeypatch.setitem(sys.modules, "tinygrad", None)  # import tinygrad: ModuleNotFoundError, name "tinygrad"
    with pytest.raises(devbridge.Unavailable, match=r"tinygrad is not installed \(pip install tinygrad\)"):
        _tinygrad._import_tinygrad()


def test_an_interrupt_while_importing_tinygrad_is_raised_as_it_is(fresh_import):
    from devbridge import _tinygrad

    fresh_import(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        _tinygrad._import_tinygrad()
