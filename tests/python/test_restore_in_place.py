"""Restore in one copy where device memory is host memory (issue #26): the transfer planner's
``write_in_place`` route (``Bridge::write_in_place``) reads the file straight into the tensors, no ring, and
small tensors next to each other in the file go as one stream (``submit_scatter``: one ``preadv`` into them
all). Elsewhere (the fake, OpenCL) the same calls go through the ring. Checked on every backend: bit-exact
against files the ``safetensors`` package writes, failures free everything, ``wait=False`` tensors ready
as they land, partial loads.
"""

from __future__ import annotations

import gc
import json
import os
import threading

import numpy as np
import pytest
import safetensors.numpy

import devbridge
import devbridge._restore as restore_module
from conftest import auto_bridge
from devbridge._devbridge import TransferPlanner
from test_checkpoint_partial import nothing_left, restored_then_freed
from test_restore_stream import HeldRead, until

RING = 4 << 20


@pytest.fixture(params=["fake", "host", "opencl", "cuda"])
def pb(request):
    yield from auto_bridge(request.param, ring_bytes=RING)


def in_place(b: devbridge.Bridge) -> bool:
    """Whether ``b``'s planner takes write_in_place for a stream (host memory, or memory mapped for writing)."""
    h = b.alloc(devbridge.ObjectSpec(max_extent=4096, alignment=256, dtype="uint8"), 4096)
    try:
        planner = TransferPlanner(b)
        events = planner.submit_stream(lambda at, chunk: chunk.__setitem__(slice(None), b"\0" * len(chunk)), 4096,
                                       into=h)
        for event, _, _ in events:
            b.wait(event)
        return planner.last_route == "write_in_place"
    finally:
        b.free(h)


def many(rng, count: int = 700) -> dict[str, np.ndarray]:
    """Many small tensors of several dtypes (adjacent in the file: read together), a few larger than the
    batch size and the ring, and a scalar."""
    arrays: dict[str, np.ndarray] = {}
    for i in range(count):
        n = int(rng.integers(1, 600))
        kind = i % 4
        if kind == 0:
            arrays[f"w{i:04d}"] = rng.standard_normal(n).astype(np.float32)
        elif kind == 1:
            arrays[f"w{i:04d}"] = rng.standard_normal((n, 3)).astype(np.float16)
        elif kind == 2:
            arrays[f"w{i:04d}"] = rng.integers(-99, 99, size=n).astype(np.int64)
        else:
            arrays[f"w{i:04d}"] = rng.integers(0, 255, size=n).astype(np.uint8)
    arrays["big.a"] = rng.standard_normal(3 << 20).astype(np.float32)  # 12 MiB: past the ring, read in parts
    arrays["big.b"] = rng.standard_normal(300_000).astype(np.float32)  # 1.2 MB: past the batch's tensor size
    arrays["step"] = np.array(7, dtype=np.int64)
    return arrays


def backend_live(b: devbridge.Bridge) -> None:
    """Nothing allocated, by the bridge's count and, where the backend counts them (the fake without a
    pool), the backend's own."""
    assert b.memory_stats()["allocated_bytes"] == 0 and b.stats()["live_allocations"] == 0
    if b.backend_info()["name"] == "fake" and not b.memory_stats()["pool_enabled"]:
        assert b.fake.live_allocations() == 0


def test_host_memory_and_mappable_memory_stream_in_place_and_the_others_through_the_ring(pb):
    info = pb.backend_info()
    assert in_place(pb) == (info["host_addressable"] or info["maps_for_write"])
    assert in_place(pb) == (info["name"] == "host" or (info["name"] == "opencl" and info["cheap_registration"]))


def test_many_small_tensors_restore_bit_exact_from_a_file_the_package_wrote(pb, rng, tmp_path):
    arrays = many(rng)
    path = str(tmp_path / "many.safetensors")
    safetensors.numpy.save_file(arrays, path)
    before = pb.stats()["copies_submitted"]
    restored = pb.restore(path)
    if in_place(pb):
        assert pb.stats()["copies_submitted"] == before  # nothing went through the ring
    restored_then_freed(pb, restored, arrays)


def test_a_devbridge_checkpoint_of_many_tensors_round_trips_verified(pb, rng, tmp_path):
    arrays = many(rng, 400)
    path = str(tmp_path / "many.safetensors")
    tensors = {name: pb.upload(a, wait=True) for name, a in arrays.items()}
    pb.checkpoint(path, tensors)
    for t in tensors.values():
        t.free()
    back = safetensors.numpy.load_file(path)  # the package reads what the in-place restore reads back
    assert all(back[n].tobytes() == a.tobytes() for n, a in arrays.items())
    restored_then_freed(pb, pb.restore(path), arrays)


@pytest.mark.parametrize("where", ["first small", "middle small", "big"])
def test_a_flipped_bit_anywhere_frees_every_tensor(pb, rng, tmp_path, where):
    arrays = many(rng, 300)
    path = str(tmp_path / "many.safetensors")
    tensors = {name: pb.upload(a, wait=True) for name, a in arrays.items()}
    pb.checkpoint(path, tensors)
    for t in tensors.values():
        t.free()
    info = devbridge.checkpoint_info(path)
    data_start = os.path.getsize(path) - sum(t["nbytes"] for t in info["tensors"].values())
    offsets = {}
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    for name, entry in header.items():
        if name != "__metadata__":
            offsets[name] = entry["data_offsets"]
    small = sorted((o for name, o in offsets.items() if name.startswith("w")), key=lambda o: o[0])
    target = {"first small": small[0][0], "middle small": small[len(small) // 2][0],
              "big": offsets["big.a"][0] + 12345}[where]
    with open(path, "r+b") as f:
        f.seek(data_start + target)
        byte = f.read(1)[0]
        f.seek(data_start + target)
        f.write(bytes([byte ^ 0x01]))
    with pytest.raises(devbridge.CheckpointError, match="is corrupt: the data's checksum"):
        pb.restore(path)
    nothing_left(pb)
    backend_live(pb)


def test_a_file_that_ends_inside_a_batch_of_small_tensors_frees_everything(pb, rng, tmp_path, monkeypatch):
    arrays = {f"v{i:03d}": rng.standard_normal(100 + i).astype(np.float32) for i in range(200)}
    path = str(tmp_path / "small.safetensors")
    safetensors.numpy.save_file(arrays, path)
    size = os.path.getsize(path)
    read = HeldRead(monkeypatch, size - 1)
    pending = pb.restore(path, wait=False)
    assert until(read.reached.is_set)
    os.truncate(path, size - 1000)
    read.release()
    with pytest.raises(devbridge.CheckpointError, match="shrank since its header was checked: a read of"):
        pending.wait()
    assert all(t.freed for t in pending.values())
    nothing_left(pb)
    backend_live(pb)


def test_a_failing_read_inside_a_batch_names_the_tensors_and_frees_everything(pb, rng, tmp_path, monkeypatch):
    arrays = {f"v{i:03d}": rng.standard_normal(50 + i).astype(np.float32) for i in range(120)}
    path = str(tmp_path / "small.safetensors")
    safetensors.numpy.save_file(arrays, path)
    middle = os.path.getsize(path) // 2

    def failing(offset, nbytes):  # the read that reaches the file's second half fails
        if offset + nbytes > middle:
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(restore_module, "_before_read", failing)
    with pytest.raises(OSError, match="Input/output error"):
        pb.restore(path)
    nothing_left(pb)
    backend_live(pb)
    # The error raised again from every tensor's wait, and the stream it came from, are collected: the stream
    # keeps the exception, whose traceback holds the frames that waited on the stream (a cycle through it).
    pending = pb.restore(path, wait=False)
    for name in list(pending)[-3:]:
        with pytest.raises(OSError, match="Input/output error"):
            pending[name].wait()
    with pytest.raises(OSError, match="Input/output error"):
        pending.wait()
    del pending
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o).__name__ == "_RestoreStream"]
    nothing_left(pb)


def test_wait_false_small_tensors_are_ready_before_the_last_byte_is_read(pb, rng, tmp_path, monkeypatch):
    arrays = {f"a{i:03d}": rng.standard_normal(64 + i).astype(np.float32) for i in range(50)}
    arrays["z.big"] = rng.standard_normal(2 << 20).astype(np.float32)  # last in the file (widest first, then name)
    path = str(tmp_path / "m.safetensors")
    safetensors.numpy.save_file(arrays, path)
    read = HeldRead(monkeypatch, os.path.getsize(path) - 1)
    pending = pb.restore(path, wait=False)
    try:
        assert until(read.reached.is_set)
        assert until(pending["a000"].ready) and until(pending["a049"].ready)
        assert not pending["z.big"].ready() and not pending.done()
        assert pending["a017"].numpy().tobytes() == arrays["a017"].tobytes()
    finally:
        read.release()
    assert pending.wait()
    restored_then_freed(pb, pending, arrays)


def test_partial_restores_of_small_tensors_read_only_what_is_asked(pb, rng, tmp_path):
    arrays = many(rng, 200)
    path = str(tmp_path / "many.safetensors")
    safetensors.numpy.save_file(arrays, path)
    every_third = {n for i, n in enumerate(sorted(arrays)) if i % 3 == 0}
    restored_then_freed(pb, pb.restore(path, names=every_third), {n: arrays[n] for n in every_third})
    restored_then_freed(pb, pb.restore(path, prefix="w00"), {n: a for n, a in arrays.items() if n.startswith("w00")})
    rows = {"big.a": slice(1000, 5000), "w0001": slice(1, 2)}
    restored = pb.restore(path, names=lambda n: n in rows, rows=rows)
    restored_then_freed(pb, restored, {n: arrays[n][s] for n, s in rows.items()})


def test_submit_scatter_fills_every_target_in_order_and_cuts_at_chunks(pb):
    spec = devbridge.ObjectSpec(max_extent=1 << 20, alignment=256, dtype="uint8")
    sizes = [256, 4096, 100 << 10, 256, 512 << 10]
    handles = [pb.alloc(spec, n) for n in sizes]
    total = sum(sizes)
    stream = np.random.default_rng(3).integers(0, 255, size=total, dtype=np.uint8)
    seen = []

    def fill(at, views):
        n = sum(v.nbytes for v in views)
        seen.append((at, n))
        done = 0
        for v in views:
            v[:] = stream[at + done:at + done + v.nbytes].tobytes()
            done += v.nbytes

    planner = TransferPlanner(pb, chunk_bytes=64 << 10)
    results = planner.submit_scatter(fill, [(h, 0, n) for h, n in zip(handles, sizes)])
    assert len(results) == len(sizes)
    for events in results:
        for event, _, _ in events:
            assert pb.wait(event) == "completed"
    assert [s for s in seen] == sorted(seen) and sum(n for _, n in seen) == total
    assert all(n <= 64 << 10 for _, n in seen)
    at = 0
    for h, n in zip(handles, sizes):
        assert pb.download(h, dtype="uint8", shape=(n,)).tobytes() == stream[at:at + n].tobytes()
        at += n
    for h in handles:
        pb.free(h)
    nothing_left(pb)


def test_a_fill_that_raises_ends_the_scatter_and_leaves_the_allocations_usable(pb):
    spec = devbridge.ObjectSpec(max_extent=1 << 20, alignment=256, dtype="uint8")
    handles = [pb.alloc(spec, 4096) for _ in range(4)]

    def fill(at, views):
        raise ValueError("no bytes today")

    with pytest.raises(ValueError, match="no bytes today"):
        TransferPlanner(pb).submit_scatter(fill, [(h, 0, 4096) for h in handles])
    assert pb.stats()["copies_in_flight"] == 0
    for h in handles:
        pb.free(h)  # not held by the failed call
    nothing_left(pb)


def test_write_in_place_holds_the_allocation_and_honours_views(pb, rng):
    if not in_place(pb):
        pytest.skip("write_in_place is the route only where device memory is host memory")
    x = pb.upload(rng.standard_normal(1024).astype(np.float32), wait=True)
    with pb.view(x.handle, "float32", (1024,)):
        planner = TransferPlanner(pb)
        with pytest.raises(devbridge.AllocationStillInUse):  # writes_under_view="refuse", as an upload
            planner.submit_stream(lambda at, chunk: None, 4096, into=x.handle)
    release = threading.Event()
    entered = threading.Event()

    def slow_fill(at, chunk):
        entered.set()
        assert release.wait(10)
        chunk[:] = np.arange(1024, dtype=np.float32).tobytes()

    worker = threading.Thread(target=lambda: TransferPlanner(pb).submit_stream(slow_fill, 4096, into=x.handle))
    worker.start()
    try:
        assert entered.wait(10)
        with pytest.raises(devbridge.AllocationStillInUse):  # held as a copy into it is
            pb.free(x.handle)
    finally:
        release.set()
        worker.join()
    assert np.array_equal(pb.download(x), np.arange(1024, dtype=np.float32))
    x.free()
    nothing_left(pb)
