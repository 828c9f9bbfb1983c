"""Regressions of issue 10 on the Python side: timeouts (defect 4), close() (defect 3), log lines.

Each test here failed on 55e61ea. The argument types of defect 8 are in test_boundaries.py.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

import devbridge
from conftest import collect, random_array, upload

U8 = devbridge.ObjectSpec(max_extent=1 << 20, alignment=64, dtype="uint8")
PROMPTLY = 10.0  # seconds a woken thread may take to finish (a loaded CI machine); a hang never finishes
STILL_BLOCKED = 0.3  # seconds a thread must still be blocked after, to show it did not return at once


class Worker(threading.Thread):
    """Runs `call` in a daemon thread (a hang must not keep pytest alive); keeps its result or exception."""

    def __init__(self, call):
        super().__init__(daemon=True)
        self.call = call
        self.started_call = threading.Event()
        self.result = None
        self.error: BaseException | None = None
        self.finished_at: float | None = None

    def run(self):
        self.started_call.set()
        try:
            self.result = self.call()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.error = error
        self.finished_at = time.monotonic()

    def begin(self) -> "Worker":
        self.start()
        assert self.started_call.wait(PROMPTLY)
        return self

    def assert_blocked(self):
        self.join(STILL_BLOCKED)
        assert self.is_alive(), f"returned at once: result {self.result!r}, error {self.error!r}"

    def finish(self):
        self.join(PROMPTLY)
        assert not self.is_alive(), "still blocked: never woken"


def fake_bridge(**options) -> devbridge.Bridge:
    return devbridge.Bridge(backend="fake", ring_bytes=1 << 20, **options)


# ---- defect 4: huge and infinite timeouts wait until done ----------------------------------------------

@pytest.mark.parametrize("timeout", [math.inf, 1e10, 2**63, 2**64, 10**400, 1e300])
def test_a_huge_or_infinite_wait_timeout_waits_until_done(timeout, rng):
    b = fake_bridge()
    h = b.alloc(U8, 4096)
    r = b.ring.reserve(4096)
    event = b.host_to_device(r, h)
    worker = Worker(lambda: b.wait(event, timeout=timeout)).begin()
    worker.assert_blocked()  # 55e61ea: "pending" at once
    assert b.fake.complete(event)
    worker.finish()
    assert worker.error is None and worker.result == "completed"
    b.ring.release(r)
    b.close()


@pytest.mark.parametrize("wait_for_room", [math.inf, 1e10, 2**64])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_a_huge_or_infinite_wait_for_room_waits_for_room(wait_for_room, direction, rng):
    b = fake_bridge(inflight_bytes=4096)
    h = b.alloc(U8, 8192)
    first, second = b.ring.reserve(4096), b.ring.reserve(4096)
    in_flight = b.host_to_device(first, h)  # fills the whole budget
    if direction == "h2d":
        worker = Worker(lambda: b.host_to_device(second, h, 4096, wait_for_room=wait_for_room)).begin()
    else:
        worker = Worker(lambda: b.device_to_host(h, second, 4096, wait_for_room=wait_for_room)).begin()
    worker.assert_blocked()  # 55e61ea: Backpressure at once (1e10), ValueError (inf)
    assert b.fake.complete(in_flight)
    worker.finish()
    assert worker.error is None, worker.error
    event = worker.result
    assert isinstance(event, devbridge.CopyEvent)
    b.fake.complete_all()
    assert b.wait(event) == "completed"
    b.ring.release(first)
    b.ring.release(second)
    b.close()


def test_a_short_wait_for_room_still_raises_backpressure():
    b = fake_bridge(inflight_bytes=4096)
    h = b.alloc(U8, 8192)
    first, second = b.ring.reserve(4096), b.ring.reserve(4096)
    b.host_to_device(first, h)
    started = time.monotonic()
    with pytest.raises(devbridge.Backpressure):
        b.host_to_device(second, h, 4096, wait_for_room=0.05)
    assert time.monotonic() - started >= 0.04
    with pytest.raises(devbridge.Backpressure):
        b.host_to_device(second, h, 4096)  # 0: fail fast
    b.fake.complete_all()
    b.close()


@pytest.mark.parametrize("bad, error", [(math.nan, ValueError), (-1, ValueError), (-math.inf, ValueError),
                                        ("1", TypeError), ([], TypeError)])
def test_bad_timeouts_are_usage_errors(bad, error):
    b = fake_bridge()
    b.fake.set_auto_complete(True)
    h = b.alloc(U8, 4096)
    r = b.ring.reserve(64)
    event = b.host_to_device(r, h)
    with pytest.raises(error):
        b.wait(event, timeout=bad)
    with pytest.raises(error):
        b.host_to_device(r, h, wait_for_room=bad)
    assert b.wait(event, timeout=None) == "completed"
    b.ring.release(r)
    b.close()


# ---- defect 3: close() wakes every blocked caller -------------------------------------------------------

def test_close_wakes_a_blocked_wait_while_ring_memory_is_exported(rng):
    b = fake_bridge()
    h = b.alloc(U8, 4096)
    exported = b.ring.reserve(4096)
    array = b.ring.ndarray(exported, "uint8")  # an export: 55e61ea deferred the close for it
    data = random_array(rng, 4096, "uint8")
    array[:] = data
    r = b.ring.reserve(4096)
    event = b.host_to_device(r, h)  # stays pending: the test never completes it
    worker = Worker(lambda: b.wait(event)).begin()
    worker.assert_blocked()
    b.close()
    worker.finish()  # 55e61ea: blocked forever
    assert isinstance(worker.error, devbridge.Closed), worker.error
    # The exported ring memory stays valid, readable and writable, until numpy lets go of it.
    assert np.array_equal(array, data)
    array[:] = 7
    assert (array == 7).all()
    with pytest.raises(devbridge.Closed):
        b.wait(event)


def test_close_wakes_a_blocked_wait_for_room():
    b = fake_bridge(inflight_bytes=4096)
    h = b.alloc(U8, 8192)
    first, second = b.ring.reserve(4096), b.ring.reserve(4096)
    keep = b.ring.ndarray(first)  # an export
    b.host_to_device(first, h)
    worker = Worker(lambda: b.host_to_device(second, h, 4096, wait_for_room=math.inf)).begin()
    worker.assert_blocked()
    b.close()
    worker.finish()
    assert isinstance(worker.error, devbridge.Closed), worker.error
    del keep


def test_close_wakes_a_view_waiting_for_an_upload_on_the_fake_backend():
    b = fake_bridge()
    h = b.alloc(U8, 4096)
    r = b.ring.reserve(4096)
    keep = b.ring.ndarray(r)  # an export
    b.host_to_device(r, h)  # pending until completed, which the test never does
    worker = Worker(lambda: b.view(h, "uint8", 4096, wait=True)).begin()
    worker.assert_blocked()
    b.close()
    worker.finish()  # 55e61ea: blocked forever
    assert isinstance(worker.error, devbridge.Closed), worker.error
    assert worker.result is None
    del keep


def test_close_wakes_a_view_waiting_for_uploads_on_the_host_backend(rng):
    """No view is created after close(): the waiting view raises Closed instead."""
    chunk = 32 << 20
    b = devbridge.Bridge(backend="host", ring_bytes=chunk, inflight_bytes=1 << 40)
    h = b.alloc(devbridge.ObjectSpec(chunk, 64, "uint8"), chunk)
    r = b.ring.reserve(chunk)
    keep = b.ring.ndarray(r)  # an export: 55e61ea deferred the close for it
    keep[:] = 1
    # Enough copy work queued that the view is still waiting when close() runs (GiBs of memcpy).
    events = [b.host_to_device(r, h) for _ in range(64)]
    worker = Worker(lambda: b.view(h, "uint8", chunk, wait=True)).begin()
    time.sleep(0.05)
    pending_before_close = b.copy_status(events[-1]) == "pending"
    b.close()
    closed_at = time.monotonic()
    worker.finish()
    if not pending_before_close:
        pytest.skip("the host copied 2 GiB before close() ran; nothing was left to wait for")
    # 55e61ea: the view was created after close() returned, once the copies ended.
    assert isinstance(worker.error, devbridge.Closed), (worker.result, worker.error)
    assert worker.finished_at is not None and worker.finished_at - closed_at < PROMPTLY
    assert (keep == 1).all()  # still valid memory
    del keep


def test_close_wakes_a_waiting_dlpack_export():
    b = fake_bridge(writes_under_view="allow")  # the upload goes under the open view
    h = b.alloc(U8, 4096)
    b.fake.set_auto_complete(True)
    view = b.view(h, "uint8", 4096)
    b.fake.set_auto_complete(False)
    r = b.ring.reserve(4096)
    b.host_to_device(r, h)  # __dlpack__ waits for copies into the allocation
    worker = Worker(lambda: view.__dlpack__()).begin()
    worker.assert_blocked()
    b.close()
    worker.finish()
    assert isinstance(worker.error, devbridge.Closed), worker.error
    view.close()


def engine_threads() -> int:
    """The host backend's copy and compute threads alive in this process (named in CopyEngine::kThreadNames,
    src/backends/host/copy_engine.hpp)."""
    import os

    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # ended meanwhile
            pass
    return sum(name in ("devbridge-h2d", "devbridge-d2h", "devbridge-comp") for name in names)


def test_a_closed_host_bridge_holds_no_thread_while_its_object_and_views_live(rng):
    # close() gave back memory but the host backend's three engine threads ran on as long as anything referred
    # to the Bridge (a freed DeviceTensor was enough): ten such bridges held 30 threads.
    before = engine_threads()
    kept = []
    for _ in range(3):
        b = devbridge.Bridge(backend="host")
        data = random_array(rng, 4096, "float32")
        t = b.upload(data, wait=True)
        array = np.from_dlpack(t.view())  # a consumer that outlives the close
        b.close()
        kept.append((b, t, array, data))
    assert engine_threads() == before, "a closed bridge's engine threads still run"
    for b, t, array, data in kept:
        assert np.array_equal(array, data), "memory a consumer holds stays valid after close"
        with pytest.raises(devbridge.Closed):
            b.upload(data)
    kept.clear()
    collect()


def test_exported_memory_stays_valid_after_close_until_its_consumer_lets_go(rng):
    b = fake_bridge()
    fake = b.fake
    fake.set_auto_complete(True)
    r = b.ring.reserve(4096)
    data = random_array(rng, 4096, "uint8")
    arr = b.ring.ndarray(r, "uint8")
    arr[:] = data
    h = b.alloc(U8, 4096)
    upload(b, h, data)
    view = b.view(h, "uint8", 4096)
    view_array = np.from_dlpack(view)
    capsule_array = np.from_dlpack(b.view(h, "uint8", 4096))
    b.close()
    assert b.closed
    assert b.stats()["closed"] and b.stats()["live_views"] >= 2  # introspection stays, as dump_trace does
    assert b.memory_stats()["reserved_bytes"] >= 4096
    with pytest.raises(devbridge.Closed):
        b.ring.ndarray(r)  # no new export once closed
    with pytest.raises(devbridge.Closed):
        view.__dlpack__()
    # The memory numpy points at stays valid (readable and writable) until numpy lets go of it.
    assert np.array_equal(arr, data) and np.array_equal(view_array, data) and np.array_equal(capsule_array, data)
    arr[:] = 3
    view_array[:] = 5
    assert (arr == 3).all() and (capsule_array == 5).all()
    assert fake.live_host_blocks() == 1 and fake.live_allocations() == 1
    del arr
    collect()
    assert fake.live_host_blocks() == 0 and fake.live_allocations() == 1
    view.close()
    del view_array
    collect()
    assert fake.live_allocations() == 1  # capsule_array still holds its lease
    del capsule_array
    collect()
    assert fake.live_allocations() == 0


@pytest.mark.parametrize("backend", ["fake", "host"])
def test_exported_memory_outlives_the_bridge_object_itself(backend):
    """No close() at all: the Bridge is garbage-collected while a ring array, a DLPack array and a view live."""
    b = devbridge.Bridge(backend=backend, ring_bytes=1 << 20)
    if backend == "fake":
        b.fake.set_auto_complete(True)
    h = b.alloc(U8, 4096)
    arr = b.ring.ndarray(b.ring.reserve(4096))
    arr[:] = 9
    view = b.view(h, "uint8", 4096)
    array = np.from_dlpack(b.view(h, "uint8", 4096))
    array[:] = 4
    del b
    collect()
    assert (arr == 9).all() and (array == 4).all()
    arr[:] = 1
    array[:] = 2
    assert view.closed is False
    del arr
    collect()
    view.close()
    del array
    collect()


def test_close_is_idempotent_and_later_calls_raise_closed():
    b = fake_bridge()
    h = b.alloc(U8, 4096)
    b.close()
    b.close()
    for call in (lambda: b.alloc(U8, 64), lambda: b.free(h), lambda: b.ring.reserve(64), b.poll,
                 lambda: b.ring.capacity, lambda: b.view(h, "uint8", 64), lambda: b.restart(2)):
        with pytest.raises(devbridge.Closed):
            call()
    assert b.stats()["closed"]  # what close left is still there to read (abandoned fences, views' memory)


# ---- log lines go to stderr, never stdout ----------------------------------------------------------------

def test_log_lines_go_to_stderr_not_stdout(capfd, rng):
    b = fake_bridge()
    h = b.alloc(U8, 4096)
    r = b.ring.reserve(4096)
    capfd.readouterr()
    # A stale completion (logged as a warning)...
    event = b.host_to_device(r, h)
    b.fake.report_completion(devbridge.CopyEvent(event.domain, event.generation, event.id + 99))
    b.poll()
    assert b.stats()["stale_completions"] == 1
    b.fake.complete(event)
    assert b.wait(event) == "completed"
    # ...and a fatal failure that breaks the bridge (logged as an error).
    b.fake.inject("copy_h2d", "fatal")
    with pytest.raises(devbridge.BridgeError) as caught:
        b.host_to_device(r, h, mode="sync")
    assert caught.value.fatal
    with pytest.raises(devbridge.Broken):
        b.alloc(U8, 64)
    out, err = capfd.readouterr()
    assert out == "", f"log lines on stdout: {out!r}"
    assert "broken" in err.lower() and "completion" in err.lower(), err
    b.restart(2)
    b.close()


def interrupted_by_ctrl_c(blocked) -> float:
    """Runs ``blocked()`` with SIGINT sent shortly after, expects KeyboardInterrupt; the seconds it took."""
    import os
    import signal

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            blocked()
    finally:
        timer.cancel()
    return time.monotonic() - started


@pytest.mark.parametrize("direction", ["upload", "download"])
def test_ctrl_c_ends_a_transfer_waiting_on_a_lost_completion_and_it_takes_nothing_with_it(direction):
    # A copy whose completion never comes (a hung device) holds ring room, or is the copy the transfer waits
    # for: the wait ends with KeyboardInterrupt (any signal handler that raises), not never.
    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 20)
    b.fake.set_auto_complete(True)
    a = np.arange(1024, dtype=np.float32)
    if direction == "upload":
        b.fake.inject("copy_h2d", "lost_completion")
        b.upload(a)  # its chunk's range waits for a completion that never comes
        held = []
        with pytest.raises(devbridge.Backpressure):
            while True:
                held.append(b.ring.reserve(4096))
        call = lambda: b.upload(a, wait=True)  # noqa: E731
    else:
        t = b.upload(a, wait=True)
        b.fake.inject("copy_d2h", "lost_completion")
        call = lambda: b.download(t)  # noqa: E731
    before = b.stats()
    assert interrupted_by_ctrl_c(call) < 20
    after = b.stats()
    assert after["live_allocations"] == before["live_allocations"], "the interrupted upload's allocation is freed"
    assert after["ring_reservations"] <= before["ring_reservations"] + 1, "at most the lost copy's range waits"
    b.close()


@pytest.mark.parametrize("call", ["wait", "reserve"])
def test_ctrl_c_ends_a_wait_with_no_limit_and_the_bridge_goes_on(call):
    # Bridge.wait(event) of a copy that never completes, ring.reserve(timeout=inf) of room nobody gives back.
    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 20)
    held = b.ring.reserve(4096)
    if call == "wait":
        h = b.alloc(devbridge.ObjectSpec(4096, 64, "uint8"), 4096)
        event = b.host_to_device(held, h)  # the fake completes it only when told
        blocked = lambda: b.wait(event)  # noqa: E731
    else:
        b.ring.reserve(b.ring.free_bytes)
        blocked = lambda: b.ring.reserve(4096, timeout=math.inf)  # noqa: E731
    assert interrupted_by_ctrl_c(blocked) < 10
    if call == "wait":
        b.fake.complete(event)
        assert b.wait(event, timeout=5) == "completed"
    b.close()


@pytest.mark.parametrize("call", ["view", "share"])
def test_ctrl_c_ends_a_view_waiting_for_an_upload_that_never_completes(call):
    # A view (wait=True, the default) waits for the uploads into its allocation; one whose completion never comes
    # held it for good. Sharing a view's lease with a consumer (DLPack) waits the same way (an upload under a
    # live view: writes_under_view "allow").
    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 20, writes_under_view="allow")
    h = b.alloc(devbridge.ObjectSpec(4096, 64, "float32"), 4096)
    if call == "view":
        event = b.host_to_device(b.ring.reserve(4096), h)  # the fake completes it only when told
        blocked = lambda: b.view(h, "float32", (1024,))  # noqa: E731
    else:
        view = b.view(h, "float32", (1024,))
        event = b.host_to_device(b.ring.reserve(4096), h)
        blocked = lambda: view.__dlpack__()  # noqa: E731
    assert interrupted_by_ctrl_c(blocked) < 10
    b.fake.complete(event)
    with b.view(h, "float32", (1024,)) as again:
        assert again.shape == (1024,)
    b.close()


@pytest.mark.parametrize("waits_for", ["room", "views", "peer views", "planner room", "planner views"])
def test_ctrl_c_ends_a_copy_waiting_with_no_limit_and_it_takes_nothing(waits_for):
    # host_to_device(wait_for_room=math.inf) behind a copy that never completes; an upload (or a peer copy)
    # under writes_under_view="wait" into an allocation whose view nobody ends; the same two through a
    # TransferPlanner. Each waited until the other side let go, or for ever: Ctrl-C ends it now, the copy not
    # made, and the bridge goes on.
    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 16, inflight_bytes=8192, writes_under_view="wait")
    h = b.alloc(devbridge.ObjectSpec(1 << 20, 256, "uint8"), 8192)
    r = b.ring.reserve(4096)
    if waits_for.endswith("room"):
        first = b.host_to_device(b.ring.reserve(8192), h)  # the whole budget, until the fake is told
        if waits_for == "room":
            blocked = lambda: b.host_to_device(r, h, wait_for_room=math.inf)  # noqa: E731
        else:
            planner = devbridge._devbridge.TransferPlanner(b, wait_for_room=math.inf)
            blocked = lambda: planner.upload_into(h, 0, bytes(4096))  # noqa: E731
    elif waits_for == "planner views":
        view = b.view(h, "uint8", (8192,))
        blocked = lambda: devbridge._devbridge.TransferPlanner(b).upload_into(h, 0, bytes(4096))  # noqa: E731
    else:
        view = b.view(h, "uint8", (8192,))  # a consumer still reads it
        if waits_for == "views":
            blocked = lambda: b.host_to_device(r, h)  # noqa: E731
        else:
            other = devbridge.Bridge(backend="fake")
            other.fake.set_auto_complete(True)
            source = other.alloc(devbridge.ObjectSpec(4096, 256, "uint8"), 4096)
            blocked = lambda: other.copy_to_peer(source, b, h, 4096)  # noqa: E731
    before = b.stats()
    # Without the interrupt the call waits for ever: let go after 15 s, so that a wait Ctrl-C cannot end
    # fails the test instead of hanging it.
    rescue = threading.Timer(15, lambda: b.fake.complete(first) if waits_for.endswith("room") else view.close())
    rescue.start()
    try:
        assert interrupted_by_ctrl_c(blocked) < 10
    finally:
        rescue.cancel()
    assert b.stats()["copies_submitted"] == before["copies_submitted"], "the interrupted copy was made"
    if waits_for.endswith("room"):
        b.fake.complete(first)
        again = b.host_to_device(r, h, wait_for_room=5.0)  # the room is back: the copy goes in
        b.fake.complete(again)
        assert b.wait(again, timeout=5) == "completed"
    else:
        view.close()
        if waits_for == "peer views":
            other.close()
    b.close()


def test_ctrl_c_ends_a_wait_for_a_restore_whose_read_never_comes(tmp_path, monkeypatch):
    # A restore's read held (slow storage, a hung network disk): a tensor's wait() ends at Ctrl-C at once; the
    # restore's own wait() ends too, abandoning the restore (which stops the reader after its current read).
    from devbridge import _restore as restore_module

    b = devbridge.Bridge(backend="host")
    path = tmp_path / "m.safetensors"
    with b.upload(np.arange(1 << 16, dtype=np.float32), wait=True) as t:
        b.checkpoint(path, {"w": t})
    gate = threading.Event()
    monkeypatch.setattr(restore_module, "_before_read", lambda offset, nbytes: gate.wait(30))
    opens = threading.Timer(8, gate.set)  # the read comes, late
    opens.start()
    try:
        pending = b.restore(path, wait=False)
        assert interrupted_by_ctrl_c(pending["w"].wait) < 5, "the tensor's wait ended only with the read"
        interrupted_by_ctrl_c(pending.wait)
    finally:
        gate.set()
        opens.cancel()
    with pytest.raises(devbridge.CheckpointError, match="abandoned"):
        pending.wait(30)
    assert b.stats()["live_allocations"] == 0
    b.close()


# ---- Ctrl-C right after a call made an allocation leaks nothing ------------------------------------------
#
# A signal (Ctrl-C) that arrives while a C++ call runs without the GIL raises at the first bytecode boundary
# after the call returns, before its result is stored; so can an asynchronous exception. An allocation the
# call returned as a bare DeviceHandle was then owned by nothing (held until close(), every time). The staging
# layer's calls return it owned (_OwnedAllocation), so an exception at any boundary leaves nothing allocated.


def _settle(b: devbridge.Bridge) -> None:
    """Lets the copies an interrupted call left in flight end, and the deferred frees they held run."""
    collect()
    if b.backend == "fake":
        b.fake.complete_all()
    deadline = time.monotonic() + PROMPTLY
    b.poll()  # completions are drained by the bridge's calls: stats() alone never sees a copy end
    while b.stats()["copies_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.001)
        b.poll()


def interrupted_at_each_boundary_after_the_allocation(b: devbridge.Bridge, call, *, limit: int = 5000) -> int:
    """Runs ``call()`` again and again with KeyboardInterrupt raised at the 1st, 2nd, ... bytecode boundary
    (an opcode of a devbridge frame, traced) after ``b``'s new allocation exists, as Ctrl-C raises at whichever
    boundary the signal finds; after each, nothing may stay allocated. The uninterrupted run's tensor is freed.
    Returns how many boundaries there were."""
    import sys

    for nth in range(1, limit):
        before = b.stats()["live_allocations"]
        seen, fired = 0, False

        def local(frame, event, arg):
            nonlocal seen, fired
            if event == "opcode" and not fired and b.stats()["live_allocations"] > before:
                seen += 1
                if seen == nth:
                    fired = True
                    raise KeyboardInterrupt(f"boundary {nth} after the allocation")
            return local

        def traced(frame, event, arg):
            if frame.f_globals.get("__name__", "").startswith("devbridge"):
                frame.f_trace_opcodes = True
                return local
            return None

        made = None
        sys.settrace(traced)
        try:
            made = call()
        except KeyboardInterrupt:
            assert fired, "a KeyboardInterrupt this test did not raise"
        finally:
            sys.settrace(None)
        if not fired:
            assert made is not None and b.stats()["live_allocations"] == before + 1
            made.free()
            _settle(b)
            assert b.stats()["live_allocations"] == before
            return nth - 1
        del made
        _settle(b)
        left = b.stats()["live_allocations"] - before
        assert left == 0, f"KeyboardInterrupt at boundary {nth} after the allocation left {left} allocation(s)"
    raise AssertionError(f"the call never returned within {limit} boundaries")


@pytest.mark.parametrize("backend", ["fake", "host", "opencl"])
@pytest.mark.parametrize("how", ["upload(wait=True)", "upload(wait=False)", "import_tensor", "import_tensor(file)",
                                 "transfer", "adopt"])
def test_ctrl_c_at_any_boundary_after_a_call_allocated_leaks_nothing(backend, how, rng):
    import io

    from conftest import require_backend

    require_backend(backend)
    b = devbridge.Bridge(backend=backend, ring_bytes=1 << 20)
    if backend == "fake":
        b.fake.set_auto_complete(True)
    a = random_array(rng, (3, 1000), "float32")
    other = None
    if how == "upload(wait=True)":
        call = lambda: b.upload(a, wait=True)  # noqa: E731
    elif how == "upload(wait=False)":
        call = lambda: b.upload(a)  # noqa: E731
    elif how == "import_tensor":
        call = lambda: b.import_tensor(devbridge.PortableTensor.from_array(a))  # noqa: E731
    elif how == "import_tensor(file)":
        call = lambda: b.import_tensor(io.BytesIO(a.tobytes()), dtype="float32", shape=a.shape)  # noqa: E731
    elif how == "transfer":
        other = devbridge.Bridge(backend="fake" if backend == "fake" else "host", ring_bytes=1 << 20)
        if backend == "fake":
            other.fake.set_auto_complete(True)
        source = other.upload(a, wait=True)
        call = lambda: devbridge.transfer(other, source, b)  # noqa: E731
    else:
        if not b.backend_info()["host_addressable"]:
            pytest.skip(f"{backend} adopts no host memory")
        ro = a.copy()
        ro.flags.writeable = False
        call = lambda: b.adopt(ro)  # noqa: E731
    boundaries = interrupted_at_each_boundary_after_the_allocation(b, call)
    assert boundaries > 0
    assert b.stats()["live_allocations"] == 0 and b.memory_stats()["allocated_bytes"] == 0
    if how == "adopt":
        collect()
        assert b.stats()["host_regions"] == 0, "an interrupted adopt kept its buffer registered"
    with b.upload(a, wait=True) as t:  # the bridge goes on
        assert np.array_equal(t.numpy(), a)
    if other is not None:
        other.close()
    b.close()


@pytest.mark.parametrize("backend", ["fake", "host"])
def test_ctrl_c_while_a_prefetcher_allocates_its_slots_leaks_nothing(backend, rng):
    # A Prefetcher allocates its slots as batches come: an interrupt right after an allocation, before its slot
    # held the handle, left it allocated once the Prefetcher was gone.
    import sys

    from conftest import require_backend

    require_backend(backend)
    b = devbridge.Bridge(backend=backend, ring_bytes=1 << 20)
    if backend == "fake":
        b.fake.set_auto_complete(True)
    batches = [(random_array(rng, 64, "float32"), random_array(rng, 8, "int64")) for _ in range(3)]
    for nth in range(1, 5000):
        seen, fired = 0, False

        def local(frame, event, arg):
            nonlocal seen, fired
            if event == "opcode" and not fired and b.stats()["live_allocations"] > 0:
                seen += 1
                if seen == nth:
                    fired = True
                    raise KeyboardInterrupt(f"boundary {nth} after the first allocation")
            return local

        def traced(frame, event, arg):  # the boundaries of the code that allocates the slots
            if frame.f_code.co_name == "_issue_into" and frame.f_globals.get("__name__", "").startswith("devbridge"):
                frame.f_trace_opcodes = True
                return local
            return None

        it = devbridge.Prefetcher(b, batches, depth=1, to="device")
        sys.settrace(traced)
        try:
            next(it)
        except KeyboardInterrupt:
            assert fired
        finally:
            sys.settrace(None)
        it.close()
        del it
        _settle(b)
        assert b.stats()["live_allocations"] == 0, f"an interrupt at boundary {nth} left an allocation"
        if not fired:
            break
    else:
        raise AssertionError("next() never returned")
    assert nth > 1
    b.close()


@pytest.mark.parametrize("how", ["upload(wait=True)", "upload(wait=False)", "import_tensor"])
def test_ctrl_c_during_uploads_leaks_no_allocation(how):
    # The real thing: SIGINT sent while uploads of 16 MiB run back to back (most land during the copy, the GIL
    # let go, and raise as the call returns). Each used to leave its allocation behind, 16 MiB until close().
    import os
    import signal

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    b = devbridge.Bridge(backend="host", ring_bytes=1 << 20)
    a = np.ones(4 << 20, np.float32)
    call = {"upload(wait=True)": lambda: b.upload(a, wait=True).free(),
            "upload(wait=False)": lambda: b.upload(a).free(),
            "import_tensor": lambda: b.import_tensor(a).free()}[how]
    started = time.monotonic()
    call()
    one = time.monotonic() - started
    interrupts = 0
    for i in range(12):
        timer = threading.Timer(0.001 + one * (i % 6) / 6, os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()
            deadline = time.monotonic() + PROMPTLY
            while time.monotonic() < deadline:
                call()
        except KeyboardInterrupt:
            interrupts += 1
        finally:
            timer.cancel()
            timer.join()
    assert interrupts == 12
    _settle(b)
    stats = b.stats()
    assert (stats["live_allocations"], b.memory_stats()["allocated_bytes"]) == (0, 0), stats
    assert stats["ring_used"] == 0 and stats["ring_releases_pending"] == 0
    b.close()


def test_an_address_space_limit_is_named_when_it_refuses_host_memory():
    """Under `ulimit -v`, a host mapping failed with ENOMEM beside "18451005440 bytes available": the message
    pointed at free memory, never at the limit that refused it."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import resource, devbridge
        with open("/proc/self/status") as status:
            size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.RLIM_INFINITY))
        try:
            devbridge.Bridge(backend="host", ring_bytes=1 << 30)
        except devbridge.AllocationFailed as error:
            print(error.message)
        else:
            print("opened")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "RLIMIT_AS, ulimit -v" in run.stdout, run.stdout


@pytest.mark.parametrize("backend", ["host", "fake"])
def test_a_ring_or_an_allocation_past_the_machines_memory_is_refused_not_killed(backend):
    # Mapped anyway (overcommit), it was touched at once (mlock, the fake's fill) or by the first copy, and the
    # system killed the process. Refused with AllocationFailed naming what the machine has; the bridge stays usable.
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    has = sum(int(fields[key].split()[0]) * 1024 for key in ("MemAvailable", "SwapFree"))
    huge = has + (4 << 30)
    options = {"memory_bytes": 1 << 50} if backend == "fake" else {}
    with pytest.raises(devbridge.AllocationFailed, match="the machine has"):
        devbridge.Bridge(backend=backend, ring_bytes=huge, **options)
    with devbridge.Bridge(backend=backend, ring_bytes=1 << 20, **options) as b:
        with pytest.raises(devbridge.AllocationFailed, match="the machine has"):
            b.alloc(devbridge.ObjectSpec(max_extent=huge, alignment=256, dtype="uint8"), huge)
        assert b.stats()["live_allocations"] == 0
        b.free(b.alloc(devbridge.ObjectSpec(max_extent=4096, alignment=256, dtype="uint8"), 4096))
