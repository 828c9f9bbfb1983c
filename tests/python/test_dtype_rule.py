"""Storage is not compute (CONTRACT.md, Version 3): every device holds every dtype, and only a call
that computes is refused for a dtype the device does not compute in.

PoCL on a CPU has no cl_khr_fp16: OpenCL there used to refuse to hold float16, so a float16 tensor
could not be uploaded or a float16 checkpoint restored onto it. It now holds it, bit-exact, and says
separately that it does not compute in it.
"""

from __future__ import annotations

import numpy as np
import pytest

import devbridge
from conftest import require_backend


def half_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random float16 bit patterns, NaNs and infinities included: bit-exact means every pattern."""
    return rng.integers(0, 1 << 16, size=n, dtype=np.uint16).view(np.float16)


@pytest.mark.parametrize("backend", ["fake", "host", "opencl"])
def test_every_backend_holds_every_dtype_and_computes_in_a_subset(backend):
    require_backend(backend)
    for device in devbridge.devices(backend):
        assert set(device["dtypes"]) == set(devbridge.dtypes())
        assert set(device["compute_dtypes"]) <= set(device["dtypes"])


def test_opencl_computes_in_half_and_double_only_with_their_extensions():
    require_backend("opencl")
    for device in devbridge.devices("opencl"):
        computed = set(device["compute_dtypes"])
        assert ("float16" in computed) == ("cl_khr_fp16" in device["capabilities"])
        assert ("float64" in computed) == ("cl_khr_fp64" in device["capabilities"])
        assert not computed & {"bfloat16", "float8_e4m3fn", "float8_e5m2"}


def test_float16_uploads_downloads_checkpoints_and_restores_bit_exact_on_opencl(tmp_path):
    require_backend("opencl")
    a = half_bits(np.random.default_rng(16), 17 * 241).reshape(17, 241)
    with devbridge.Bridge(backend="opencl", ring_bytes=4 << 20) as b:
        x = b.upload(a, wait=True)
        assert x.dtype == "float16"
        assert b.download(x).view(np.uint16).tobytes() == a.view(np.uint16).tobytes()
        path = tmp_path / "half.safetensors"
        b.checkpoint(path, {"x": x})
        x.free()
        restored = b.restore(path)["x"]
        assert restored.dtype == "float16" and restored.shape == (17, 241)
        assert b.download(restored).view(np.uint16).tobytes() == a.view(np.uint16).tobytes()
        restored.free()


def test_a_dtype_not_held_is_still_refused_where_it_enters():
    b = devbridge.Bridge(backend="fake", dtypes="uint8,float32")
    try:
        with pytest.raises(devbridge.UnsupportedDType, match="does not hold float16"):
            b.upload(np.zeros(4, np.float16))
        assert b.backend_info()["compute_dtypes"] == ["uint8", "float32"]
    finally:
        b.close()


def test_a_typed_view_goes_to_tinygrad_only_in_a_dtype_the_device_computes_in():
    require_backend("opencl")
    pytest.importorskip("tinygrad")
    with devbridge.Bridge(backend="opencl", ring_bytes=1 << 20) as b:
        if "float16" in b.backend_info()["compute_dtypes"]:
            pytest.skip("this OpenCL device has cl_khr_fp16")
        x = b.upload(half_bits(np.random.default_rng(3), 256), wait=True)
        with x.view() as v:  # a view is bytes: it is made
            assert v.dtype == "float16"
            with pytest.raises(devbridge.UnsupportedDType, match="holds float16 but does not compute in it"):
                v.to_tinygrad()
        assert b.stats()["live_views"] == 0
        x.free()
