"""Fault injection through the fake backend: exact calls, the right exception, no byte lost."""

from __future__ import annotations

import numpy as np
import pytest

import devbridge
from conftest import download, random_array

U8 = devbridge.ObjectSpec(max_extent=1 << 20, alignment=64, dtype="uint8")


def staged(b: devbridge.Bridge, data: np.ndarray):
    r = b.ring.reserve(data.nbytes)
    b.ring.ndarray(r, "uint8")[:] = data
    return r


def test_fake_is_only_on_the_fake_backend():
    # An attribute the object lacks: AttributeError, so hasattr() answers and the tools that list an object's
    # members (inspect.getmembers, Ray's pickling check) go on; Ray said "Unsupported: Bridge.fake" for a bridge
    # captured by a task instead of "cannot pickle".
    import inspect

    with devbridge.Bridge(backend="host") as b:
        with pytest.raises(AttributeError, match='backend is "host", not "fake"'):
            b.fake
        assert not hasattr(b, "fake")
        assert "ring" in dict(inspect.getmembers(b))


def test_calls_are_recorded_with_exact_arguments(fake_bridge, rng):
    b = fake_bridge
    fake = b.fake
    fake.clear_calls()
    h = b.alloc(devbridge.ObjectSpec(1 << 20, 256, "uint8"), 8192)
    data = random_array(rng, 4096, "uint8")
    r = staged(b, data)
    event = b.host_to_device(r, h, offset=1024)
    calls = fake.calls()
    assert [c["call"] for c in calls] == ["allocate", "copy_h2d"]
    assert calls[0]["bytes"] == 8192 and calls[0]["alignment"] >= 256
    copy = calls[1]
    assert copy["bytes"] == 4096 and copy["host_offset"] == r.offset and copy["device_offset"] == 1024
    assert copy["mode"] == "async" and copy["event"] == event
    assert copy["address"] == calls[0]["address"] != 0
    assert fake.pending() == [event]
    assert b.copy_status(event) == "pending" and not b.safe_to_release_host(event)
    with pytest.raises(devbridge.AllocationStillInUse):
        b.ring.release(r)  # an async copy still reads it
    assert fake.complete(event)
    assert b.wait(event) == "completed" and b.safe_to_release_host(event)
    b.ring.release(r)
    b.device_to_host(h, b.ring.reserve(4096), offset=1024, mode="sync")
    assert fake.calls()[-1]["call"] == "copy_d2h" and fake.calls()[-1]["mode"] == "sync"


def test_allocation_failure(fake_bridge):
    b = fake_bridge
    b.fake.inject("allocate", "allocation_failed")
    b.fake.inject("allocate", "allocation_failed", nth=2)  # the bridge's one retry
    with pytest.raises(devbridge.AllocationFailed) as caught:
        b.alloc(U8, 4096)
    assert "4096" in caught.value.message and "retried once" in caught.value.message
    assert b.fake.live_allocations() == 0 and b.stats()["live_allocations"] == 0
    assert b.memory_stats()["oom_failures"] == 1
    h = b.alloc(U8, 4096)  # one-shot
    b.free(h)


def test_one_refusal_is_retried_away(fake_bridge):
    b = fake_bridge
    b.fake.inject("allocate", "allocation_failed")
    h = b.alloc(U8, 4096)
    assert [c["call"] for c in b.fake.calls()][-2:] == ["allocate", "allocate"]
    stats = b.memory_stats()
    assert stats["oom_retries"] == 1 and stats["oom_failures"] == 0
    b.free(h)


def test_unknown_injection_names_are_value_errors(fake_bridge):
    with pytest.raises(ValueError, match="known"):
        fake_bridge.fake.inject("allocate_more", "allocation_failed")
    with pytest.raises(ValueError, match="known"):
        fake_bridge.fake.inject("allocate", "gremlins")
    with pytest.raises(ValueError):
        fake_bridge.fake.inject("allocate", "lost_completion")  # does not apply to allocations


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_upload_failing_at_submit_loses_no_bytes(fake_bridge, rng, mode):
    b = fake_bridge
    h = b.alloc(U8, 4096)
    data = random_array(rng, 4096, "uint8")
    r = staged(b, data)
    b.fake.inject("copy_h2d", "copy_failed_at_submit")
    with pytest.raises(devbridge.DeviceCopyFailed):
        b.host_to_device(r, h, mode=mode)
    assert np.array_equal(b.ring.ndarray(r, "uint8"), data)  # still the caller's, intact
    b.fake.set_auto_complete(True)
    assert b.wait(b.host_to_device(r, h, mode=mode)) == "completed"  # the retry
    b.ring.release(r)
    assert np.array_equal(download(b, h, 4096), data)


def test_upload_failing_at_completion_loses_no_bytes(fake_bridge, rng):
    b = fake_bridge
    h = b.alloc(U8, 4096)
    data = random_array(rng, 4096, "uint8")
    r = staged(b, data)
    b.fake.inject("copy_h2d", "copy_failed_at_completion")
    event = b.host_to_device(r, h)
    b.fake.complete_all()
    with pytest.raises(devbridge.DeviceCopyFailed):
        b.wait(event)
    assert b.copy_status(event) == "failed"
    info = b.copy_info(event)
    assert info["state"] == "failed" and info["error"] == "DeviceCopyFailed" and info["message"]
    assert not b.safe_to_release_host(event)
    assert np.array_equal(b.ring.ndarray(r, "uint8"), data)
    b.fake.set_auto_complete(True)
    assert b.wait(b.host_to_device(r, h)) == "completed"
    b.ring.release(r)
    assert np.array_equal(download(b, h, 4096), data)


def test_download_failing_at_completion_is_output_copy_failed(fake_bridge, rng):
    b = fake_bridge
    b.fake.set_auto_complete(True)
    h = b.alloc(U8, 4096)
    data = random_array(rng, 4096, "uint8")
    r = staged(b, data)
    b.wait(b.host_to_device(r, h))
    b.ring.release(r)
    out = b.ring.reserve(4096)
    sentinel = random_array(rng, 4096, "uint8")
    b.ring.ndarray(out, "uint8")[:] = sentinel
    b.fake.inject("copy_d2h", "copy_failed_at_completion")
    event = b.device_to_host(h, out)
    with pytest.raises(devbridge.OutputCopyFailed):
        b.wait(event)
    assert not b.host_bytes_valid(event)
    assert np.array_equal(b.ring.ndarray(out, "uint8"), sentinel)  # no partial bytes
    assert b.wait(b.device_to_host(h, out)) == "completed"  # retried into the same range
    assert np.array_equal(b.ring.ndarray(out, "uint8"), data)


def test_lost_completion_stays_pending_until_restart(fake_bridge, rng):
    b = fake_bridge
    h = b.alloc(U8, 4096)
    r = staged(b, random_array(rng, 4096, "uint8"))
    b.fake.inject("copy_h2d", "lost_completion")
    event = b.host_to_device(r, h)
    b.fake.complete_all()
    assert b.wait(event, timeout=0.01) == "pending"
    assert b.stats()["copies_in_flight"] == 1
    b.restart(2)
    assert b.fake.live_allocations() == 0 and b.stats()["copies_in_flight"] == 0
    with pytest.raises(devbridge.OldGenerationHandle):
        b.copy_status(event)


def test_stale_completions_are_counted_not_applied(fake_bridge, rng):
    b = fake_bridge
    h = b.alloc(U8, 4096)
    r = staged(b, random_array(rng, 4096, "uint8"))
    event = b.host_to_device(r, h)
    b.fake.report_completion(devbridge.CopyEvent(event.domain, event.generation, event.id + 99))
    b.poll()
    assert b.stats()["stale_completions"] == 1
    assert b.copy_status(event) == "pending"
    b.fake.complete(event)
    assert b.wait(event) == "completed"


def test_invalid_view_injection(fake_bridge):
    b = fake_bridge
    h = b.alloc(devbridge.ObjectSpec(1 << 20, 64, "float32"), 4096)
    b.fake.inject("validate_view", "invalid_view")
    with pytest.raises(devbridge.InvalidTensorView):
        b.view(h, "float32", 1024)
    assert b.stats()["live_views"] == 0
    with b.view(h, "float32", 1024):
        pass
    b.free(h)


def test_fatal_failure_breaks_the_bridge_until_restart(fake_bridge, rng):
    b = fake_bridge
    h = b.alloc(U8, 4096)
    r = staged(b, random_array(rng, 4096, "uint8"))
    b.fake.inject("copy_h2d", "fatal")
    with pytest.raises(devbridge.BridgeError) as caught:
        b.host_to_device(r, h, mode="sync")
    assert caught.value.fatal
    with pytest.raises(devbridge.Broken):
        b.alloc(U8, 64)
    assert b.stats()["broken"]
    b.restart(2)
    assert not b.stats()["broken"]
    assert b.fake.live_allocations() == 0
    h = b.alloc(U8, 4096)
    b.free(h)


def test_restart_in_the_middle_of_in_flight_work(fake_bridge, rng):
    b = fake_bridge
    handles = [b.alloc(U8, 4096) for _ in range(4)]
    ranges = [staged(b, random_array(rng, 4096, "uint8")) for _ in handles]
    events = [b.host_to_device(r, h) for r, h in zip(ranges, handles)]
    assert len(b.fake.pending()) == 4
    b.restart(5)
    assert b.fake.live_allocations() == 0
    assert b.stats()["copies_in_flight"] == 0 and b.stats()["inflight_bytes"] == 0
    for e in events:
        with pytest.raises(devbridge.OldGenerationHandle):
            b.wait(e)
    for r in ranges:
        b.ring.release(r)  # the ranges are the caller's again
    assert b.ring.free_bytes == b.ring.capacity
