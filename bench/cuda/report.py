#!/usr/bin/env python3
"""The CUDA throughput table: bridge vs raw cuMemcpyAsync (cuda_copy_bench's
JSON) and, when given and present, torch pinned non_blocking copies
(torch_copy_bench.py's JSON). Prints Markdown.

    report.py BRIDGE_RAW.json [TORCH.json]
"""
import json
import os
import sys


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        bench = json.load(f)
    torch_rows = {}
    torch_label = None
    if len(sys.argv) > 2 and os.path.exists(sys.argv[2]):
        with open(sys.argv[2]) as f:
            torch_data = json.load(f)
        torch_label = f"torch {torch_data.get('torch', '?')}"
        torch_rows = {(r["chunk_mib"], r["direction"]): r["torch_gbps"] for r in torch_data["rows"]}

    gib = bench["bytes_per_run"] / (1 << 30)
    print(f"Device: {bench['device']} ({bench['notes']})  ")
    print(f"{gib:g} GiB per direction per run, median of {bench['repeats']} runs; GB/s = 1e9 bytes/s; "
          "duplex counts both directions.\n")
    header = "| chunk | direction | bridge GB/s | raw cuMemcpyAsync GB/s | bridge / raw |"
    rule = "|------:|-----------|------------:|-----------------------:|-------------:|"
    if torch_label:
        header += f" {torch_label} GB/s | bridge / torch |"
        rule += "---------:|---------:|"
    print(header)
    print(rule)
    for r in bench["rows"]:
        line = (f"| {r['chunk_mib']} MiB | {r['direction']} | {r['bridge_gbps']:.2f} | {r['raw_gbps']:.2f} | "
                f"{r['bridge_gbps'] / r['raw_gbps']:.3f} |")
        if torch_label:
            t = torch_rows.get((r["chunk_mib"], r["direction"]))
            line += f" {t:.2f} | {r['bridge_gbps'] / t:.3f} |" if t else " - | - |"
        print(line)
    failures = bench.get("failures", [])
    print()
    print("Bars (chunks >= 4 MiB): bridge >= 0.95 x raw; duplex >= 1.6 x mean(upload, download): "
          + ("all met" if not failures else "MISSED: " + "; ".join(failures)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
