"""The memory snapshot in the layout PyTorch's memory viewer reads (``Bridge.memory_snapshot(layout="torch")``).

PyTorch's ``torch.cuda.memory._snapshot()`` returns a dict of ``segments`` (each with its ``blocks``) and
``device_traces`` (the allocator's history); https://pytorch.org/memory_viz opens it pickled, and
``torch.cuda._memory_viz`` prints summaries of it. This module rewrites devbridge's own snapshot and trace
(docs/TRACING.md) into that layout, so the same tools show a devbridge bridge: pool segments and their blocks
(live, freed but waiting for their uses, cached), and the allocations and frees the flight recorder kept, with
the Python stacks it recorded as frames.
"""

from __future__ import annotations

import re
from typing import Any

# devbridge block states -> PyTorch's: a live allocation is "active_allocated"; one released but still used (a
# deferred free) or an orphan a view or fence holds is "active_pending_free"; free memory in the pool "inactive".
_BLOCK_STATES = {
    "allocated": "active_allocated",
    "split part": "active_allocated",
    "adopted": "active_allocated",
    "orphan": "active_pending_free",
    "cached": "inactive",
}

# PyTorch's split between its small and large pools (1 MiB); only a label in the viewer.
_SMALL_SEGMENT = 1 << 20
# A frame of the recorder's stack text: "file:line function".
_FRAME = re.compile(r"^(.*):(\d+) (.*)$", re.DOTALL)


def _frames(stack: str | None) -> list[dict[str, Any]]:
    """The recorder's stack text ("file:line function", innermost first, a frame a line) as PyTorch's frames."""
    frames = []
    for line in (stack or "").split("\n"):  # only "\n" separates frames (a name may hold other line breaks)
        if not line:
            continue
        # The file name may hold spaces and colons ("/home/me/My Project/a.py"): the line number is the
        # last ":digits " of the line, the function's name what follows it.
        match = _FRAME.match(line)
        if match is None:
            frames.append({"filename": line, "line": 0, "name": ""})
        else:
            frames.append({"filename": match[1], "line": int(match[2]), "name": match[3]})
    return frames


def torch_layout(snapshot: dict[str, Any], trace: dict[str, Any]) -> dict[str, Any]:
    """``snapshot`` (``memory_snapshot()``) and ``trace`` (``trace()``) as PyTorch's memory snapshot dict."""
    events_by_seq: dict[int, dict[str, Any]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "i" and "seq" in event.get("args", {}):
            events_by_seq[event["args"]["seq"]] = event

    def allocation_frames(block: dict[str, Any]) -> list[dict[str, Any]]:
        for seq in block.get("events", []):
            event = events_by_seq.get(seq)
            if event is not None and event["name"] == "allocate":
                return _frames(event["args"].get("stack"))
        return []

    segments = []
    for segment in snapshot["segments"]:
        base, total = segment["address"], segment["bytes"]
        blocks = []
        covered = 0
        for block in segment["blocks"]:
            state = _BLOCK_STATES.get(block["state"], "active_allocated")
            if state == "active_allocated" and block.get("released"):
                state = "active_pending_free"
            live = state != "inactive"
            blocks.append({
                "address": base + block["offset"],
                "size": block["bytes"],
                "requested_size": min(block.get("requested", block["bytes"]), block["bytes"]) if live else 0,
                "state": state,
                "frames": allocation_frames(block) if live else [],
            })
            covered = max(covered, block["offset"] + block["bytes"])
        if covered < total:  # what the backend rounded the last block up to: free as far as the viewer goes
            blocks.append({"address": base + covered, "size": total - covered, "requested_size": 0,
                           "state": "inactive", "frames": []})
        segments.append({
            "device": 0,
            "address": base,
            "total_size": total,
            "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
            "requested_size": sum(b["requested_size"] for b in blocks),
            "stream": 0,
            "segment_type": "small" if total < _SMALL_SEGMENT else "large",
            "segment_pool_id": (0, 0),
            "is_expandable": False,
            "frames": [],
            "blocks": blocks,
        })

    # The history: an allocation is "alloc"; its end "free_requested" when released (or freed) and
    # "free_completed" when the memory went back. Allocations made before recording have no "alloc".
    # Without the caching pool every allocation is a segment of its own, made and given back with it:
    # "segment_alloc" before its "alloc", "segment_free" after its "free_completed" (the viewer's
    # history, stepped back past a free, recreates the block inside its segment, which must be there).
    # With the pool, its segments are those of the snapshot (the trace names no segment's address).
    own_segments = not snapshot.get("stats", {}).get("pool_enabled", False)
    history = []
    allocations: dict[str, tuple[int, int]] = {}  # handle -> (address, bytes)
    requested: set[str] = set()
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "i" or event.get("cat") != "memory":
            continue
        args = event["args"]
        handle = args.get("handle")
        time_us = int(event["ts"])
        frames = _frames(args.get("stack"))
        if event["name"] == "allocate":
            allocations[handle] = (args.get("address", 0), args["bytes"])
            actions = ("segment_alloc", "alloc") if own_segments else ("alloc",)
            history.extend({"action": action, "addr": args.get("address", 0), "size": args["bytes"],
                            "stream": 0, "time_us": time_us, "frames": frames} for action in actions)
        elif event["name"] in ("release", "free") and handle in allocations:
            # The end of an allocation made before recording is left out with its start: the viewer would
            # otherwise count memory below zero.
            address, size = allocations[handle]
            if handle not in requested:
                requested.add(handle)
                history.append({"action": "free_requested", "addr": address, "size": size, "stream": 0,
                                "time_us": time_us, "frames": frames})
            if event["name"] == "free":
                requested.discard(handle)
                allocations.pop(handle, None)
                actions = ("free_completed", "segment_free") if own_segments else ("free_completed",)
                history.extend({"action": action, "addr": address, "size": size, "stream": 0,
                                "time_us": time_us, "frames": frames} for action in actions)
    return {"segments": segments, "device_traces": [history]}
