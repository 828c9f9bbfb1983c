"""What the bridge holds in memory, as memory_stats() says and as the process's RSS shows.

The host backend's freed memory is the caching pool's: counted in memory_stats
(reserved/cached), given back by empty_cache(), and nothing is kept once the
bridge is closed. And ring.reserve(timeout=) waits for room instead of failing.
"""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest

import devbridge

MiB = 1 << 20
BIG = 256 * MiB
# RSS moves with the allocator and the interpreter too: a 256 MiB tensor going
# back must show, a few MiB of noise must not fail the test.
SLACK = 64 * MiB


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def source():
    a = np.ones(BIG, np.uint8)  # its pages are touched now, before any baseline
    yield a


def test_the_host_pool_shows_in_memory_stats_and_goes_back():
    with devbridge.Bridge(backend="host", ring_bytes=MiB) as b:
        stats = b.memory_stats()
        assert stats["pool_enabled"] and stats["pool_cap_bytes"] == 512 * MiB
        t = b.upload(np.ones(8 * MiB, np.uint8), wait=True)
        t.free()
        stats = b.memory_stats()
        assert stats["allocated_bytes"] == 0
        assert stats["reserved_bytes"] == stats["cached_bytes"] == stats["free_segment_bytes"] == 8 * MiB
        b.empty_cache()
        stats = b.memory_stats()
        assert stats["reserved_bytes"] == stats["cached_bytes"] == 0


def test_freed_device_memory_leaves_the_process_whatever_the_c_library_did_before():
    # glibc raises its mmap threshold after the first large free, and blocks it then hands out from its
    # heap stay in the process after free(); memory_stats() would say 0 while RSS kept them all.
    def touch(b, h, n):
        with b.view(h, "uint8", (n,)) as v:
            np.from_dlpack(v)[::4096] = 1

    spec = devbridge.ObjectSpec(1 << 30, 256, "uint8")
    with devbridge.Bridge(backend="host", ring_bytes=MiB) as b:
        base = rss()
        h = b.alloc(spec, 24 * MiB)
        touch(b, h, 24 * MiB)
        b.free(h)
        b.empty_cache()
        kept, handles = [], []
        for _ in range(12):
            handles.append(b.alloc(spec, 20 * MiB))
            touch(b, handles[-1], 20 * MiB)
            kept.append(bytearray(200_000))  # long-lived heap objects between them, as a program has
        assert rss() >= base + 240 * MiB - SLACK
        for h in handles:
            b.free(h)
        b.empty_cache()
        assert b.memory_stats()["reserved_bytes"] == 0
        assert rss() < base + SLACK, f"RSS {(rss() - base) / MiB:.0f} MiB above the baseline with nothing reserved"


def test_close_then_the_last_view_gone_gives_the_memory_back(source):
    b = devbridge.Bridge(backend="host", ring_bytes=MiB)
    base = rss()
    t = b.upload(source, wait=True)
    view = t.view()
    arr = np.from_dlpack(view)
    assert rss() >= base + BIG - SLACK
    assert b.memory_stats()["reserved_bytes"] >= BIG
    b.close()
    assert arr[-1] == 1  # the view still reads the memory
    view.close()
    del arr, view, t
    gc.collect()
    # The Python Bridge object is still alive: nothing of the backend's may stay behind it.
    assert rss() < base + SLACK, f"RSS {rss() - base} bytes above the baseline after close"
    del b


@pytest.mark.parametrize("caching_pool", [True, False])
def test_after_restart_memory_stats_shows_what_a_view_holds_and_empty_cache_gives_it_back(source, caching_pool):
    with devbridge.Bridge(backend="host", ring_bytes=MiB, caching_pool=caching_pool) as b:
        base = rss()
        t = b.upload(source, wait=True)
        view = t.view()
        arr = np.from_dlpack(view)
        b.restart(2)
        stats = b.memory_stats()
        assert stats["reserved_bytes"] >= BIG, stats  # held by the orphan the view keeps
        assert rss() >= base + BIG - SLACK
        view.close()
        del arr, view, t
        gc.collect()
        stats = b.memory_stats()
        assert stats["allocated_bytes"] == 0
        if caching_pool:
            assert stats["cached_bytes"] == stats["reserved_bytes"] >= BIG, stats
        else:
            assert stats["cached_bytes"] == stats["reserved_bytes"] == 0, stats  # the orphan went back with its view
        b.empty_cache()
        stats = b.memory_stats()
        assert stats["reserved_bytes"] == stats["cached_bytes"] == 0, stats
        assert rss() < base + SLACK, f"RSS {rss() - base} bytes above the baseline after empty_cache"


def test_the_fake_memory_bytes_bound_device_allocations_not_the_ring():
    # docs/BACKENDS.md: the ring is host memory; it must fit in memory_bytes on its own.
    spec = devbridge.ObjectSpec(max_extent=8192, alignment=64, dtype="uint8")
    with devbridge.Bridge(backend="fake", ring_bytes=8192, memory_bytes=8192) as b:
        h = b.alloc(spec, 8192)  # all of memory_bytes, beside a ring as large
        with pytest.raises(devbridge.AllocationFailed):
            b.alloc(spec, 512)
        b.free(h)
    with pytest.raises(devbridge.AllocationFailed, match="more than the fake's memory"):
        devbridge.Bridge(backend="fake", ring_bytes=16384, memory_bytes=8192)


# ---- ring.reserve(timeout=) ----


def test_threads_reserving_with_a_timeout_never_see_backpressure():
    """Four threads each keep an 8 KiB range of an 8 MiB ring while its copy
    runs; the ring frees in order, so a range held a while (its thread
    descheduled) blocks the others, who wait for it instead of failing. A
    thread gives its own range back before it reserves the next: holding the
    ring's oldest range while waiting for room would wait on itself
    (docs/DECISIONS.md)."""
    spec = devbridge.ObjectSpec(max_extent=1 << 16, alignment=64, dtype="uint8")
    n, rounds = 8192, 1100  # 4 x 1100 reservations: over four laps of 1024 ranges
    errors: list[BaseException] = []
    with devbridge.Bridge(backend="host", ring_bytes=8 * MiB) as b:

        def worker(index: int) -> None:
            try:
                h = b.alloc(spec, n)
                held = []
                for i in range(rounds):
                    while held:
                        r, event = held.pop(0)
                        assert b.wait(event, 30.0) == "completed"
                        b.ring.release(r)
                    r = b.ring.reserve(n, timeout=30.0)
                    b.ring.ndarray(r)[:] = (index + i) % 251
                    held.append((r, b.host_to_device(r, h)))
                for r, event in held:
                    assert b.wait(event, 30.0) == "completed"
                    b.ring.release(r)
                assert b.download(h)[0] == (index + rounds - 1) % 251
                b.free(h)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert b.ring.free_bytes == 8 * MiB


def test_reserve_timeout_is_backpressure_when_time_runs_out_and_closed_on_close():
    with devbridge.Bridge(backend="host", ring_bytes=1 << 16) as b:
        first = b.ring.reserve(1 << 15)
        second = b.ring.reserve(1 << 15)
        b.ring.release(second)  # not the oldest: no room yet
        with pytest.raises(devbridge.Backpressure, match="host ring full"):
            b.ring.reserve(1 << 16, timeout=0.001)
        b.ring.release(first)
        b.ring.release(b.ring.reserve(1 << 16, timeout=0.001))
        with pytest.raises(ValueError):
            b.ring.reserve(1, timeout=-1)
        with pytest.raises(TypeError):
            b.ring.reserve(1, timeout="1")

        whole = b.ring.reserve(1 << 16)
        assert whole.len == 1 << 16
        outcome: list[BaseException] = []
        started = threading.Event()

        def waiter() -> None:
            started.set()
            try:
                b.ring.reserve(1, timeout=float("inf"))
            except BaseException as e:  # noqa: BLE001
                outcome.append(e)

        thread = threading.Thread(target=waiter)
        thread.start()
        started.wait()
        b.close()  # wakes the wait: it has no end of its own
        thread.join()
        assert len(outcome) == 1 and isinstance(outcome[0], devbridge.Closed), outcome
