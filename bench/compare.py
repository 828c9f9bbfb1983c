#!/usr/bin/env python3
"""Sets devbridge's replay of workloads a-f beside the Rust reference's.

Both programs print the same machine-readable lines:
    workload=<name> ns_per_op=<float>
    peak_rss_kib=<int>
    # f_growth_d_4e6: ... vm_rss_kib_with_4000000_copies_live=<int> ...
This prints one table: workload | devbridge ns/op | reference ns/op | ratio
(devbridge/reference) | target | pass/fail, then memory after workload f.
The verdicts are information for the reader; the exit status never depends on
time (it is 1 only when devbridge's output reports a failed workload or is
missing). Python standard library only.

Both options may be given several times: outputs of runs interleaved in
time (reference, devbridge, reference, devbridge, ...). Each workload's
figure is then the median over the runs that have it, so a slow spell of
the machine (common on a shared VM) lands on both sides instead of on one.
Memory figures come from the first output that has them.

Usage: compare.py --devbridge OUT [--devbridge OUT ...] [--reference OUT ...]
"""

import argparse
import re
import statistics
import sys

# Issue 2, "Done when": a-d at most a third of the reference, e no more than it.
TARGETS = {
    "a_alloc_free": 1.0 / 3.0,
    "b_steady_fifo_1024": 1.0 / 3.0,
    "c_sync_h2d_d2h_per_copy": 1.0 / 3.0,
    "d_async_observe_release": 1.0 / 3.0,
    "e_wrap_for_tinygrad": 1.0,
}
ORDER = list(TARGETS) + [
    "f_growth_d_1e5",
    "f_growth_d_1e6",
    "f_growth_d_4e6",
    "f_growth_d_1e5_last100k",
    "f_growth_d_1e6_last100k",
    "f_growth_d_4e6_last100k",
]
# "Flat" memory: RSS with 4e6 copies made may exceed RSS with 1e5 copies by at
# most this much (the reference grows by ~250 MiB over the same span).
FLAT_SLACK_KIB = 4 * 1024

WORKLOAD_RE = re.compile(r"^workload=(\S+) (ns_per_op|error)=(\S+)")
RSS_RE = re.compile(r"^# (f_growth_d_\w+):.*vm_rss_kib_with_(\d+)_copies_live=(\d+)")
REPS_RE = re.compile(r"\breps=(\d+)")
RECORDS_RE = re.compile(r"^# (f_growth_d_\w+):.*copy_records=(\d+)")


def parse(path):
    result = {"ns": {}, "errors": set(), "rss": {}, "records": {}, "peak": None, "reps": None}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            m = WORKLOAD_RE.match(line)
            if m:
                if m.group(2) == "error":
                    result["errors"].add(m.group(1))
                else:
                    result["ns"][m.group(1)] = float(m.group(3))
                continue
            m = RSS_RE.match(line)
            if m:
                result["rss"][m.group(1)] = int(m.group(3))
            m = RECORDS_RE.match(line)
            if m:
                result["records"][m.group(1)] = int(m.group(2))
            m = REPS_RE.search(line)
            if line.startswith("#") and m and result["reps"] is None:
                result["reps"] = int(m.group(1))
            if line.startswith("peak_rss_kib="):
                result["peak"] = int(line.split("=", 1)[1])
    return result


def merge(results):
    """One result from several runs: median ns per workload, the rest from the first run that has it."""
    merged = {"ns": {}, "errors": set(), "rss": {}, "records": {}, "peak": None, "reps": None, "runs": {}}
    for result in results:
        merged["errors"] |= result["errors"]
        for key in ("rss", "records"):
            for name, value in result[key].items():
                merged[key].setdefault(name, value)
        for key in ("peak", "reps"):
            if merged[key] is None:
                merged[key] = result[key]
    names = {name for result in results for name in result["ns"]}
    for name in names:
        values = [result["ns"][name] for result in results if name in result["ns"]]
        merged["ns"][name] = statistics.median(values)
        merged["runs"][name] = len(values)
    return merged


def fmt_ns(value):
    return "-" if value is None else f"{value:.2f}"


def fmt_mib(kib):
    return "-" if kib is None else f"{kib / 1024:.1f} MiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devbridge", required=True, action="append",
                        help="output of build/.../bench/bridge_workloads (repeatable)")
    parser.add_argument("--reference", action="append", default=[],
                        help="output of the seed-rust bench (repeatable; omit when cargo is missing)")
    args = parser.parse_args()

    try:
        dev = merge([parse(path) for path in args.devbridge])
    except OSError as e:
        print(f"compare: cannot read devbridge output: {e}")
        return 1
    ref = None
    if args.reference:
        try:
            ref = merge([parse(path) for path in args.reference])
        except OSError as e:
            print(f"compare: cannot read reference output ({e}); devbridge's figures alone")

    header = ("workload", "devbridge ns/op", "reference ns/op", "ratio", "target", "result", "runs")
    rows = []
    for name in ORDER:
        d = dev["ns"].get(name)
        r = ref["ns"].get(name) if ref else None
        if d is None and r is None and name not in dev["errors"]:
            continue
        ratio = d / r if (d is not None and r) else None
        target = TARGETS.get(name)
        if name in dev["errors"]:
            verdict = "ERROR"
        elif target is None:
            verdict = "info"
        elif ratio is None:
            verdict = "n/a"
        else:
            verdict = "pass" if ratio <= target + 1e-9 else "FAIL"
        rows.append((
            name,
            "error" if name in dev["errors"] else fmt_ns(d),
            fmt_ns(r),
            "-" if ratio is None else f"{ratio:.3f}",
            "-" if target is None else f"<= {target:.3f}",
            verdict,
            f"{dev['runs'].get(name, 0)}/{ref['runs'].get(name, 0) if ref else 0}",
        ))

    widths = [max(len(str(row[i])) for row in rows + [header]) for i in range(len(header))]
    aligns = ["<", ">", ">", ">", ">", "<", ">"]

    def line(cells):
        return " | ".join(f"{str(c):{a}{w}}" for c, a, w in zip(cells, aligns, widths))

    print()
    reps = dev["reps"] if dev["reps"] is not None else "?"
    print(f"== devbridge vs seed-rust reference (null backend, ns per op: in each run the median of {reps} "
          "repetitions; over runs, the median; runs = devbridge/reference runs with the workload) ==")
    print(line(header))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(line(row))

    # Memory after workload f.
    print()
    print("memory after workload f (VmRSS while the bridge that made N copies is alive):")
    for label, n in (("1e5", 100_000), ("1e6", 1_000_000), ("4e6", 4_000_000)):
        key = f"f_growth_d_{label}"
        d_rss = dev["rss"].get(key)
        r_rss = ref["rss"].get(key) if ref else None
        records = dev["records"].get(key)
        extra = f", devbridge copy_records={records}" if records is not None else ""
        print(f"  {n:>9,} copies: devbridge {fmt_mib(d_rss):>12} | reference {fmt_mib(r_rss):>12}{extra}")
    d_peak = dev["peak"]
    r_peak = ref["peak"] if ref else None
    print(f"  peak RSS (VmHWM): devbridge {fmt_mib(d_peak)} | reference {fmt_mib(r_peak)} "
          "(reference: ~261 MB from never-removed copy records)")
    low, high = dev["rss"].get("f_growth_d_1e5"), dev["rss"].get("f_growth_d_4e6")
    if low is not None and high is not None:
        growth = high - low
        verdict = "pass (flat)" if growth <= FLAT_SLACK_KIB else "FAIL (grows)"
        print(f"  devbridge growth 1e5 -> 4e6 copies: {growth / 1024:+.1f} MiB (flat = at most "
              f"{FLAT_SLACK_KIB // 1024} MiB): {verdict}")

    if ref is None:
        print("\n(no reference figures: devbridge's alone)")
    if dev["errors"]:
        print(f"\ncompare: devbridge workloads failed: {', '.join(sorted(dev['errors']))}")
        return 1
    if not dev["ns"]:
        print("\ncompare: no devbridge figures found")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
