"""devbridge.ray benchmarks on a local Ray cluster (make bench), each comparison in one run:

1. hand-off of a 256 MiB float32 tensor between two workers: ``a.export`` -> ``b.import_`` (device of A to
   device of B, through the object store) against ``ray.put`` in one actor + ``ray.get`` in another of the
   same numpy array (host memory to host memory). Samples alternate; medians; ratio = baseline / devbridge
   time (>= 1 means devbridge is as fast).
2. pipeline throughput (examples/ray_pipeline.py's two stages) with both stages on 1 worker against one
   stage per worker on 2 workers (hand-off between them), batches per second; ratio = 2 workers / 1.

    python bench/ray_bench.py [--mib 256] [--repeats 5] [--batches 24] [--backends host,host]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--backends", default="host,host", help="A,B for the hand-off (also try host,opencl)")
    p.add_argument("--num-cpus", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    try:
        import ray
    except ImportError:
        print("ray_bench: Ray is not installed (pip install 'devbridge[ray]'); skipped")
        return 0
    import devbridge
    from devbridge.ray import init_local, start_worker, wait_until_ready
    import ray_pipeline as pipeline

    ray.cloudpickle.register_pickle_by_value(pipeline)  # the workers cannot import examples/

    nbytes = args.mib << 20
    init_local(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=True, configure_logging=False,
               object_store_memory=max(1 << 30, 3 * nbytes + (256 << 20)))
    status = 0
    try:
        @ray.remote
        class Holder:
            """The baseline's two ends: a numpy array in an actor's memory, ray.put, and ray.get elsewhere."""

            def __init__(self, n):
                self.a = np.random.default_rng(0).standard_normal(n // 4, dtype=np.float32) if n else None

            def send(self):
                return [ray.put(self.a)]   # nested, so the caller passes the ref on unresolved

            def receive(self, refs):
                a = ray.get(refs[0], timeout=120)
                return a.nbytes

        backend_a, backend_b = args.backends.split(",")
        src, dst = start_worker(backend_a), start_worker(backend_b)
        for w in (src, dst):
            wait_until_ready(w, timeout=120)
        data = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
        ray.get(src.put.remote("t", data), timeout=300)
        del data
        put_end, get_end = Holder.remote(nbytes), Holder.remote(0)
        ray.get([put_end.send.remote(), get_end.receive.remote([ray.put(np.zeros(1))])], timeout=300)

        def devbridge_once():
            t = time.perf_counter()
            ray.get(dst.import_.remote("t", src.export.remote("t")), timeout=300)
            return time.perf_counter() - t

        def baseline_once():
            t = time.perf_counter()
            ray.get(get_end.receive.remote(put_end.send.remote()), timeout=300)
            return time.perf_counter() - t

        devbridge_once(), baseline_once()  # warm-up (object store pages, worker imports)
        ours, base = [], []
        for _ in range(args.repeats):
            ours.append(devbridge_once())
            base.append(baseline_once())
        check = ray.get(dst.get.remote("t"), timeout=300)
        exact = np.array_equal(check, ray.get(src.get.remote("t"), timeout=300))
        del check
        if os.environ.get("RAY_BENCH_VERBOSE"):
            print("  samples (s):", [round(x, 4) for x in ours], [round(x, 4) for x in base])
        mo, mb = statistics.median(ours), statistics.median(base)
        print(f"hand-off of {args.mib} MiB float32 between two workers ({backend_a} -> {backend_b}), "
              f"median of {args.repeats}:")
        print(f"  {'devbridge export -> import_ (device to device)':52s} {mo * 1e3:8.1f} ms  "
              f"{nbytes / mo / 1e9:6.2f} GB/s")
        print(f"  {'ray.put + ray.get of the numpy array (host to host)':52s} {mb * 1e3:8.1f} ms  "
              f"{nbytes / mb / 1e9:6.2f} GB/s")
        print(f"  ratio (ray.put+get time / devbridge time): {mb / mo:.2f}x  (goal >= 0.9x); bit-exact: {exact}")
        if not exact:
            status = 1
        for actor in (src, dst, put_end, get_end):
            ray.kill(actor, no_restart=True)

        # 2. Pipeline throughput: 1 worker (both stages) vs 2 workers (a stage each, hand-off between).
        cfg = argparse.Namespace(batches=args.batches, batch_size=args.batch_size, features=256, hidden=512,
                                 out=64, seed=0)
        w1, b1, w2 = pipeline.weights(cfg.seed, cfg.features, cfg.hidden, cfg.out)
        batches = [pipeline.batch(cfg.seed, k, cfg.batch_size, cfg.features) for k in range(cfg.batches)]

        def run_pipeline(a, b):
            ray.get([a.put.remote("w1", w1), a.put.remote("b1", b1), b.put.remote("w2", w2),
                     b.put.remote("acc", np.zeros(cfg.out, np.float32)), b.put.remote("step", np.zeros(1, np.int32))],
                    timeout=120)
            t = time.perf_counter()
            pending = []
            for x in batches:
                a.put.remote("x", x)
                a.run.remote(pipeline.stage1, ["x", "w1", "b1"], ["h"])
                h = "h" if a is b else b.import_.remote("h", a.export.remote("h"))
                pending.append(b.run.remote(pipeline.stage2, [h, "w2", "acc", "step"], ["acc", "step"]))
                if len(pending) > 2:
                    ray.get(pending.pop(0), timeout=120)
            ray.get(pending, timeout=120)
            elapsed = time.perf_counter() - t
            return ray.get(b.get.remote("acc"), timeout=120), cfg.batches / elapsed

        one = start_worker(backend_a)
        two_a, two_b = start_worker(backend_a), start_worker(backend_b)
        for w in (one, two_a, two_b):
            wait_until_ready(w, timeout=120)
        run_pipeline(one, one), run_pipeline(two_a, two_b)  # warm-up: tinygrad compiles its kernels
        rates1, rates2 = [], []
        for _ in range(max(1, args.repeats // 2)):
            acc1, r1 = run_pipeline(one, one)
            acc2, r2 = run_pipeline(two_a, two_b)
            rates1.append(r1)
            rates2.append(r2)
        r1, r2 = statistics.median(rates1), statistics.median(rates2)
        print(f"pipeline, {cfg.batches} batches of {cfg.batch_size}x{cfg.features} (stage 1 {cfg.features}->"
              f"{cfg.hidden}, stage 2 {cfg.hidden}->{cfg.out}), {args.num_cpus} CPUs:")
        print(f"  {'1 worker (' + backend_a + ', both stages)':52s} {r1:8.1f} batches/s")
        print(f"  {'2 workers (' + backend_a + ' -> ' + backend_b + ', hand-off per batch)':52s} {r2:8.1f} batches/s")
        print(f"  ratio (2 workers / 1 worker): {r2 / r1:.2f}x; same result: {np.array_equal(acc1, acc2)}")
        if not np.array_equal(acc1, acc2):
            status = 1
    finally:
        ray.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
