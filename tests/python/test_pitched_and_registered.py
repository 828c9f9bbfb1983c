"""Pitched 2-D copies (CopyLayout) and registered host memory (Bridge.register_host) from Python.

Runs on fake (auto-completing unless a test drives completions), host, OpenCL where it is available,
and CUDA with DEVBRIDGE_TEST_BACKEND=cuda; where the emulated libcuda is built (build/<preset>/tests/cuda),
one test reruns the CUDA cases of this file against it in a child process. Padding is filled with random
bytes before every pitched copy and checked after it: a copy that wrote between its rows, or moved
nothing, cannot pass.

Registered buffers are page-aligned and a whole number of pages where a test registers more than one
at once: CUDA pins whole pages, and two registrations may not share one.
"""

from __future__ import annotations

import gc
import mmap
import os
import pathlib
import pickle
import subprocess
import sys
import weakref

import numpy as np
import pytest

import devbridge
from conftest import REQUESTED_BACKEND, collect, download, require_backend, upload

RING = 1 << 20
PAGE = mmap.PAGESIZE
BACKENDS = ("fake", "host", "opencl", "cuda")
HERE = pathlib.Path(__file__).resolve().parent
EMULATED_CHILD = "DEVBRIDGE_PITCHED_EMULATED_CHILD"


def open_bridge(name: str, **options) -> devbridge.Bridge:
    require_backend(name)
    # CUDA on the device's primary context: nothing here hands memory to tinygrad.
    b = devbridge.Bridge(backend=name, ring_bytes=RING, **options)
    if name == "fake":
        b.fake.set_auto_complete(True)
    return b


@pytest.fixture(params=BACKENDS)
def pb(request):
    b = open_bridge(request.param)
    yield b
    collect()
    b.close()


@pytest.fixture
def held_fake():
    """A fake bridge whose copies stay in flight until the test completes them."""
    b = devbridge.Bridge(backend="fake", ring_bytes=RING)
    yield b
    collect()
    b.close()


def page_array(shape, dtype="float32") -> np.ndarray:
    """A C-contiguous array alone on its pages."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    span = -(-nbytes // PAGE) * PAGE
    raw = np.empty(span + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start : start + span].view(dtype)[: nbytes // dtype.itemsize].reshape(shape)


def random_bytes(rng, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=n, dtype=np.uint8)


def byte_alloc(b: devbridge.Bridge, nbytes: int):
    extent = -(-nbytes // 64) * 64
    return b.alloc(devbridge.ObjectSpec(extent, 64, "uint8"), extent), extent


def float_alloc(b: devbridge.Bridge, nbytes: int):
    extent = -(-nbytes // 256) * 256
    return b.alloc(devbridge.ObjectSpec(extent, 256, "float32"), extent), extent


def apply_rows(dst: np.ndarray, dst_start: int, dst_pitch: int, src: np.ndarray, src_start: int, src_pitch: int,
               layout: devbridge.CopyLayout) -> np.ndarray:
    """What a pitched copy of `layout` from src to dst leaves in dst (byte arrays)."""
    out = dst.copy()
    for i in range(layout.rows):
        d, s = dst_start + i * dst_pitch, src_start + i * src_pitch
        out[d : d + layout.row_bytes] = src[s : s + layout.row_bytes]
    return out


# ---- CopyLayout, pitched_layout ----


def test_copy_layout_is_a_value_type():
    layout = devbridge.CopyLayout(7, 20, 48, 32)
    assert (layout.rows, layout.row_bytes, layout.host_pitch, layout.device_pitch) == (7, 20, 48, 32)
    assert repr(layout) == "CopyLayout(rows=7, row_bytes=20, host_pitch=48, device_pitch=32)"
    assert layout == devbridge.CopyLayout(rows=7, row_bytes=20, host_pitch=48, device_pitch=32)
    assert layout != devbridge.CopyLayout(7, 20, 48, 20) and layout != (7, 20, 48, 32) and layout != None  # noqa: E711
    assert len({layout, devbridge.CopyLayout(7, 20, 48, 32), devbridge.CopyLayout(7, 20, 48, 20)}) == 2
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert layout.pitched and (layout.host_span, layout.device_span, layout.bytes_moved) == (6 * 48 + 20, 6 * 32 + 20, 140)
    packed = devbridge.CopyLayout(3, 12)  # pitches default to the row: packed
    assert (packed.host_pitch, packed.device_pitch) == (12, 12)
    assert not devbridge.CopyLayout(0, 0).pitched
    with pytest.raises(AttributeError):
        layout.rows = 3


def test_copy_layout_arguments_raise_what_python_users_expect():
    with pytest.raises(TypeError, match="rows must be an int"):
        devbridge.CopyLayout("7", 20)
    with pytest.raises(TypeError, match="row_bytes must be an int"):
        devbridge.CopyLayout(7, 2.0)
    with pytest.raises(OverflowError, match="host_pitch"):
        devbridge.CopyLayout(7, 20, -1)
    with pytest.raises(OverflowError, match="device_pitch"):
        devbridge.CopyLayout(7, 20, 20, 2**64)
    assert devbridge.CopyLayout(np.int64(2), np.uint16(4)) == devbridge.CopyLayout(2, 4, 4, 4)
    # Spans are the bridge's rules: rows that overlap, or reach past 2**64, are InvalidRange.
    with pytest.raises(devbridge.InvalidRange, match="host pitch of 8 bytes is shorter than a row of 16"):
        devbridge.CopyLayout(3, 16, 8, 16).host_span
    with pytest.raises(devbridge.InvalidRange, match="past 2\\^64"):
        devbridge.CopyLayout(2**40, 2**30, 2**30, 2**30).device_span
    with pytest.raises(devbridge.InvalidRange):
        devbridge.CopyLayout(2**40, 2**30).bytes_moved


def test_pitched_layout_folds_rows_and_names_what_is_not_row_major():
    # A float32 window a[1:8, 1:6] of a (10, 12) matrix: 7 rows of 5 elements, 48 bytes apart.
    assert devbridge.pitched_layout((7, 5), (48, 4), 4) == devbridge.CopyLayout(7, 20, 48, 20)
    assert devbridge.pitched_layout([7, 5], [48, 4], 4, device_pitch=32) == devbridge.CopyLayout(7, 20, 48, 32)
    # Leading dimensions that continue the rows evenly fold into them; dimensions of one drop out.
    assert devbridge.pitched_layout((2, 6, 1, 5), (96, 16, 999, 2), 2) == devbridge.CopyLayout(12, 10, 16, 10)
    assert devbridge.pitched_layout((), (), 8) == devbridge.CopyLayout(1, 8, 8, 8)
    assert devbridge.pitched_layout(5, 4, 4) == devbridge.CopyLayout(1, 20, 20, 20)

    with pytest.raises(devbridge.InvalidRange, match="\\(dimension 1\\) are 48 bytes apart, not adjacent.*not pitched row-major"):
        devbridge.pitched_layout((12, 10), (4, 48), 4)  # a transpose
    with pytest.raises(devbridge.InvalidRange, match="dimension 0 has a negative stride"):
        devbridge.pitched_layout((10, 12), (-48, 4), 4)
    with pytest.raises(devbridge.InvalidRange, match="8 bytes apart, less than a row's 16 bytes; they would overlap"):
        devbridge.pitched_layout((3, 4), (8, 4), 4)
    with pytest.raises(devbridge.InvalidRange, match="dimension 0 has stride 128 where 96 would continue"):
        devbridge.pitched_layout((2, 6, 5), (128, 16, 2), 2)
    with pytest.raises(devbridge.InvalidRange, match="2 dimensions but 1 strides"):
        devbridge.pitched_layout((2, 3), (4,), 4)
    with pytest.raises(devbridge.InvalidRange, match="element size 0"):
        devbridge.pitched_layout((2, 3), (12, 4), 0)
    with pytest.raises(devbridge.InvalidRange, match="dimension 1 is empty"):
        devbridge.pitched_layout((2, 0), (12, 4), 4)
    with pytest.raises(devbridge.InvalidRange, match="device pitch of 16 bytes is shorter than a row of 20"):
        devbridge.pitched_layout((7, 5), (48, 4), 4, device_pitch=16)

    with pytest.raises(TypeError, match="shape must be an int or a sequence of ints"):
        devbridge.pitched_layout("75", (48, 4), 4)
    with pytest.raises(TypeError, match="strides must be an int"):
        devbridge.pitched_layout((7, 5), (48.0, 4), 4)
    with pytest.raises(TypeError, match="itemsize must be an int"):
        devbridge.pitched_layout((7, 5), (48, 4), np.dtype("float32"))
    with pytest.raises(OverflowError, match="shape"):
        devbridge.pitched_layout((2**63, 5), (48, 4), 4)
    with pytest.raises(OverflowError, match="itemsize"):
        devbridge.pitched_layout((7, 5), (48, 4), -4)
    with pytest.raises(OverflowError, match="device_pitch"):
        devbridge.pitched_layout((7, 5), (48, 4), 4, device_pitch=-1)


def test_copy_layout_of_a_strided_numpy_array():
    a = np.zeros((10, 12), np.float32)
    assert devbridge.CopyLayout.of(a[1:8, 1:6]) == devbridge.CopyLayout(7, 20, 48, 20)
    assert devbridge.CopyLayout.of(a[1:8, 1:6], device_pitch=24) == devbridge.CopyLayout(7, 20, 48, 24)
    assert devbridge.CopyLayout.of(a) == devbridge.CopyLayout(10, 48, 48, 48)
    assert devbridge.CopyLayout.of(a[::2]) == devbridge.CopyLayout(5, 48, 96, 48)
    assert devbridge.CopyLayout.of(a[3]) == devbridge.CopyLayout(1, 48, 48, 48)
    assert devbridge.CopyLayout.of(memoryview(bytearray(30))) == devbridge.CopyLayout(1, 30, 30, 30)
    cube = np.zeros((4, 6, 8), np.uint16)
    assert devbridge.CopyLayout.of(cube[1:3, :, 2:7]) == devbridge.CopyLayout(12, 10, 16, 10)

    with pytest.raises(devbridge.InvalidRange, match="not adjacent") as info:
        devbridge.CopyLayout.of(a.T)
    assert "shape (12, 10) with byte strides (4, 48)" in str(info.value)
    with pytest.raises(devbridge.InvalidRange, match="not adjacent"):
        devbridge.CopyLayout.of(a[:, ::2])
    with pytest.raises(devbridge.InvalidRange, match="negative stride"):
        devbridge.CopyLayout.of(a[::-1, 1:6])
    with pytest.raises(devbridge.InvalidRange, match="copy each slice of it separately"):
        devbridge.CopyLayout.of(cube[:, 1:5, 2:7])
    with pytest.raises(devbridge.InvalidRange, match="overlap"):
        devbridge.CopyLayout.of(np.lib.stride_tricks.as_strided(a, shape=(4, 12), strides=(8, 4)))
    with pytest.raises(devbridge.InvalidRange, match="device pitch of 20 bytes is shorter than a row of 48"):
        devbridge.CopyLayout.of(a, device_pitch=20)
    with pytest.raises(TypeError, match="must support the buffer protocol"):
        devbridge.CopyLayout.of([[1, 2], [3, 4]])
    with pytest.raises(TypeError, match="device_pitch must be an int"):
        devbridge.CopyLayout.of(a, device_pitch="32")


# ---- pitched copies through the ring ----

# rows, row_bytes, host_pitch, device_pitch: odd widths and pitches, packed and padded sides, one row.
RING_LAYOUTS = [(1, 1, 1, 1), (5, 7, 13, 11), (3, 33, 64, 35), (16, 3, 3, 5), (4, 10, 10, 10), (9, 1, 2, 3)]


@pytest.mark.parametrize("rows,row_bytes,host_pitch,device_pitch", RING_LAYOUTS)
def test_pitched_ring_round_trip_leaves_the_padding_untouched(pb, rng, rows, row_bytes, host_pitch, device_pitch):
    layout = devbridge.CopyLayout(rows, row_bytes, host_pitch, device_pitch)
    before, device_offset = 9, 3  # the rows start off the reservation's and the allocation's start
    h, extent = byte_alloc(pb, device_offset + layout.device_span + 5)
    device_bytes = random_bytes(rng, extent)
    upload(pb, h, device_bytes)

    r = pb.ring.reserve(before + layout.host_span + 7)
    source = random_bytes(rng, r.len)
    pb.ring.ndarray(r)[:] = source
    rows_range = devbridge.HostRange(r.offset + before, layout.host_span)
    assert pb.wait(pb.host_to_device(rows_range, h, device_offset, layout=layout)) == "completed"
    device_bytes = apply_rows(device_bytes, device_offset, device_pitch, source, before, host_pitch, layout)
    assert np.array_equal(download(pb, h, extent), device_bytes)
    assert np.array_equal(pb.ring.ndarray(r), source)  # an upload leaves the host side alone

    # Back into fresh random bytes, with the same layout: only the rows change.
    landing = random_bytes(rng, r.len)
    pb.ring.ndarray(r)[:] = landing
    event = pb.device_to_host(h, rows_range, device_offset, mode="sync", layout=layout)
    assert pb.host_bytes_valid(event)
    expected = apply_rows(landing, before, host_pitch, device_bytes, device_offset, device_pitch, layout)
    assert np.array_equal(pb.ring.ndarray(r), expected)
    pb.ring.release(r)
    pb.free(h)


def test_a_float32_window_goes_through_the_ring_row_by_row(pb, rng):
    a = rng.standard_normal((10, 12)).astype(np.float32)
    window = a[1:8, 1:6]
    layout = devbridge.CopyLayout.of(window)
    h, extent = float_alloc(pb, window.nbytes)
    padding = random_bytes(rng, extent)
    upload(pb, h, padding)
    r = pb.ring.reserve(a.nbytes)
    pb.ring.ndarray(r, "float32")[:] = a.ravel()
    start = window.ctypes.data - a.ctypes.data  # where the window's first element sits in the ring copy
    pb.wait(pb.host_to_device(devbridge.HostRange(r.offset + start, layout.host_span), h, layout=layout))
    on_device = download(pb, h, extent)
    assert np.array_equal(on_device[: window.nbytes].view(np.float32).reshape(7, 5), window)
    assert np.array_equal(on_device[window.nbytes :], padding[window.nbytes :])
    pb.ring.release(r)
    pb.free(h)


def test_pitched_copies_refuse_what_does_not_fit(pb, rng):
    h, extent = float_alloc(pb, 256)
    r = pb.ring.reserve(256)
    layout = devbridge.CopyLayout(4, 16, 48, 16)  # reaches 160 host bytes
    with pytest.raises(devbridge.InvalidRange, match="reach 160 bytes, past host range"):
        pb.host_to_device(devbridge.HostRange(r.offset, 128), h, layout=layout)
    with pytest.raises(devbridge.InvalidRange, match="outside its extent"):
        pb.host_to_device(r, h, extent - 32, layout=layout)
    with pytest.raises(devbridge.InvalidRange, match="host pitch of 8 bytes is shorter than a row of 16 bytes"):
        pb.host_to_device(r, h, layout=devbridge.CopyLayout(3, 16, 8, 16))
    with pytest.raises(devbridge.InvalidRange, match="device pitch of 8 bytes is shorter than a row of 16 bytes"):
        pb.device_to_host(h, r, layout=devbridge.CopyLayout(3, 16, 16, 8))
    with pytest.raises(devbridge.InvalidRange, match="split the float32 elements"):
        pb.host_to_device(r, h, layout=devbridge.CopyLayout(2, 6, 8, 10))  # 6-byte rows of a float32 allocation
    with pytest.raises(devbridge.InvalidRange, match="has no rows; pass layout=None"):
        pb.host_to_device(r, h, layout=devbridge.CopyLayout(0, 16))
    with pytest.raises(TypeError, match="layout must be a devbridge.CopyLayout"):
        pb.host_to_device(r, h, layout=(4, 16, 48, 16))
    assert pb.stats()["copies_submitted"] == 0  # nothing was submitted by any of them
    pb.ring.release(r)
    pb.free(h)


def test_existing_copy_calls_are_unchanged(pb, rng):
    h, extent = byte_alloc(pb, 128)
    r = pb.ring.reserve(128)
    data = random_bytes(rng, 128)
    pb.ring.ndarray(r)[:] = data
    assert pb.wait(pb.host_to_device(r, h, 0, "sync")) == "completed"
    assert pb.wait(pb.host_to_device(r, h, offset=0, mode="async", wait_for_room=1.0, layout=None)) == "completed"
    pb.ring.ndarray(r)[:] = 0
    assert pb.wait(pb.device_to_host(h, r, 0, "async")) == "completed"
    assert np.array_equal(pb.ring.ndarray(r), data)
    with pytest.raises(TypeError, match="range must be a HostRange .* RegionRange"):
        pb.host_to_device("0:128", h)
    with pytest.raises(TypeError):
        pb.device_to_host(r, h)  # arguments swapped
    pb.ring.release(r)
    pb.free(h)


def test_the_fake_backend_records_the_layout_it_was_given(rng):
    with open_bridge("fake") as b:
        h, extent = byte_alloc(b, 256)
        r = b.ring.reserve(256)
        b.fake.clear_calls()
        layout = devbridge.CopyLayout(3, 10, 30, 16)
        b.wait(b.host_to_device(r, h, layout=layout))
        b.wait(b.device_to_host(h, r))
        copies = [c for c in b.fake.calls() if c["call"].startswith("copy")]
        assert [c["layout"] for c in copies] == [layout, None]
        assert copies[0]["bytes"] == layout.bytes_moved == 30
        b.ring.release(r)
        b.free(h)


# ---- registered host memory ----


def test_a_numpy_array_round_trips_through_its_registration(pb, rng):
    src = page_array((64, 33), "float32")
    src[:] = rng.standard_normal(src.shape)
    dst = page_array((64, 33), "float32")
    dst[:] = rng.standard_normal(dst.shape)
    h, extent = float_alloc(pb, src.nbytes)
    with pb.register_host(src, writable=False) as up, pb.register_host(dst) as down:
        assert up.registered and up.obj is src and (up.nbytes, up.bytes, len(up)) == (src.nbytes,) * 3
        assert up.address == src.ctypes.data and not up.writable and down.writable
        assert pb.stats()["host_regions"] == 2 and pb.stats()["host_region_bytes"] == 2 * src.nbytes
        assert pb.wait(pb.host_to_device(up.range(), h)) == "completed"
        assert pb.wait(pb.device_to_host(h, down)) == "completed"  # a HostRegion is its whole range
        assert np.array_equal(dst, src)
        # A part of it, at an offset, both ways.
        part = down.range(400, 800)
        assert (part.offset, part.len, len(part), part.region) == (400, 800, 800, down)
        dst[:] = 0
        assert pb.wait(pb.device_to_host(h, part, 400, mode="sync")) == "completed"
        flat = dst.view(np.uint8).ravel()
        assert np.array_equal(flat[400:1200], src.view(np.uint8).ravel()[400:1200]) and not flat[:400].any()
    assert not up.registered and not down.registered and up.obj is None
    assert pb.stats()["host_regions"] == 0 and pb.stats()["host_region_bytes"] == 0
    if pb.backend == "fake":
        assert pb.fake.live_registrations() == 0
    pb.free(h)


def test_a_bytearray_and_an_mmap_round_trip(pb, rng):
    data = bytearray(random_bytes(rng, 3 * PAGE).tobytes())
    mm = mmap.mmap(-1, 3 * PAGE)
    h, extent = byte_alloc(pb, 3 * PAGE)
    with pb.register_host(data) as a, pb.register_host(mm) as b:
        assert a.obj is data and b.obj is mm and len(b) == 3 * PAGE
        pb.wait(pb.host_to_device(a.range(), h))
        pb.wait(pb.device_to_host(h, b.range()))
        assert mm[:] == bytes(data)
        with pytest.raises(BufferError):
            data.append(1)  # the held export: the bytearray cannot move while registered
        with pytest.raises(BufferError):
            mm.close()
    data.append(1)  # unregistered: resizable again
    mm.close()
    pb.free(h)


def test_a_file_backed_mmap_receives_a_download(pb, rng, tmp_path):
    path = tmp_path / "weights.bin"
    original = random_bytes(rng, 2 * PAGE).tobytes()
    path.write_bytes(original)
    payload = random_bytes(rng, PAGE)
    h, _ = byte_alloc(pb, PAGE)
    upload(pb, h, payload)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        with pb.register_host(mm) as region:
            pb.wait(pb.device_to_host(h, region.range(PAGE // 2, PAGE)))
        mm.flush()
    written = path.read_bytes()
    assert written[PAGE // 2 : PAGE // 2 + PAGE] == payload.tobytes()
    assert written[: PAGE // 2] == original[: PAGE // 2] and written[PAGE // 2 + PAGE :] == original[PAGE // 2 + PAGE :]
    pb.free(h)


def test_a_float32_window_of_a_registered_matrix_round_trips(pb, rng):
    a = page_array((10, 12), "float32")
    a[:] = rng.standard_normal(a.shape)
    out = page_array((9, 11), "float32")
    out[:] = rng.standard_normal(out.shape)
    untouched = out.copy()
    h, extent = float_alloc(pb, 512)
    padding = random_bytes(rng, extent)
    upload(pb, h, padding)
    with pb.register_host(a) as region, pb.register_host(out) as out_region:
        window = a[1:8, 1:6]
        rows, layout = region.range_of(window)
        assert layout == devbridge.CopyLayout(7, 20, 48, 20)
        assert (rows.offset, rows.len) == ((1 * 12 + 1) * 4, layout.host_span)
        assert pb.wait(pb.host_to_device(rows, h, 64, layout=layout)) == "completed"
        on_device = download(pb, h, extent)
        assert np.array_equal(on_device[64 : 64 + window.nbytes].view(np.float32).reshape(7, 5), window)
        assert np.array_equal(on_device[:64], padding[:64])
        assert np.array_equal(on_device[64 + window.nbytes :], padding[64 + window.nbytes :])

        # Down into a window of another registered matrix: the rest of it keeps its values.
        into, into_layout = out_region.range_of(out[2:9, 3:8])
        assert pb.wait(pb.device_to_host(h, into, 64, layout=into_layout)) == "completed"
        expected = untouched.copy()
        expected[2:9, 3:8] = window
        assert np.array_equal(out, expected)

        # A device pitch of its own: the rows land 32 bytes apart, the bytes between them untouched.
        upload(pb, h, padding)
        rows, pitched = region.range_of(window, device_pitch=32)
        assert pitched == devbridge.CopyLayout(7, 20, 48, 32)
        pb.wait(pb.host_to_device(rows, h, layout=pitched))
        expected_device = apply_rows(padding, 0, 32, a.view(np.uint8).ravel(), rows.offset, 48, pitched)
        assert np.array_equal(download(pb, h, extent), expected_device)

        # A contiguous view is a plain range: no layout.
        whole_rows, none = region.range_of(a[2:5])
        assert none is None and (whole_rows.offset, whole_rows.len) == (2 * 48, 3 * 48)
    pb.free(h)


def test_range_of_refuses_views_it_cannot_copy(rng):
    with open_bridge("fake") as b:
        a = page_array((10, 12), "float32")
        elsewhere = np.zeros((10, 12), np.float32)
        with b.register_host(a) as region:
            with pytest.raises(devbridge.InvalidRange, match="not inside host region .*pass a view into the registered"):
                region.range_of(elsewhere[1:3])
            with pytest.raises(devbridge.InvalidRange, match="not inside"):
                region.range_of(np.lib.stride_tricks.as_strided(a, shape=(11, 12), strides=(48, 4)))
            with pytest.raises(devbridge.InvalidRange, match="not adjacent.*not pitched row-major"):
                region.range_of(a.T)
            with pytest.raises(devbridge.InvalidRange, match="negative stride"):
                region.range_of(a[7:1:-1, 1:6])
            with pytest.raises(devbridge.InvalidRange, match="would overlap"):
                region.range_of(np.lib.stride_tricks.as_strided(a, shape=(4, 12), strides=(8, 4)))
            with pytest.raises(devbridge.InvalidRange, match="is empty"):
                region.range_of(a[3:3])
            with pytest.raises(TypeError, match="must support the buffer protocol"):
                region.range_of(17)
            with pytest.raises(OverflowError, match="device_pitch"):
                region.range_of(a[1:3], device_pitch=-1)


def test_region_ranges_take_ints_as_python_users_expect():
    with open_bridge("fake") as b:
        with b.register_host(bytearray(256)) as region:
            assert region.range(np.int64(16), np.uint8(32)) == region.range(16, 32)
            assert region.range(200).len == 56 and hash(region.range(1, 2)) == hash(region.range(1, 2))
            assert region.range(1, 2) != region.range(1, 3) and region.range(1, 2) != devbridge.HostRange(1, 2)
            with pytest.raises(TypeError, match="offset must be an int"):
                region.range("16")
            with pytest.raises(TypeError, match="length must be an int"):
                region.range(0, 1.5)
            with pytest.raises(OverflowError, match="offset"):
                region.range(-1)
            with pytest.raises(OverflowError, match="length"):
                region.range(0, 2**64)
            with pytest.raises(devbridge.InvalidRange, match="range \\[offset 0, len 0\\] is outside the 256 bytes of host region"):
                region.range(0, 0)
            with pytest.raises(devbridge.InvalidRange, match="outside the 256 bytes"):
                region.range(256)
            with pytest.raises(devbridge.InvalidRange, match="outside the 256 bytes"):
                region.range(200, 57)
            with pytest.raises(TypeError, match="writable must be True or False"):
                b.register_host(bytearray(8), writable=1)
            with pytest.raises(TypeError):
                devbridge.RegionRange()  # only a region hands ranges out


def test_registration_refuses_buffers_it_cannot_use():
    with open_bridge("fake") as b:
        with pytest.raises(ValueError, match="bytes object \\(5 bytes\\) is read-only; register it with writable=False"):
            b.register_host(b"12345")
        frozen = np.zeros(16, np.uint8)
        frozen.setflags(write=False)
        with pytest.raises(ValueError, match="read-only"):
            b.register_host(frozen)
        with pytest.raises(ValueError, match="not C-contiguous; registered memory is one run of bytes"):
            b.register_host(np.zeros((8, 8), np.float32)[:, 1])
        with pytest.raises(ValueError, match="not C-contiguous"):
            b.register_host(np.zeros((8, 8), np.float32).T)
        with pytest.raises(TypeError, match="must support the buffer protocol"):
            b.register_host("a str is not a buffer")
        with pytest.raises(TypeError, match="must support the buffer protocol"):
            b.register_host(12)
        with pytest.raises(devbridge.InvalidExtent, match="0 bytes"):
            b.register_host(bytearray())
        r = b.ring.reserve(4096)
        with pytest.raises(devbridge.InvalidRange, match="overlaps the bridge's own ring"):
            b.register_host(b.ring.buffer(r))
        b.ring.release(r)  # the failed registration let go of the ring buffer's export
        assert b.stats()["host_regions"] == 0 and b.fake.live_registrations() == 0


def test_big_endian_elements_are_refused_where_registered_bytes_would_move_swapped():
    """register_host and range_of took a '>f4' array, and copies moved its bytes as they are: the float32
    allocation read [4.6e-41, 9.0e-44, ...] for [1, 2, 3, 4] (the contract: converted or refused at every entry)."""
    with open_bridge("fake") as b:
        big = np.arange(1, 5, dtype=">f4")
        for refused in (big, memoryview(big), np.zeros(4, np.dtype([("a", ">i4")]))):
            with pytest.raises(ValueError, match="big-endian .*newbyteorder"):
                b.register_host(refused)
        assert b.stats()["host_regions"] == 0 and b.fake.live_registrations() == 0
        raw = page_array((64,), "uint8")
        region = b.register_host(raw)
        with pytest.raises(ValueError, match="range_of: .*big-endian"):
            region.range_of(raw.view(">f4"))
        assert region.range_of(raw.view("<f4"))[0] == region.range(0, 64)  # little-endian and native: as they are
        region.unregister()


def test_a_with_block_ending_in_an_error_keeps_that_error_not_the_unregisters():
    """A fatal copy failure inside `with bridge.register_host(buf)` surfaced as the Broken the region's
    __exit__ met unregistering, fatal=False, the DeviceCopyFailed only in __context__."""
    with open_bridge("fake") as b:
        b.fake.set_auto_complete(True)
        buf = page_array((4096,), "uint8")
        h = b.alloc(devbridge.ObjectSpec(4096, 256, "uint8"), 4096)
        b.fake.inject("copy_h2d", "fatal")
        with pytest.raises(devbridge.DeviceCopyFailed) as raised:
            with b.register_host(buf) as region:
                b.wait(b.host_to_device(region.range(0, 4096), h))
        assert raised.value.fatal
        b.restart(2)  # lets the region go, as a broken bridge's restart does
        assert b.fake.live_registrations() == 0


def test_overlapping_registrations_are_refused_naming_the_region():
    with open_bridge("fake") as b:
        a = page_array((16, 64), "uint8")
        region = b.register_host(a)
        for overlapping in (a, a[3:5], a[15]):
            with pytest.raises(devbridge.InvalidRange, match=f"overlaps host region .*id {region.id:#x}.*unregister it first"):
                b.register_host(overlapping)
        region.unregister()
        again = b.register_host(a[3:5])  # free again once unregistered
        assert again.nbytes == 128
        again.unregister()


def test_a_read_only_registration_uploads_but_refuses_downloads(pb, rng):
    payload = random_bytes(rng, PAGE).tobytes()
    h, _ = byte_alloc(pb, PAGE)
    with pb.register_host(payload, writable=False) as region:
        assert not region.writable and "writable=False" in repr(region)
        pb.wait(pb.host_to_device(region.range(), h))
        assert download(pb, h, PAGE).tobytes() == payload
        with pytest.raises(devbridge.InvalidRange, match="registered read-only \\(uploads only\\)"):
            pb.device_to_host(h, region.range(0, 64))
        with pytest.raises(devbridge.InvalidRange, match="read-only"):
            pb.device_to_host(h, region)
    pb.free(h)


def test_a_read_only_mmap_registers_for_uploads(rng, tmp_path):
    # Real CUDA pins read-only pages only with CU_MEMHOSTREGISTER_READ_ONLY, which the backend does not ask for.
    with open_bridge("fake") as b:
        path = tmp_path / "data.bin"
        payload = random_bytes(rng, PAGE).tobytes()
        path.write_bytes(payload)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            with pytest.raises(ValueError, match="mmap object .* is read-only"):
                b.register_host(mm)
            h, _ = byte_alloc(b, PAGE)
            with b.register_host(mm, writable=False) as region:
                b.wait(b.host_to_device(region, h))
            assert download(b, h, PAGE).tobytes() == payload
            b.free(h)


def test_unregister_is_refused_while_an_async_copy_uses_the_region(held_fake, rng):
    b = held_fake
    data = bytearray(random_bytes(rng, 1024).tobytes())
    h, _ = byte_alloc(b, 1024)
    region = b.register_host(data)
    upload_event = b.host_to_device(region.range(0, 512), h, 0)
    download_event = b.device_to_host(h, region.range(512, 512), 512)
    with pytest.raises(devbridge.AllocationStillInUse, match=f"host region .*id {region.id:#x}.* is used by 2 copies in flight"):
        region.unregister()
    with pytest.raises(devbridge.AllocationStillInUse):
        with region:
            pass  # leaving the block unregisters: refused the same way
    with pytest.raises(devbridge.AllocationStillInUse):
        b.unregister_host(region)
    assert region.registered and b.stats()["host_regions"] == 1 and b.fake.live_registrations() == 1
    with pytest.raises(BufferError):
        data.extend(b"more")  # still held: the device may still write into it
    b.fake.complete(upload_event)
    assert b.wait(upload_event) == "completed"
    with pytest.raises(devbridge.AllocationStillInUse, match="1 copies in flight"):
        region.unregister()
    b.fake.complete_all()
    assert b.wait(download_event) == "completed"
    region.unregister()
    assert not region.registered and b.fake.live_registrations() == 0
    data.extend(b"more")
    with pytest.raises(devbridge.UnknownDeviceHandle, match="unknown or already unregistered"):
        region.unregister()
    with region:
        pass  # nothing left to end
    b.free(h)


def test_a_region_dropped_during_a_copy_stays_registered_until_the_copy_ends(held_fake, rng):
    b = held_fake
    data = bytearray(1024)
    h, _ = byte_alloc(b, 1024)
    payload = random_bytes(rng, 1024)
    b.fake.set_auto_complete(True)
    upload(b, h, payload)
    b.fake.set_auto_complete(False)
    region = b.register_host(data)
    event = b.device_to_host(h, region.range())
    del region
    collect()
    assert b.stats()["host_regions"] == 1 and b.fake.live_registrations() == 1
    with pytest.raises(BufferError):
        data.append(0)  # the device still writes into it
    b.fake.complete_all()
    assert b.wait(event) == "completed"
    assert bytes(data) == payload.tobytes()
    # The next registration lets go of it.
    other = b.register_host(bytearray(64))
    assert b.stats()["host_regions"] == 1 and b.fake.live_registrations() == 1
    data.append(0)
    other.unregister()
    b.free(h)


def test_a_region_keeps_its_buffer_alive_until_unregistered():
    with open_bridge("fake") as b:
        a = np.ones(4096, np.uint8)
        alive = weakref.ref(a)
        region = b.register_host(a)
        del a
        collect()
        assert alive() is not None and region.obj is alive()
        rows = region.range(0, 16)  # a range keeps the region object, not the registration
        region.unregister()
        collect()
        assert alive() is None and region.obj is None and rows.region is region
        # Dropping a registered region unregisters it.
        c = np.ones(4096, np.uint8)
        alive = weakref.ref(c)
        b.register_host(c)
        del c
        collect()
        assert alive() is None and b.stats()["host_regions"] == 0 and b.fake.live_registrations() == 0


def test_a_bridge_dropped_with_a_region_still_in_use_lets_go_of_it_when_it_closes():
    b = devbridge.Bridge(backend="fake", ring_bytes=RING)
    data = bytearray(256)
    h, _ = byte_alloc(b, 256)
    region = b.register_host(data)
    b.device_to_host(h, region.range())  # stays in flight: the fake completes nothing by itself
    del region  # cannot unregister yet: the bridge's state keeps the registration
    collect()
    with pytest.raises(BufferError):
        data.append(0)
    del b  # the last holder of the state: closing quiesces the copy, then the buffer goes back
    collect()
    data.append(0)


def test_a_failed_registration_leaves_nothing_held():
    with open_bridge("fake") as b:
        data = bytearray(512)
        b.fake.inject("register_host", "allocation_failed")
        with pytest.raises(devbridge.AllocationFailed, match="register_host"):
            b.register_host(data)
        data.append(0)
        assert b.stats()["host_regions"] == 0 and b.fake.live_registrations() == 0


def test_a_restart_refuses_the_old_region_and_lets_go_of_its_buffer(pb, rng):
    data = bytearray(random_bytes(rng, PAGE).tobytes())
    h, _ = byte_alloc(pb, PAGE)
    region = pb.register_host(data)
    rows = region.range(0, 256)
    pb.wait(pb.host_to_device(rows, h))
    pb.restart(pb.generation + 1)
    assert not region.registered and region.obj is None and "unregistered" in repr(region)
    data.extend(b"resizable again")  # the restart unregistered it, and the bindings let go of it
    assert pb.stats()["host_regions"] == 0 and pb.stats()["host_region_bytes"] == 0
    h2, _ = byte_alloc(pb, PAGE)
    with pytest.raises(devbridge.OldGenerationHandle, match=f"host region .*id {region.id:#x}.* is from generation"):
        pb.host_to_device(rows, h2)
    with pytest.raises(devbridge.OldGenerationHandle):
        region.unregister()
    with pytest.raises(devbridge.OldGenerationHandle):
        pb.unregister_host(region)
    with pytest.raises(devbridge.OldGenerationHandle):
        region.range(0, 16)
    with region:
        pass  # a `with` block ends quietly on a region the restart already ended
    with pb.register_host(data) as fresh:  # the same memory registers again in the new generation
        assert fresh.generation == pb.generation
        pb.wait(pb.host_to_device(fresh.range(0, 64), h2))
    pb.free(h2)


def test_close_lets_go_of_every_registered_buffer():
    b = open_bridge("fake")
    data = bytearray(256)
    mm = mmap.mmap(-1, PAGE)
    region, mapped = b.register_host(data), b.register_host(mm)
    b.close()
    data.append(0)
    mm.close()
    assert not region.registered and not mapped.registered
    with pytest.raises(devbridge.Closed):
        region.unregister()
    with pytest.raises(devbridge.Closed):
        region.range()
    with region:
        pass


def test_a_region_outlives_its_bridge_object():
    b = open_bridge("fake")
    data = bytearray(256)
    region = b.register_host(data)
    del b
    gc.collect()
    region.unregister()  # the region holds the bridge's state: it is still open
    data.append(0)
    del region  # the last holder: the bridge closes now


def test_regions_of_another_bridge_are_refused(rng):
    with open_bridge("fake") as one, open_bridge("fake") as other:
        region = one.register_host(bytearray(256))
        h, _ = byte_alloc(other, 256)
        with pytest.raises(devbridge.ForeignDomain, match="host region"):
            other.host_to_device(region.range(), h)
        with pytest.raises(devbridge.ForeignDomain, match="belongs to another bridge"):
            other.unregister_host(region)
        with pytest.raises(TypeError, match="region must be a HostRegion"):
            other.unregister_host(devbridge.HostRange(0, 256))
        one.unregister_host(region)
        assert not region.registered


# ---- CUDA, emulated ----


def test_the_cuda_cases_pass_on_the_emulated_driver(request):
    if os.environ.get(EMULATED_CHILD):
        pytest.skip("this is the emulated-CUDA run")
    if REQUESTED_BACKEND == "cuda":
        pytest.skip("DEVBRIDGE_TEST_BACKEND=cuda: the cuda cases of this run use the driver it loads")
    if not any(e["name"] == "cuda" and e["built"] for e in devbridge.list_backends()):
        pytest.skip("this build of the module has no CUDA backend")
    library = request.getfixturevalue("emulated_libcuda")  # after the skips above: they need no build tree
    env = dict(os.environ, DEVBRIDGE_LIBCUDA=str(library), DEVBRIDGE_EMULATED_CUDA_DELAY_US="0",
               DEVBRIDGE_TEST_BACKEND="cuda", **{EMULATED_CHILD: "1"})
    command = [sys.executable, "-m", "pytest", str(pathlib.Path(__file__)), "-q", "-p", "no:cacheprovider", "-k", "cuda"]
    result = subprocess.run(command, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert " passed" in result.stdout and " failed" not in result.stdout, output[-6000:]
