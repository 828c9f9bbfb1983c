"""The crash-flow child of test_portable.py: a worker that checkpoints, then is killed with SIGKILL.

    python portable_child.py BACKEND PATH SEED

Uploads the tensors ``tensors_for(seed)`` describes, checkpoints them to PATH,
prints "ready" (the parent may kill it from then on) and keeps checkpointing
to PATH, alternating the data of SEED and SEED + 1, until it is killed. A kill
lands at any point of a checkpoint: the atomic write must leave PATH holding
one whole checkpoint.
"""

from __future__ import annotations

import sys

import numpy as np

import devbridge

RING = 1 << 20


def tensors_for(seed: int) -> dict[str, tuple[np.ndarray, str]]:
    """The checkpoint's tensors for ``seed``: ``{name: (bits as numpy, devbridge dtype)}``, some larger
    than the ring."""
    rng = np.random.default_rng(seed)
    shapes = {"weights": ((700, 513), "float32"), "bias": ((513,), "bfloat16"), "steps": ((), "int64"),
              "mask": ((97, 31), "bool"), "table": ((300, 1024), "int16")}
    out = {}
    for name, (shape, dtype) in shapes.items():
        info = devbridge.dtype_info(dtype)
        bits = np.dtype(f"uint{info['itemsize'] * 8}")
        if dtype == "bool":
            array = rng.integers(0, 2, size=shape, dtype=np.uint8).view(np.bool_)
        else:
            array = rng.integers(0, np.iinfo(bits).max, size=shape, dtype=bits, endpoint=True)
        out[name] = (array, dtype)
    return out


def main() -> None:
    backend, path, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    bridge = devbridge.Bridge(backend=backend, ring_bytes=RING)
    if backend == "fake":
        bridge.fake.set_auto_complete(True)
    versions = []
    for s in (seed, seed + 1):
        versions.append({name: bridge.upload(array, dtype=dtype, wait=True)
                         for name, (array, dtype) in tensors_for(s).items()})
    bridge.checkpoint(path, versions[0])
    print("ready", flush=True)
    round_ = 1
    while True:
        bridge.checkpoint(path, versions[round_ % 2])
        round_ += 1


if __name__ == "__main__":
    main()
