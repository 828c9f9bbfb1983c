"""Lifetimes ordered on the device, from Python (docs/ARCHITECTURE.md, "Lifetimes on the device").

On the fake backend the test plays the device: ``fake.hold_launches`` keeps a launch's fence pending,
``fake.block_queue(q)`` a consumer queue's. The DLPack ``stream`` path runs on the CUDA backend over the
emulated driver the C++ build makes (tests/cuda/emulated_libcuda.cpp), in a child process, where a
consumer stream of the test's own is held by a host function until the test lets it go.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import gc

import pytest

import devbridge

QUEUE = 0x5EED
FLOATS = devbridge.ObjectSpec(4096, 64, "float32")


@pytest.fixture
def fake_bridge():
    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 16)
    b.fake.set_auto_complete(True)
    yield b
    b.close()


def test_a_free_right_after_a_held_launch_is_deferred_until_the_kernel_finished(fake_bridge):
    b = fake_bridge
    x, y = b.alloc(FLOATS, 4096), b.alloc(FLOATS, 4096)
    b.fake.hold_launches(True)
    b.axpy(x, y, 2.0, 1.0)
    with pytest.raises(devbridge.AllocationStillInUse, match="fence not yet passed on the compute queue \\(a launch\\)"):
        b.free(y)
    b.release(x)
    b.release(y)
    assert b.stats()["pending_fences"] == 1
    assert b.fake.live_allocations() == 2
    b.fake.hold_launches(False)
    assert b.stats()["pending_fences"] == 0  # any call reclaims: no poll needed
    assert b.fake.live_allocations() == 0
    assert b.fake.live_fences() == 0


def test_a_view_closed_after_a_consumers_stream_holds_its_memory_until_the_stream_passes(fake_bridge):
    b = fake_bridge
    h = b.alloc(FLOATS, 4096)
    view = b.view(h, "float32", (1024,))
    b.fake.block_queue(QUEUE)
    view.close(stream=QUEUE)
    assert view.closed
    b.release(h)
    assert b.fake.live_allocations() == 1, "freed while the consumer's stream may still read it"
    b.fake.unblock_queue(QUEUE)
    b.poll()
    assert b.fake.live_allocations() == 0


def test_a_view_closed_after_a_consumers_stream_once_the_bridge_closed_still_waits_for_the_stream():
    """view.close(stream=q) after bridge.close() raised Closed and left the lease open; when the view went, the
    lease ended with no fence and the memory was freed while q (a consumer's queue) could still read it."""
    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 16, close_fence_timeout=0.05)
    b.fake.set_auto_complete(True)
    h = b.alloc(FLOATS, 4096)
    view = b.view(h, "float32", (1024,))
    b.fake.block_queue(QUEUE)
    b.release(h)
    b.close()
    view.close(stream=QUEUE)
    assert view.closed
    del view
    gc.collect()
    assert b.fake.live_allocations() == 1, "freed while the consumer's queue may still read it"
    assert b.stats()["pending_fences"] == 1
    b.fake.unblock_queue(QUEUE)
    # No call after close() looked at that fence again: the memory stayed until the Bridge object went.
    assert b.stats()["pending_fences"] == 0
    assert b.fake.live_allocations() == 0 and b.fake.live_fences() == 0


def test_a_step_ended_after_a_consumers_stream_keeps_free_strict(fake_bridge):
    b = fake_bridge
    h = b.alloc(FLOATS, 4096)
    b.begin_step(1, [h])
    b.fake.block_queue(QUEUE)
    b.end_step(1, stream=QUEUE)
    with pytest.raises(devbridge.AllocationStillInUse, match=f"fence not yet passed on consumer queue {QUEUE:#x} "):
        b.free(h)
    b.fake.unblock_queue(QUEUE)
    b.free(h)
    assert b.fake.live_allocations() == 0


def test_restart_orphans_what_a_consumers_fence_holds_until_it_passes(fake_bridge):
    b = fake_bridge
    h = b.alloc(FLOATS, 4096)
    b.fake.block_queue(QUEUE)
    b.view(h, "float32", (1024,)).close(stream=QUEUE)
    b.restart(2)
    assert b.stats()["orphaned_allocations"] == 1
    b.fake.unblock_queue(QUEUE)
    assert b.stats()["orphaned_allocations"] == 0
    assert b.fake.live_allocations() == 0


@pytest.mark.parametrize("bad", ["1", 1.5, -1, 2**64])
def test_a_stream_that_is_not_a_queue_number_is_refused_with_the_python_exception(fake_bridge, bad):
    b = fake_bridge
    h = b.alloc(FLOATS, 4096)
    view = b.view(h, "float32", (1024,))
    with pytest.raises(TypeError if isinstance(bad, (str, float)) else OverflowError):
        view.close(stream=bad)
    assert not view.closed
    b.begin_step(3, [h])
    with pytest.raises(TypeError if isinstance(bad, (str, float)) else OverflowError):
        b.end_step(3, stream=bad)
    b.end_step(3)
    view.close()
    # Checked on a closed view too (it returned None for any value).
    with pytest.raises(TypeError if isinstance(bad, (str, float)) else OverflowError):
        view.close(stream=bad)
    view.close(stream=QUEUE)  # a queue number on a closed view: nothing to do


def test_host_views_have_no_consumer_streams():
    with devbridge.Bridge(backend="host", ring_bytes=1 << 16) as b:
        h = b.alloc(FLOATS, 4096)
        view = b.view(h, "float32", (1024,))
        with pytest.raises(devbridge.Unsupported, match="CPU consumer has no queue"):
            view.close(stream=1)
        assert not view.closed, "the lease ended though no fence holds its memory"
        b.begin_step(1, [h])
        with pytest.raises(devbridge.Unsupported):
            b.end_step(1, stream=1)
        b.end_step(1)
        view.close()
        b.free(h)


CHILD = textwrap.dedent(
    r"""
    import ctypes, os, sys, threading, time
    import numpy as np
    import devbridge

    lib = ctypes.CDLL(os.environ["DEVBRIDGE_LIBCUDA"])  # the library the backend loaded
    b = devbridge.Bridge(backend="cuda", ring_bytes=1 << 20)
    h = b.alloc(devbridge.ObjectSpec(4096, 64, "float32"), 4096)
    view = b.view(h, "float32", (1024,))

    # A consumer stream of our own in the bridge's context, held by a host function until we let it go.
    assert lib.cuCtxPushCurrent_v2(ctypes.c_void_p(view._native_context)) == 0
    stream = ctypes.c_void_p()
    assert lib.cuStreamCreate(ctypes.byref(stream), 1) == 0
    go = threading.Event()
    HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    gate = HOSTFN(lambda _: go.wait())
    assert lib.cuLaunchHostFunc(stream, gate, None) == 0

    capsule = view.__dlpack__(stream=stream.value)   # the stream waits for the bridge's work on the device
    del capsule                                      # the consumer's array dies: its lease ends *after* the stream
    view.close()
    b.release(h)
    held = b.stats()
    assert held["pending_fences"] == 1, held
    assert held["live_allocations"] == 1, held  # released, not yet freed

    go.set()
    deadline = time.monotonic() + 20
    while b.stats()["pending_fences"] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert b.stats()["pending_fences"] == 0, "the fence on the consumer's stream never passed"
    assert b.stats()["live_allocations"] == 0
    assert lib.cuStreamSynchronize(stream) == 0 and lib.cuStreamDestroy_v2(stream) == 0

    # stream=None is the legacy default stream for CUDA: the lease ends after it.
    h2 = b.alloc(devbridge.ObjectSpec(4096, 64, "float32"), 4096)
    v2 = b.view(h2, "float32", (1024,))
    c = v2.__dlpack__()
    del c
    v2.close()
    b.free(h2)
    b.close()
    print("ok")
    """
)


def test_a_dlpack_consumers_stream_holds_the_memory_until_it_passes_on_emulated_cuda(tmp_path, emulated_libcuda):
    library = emulated_libcuda
    available = {e["name"]: e for e in devbridge.list_backends()}
    if "cuda" not in available:
        pytest.skip("this build of the module has no CUDA backend")
    env = dict(os.environ, DEVBRIDGE_LIBCUDA=str(library), DEVBRIDGE_EMULATED_CUDA_DELAY_US="0")
    result = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


# ---- memory: the caching pool, statistics, out of memory ----


def test_the_pool_reuses_a_freed_block_and_reports_it():
    with devbridge.Bridge(backend="fake", ring_bytes=1 << 16, caching_pool=True) as b:
        b.free(b.alloc(FLOATS, 4096))
        h = b.alloc(FLOATS, 4032)  # the same size class
        stats = b.memory_stats()
        assert stats["pool_enabled"] and stats["cache_hits"] == 1 and stats["backend_allocations"] == 1
        assert [c["call"] for c in b.fake.calls()].count("allocate") == 1
        b.free(h)
        assert b.memory_stats()["cached_blocks"] == 1
        b.empty_cache()
        assert b.memory_stats()["cached_blocks"] == 0 and b.fake.live_allocations() == 0


def test_peaks_reset_to_the_current_figures():
    with devbridge.Bridge(backend="host", ring_bytes=1 << 16, caching_pool=False) as b:
        a, c = b.alloc(FLOATS, 4096), b.alloc(FLOATS, 2048)
        b.free(a)
        stats = b.memory_stats()
        assert not stats["pool_enabled"]
        assert (stats["peak_allocated_bytes"], stats["allocated_bytes"]) == (6144, 2048)
        b.reset_peak_memory()
        assert b.memory_stats()["peak_allocated_bytes"] == 2048
        b.free(c)


def test_the_pool_is_on_by_default_where_the_backend_asks_for_it():
    available = {e["name"]: e["available"] for e in devbridge.list_backends()}
    if not available.get("opencl"):
        pytest.skip("no OpenCL device here")
    with devbridge.Bridge(backend="opencl", ring_bytes=1 << 16) as b:
        assert b.memory_stats()["pool_enabled"]
    with devbridge.Bridge(backend="opencl", ring_bytes=1 << 16, caching_pool=False) as b:
        assert not b.memory_stats()["pool_enabled"]


@pytest.mark.parametrize(
    "kwargs,exception",
    [
        ({"caching_pool": "yes"}, TypeError),
        ({"pool_cap_bytes": -1}, OverflowError),
        ({"pool_cap_bytes": 2**64}, OverflowError),
        ({"pool_cap_bytes": 1.5}, TypeError),
        ({"close_fence_timeout": -1}, ValueError),
        ({"close_fence_timeout": "1"}, TypeError),
    ],
)
def test_memory_options_are_checked_with_the_python_exception(kwargs, exception):
    with pytest.raises(exception):
        devbridge.Bridge(backend="fake", ring_bytes=1 << 16, **kwargs)


def test_out_of_memory_after_the_retry_names_what_the_bridge_held():
    with devbridge.Bridge(backend="fake", ring_bytes=4096, memory_bytes=8192) as b:
        h = b.alloc(FLOATS, 4096)
        h2 = b.alloc(FLOATS, 4096)
        with pytest.raises(devbridge.AllocationFailed, match=r"retried once.*8192 bytes in live allocations"):
            b.alloc(FLOATS, 4096)
        assert b.memory_stats()["oom_failures"] == 1
        b.free(h)
        b.free(h2)
