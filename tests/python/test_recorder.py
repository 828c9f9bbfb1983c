"""The flight recorder from Python (docs/TRACING.md): record, trace, dump_trace, memory_snapshot on the host and
fake backends, stacks naming the caller's file, and the argument checks (TypeError / ValueError / OverflowError,
never RuntimeError)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

import devbridge

from conftest import upload

F32 = devbridge.ObjectSpec(max_extent=1 << 20, alignment=64, dtype="float32")


@pytest.fixture(params=["host", "fake"])
def recorded(request):
    b = devbridge.Bridge(backend=request.param, ring_bytes=1 << 20)
    if request.param == "fake":
        b.fake.set_auto_complete(True)  # its copies complete when submitted
    yield b
    b.close()


def instants(trace: dict, *names: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "i" and e["name"] in names]


def check_trace(trace: dict) -> None:
    """Every begin has its end on its tid, time never goes back, counters never negative."""
    assert trace["otherData"]["format"] == "devbridge-trace"
    open_slices: dict[int, list[str]] = {}
    last = 0.0
    for e in trace["traceEvents"]:
        if e["ph"] == "M":
            continue
        assert e["ts"] >= last
        last = e["ts"]
        if e["ph"] == "B":
            open_slices.setdefault(e["tid"], []).append(e["name"])
        elif e["ph"] == "E":
            assert open_slices[e["tid"]].pop() == e["name"]
        elif e["ph"] == "C":
            assert all(v >= 0 for v in e["args"].values())
    assert all(not names for names in open_slices.values())


def test_a_recorded_sequence_dumps_as_a_trace(recorded, tmp_path):
    b = recorded
    b.record(max_events=1000)
    h = b.alloc(F32, 4096)
    upload(b, h, np.arange(1024, dtype=np.float32))
    with b.view(h, "float32", (1024,)):
        pass
    b.free(h)
    trace = b.trace()
    check_trace(trace)
    assert trace["otherData"]["backend"] == b.backend
    handle = f"{h.domain}:{h.generation}:{h.id}"
    assert [e["args"]["handle"] for e in instants(trace, "allocate", "free")] == [handle, handle]
    slices = [(e["name"], e["ph"]) for e in trace["traceEvents"] if e["ph"] in "BE"]
    assert ("copy up", "B") in slices and ("view", "E") in slices
    path = tmp_path / "run.trace.json"
    b.dump_trace(path)
    dumped = json.loads(path.read_text())
    assert dumped["otherData"]["recorded_events"] == trace["otherData"]["recorded_events"]
    assert [p.name for p in tmp_path.iterdir()] == ["run.trace.json"], "no temporary file left"
    b.dump_trace(str(tmp_path / "again.json"))


def test_the_snapshot_names_blocks_and_their_holders(recorded):
    b = recorded
    b.record()
    h = b.alloc(F32, 4096)
    view = b.view(h, "float32", (16,))
    snapshot = b.memory_snapshot()
    assert snapshot["format"] == "devbridge-memory-snapshot"
    assert snapshot["stats"]["allocated_bytes"] >= 4096
    blocks = [block for segment in snapshot["segments"] for block in segment["blocks"] if "handle" in block]
    assert len(blocks) == 1
    assert blocks[0]["handle"] == f"{h.domain}:{h.generation}:{h.id}"
    assert blocks[0]["holders"]["views"] == 1
    assert blocks[0]["events"], "its allocate and its view"
    view.close()
    b.free(h)


def test_stacks_name_the_calling_file(recorded):
    b = recorded
    b.record(max_events=100, stacks=True)
    h = b.alloc(F32, 4096)
    b.free(h)
    b.stop_recording()
    for event in instants(b.trace(), "allocate", "free"):
        stack = event["args"]["stack"]
        assert "test_recorder.py:" in stack.splitlines()[0], stack
        assert "test_stacks_name_the_calling_file" in stack


def test_nothing_is_recorded_when_off(recorded):
    b = recorded
    b.free(b.alloc(F32, 4096))
    trace = b.trace()
    assert trace["otherData"]["recorded_events"] == 0
    assert not instants(trace, "allocate", "free")


def test_restart_and_close_are_recorded(recorded):
    b = recorded
    b.record(max_events=16)
    for _ in range(50):
        b.free(b.alloc(F32, 4096))
    b.restart(b.generation + 1)
    b.close()
    trace = b.trace()
    check_trace(trace)
    assert trace["otherData"]["dropped_events"] == trace["otherData"]["recorded_events"] - 16
    assert [e["name"] for e in instants(trace, "restart", "close")] == ["restart", "close"]


def test_out_of_memory_dumps_the_trace_and_names_it(tmp_path):
    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 20, memory_bytes=1 << 20)
    try:
        b.record(oom_dump_dir=tmp_path)
        h = b.alloc(F32, 1 << 19)
        with pytest.raises(devbridge.AllocationFailed) as failure:
            b.alloc(F32, 1 << 20)
        message = str(failure.value)
        assert "fragmentation" in message
        assert "the largest holders" in message
        dumped = list(tmp_path.iterdir())
        assert len(dumped) == 1 and str(dumped[0]) in message
        check_trace(json.loads(dumped[0].read_text()))
        b.free(h)
    finally:
        b.close()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"max_events": "10"}, TypeError),
        ({"max_events": 1.5}, TypeError),
        ({"max_events": -1}, OverflowError),
        ({"max_events": 1 << 64}, OverflowError),
        ({"max_events": 0}, ValueError),
        ({"max_events": (1 << 24) + 1}, ValueError),
        ({"stacks": 1}, TypeError),
        ({"oom_dump_dir": 3}, TypeError),
    ],
)
def test_argument_errors(fake_bridge, kwargs, error):
    with pytest.raises(error):
        fake_bridge.record(**kwargs)


def test_dump_trace_takes_paths_only(fake_bridge, tmp_path):
    with pytest.raises(TypeError):
        fake_bridge.dump_trace(3)
    fake_bridge.dump_trace(pathlib.Path(tmp_path) / "empty.json")
    assert json.loads((tmp_path / "empty.json").read_text())["otherData"]["recorded_events"] == 0


def test_the_torch_layout_is_read_by_pytorchs_memory_viz(tmp_path):
    """memory_snapshot(layout="torch") is what torch.cuda.memory._snapshot() returns: PyTorch's own summaries of a
    snapshot (torch.cuda._memory_viz) read it, its segments add up, and its history pairs each alloc with its
    frees; pickled, it is the file https://pytorch.org/memory_viz opens."""
    memory_viz = pytest.importorskip("torch.cuda._memory_viz")
    b = devbridge.Bridge(backend="host", ring_bytes=1 << 20, caching_pool=True)
    try:
        b.record(max_events=1000, stacks=True)
        kept = b.alloc(F32, 4096)
        freed = b.alloc(F32, 8192)
        b.free(freed)
        held = b.alloc(F32, 4096)
        view = b.view(held, "float32", (16,))
        b.release(held)  # freed once the view ends: a pending free meanwhile
        snapshot = b.memory_snapshot(layout="torch")
        ours = b.memory_snapshot()

        assert sum(s["total_size"] for s in snapshot["segments"]) == ours["stats"]["reserved_bytes"]
        for segment in snapshot["segments"]:
            assert sum(block["size"] for block in segment["blocks"]) == segment["total_size"]
            addresses = [block["address"] for block in segment["blocks"]]
            assert addresses == sorted(addresses) and addresses[0] == segment["address"]
        states = sorted(block["state"] for s in snapshot["segments"] for block in s["blocks"])
        assert states.count("active_allocated") == 1 and states.count("active_pending_free") == 1
        active = [block for s in snapshot["segments"] for block in s["blocks"] if block["state"] != "inactive"]
        assert all(block["frames"] and block["frames"][0]["filename"].endswith("test_recorder.py") for block in active)
        assert {block["requested_size"] for block in active} == {4096}

        history = snapshot["device_traces"][0]
        actions = [e["action"] for e in history]
        assert actions == ["alloc", "alloc", "free_requested", "free_completed", "alloc", "free_requested"]
        assert [(e["addr"], e["size"]) for e in history[1:4]] == [(history[1]["addr"], 8192)] * 3
        assert history[4]["addr"] == history[1]["addr"], "the pool gave the freed block to the next allocation"

        summary = memory_viz.segsum(snapshot)
        assert "Segment size mismatch" not in summary
        assert "segments: " in summary
        text = memory_viz.trace(snapshot)
        assert "del " in text and "free completed" in text
        assert "test_recorder.py" in "".join(memory_viz.memory(snapshot, format_flamegraph=lambda lines: lines))
        assert memory_viz.trace_plot(snapshot).startswith("\n<!DOCTYPE html>")  # the pickle the page loads
        view.close()
    finally:
        b.close()


@pytest.mark.parametrize("layout, error", [(3, TypeError), (None, TypeError), ("pytorch", ValueError)])
def test_the_snapshot_layout_is_checked(fake_bridge, layout, error):
    with pytest.raises(error, match="layout"):
        fake_bridge.memory_snapshot(layout=layout)
