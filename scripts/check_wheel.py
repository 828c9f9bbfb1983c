"""Checks an installed devbridge wheel from outside the source tree (scripts/test-no-toolkit.sh runs it in a fresh
venv): every backend is compiled in, each says whether it can run here and, when not, what to install; bytes make a
round trip on the host backend and, through the emulated driver ($DEVBRIDGE_EMULATED_LIBCUDA, when given), on CUDA.
Exits non-zero with the reason on the first failure."""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np

import devbridge

EVERY_BACKEND = {"fake", "host", "cuda", "opencl"}


def fail(why: str) -> None:
    print(f"check_wheel: {why}", file=sys.stderr)
    sys.exit(1)


def round_trip(backend: str) -> None:
    values = np.arange(1 << 16, dtype=np.float32)
    with devbridge.Bridge(backend=backend) as bridge:
        back = devbridge.download(bridge, devbridge.upload(bridge, values, wait=True))
    if not np.array_equal(back, values):
        fail(f"{backend}: the bytes that came back differ from those uploaded")
    print(f"check_wheel: {backend}: 256 KiB uploaded and read back bit-exact")


def main() -> None:
    module = pathlib.Path(devbridge.__file__).resolve()
    if pathlib.Path(__file__).resolve().parents[1] in module.parents:
        fail(f"devbridge was imported from the source tree ({module}), not from the installed wheel")
    print(f"check_wheel: devbridge from {module.parent}")

    rows = {row["name"]: row for row in devbridge.list_backends()}
    if set(rows) != EVERY_BACKEND or not all(row["built"] for row in rows.values()):
        fail(f"the wheel's module should have every backend built in: {devbridge.info()}")
    for row in rows.values():
        if not row["available"] and not (row["reason"] and row["remedy"]):
            fail(f"{row['name']} cannot run here but does not say why and what to install: {row['summary']}")
    print(devbridge.info())
    round_trip("host")

    emulated = os.environ.get("DEVBRIDGE_EMULATED_LIBCUDA")
    if emulated:
        # Read when the CUDA backend is next asked for: the driver is loaded per path.
        os.environ["DEVBRIDGE_LIBCUDA"] = emulated
        cuda = next(row for row in devbridge.list_backends() if row["name"] == "cuda")
        if not cuda["available"]:
            fail(f"cuda through the emulated driver {emulated}: {cuda['summary']}")
        round_trip("cuda")


if __name__ == "__main__":
    main()
