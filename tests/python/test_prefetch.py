"""Prefetcher: batches fed from device memory while the next ones upload.

Runs on fake (auto-completing unless a test drives completions), host, and OpenCL where it is available
(CUDA with DEVBRIDGE_TEST_BACKEND=cuda). tinygrad hand-offs need a device tinygrad can wrap without a copy
(CPU, CUDA): on OpenCL those cases are skipped and ``to="device"`` runs instead. Every bridge has a 1 MiB
ring, so the large batches are chunked.
"""

from __future__ import annotations

import collections
import gc
import math
import threading
import time
import warnings

import numpy as np
import pytest

import devbridge
from conftest import collect, make_bridge, random_array, require_backend, require_dtype

RING = 1 << 20
BACKENDS = ["fake", "host", "opencl", "cuda"]
TINYGRAD_DEVICES = ("CPU", "CUDA")


def _bridge(name: str, *, auto_complete: bool = True) -> devbridge.Bridge:
    require_backend(name)
    b = make_bridge(name, ring_bytes=RING)
    if name == "fake":
        b.fake.set_auto_complete(auto_complete)
    return b


@pytest.fixture(params=BACKENDS)
def pb(request):
    b = _bridge(request.param)
    yield b
    collect()
    b.close()


@pytest.fixture
def fake():
    b = _bridge("fake")
    yield b
    collect()
    b.close()


@pytest.fixture(params=["device", "tinygrad"])
def to(request, pb):
    if request.param == "tinygrad":
        pytest.importorskip("tinygrad")
        if not _tinygrad_can_wrap(pb):
            pytest.skip(f"tinygrad cannot wrap {pb.backend} memory without a copy (to='device' covers it)")
    return request.param


def _tinygrad_can_wrap(b: devbridge.Bridge) -> bool:
    h = b.alloc(devbridge.ObjectSpec(256, 64, "uint8"), 256)
    try:
        with b.view(h, "uint8", 256) as view:
            return view.device.partition(":")[0] in TINYGRAD_DEVICES
    finally:
        b.free(h)


def host(x) -> np.ndarray:
    """A handed-out array's values on the host (a DeviceTensor or a tinygrad Tensor)."""
    return x.numpy()


def assert_quiet(b: devbridge.Bridge) -> None:
    """Nothing of the Prefetcher's is left: no allocation, no ring range, no view, no copy."""
    collect()
    s = b.stats()
    left = {k: s[k] for k in ("live_allocations", "ring_reservations", "live_views", "copies_in_flight")}
    assert left == dict.fromkeys(left, 0), left


def make_batches(rng, n: int, shape=(8, 5)):
    return [(random_array(rng, shape, "float32"), random_array(rng, shape[:1], "int32")) for _ in range(n)]


# ------------------------------------------------------------------------------------- happy paths


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_tuples_round_trip_bit_exact_and_leave_nothing(pb, to, rng, depth):
    batches = make_batches(rng, 7)
    seen = 0
    for i, (x, y) in enumerate(devbridge.Prefetcher(pb, batches, depth=depth, to=to)):
        assert host(x).tobytes() == batches[i][0].tobytes()
        assert host(y).tobytes() == batches[i][1].tobytes()
        assert pb.stats()["live_allocations"] <= 2 * (depth + 1)  # bounded: depth + 1 slots of two arrays
        seen += 1
    assert seen == len(batches)
    del x, y
    assert_quiet(pb)


def test_each_structure_comes_back_as_it_went_in(pb, to, rng):
    Pair = collections.namedtuple("Pair", "image label")
    a, c = random_array(rng, (4, 3), "float32"), random_array(rng, 4, "uint8")
    shapes = {
        "array": (a, lambda out: [out]),
        "tuple": ((a, c), lambda out: list(out)),
        "list": ([a, c], lambda out: list(out)),
        "dict": ({"image": a, "label": c}, lambda out: [out["image"], out["label"]]),
        "namedtuple": (Pair(a, c), lambda out: [out.image, out.label]),
    }
    for name, (batch, items) in shapes.items():
        (out,) = list(devbridge.Prefetcher(pb, [batch], to=to))
        assert type(out) is type(batch) or (name == "array" and not isinstance(out, (tuple, list, dict))), name
        if name == "dict":
            assert list(out) == ["image", "label"]
        expected = [a] if name == "array" else [a, c]
        for got, want in zip(items(out), expected):
            assert host(got).tobytes() == want.tobytes() and tuple(got.shape) == want.shape
        del out, got
    assert_quiet(pb)


def test_device_tensors_are_ready_and_views_of_them_work(pb, rng):
    batches = [random_array(rng, (16, 16), "float32") for _ in range(4)]
    for i, x in enumerate(devbridge.Prefetcher(pb, batches, to="device")):
        assert isinstance(x, devbridge.DeviceTensor) and x.ready()
        assert x.shape == (16, 16) and x.dtype == "float32"
        with x.view() as view:
            assert view.shape == (16, 16)
            if view.device == "CPU":
                assert np.from_dlpack(view).tobytes() == batches[i].tobytes()
        assert x.numpy().tobytes() == batches[i].tobytes()
    del x
    assert_quiet(pb)


def test_batches_larger_than_the_ring_are_chunked(pb, to, rng):
    batches = [random_array(rng, (3 * RING // 4,), "float32") for _ in range(3)]  # 3 MiB each, 1 MiB ring
    for i, x in enumerate(devbridge.Prefetcher(pb, batches, depth=2, to=to)):
        assert host(x).tobytes() == batches[i].tobytes()
    del x
    assert_quiet(pb)


def test_slots_are_reused_until_a_batch_needs_more_room(pb, rng):
    sizes = [64, 64, 64, 64, 40, 40, 100, 100, 100, 100]  # smaller: reused; larger: reallocated
    batches = [random_array(rng, n, "float32") for n in sizes]
    handles = set()
    for i, x in enumerate(devbridge.Prefetcher(pb, batches, depth=1, to="device")):
        assert x.shape == (sizes[i],) and host(x).tobytes() == batches[i].tobytes()
        handles.add(x.handle)
        assert pb.stats()["live_allocations"] <= 2
    del x
    assert len(handles) <= 4  # two slots, each reallocated at most once (for the 100-element batches)
    assert_quiet(pb)


def test_a_dtype_change_reallocates(pb, to, rng):
    require_dtype(pb, "float16")
    batches = [random_array(rng, 32, "float32"), random_array(rng, 32, "int32"), random_array(rng, 32, "float16")]
    for i, x in enumerate(devbridge.Prefetcher(pb, batches, depth=1, to=to)):
        got = host(x)
        assert got.dtype == batches[i].dtype and got.tobytes() == batches[i].tobytes()
    del x, got
    assert_quiet(pb)


def test_an_empty_source_allocates_nothing(pb, to):
    assert list(devbridge.Prefetcher(pb, [], to=to)) == []
    assert list(devbridge.Prefetcher(pb, iter(()), to=to)) == []
    assert_quiet(pb)


# ----------------------------------------------------------------------------- overlap and ordering


def h2d_calls(b: devbridge.Bridge) -> int:
    return sum(1 for call in b.fake.calls() if call["call"] == "copy_h2d")


def test_the_next_batches_are_issued_before_the_consumer_asks(fake, rng):
    batches = [random_array(rng, 64, "float32") for _ in range(8)]  # one chunk each: one copy per batch
    it = devbridge.Prefetcher(fake, batches, depth=2, to="device")
    x = next(it)
    assert h2d_calls(fake) == 3  # batch 0, and 1..2 ahead (depth + 1 slots, none held yet)
    x = next(it)  # batch 0 is still held (by x) while batch 1 is handed out
    assert h2d_calls(fake) == 3 and host(x).tobytes() == batches[1].tobytes()
    del x  # the consumer lets go before asking: both slots it held are refilled
    x = next(it)
    assert h2d_calls(fake) == 5 and host(x).tobytes() == batches[2].tobytes()
    assert int(fake.stats()["live_allocations"]) == 3
    it.close()
    del x
    assert_quiet(fake)


def test_a_batch_is_handed_out_only_once_its_copies_completed():
    b = _bridge("fake", auto_complete=False)
    data = np.arange(64, dtype=np.float32)
    it = devbridge.Prefetcher(b, [data], depth=1, to="device", timeout=60)
    completer = threading.Timer(0.2, b.fake.complete_all)
    completer.start()
    try:
        x = next(it)  # waits (the bridge's wait drops the GIL) until the copy completes
    finally:
        completer.join()
    assert all(b.copy_status(event) == "completed" for event, _, _ in x._events)
    b.fake.set_auto_complete(True)  # for the download that reads it back
    assert host(x).tobytes() == data.tobytes()
    del x
    it.close()
    assert_quiet(b)
    b.close()


# ----------------------------------------------------------------------------------- producer errors


@pytest.mark.parametrize("failure", ["copy_failed_at_submit", "copy_failed_at_completion"])
@pytest.mark.parametrize("to_", ["device", "tinygrad"])
def test_a_failed_upload_surfaces_at_its_batch_and_leaks_nothing(fake, rng, failure, to_):
    if to_ == "tinygrad":
        pytest.importorskip("tinygrad")
    batches = make_batches(rng, 8)
    # Two single-chunk copies per batch: the 8th copy is batch 3's second array ("item 1").
    fake.fake.inject("copy_h2d", failure, nth=8)
    got = []
    with pytest.raises(devbridge.DeviceCopyFailed) as caught:
        for x, y in devbridge.Prefetcher(fake, batches, depth=2, to=to_):
            got.append(host(x).tobytes())
    assert got == [batches[i][0].tobytes() for i in range(3)]  # the batches before it, intact
    error = caught.value
    assert "Prefetcher batch 3 (item 1)" in str(error) and error.batch_index == 3
    assert isinstance(error.__cause__, devbridge.DeviceCopyFailed)
    del x, y, caught, error
    assert_quiet(fake)


def test_after_a_producer_error_the_iteration_ends(fake, rng):
    fake.fake.inject("copy_h2d", "copy_failed_at_submit", nth=2)
    it = devbridge.Prefetcher(fake, [random_array(rng, 16, "float32") for _ in range(5)], depth=1, to="device")
    x = next(it)
    with pytest.raises(devbridge.DeviceCopyFailed, match="Prefetcher batch 1"):
        next(it)
    assert it.closed
    with pytest.raises(StopIteration):
        next(it)
    del x
    assert_quiet(fake)


def test_a_failed_allocation_names_its_batch(fake, rng):
    fake.fake.inject("allocate", "allocation_failed", nth=3)  # one allocation per slot: slot 2, batch 2
    fake.fake.inject("allocate", "allocation_failed", nth=4)  # and the bridge's one retry
    it = devbridge.Prefetcher(fake, [random_array(rng, 16, "float32") for _ in range(5)], depth=2, to="device")
    assert [host(x).size for x in (next(it), next(it))] == [16, 16]
    with pytest.raises(devbridge.AllocationFailed, match="Prefetcher batch 2") as caught:
        next(it)
    assert caught.value.batch_index == 2
    del caught
    assert_quiet(fake)


def test_a_source_error_is_raised_at_its_batch_after_the_ones_before(pb, to, rng):
    closed = []

    def source():
        try:
            for i in range(5):
                if i == 3:
                    raise KeyError("record 3 is missing")
                yield random_array(rng, 8, "float32")
        finally:
            closed.append(True)

    got = 0
    with pytest.raises(KeyError, match="Prefetcher batch 3") as caught:
        for _ in devbridge.Prefetcher(pb, source(), depth=3, to=to):
            got += 1
    assert got == 3 and caught.value.batch_index == 3
    assert isinstance(caught.value.__cause__, KeyError) and closed == [True]
    del _, caught
    assert_quiet(pb)


def test_a_batch_that_cannot_be_staged_names_its_batch_and_item(pb, to, rng):
    a = random_array(rng, (8, 8), "float32")
    batches = [{"x": a, "y": a[0]}, {"x": a[:, ::2], "y": a[0]}]  # batch 1's "x" is not contiguous
    it = devbridge.Prefetcher(pb, batches, to=to)
    first = next(it)
    with pytest.raises(ValueError, match=r"Prefetcher batch 1 \(key 'x'\).*C-contiguous"):
        next(it)
    with pytest.raises(TypeError, match="Prefetcher batch 0 \\(item 1\\)"):
        next(devbridge.Prefetcher(pb, [(a, [1.0, 2.0])], to=to))
    with pytest.raises(ValueError, match="Prefetcher batch 0.*empty"):
        next(devbridge.Prefetcher(pb, [np.zeros((4, 0), np.float32)], to=to))
    with pytest.raises(ValueError, match="Prefetcher batch 0: .*empty tuple"):
        next(devbridge.Prefetcher(pb, [()], to=to))
    del first
    assert_quiet(pb)


def test_tinygrad_refused_for_a_device_it_cannot_wrap_names_the_batch(rng):
    pytest.importorskip("tinygrad")
    b = _bridge("opencl")
    try:
        with pytest.raises(devbridge.Unsupported, match=r'Prefetcher batch 0.*bridge\.download.*to="device"'):
            next(devbridge.Prefetcher(b, [random_array(rng, 8, "float32")], to="tinygrad"))
        assert_quiet(b)
    finally:
        b.close()


# ------------------------------------------------------------------------------------------ early exit


def test_break_releases_everything(pb, to, rng):
    closed = []

    def source():
        try:
            for _ in range(100):
                yield make_batches(rng, 1)[0]
        finally:
            closed.append(True)

    for i, (x, y) in enumerate(devbridge.Prefetcher(pb, source(), depth=3, to=to)):
        if i == 2:
            break
    # The iterator was the for loop's alone: gone now, and closed (the generator with it).
    gc.collect()
    assert closed == [True]
    assert host(x).shape == (8, 5)  # what the consumer still holds stays valid
    del x, y
    assert_quiet(pb)


def test_close_and_del_mid_iteration_release_everything(pb, to, rng):
    batches = make_batches(rng, 10)
    it = devbridge.Prefetcher(pb, batches, depth=3, to=to)
    x, _ = next(it)
    it.close()
    it.close()  # idempotent
    with pytest.raises(StopIteration):
        next(it)
    assert host(x).tobytes() == batches[0][0].tobytes()
    del x, _
    assert_quiet(pb)

    it = devbridge.Prefetcher(pb, batches, depth=2, to=to)
    next(it)
    next(it)
    del it  # garbage: closes itself
    assert_quiet(pb)

    with devbridge.Prefetcher(pb, batches, depth=2, to=to) as it:
        for i, _ in enumerate(it):
            if i == 4:
                break
    assert it.closed
    del _
    assert_quiet(pb)


def test_a_device_tensor_kept_after_close_owns_its_allocation(pb, rng):
    batches = [random_array(rng, 32, "float32") for _ in range(4)]
    it = devbridge.Prefetcher(pb, batches, depth=2, to="device")
    x = next(it)
    it.close()
    assert pb.stats()["live_allocations"] == 1  # x's; the other slots are freed
    assert host(x).tobytes() == batches[0].tobytes()
    x.free()
    assert pb.stats()["live_allocations"] == 0
    with pytest.raises(devbridge.Closed):
        x.numpy()
    del x
    assert_quiet(pb)


def test_close_waits_for_copies_in_flight():
    b = _bridge("fake", auto_complete=False)
    it = devbridge.Prefetcher(b, [np.arange(64, dtype=np.float32)] * 4, depth=2, to="device", timeout=60)
    completer = threading.Timer(0.1, b.fake.complete_all)
    completer.start()
    x = next(it)  # batches 0..2 issued, and completed by the timer
    completer.join()
    del x
    x = next(it)  # batch 3 goes into batch 0's slot, and stays in flight
    assert len(b.fake.pending()) == 1
    completer = threading.Timer(0.1, b.fake.complete_all)
    completer.start()
    it.close()  # waits for it before freeing the slot
    completer.join()
    del x
    assert_quiet(b)
    b.close()


def test_the_bridge_closing_first_is_survived(rng):
    b = _bridge("host")
    it = devbridge.Prefetcher(b, make_batches(rng, 6), to="device")
    next(it)
    b.close()
    it.close()  # nothing to release any more, and no error


def test_next_after_the_bridge_closed_raises_closed_naming_the_batch(rng):
    b = _bridge("host")
    ended = []

    def source():
        try:
            yield from make_batches(rng, 6)
        finally:
            ended.append(True)

    it = devbridge.Prefetcher(b, source(), to="device")
    x = next(it)
    b.close()
    closed = r"Prefetcher batch 1: the bridge is closed \(bridge.close\(\)\)"
    with pytest.raises(devbridge.Closed, match=closed) as caught:
        next(it)
    assert caught.value.batch_index == 1 and it.closed and ended == [True]
    with pytest.raises(StopIteration):
        next(it)
    del x


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_closing_the_bridge_ends_a_wait_for_a_slot_with_closed(pb, timeout):
    # A consumer thread keeps every batch, so the Prefetcher waits for a slot; the bridge closes meanwhile. Before,
    # the wait ignored it: without a timeout the thread never ended; with one it raised AllocationStillInUse ("let
    # go of what you keep") when it ran out.
    kept, outcome = [], {}

    def consume():
        try:
            source = (np.full(64, i, np.float32) for i in range(100))
            for x in devbridge.Prefetcher(pb, source, depth=1, to="device", timeout=timeout):
                kept.append(x)
        except BaseException as error:  # noqa: BLE001 - what the thread ended with, for the test to see
            outcome["error"] = error
        outcome["at"] = time.monotonic()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the retirement notice
        thread = threading.Thread(target=consume, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while len(kept) < 4 and time.monotonic() < deadline:  # depth + 1 slots, as many retired: then it waits
            time.sleep(0.01)
        time.sleep(0.2)
        assert len(kept) == 4 and thread.is_alive(), outcome
        closed_at = time.monotonic()
        pb.close()
        thread.join(5)
    assert not thread.is_alive(), "the wait for a slot ignored bridge.close()"
    error = outcome["error"]
    assert isinstance(error, devbridge.Closed), repr(error)
    assert error.batch_index == 4 and "Prefetcher batch 4: the bridge is closed" in str(error)
    assert outcome["at"] - closed_at < 1.0
    del kept


# ----------------------------------------------------------------------------------------- restart


@pytest.mark.parametrize("depth", [1, 2])
def test_a_restart_mid_loop_stages_the_pulled_batches_again_and_the_loop_goes_on(pb, to, rng, depth):
    # Before, the next batch raised OldGenerationHandle ("upload chunk 0 ... copy event ... is from generation 1"),
    # the Prefetcher closed the source, and the batches it had pulled were lost.
    batches = make_batches(rng, 10)
    pulled, ended = [], []

    def source():
        try:
            for i, batch in enumerate(batches):
                pulled.append(i)
                yield batch
        finally:
            ended.append(len(pulled))

    got = []
    for i, (x, y) in enumerate(devbridge.Prefetcher(pb, source(), depth=depth, to=to)):
        got.append((host(x).tobytes(), host(y).tobytes()))
        if i == 3:
            pb.restart(pb.generation + 1)
    assert got == [(a.tobytes(), b.tobytes()) for a, b in batches], "a batch lost, repeated or out of order"
    assert pulled == list(range(10)), "each batch asked of the source once"
    assert ended == [10], "the source was closed before its end"
    del x, y
    assert_quiet(pb)


def holding_every_slot(pb, source, timeout: float, to: str = "device"):
    """A depth-1 Prefetcher over ``source`` whose consumer keeps its first four batches: every slot held, and as
    many retired as may be (the RuntimeWarning checked). Returns the Prefetcher and the kept batches."""
    it = devbridge.Prefetcher(pb, source, depth=1, to=to, timeout=timeout)
    with pytest.warns(RuntimeWarning, match="retired"):
        kept = [next(it) for _ in range(4)]
    return it, kept


def test_a_restart_while_waiting_for_a_slot_ends_the_wait(pb, rng):
    # Every slot is held by the consumer; a restart (another thread) retires them all: fresh slots take the batch.
    batches = [random_array(rng, 32, "float32") for _ in range(6)]
    it, kept = holding_every_slot(pb, batches, timeout=5.0)
    restarter = threading.Timer(0.2, lambda: pb.restart(pb.generation + 1))
    restarter.start()
    start = time.monotonic()
    x = next(it)
    restarter.join()
    assert time.monotonic() - start < 4.0, "waited out the timeout"
    assert host(x).tobytes() == batches[4].tobytes()
    assert [host(t).tobytes() for t in it] == [batches[5].tobytes()]
    del kept, x
    assert_quiet(pb)


def test_a_staging_failure_of_the_old_generation_is_staged_again_after_a_restart(fake, rng):
    batches = [random_array(rng, 16, "float32") for _ in range(6)]
    fake.fake.inject("copy_h2d", "copy_failed_at_submit", nth=3)  # batch 2, staged ahead with batch 0 and 1
    it = devbridge.Prefetcher(fake, batches, depth=2, to="device")
    got = [host(next(it)).tobytes()]
    fake.restart(fake.generation + 1)  # the failure was the old generation's: batch 2 is staged again
    got += [host(x).tobytes() for x in it]
    assert got == [a.tobytes() for a in batches]
    assert_quiet(fake)


def test_a_source_error_is_still_raised_at_its_batch_after_a_restart(pb, rng):
    batches = [random_array(rng, 16, "float32") for _ in range(3)]

    def source():
        yield from batches
        raise KeyError("record 3 is missing")

    it = devbridge.Prefetcher(pb, source(), depth=4, to="device")
    got = [host(next(it)).tobytes()]  # batches 1 and 2 are staged, the source's error waits after them
    pb.restart(pb.generation + 1)
    with pytest.raises(KeyError, match="Prefetcher batch 3") as caught:
        for x in it:
            got.append(host(x).tobytes())
    assert got == [a.tobytes() for a in batches] and caught.value.batch_index == 3
    del caught, x
    assert_quiet(pb)


# ---------------------------------------------------------------------- a consumer that holds its batches


def test_a_batch_kept_for_good_is_retired_and_the_loop_goes_on(pb, to, rng):
    # What TinyJit does to its capture call's batch: a consumer keeps one batch for good. Before, depth=1
    # stalled at the next batch and raised AllocationStillInUse telling the user to drop what they cannot.
    batches = make_batches(rng, 6)
    it = devbridge.Prefetcher(pb, batches, depth=1, to=to, timeout=0.05)
    pinned = None
    with pytest.warns(RuntimeWarning, match=r"batch 0's .*TinyJit keeps the batch of its capture call") as caught:
        for i, (x, y) in enumerate(it):
            assert host(x).tobytes() == batches[i][0].tobytes() and host(y).tobytes() == batches[i][1].tobytes()
            if i == 0:
                pinned = x
            elif i >= 2:  # batch 1 came from the slot staged beside batch 0's; batch 2 needed a fresh one
                assert it.retired == 1 and "1 retired" in repr(it)  # one slot left to its holder, no more
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1, "said once"
    assert host(pinned).tobytes() == batches[0][0].tobytes(), "a retired slot is never written again"
    del x, y, pinned, caught
    assert it.retired == 0
    assert_quiet(pb)  # the retired slot was freed once its holder let go


def test_retired_slots_are_capped_then_it_times_out_naming_the_batch(pb, to, rng):
    batches = make_batches(rng, 6)
    it = devbridge.Prefetcher(pb, batches, depth=1, to=to, timeout=0.05)
    with pytest.warns(RuntimeWarning, match="retired"):
        kept = [next(it) for _ in range(4)]      # batches 0 and 1 retired: the cap (depth + 1) is reached
    assert it.retired == 2
    with pytest.raises(devbridge.AllocationStillInUse,
                       match=r"Prefetcher batch 4: .*batch 2: .*2 more slots are retired.*\(0, 1\): at most 2") as caught:
        next(it)
    assert ("tinygrad tensors" if to == "tinygrad" else "DeviceTensors") in str(caught.value)
    assert "TinyJit" in str(caught.value) and "drop what you keep" in str(caught.value)
    del caught
    kept.pop(0)  # letting go of a retired batch is enough to go on: another can be retired
    x, _ = next(it)
    assert host(x).tobytes() == batches[4][0].tobytes()
    for k, (x, _) in enumerate(kept):
        assert host(x).tobytes() == batches[k + 1][0].tobytes(), "no kept batch was overwritten"
    it.close()
    del kept, x, _
    assert_quiet(pb)


def test_another_thread_letting_go_unblocks_the_wait(pb, rng):
    batches = [random_array(rng, 32, "float32") for _ in range(6)]
    it, kept = holding_every_slot(pb, batches, timeout=60)
    threading.Timer(0.1, kept.clear).start()
    x = next(it)
    assert host(x).tobytes() == batches[4].tobytes()
    it.close()
    del x
    assert_quiet(pb)


def keep_behind_its_back(b: devbridge.Bridge, x: devbridge.DeviceTensor):
    """A view of x that only the bridge knows of: a DLPack array where numpy can take one, else a TensorView.
    Returns it, what the bridge calls its holder, and a function reading the bytes under it."""
    view = x.view()
    handle, dtype, shape = x.handle, x.dtype, x.shape  # not x itself: the caller's x is all that holds it
    read = lambda: b.download(handle, dtype=dtype, shape=shape).tobytes()  # noqa: E731
    if view.device == "CPU":
        array = np.from_dlpack(view)
        view.close()
        return array, "DLPack consumer", read
    return view, "held by the caller", read


def test_a_view_the_consumer_keeps_is_never_overwritten(pb, rng):
    batches = [random_array(rng, 64, "float32") for _ in range(8)]
    it = devbridge.Prefetcher(pb, batches, depth=2, to="device")
    kept, _, read = keep_behind_its_back(pb, next(it))  # the DeviceTensor itself is gone
    for i, x in enumerate(it, start=1):
        assert host(x).tobytes() == batches[i].tobytes()
        assert read() == batches[0].tobytes()  # while the Prefetcher runs (it releases the handle at the end)
    if isinstance(kept, np.ndarray):
        assert kept.tobytes() == batches[0].tobytes()  # and after: the memory stays the array's
    del x, kept
    assert_quiet(pb)


@pytest.mark.parametrize("depth", [1, 2])
def test_views_kept_of_every_batch_retire_slots_as_device_tensors_do(pb, rng, depth):
    # [numpy.from_dlpack(x) for x in Prefetcher(...)]: only the bridge sees such a holder (it refuses to upload
    # under the view). Before, those slots were never retired: AllocationStillInUse at batch depth + 1, against
    # "list(Prefetcher(...)) works for 2 * (depth + 1) batches" (docs/PYTHON.md).
    batches = [random_array(rng, 64, "float32") for _ in range(2 * (depth + 1))]
    it = devbridge.Prefetcher(pb, batches, depth=depth, to="device", timeout=5.0)
    kept = []
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"batch 0's views \(DLPack arrays or TensorViews"):
        for i, x in enumerate(it):
            assert host(x).tobytes() == batches[i].tobytes()
            kept.append(keep_behind_its_back(pb, x))
            assert [read() for _, _, read in kept] == [a.tobytes() for a in batches[:i + 1]], "overwritten"
    assert time.monotonic() - start < 2.5, "waited for a slot"
    assert it.closed
    for (view, _, _), a in zip(kept, batches):
        if isinstance(view, np.ndarray):
            assert view.tobytes() == a.tobytes()  # after close too: the memory stays the array's
    del x, kept, view
    assert_quiet(pb)


def test_hidden_holders_are_named_once_every_slot_and_retired_slot_is_held(pb, rng):
    batches = [random_array(rng, 64, "float32") for _ in range(6)]
    it = devbridge.Prefetcher(pb, batches, depth=1, to="device", timeout=0.05)
    kept = []
    with pytest.warns(RuntimeWarning, match="retired"):
        for _ in range(4):  # depth + 1 slots, and as many retired ones
            kept.append(keep_behind_its_back(pb, next(it)))
    assert it.retired == 2
    holder = kept[0][1]
    with pytest.raises(devbridge.AllocationStillInUse,
                       match=f"Prefetcher batch 4: .*batch 2: the bridge refused .*{holder}.*2 more slots are retired"
                             r".*\(0, 1\)") as caught:
        next(it)
    del caught
    assert [read() for _, _, read in kept] == [a.tobytes() for a in batches[:4]]
    kept.pop(0)  # the view of batch 0 goes: its retired slot is freed, and another can be retired
    assert it.retired == 1
    assert host(next(it)).tobytes() == batches[4].tobytes()
    assert [read() for _, _, read in kept] == [a.tobytes() for a in batches[1:4]]
    it.close()
    del kept
    assert_quiet(pb)


def test_a_view_of_one_array_of_a_batch_is_seen_too(pb, rng):
    # Only the batch's second array is kept (a DLPack array of y): the bridge refuses the upload at it, after the
    # first array was staged. Before, that was a producer error ("Prefetcher batch 2 (item 1)") ending the loop.
    batches = make_batches(rng, 6, shape=(16, 4))
    it = devbridge.Prefetcher(pb, batches, depth=1, to="device", timeout=5.0)
    kept = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the retirement notice
        for i, (x, y) in enumerate(it):
            assert host(x).tobytes() == batches[i][0].tobytes() and host(y).tobytes() == batches[i][1].tobytes()
            if i < 2:
                kept.append(keep_behind_its_back(pb, y))
            assert [read() for _, _, read in kept] == [batches[k][1].tobytes() for k in range(len(kept))]
    del x, y, kept
    assert_quiet(pb)


def test_a_device_tensor_freed_by_the_consumer_frees_its_slot(pb, rng):
    batches = [random_array(rng, 32, "float32") for _ in range(5)]
    it = devbridge.Prefetcher(pb, batches, depth=1, to="device", timeout=30)
    kept = []
    for i, x in enumerate(it):
        assert host(x).tobytes() == batches[i].tobytes()
        kept.append(x)
        x.free()  # done with it, though still referenced
    assert all(k.freed for k in kept)
    del kept, x
    assert_quiet(pb)


@pytest.mark.parametrize("depth", [1, 2])
def test_list_of_as_many_batches_as_slots_and_retired_slots_ends_at_once(pb, to, rng, depth):
    # list() keeps every batch: depth + 1 slots, then depth + 1 retired ones, hold 2 * (depth + 1) batches
    # (docs/PYTHON.md). At the source's end next() used to wait for a slot first, for a batch that does not
    # exist: the whole timeout, then AllocationStillInUse "no device slot came free".
    batches = [random_array(rng, 64, "float32") for _ in range(2 * (depth + 1))]
    timeout = 5.0
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the retirement notice
        out = list(devbridge.Prefetcher(pb, batches, depth=depth, to=to, timeout=timeout))
    assert time.monotonic() - start < timeout / 2, "the end of the source waited for a slot"
    assert [host(x).tobytes() for x in out] == [a.tobytes() for a in batches]
    del out
    assert_quiet(pb)


def test_the_batch_pulled_before_waiting_for_a_slot_is_kept_for_the_next_attempt(pb, rng):
    batches = [random_array(rng, 32, "float32") for _ in range(6)]
    pulled = []

    def source():
        for i, a in enumerate(batches):
            pulled.append(i)
            yield a

    it, kept = holding_every_slot(pb, source(), timeout=0.05)
    with pytest.raises(devbridge.AllocationStillInUse, match="Prefetcher batch 4: no device slot") as caught:
        next(it)
    del caught
    assert pulled == [0, 1, 2, 3, 4], "batch 4 was asked for before the wait, once"
    with pytest.raises(devbridge.AllocationStillInUse, match="Prefetcher batch 4: "):
        next(it)  # still batch 4: the batch pulled waits for a slot, however many attempts that takes
    assert pulled == [0, 1, 2, 3, 4]
    kept.clear()
    rest = list(it)
    assert [host(x).tobytes() for x in rest] == [a.tobytes() for a in batches[4:]], "no batch lost or repeated"
    assert pulled == list(range(6))
    del rest
    assert_quiet(pb)


def test_a_source_error_after_every_slot_is_held_is_raised_at_once(pb, rng):
    def source():
        for _ in range(4):
            yield random_array(rng, 32, "float32")
        raise KeyError("record 4 is missing")

    it, kept = holding_every_slot(pb, source(), timeout=5.0)
    start = time.monotonic()
    with pytest.raises(KeyError, match="Prefetcher batch 4") as caught:
        next(it)
    assert time.monotonic() - start < 2.5, "the source's error waited for a slot"
    assert caught.value.batch_index == 4 and it.closed
    del caught, kept
    assert_quiet(pb)


# ------------------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize("depth", ["2", 2.0, None, True, np.float32(2)])
def test_depth_must_be_an_int(fake, depth):
    with pytest.raises(TypeError, match="depth"):
        devbridge.Prefetcher(fake, [], depth=depth)


@pytest.mark.parametrize("depth", [0, -1, -2**70])
def test_depth_must_be_at_least_one(fake, depth):
    with pytest.raises(ValueError, match="depth"):
        devbridge.Prefetcher(fake, [], depth=depth)


def test_numpy_ints_are_depths(fake, rng):
    assert devbridge.Prefetcher(fake, [], depth=np.int64(3)).depth == 3


@pytest.mark.parametrize("timeout, error", [(-1, ValueError), (-1e-9, ValueError), (math.nan, ValueError),
                                            ("1", TypeError), (True, TypeError), ([1], TypeError)])
def test_timeouts_are_non_negative_numbers(fake, timeout, error):
    with pytest.raises(error, match="timeout"):
        devbridge.Prefetcher(fake, [], timeout=timeout)


@pytest.mark.parametrize("timeout", [0, 0.5, 10**400, math.inf, None])
def test_timeouts_that_are_accepted(fake, timeout):
    devbridge.Prefetcher(fake, [], timeout=timeout).close()


def test_other_arguments_are_checked(fake):
    with pytest.raises(TypeError, match="bridge"):
        devbridge.Prefetcher("host", [])
    with pytest.raises(TypeError):
        devbridge.Prefetcher(fake, 3)  # not iterable
    with pytest.raises(ValueError, match="to"):
        devbridge.Prefetcher(fake, [], to="cpu")
    with pytest.raises(TypeError, match="to"):
        devbridge.Prefetcher(fake, [], to=None)
    with pytest.raises(devbridge.InvalidAlignment):
        devbridge.Prefetcher(fake, [], alignment=3)
    with pytest.raises(TypeError):
        devbridge.Prefetcher(fake, [], alignment="256")
    assert_quiet(fake)


def test_repr_says_where_it_is(fake, rng):
    it = devbridge.Prefetcher(fake, make_batches(rng, 3), depth=2, to="device")
    next(it)
    assert "depth=2" in repr(it) and "1 batches handed out" in repr(it)
    it.close()
    assert "closed" in repr(it)
    assert_quiet(fake)
