"""Devices and the dtypes they hold: devbridge.devices(), Bridge(device=..., **options) through the
registry, and UnsupportedDType wherever a dtype enters a bridge (alloc, view, upload, import, restore)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import devbridge
from conftest import require_backend

EVERY_BACKEND = ("fake", "host", "opencl", "cuda")


@pytest.mark.parametrize("name", EVERY_BACKEND)
def test_every_listed_device_binds_again_by_its_id(name):
    listed = devbridge.devices(name)
    available = {b["name"]: b["available"] for b in devbridge.list_backends()}
    assert bool(listed) == available.get(name, False)
    for device in listed:
        assert device["name"] == name and device["device_id"] and device["dtypes"]
        assert isinstance(device["capabilities"], list) and isinstance(device["pci_bus_id"], str)
        with devbridge.Bridge(backend=name, device=device["device_id"]) as b:
            assert b.backend_info()["device_id"] == device["device_id"]


def test_info_is_one_line_per_backend_and_each_that_cannot_run_says_what_to_install():
    rows = devbridge.list_backends()
    lines = devbridge.info().splitlines()
    assert [line.split()[0] for line in lines] == [row["name"] for row in rows]
    # Every build has every backend: none needs a vendor SDK to build.
    assert sorted(row["name"] for row in rows) == sorted(EVERY_BACKEND) and all(row["built"] for row in rows)
    for row, line in zip(rows, lines):
        assert line.endswith("  " + row["summary"])
        if row["available"]:
            assert row["summary"] == "available" and not row["remedy"]
        else:
            assert row["reason"] and row["remedy"] and row["summary"].endswith("; to use it: " + row["remedy"])


def info_in_a_child(**env: str) -> dict[str, str]:
    """devbridge.info() of a fresh process (drivers are loaded once per process), by backend name."""
    result = subprocess.run([sys.executable, "-c", "import devbridge; print(devbridge.info())"],
                            env=dict(os.environ, **env), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(line.split(None, 1) for line in result.stdout.splitlines())


def test_without_drivers_info_names_the_library_it_tried_and_what_to_install(tmp_path):
    libcuda, libopencl = tmp_path / "libcuda.so.1", tmp_path / "libOpenCL.so.1"
    lines = info_in_a_child(DEVBRIDGE_LIBCUDA=str(libcuda), DEVBRIDGE_LIBOPENCL=str(libopencl))
    assert lines["cuda"].startswith(f"unavailable: CUDA: no driver ({libcuda}: cannot open"), lines["cuda"]
    assert "to use it: install the NVIDIA driver" in lines["cuda"] and "DEVBRIDGE_LIBCUDA" in lines["cuda"]
    assert lines["opencl"].startswith(f"unavailable: OpenCL: no OpenCL ICD loader ({libopencl}: cannot open")
    assert "ocl-icd-libopencl1" in lines["opencl"] and "pocl-opencl-icd" in lines["opencl"]
    assert lines["host"] == "available" and lines["fake"] == "available"


def test_an_icd_loader_that_finds_no_driver_says_which_drivers_to_install(tmp_path):
    require_backend("opencl")  # the ICD loader is there (ocl-icd reads $OCL_ICD_VENDORS for its drivers)
    lines = info_in_a_child(OCL_ICD_VENDORS=str(tmp_path))
    assert lines["opencl"].startswith("unavailable: OpenCL: no OpenCL platform") and str(tmp_path) in lines["opencl"]
    assert "to use it: install an OpenCL driver" in lines["opencl"] and "pocl-opencl-icd" in lines["opencl"]


@pytest.mark.parametrize("emulated, reason, remedy", [
    ({"DEVBRIDGE_EMULATED_CUDA_DRIVER_VERSION": "11040"},
     "the driver (CUDA 11.4) is too old for the kernel's PTX on GPU 0: compute_90 needs PTX ISA 7.8 (CUDA 11.8)",
     "install an NVIDIA driver for CUDA 11.8 or newer"),
    ({"DEVBRIDGE_EMULATED_CUDA_CC": "61"},
     "GPU 0 has compute capability 6.1; the kernel's PTX targets 7.5 and newer",
     "use a GPU of compute capability 7.5 or newer"),
], ids=["driver-older-than-the-ptx", "gpu-older-than-the-ptx"])
def test_a_gpu_driver_that_cannot_run_the_kernel_says_what_to_install(emulated_libcuda, emulated, reason, remedy):
    lines = info_in_a_child(DEVBRIDGE_LIBCUDA=str(emulated_libcuda), **emulated)
    assert lines["cuda"] == f"unavailable: CUDA: {reason}; to use it: {remedy}"


def test_an_unknown_backend_has_no_devices_to_list():
    with pytest.raises(devbridge.Unavailable, match="unknown backend 'tpu'"):
        devbridge.devices("tpu")


def test_opencl_holds_every_dtype():
    # Storage is not compute: what it computes in is test_dtype_rule.py's.
    require_backend("opencl")
    for device in devbridge.devices("opencl"):
        assert set(device["dtypes"]) == set(devbridge.dtypes())


@pytest.mark.parametrize("options,error,match", [
    ({"device": 1.5}, TypeError, "backend option device must be a str or an int, not float"),
    ({"device": True}, TypeError, "not bool"),
    ({"inline_async_max_bytes": b"1"}, TypeError, "not bytes"),
    ({"context": 1}, devbridge.Unsupported, "backend host has no option 'context'"),
    ({"device": "1"}, devbridge.Unavailable, "no such device; this backend has one device"),
    ({"device": 0, "cuda_ordinal": 0}, ValueError, "give device or cuda_ordinal, not both"),
    ({"inline_async_max_bytes": -1}, devbridge.Unsupported, "not a non-negative integer"),
    ({"inline_async_max_bytes": 2**64}, devbridge.Unsupported, "not a non-negative integer"),
])
def test_backend_options_are_checked_by_the_backend_they_are_for(options, error, match):
    with pytest.raises(error, match=match):
        devbridge.Bridge(backend="host", **options)


def test_options_reach_the_backend():
    with devbridge.Bridge(backend="fake", device=0, memory_bytes=1 << 30, dtypes="float32,uint8") as b:
        info = b.backend_info()
        assert info["total_memory"] == 1 << 30 and info["dtypes"] == ["float32", "uint8"]
    with devbridge.Bridge(backend="host", device="0") as b:
        assert "run on the caller" in b.backend_info()["notes"]
    with devbridge.Bridge(backend="host", inline_async_max_bytes=0, device="0") as b:
        assert "run on the caller" not in b.backend_info()["notes"]
    # Integers may be any object with __index__, as every other integer argument.
    import numpy as np
    with devbridge.Bridge(backend="fake", device=np.int64(0), memory_bytes=np.uint64(1 << 30)) as b:
        assert b.backend_info()["total_memory"] == 1 << 30


@pytest.fixture
def narrow():
    """A fake device that holds float32 and uint8 only."""
    b = devbridge.Bridge(backend="fake", dtypes="float32,uint8")
    b.fake.set_auto_complete(True)
    yield b
    b.close()


def test_every_way_a_dtype_enters_refuses_one_the_device_does_not_hold(narrow, tmp_path):
    before = narrow.fake.live_allocations()
    with pytest.raises(devbridge.UnsupportedDType, match=r"dtype float64: the bridge's fake device 0 .* does not hold"):
        narrow.alloc(devbridge.ObjectSpec(1024, 8, "float64"), 1024)
    with pytest.raises(devbridge.UnsupportedDType, match="it holds: uint8, float32"):
        narrow.upload(np.zeros(16, np.float64), wait=True)
    with pytest.raises(devbridge.UnsupportedDType):
        narrow.import_tensor(devbridge.PortableTensor((4,), "int64", bytes(32)))
    with devbridge.Bridge(backend="fake") as wide:
        wide.fake.set_auto_complete(True)
        path = tmp_path / "ckpt.safetensors"
        wide.checkpoint(path, {"ok": wide.upload(np.ones(4, np.float32), wait=True),
                               "wide": wide.upload(np.ones(4, np.int64), wait=True)})
    with pytest.raises(devbridge.UnsupportedDType, match="tensor 'wide' is int64.*nothing was restored"):
        narrow.restore(path)
    assert narrow.fake.live_allocations() == before
    # What it holds still goes, and so do untyped bytes.
    t = narrow.upload(np.arange(8, dtype=np.float32), wait=True)
    assert narrow.download(t).tolist() == list(range(8))
    t.free()


def test_a_view_of_untyped_bytes_takes_only_a_dtype_the_device_holds(narrow):
    h = narrow.alloc(devbridge.ObjectSpec(1024, 8, "bytes"), 1024)
    with pytest.raises(devbridge.UnsupportedDType, match="a view of dtype int64"):
        narrow.view(h, "int64", (4,))
    with narrow.view(h, "float32", (4,)) as v:
        assert v.shape == (4,)
    narrow.free(h)


def test_a_bridge_and_its_tensors_name_the_device_they_live_on():
    with devbridge.Bridge(backend="host", device=0) as b:
        assert b.device == "host:0" and b.backend == "host"
        t = b.upload(np.ones(4, np.float32), wait=True)
        assert t.device == "host:0"
        t.free()
    with devbridge.Bridge(backend="auto") as b:  # the backend auto chose, not "auto"
        assert b.backend != "auto" and b.device.startswith(b.backend + ":")
