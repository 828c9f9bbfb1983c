"""The flight recorder from Python (docs/TRACING.md): record, trace, dump_trace, memory_snapshot on the host and
fake backends, stacks naming the caller's file, and the argument checks (TypeError / ValueError / InvalidRange,
never RuntimeError)."""

from __future__ import annotations

import json
import os
import pathlib
import threading
import time

import numpy as np
import pytest

import devbridge

from conftest import run_in_threads, upload

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


def test_max_events_none_is_the_default(fake_bridge):
    fake_bridge.record(max_events=None)
    assert fake_bridge.trace()["otherData"]["max_events"] == 100000


def test_close_records_its_own_stack_not_the_last_calls(fake_bridge):
    # close() (and a with-block's end) do not pass through the check every other call makes, which attaches the
    # caller's stack: the close and the frees it makes carried the stack of the thread's previous call.
    b = fake_bridge
    b.record(max_events=100, stacks=True)
    h = b.alloc(F32, 4096)  # the previous call: its line must not be what close records

    def closing_here():
        b.close()

    closing_here()
    for event in instants(b.trace(), "close"):
        assert "closing_here" in event["args"]["stack"], event["args"]["stack"]
    assert h is not None


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


def test_the_memory_snapshot_answers_after_close_with_what_views_still_hold(recorded):
    # A post-mortem: after close() the snapshot (both layouts) shows what a consumer still holds, as stats(),
    # memory_stats() and dump_trace() do; it raised Closed.
    b = recorded
    b.record(max_events=1000)
    t = b.upload(np.arange(1024, dtype=np.float32), wait=True)
    held = np.from_dlpack(t.view())
    b.close()
    snapshot = b.memory_snapshot()
    assert snapshot["stats"] == b.memory_stats()
    assert b.stats()["orphaned_allocations"] == 1
    assert "segments" in b.memory_snapshot(layout="torch")
    del held


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
        # A loop running out of memory over and over is pointed at that dump for a second, not given a file
        # each time (three threads retrying wrote 15,000 files in 6 s).
        for _ in range(20):
            with pytest.raises(devbridge.AllocationFailed) as again:
                b.alloc(F32, 1 << 20)
        assert f"{dumped[0]} (written under 1 s ago: one dump a second at most)" in str(again.value)
        assert list(tmp_path.iterdir()) == dumped
        time.sleep(1.1)
        with pytest.raises(devbridge.AllocationFailed):
            b.alloc(F32, 1 << 20)
        assert len(list(tmp_path.iterdir())) == 2
        b.free(h)
    finally:
        b.close()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"max_events": "10"}, TypeError),
        ({"max_events": 1.5}, TypeError),
        ({"max_events": -1}, devbridge.InvalidRange),  # every size the ring cannot have (TRACING.md)
        ({"max_events": 1 << 64}, devbridge.InvalidRange),
        ({"max_events": 0}, devbridge.InvalidRange),
        ({"max_events": (1 << 24) + 1}, devbridge.InvalidRange),
        ({"max_events": True}, TypeError),
        ({"stacks": 1}, TypeError),
        ({"oom_dump_dir": 3}, TypeError),
    ],
)
def test_argument_errors(fake_bridge, kwargs, error):
    with pytest.raises(error):
        fake_bridge.record(**kwargs)


def test_memory_snapshot_layout_none_is_the_default_layout(fake_bridge):
    """PYTHON.md documents memory_snapshot(layout=None); None was a TypeError."""
    assert fake_bridge.memory_snapshot(layout=None)["format"] == fake_bridge.memory_snapshot()["format"]
    with pytest.raises(ValueError, match="devbridge"):
        fake_bridge.memory_snapshot(layout="pytorch")


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


@pytest.mark.parametrize("layout, error", [(3, TypeError), (b"torch", TypeError), ("pytorch", ValueError)])
def test_the_snapshot_layout_is_checked(fake_bridge, layout, error):
    with pytest.raises(error, match="layout"):
        fake_bridge.memory_snapshot(layout=layout)


def test_stacks_keep_file_names_utf8_cannot_hold_or_that_break_lines(fake_bridge):
    """A script run from a directory whose name is not UTF-8 (os.fsdecode gives lone surrogates) or with a line
    break in its name: each frame stays one line, the bytes escaped, and nothing crashes."""
    fake_bridge.record(max_events=100, stacks=True)
    names = ["caf\udce9/run.py", "two\nlines\u2028.py"]
    for name in names:
        exec(compile("b.free(b.alloc(F32, 4096))", name, "exec"), {"b": fake_bridge, "F32": F32})
    stacks = [e["args"]["stack"] for e in instants(fake_bridge.trace(), "allocate")]
    assert len(stacks) == 2
    assert stacks[0].split("\n")[0] == "caf\\udce9/run.py:1 <module>", stacks[0]
    assert stacks[1].split("\n")[0] == "two\\nlines\u2028.py:1 <module>", stacks[1]
    history = fake_bridge.memory_snapshot(layout="torch")["device_traces"][0]
    allocs = [e for e in history if e["action"] == "alloc"]
    assert [frame["filename"] for frame in allocs[0]["frames"][:1]] == ["caf\\udce9/run.py"]
    assert [frame["filename"] for frame in allocs[1]["frames"][:1]] == ["two\\nlines\u2028.py"]


def test_dump_trace_writes_any_file_name_and_refuses_an_empty_one(fake_bridge, tmp_path):
    name = tmp_path / "tr\udcff.json"  # the bytes b"tr\xff.json", as os.listdir would give them
    fake_bridge.dump_trace(name)
    assert b"tr\xff.json" in os.listdir(bytes(tmp_path))
    with pytest.raises(ValueError, match="empty"):
        fake_bridge.dump_trace("")


def test_dumps_to_one_path_at_once_each_write_a_whole_file(fake_bridge, tmp_path):
    fake_bridge.record(max_events=1000)
    for _ in range(100):
        fake_bridge.free(fake_bridge.alloc(F32, 4096))
    path = tmp_path / "race.json"

    def dump():
        for _ in range(20):
            fake_bridge.dump_trace(path)

    errors = run_in_threads(dump, 4)
    assert not errors, errors
    check_trace(json.loads(path.read_text()))
    assert [p.name for p in tmp_path.iterdir()] == ["race.json"], "no temporary file left"


def test_an_oom_dump_dir_that_cannot_take_the_dump_is_refused_when_recording_starts(fake_bridge, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    # /proc takes no new file, though access(2) says it does to root.
    for directory in (tmp_path / "missing", a_file, pathlib.Path("/proc")):
        with pytest.raises(devbridge.Unavailable, match=str(directory)):
            fake_bridge.record(oom_dump_dir=directory)
    fake_bridge.free(fake_bridge.alloc(F32, 4096))
    assert not instants(fake_bridge.trace(), "allocate"), "recording did not start"


def test_the_torch_layout_leaves_out_the_ends_of_allocations_made_before_recording(fake_bridge):
    """PyTorch's viewer adds each free to nothing it knows: an end without its start would count below zero."""
    before = fake_bridge.alloc(F32, 4096)
    fake_bridge.record(max_events=100)
    fake_bridge.free(before)
    during = fake_bridge.alloc(F32, 8192)
    fake_bridge.free(during)
    history = fake_bridge.memory_snapshot(layout="torch")["device_traces"][0]
    # Without the caching pool each allocation is its own segment, made and given back with it.
    assert [(e["action"], e["size"]) for e in history] == [
        ("segment_alloc", 8192), ("alloc", 8192), ("free_requested", 8192), ("free_completed", 8192),
        ("segment_free", 8192)]


def test_hundreds_of_slices_open_at_once_each_get_a_lane_of_their_own(fake_bridge):
    """150 uploads in flight on the copy-up track and 3 downloads on copy-down: every lane a tid no other lane or
    track has, named once, and every end on its begin's tid."""
    b = fake_bridge
    b.fake.set_auto_complete(False)
    b.record(max_events=10000)
    spec = devbridge.ObjectSpec(max_extent=1 << 20, alignment=256, dtype="bytes")
    up, down = b.alloc(spec, 1 << 20), b.alloc(spec, 1 << 20)
    events = [b.host_to_device(b.ring.reserve(256), up, offset=256 * i) for i in range(150)]
    events += [b.device_to_host(down, b.ring.reserve(256), offset=256 * i) for i in range(3)]
    b.fake.complete_all()
    for event in events:
        b.wait(event)
    trace = b.trace()
    check_trace(trace)
    names: dict[int, list[str]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "thread_name":
            names.setdefault(e["tid"], []).append(e["args"]["name"])
    assert all(len(n) == 1 for n in names.values()), {t: n for t, n in names.items() if len(n) > 1}
    lanes = sorted(n[0] for n in names.values())
    assert sum(name.startswith("copy up") for name in lanes) == 150
    assert sum(name.startswith("copy down") for name in lanes) == 3
    by_tid = {t: n[0] for t, n in names.items()}
    for e in trace["traceEvents"]:
        if e["ph"] in "BE":
            assert by_tid[e["tid"]].startswith(e["name"]), (e, by_tid[e["tid"]])


def test_dump_trace_writes_through_links_and_into_fifos_and_devices_never_replacing_them(fake_bridge, tmp_path):
    # A dump renames a whole file over a regular path; a link is followed (its target replaced, the link kept),
    # and a FIFO a process reads or a device is written in place: renamed over, the node itself would be gone
    # (/dev/full as root).
    fake_bridge.record(max_events=100)
    fake_bridge.free(fake_bridge.alloc(F32, 4096))
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    target.chmod(0o640)
    link.symlink_to(target.name)
    fake_bridge.dump_trace(link)
    assert link.is_symlink() and os.readlink(link) == target.name
    check_trace(json.loads(target.read_text()))
    assert target.stat().st_mode & 0o777 == 0o640, "a replaced file keeps its permissions"

    # A FIFO with a reader is written; one with none is refused at once (test_recorder_probe_fixes.py).
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the reader's open must come first, or the FIFO has no reader yet
        try:
            fake_bridge.dump_trace(fifo)
            break
        except devbridge.Unavailable:
            time.sleep(0.01)
    reader.join(timeout=30)
    assert fifo.is_fifo() and json.loads(got[0])["otherData"]["recorded_events"] >= 2

    fake_bridge.dump_trace("/dev/null")
    assert pathlib.Path("/dev/null").is_char_device()
    if os.path.exists("/dev/full"):
        with pytest.raises(devbridge.Unavailable, match=r"/dev/full.*No space left"):
            fake_bridge.dump_trace("/dev/full")
        assert pathlib.Path("/dev/full").is_char_device()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.json", "target.json"], "no temporary left"
