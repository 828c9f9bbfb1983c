"""The flight recorder's fixes from the probes (docs/TRACING.md): the stack a lease's end records, torch frames
of file names with spaces, copies a restart or close dropped, dump_trace to a FIFO or socket, max_events
refusals, the snapshot's stats, and the memory sample of an end whose begin is not in the ring."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import devbridge
from devbridge._memory_viz import _frames

SPEC = devbridge.ObjectSpec(max_extent=1 << 24, alignment=256, dtype="float32")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def instants(trace: dict, name: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "i" and e["name"] == name]


def lanes_nest(trace: dict) -> bool:
    """Every B has its E on its tid, in order."""
    open_slices: dict[int, list[str]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "B":
            open_slices.setdefault(e["tid"], []).append(e["name"])
        elif e["ph"] == "E" and open_slices.get(e["tid"], [None]).pop() != e["name"]:
            return False
    return all(not names for names in open_slices.values())


# 1. A lease that ends outside a call records the stack where it ended, never the thread's last annotated
# call (here: another bridge's alloc).


def _released_view(bridge: devbridge.Bridge):
    h = bridge.alloc(SPEC, 4096)
    view = bridge.view(h, "float32", (1024,))
    bridge.release(h)  # the free is deferred to the lease's end
    return view


@pytest.mark.parametrize("how", ["dlpack", "close", "with", "collected"])
def test_a_lease_end_records_the_stack_where_it_ended(how):
    a, other = devbridge.Bridge(backend="host"), devbridge.Bridge(backend="host")
    try:
        a.record(max_events=100, stacks=True)
        other.record(max_events=100, stacks=True)
        view = _released_view(a)
        array = np.from_dlpack(view) if how == "dlpack" else None
        if array is not None:
            view.close()  # the DLPack export holds its own lease

        def unrelated_work_on_other_bridge():
            return other.alloc(SPEC, 4096)

        unrelated_work_on_other_bridge()

        def end_the_lease():
            nonlocal array, view
            if how == "dlpack":
                array = None  # numpy calls the export's deleter
            elif how == "close":
                view.close()
            elif how == "collected":
                view = None  # dropped without close(): its lease ends as it is collected
            else:
                with view:
                    pass

        end_the_lease()
        (free,) = instants(a.trace(), "free")
        assert free["args"]["deferred"]
        assert free["args"]["stack"].split("\n")[0].endswith(" end_the_lease")
        view_ends = [e for e in a.trace()["traceEvents"] if e["ph"] == "E" and e["name"] == "view"]
        assert view_ends and all(e["args"]["status"] == "ended" for e in view_ends)
    finally:
        a.close()
        other.close()


def test_a_lease_end_on_a_thread_that_never_recorded_stacks_has_no_stack():
    b = devbridge.Bridge(backend="host")
    try:
        b.record(max_events=100)  # without stacks: the lease's end notes none
        array = np.from_dlpack(_released_view(b))
        del array
        (free,) = instants(b.trace(), "free")
        assert "stack" not in free["args"]
    finally:
        b.close()


# 2. Torch frames: the file name may hold spaces (and colons).


def test_torch_frames_keep_a_file_name_with_spaces():
    b = devbridge.Bridge(backend="host")
    try:
        b.record(max_events=100, stacks=True)
        namespace = {"b": b, "spec": SPEC}
        exec(compile("def train_step():\n    return b.alloc(spec, 4096)\n", "/home/me/My Project/train.py", "exec"),
             namespace)
        namespace["train_step"]()
        frame = b.memory_snapshot(layout="torch")["segments"][0]["blocks"][0]["frames"][0]
        assert frame == {"filename": "/home/me/My Project/train.py", "line": 2, "name": "train_step"}
    finally:
        b.close()


def test_frames_split_at_the_last_line_number():
    assert _frames("C:/a b/x:y.py:12 f g\n/t.py:3 <module>\nno line here") == [
        {"filename": "C:/a b/x:y.py", "line": 12, "name": "f g"},
        {"filename": "/t.py", "line": 3, "name": "<module>"},
        {"filename": "no line here", "line": 0, "name": ""},
    ]


# 3. A copy in flight that a restart or close dropped ends there, "dropped", and later copies keep the track.


@pytest.mark.parametrize("how", ["restart", "close"])
def test_a_copy_dropped_by_restart_or_close_ends_there(how):
    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 20)
    h = b.alloc(SPEC, 4096)
    b.record(max_events=100)
    r = b.ring.reserve(4096)
    b.host_to_device(r, h)  # pending on the fake
    if how == "restart":
        b.restart(b.generation + 1)
        b.fake.set_auto_complete(True)
        b.wait(b.host_to_device(r, b.alloc(SPEC, 4096)))
    b.close()
    trace = b.trace()
    assert lanes_nest(trace)
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    ends = [e for e in events if e["ph"] == "E"]
    assert [e["args"]["status"] for e in ends] == (["dropped", "completed"] if how == "restart" else ["dropped"])
    (dropped,) = [e for e in ends if e["args"]["status"] == "dropped"]
    (at,) = instants(trace, how)
    assert dropped["ts"] == at["ts"] and events.index(dropped) < events.index(at) and "seq" not in dropped["args"]
    assert {e["tid"] for e in events if e["ph"] in "BE"} == {2}  # no "copy up #2" lane
    assert not any(e["args"]["name"].endswith("#2") for e in trace["traceEvents"] if e["name"] == "thread_name")


# 4. dump_trace refuses a FIFO no process reads (it would wait for one for good) and a socket at once; a device
# is written (and a FIFO a process reads: test_recorder.py).


def test_dump_trace_refuses_a_fifo_at_once(tmp_path):
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    script = textwrap.dedent(f"""
        import devbridge
        b = devbridge.Bridge(backend="host")
        b.record(max_events=100)
        try:
            b.dump_trace({str(fifo)!r})
        except devbridge.Unavailable as e:
            print("refused:", e)
    """)
    # In a child: before the fix the dump never returned (the GIL released, no signal stops it).
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "FIFO no process reads" in done.stdout and str(fifo) in done.stdout
    assert fifo.exists()  # left as it was


def test_dump_trace_refuses_a_socket_and_writes_a_device(tmp_path):
    b = devbridge.Bridge(backend="host")
    try:
        b.record(max_events=100)
        path = tmp_path / "s"
        with socket.socket(socket.AF_UNIX) as listening:
            listening.bind(str(path))
            with pytest.raises(devbridge.Unavailable, match="socket"):
                b.dump_trace(path)
        b.dump_trace(os.devnull)
    finally:
        b.close()


# 5. max_events out of [1, 2^24] is InvalidRange naming the value, whatever int it is; not an int: TypeError.


@pytest.mark.parametrize("value", [0, (1 << 24) + 1, 1 << 63, -1, -(1 << 70), 1 << 64])
def test_max_events_out_of_range_is_invalid_range_naming_it(value):
    b = devbridge.Bridge(backend="host")
    try:
        with pytest.raises(devbridge.InvalidRange) as refused:
            b.record(max_events=value)
        message = str(refused.value)
        assert f"max_events of {value} is outside [1, {1 << 24}]" in message and "from 0" not in message
    finally:
        b.close()


@pytest.mark.parametrize("value", [True, 1.0, "10"])
def test_max_events_not_an_int_is_a_type_error(value):
    b = devbridge.Bridge(backend="host")
    try:
        with pytest.raises(TypeError):
            b.record(max_events=value)
    finally:
        b.close()


# 6. The snapshot's stats and memory_stats() carry every MemoryStats field, under its name.


def memory_stats_fields() -> list[str]:
    header = (ROOT / "include/devbridge/bridge.hpp").read_text()
    body = re.search(r"struct MemoryStats \{(.*?)\n\};", header, re.S)[1]
    body = re.sub(r"//[^\n]*", "", body)
    names = []
    for declaration in re.findall(r"(?:std::uint64_t|bool)\s+([^;]+);", body):
        names += [part.split("=")[0].strip() for part in declaration.split(",")]
    return names


@pytest.mark.parametrize("backend", ["host", "fake"])
def test_snapshot_stats_and_memory_stats_are_every_memory_stats_field(backend):
    fields = memory_stats_fields()
    assert len(fields) == 24 and "pool_splits" in fields and "largest_request_bytes" in fields
    b = devbridge.Bridge(backend=backend)
    try:
        b.free(b.alloc(SPEC, 4096))
        h = b.alloc(SPEC, 4096)
        stats, snapshot = b.memory_stats(), b.memory_snapshot()["stats"]
        assert list(snapshot) == fields  # in MemoryStats' order
        assert list(stats) == fields  # both from for_each_field
        assert snapshot == stats  # nothing changed between them
        b.free(h)
    finally:
        b.close()


def test_for_each_field_and_the_c_struct_list_every_memory_stats_field():
    """bridge.hpp's for_each_field (the snapshot, memory_stats() and the stream report) names each field as
    it is declared, in its order; the C ABI's devbridge_memory_stats has each after its size (appended ones
    may come in another order: its layout is the ABI)."""
    fields = memory_stats_fields()
    header = (ROOT / "include/devbridge/bridge.hpp").read_text()
    body = re.search(r"void for_each_field\(const MemoryStats& m, Visit&& visit\) \{(.*?)\n\}", header, re.S)[1]
    visited = re.findall(r'visit\("(\w+)", m\.(\w+)\);', body)
    assert [name for name, _ in visited] == fields
    assert all(name == member for name, member in visited)
    c_header = (ROOT / "include/devbridge/c/devbridge.h").read_text()
    c_body = re.search(r"typedef struct devbridge_memory_stats \{(.*?)\} devbridge_memory_stats;", c_header, re.S)[1]
    c_fields = re.findall(r"uint64_t (\w+);", c_body)
    assert c_fields[0] == "size"
    assert sorted(c_fields[1:]) == sorted(fields)


# 7. An end whose begin is not in the ring is left out, its memory sample is not.


def test_the_memory_sample_of_an_end_whose_begin_was_not_recorded_is_kept():
    b = devbridge.Bridge(backend="fake", ring_bytes=1 << 20)
    try:
        h = b.alloc(SPEC, 4096)
        r = b.ring.reserve(4096)
        event = b.host_to_device(r, h)  # in flight before recording
        b.record(max_events=100)
        b.fake.complete(event)
        b.wait(event)
        trace = b.trace()
        held = [e for e in trace["traceEvents"] if e["ph"] != "M"]
        assert trace["otherData"]["recorded_events"] == 1
        (sample,) = held
        assert sample["ph"] == "C" and sample["args"]["in_flight"] == 0
    finally:
        b.close()
