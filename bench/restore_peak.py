#!/usr/bin/env python3
"""Peak host memory of one restore beyond the restored tensors, in a process of its own.

    python bench/restore_peak.py FILE RING_BYTES

Restores FILE on the host backend (whose device memory is the process's own,
so the tensors count as resident) with a ring of RING_BYTES, and prints two
integers: the rise of the process's peak resident memory (VmHWM, restarted
from what is resident once the bridge is open) across the restore, and the
bytes of the tensors restored. Their difference is what the restore held
beyond its tensors: the ring, the reader's buffers, a map of the file if it
made one. Used by checkpoint_bench.py (--peak-gib) and
tests/python/test_restore_stream.py.
"""

from __future__ import annotations

import sys

import devbridge


def kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def main() -> None:
    path, ring = sys.argv[1], int(sys.argv[2])
    bridge = devbridge.Bridge(backend="host", ring_bytes=ring)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM starts again from what is resident now
    before = kib("VmRSS")
    restored = bridge.restore(path)
    print((kib("VmHWM") - before) * 1024, sum(t.nbytes for t in restored.values()))


if __name__ == "__main__":
    main()
