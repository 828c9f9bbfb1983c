"""Views and the bytes under them: the writes-under-view guard, messages naming who holds a view, and
untyped ("bytes") allocations that views of several dtypes share.

Runs on fake (auto-completing), host and OpenCL where it is available (CUDA with
DEVBRIDGE_TEST_BACKEND=cuda).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import devbridge
from conftest import collect, make_bridge, random_array, require_backend

F32 = devbridge.ObjectSpec(1 << 20, 64, "float32")
BYTES = devbridge.ObjectSpec(1 << 20, 256, "bytes")


def _bridge(name, **options):
    require_backend(name)
    b = make_bridge(name, ring_bytes=1 << 20, **options)
    if name == "fake":
        b.fake.set_auto_complete(True)
    return b


BACKENDS = ["fake", "host", "opencl", "cuda"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _stage(b, h, data: np.ndarray, offset: int = 0, mode: str = "async"):
    """Uploads `data` into `h` at `offset` through a ring range; returns once it completed."""
    r = b.ring.reserve(data.nbytes)
    try:
        b.ring.ndarray(r, "uint8")[:] = np.frombuffer(data.tobytes(), np.uint8)
        b.wait(b.host_to_device(r, h, offset=offset, mode=mode))
    finally:
        b.ring.release(r)


def _read(b, h, nbytes: int, offset: int = 0) -> bytes:
    r = b.ring.reserve(nbytes)
    try:
        b.wait(b.device_to_host(h, r, offset=offset))
        return b.ring.ndarray(r, "uint8").tobytes()
    finally:
        b.ring.release(r)


def _quiet(b):
    s = b.stats()
    assert (s["live_views"], s["copies_in_flight"], s["ring_reservations"]) == (0, 0, 0), s


# --------------------------------------------------------------------------------------- the guard


def test_an_upload_under_a_live_view_is_refused_by_default_and_changes_nothing(backend, rng):
    b = _bridge(backend)
    first, second = random_array(rng, 256, "float32"), random_array(rng, 256, "float32")
    h = b.alloc(F32, first.nbytes)
    _stage(b, h, first)
    view = b.view(h, "float32", 256)
    with pytest.raises(devbridge.AllocationStillInUse) as caught:
        _stage(b, h, second, mode="sync")
    message = str(caught.value)
    assert "would change bytes a view still reads" in message and "1 live view held by the caller" in message
    assert '"refuse"' in message and f"id {h.id:#x}" in message
    assert _read(b, h, first.nbytes) == first.tobytes()  # nothing written
    # Reads from under a view are fine; so is a write once the view has ended.
    view.close()
    _stage(b, h, second)
    assert _read(b, h, second.nbytes) == second.tobytes()
    _quiet(b)
    b.close()


def test_the_refusal_names_tinygrad_tensors_and_dlpack_consumers(backend, rng):
    pytest.importorskip("tinygrad")
    if backend == "opencl":
        pytest.skip("tinygrad takes external memory only on CPU and CUDA")
    b = _bridge(backend)
    x = random_array(rng, 256, "float32")
    h = b.alloc(F32, x.nbytes)
    _stage(b, h, x)
    with b.view(h, "float32", 256) as view:
        tensor = view.to_tinygrad()
    with pytest.raises(devbridge.AllocationStillInUse, match=r"1 live view held by a tinygrad tensor \(a lazy graph"):
        _stage(b, h, x)
    with pytest.raises(devbridge.AllocationStillInUse, match=r"opt\.zero_grad\(\) or del releases it"):
        b.free(h)
    if backend in ("fake", "host"):  # numpy imports only host memory
        with b.view(h, "float32", 256) as view:
            array = np.from_dlpack(view)
        with pytest.raises(devbridge.AllocationStillInUse) as caught:
            _stage(b, h, x)
        message = str(caught.value)
        assert "2 live views: 1 held by a tinygrad tensor" in message
        assert "1 held by a DLPack consumer (a numpy, jax, torch or cupy array; del releases it)" in message
        del array
    del tensor
    collect()
    _stage(b, h, x)  # every holder let go
    b.free(h)
    _quiet(b)
    b.close()


def test_allow_writes_under_a_view_and_the_view_sees_the_new_bytes(backend, rng):
    b = _bridge(backend, writes_under_view="allow")
    first, second = random_array(rng, 256, "float32"), random_array(rng, 256, "float32")
    h = b.alloc(F32, first.nbytes)
    _stage(b, h, first)
    with b.view(h, "float32", 256) as view:
        _stage(b, h, second)
        if backend in ("fake", "host"):
            np.testing.assert_array_equal(np.from_dlpack(view), second)
    assert _read(b, h, second.nbytes) == second.tobytes()
    _quiet(b)
    b.close()


def test_wait_gives_up_after_its_timeout_naming_the_views(backend, rng):
    b = _bridge(backend, writes_under_view="wait", writes_under_view_timeout=0.05)
    x = random_array(rng, 256, "float32")
    h = b.alloc(F32, x.nbytes)
    view = b.view(h, "float32", 256)
    started = time.monotonic()
    with pytest.raises(devbridge.AllocationStillInUse, match=r'"wait", and the wait timed out\): 1 live view'):
        _stage(b, h, x)
    assert time.monotonic() - started >= 0.04
    view.close()
    _quiet(b)
    b.close()


def test_wait_copies_once_the_last_view_ends(backend, rng):
    b = _bridge(backend, writes_under_view="wait")
    first, second = random_array(rng, 256, "float32"), random_array(rng, 256, "float32")
    h = b.alloc(F32, first.nbytes)
    _stage(b, h, first)
    view = b.view(h, "float32", 256)
    seen_before_end = []

    def end_view_later():
        time.sleep(0.1)
        seen_before_end.append(_read(b, h, first.nbytes))  # the waiting upload has not written yet
        view.close()

    closer = threading.Thread(target=end_view_later)
    closer.start()
    _stage(b, h, second)  # blocks until the view ends
    closer.join()
    assert seen_before_end == [first.tobytes()]
    assert _read(b, h, second.nbytes) == second.tobytes()
    _quiet(b)
    b.close()


def test_close_wakes_an_upload_waiting_for_views(rng):
    b = _bridge("fake", writes_under_view="wait")
    h = b.alloc(F32, 1024)
    view = b.view(h, "float32", 256)
    r = b.ring.reserve(1024)
    errors = []

    def upload():
        try:
            b.host_to_device(r, h)
        except devbridge.BridgeError as error:
            errors.append(error)

    worker = threading.Thread(target=upload, daemon=True)
    worker.start()
    time.sleep(0.1)
    assert worker.is_alive()
    b.close()
    worker.join(5)
    assert not worker.is_alive() and len(errors) == 1 and isinstance(errors[0], devbridge.Closed), errors
    view.close()


@pytest.mark.parametrize(
    "options, error",
    [
        ({"writes_under_view": "never"}, ValueError),
        ({"writes_under_view": "Refuse"}, ValueError),
        ({"writes_under_view": 1}, TypeError),
        ({"writes_under_view": None}, TypeError),
        ({"writes_under_view_timeout": -1}, ValueError),
        ({"writes_under_view_timeout": float("nan")}, ValueError),
        ({"writes_under_view_timeout": "1s"}, TypeError),
    ],
)
def test_bad_policies_are_refused_with_the_right_exception(options, error):
    with pytest.raises(error):
        devbridge.Bridge(backend="fake", **options)


def test_a_huge_wait_timeout_means_no_limit():
    for timeout in (float("inf"), 10**30, 1e300):
        devbridge.Bridge(backend="fake", writes_under_view="wait", writes_under_view_timeout=timeout).close()


# -------------------------------------------------------------------------------- untyped allocations


def test_untyped_spec_reads_back_as_bytes():
    for dtype in ("bytes", None):
        spec = devbridge.ObjectSpec(4096, 256, dtype)
        assert spec.dtype == "bytes" and 'dtype="bytes"' in repr(spec)
    with devbridge.Bridge(backend="fake") as b:
        h = b.alloc(devbridge.ObjectSpec(4096, 256, None), 768)
        assert b.spec(h).dtype == "bytes"


def test_one_untyped_allocation_holds_images_and_labels(backend, rng):
    b = _bridge(backend)
    images = random_array(rng, (8, 28, 28), "float32")
    labels = rng.integers(0, 10, size=8).astype(np.int64)
    labels_at = 8 * 28 * 28 * 4  # 25088: a multiple of 8
    h = b.alloc(BYTES, 25600)
    _stage(b, h, images)
    _stage(b, h, labels, offset=labels_at)
    with b.view(h, "float32", images.shape) as v_images, b.view(h, "int64", 8, offset=labels_at) as v_labels:
        assert v_images.dtype == "float32" and v_labels.dtype == "int64"
        if backend in ("fake", "host"):
            np.testing.assert_array_equal(np.from_dlpack(v_images), images)
            np.testing.assert_array_equal(np.from_dlpack(v_labels), labels)
    assert _read(b, h, 64, offset=labels_at) == labels.tobytes()
    b.free(h)
    _quiet(b)
    b.close()


def test_untyped_views_must_be_aligned_to_their_dtype_and_fit(backend):
    b = _bridge(backend)
    h = b.alloc(BYTES, 4096)
    with pytest.raises(devbridge.InvalidTensorView, match="byte offset 4 is not a multiple of 8"):
        b.view(h, "int64", 1, offset=4)
    with pytest.raises(devbridge.InvalidTensorView, match="outside the extent"):
        b.view(h, "float64", 512, offset=8)
    with pytest.raises(ValueError, match="unknown dtype"):
        b.view(h, "bytes", 16)
    with b.view(h, "uint8", 4096), b.view(h, "bfloat16", 2048), b.view(h, "float32", (2, 4), offset=4064):
        assert b.stats()["live_views"] == 3
    b.free(h)
    _quiet(b)
    b.close()


def test_untyped_copies_take_any_byte_range(backend, rng):
    b = _bridge(backend)
    h = b.alloc(BYTES, 4096)
    data = rng.integers(0, 256, size=7).astype(np.uint8)
    _stage(b, h, data, offset=3)
    assert _read(b, h, 7, offset=3) == data.tobytes()
    b.free(h)
    _quiet(b)
    b.close()


def test_axpy_reads_an_untyped_allocation_as_float32(rng):
    with devbridge.Bridge(backend="host") as b:
        x = random_array(rng, 64, "float32")
        xh, yh = b.alloc(BYTES, 256), b.alloc(F32, 256)
        _stage(b, xh, x)
        b.axpy(xh, yh, 2.0, 1.0)
        y = np.frombuffer(_read(b, yh, 256), np.float32)
        np.testing.assert_allclose(y, 2 * x + 1, rtol=1e-6)
        with pytest.raises(devbridge.InvalidRange, match="not aligned to float32"):
            b.axpy(xh, yh, 1.0, 0.0, x_offset=2, y_offset=0, nbytes=8)
