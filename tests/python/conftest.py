"""Shared fixtures of the devbridge Python suite.

Backends: tests that can run on any real backend are parametrized over
``host`` and ``cuda``. ``cuda`` runs only when DEVBRIDGE_TEST_BACKEND=cuda
(the GPU check sets it); there it must work, so an unavailable CUDA backend
fails the run instead of skipping it. Elsewhere the cuda cases are skipped
with the reason. Fault-injection tests use the ``fake`` backend directly.

Data: random, never constant (a zero-filled buffer cannot tell a copy that
happened from one that did not). Each test's seed is printed on failure.
"""

from __future__ import annotations

import gc
import time
import importlib.util
import os
import pathlib
import secrets

import numpy as np
import pytest

import devbridge

REQUESTED_BACKEND = os.environ.get("DEVBRIDGE_TEST_BACKEND", "host").strip().lower() or "host"
REAL_BACKENDS = ("host", "cuda")
# The CUDA column on the emulated driver (CI, scripts/test-no-toolkit.sh): devbridge runs on it, tinygrad cannot
# (it loads its own libcuda and compiles its kernels with NVRTC).
ON_EMULATED_CUDA = "emulated_libcuda" in os.environ.get("DEVBRIDGE_LIBCUDA", "")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """On the emulated driver, a case that hands a CUDA view to tinygrad is skipped at the hand-off, saying so;
    everything before it has run. On a GPU the same refusal fails the case."""
    try:
        return (yield)
    except BaseException as error:  # pytest's own failures (DID NOT WARN) are not Exceptions
        if ON_EMULATED_CUDA and _tinygrad_refused_cuda(error):
            pytest.skip("tinygrad opens no CUDA device on the emulated driver (a GPU runs this case to the end)")
        raise


def _tinygrad_refused_cuda(error: BaseException | None) -> bool:
    """Whether the refusal is in the chain (a ``pytest.warns`` or ``raises`` around the hand-off reports its own)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, devbridge.Unavailable) and "tinygrad's CUDA device is not usable here" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _backend_available(name: str) -> tuple[bool, str]:
    for entry in devbridge.list_backends():
        if entry["name"] == name:
            return entry["available"], entry["reason"]
    return False, f"backend {name!r} is not in this build"


def require_backend(name: str) -> None:
    """Skips a test whose backend cannot run here; fails it when that backend is DEVBRIDGE_TEST_BACKEND's."""
    if name == "cuda" and REQUESTED_BACKEND != "cuda":
        pytest.skip("CUDA cases run with DEVBRIDGE_TEST_BACKEND=cuda on a machine with an NVIDIA GPU")
    available, reason = _backend_available(name)
    if not available:
        if name == REQUESTED_BACKEND:
            pytest.fail(f"DEVBRIDGE_TEST_BACKEND={name} but the backend is unavailable: {reason}")
        pytest.skip(reason)


def require_dtype(b: devbridge.Bridge, dtype: str) -> None:
    """Skips unless `b`'s device holds `dtype` (every device holds every dtype; only the fake's `dtypes`
    option narrows it, which test_devices.py checks)."""
    if dtype not in b.backend_info()["dtypes"]:
        pytest.skip(f"{b.backend}'s device does not hold {dtype}")


def make_bridge(backend: str, **options) -> devbridge.Bridge:
    """A bridge on `backend`; CUDA bridges share tinygrad's context (when tinygrad is there) so tinygrad
    can compute on their memory; without tinygrad they use the device's primary context."""
    if backend == "cuda" and "cuda_context" not in options and importlib.util.find_spec("tinygrad") is not None:
        try:
            return devbridge.Bridge(backend=backend, cuda_context="tinygrad", **options)
        except devbridge.Unavailable:
            pass  # tinygrad has no CUDA device here (the emulated driver): the device's primary context
    return devbridge.Bridge(backend=backend, **options)


@pytest.fixture(params=REAL_BACKENDS)
def backend_name(request) -> str:
    name = request.param
    if name == "host" and REQUESTED_BACKEND not in ("host", "cuda"):
        pytest.skip(f"DEVBRIDGE_TEST_BACKEND={REQUESTED_BACKEND}")
    require_backend(name)
    return name


@pytest.fixture(autouse=True, scope="module")
def _collector_walks_only_this_module():
    """Freezes what is alive as a test module starts (gc.freeze): the libraries imported so far (numpy, jax,
    torch, tinygrad, ray: ~300k objects) and what earlier modules kept. The fixtures' gc.collect() calls, which
    end leases held by garbage, then walk only this module's objects instead of the whole heap each time (that
    walk was most of the suite's time). Garbage made before this point was collected first."""
    gc.collect()
    gc.freeze()
    yield


def pytest_sessionfinish(session, exitstatus):
    """Frozen objects are out of the collector's reach at exit too: give them back, so that what became garbage
    since is freed before the interpreter ends (nanobind reports any instance still alive then as a leak)."""
    gc.unfreeze()
    gc.collect()


@pytest.fixture
def emulated_libcuda() -> pathlib.Path:
    """The emulated CUDA driver the C++ build makes (tests/cuda/emulated_libcuda.cpp), for DEVBRIDGE_LIBCUDA in a
    child process; the test is skipped where it is not built."""
    root = pathlib.Path(__file__).resolve().parents[2]
    for build in ("release", "no-toolkit", "debug", "asan"):
        candidate = root / "build" / build / "tests" / "cuda" / "libdevbridge_emulated_libcuda.so"
        if candidate.exists():
            return candidate
    pytest.skip("the emulated libcuda is built with the C++ tests (build/<preset>/tests/cuda)")


@pytest.fixture
def bridge(backend_name):
    b = make_bridge(backend_name)
    yield b
    gc.collect()  # end leases held by garbage (tinygrad buffers, numpy arrays) before closing
    b.close()


@pytest.fixture
def fake_bridge():
    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 20)
    yield b
    gc.collect()
    b.close()


@pytest.fixture
def rng(request) -> np.random.Generator:
    seed = int(os.environ.get("DEVBRIDGE_TEST_SEED", secrets.randbits(32)))
    request.node.user_properties.append(("seed", seed))
    print(f"random seed {seed} (DEVBRIDGE_TEST_SEED={seed} reproduces)")
    return np.random.default_rng(seed)


def random_array(rng: np.random.Generator, shape, dtype="float32") -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def upload(b: devbridge.Bridge, handle, data: np.ndarray, offset: int = 0, mode: str = "async"):
    """Reserves a ring range, fills it with `data`, copies it to the device, waits, releases the range."""
    r = b.ring.reserve(data.nbytes)
    b.ring.ndarray(r, data.dtype)[:] = data.ravel()
    event = b.host_to_device(r, handle, offset, mode=mode)
    assert b.wait(event) == "completed"
    b.ring.release(r)
    return event


def download(b: devbridge.Bridge, handle, nbytes: int, dtype="uint8", offset: int = 0, mode: str = "async") -> np.ndarray:
    """Copies `nbytes` from the device into a fresh ring range and returns a copy of them."""
    r = b.ring.reserve(nbytes)
    b.ring.ndarray(r, "uint8")[:] = 0x5A  # a pattern the device data will not match by chance
    event = b.device_to_host(handle, r, offset, mode=mode)
    assert b.wait(event) == "completed"
    assert b.host_bytes_valid(event)
    out = b.ring.ndarray(r, dtype).copy()
    b.ring.release(r)
    return out


def same_bits(a, b) -> bool:
    """Same shape and bytes. A bfloat16 reads as its uint16 bits, or as ml_dtypes' bfloat16 where devbridge
    hands that out; the bytes are what must not change."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize and a.tobytes() == b.tobytes()


def run_in_threads(work, count: int, timeout: float = 300.0) -> list[BaseException]:
    """Runs ``work()`` on ``count`` threads at once and joins them (each within ``timeout``: a thread still
    running fails the test as a hang); returns what they raised."""
    import threading

    failures: list[BaseException] = []

    def guarded():
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - handed to the test's assertion
            failures.append(error)

    threads = [threading.Thread(target=guarded) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread is still waiting"
    return failures


def collect() -> None:
    """Runs the garbage collector until tinygrad's weak references settle."""
    for _ in range(3):
        gc.collect()


def views_settle(b: devbridge.Bridge, expected: int = 0, timeout: float = 30.0) -> int:
    """The bridge's ``live_views`` once it reaches ``expected`` (or ``timeout`` seconds passed), collecting garbage
    meanwhile: a consumer may end its lease on a thread of its own after the array is gone (jax's runtime drops an
    imported buffer once the computations that read it have finished, not when the last Python reference goes)."""
    deadline = time.monotonic() + timeout
    while True:
        collect()
        live = b.stats()["live_views"]
        if live == expected or time.monotonic() >= deadline:
            return live
        time.sleep(0.01)


def auto_bridge(backend: str, **options):
    """For fixtures (``yield from``): a bridge on ``backend`` (the test skipped where it cannot run) whose
    fake, if it is one, completes copies as they are submitted; closed after the test, garbage collected first."""
    require_backend(backend)
    b = make_bridge(backend, **options)
    if backend == "fake":
        b.fake.set_auto_complete(True)
    yield b
    collect()
    b.close()
