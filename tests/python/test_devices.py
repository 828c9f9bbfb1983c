"""Devices and the dtypes they hold: devbridge.devices(), Bridge(device=..., **options) through the
registry, and UnsupportedDType wherever a dtype enters a bridge (alloc, view, upload, import, restore)."""

from __future__ import annotations

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
    ({"device": "1"}, devbridge.Unsupported, "this backend has one device"),
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
