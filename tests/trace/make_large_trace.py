"""Writes a synthetic devbridge trace (docs/TRACING.md, "Trace format") of about
N events, for what a long recording costs the tools: the page's size and
drawing time, the replay's time. Deterministic (a fixed seed), standard
library only.

    make_large_trace.py OUT [EVENTS]    (EVENTS: 100000 by default)
"""
import json
import random
import sys

TRACKS = {1: "calls", 2: "copy up", 3: "copy down", 4: "compute"}


def synthetic_trace(events):
    rng = random.Random(28)
    out = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "devbridge fake synthetic"}}]
    out += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}
            for tid, name in TRACKS.items()]
    ts, next_id, live = 0.0, 1, {}
    allocated = reserved = 0
    # Each step is about 7 events: an allocation or a free, its counter sample,
    # and a copy or a launch as a slice on its track.
    while len(out) < events:
        ts += rng.uniform(0.5, 20.0)
        if live and (len(live) > 64 or rng.random() < 0.45):
            handle = rng.choice(sorted(live))
            allocated -= live.pop(handle)
            out.append({"ph": "i", "s": "t", "name": "free", "cat": "memory", "pid": 1, "tid": 1, "ts": ts,
                        "args": {"handle": handle}})
        else:
            size = 256 * rng.randint(1, 1 << rng.randint(2, 14))
            handle = f"1:1:{next_id}"
            next_id += 1
            live[handle] = size
            allocated += size
            reserved = max(reserved, allocated)
            out.append({"ph": "i", "s": "t", "name": "allocate", "cat": "memory", "pid": 1, "tid": 1, "ts": ts,
                        "args": {"handle": handle, "bytes": size, "generation": 1, "thread": 1}})
        out.append({"ph": "C", "name": "memory", "pid": 1, "ts": ts,
                    "args": {"allocated": allocated, "reserved": reserved, "cached": reserved - allocated,
                             "ring_used": rng.randint(0, 1 << 20), "in_flight": rng.randint(0, 4)}})
        tid = rng.choice([2, 3, 4])
        name = {2: "copy up", 3: "copy down", 4: "axpy"}[tid]
        cat = "compute" if tid == 4 else "copy"
        length = rng.uniform(1.0, 30.0)
        out.append({"ph": "B", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": ts,
                    "args": {"event": f"1:1:{next_id}", "bytes": 4096}})
        out.append({"ph": "E", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": ts + length,
                    "args": {"status": "completed"}})
        ts += length
    recorded = len(out) - 1 - len(TRACKS)
    return {"displayTimeUnit": "ns",
            "otherData": {"format": "devbridge-trace", "version": 1, "backend": "fake", "device": "synthetic",
                          "max_events": recorded, "recorded_events": recorded, "dropped_events": 0},
            "traceEvents": out}


def main():
    path = sys.argv[1]
    events = int(sys.argv[2]) if len(sys.argv) > 2 else 100000
    with open(path, "w") as f:
        json.dump(synthetic_trace(events), f, separators=(",", ":"))


if __name__ == "__main__":
    main()
