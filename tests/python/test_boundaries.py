"""Boundary tables: every public entry of the Python API, at its edges, with the exact exception expected.

Each table row is (value, expected): ``OK`` when the call must succeed, else the exact exception class (a
subclass does not pass). The values are the same for every entry: 0, 1, max - 1, max, 2**63, 2**64 - 1,
2**64, -1, NaN and infinities where a float is taken, and a wrong type (a str, None where None is not
allowed, a float where an int is). After every row, refused or not, the bridge must still move bytes (a
small upload/download round trip) and must not be Broken.

Python's own vocabulary for a bad argument (docs/PYTHON.md, "Arguments"):
- TypeError: the wrong type;
- OverflowError: an int outside what the parameter holds (-1 or 2**64 for a byte count, 2**63 for a
  dimension, 2**32 for a DLPack version field);
- ValueError: a value of the right type the parameter refuses (a negative or NaN timeout);
- BufferError: inside the DLPack protocol, what cannot be exported as asked;
- devbridge's own error kinds for the contract's rules (InvalidRange, InvalidTensorView, ...).

Run on the fake and host backends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

import devbridge
from conftest import download, upload

OK = "ok"
U64_MAX = 2**64 - 1
I64_MAX = 2**63 - 1
U32_MAX = 2**32 - 1
I32_MAX = 2**31 - 1
RING = 1 << 20
BACKENDS = ("fake", "host")

U8 = devbridge.ObjectSpec(max_extent=1 << 20, alignment=64, dtype="uint8")
F32 = devbridge.ObjectSpec(max_extent=1 << 20, alignment=64, dtype="float32")

# A wrong type, for an int parameter that does not take None.
# A bool is an int to Python, but never a size: True as a length or offset is a slip.
NOT_INTS = [("1", TypeError), (1.0, TypeError), (None, TypeError), (b"1", TypeError), ([1], TypeError),
            (True, TypeError), (False, TypeError)]
# Outside an unsigned 64-bit parameter.
BEYOND_U64 = [(2**64, OverflowError), (2**70, OverflowError), (-1, OverflowError), (-(2**64), OverflowError)]
# Outside a signed 64-bit parameter (a dimension or a stride, in elements).
BEYOND_I64 = [(2**63, OverflowError), (U64_MAX, OverflowError), (2**64, OverflowError), (-(2**63) - 1, OverflowError)]
# A duration in seconds: what every timeout refuses.
BAD_SECONDS = [
    (math.nan, ValueError), (-1, ValueError), (-0.5, ValueError), (-math.inf, ValueError), (-(10**400), ValueError),
    ("1", TypeError), ([], TypeError), (1j, TypeError), (b"1", TypeError),
]
# Durations that must be accepted: zero, small, huge, infinite (huge and infinite mean "until done").
GOOD_SECONDS = [0, 0.0, 1, 1e-9, 1e10, math.inf, 2**63, 2**64, 10**400, np.float32(1.0), np.int64(2**62)]


@dataclass
class Entry:
    name: str
    call: Callable[[devbridge.Bridge, Any], Any]  # raises, or returns after cleaning up what it made
    rows: list  # (value, expected)
    backends: tuple = BACKENDS


def make_bridge(backend: str, **options) -> devbridge.Bridge:
    options.setdefault("ring_bytes", RING)
    b = devbridge.Bridge(backend=backend, **options)
    if backend == "fake":
        b.fake.set_auto_complete(True)
    return b


def assert_works(b: devbridge.Bridge, mode: str = "async") -> None:
    """The bridge still moves exact bytes, and nothing is left over from the row."""
    stats = b.stats()
    assert not stats["broken"]
    assert stats["live_views"] == 0 and stats["ring_used"] == 0, stats
    n = min(256, b.ring.capacity)
    h = b.alloc(devbridge.ObjectSpec(4096, 1, "uint8"), 4096)
    data = np.random.default_rng().integers(0, 256, n, dtype=np.uint8)
    upload(b, h, data, mode=mode)
    assert np.array_equal(download(b, h, n, mode=mode), data)
    b.free(h)


def check(call: Callable[[], Any], expected) -> Any:
    if expected == OK:
        return call()
    with pytest.raises(Exception) as caught:
        call()
    assert type(caught.value) is expected, f"expected {expected.__name__}, got {caught.type.__name__}: {caught.value}"
    assert type(caught.value) is not RuntimeError
    return None


# ---- the entries --------------------------------------------------------------------------------------

def ring_bytes(b, value):
    # The constructor's own table: the bridge under test is the one it builds (closed afterwards).
    made = make_bridge(b.backend, ring_bytes=value)
    assert made.ring.capacity >= value
    assert_works(made, mode="sync")
    made.close()


def generation(b, value):
    made = make_bridge(b.backend, generation=value)
    assert made.generation == value
    assert_works(made)
    made.close()


def inflight_bytes(b, value):
    made = make_bridge(b.backend, inflight_bytes=value)
    assert made.stats()["inflight_budget_bytes"] == (value or RING)
    assert_works(made, mode="sync")
    made.close()


def alloc_extent(b, value):
    b.free(b.alloc(devbridge.ObjectSpec(U64_MAX, 64, "uint8"), value))


def alloc_alignment(b, value):
    b.free(b.alloc(devbridge.ObjectSpec(1 << 20, value, "uint8"), 4096))


def alloc_huge_alignment(b, value):
    # extent == alignment == value: only the backend can refuse it.
    b.free(b.alloc(devbridge.ObjectSpec(U64_MAX, value, "uint8"), value))


def alloc_max_extent(b, value):
    b.free(b.alloc(devbridge.ObjectSpec(value, 64, "uint8"), 4096))


def reserve_nbytes(b, value):
    b.ring.release(b.ring.reserve(value))


def reserve_alignment(b, value):
    b.ring.release(b.ring.reserve(64, value))


def _copy(b, direction, value):
    h = b.alloc(F32, 4096)
    r = b.ring.reserve(64)
    try:
        if direction == "h2d":
            e = b.host_to_device(r, h, value)
        else:
            e = b.device_to_host(h, r, value)
        assert b.wait(e) == "completed"
    finally:
        b.ring.release(r)
        b.free(h)


def h2d_offset(b, value):
    _copy(b, "h2d", value)


def d2h_offset(b, value):
    _copy(b, "d2h", value)


def host_range_offset(b, value):
    h = b.alloc(U8, 4096)
    r = b.ring.reserve(64)
    try:
        assert r.offset == 0  # a fresh ring
        b.wait(b.host_to_device(devbridge.HostRange(value, 64), h))
    finally:
        b.ring.release(r)
        b.free(h)


def host_range_len(b, value):
    h = b.alloc(U8, 4096)
    r = b.ring.reserve(64)
    try:
        b.wait(b.device_to_host(h, devbridge.HostRange(r.offset, value)))
    finally:
        b.ring.release(r)
        b.free(h)


def _view(b, shape, strides=None, offset=0):
    h = b.alloc(F32, 4096)  # 1024 float32
    try:
        b.view(h, "float32", shape, strides, offset).close()
    finally:
        b.free(h)


def view_shape(b, value):
    _view(b, (value,))


def view_shape_scalar(b, value):
    _view(b, value)  # an int for a 1-d shape


def view_shape_2d(b, value):
    _view(b, (2, value))


def view_strides(b, value):
    _view(b, (4,), (value,))


def view_strides_2d(b, value):
    _view(b, (2, 2), (value, 1), offset=2048)


def view_byte_offset(b, value):
    _view(b, (4,), None, value)


def wait_timeout(b, value):
    h = b.alloc(U8, 4096)
    r = b.ring.reserve(64)
    e = b.host_to_device(r, h)
    try:
        assert b.wait(e, timeout=value) == "completed"
    finally:
        b.wait(e)
        b.ring.release(r)
        b.free(h)


def wait_timeout_pending(b, value):
    # A copy that stays pending: a finite timeout returns "pending" after it.
    b.fake.set_auto_complete(False)
    h = b.alloc(U8, 4096)
    r = b.ring.reserve(64)
    e = b.host_to_device(r, h)
    try:
        assert b.wait(e, timeout=value) == "pending"
    finally:
        b.fake.complete_all()
        b.fake.set_auto_complete(True)
        assert b.wait(e) == "completed"
        b.ring.release(r)
        b.free(h)


def wait_for_room(b, value):
    h = b.alloc(U8, 4096)
    r = b.ring.reserve(64)
    try:
        assert b.wait(b.host_to_device(r, h, wait_for_room=value)) == "completed"
        assert b.wait(b.device_to_host(h, r, wait_for_room=value)) == "completed"
    finally:
        b.ring.release(r)
        b.free(h)


def restart_generation(b, value):
    b.restart(value)
    assert b.generation == value


def step_id(b, value):
    h = b.alloc(U8, 4096)
    b.begin_step(value, [h])
    b.end_step(value)
    b.free(h)


def end_step_id(b, value):
    b.end_step(value)  # never begun


def forged_handle_id(b, value):
    b.free(devbridge.DeviceHandle(b.domain, b.generation, value))


def forged_handle_generation(b, value):
    b.free(devbridge.DeviceHandle(b.domain, value, 0))


def forged_handle_domain(b, value):
    b.free(devbridge.DeviceHandle(value, b.generation, 0))


def forged_event_id(b, value):
    b.copy_status(devbridge.CopyEvent(b.domain, b.generation, value))


def axpy_x_offset(b, value):
    x, y = b.alloc(F32, 4096), b.alloc(F32, 4096)
    try:
        b.axpy(x, y, 2.0, 1.0, x_offset=value, nbytes=64)
    finally:
        b.free(x)
        b.free(y)


def axpy_nbytes(b, value):
    x, y = b.alloc(F32, 4096), b.alloc(F32, 4096)
    try:
        b.axpy(x, y, 2.0, 1.0, nbytes=value)
    finally:
        b.free(x)
        b.free(y)


def _dlpack(b, **kwargs):
    h = b.alloc(F32, 4096)
    try:
        with b.view(h, "float32", 1024) as view:
            capsule = view.__dlpack__(**kwargs)
            del capsule
    finally:
        b.free(h)


def dlpack_stream(b, value):
    _dlpack(b, stream=value)


def dlpack_max_version(b, value):
    _dlpack(b, max_version=value)


def dlpack_max_version_major(b, value):
    _dlpack(b, max_version=(value, 0))


def dlpack_max_version_minor(b, value):
    _dlpack(b, max_version=(1, value))


def dlpack_dl_device(b, value):
    _dlpack(b, dl_device=value)


def dlpack_dl_device_id(b, value):
    _dlpack(b, dl_device=(1, value))


def dlpack_copy(b, value):
    _dlpack(b, copy=value)


def fake_inject_nth(b, value):
    b.fake.inject("validate_view", "invalid_view", value)  # no round trip takes a view


ENTRIES = [
    Entry("Bridge(ring_bytes)", ring_bytes, [
        (0, devbridge.InvalidExtent), (1, OK), (4096, OK), (U64_MAX - 1, devbridge.AllocationFailed),
        (U64_MAX, devbridge.AllocationFailed), (2**64 - 4095, devbridge.AllocationFailed),
        (2**63, devbridge.AllocationFailed), *BEYOND_U64, *NOT_INTS]),
    Entry("Bridge(generation)", generation, [
        (0, OK), (1, OK), (U64_MAX - 1, OK), (U64_MAX, OK), (2**63, OK), *BEYOND_U64, *NOT_INTS]),
    Entry("Bridge(inflight_bytes)", inflight_bytes, [
        (None, OK), (0, OK), (1, OK), (U64_MAX - 1, OK), (U64_MAX, OK), (2**63, OK), *BEYOND_U64,
        *[row for row in NOT_INTS if row[0] is not None]]),
    Entry("alloc(extent)", alloc_extent, [
        (0, devbridge.InvalidExtent), (1, devbridge.InvalidExtent), (64, OK),
        (U64_MAX - 1, devbridge.InvalidExtent), (U64_MAX, devbridge.InvalidExtent),
        (2**64 - 64, devbridge.AllocationFailed), (2**63, devbridge.AllocationFailed), *BEYOND_U64, *NOT_INTS]),
    Entry("ObjectSpec(alignment)", alloc_alignment, [
        (0, devbridge.InvalidAlignment), (1, OK), (3, devbridge.InvalidAlignment), (4096, OK),
        (8192, devbridge.InvalidExtent), (U64_MAX - 1, devbridge.InvalidAlignment),
        (U64_MAX, devbridge.InvalidAlignment), (2**63, devbridge.InvalidExtent), *BEYOND_U64, *NOT_INTS]),
    Entry("ObjectSpec(alignment) == extent", alloc_huge_alignment, [
        (1, OK), (4096, OK), (2**62, devbridge.AllocationFailed), (2**63, devbridge.AllocationFailed)]),
    Entry("ObjectSpec(max_extent)", alloc_max_extent, [
        (0, devbridge.InvalidExtent), (1, devbridge.InvalidExtent), (4095, devbridge.InvalidExtent), (4096, OK),
        (U64_MAX - 1, OK), (U64_MAX, OK), (2**63, OK), *BEYOND_U64, *NOT_INTS]),
    Entry("ring.reserve(nbytes)", reserve_nbytes, [
        (0, devbridge.InvalidRange), (1, OK), (RING, OK), (RING + 1, devbridge.InvalidRange),
        (U64_MAX - 1, devbridge.InvalidRange), (U64_MAX, devbridge.InvalidRange), (2**63, devbridge.InvalidRange),
        *BEYOND_U64, *NOT_INTS]),
    Entry("ring.reserve(alignment)", reserve_alignment, [
        (0, devbridge.InvalidAlignment), (1, OK), (3, devbridge.InvalidAlignment), (4096, OK),
        (8192, devbridge.InvalidAlignment), (U64_MAX - 1, devbridge.InvalidAlignment),
        (U64_MAX, devbridge.InvalidAlignment), (2**63, devbridge.InvalidAlignment), *BEYOND_U64, *NOT_INTS]),
    *[Entry(name, fn, [
        (0, OK), (1, devbridge.InvalidRange), (4, OK), (4096 - 64, OK), (4096 - 60, devbridge.InvalidRange),
        (4096, devbridge.InvalidRange), (U64_MAX - 1, devbridge.InvalidRange), (U64_MAX, devbridge.InvalidRange),
        (2**63, devbridge.InvalidRange), (2**64 - 64, devbridge.InvalidRange), *BEYOND_U64, *NOT_INTS])
      for name, fn in (("host_to_device(offset)", h2d_offset), ("device_to_host(offset)", d2h_offset))],
    Entry("HostRange(offset)", host_range_offset, [
        (0, OK), (1, devbridge.InvalidRange), (RING - 64, devbridge.InvalidRange), (RING, devbridge.InvalidRange),
        (U64_MAX - 1, devbridge.InvalidRange), (U64_MAX, devbridge.InvalidRange), (2**63, devbridge.InvalidRange),
        *BEYOND_U64, *NOT_INTS]),
    Entry("HostRange(len)", host_range_len, [
        (0, devbridge.InvalidRange), (1, OK), (64, OK), (65, devbridge.InvalidRange),
        (U64_MAX - 1, devbridge.InvalidRange), (U64_MAX, devbridge.InvalidRange), (2**63, devbridge.InvalidRange),
        *BEYOND_U64, *NOT_INTS]),
    Entry("view(shape)", view_shape, [
        (0, devbridge.InvalidTensorView), (1, OK), (1024, OK), (1025, devbridge.InvalidTensorView),
        (I64_MAX - 1, devbridge.InvalidTensorView), (I64_MAX, devbridge.InvalidTensorView),
        (-1, devbridge.InvalidTensorView), (-(2**63), devbridge.InvalidTensorView), *BEYOND_I64, *NOT_INTS]),
    Entry("view(shape as an int)", view_shape_scalar, [
        (0, devbridge.InvalidTensorView), (1024, OK), (I64_MAX, devbridge.InvalidTensorView),
        (-1, devbridge.InvalidTensorView), *BEYOND_I64, ("1", TypeError), (1.0, TypeError), (None, TypeError),
        ((1.0,), TypeError), (("1",), TypeError), ((None,), TypeError), ((1,) * 9, devbridge.InvalidTensorView),
        ((2**32, 2**32), devbridge.InvalidTensorView), ((I64_MAX, 2), devbridge.InvalidTensorView)]),
    Entry("view(shape[1])", view_shape_2d, [
        (0, devbridge.InvalidTensorView), (1, OK), (512, OK), (513, devbridge.InvalidTensorView),
        (I64_MAX, devbridge.InvalidTensorView), (-1, devbridge.InvalidTensorView), *BEYOND_I64, *NOT_INTS]),
    Entry("view(strides)", view_strides, [
        (0, OK), (1, OK), (341, OK), (342, devbridge.InvalidTensorView), (I64_MAX - 1, devbridge.InvalidTensorView),
        (I64_MAX, devbridge.InvalidTensorView), (-1, devbridge.InvalidTensorView),
        (-(2**63), devbridge.InvalidTensorView), *BEYOND_I64, *NOT_INTS]),
    Entry("view(strides[0]) from the middle", view_strides_2d, [
        (0, OK), (-1, OK), (-512, OK), (-513, devbridge.InvalidTensorView), (I64_MAX, devbridge.InvalidTensorView),
        (-(2**63), devbridge.InvalidTensorView), *BEYOND_I64, *NOT_INTS]),
    Entry("view(offset)", view_byte_offset, [
        (0, OK), (1, devbridge.InvalidTensorView), (4, OK), (4080, OK), (4084, devbridge.InvalidTensorView),
        (U64_MAX - 1, devbridge.InvalidTensorView), (U64_MAX, devbridge.InvalidTensorView),
        (2**63, devbridge.InvalidTensorView), (2**64 - 4, devbridge.InvalidTensorView), *BEYOND_U64, *NOT_INTS]),
    Entry("wait(timeout)", wait_timeout, [*[(v, OK) for v in GOOD_SECONDS], (None, OK), *BAD_SECONDS]),
    Entry("wait(timeout) on a pending copy", wait_timeout_pending, [(0, OK), (1e-3, OK), *BAD_SECONDS],
          backends=("fake",)),
    Entry("wait_for_room", wait_for_room, [*[(v, OK) for v in GOOD_SECONDS], *BAD_SECONDS, (None, TypeError)]),
    Entry("restart(generation)", restart_generation, [
        (0, devbridge.OldGenerationHandle), (1, devbridge.OldGenerationHandle), (2, OK), (U64_MAX - 1, OK),
        (U64_MAX, OK), (2**63, OK), *BEYOND_U64, *NOT_INTS]),
    Entry("begin_step(step_id)", step_id, [(0, OK), (1, OK), (U64_MAX - 1, OK), (U64_MAX, OK), (2**63, OK),
                                           *BEYOND_U64, *NOT_INTS]),
    Entry("end_step(step_id)", end_step_id, [(0, devbridge.UnknownDeviceHandle), (U64_MAX, devbridge.UnknownDeviceHandle),
                                             *BEYOND_U64, *NOT_INTS]),
    Entry("DeviceHandle(id)", forged_handle_id, [
        *[(v, devbridge.UnknownDeviceHandle) for v in (0, 1, U64_MAX - 1, U64_MAX, 2**63, 2**32, 2**32 + 1)],
        *BEYOND_U64, *NOT_INTS]),
    Entry("DeviceHandle(generation)", forged_handle_generation, [
        (0, devbridge.OldGenerationHandle), (1, devbridge.UnknownDeviceHandle), (2, devbridge.UnknownDeviceHandle),
        (U64_MAX, devbridge.UnknownDeviceHandle), *BEYOND_U64, *NOT_INTS]),
    Entry("DeviceHandle(domain)", forged_handle_domain, [
        (0, devbridge.ForeignDomain), (U64_MAX, devbridge.ForeignDomain), (2**63, devbridge.ForeignDomain),
        *BEYOND_U64, *NOT_INTS]),
    Entry("CopyEvent(id)", forged_event_id, [
        *[(v, devbridge.UnknownDeviceHandle) for v in (0, 1, U64_MAX - 1, U64_MAX, 2**63, 2**32)],
        *BEYOND_U64, *NOT_INTS]),
    Entry("axpy(x_offset)", axpy_x_offset, [
        (0, OK), (4, OK), (1, devbridge.InvalidRange), (4096 - 64, OK), (4096, devbridge.InvalidRange),
        (U64_MAX - 3, devbridge.InvalidRange), (U64_MAX, devbridge.InvalidRange), (2**63, devbridge.InvalidRange),
        *BEYOND_U64, *NOT_INTS]),
    Entry("axpy(nbytes)", axpy_nbytes, [
        (None, OK), (0, devbridge.InvalidRange), (4, OK), (4096, OK), (4100, devbridge.InvalidRange),
        (U64_MAX - 3, devbridge.InvalidRange), (U64_MAX, devbridge.InvalidRange), (2**63, devbridge.InvalidRange),
        *BEYOND_U64, *[row for row in NOT_INTS if row[0] is not None]]),
    # ---- DLPack (host memory: the fake and host backends' views are CPU views) ----
    Entry("__dlpack__(stream)", dlpack_stream, [
        (None, OK), (-1, OK), (0, BufferError), (1, BufferError), (2, BufferError), (U64_MAX - 1, BufferError),
        (U64_MAX, BufferError), (2**63, BufferError), (2**64, OverflowError), (2**70, OverflowError),
        (-2, OverflowError), ("1", TypeError), (1.0, TypeError), (b"1", TypeError)]),
    Entry("__dlpack__(max_version)", dlpack_max_version, [
        (None, OK), ((0, 8), OK), ((1, 0), OK), ((1, 3), OK), ([1, 0], OK), ((U32_MAX, U32_MAX), OK),
        ("ab", TypeError), ((1,), TypeError), ((1, 0, 0), TypeError), (1, TypeError), ({1: 0}, TypeError)]),
    *[Entry(name, fn, [
        (0, OK), (1, OK), (U32_MAX - 1, OK), (U32_MAX, OK), (2**32, OverflowError), (2**63, OverflowError),
        (2**64, OverflowError), (2**70, OverflowError), (-1, OverflowError), ("1", TypeError), (1.0, TypeError),
        (None, TypeError)])
      for name, fn in (("__dlpack__(max_version[0])", dlpack_max_version_major),
                       ("__dlpack__(max_version[1])", dlpack_max_version_minor))],
    Entry("__dlpack__(dl_device)", dlpack_dl_device, [
        (None, OK), ((1, 0), OK), ([1, 0], OK), ((2, 0), BufferError), ((0, 0), BufferError),
        ((I32_MAX, 0), BufferError), ((-1, 0), BufferError), ((2**31, 0), OverflowError),
        ((2**70, 0), OverflowError), ("ab", TypeError), ((1,), TypeError), (1, TypeError), (("1", 0), TypeError),
        ((1.0, 0), TypeError)]),
    Entry("__dlpack__(dl_device[1])", dlpack_dl_device_id, [
        (0, OK), (1, BufferError), (I32_MAX, BufferError), (-1, BufferError), (-(2**31), BufferError),
        (2**31, OverflowError), (2**63, OverflowError), (2**64, OverflowError), (-(2**31) - 1, OverflowError),
        ("0", TypeError), (0.0, TypeError), (None, TypeError)]),
    Entry("__dlpack__(copy)", dlpack_copy, [
        (None, OK), (False, OK), (True, OK), ("ab", TypeError), (0, TypeError), (1, TypeError),  # host memory: copied
        (1.0, TypeError)]),
    Entry("fake.inject(nth)", fake_inject_nth, [
        (0, ValueError), (1, OK), (I32_MAX, OK), (-1, ValueError), (2**31, OverflowError), (2**63, OverflowError),
        (2**64, OverflowError), *NOT_INTS], backends=("fake",)),
]


def _cases():
    for entry in ENTRIES:
        for backend in entry.backends:
            for value, expected in entry.rows:
                outcome = expected if expected == OK else expected.__name__
                yield pytest.param(backend, entry, value, expected, id=f"{backend}-{entry.name}={value!r:.40}-{outcome}")


@pytest.mark.parametrize("backend,entry,value,expected", list(_cases()))
def test_boundary(backend, entry, value, expected):
    b = make_bridge(backend)
    try:
        check(lambda: entry.call(b, value), expected)
        assert_works(b)
    finally:
        b.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_refusal_is_a_generic_runtime_error(backend):
    """The issue's list (defect 8), which raised RuntimeError("std::bad_cast") before."""
    b = make_bridge(backend)
    h = b.alloc(F32, 4096)
    cases = [
        (lambda: b.view(h, "float32", (2**63,)), OverflowError),
        (lambda: b.view(h, "float32", (4,), strides=(2**63,)), OverflowError),
    ]
    view = b.view(h, "float32", 1024)
    cases += [
        (lambda: view.__dlpack__(max_version="ab"), TypeError),
        (lambda: view.__dlpack__(max_version=(2**70, 0)), OverflowError),
        (lambda: view.__dlpack__(stream=2**70), OverflowError),
        (lambda: view.__dlpack__(dl_device="ab"), TypeError),
        (lambda: view.__dlpack__(copy="ab"), TypeError),
    ]
    for call, expected in cases:
        check(call, expected)
    view.close()
    b.free(h)
    assert_works(b)
    b.close()
