"""A two-stage pipeline on two devbridge workers (Ray actors) of different backends, one killed halfway.

    python examples/ray_pipeline.py [--batches 16] [--kill-at 8] [--backends host,opencl]   # make run-ray

Stage 1 (worker A, host backend): h = relu(x @ W1 + b1) over each batch.
Stage 2 (worker B, OpenCL where available, else host): acc += h @ W2 summed over the batch, step += 1.

Each batch goes: driver -> A.put (from the object store) -> A.run -> A.export -> B.import_ (the hand-off,
bit-exact) -> B.run -> B.checkpoint. The driver keeps two batches in flight, so A computes batch k+1
while B works on batch k. Calls on B are chained by the tokens B hands out (TensorRefs, of B's current
generation). Halfway, B is killed (ray.kill(..., no_restart=False)); Ray restarts it, it restores its
last checkpoint (acc, step, W2) at generation 2, and every call still queued with a token of
generation 1 is refused (OldGenerationHandle), so nothing runs twice on restored state. The driver
asks B where it stands (step) and continues from there. The final acc is compared bit for bit with
the same computation in this process (tinygrad on CPU, no Ray).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np


def stage1(x, w1, b1):
    return (x @ w1 + b1).relu()


def stage2(h, w2, acc, step):
    return acc + (h @ w2).sum(axis=0), step + 1


def batch(seed: int, k: int, rows: int, features: int) -> np.ndarray:
    return np.random.default_rng([seed, k]).standard_normal((rows, features), dtype=np.float32)


def weights(seed: int, features: int, hidden: int, out: int):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((features, hidden), dtype=np.float32) / np.sqrt(features),
            rng.standard_normal((hidden,), dtype=np.float32) * 0.1,
            rng.standard_normal((hidden, out), dtype=np.float32) / np.sqrt(hidden))


def single_process(args, w1, b1, w2) -> np.ndarray:
    """The same stages in this process: tinygrad on CPU, one realize per stage as on the workers."""
    from tinygrad import Tensor
    from tinygrad.helpers import Context

    with Context(DEV="CPU"):
        tw1, tb1, tw2 = (Tensor(a, device="CPU").realize() for a in (w1, b1, w2))
        acc = Tensor(np.zeros(args.out, np.float32), device="CPU").realize()
        step = Tensor(np.zeros(1, np.int32), device="CPU").realize()
        for k in range(args.batches):
            h = stage1(Tensor(batch(args.seed, k, args.batch_size, args.features), device="CPU"), tw1, tb1).realize()
            acc, step = (t.realize() for t in stage2(h, tw2, acc, step))
        return acc.numpy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--out", type=int, default=32)
    p.add_argument("--kill-at", type=int, default=None, help="kill worker B after submitting this batch "
                   "(default: halfway; -1: never)")
    p.add_argument("--backends", default=None, help="A,B (default: host,opencl when OpenCL is available, else host,host)")
    p.add_argument("--num-cpus", type=int, default=os.cpu_count())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for any one wait")
    args = p.parse_args(argv)

    import ray

    import devbridge
    from devbridge.ray import init_local, start_worker, wait_until_ready

    if args.backends is None:
        opencl = any(b["name"] == "opencl" and b["available"] for b in devbridge.list_backends())
        args.backends = "host,opencl" if opencl else "host,host"
    backend_a, backend_b = args.backends.split(",")
    kill_at = args.batches // 2 if args.kill_at is None else args.kill_at
    w1, b1, w2 = weights(args.seed, args.features, args.hidden, args.out)
    directory = tempfile.mkdtemp(prefix="devbridge-ray-pipeline-")
    started = time.perf_counter()
    init_local(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=True, configure_logging=False,
               object_store_memory=512 << 20)
    try:
        a = start_worker(backend_a, checkpoint=os.path.join(directory, "a.safetensors"))
        b = start_worker(backend_b, checkpoint=os.path.join(directory, "b.safetensors"))
        ids = [ray.get(w.identity.remote(), timeout=args.timeout) for w in (a, b)]
        print(f"worker A: {ids[0]['device']} (pid {ids[0]['pid']}), worker B: {ids[1]['device']} (pid {ids[1]['pid']})")

        def get(ref: Any) -> Any:
            return ray.get(ref, timeout=args.timeout)

        get([a.put.remote("w1", w1), a.put.remote("b1", b1), a.checkpoint.remote()])
        get([b.put.remote("w2", w2), b.put.remote("acc", np.zeros(args.out, np.float32)),
             b.put.remote("step", np.zeros(1, np.int32))])
        get(b.checkpoint.remote())
        state = get(b.run.remote(lambda acc, step: (acc, step), ["acc", "step"], ["acc", "step"]))  # gen-1 tokens
        generation = 1
        k, restarts, killed = 0, 0, False
        in_flight: list[tuple[int, Any, Any]] = []  # (batch, its state's refs, its checkpoint's ref)
        while k < args.batches or in_flight:
            # Submit batch k (two in flight at most).
            if k < args.batches and len(in_flight) < 2:
                x = batch(args.seed, k, args.batch_size, args.features)
                a.put.remote("x", x)
                a.run.remote(stage1, ["x", "w1", "b1"], ["h"])
                h = b.import_.remote("h", a.export.remote("h"))
                state = b.run.remote(stage2, [h, "w2", state], ["acc", "step"])
                done = b.checkpoint.remote(names=["w2", "acc", "step"])
                in_flight.append((k, state, done))
                if k == kill_at and not killed:
                    time.sleep(0.05)  # let B start on it
                    print(f"batch {k}: killing worker B (ray.kill(no_restart=False))")
                    ray.kill(b, no_restart=False)
                    killed = True
                k += 1
                continue
            done_k, tokens, done = in_flight.pop(0)
            try:
                get(tokens)  # refused (OldGenerationHandle) when B restarted under it
                get(done)
            except (ray.exceptions.RayActorError, devbridge.OldGenerationHandle) as error:
                # B died (or already came back): its queued calls with generation-1 tokens are refused.
                generation = wait_until_ready(b, timeout=args.timeout, min_generation=generation + 1)
                restored = int(get(b.get.remote("step"))[0])
                restarts += 1
                print(f"batch {done_k}: worker B failed ({type(error).__name__}); restarted at generation "
                      f"{generation}, restored its checkpoint at step {restored}; resuming from batch {restored}")
                for _, _, pending in in_flight:  # drain what was submitted before the restart (refused or done)
                    try:
                        get(pending)
                    except (ray.exceptions.RayActorError, devbridge.OldGenerationHandle, devbridge.BridgeError):
                        pass
                in_flight = []
                state = get([b.handle.remote("acc"), b.handle.remote("step")])
                k = restored
        acc = get(b.get.remote("acc"))
        step = int(get(b.get.remote("step"))[0])
        stats = get(b.stats.remote())
        elapsed = time.perf_counter() - started
    finally:
        ray.shutdown()
        shutil.rmtree(directory, ignore_errors=True)
    reference = single_process(args, w1, b1, w2)
    print(f"{args.batches} batches of {args.batch_size}x{args.features} through {backend_a} -> {backend_b} in "
          f"{elapsed:.1f} s; worker B restarts: {restarts}, generation {stats['generation']}, step {step}, "
          f"refused stale handles: {stats['refused_handles']}")
    if step != args.batches:
        print(f"FAIL: step {step}, expected {args.batches}")
        return 1
    if not np.array_equal(acc, reference):
        print(f"FAIL: result differs from the single-process run (max abs diff {np.abs(acc - reference).max()})")
        return 1
    if kill_at >= 0 and kill_at < args.batches and restarts != 1:
        print(f"FAIL: expected one restart of worker B, saw {restarts}")
        return 1
    print("result equals the single-process run: bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
