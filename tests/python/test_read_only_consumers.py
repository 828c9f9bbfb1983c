"""Read-only memory stays unwritten through every consumer, and the advice for views no CPU consumer can take
is true.

An adopted tensor (``Bridge.adopt``) is the caller's immutable buffer itself: a read-only mmap, an
object-store array. tinygrad has no read-only tensors, so ``to_tinygrad()`` of one hands over a tensor
whose writes cannot reach the buffer (they land in a buffer of tinygrad's own); DLPack tells numpy the
memory is read-only and refuses consumers (jax) that ask for the capsule that cannot say so. An OpenCL
view cannot be handed to tinygrad at all: its error says what works instead.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import devbridge
from conftest import require_backend


def immutable(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a


def adopted(backend: str, a: np.ndarray) -> tuple[devbridge.Bridge, devbridge.DeviceTensor]:
    require_backend(backend)
    b = devbridge.Bridge(backend=backend, ring_bytes=1 << 20)
    if backend == "fake":
        b.fake.set_auto_complete(True)
    return b, b.adopt(a)


def cpu_context():
    pytest.importorskip("tinygrad")
    from tinygrad.helpers import Context

    return Context(DEV="CPU")


@pytest.mark.parametrize("backend", ["host", "fake"])
def test_no_tinygrad_write_through_a_read_only_tensor_reaches_the_adopted_memory(backend):
    a = immutable(np.random.default_rng(7).standard_normal((4, 8), dtype=np.float32))
    a_bits = a.tobytes()
    b, t = adopted(backend, a)
    from tinygrad import nn

    with cpu_context():
        x = t.to_tinygrad()
        assert x.shape == (4, 8) and x.dtype.name == "float"
        assert np.array_equal(x.numpy(), a) and (x * 2).numpy().tobytes() == (a * 2).tobytes()
        x.assign(x * 2).realize()                        # writes into tinygrad's own buffer (copy on write)
        assert np.array_equal(x.numpy(), a * 2)
        y = t.to_tinygrad()
        y.reshape(32).assign(y.reshape(32) + 1).realize()  # a view of it: assign looks through movement ops
        z = t.to_tinygrad()
        z += 3
        z.realize()
        w = t.to_tinygrad()
        w[1:3] = 0.0
        w.realize()
        p = t.to_tinygrad()                               # a parameter an optimizer steps
        opt = nn.optim.SGD([p], lr=0.5)
        from tinygrad.helpers import Context as _Context
        with _Context(TRAINING=1):
            (p * p).sum().backward()
            opt.step()
        assert np.array_equal(p.numpy(), a - 0.5 * 2 * a)
    assert a.tobytes() == a_bits, "a tinygrad write reached the adopted array"
    assert np.array_equal(t.numpy(), a)
    del x, y, z, w, p, opt
    t.free()
    b.close()


def test_a_tinygrad_write_into_an_adopted_read_only_mmap_does_not_fault(tmp_path):
    # Before, the kernel stored into the ACCESS_READ mapping: SIGSEGV. In a child, so a fault fails one test.
    pytest.importorskip("tinygrad")
    path = tmp_path / "weights.bin"
    path.write_bytes(np.arange(64, dtype=np.float32).tobytes())
    script = textwrap.dedent(f"""
        import mmap, os, numpy as np, devbridge
        fd = os.open({str(path)!r}, os.O_RDONLY)
        a = np.frombuffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ), np.float32)
        with devbridge.Bridge("host") as b:
            t = b.adopt(a)
            x = t.to_tinygrad()
            x.assign(x * 2).realize()
            assert np.array_equal(x.numpy(), np.arange(64, dtype=np.float32) * 2)
            assert np.array_equal(a, np.arange(64, dtype=np.float32))
            del x
            t.free()
        print("unwritten")
    """)
    env = {**os.environ, "DEV": "CPU"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "unwritten" in done.stdout, (done.returncode, done.stdout + done.stderr)


def test_a_tinygrad_that_would_write_through_is_refused_naming_the_handle(monkeypatch):
    # Where a tinygrad folds the identity away (the tensor is the buffer again), the hand-off is refused
    # instead of made writable: simulated by letting assign's walk look through the identity too.
    from devbridge import _tinygrad

    a = immutable(np.arange(16, dtype=np.float32))
    b, t = adopted("host", a)
    with cpu_context():
        tg = _tinygrad._tinygrad_names()
        monkeypatch.setattr(tg, "write_through_ops", tg.write_through_ops | {tg.Ops.MUL})
        with pytest.raises(devbridge.Unsupported, match=r"read-only.*bridge\.download.*bridge\.upload") as caught:
            t.to_tinygrad()
        assert repr(t.handle) in str(caught.value)
        monkeypatch.undo()
        assert b.stats()["live_views"] == 0, "the refused hand-off's lease ended"
    t.free()
    b.close()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_read_only_float8_is_refused_by_tinygrad_not_handed_on_with_changed_bits(dtype):
    # tinygrad stores float8 through float32 in every kernel (subnormals flushed, infinities saturated), and
    # the copy-on-write identity is a kernel: the hand-off would change the bits a read gives back.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = immutable(np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, dtype)))
    b, t = adopted("host", a)
    with cpu_context():
        tg = devbridge._tinygrad._tinygrad_names()
        if not tg.float8_dtypes:
            pytest.skip("this tinygrad has no float8")
        with pytest.raises(devbridge.Unsupported, match=r"float8 through float32.*bridge\.upload") as caught:
            t.to_tinygrad()
        assert repr(t.handle) in str(caught.value)
        assert b.stats()["live_views"] == 0, "the refused hand-off's lease ended"
        u = b.upload(a, wait=True)                       # the way the refusal names: bit-exact
        from tinygrad import dtypes
        assert np.array_equal(u.to_tinygrad().bitcast(dtypes.uint8).numpy(), np.arange(256, dtype=np.uint8))
        u.free()
    t.free()
    b.close()


def test_a_writable_array_is_not_adopted():
    require_backend("host")
    b = devbridge.Bridge(backend="host", ring_bytes=1 << 20)
    a = np.arange(16, dtype=np.float32)
    with pytest.raises(ValueError, match=r"writable.*a\.flags\.writeable = False.*bridge\.upload"):
        b.adopt(a)
    assert b.stats()["host_regions"] == 0 and b.stats()["adopted_allocations"] == 0
    a.flags.writeable = False
    t = b.adopt(a)                                       # the same memory, promised unwritten
    assert t.read_only
    t.free()
    b.close()


def test_dlpack_consumers_of_an_adopted_tensor_cannot_write_it():
    a = immutable(np.arange(12, dtype=np.int32).reshape(3, 4))
    b, t = adopted("host", a)
    n = np.from_dlpack(t)                                # DeviceTensor.__dlpack__: the versioned capsule
    assert not n.flags.writeable and np.shares_memory(n, a)
    with pytest.raises(ValueError, match="read-only"):
        n[0, 0] = 1
    del n
    jnp = pytest.importorskip("jax.numpy")
    # jax asks for the unversioned capsule, which cannot say read-only: refused, never a writable import.
    with pytest.raises(BufferError, match=r"read-only.*bridge\.download") as caught:
        jnp.from_dlpack(t)
    assert repr(t.handle) in str(caught.value)
    del caught
    assert np.array_equal(a, np.arange(12, dtype=np.int32).reshape(3, 4))
    t.free()
    b.close()


def test_to_tinygrad_of_an_opencl_view_says_what_works_instead():
    require_backend("opencl")
    pytest.importorskip("tinygrad")
    b = devbridge.Bridge(backend="opencl", ring_bytes=1 << 20)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = b.upload(a, wait=True)
    with pytest.raises(devbridge.Unsupported) as caught:
        t.to_tinygrad()
    message = str(caught.value)
    assert repr(t.handle) in message and "bridge.download" in message and 'to="device"' in message
    assert "use DLPack" not in message, "no CPU consumer can take an OpenCL capsule"
    # The advice works: a download is the array, and tinygrad takes it as any numpy array.
    from tinygrad import Tensor

    assert np.array_equal(Tensor(b.download(t), device="CPU").numpy(), a)
    assert b.stats()["live_views"] == 0
    t.free()
    b.close()


def test_torch_takes_a_copy_of_a_read_only_view_it_could_not_respect():
    """torch has no read-only tensors and ignores DLPack's flag: copy=True gives it memory of its own, and its
    in-place ops leave the adopted buffer as it was."""
    torch = pytest.importorskip("torch")
    b = devbridge.Bridge(backend="host", ring_bytes=1 << 20)
    try:
        frozen = np.arange(8, dtype=np.float32)
        frozen.flags.writeable = False
        t = b.adopt(frozen)
        with t.view() as view:
            x = torch.from_dlpack(view, copy=True)
        x.add_(1)
        assert x.tolist() == list(range(1, 9)) and frozen.tolist() == list(range(8))
        t.free()
    finally:
        b.close()
