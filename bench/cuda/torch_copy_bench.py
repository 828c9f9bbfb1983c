#!/usr/bin/env python3
"""torch's own host<->device copies, for the CUDA throughput table.

The same shape of work as cuda_copy_bench: page-locked host buffers
(``pin_memory=True``), ``copy_(..., non_blocking=True)`` of each chunk on a
dedicated stream per direction, every slot of a ``--ring-mib`` ring reused in
turn, ``--bytes-mib`` per direction per run, median of ``--repeats`` runs after
a warm-up, GB/s = 1e9 bytes/s (duplex counts both directions).

    torch_copy_bench.py [--chunks-mib 1,4,16,64] [--bytes-mib 2048] [--repeats 5]
                        [--ring-mib 512] [--json PATH]

Without torch or a CUDA device it says so and exits 0.
"""
import argparse
import json
import statistics
import sys
import time

MIB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks-mib", default="1,4,16,64")
    parser.add_argument("--bytes-mib", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ring-mib", type=int, default=512)
    parser.add_argument("--json")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks_mib.split(",") if c]

    try:
        import torch
    except ImportError:
        print("torch_copy_bench: skipped: torch is not importable")
        return 0
    if not torch.cuda.is_available():
        print("torch_copy_bench: skipped: torch sees no CUDA device")
        return 0

    half = args.ring_mib * MIB // 2
    host_up = torch.randint(0, 256, (half,), dtype=torch.uint8).pin_memory()
    host_down = torch.empty(half, dtype=torch.uint8).pin_memory()
    device_up = torch.empty(half, dtype=torch.uint8, device="cuda")
    device_down = torch.randint(0, 256, (half,), dtype=torch.uint8, device="cuda")
    upload_stream = torch.cuda.Stream()
    download_stream = torch.cuda.Stream()
    total = args.bytes_mib * MIB

    def run(chunk: int, mode: str) -> float:
        slots = half // chunk
        # Views made up front: slicing is not what is being measured.
        ups = [(device_up[i * chunk:(i + 1) * chunk], host_up[i * chunk:(i + 1) * chunk]) for i in range(slots)]
        downs = [(host_down[i * chunk:(i + 1) * chunk], device_down[i * chunk:(i + 1) * chunk]) for i in range(slots)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for n in range(total // chunk):
            slot = n % slots
            if mode != "download":
                with torch.cuda.stream(upload_stream):
                    dst, src = ups[slot]
                    dst.copy_(src, non_blocking=True)
            if mode != "upload":
                with torch.cuda.stream(download_stream):
                    dst, src = downs[slot]
                    dst.copy_(src, non_blocking=True)
        upload_stream.synchronize()
        download_stream.synchronize()
        return time.perf_counter() - start

    rows = []
    print(f"torch_copy_bench: torch {torch.__version__} on {torch.cuda.get_device_name()}")
    for chunk_mib in chunks:
        chunk = chunk_mib * MIB
        for mode in ("upload", "download", "duplex"):
            run(chunk, mode)  # warm-up
            rates = []
            for _ in range(args.repeats):
                seconds = run(chunk, mode)
                rates.append(total * (2 if mode == "duplex" else 1) / seconds / 1e9)
            rows.append({"chunk_mib": chunk_mib, "direction": mode, "torch_gbps": statistics.median(rates),
                         "torch_best_gbps": max(rates)})
            print(f"  {chunk_mib:3d} MiB {mode:8s} {statistics.median(rates):8.2f} GB/s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, out,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
