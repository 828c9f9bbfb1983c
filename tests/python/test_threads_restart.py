"""Threads racing restart: nothing is left behind once every consumer lets go.

Four workers loop alloc -> upload -> download -> wait -> view (waiting for the upload) (a few views kept, most closed) ->
free or release, a poller polls, and a restarter calls restart(generation + 1) as fast as it can.
Operations that race a restart fail, and must fail with the contract's kinds (an old handle or
event, an unknown one, an allocation still in use, backpressure from a ring pinned by old copies);
anything else is a bug. After the threads are joined, every kept view closed and one more restart,
the bridge must hold no view and no orphaned allocation. OpenCL used to end with live views and
orphans (5 s runs: 3 of 3; this 2.5 s run catches it about one run in three): a view that ended
while a restart, having orphaned its allocation, gave back the caching pool with its lock dropped.
The deterministic regression is tests/conformance/restart_lease_test.cpp.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import devbridge
from conftest import require_backend

# The kinds an operation racing a restart may raise (CONTRACT.md: restart retires every old handle
# and event at once; a pinned range or a live view refuses a free or an upload).
RACING_KINDS = (devbridge.OldGenerationHandle, devbridge.UnknownDeviceHandle, devbridge.AllocationStillInUse,
                devbridge.Backpressure, devbridge.InvalidRange)
RUN_SECONDS = 2.5


@pytest.mark.parametrize("backend", ["fake", "host", "opencl"])
def test_threads_racing_restart_leave_no_view_or_orphan(backend):
    require_backend(backend)
    b = devbridge.Bridge(backend=backend, ring_bytes=4 << 20)
    if backend == "fake":
        b.fake.set_auto_complete(True)  # its copies complete on their own, as a device's do
    stop = threading.Event()
    kept: list = []
    kept_lock = threading.Lock()
    unexpected: list[BaseException] = []

    def record(exc: BaseException) -> None:
        if not isinstance(exc, RACING_KINDS):
            unexpected.append(exc)

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        spec = devbridge.ObjectSpec(4096, 4, "float32")
        n = 0
        while not stop.is_set():
            n += 1
            h = up = down = None
            try:
                h = b.alloc(spec, 4096)
                up = b.ring.reserve(4096)
                np.frombuffer(b.ring.buffer(up), dtype=np.float32)[:] = rng.random(1024, dtype=np.float32)
                b.host_to_device(up, h)  # not waited: the view waits for it, and a restart may come meanwhile
                down = b.ring.reserve(4096)
                b.wait(b.device_to_host(h, down))
                v = b.view(h, "float32", (1024,), wait=True)
                if n % 16 == 0:
                    with kept_lock:
                        kept.append(v)
                else:
                    time.sleep(0.0002)  # a consumer reading it for a moment: a restart may orphan it meanwhile
                    v.close()
                if n % 2:
                    b.free(h)
                else:
                    b.release(h)
                h = None
            except Exception as exc:  # noqa: BLE001 - sorted by record()
                record(exc)
            finally:
                for r in (up, down):
                    if r is not None:
                        try:
                            b.ring.release(r)
                        except Exception as exc:  # noqa: BLE001
                            record(exc)
                if h is not None:
                    try:
                        b.release(h)
                    except Exception as exc:  # noqa: BLE001
                        record(exc)

    def poller() -> None:
        while not stop.is_set():
            try:
                b.poll()
            except Exception as exc:  # noqa: BLE001
                record(exc)

    def restarter() -> None:
        while not stop.is_set():
            try:
                b.restart(b.generation + 1)
            except Exception as exc:  # noqa: BLE001
                record(exc)
            time.sleep(0.0005)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=poller), threading.Thread(target=restarter)]
    for t in threads:
        t.start()
    time.sleep(RUN_SECONDS)
    stop.set()
    for t in threads:
        t.join()
    try:
        assert not unexpected, f"{len(unexpected)} unexpected errors, first: {unexpected[0]!r}"
        for v in kept:
            v.close()
        b.restart(b.generation + 1)
        stats = b.stats()
        assert (stats["live_views"], stats["orphaned_allocations"]) == (0, 0), stats
    finally:
        b.close()


@pytest.mark.parametrize("backend", ["host", "fake", "opencl"])
def test_a_forked_child_is_refused_the_parents_bridge_and_exits_cleanly(backend):
    # A DataLoader's fork workers inherit the parent's Bridge, but not its copy threads or device context:
    # its use is Unavailable saying what to do, and the child's exit (which tore the bridge down, joining
    # threads it did not have) no longer crashes. A host or fake Bridge made in the child works; the parent is
    # untouched.
    import os
    import subprocess
    import sys
    import textwrap

    require_backend(backend)
    script = textwrap.dedent(f"""
        import os, sys, numpy as np, devbridge
        b = devbridge.Bridge(backend={backend!r}, ring_bytes=1 << 20)
        if {backend!r} == "fake":
            b.fake.set_auto_complete(True)
        t = b.upload(np.arange(100_000, dtype=np.float32), wait=True)
        pid = os.fork()
        if pid == 0:
            try:
                b.download(t)
                print("child: the inherited bridge answered")
            except devbridge.Unavailable as error:
                assert "forked from" in str(error) and "spawn" in str(error), error
            if {backend!r} != "opencl":  # a GPU runtime (OpenCL, CUDA) does not start again after a fork
                mine = devbridge.Bridge(backend={backend!r}, ring_bytes=1 << 20)
                if {backend!r} == "fake":
                    mine.fake.set_auto_complete(True)
                own = mine.upload(np.arange(10, dtype=np.int64), wait=True)
                assert mine.download(own).tolist() == list(range(10))
            b.close()  # the parent's: refused from now on here, closed nowhere
            sys.exit(0)  # interpreter exit: every object of the parent's bridge is dropped here
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
        assert np.array_equal(b.download(t), np.arange(100_000, dtype=np.float32))
        t.free()
        assert b.stats()["live_allocations"] == 0
        b.close()
        print("parent ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "child exit 0" in done.stdout and "parent ok" in done.stdout, done.stdout + done.stderr
    assert "answered" not in done.stdout


def test_a_child_forked_while_a_thread_runs_a_callback_exits_without_waiting_for_that_thread():
    # The exit hook lets threads already running a callback (the GIL taken back inside a call) finish
    # before the interpreter finalizes, waiting up to 10 s. A forked child has none of the parent's
    # threads: the gate starts afresh there, so the child's exit does not wait for a thread that stayed in
    # the parent (it waited the full 10 s when the child inherited the parent's count).
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, sys, threading, time, numpy as np, devbridge
        from devbridge._devbridge import TransferPlanner
        b = devbridge.Bridge(backend="host", ring_bytes=1 << 20)
        handle = b.alloc(devbridge.ObjectSpec(4096, 64, "uint8"), 4096)
        inside, leave = threading.Event(), threading.Event()
        def fill(at, chunk):
            chunk[:] = bytes(len(chunk))
            inside.set()
            leave.wait()  # the GIL let go by Python, the callback still running
        worker = threading.Thread(target=lambda: TransferPlanner(b).submit_stream(fill, 4096, into=handle))
        worker.start()
        inside.wait()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        began = time.monotonic()
        _, status = os.waitpid(pid, 0)
        print(f"child exit {os.waitstatus_to_exitcode(status)} after {time.monotonic() - began:.1f} s")
        leave.set()
        worker.join()
        b.close()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    seconds = float(done.stdout.split("after ")[1].split(" s")[0])
    assert "child exit 0" in done.stdout and seconds < 5, done.stdout + done.stderr


EXIT_ACTIVITIES = {
    # what a daemon thread does, over and over, when the main thread returns
    "upload": "t = b.upload(a, wait=True); t.free()",
    "download": "b.download(kept)",
    "view": "np.from_dlpack(kept.view()).sum()",
    "restore": "[t.free() for t in b.restore(path).values()]",
    # a transfer blocked for good, its planner taking the GIL back every 20 ms to look at signals
    "lost_completion": "b.download(kept)",
    # Bridge.wait with no limit on a copy that never completes (100 ms slices)
    "endless_wait": "b.wait(b.host_to_device(b.ring.reserve(4096), kept))",
}


@pytest.mark.parametrize("backend", ["host", "fake", "opencl"])
@pytest.mark.parametrize("activity", sorted(EXIT_ACTIVITIES))
def test_daemon_threads_inside_devbridge_at_interpreter_exit_leave_it_cleanly(backend, activity):
    # Before Python 3.14 a thread taking the GIL back during the interpreter's finalization is ended with
    # pthread_exit, whose unwind through a frame that may not throw aborted the process ("terminate called
    # without an active exception", exit 134) in 6 runs of 6: a prefetching daemon thread crashed every exit.
    import os
    import subprocess
    import sys
    import tempfile
    import textwrap

    require_backend(backend)
    if activity in ("lost_completion", "endless_wait") and backend != "fake":
        pytest.skip("only the fake loses a completion on purpose")
    blocked = activity in ("lost_completion", "endless_wait")
    with tempfile.TemporaryDirectory() as tmp:
        script = textwrap.dedent(f"""
            import os, threading, time, numpy as np, devbridge
            b = devbridge.Bridge(backend={backend!r}, ring_bytes=4 << 20)
            if {backend!r} == "fake" and not {blocked!r}:
                b.fake.set_auto_complete(True)
            a = np.arange(1 << 16, dtype=np.float32)
            path = os.path.join({tmp!r}, "model.safetensors")
            kept = b.alloc(devbridge.ObjectSpec(a.nbytes, 64, "float32"), a.nbytes)
            if not {blocked!r}:
                kept = b.upload(a, wait=True)
                b.checkpoint(path, {{"w": kept}})
            if {activity!r} == "lost_completion":
                b.fake.set_auto_complete(True)
                kept = b.upload(a, wait=True)
                b.fake.inject("copy_d2h", "lost_completion")  # the first download waits for good
            started = threading.Barrier(4)
            def work():
                started.wait()
                while True:
                    {EXIT_ACTIVITIES[activity]}
            for _ in range(3):
                threading.Thread(target=work, daemon=True).start()
            started.wait()
            time.sleep(0.3)
            print("main returns")
        """)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stdout}{done.stderr}"
    assert "main returns" in done.stdout, done.stderr
    assert "terminate" not in done.stderr and "leaked" not in done.stderr, done.stderr


def test_a_call_waiting_for_a_restart_never_holds_the_gil_a_checkpoint_needs(tmp_path):
    """restart() waits for a host checkpoint's in-place write, whose writer needs the GIL; an alloc/release on
    a third thread blocked in the bridge for the restart while holding the GIL: the whole process stopped for
    good (4 of 4 runs). Run in a child, so a deadlock fails the test instead of hanging the suite."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import threading, time, numpy as np, devbridge
        b = devbridge.Bridge(backend="host")
        stop = threading.Event()
        done = [0, 0]
        def checkpoints():
            while not stop.is_set():
                try:
                    t = b.upload(np.ones(300000, np.uint32), wait=True)
                    b.checkpoint({str(tmp_path / "c.safetensors")!r}, {{"a": t}})
                    t.free()
                    done[0] += 1
                except (devbridge.OldGenerationHandle, devbridge.Closed):
                    pass
        def allocs():
            spec = devbridge.ObjectSpec(1 << 20, 256, "uint32")
            while not stop.is_set():
                try:
                    b.release(b.alloc(spec, 4096))
                    done[1] += 1
                except (devbridge.OldGenerationHandle, devbridge.Closed):
                    pass
        threads = [threading.Thread(target=f, daemon=True) for f in (checkpoints, allocs)]
        for t in threads:
            t.start()
        generation, end = 1, time.monotonic() + 3
        while time.monotonic() < end:
            time.sleep(0.005)
            generation += 1
            b.restart(generation)
        stop.set()
        for t in threads:
            t.join()
        b.close()
        print("restarts", generation - 1, "checkpoints", done[0], "allocs", done[1])
    """)
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: restart, a checkpoint and an alloc loop stopped each other")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("restarts "), run.stdout
