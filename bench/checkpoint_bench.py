#!/usr/bin/env python3
"""Checkpoint/restore and transfer throughput: devbridge against the plain paths, as ratios, in one run.

  checkpoint  bridge.checkpoint(path, tensors): device -> ring -> file, the
              data's checksum (crc32, the default; sha256 in its own row) on a
              thread of its own, temp file + fsync + rename + directory fsync;
              against safetensors.numpy.save_file of the same arrays held in
              host memory, with and without an fsync after it (save_file does
              not make the file durable; devbridge does).
  restore     bridge.restore(path): file -> ring -> device, the checksum
              verified (crc32, and sha256 in its own row; for reference also
              verify=False); against safetensors.numpy.load_file (file -> numpy
              arrays) and against a raw sequential read of the same file into
              one buffer (the storage's own rate), warm and cold (the file
              dropped from the page cache with posix_fadvise(DONTNEED) before
              each sample of both); and onto OpenCL against onto host (the
              same file, when an OpenCL device is there).
  slow        restore of a 300-tensor file (64 MiB) from storage that streams
              it at --slow-mib-per-s (default 300 MiB/s) from the first read
              (os.preadv returns once the stream reaches the bytes asked for,
              as with the kernel reading ahead) against a raw read of the
              same storage: whether copies and hashing hide behind the reads.
  peak        a restore of --peak-gib GiB (default 2) in a process of its
              own (restore_peak.py): its peak resident memory beyond the
              restored tensors, against ring + in-flight budget + 64 MiB.
  transfer    devbridge.transfer(host bridge, x, OpenCL bridge) and back:
              against the slower of the source's download and the destination's
              upload (bridge.download / bridge.upload of the same bytes), the
              best a staged copy through both rings can reach.

Each file is written three ways, --tensors (default 8,300,3000) tensors of
the same --mib: per-tensor cost, not bytes, sets the speed of many small
tensors. Files go to --dir (default: the temp directory); the warm rows are
memory-bandwidth figures, the cold ones the disk's. Each figure is
the median of --repeat samples (GB/s, 1 GB = 1e9 bytes); a ratio above 1 means
devbridge is faster. The samples of a row and of its baseline are interleaved
(ours, theirs, ours, ...), so a machine that slows down mid-run (another
process, the disk's writeback) weighs on both alike. Nothing is asserted:
this reports.

    .venv/bin/python bench/checkpoint_bench.py [--mib 256] [--repeat 3] [--ring-mib 64] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import numpy as np
import safetensors.numpy

import devbridge


def arrays_of(total_bytes: int, count: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """A model-like mix. 8: a few large float32 matrices, some float16, small int64 counters. More: layers
    as a transformer has them, each a large float32 weight, a float16 projection and small float32/int64
    vectors (norms, biases, counters), the bytes mostly in the weights."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    if count <= 8:
        big = total_bytes // 8  # 6 float32 matrices of an eighth each, then float16
        for i in range(6):
            out[f"layer{i}.weight"] = rng.standard_normal(big // 4, dtype=np.float32).reshape(-1, 1024)
        out["embed.weight"] = rng.standard_normal(big // 2).astype(np.float16).reshape(-1, 512)
        out["optimizer.step"] = np.arange(16, dtype=np.int64)
        return out
    layers = count // 4
    per_layer = total_bytes // layers
    for i in range(layers):
        weight = max(1024, per_layer * 3 // 4 // 4 // 256 * 256)  # float32 elements, whole rows of 256
        out[f"layers.{i}.mlp.weight"] = rng.standard_normal(weight, dtype=np.float32).reshape(-1, 256)
        proj = max(256, per_layer // 4 // 2 // 256 * 256)
        out[f"layers.{i}.attn.proj"] = rng.standard_normal(proj).astype(np.float16).reshape(-1, 256)
        out[f"layers.{i}.norm.weight"] = rng.standard_normal(256, dtype=np.float32)
        out[f"layers.{i}.step"] = np.arange(4, dtype=np.int64)
    return out


def read_raw(path: str, into: bytearray) -> None:
    """The file's bytes into one buffer, 16 MiB per read: the storage's own sequential rate."""
    view = memoryview(into)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            n = f.readinto(view[done:done + (16 << 20)])
            if not n:
                break
            done += n


def drop_from_page_cache(*paths: str) -> None:
    """Cold reads: the files' clean pages out of the page cache (their writes were fsynced)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def median_seconds(run: Callable[[], object], repeat: int, before: Callable[[], object] | None = None) -> float:
    samples = []
    for _ in range(repeat):
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved_medians(runs: list[tuple[Callable[[], object], Callable[[], object] | None]],
                        repeat: int) -> list[float]:
    """The median seconds of each ``(run, before)``, their samples taken in turn: run 0, run 1, ..., run 0, ..."""
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(repeat):
        for (run, before), out in zip(runs, samples):
            if before is not None:
                before()
            start = time.perf_counter()
            run()
            out.append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def save_and_fsync(arrays: dict[str, np.ndarray], path: str) -> None:
    safetensors.numpy.save_file(arrays, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_all(tensors: dict[str, devbridge.DeviceTensor]) -> None:
    for t in tensors.values():
        t.free()


def file_rows(host: devbridge.Bridge, arrays: dict[str, np.ndarray], workdir: str, repeat: int,
              every_checksum: bool, opencl: devbridge.Bridge | None) -> list[tuple[str, float, str, float]]:
    """Checkpoint and restore rows for one set of arrays (``every_checksum``: sha256 and verify=False too;
    ``opencl``: the same restore onto it, against the host's)."""
    nbytes = sum(a.nbytes for a in arrays.values())
    gb = nbytes / 1e9
    label = f"{len(arrays)} tensors"
    rows: list[tuple[str, float, str, float]] = []
    ours, theirs = os.path.join(workdir, "ours.safetensors"), os.path.join(workdir, "theirs.safetensors")
    strong = os.path.join(workdir, "ours-sha256.safetensors")
    tensors = {name: host.upload(a, wait=True) for name, a in arrays.items()}
    host.checkpoint(ours, tensors)  # one each first: the files exist, so every sample replaces one
    host.checkpoint(strong, tensors, checksum="sha256")
    safetensors.numpy.save_file(arrays, theirs)

    writes = [(lambda: host.checkpoint(ours, tensors), None),
              (lambda: safetensors.numpy.save_file(arrays, theirs), None),
              (lambda: save_and_fsync(arrays, theirs), None)]
    if every_checksum:
        writes.append((lambda: host.checkpoint(strong, tensors, checksum="sha256"), None))
    write, plain_write, durable_write, *write_sha = interleaved_medians(writes, repeat)
    rows.append((f"checkpoint ({label}, crc32)", gb / write, "save_file", gb / plain_write))
    rows.append((f"checkpoint ({label}, crc32)", gb / write, "save_file + fsync", gb / durable_write))
    if every_checksum:
        rows.append((f"checkpoint ({label}, sha256)", gb / write_sha[0], "save_file", gb / plain_write))
    # Freed before the restores: the restored tensors then land in memory the pool keeps between samples,
    # as the raw read lands in one buffer kept between samples (neither pays the kernel's zero-filling).
    free_all(tensors)

    restored: dict[str, devbridge.DeviceTensor] = {}

    def restore(path: str, onto: devbridge.Bridge = host, **kwargs: object) -> Callable[[], None]:
        return lambda: restored.update(onto.restore(path, **kwargs))

    def clear() -> None:
        free_all(restored)
        restored.clear()

    def clear_cold() -> None:
        clear()
        drop_from_page_cache(ours, theirs)

    raw = bytearray(os.path.getsize(ours))
    reads = [(restore(ours), clear), (lambda: safetensors.numpy.load_file(theirs), clear),
             (lambda: read_raw(ours, raw), clear), (restore(ours), clear_cold), (lambda: read_raw(ours, raw), clear_cold)]
    if opencl is not None:
        reads.append((restore(ours, opencl), clear))
    if every_checksum:
        reads += [(restore(strong), clear), (restore(ours, verify=False), clear)]
    read, plain_read, raw_warm, read_cold, raw_cold, *others = interleaved_medians(reads, repeat)
    if opencl is not None:
        rows.append((f"restore ({label}, crc32) onto OpenCL", gb / others.pop(0), "restore onto host", gb / read))
    clear()
    rows.append((f"restore ({label}, crc32)", gb / read, "load_file", gb / plain_read))
    rows.append((f"restore ({label}, crc32)", gb / read, "raw read, warm", gb / raw_warm))
    rows.append((f"restore ({label}, crc32), cold", gb / read_cold, "raw read, cold", gb / raw_cold))
    if every_checksum:
        rows.append((f"restore ({label}, sha256)", gb / others[0], "load_file", gb / plain_read))
        rows.append((f"restore ({label}, verify=False)", gb / others[1], "load_file", gb / plain_read))
    for path in (ours, strong):
        check = host.restore(path)
        assert all(np.array_equal(host.download(check[n]), a) for n, a in arrays.items()), "restore differs"
        free_all(check)
    return rows


class ThrottledStorage:
    """Storage that streams a file at ``rate`` bytes/s from its first read on, as a network disk or slow SSD
    does with the kernel reading ahead: a read of bytes [a, b) returns once the stream has reached b (restore
    reads in C++, on its own thread: its ``_before_read`` hook waits for that before each read; the raw read
    goes through os.preadv). A raw read through it takes the storage's own time; restore matches it only if
    its device copies and hashing keep pace and hide behind the reads, never stalling the stream."""

    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._preadv = os.preadv
        self._started: float | None = None  # when the stream began (one file at a time)

    def _wait_for(self, end: int) -> None:
        if self._started is None:
            self._started = time.monotonic()
        time.sleep(max(0.0, self._started + end / self._rate - time.monotonic()))

    def preadv(self, fd: int, buffers: list, offset: int, *args: int) -> int:
        n = self._preadv(fd, buffers, offset, *args)
        self._wait_for(offset + n)
        return n

    def restart(self) -> None:
        """The file streams from its beginning again (before each sample)."""
        self._started = None

    def __enter__(self) -> ThrottledStorage:
        os.preadv = self.preadv
        devbridge._restore._before_read = lambda offset, nbytes: self._wait_for(offset + nbytes)
        return self

    def __exit__(self, *exc: object) -> None:
        os.preadv = self._preadv
        devbridge._restore._before_read = None


def throttled_rows(host: devbridge.Bridge, workdir: str, mib_per_s: int, repeat: int) -> list[tuple[str, float, str, float]]:
    """Restore of the 300-tensor file from storage throttled to ``mib_per_s`` against a raw read through the
    same throttle: the overlap of reads with copies and hashing, where storage is the bound."""
    path = os.path.join(workdir, "ours.safetensors")
    host.checkpoint(path, {n: host.upload(a, wait=True) for n, a in arrays_of(64 << 20, 300).items()})
    gb = os.path.getsize(path) / 1e9
    restored: dict[str, devbridge.DeviceTensor] = {}

    def raw() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            buffer = memoryview(bytearray(16 << 20))
            at = 0
            while n := os.preadv(fd, [buffer], at):
                at += n
        finally:
            os.close(fd)

    with ThrottledStorage(mib_per_s * (1 << 20)) as storage:
        def clear() -> None:
            free_all(restored)
            restored.clear()
            storage.restart()

        ours, theirs = interleaved_medians([(lambda: restored.update(host.restore(path)), clear), (raw, clear)],
                                           repeat)
    free_all(restored)
    return [(f"restore (300 tensors), storage {mib_per_s} MiB/s", gb / ours, "raw read, same storage", gb / theirs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="total checkpoint size (MiB)")
    parser.add_argument("--tensors", default="8,300,3000", help="tensor counts, one file each (comma-separated)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--ring-mib", type=int, default=64, help="each bridge's ring (MiB)")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--peak-gib", type=float, default=2.0,
                        help="restore a file this large in a process of its own and report its peak memory "
                             "beyond the tensors (0: skip)")
    parser.add_argument("--slow-mib-per-s", type=int, default=300,
                        help="restore from storage throttled to this rate, against a raw read of it (0: skip)")
    args = parser.parse_args()
    counts = [int(c) for c in args.tensors.split(",") if c]

    rows: list[tuple[str, float, str, float]] = []
    available = {b["name"]: b["available"] for b in devbridge.list_backends()}
    with tempfile.TemporaryDirectory(dir=args.dir) as workdir, \
            devbridge.Bridge(backend="host", ring_bytes=args.ring_mib << 20) as host, \
            (devbridge.Bridge(backend="opencl", ring_bytes=args.ring_mib << 20) if available.get("opencl")
             else contextlib.nullcontext()) as cl:
        for i, count in enumerate(counts):
            rows += file_rows(host, arrays_of(args.mib << 20, count), workdir, args.repeat, every_checksum=i == 0,
                              opencl=cl)
        arrays = arrays_of(args.mib << 20)
        if args.slow_mib_per_s > 0:
            rows += throttled_rows(host, workdir, args.slow_mib_per_s, args.repeat)
        peak = peak_row(workdir, args.peak_gib, args.ring_mib << 20) if args.peak_gib > 0 else None

        if cl is not None:
            a = arrays["layer0.weight"]
            part = a.nbytes / 1e9
            x = host.upload(a, wait=True)
            moved: list[devbridge.DeviceTensor] = []

            def drop_moved() -> None:
                while moved:
                    moved.pop().free()

            out = np.empty_like(a)
            for src, dst, label in ((host, cl, "host -> OpenCL"), (cl, host, "OpenCL -> host")):
                start_tensor = x if src is host else cl.upload(a, wait=True)
                t = median_seconds(lambda: moved.append(devbridge.transfer(src, start_tensor, dst)),
                                   args.repeat, before=drop_moved)
                drop_moved()
                down = median_seconds(lambda: src.download(start_tensor, out), args.repeat)
                up = median_seconds(lambda: moved.append(dst.upload(a, wait=True)), args.repeat,
                                    before=drop_moved)
                drop_moved()
                slower = min(part / down, part / up)
                rows.append((f"transfer {label}", part / t, "min(download, upload)", slower))
                if start_tensor is not x:
                    start_tensor.free()
            x.free()
        else:
            print("OpenCL unavailable here: no transfer figures")

    print(f"about {args.mib} MiB per file, tensors {args.tensors}, ring {args.ring_mib} MiB, median of {args.repeat}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'devbridge':<40}{'GB/s':>8}   {'against':<24}{'GB/s':>8}   {'ratio':>6}")
    for ours_label, ours_rate, their_label, their_rate in rows:
        print(f"{ours_label:<40}{ours_rate:>8.2f}   {their_label:<24}{their_rate:>8.2f}   "
              f"{ours_rate / their_rate:>6.2f}")
    if peak is not None:
        print(peak)


def peak_row(workdir: str, gib: float, ring: int) -> str:
    """A restore of ``gib`` GiB (8 tensors) in a process of its own (restore_peak.py): its peak resident
    memory beyond the tensors, against the bound the issue sets (ring + in-flight budget + 64 MiB)."""
    path = os.path.join(workdir, "peak.safetensors")
    per_tensor = int(gib * (1 << 30)) // 8 // 4
    rng = np.random.default_rng(1)
    safetensors.numpy.save_file({f"w{i}": rng.standard_normal(per_tensor, dtype=np.float32) for i in range(8)},
                                path)
    child = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "restore_peak.py"), path,
                            str(ring)], capture_output=True, text=True, check=True)
    os.unlink(path)
    peak, tensors = map(int, child.stdout.split())
    with devbridge.Bridge(backend="host", ring_bytes=ring) as probe:
        budget = probe.stats()["inflight_budget_bytes"]
    return (f"restore of {tensors / (1 << 30):.2f} GiB (8 tensors, host, ring {ring >> 20} MiB): peak memory beyond "
            f"the tensors {(peak - tensors) / (1 << 20):.0f} MiB; bound ring + in-flight budget + 64 MiB = "
            f"{(ring + budget + (64 << 20)) / (1 << 20):.0f} MiB")


if __name__ == "__main__":
    main()
