"""Restore as a stream (issue #26, item 1): the file is read with pread straight into the ring's chunks,
nothing of it mapped, large chunks read and hashed in parts; with ``wait=False`` the tensors come back at
once and each is usable as soon as its own bytes have landed, before the rest of the file is read.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from typing import Any

import numpy as np
import pytest

import devbridge
import devbridge._restore as restore_module
from conftest import auto_bridge, collect
from test_checkpoint_partial import free, model_arrays, nothing_left, restored_then_freed, write_sharded

# 32 MiB: chunks of 8 MiB, past the size read in parts.
RING = 32 << 20


@pytest.fixture(params=["fake", "host", "opencl", "cuda"])
def pb(request):
    yield from auto_bridge(request.param, ring_bytes=RING)


def layers(rng, count: int = 6, big: int = 3 << 20) -> dict[str, np.ndarray]:
    """float32 tensors named in file order (checkpoint orders a dtype's tensors by name); the last one large."""
    arrays = {f"layer{i:02d}": rng.standard_normal(1000 + 37 * i).astype(np.float32) for i in range(count - 1)}
    arrays[f"layer{count - 1:02d}"] = rng.standard_normal(big).astype(np.float32)
    return arrays


def write(b: devbridge.Bridge, path, arrays: dict[str, np.ndarray], checksum: str = "crc32") -> None:
    tensors = {name: b.upload(a, wait=True) for name, a in arrays.items()}
    b.checkpoint(path, tensors, checksum=checksum)
    free(tensors)


def written(b: devbridge.Bridge, rng, tmp_path) -> tuple[dict[str, np.ndarray], str]:
    """The layers, checkpointed by ``b``: the arrays and the file's path."""
    arrays = layers(rng)
    path = str(tmp_path / "model.safetensors")
    write(b, path, arrays)
    return arrays, path


class HeldRead:
    """Restore's reads, except that the read reaching byte ``last`` of the file waits until ``release()`` (the
    reading thread's ``_before_read`` hook, called before each read)."""

    def __init__(self, monkeypatch, last: int) -> None:
        self.reached = threading.Event()
        self._gate = threading.Event()
        self._last = last

        def held(offset, nbytes):
            if offset + nbytes > self._last:
                self.reached.set()
                assert self._gate.wait(30), "the test never released the read"

        monkeypatch.setattr(restore_module, "_before_read", held)

    def release(self) -> None:
        self._gate.set()


def until(predicate, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def test_with_wait_false_the_first_tensor_is_ready_before_the_last_byte_is_read(pb, rng, tmp_path, monkeypatch):
    arrays, path = written(pb, rng, tmp_path)
    read = HeldRead(monkeypatch, os.path.getsize(path) - 1)
    pending = pb.restore(path, wait=False)
    try:
        assert isinstance(pending, devbridge.PendingRestore) and sorted(pending) == sorted(arrays)
        first, last = pending["layer00"], pending["layer05"]
        assert until(first.ready), "the first tensor never became ready"
        assert read.reached.is_set() or not pending.done()
        assert until(read.reached.is_set)
        # The reader waits at the file's last byte: the first tensors are usable, the last one is not.
        assert not pending.done() and not last.ready() and not pending.ready()
        assert not last.wait(timeout=0.01) and not pending.wait(timeout=0.01)
        assert first.numpy().tobytes() == arrays["layer00"].tobytes()
        assert "pending" in repr(last) and "reading" in repr(pending)
    finally:
        read.release()
    assert pending.wait() and pending.ready() and pending.done()
    restored_then_freed(pb, pending, arrays)


def test_the_bare_handle_of_a_tensor_not_yet_read_is_handed_out_once_its_bytes_landed(pb, rng, tmp_path,
                                                                                        monkeypatch):
    # The allocation exists before its bytes are read: download(t.handle), view(t.handle) and a checkpoint of
    # t.handle read it empty (zeros, the fake's fill), and that checkpoint's checksum verified the garbage.
    arrays, path = written(pb, rng, tmp_path)
    read = HeldRead(monkeypatch, os.path.getsize(path) - 1)
    pending = pb.restore(path, wait=False)
    last = pending["layer05"]
    got: dict[str, Any] = {}

    def use_the_handle():
        handle = last.handle  # waits for the bytes
        got["download"] = pb.download(handle, dtype="float32", shape=last.shape).tobytes()
        with pb.view(handle, "float32", last.shape) as view:  # numpy reads CPU memory only
            got["view"] = np.from_dlpack(view).tobytes() if pb.backend in ("fake", "host") else None
        pb.checkpoint(tmp_path / "again.safetensors", {"x": handle})

    user = threading.Thread(target=use_the_handle)
    try:
        assert until(read.reached.is_set)
        user.start()
        user.join(0.2)
        assert user.is_alive(), "the handle was handed out before its bytes were read"
    finally:
        read.release()
    user.join(30)
    assert not user.is_alive()
    assert got["download"] == arrays["layer05"].tobytes()
    assert got["view"] in (None, arrays["layer05"].tobytes())
    again = pb.restore(tmp_path / "again.safetensors")
    assert again["x"].numpy().tobytes() == arrays["layer05"].tobytes()
    free(again)
    assert pending.wait()
    restored_then_freed(pb, pending, arrays)


def test_a_pending_restore_that_fails_frees_every_tensor_and_names_the_file(pb, rng, tmp_path):
    arrays, path = written(pb, rng, tmp_path)
    with open(path, "r+b") as f:  # one bit of the last tensor's data: the checksum differs
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte ^ 0x10]))
    pending = pb.restore(path, wait=False)
    with pytest.raises(devbridge.CheckpointError, match="model.safetensors.* is corrupt: the data's checksum"):
        pending.wait()
    assert all(t.freed for t in pending.values())
    with pytest.raises(devbridge.CheckpointError):  # the verdict stays
        pending.ready()
    nothing_left(pb)
    with pytest.raises(devbridge.CheckpointError, match="is corrupt"):  # wait=True: the same, at once
        pb.restore(path)
    nothing_left(pb)


def test_a_file_that_shrinks_while_pending_fails_the_tensors_not_yet_read(pb, rng, tmp_path, monkeypatch):
    arrays, path = written(pb, rng, tmp_path)
    size = os.path.getsize(path)
    read = HeldRead(monkeypatch, size - 1)
    pending = pb.restore(path, wait=False)
    assert until(read.reached.is_set)
    os.truncate(path, size - 4096)
    read.release()
    with pytest.raises(devbridge.CheckpointError, match=r"tensor 'layer05'.*shrank since its header was checked: a read of"):
        pending["layer05"].wait()
    with pytest.raises(devbridge.CheckpointError, match="shrank since its header was checked: a read of"):
        pending.wait()
    nothing_left(pb)


def held_at_its_last_read(b: devbridge.Bridge, path: str, monkeypatch) -> tuple[devbridge.PendingRestore, HeldRead]:
    """A pending restore of ``path`` whose reader is held in its read of the file's last byte."""
    read = HeldRead(monkeypatch, os.path.getsize(path) - 1)
    pending = b.restore(path, wait=False)
    assert until(read.reached.is_set)
    return pending, read


def test_abandon_stops_the_reader_and_frees_every_tensor(pb, rng, tmp_path, monkeypatch):
    arrays, path = written(pb, rng, tmp_path)
    pending, read = held_at_its_last_read(pb, path, monkeypatch)
    threading.Timer(0.1, read.release).start()  # abandon waits for the reader's read in progress
    pending.abandon()
    assert all(t.freed for t in pending.values())
    nothing_left(pb)
    # Its last read was in flight: the reader reached the end, yet nothing was restored.
    with pytest.raises(devbridge.CheckpointError, match=r"model.safetensors' was abandoned"):
        pending.wait()
    nothing_left(pb)


def abandoned_after_the_end(b: devbridge.Bridge, path: str) -> devbridge.PendingRestore:
    """A pending restore of ``path`` whose reader has read every byte, abandoned before anyone waited for it."""
    pending = b.restore(path, wait=False)
    assert until(pending.done), "the reader never finished"
    pending.abandon()
    return pending


def refused_as_abandoned(pending: devbridge.PendingRestore, path: str) -> None:
    """Every way of asking for the verdict says the restore was abandoned (its tensors are freed): none says
    True, none hands a freed tensor back."""
    assert all(t.freed for t in pending.values())
    for ask in (pending.wait, lambda: pending.wait(0), pending.ready, pending.tensors):
        with pytest.raises(devbridge.CheckpointError) as caught:
            ask()
        assert str(caught.value) == f"restore {path!r} was abandoned: its tensors are freed"
    pending.abandon()  # idempotent


def test_abandon_after_the_reader_finished_is_never_a_restore_that_succeeded(pb, rng, tmp_path):
    # wait() and ready() said True and tensors() handed back the freed tensors.
    arrays, path = written(pb, rng, tmp_path)
    refused_as_abandoned(abandoned_after_the_end(pb, path), path)
    nothing_left(pb)
    index = write_sharded(tmp_path, model_arrays(rng))
    refused_as_abandoned(abandoned_after_the_end(pb, index), index)  # the index named, not a shard
    nothing_left(pb)


def test_abandon_after_a_successful_wait_withdraws_the_verdict(pb, rng, tmp_path):
    arrays, path = written(pb, rng, tmp_path)
    pending = pb.restore(path, wait=False)
    assert pending.wait() and pending.ready()
    pending.abandon()  # the caller's way to free them all: the tensors it had are gone
    refused_as_abandoned(pending, path)
    nothing_left(pb)


def test_a_waiter_on_another_thread_sees_the_abandon_too(pb, rng, tmp_path, monkeypatch):
    # A thread waiting while the last read was in flight got True once abandon() freed the tensors.
    arrays, path = written(pb, rng, tmp_path)
    pending, read = held_at_its_last_read(pb, path, monkeypatch)
    verdicts: list = []

    def waiter() -> None:
        try:
            verdicts.append(pending.wait())
        except devbridge.CheckpointError as error:
            verdicts.append(error)

    waiting = [threading.Thread(target=waiter) for _ in range(3)]
    for thread in waiting:
        thread.start()
    threading.Timer(0.1, read.release).start()  # the read in flight ends; the reader reaches the file's end
    pending.abandon()
    for thread in waiting:
        thread.join(30)
    assert len(verdicts) == 3 and all(isinstance(v, devbridge.CheckpointError) for v in verdicts), verdicts
    assert all("was abandoned" in str(v) for v in verdicts)
    refused_as_abandoned(pending, path)
    nothing_left(pb)


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_chunks_read_in_parts_are_verified_and_a_flipped_bit_in_any_part_is_found(pb, rng, tmp_path, checksum):
    arrays = {"weights": rng.standard_normal(5 << 20).astype(np.float32)}  # 20 MiB: chunks of 8 MiB, in parts
    path = tmp_path / "big.safetensors"
    write(pb, path, arrays, checksum)
    restored_then_freed(pb, pb.restore(path), arrays)
    data_start = os.path.getsize(path) - arrays["weights"].nbytes
    for at in (6 << 20, (8 << 20) + 12345, (20 << 20) - 1):  # the second part of chunk 0, of chunk 1, the end
        with open(path, "r+b") as f:
            f.seek(data_start + at)
            byte = f.read(1)[0]
            f.seek(data_start + at)
            f.write(bytes([byte ^ 1]))
        with pytest.raises(devbridge.CheckpointError, match="is corrupt"):
            pb.restore(path)
        with open(path, "r+b") as f:
            f.seek(data_start + at)
            f.write(bytes([byte]))
    nothing_left(pb)


def test_a_sharded_restore_can_be_pending_too(pb, rng, tmp_path):
    arrays = model_arrays(rng)
    index = write_sharded(tmp_path, arrays)
    pending = pb.restore(index, wait=False)
    assert isinstance(pending, devbridge.PendingRestore)
    assert pending.wait()
    restored_then_freed(pb, pending, arrays)


def test_wait_must_be_a_bool(pb, tmp_path):
    with pytest.raises(TypeError, match="wait must be a bool"):
        pb.restore(tmp_path / "x.safetensors", wait=1)


PEAK = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "restore_peak.py")


def test_a_restore_holds_no_more_host_memory_than_its_tensors_and_the_ring(tmp_path):
    """Memory beyond the restored tensors stays within the ring plus 64 MiB, whatever the file's size:
    no staging buffer the size of the file, no map of the file (whose pages would count as resident)."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    file_mib, ring = 256, 16 << 20
    rng = np.random.default_rng(0)
    arrays = {f"w{i}": rng.standard_normal((file_mib << 20) // 32).astype(np.float32) for i in range(8)}
    path = tmp_path / "big.safetensors"
    safetensors_numpy.save_file(arrays, str(path))
    del arrays
    collect()
    child = subprocess.run([sys.executable, PEAK, str(path), str(ring)], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr
    peak, tensors = map(int, child.stdout.split())
    assert tensors == file_mib << 20
    assert peak - tensors <= ring + (64 << 20), f"{(peak - tensors) >> 20} MiB held beyond the tensors"


_FORKED_CHILD = """
import os, sys
import devbridge
path = sys.argv[1]
b = devbridge.Bridge(backend="host", ring_bytes=32 << 20)
for t in b.restore(path).values():  # the reader pools' threads start in this process
    t.free()
pid = os.fork()
if pid == 0:  # a child inherits the pools without their threads: its restore must not wait for them
    try:
        child = devbridge.Bridge(backend="host", ring_bytes=32 << 20)
        restored = child.restore(path)
        os._exit(0 if sorted(restored) == sorted(devbridge.checkpoint_info(path)["tensors"]) else 3)
    except BaseException:
        os._exit(4)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_process_forked_after_a_restore_restores_too(tmp_path):
    """A forked child (a DataLoader worker, multiprocessing's fork) restores with reading threads of its own."""
    host = devbridge.Bridge(backend="host", ring_bytes=RING)
    try:
        arrays = layers(np.random.default_rng(7), big=1 << 20)
        path = str(tmp_path / "model.safetensors")
        write(host, path, arrays)
    finally:
        host.close()
    child = subprocess.run([sys.executable, "-c", _FORKED_CHILD, path], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr


def test_a_tensor_freed_before_its_bytes_landed_is_let_go_by_the_reader_and_the_others_restore(pb, rng, tmp_path,
                                                                                                  monkeypatch):
    # Freed before the reader reached it, its allocation was gone when the reader came: the whole restore failed
    # (UnknownDeviceHandle naming that tensor, raised by every other tensor's wait). free() now returns at once
    # and the reader lets the allocation go once its bytes have landed.
    arrays, path = written(pb, rng, tmp_path)
    read = HeldRead(monkeypatch, os.path.getsize(path) - 1)
    before = pb.stats()["live_allocations"]
    pending = pb.restore(path, wait=False)
    last = pending["layer05"]
    try:
        assert until(read.reached.is_set)
        started = time.monotonic()
        last.free()
        assert time.monotonic() - started < 5 and last.freed  # waits for no reader
        last.free()  # idempotent
        # Still the reader's to write: allocated until it lands.
        assert pb.stats()["live_allocations"] == before + len(arrays)
    finally:
        read.release()
    assert pending.wait()
    for name, array in arrays.items():
        if name != "layer05":
            assert pending[name].numpy().tobytes() == array.tobytes(), name
    free(pending)
    assert until(lambda: pb.stats()["live_allocations"] == before)


def test_tensors_freed_before_an_abandon_are_let_go_with_the_rest(pb, rng, tmp_path, monkeypatch):
    arrays, path = written(pb, rng, tmp_path)
    read = HeldRead(monkeypatch, os.path.getsize(path) - 1)
    before = pb.stats()["live_allocations"]
    pending = pb.restore(path, wait=False)
    try:
        assert until(read.reached.is_set)
        pending["layer05"].free()
        pending["layer04"].free()
    finally:
        read.release()
    pending.abandon()
    # A released tensor whose copies were in flight goes once their completions are applied (poll: stats()
    # applies none, and the emulated CUDA driver completes only when asked).
    assert until(lambda: pb.poll() >= 0 and pb.stats()["live_allocations"] == before)


def test_abandon_ends_the_readers_wait_for_ring_room_the_caller_holds(pb, rng, tmp_path):
    # The reader waited for ring room the caller held (a minute, the restore's wait for room) and abandon()'s
    # join waited with it; the reader now looks for the stop between its slices of that wait.
    arrays, path = written(pb, rng, tmp_path)
    before = pb.stats()["live_allocations"]
    held = pb.ring.reserve(RING)  # every byte of the ring
    try:
        pending = pb.restore(path, wait=False)
        abandoning = threading.Thread(target=pending.abandon)
        abandoning.start()
        abandoning.join(20)  # a bound for a hang, far below the minute the reader would wait
        assert not abandoning.is_alive(), "abandon() waited for the ring room the caller holds"
    finally:
        pb.ring.release(held)
    with pytest.raises(devbridge.CheckpointError, match="was abandoned"):
        pending.wait()
    assert all(t.freed for t in pending.values())
    assert until(lambda: pb.poll() >= 0 and pb.stats()["live_allocations"] == before)
