#!/usr/bin/env python3
"""Prefetcher and staging benchmarks, each side measured in this one process (run by `make bench`).

1. Training: the same TinyJit MLP step fed by ``devbridge.Prefetcher`` (zero-copy tinygrad tensors over
   device memory, the next batches uploading meanwhile) against fed by ``tinygrad.Tensor(numpy_batch)``.
   Goal: Prefetcher time / plain time <= 1.0.
2. Staging: ``bridge.upload(a, wait=True)`` and ``bridge.download(x, out)`` of 256 MiB against
   ``numpy.copyto`` of the same bytes. Goal (host backend): copyto time / staging time >= 0.9.

Both JITs are compiled (and every buffer touched) before timing; samples of the two sides alternate and
the medians are compared, because a shared machine's speed drifts. Nothing here fails on time: it prints.

    python bench/prefetch_bench.py [--backend host] [--rounds 5] [--staging-mib 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterable

import numpy as np

SAMPLES, FEATURES, HIDDEN, CLASSES, BATCH = 8192, 784, 128, 10, 128
TINYGRAD_DEVICE = {"host": "CPU", "fake": "CPU", "cuda": "CUDA"}


def median_time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(sides: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds of each side, the sides alternating (the order rotating) round by round."""
    names = list(sides)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(median_time(sides[name]))
    return {name: statistics.median(s) for name, s in samples.items()}


# ---------------------------------------------------------------------------------------- training


def training(backend: str, rounds: int) -> None:
    import devbridge
    from tinygrad import Tensor, TinyJit, nn

    device = TINYGRAD_DEVICE[backend]
    rng = np.random.default_rng(0)
    images = rng.standard_normal((SAMPLES, FEATURES), dtype=np.float32)
    labels = rng.integers(0, CLASSES, SAMPLES, dtype=np.int32)
    batches = [(images[i:i + BATCH].copy(), labels[i:i + BATCH].copy()) for i in range(0, SAMPLES, BATCH)]

    def model() -> Callable[[Tensor, Tensor], Tensor]:
        w1 = Tensor(rng.standard_normal((FEATURES, HIDDEN), dtype=np.float32) * 0.05, device=device)
        w2 = Tensor(rng.standard_normal((HIDDEN, CLASSES), dtype=np.float32) * 0.1, device=device)
        for w in (w1, w2):
            if hasattr(w, "requires_grad"):  # older tinygrad
                w.requires_grad = True
        optimizer = nn.optim.SGD([w1, w2], lr=0.01)

        @TinyJit
        def step(x: Tensor, y: Tensor) -> Tensor:
            optimizer.zero_grad()
            loss = (x @ w1).relu().matmul(w2).sparse_categorical_crossentropy(y)
            loss.backward()
            optimizer.step()
            return loss.realize()

        return step

    def epoch(step: Callable[[Tensor, Tensor], Tensor], feed: Iterable[tuple[Tensor, Tensor]]) -> None:
        for x, y in feed:
            step(x, y).item()  # the consumer reads each loss, as a training loop logging it would

    bridge = devbridge.Bridge(backend=backend)
    if backend == "fake":
        bridge.fake.set_auto_complete(True)
    prefetch_step, plain_step = model(), model()

    def prefetched() -> None:
        epoch(prefetch_step, devbridge.Prefetcher(bridge, batches, depth=2, to="tinygrad"))

    def plain() -> None:
        epoch(plain_step, ((Tensor(x, device=device), Tensor(y, device=device)) for x, y in batches))

    with training_mode():
        prefetched(), plain()  # compiles both JITs
        times = interleaved({"Prefetcher": prefetched, "Tensor(numpy)": plain}, rounds)
    steps = len(batches)
    print(f"training: {steps} TinyJit steps of a {FEATURES}-{HIDDEN}-{CLASSES} MLP, batch {BATCH} "
          f"({BATCH * FEATURES * 4 // 1024} KiB of images), tinygrad {device}, medians of {rounds}")
    for name, seconds in times.items():
        print(f"  {name:<14} {seconds * 1e3:9.1f} ms/epoch  {seconds / steps * 1e6:8.1f} us/step")
    ratio = times["Prefetcher"] / times["Tensor(numpy)"]
    print(f"  Prefetcher / Tensor(numpy) time: {ratio:.3f}x (goal <= 1.0x)")
    bridge.close()


def training_mode():
    from tinygrad import Tensor

    if hasattr(Tensor, "train"):
        return Tensor.train()
    from tinygrad.helpers import Context

    return Context(TRAINING=1)


# ----------------------------------------------------------------------------------------- staging


def staging(backend: str, rounds: int, mib: int) -> None:
    import devbridge

    nbytes = mib << 20
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    bridge = devbridge.Bridge(backend=backend)
    if backend == "fake":
        bridge.fake.set_auto_complete(True)
    kept = bridge.upload(src, wait=True)  # for the downloads; also faults in the pages the allocator reuses

    def upload() -> None:
        bridge.upload(src, wait=True).free()

    def download() -> None:
        bridge.download(kept, dst)

    def copyto() -> None:
        np.copyto(dst, src)

    def copyto_fresh() -> None:  # what upload does besides copying: a new destination, its pages faulted in
        np.copyto(np.empty_like(src), src)

    upload(), download(), copyto(), copyto_fresh()
    times = interleaved({"upload": upload, "download": download, "numpy.copyto": copyto,
                         "empty+copyto": copyto_fresh}, rounds)
    assert dst.tobytes() == src.tobytes(), "the download does not match"
    print(f"staging: {mib} MiB through the default ring ({bridge.stats()['ring_capacity'] >> 20} MiB), "
          f"{backend} backend, medians of {rounds}")
    for name, seconds in times.items():
        print(f"  {name:<13} {seconds * 1e3:8.1f} ms  {nbytes / seconds / 1e9:6.2f} GB/s")
    for name, baseline in (("upload", "numpy.copyto"), ("upload", "empty+copyto"), ("download", "numpy.copyto")):
        print(f"  {name} speed / {baseline} speed: {times[baseline] / times[name]:.3f} (goal >= 0.9 on host)")
    print("  (upload allocates its destination each time, as empty+copyto does; the host backend hands back the block "
          "this loop freed, warm, where numpy's fresh array faults its pages in; " + (
              "host-addressable device memory: upload and download copy once, through a view"
              if bridge.host_addressable else "upload and download copy every byte twice: through the ring") + ")")
    kept.free()
    bridge.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(TINYGRAD_DEVICE), default="host")
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("BENCH_ROUNDS", 5)))
    parser.add_argument("--staging-mib", type=int, default=256)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.staging_mib < 1:
        parser.error("--rounds and --staging-mib must be at least 1")
    os.environ.setdefault("DEV", TINYGRAD_DEVICE[args.backend])  # tinygrad's default: the views' device
    print(f"== Prefetcher and staging ({os.cpu_count()} CPUs; one process, interleaved samples) ==")
    training(args.backend, args.rounds)
    staging(args.backend, args.rounds, args.staging_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
