"""Ctrl-C and device faults under a restore and the Prefetcher (fake backend's injections).

* Ctrl-C while a restore waits on copies that never complete (a hung device: ``lost_completion``) ends the
  wait at once, however many tensors are hung: the abandoned restore waits for none of their copies (the
  bridge frees each allocation once its copies end) and nothing leaks. The Prefetcher the same.
* A restore's failure waits for its tensors' copies once, bounded in all, never per tensor.
* A fatal failure while the Prefetcher stages a later batch is raised as itself (class, ``.fatal``, the
  batch it happened at), not as the ``Broken`` an earlier batch's wait saw after it.
* A batch whose upload never completes raises ``TimeoutError`` (documented) after ``timeout``, no later.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import devbridge
import devbridge._restore as restore_module

# What "at once" means here: the interrupt lands at 0.3 s; the defect took 30 s per hung tensor.
PROMPT_S = 5.0


# Runs blocked() with SIGINT sent 0.3 s later, expects KeyboardInterrupt; the seconds it took.
from test_reliability import interrupted_by_ctrl_c as interrupted  # noqa: E402


def fake_bridge() -> devbridge.Bridge:
    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 16)
    b.fake.set_auto_complete(True)
    return b


def checkpoint_of(b: devbridge.Bridge, path, n: int) -> None:
    tensors = {f"w{i}": b.upload(np.full(1000, i + 0.5, np.float32), wait=True) for i in range(n)}
    b.checkpoint(path, tensors)
    for t in tensors.values():
        t.free()


# ------------------------------------------------------------------------------------ restore


@pytest.mark.parametrize("how", ["pending", "sync"])
@pytest.mark.parametrize("hung", [1, 3])
def test_ctrl_c_ends_a_restore_whose_copies_never_complete_at_once_and_leaks_nothing(tmp_path, how, hung):
    b = fake_bridge()
    path = tmp_path / "ck.safetensors"
    checkpoint_of(b, path, 3)
    for i in range(hung):  # each tensor's single upload copy: its completion never comes
        b.fake.inject("copy_h2d", "lost_completion", nth=i + 1)
    pending = b.restore(path, wait=False) if how == "pending" else None
    took = interrupted(pending.wait if pending is not None else lambda: b.restore(path))
    assert took < PROMPT_S, f"Ctrl-C took {took:.1f} s to end the restore ({hung} hung tensors)"
    if pending is not None:  # abandoned: later waits say so
        with pytest.raises(devbridge.CheckpointError, match="abandoned"):
            pending.wait()
        assert all(t.freed for t in pending.values())
    # The hung tensors' allocations wait in the bridge for their copies; nothing else is left.
    assert b.stats()["live_allocations"] <= hung
    b.close()
    assert b.fake.live_allocations() == 0


def test_ctrl_c_ends_a_sharded_restore_whose_copies_never_complete_at_once(tmp_path):
    from test_checkpoint_partial import write_sharded

    b = fake_bridge()
    index = write_sharded(tmp_path, {f"w{i}": np.full(1000, i + 0.5, np.float32) for i in range(3)}, shards=3)
    for i in range(3):  # every shard's copy (the shards are read at once, in any order)
        b.fake.inject("copy_h2d", "lost_completion", nth=i + 1)
    pending = b.restore(index, wait=False)
    took = interrupted(pending.wait)  # the first shard's wait is interrupted: no other shard's is waited on
    assert took < PROMPT_S, f"Ctrl-C took {took:.1f} s to end the sharded restore"
    with pytest.raises(devbridge.CheckpointError, match="abandoned"):
        pending.wait()
    assert all(t.freed for t in pending.values())
    b.close()
    assert b.fake.live_allocations() == 0


def test_a_failed_restore_waits_for_its_copies_once_in_all_not_per_tensor(tmp_path, monkeypatch):
    b = fake_bridge()
    path = tmp_path / "ck.safetensors"
    checkpoint_of(b, path, 4)
    with open(path, "r+b") as f:  # a flipped bit in the last tensor's bytes: the checksum differs at the end
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    for i in range(4):
        b.fake.inject("copy_h2d", "lost_completion", nth=i + 1)
    monkeypatch.setattr(restore_module, "_CLEANUP_WAIT_S", 1.0)
    started = time.monotonic()
    with pytest.raises(devbridge.CheckpointError, match="corrupt|checksum"):
        b.restore(path)
    took = time.monotonic() - started
    assert took < 2.5, f"the failure's cleanup waited {took:.1f} s: 1 s per hung tensor, not 1 s in all"
    b.close()
    assert b.fake.live_allocations() == 0


# ---------------------------------------------------------------------------------- Prefetcher


def batches(n: int) -> list[np.ndarray]:
    return [np.full(1000, i + 0.5, np.float32) for i in range(n)]


def test_ctrl_c_ends_a_prefetcher_waiting_on_a_hung_device_at_once():
    b = fake_bridge()
    b.fake.inject("copy_h2d", "lost_completion", nth=1)  # batch 0's, the one next() waits for
    b.fake.inject("copy_h2d", "lost_completion", nth=2)  # batch 1's, staged ahead
    p = devbridge.Prefetcher(b, iter(batches(4)), depth=2, to="device", timeout=None)
    took = interrupted(lambda: next(p))
    assert took < PROMPT_S, f"Ctrl-C took {took:.1f} s to end next()"
    assert p.closed
    b.close()
    assert b.fake.live_allocations() == 0


def test_ctrl_c_in_the_loop_body_leaves_the_with_block_at_once_while_uploads_are_hung():
    b = fake_bridge()
    b.fake.inject("copy_h2d", "lost_completion", nth=2)  # batches 1 and 2, staged while batch 0 is in use
    b.fake.inject("copy_h2d", "lost_completion", nth=3)

    def loop():
        with devbridge.Prefetcher(b, iter(batches(4)), depth=3, to="device", timeout=None) as p:
            for _ in p:
                time.sleep(60)  # the consumer's work, interrupted

    took = interrupted(loop)
    assert took < PROMPT_S, f"leaving the with block took {took:.1f} s"
    b.close()
    assert b.fake.live_allocations() == 0


@pytest.mark.parametrize("to", ["device", "tinygrad"])
@pytest.mark.parametrize("fatal_batch", [1, 2])
def test_a_fatal_failure_staging_a_later_batch_is_raised_as_itself_not_as_broken(to, fatal_batch):
    if to == "tinygrad":
        pytest.importorskip("tinygrad")
    b = fake_bridge()
    b.fake.inject("copy_h2d", "fatal", nth=fatal_batch + 1)  # one copy per batch: batch fatal_batch's
    p = devbridge.Prefetcher(b, iter(batches(5)), depth=3, to=to)
    # The batches before it completed, but the bridge is Broken: none of them can be read any more, so the
    # fatal failure itself is raised at the first next() that needs the bridge.
    with pytest.raises(devbridge.DeviceCopyFailed) as raised:
        next(p)
    error = raised.value
    assert error.fatal is True
    assert error.batch_index == fatal_batch
    assert str(error).startswith(f"DeviceCopyFailed: Prefetcher batch {fatal_batch}: ")
    assert "injected fatal device error" in str(error)
    assert isinstance(error.__cause__, devbridge.DeviceCopyFailed) and error.__cause__.fatal
    assert p.closed
    with pytest.raises(StopIteration):
        next(p)
    b.restart(2)
    b.close()
    assert b.fake.live_allocations() == 0


def test_a_batch_whose_upload_never_completes_raises_timeout_error_after_timeout_and_no_later():
    b = fake_bridge()
    b.fake.inject("copy_h2d", "lost_completion", nth=1)  # batch 0's
    b.fake.inject("copy_h2d", "lost_completion", nth=2)  # batch 1's, in flight when batch 0 times out
    p = devbridge.Prefetcher(b, iter(batches(4)), depth=2, to="device", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        next(p)
    took = time.monotonic() - started
    assert took < 0.5 + PROMPT_S - 1, f"next() raised after {took:.1f} s with timeout=0.5"
    assert raised.value.batch_index == 0
    assert str(raised.value) == "Prefetcher batch 0: its upload did not complete within 0.5 s"
    assert p.closed
    b.close()
    assert b.fake.live_allocations() == 0
