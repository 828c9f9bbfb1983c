"""devbridge as a Ray Direct Transport (devbridge.ray_transport): DeviceTensors between actors by ObjectRef.

The transport's manager in this process first (no cluster: layout, dtypes, the segment pool, refusals), then
one local cluster for the module (on loopback, 2 CPUs, no dashboard, a timeout on every ray.get): a hand-off between two
workers bit-exact (adopted with no copy on the host backend), the driver's ray.get, several tensors in one
ref, segments recycled or closed once their ref is freed, a dead sender and a dead receiver. Skipped when Ray
(or its RDT custom transports) is missing.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'devbridge[ray]'; "
                                        "requirements-dev.txt installs it)")
if not hasattr(__import__("ray.experimental", fromlist=["_"]), "register_tensor_transport"):
    pytest.skip("this Ray has no Ray Direct Transport custom transports (register_tensor_transport)",
                allow_module_level=True)

import devbridge  # noqa: E402
from conftest import same_bits  # noqa: E402

# A devbridge installed before ray_transport.py existed: read the module from this checkout, here and (through
# the cluster's worker setup hook) in every worker, which must import it by name.
_SOURCE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "python", "devbridge"))
_FROM_CHECKOUT = importlib.util.find_spec("devbridge.ray_transport") is None
if _FROM_CHECKOUT:
    devbridge.__path__.append(_SOURCE)

import devbridge.ray_transport as rt  # noqa: E402
from devbridge.ray import TensorRef, init_local, wait_until_ready  # noqa: E402

# Ray 2.60's owner-side handling of a failed transfer (RDTManager._abort_transport, in the driver's
# _monitor_failures thread) first imports ray.experimental.collective, which imports torch: without torch that
# thread dies there (about a second after a transfer failed, so in whichever test runs then), once the receive
# task has already failed as it should. Nothing of devbridge's is involved; see docs/RAY.md.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:Exception in thread .*\(_monitor_failures\):pytest.PytestUnhandledThreadExceptionWarning")

TIMEOUT = 60  # seconds, for every ray.get
HAVE_OPENCL = any(b["name"] == "opencl" and b["available"] for b in devbridge.list_backends())
HAVE_TINYGRAD = importlib.util.find_spec("tinygrad") is not None
OTHER_BACKEND = "opencl" if HAVE_OPENCL else "host"


def get(ref, timeout=TIMEOUT):
    return ray.get(ref, timeout=timeout)


def eventually(check, timeout=20.0):
    """Polls ``check()`` until true (Ray frees a ref's primary copy asynchronously); its last value."""
    deadline = time.monotonic() + timeout
    while not (ok := check()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return ok


def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# --------------------------------------------------------------------------------- in-process: the manager


@pytest.fixture
def manager():
    m = rt.DevbridgeTransport()
    yield m
    m.close()
    rt.set_pool_bytes(None)


def upload_all(b, xs, dtypes=None):
    return [b.upload(x, dtype=(dtypes or {}).get(i), wait=True) for i, x in enumerate(xs)]


@pytest.mark.parametrize("backend", ["host", "fake", "opencl"])
def test_receivers_map_the_senders_segment_bit_exact_and_read_only(manager, backend):
    if backend == "opencl" and not HAVE_OPENCL:
        pytest.skip("no OpenCL device")
    b = devbridge.Bridge(backend=backend)
    if backend == "fake":
        b.fake.set_auto_complete(True)
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((33, 65), dtype=np.float32), rng.integers(-9, 9, size=7, dtype=np.int64),
          rng.integers(0, 1 << 16, size=(5, 3), dtype=np.uint16)]
    ts = upload_all(b, xs, {2: "bfloat16"})
    try:
        meta = manager.extract_tensor_transport_metadata("obj", ts)
        assert meta.inode in rt.segments() and meta.pid == os.getpid() and meta.tensor_device == backend
        assert [o % 4096 for o in meta.offsets] == [0, 0, 0] and meta.offsets[0] >= 4096  # a header page first
        assert meta.tensor_meta == [((33, 65), "float32"), ((7,), "int64"), ((5, 3), "bfloat16")]
        assert manager.extract_tensor_transport_metadata("obj", ts) is meta  # a retry: the same segment
        got = manager.recv_multiple_tensors("obj", meta, None)
        assert [type(g) for g in got] == [rt.SegmentTensor] * 3 and got[2].dtype == "bfloat16"
        for g, x in zip(got, xs):
            a = np.asarray(g)
            assert a.dtype == x.dtype or g.dtype == a.dtype.name == "bfloat16"
            assert same_bits(a, x) and not a.flags.writeable
        manager.garbage_collect("obj", meta, ts)
        # Freed while a receiver still maps it: kept aside, never rewritten under the receiver's feet.
        assert manager.stats()["live"] == 0 and manager.stats()["draining"] == 1
        assert np.array_equal(np.asarray(got[0]), xs[0])
        del got, a, g
        gc.collect()
        assert manager.stats()["draining"] == 0 and manager.stats()["pooled"] == 1  # nobody maps it: reusable
        with pytest.raises(rt.DevbridgeTransportError, match="has freed its tensors"):
            manager.recv_multiple_tensors("obj", meta, None)
    finally:
        for t in ts:
            t.free()
        b.close()


def test_a_pooled_segment_is_reused_and_a_stale_ref_refused(manager):
    with devbridge.Bridge(backend="host") as b:
        x, y = np.arange(50_000, dtype=np.float32), np.arange(50_000, dtype=np.float32)[::-1].copy()
        tx, ty = b.upload(x, wait=True), b.upload(y, wait=True)
        first = manager.extract_tensor_transport_metadata("1", [tx])
        manager.garbage_collect("1", first, [tx])
        second = manager.extract_tensor_transport_metadata("2", [ty])  # same size: first's segment again
        assert (second.fd, second.inode) == (first.fd, first.inode) and manager.stats()["reused"] == 1
        with pytest.raises(rt.DevbridgeTransportError, match="has freed its tensors"):
            manager.recv_multiple_tensors("1", first, None)
        held = manager.recv_multiple_tensors("2", second, None)
        assert np.array_equal(np.asarray(held[0]), y)
        # Held by a receiver when freed: the next tensors go to a new segment, the held bytes stay as they were.
        manager.garbage_collect("2", second, [ty])
        third = manager.extract_tensor_transport_metadata("3", [tx])
        assert third.fd != second.fd and manager.stats()["created"] == 2
        assert np.array_equal(np.asarray(held[0]), y)
        # No pool: a freed segment nobody holds is closed at once, one still held as soon as it is let go.
        rt.set_pool_bytes(0)
        manager._trim()
        manager.garbage_collect("3", third, [tx])
        assert third.inode not in rt.segments()
        del held
        gc.collect()
        assert manager.stats()["pooled_bytes"] == 0 and rt.segments() == []
        tx.free()
        ty.free()


def test_the_pool_is_bounded_by_segments_too(manager):
    """Each pooled segment holds two file descriptors: thousands of small ones fit in pool_bytes() and exhausted
    RLIMIT_NOFILE; pool_segments() bounds their number (oldest closed first)."""
    rt.set_pool_segments(2)
    try:
        assert rt.pool_segments() == 2
        with devbridge.Bridge(backend="host") as b:
            ts = [b.upload(np.zeros(1000, np.uint8), wait=True) for _ in range(4)]
            metas = [manager.extract_tensor_transport_metadata(f"o{i}", [t]) for i, t in enumerate(ts)]
            for i, (t, meta) in enumerate(zip(ts, metas)):
                manager.garbage_collect(f"o{i}", meta, [t])
            assert manager.stats()["pooled"] == 2 and sorted(rt.segments()) == sorted(m.inode for m in metas[2:])
            for t in ts:
                t.free()
    finally:
        rt.set_pool_segments(None)
    assert rt.pool_segments() == 64


def test_a_sender_out_of_file_descriptors_closes_its_pool_and_retries(manager, monkeypatch):
    """EMFILE making a segment: the pooled (idle) segments are closed and the segment made again, rather than
    telling the user to lower the pool; only when that fails too is it a DevbridgeTransportError."""
    import errno

    with devbridge.Bridge(backend="host") as b:
        small = b.upload(np.zeros(100, np.uint8), wait=True)
        big = b.upload(np.zeros(1 << 20, np.uint8), wait=True)
        meta = manager.extract_tensor_transport_metadata("small", [small])
        manager.garbage_collect("small", meta, [small])
        assert manager.stats()["pooled"] == 1
        real = rt.os.memfd_create
        calls = []

        def out_of_fds_while_pooled(*args):
            calls.append(manager.stats()["pooled"])
            if calls[-1]:
                raise OSError(errno.EMFILE, "Too many open files")
            return real(*args)

        monkeypatch.setattr(rt.os, "memfd_create", out_of_fds_while_pooled)
        got = manager.extract_tensor_transport_metadata("big", [big])
        assert calls == [1, 0] and manager.stats()["pooled"] == 0 and meta.inode not in rt.segments()
        assert same_bits(np.asarray(manager.recv_multiple_tensors("big", got, None)[0]), np.zeros(1 << 20, np.uint8))
        manager.garbage_collect("big", got, [big])
        small.free()
        big.free()


def test_a_closed_worker_closes_its_pooled_segments(monkeypatch):
    """close() gives back the pooled segments' file descriptors (a closed worker shares nothing more)."""
    manager = rt.DevbridgeTransport()
    monkeypatch.setattr(rt, "_manager_if_made", lambda: manager)
    w = rt._RDTDeviceWorker("host")
    try:
        w.put("x", np.arange(1000, dtype=np.float32))
        tensor = w.share("x")
        meta = manager.extract_tensor_transport_metadata("o", [tensor])
        manager.garbage_collect("o", meta, [tensor])
        assert manager.stats()["pooled"] == 1 and meta.inode in rt.segments()
        w.close()
        assert manager.stats()["pooled"] == 0 and meta.inode not in rt.segments()
    finally:
        w.close()
        manager.close()


def test_the_manager_refuses_what_it_cannot_move(manager):
    with devbridge.Bridge(backend="host") as b, devbridge.Bridge(backend="fake") as f:
        t = b.upload(np.arange(10, dtype=np.float32), wait=True)
        with pytest.raises(TypeError, match="DeviceTensor"):
            manager.extract_tensor_transport_metadata("o", [np.zeros(3)])
        f.fake.set_auto_complete(True)
        other = f.upload(np.arange(10, dtype=np.float32), wait=True)
        with pytest.raises(ValueError, match="share a backend"):
            manager.extract_tensor_transport_metadata("o", [t, other])
        other.free()
        t.free()
        with pytest.raises(devbridge.Closed):
            manager.extract_tensor_transport_metadata("o", [t])
        assert rt.segments() == []
        empty = manager.extract_tensor_transport_metadata("o", [])
        assert empty.tensor_meta == [] and manager.recv_multiple_tensors("o", empty, None) == []
        t = b.upload(np.arange(10, dtype=np.float32), wait=True)
        meta = manager.extract_tensor_transport_metadata("o", [t])
        with pytest.raises(ValueError, match="target buffers"):
            manager.recv_multiple_tensors("o", meta, None, target_buffers=[t])
        gone = rt.DevbridgeTransportMetadata(**{**meta.__dict__, "pid": dead_pid()})
        with pytest.raises(rt.DevbridgeTransportError, match="has died"):
            manager.recv_multiple_tensors("o", gone, None)
        reused = rt.DevbridgeTransportMetadata(**{**meta.__dict__, "start": meta.start + 1})  # pid reused since
        with pytest.raises(rt.DevbridgeTransportError, match="has died"):
            manager.recv_multiple_tensors("o", reused, None)
        wrong = rt.DevbridgeTransportMetadata(**{**meta.__dict__, "fd": 0})  # not the segment (stdin)
        with pytest.raises(rt.DevbridgeTransportError, match="has freed"):
            manager.recv_multiple_tensors("o", wrong, None)
        manager.garbage_collect("o", meta, [t])
        t.free()


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_a_received_segment_holds_one_file_descriptor_while_mapped(manager):
    """What bounds how many received tensors a process holds (RLIMIT_NOFILE): one fd per segment (the mapping's
    own, which also holds the shared lock), not two; none once nothing maps it."""
    with devbridge.Bridge(backend="host") as b:
        x = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
        t = b.upload(x, wait=True)
        metas = [manager.extract_tensor_transport_metadata(f"o{i}", [t]) for i in range(3)]
        before = _open_fds()
        held = [manager.recv_multiple_tensors(f"o{i}", m, None) for i, m in enumerate(metas)]
        assert _open_fds() - before == 3
        for i, m in enumerate(metas):
            manager.garbage_collect(f"o{i}", m, [t])
        assert manager.stats()["draining"] == 3  # the lock is held still: never rewritten under a receiver
        assert all(same_bits(np.asarray(h[0]), x) for h in held)
        del held
        gc.collect()
        assert _open_fds() == before and manager.stats()["draining"] == 0 and manager.stats()["pooled"] == 3
        t.free()


def test_out_of_file_descriptors_is_said_and_never_taken_for_a_dead_sender(manager, monkeypatch):
    """A receiver out of file descriptors (EMFILE) gets a DevbridgeTransportError naming that, with what to do,
    never 'the sender has died' (before: any failure to open /proc/<pid>/stat meant dead) nor 'has freed its
    tensors' (any failure to open the segment); once fds are free again the same ref reads fine."""
    import errno
    import resource

    with devbridge.Bridge(backend="host") as b:
        x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
        t = b.upload(x, wait=True)
        metas = [manager.extract_tensor_transport_metadata(f"o{i}", [t]) for i in range(3)]
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        filler = []
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(fd) for fd in os.listdir("/proc/self/fd")) + 8, hard))
            with pytest.raises(OSError):
                while True:
                    filler.append(os.open(os.devnull, os.O_RDONLY))
            with pytest.raises(rt.DevbridgeTransportError, match="EMFILE") as caught:
                manager.recv_multiple_tensors("o0", metas[0], None)
            message = str(caught.value)
            assert "file descriptors" in message and "RLIMIT_NOFILE" in message and "has died" not in message
            assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.EMFILE
            # Past the liveness check (or had it passed): opening the segment itself fails the same way.
            monkeypatch.setattr(rt, "_alive", lambda pid, start: True)
            with pytest.raises(rt.DevbridgeTransportError, match="EMFILE") as caught:
                manager.recv_multiple_tensors("o0", metas[0], None)
            assert "has freed" not in str(caught.value) and "has died" not in str(caught.value)
            monkeypatch.undo()
        finally:
            for fd in filler:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        got = manager.recv_multiple_tensors("o0", metas[0], None)
        assert same_bits(np.asarray(got[0]), x)
        del got
        for i, m in enumerate(metas):
            manager.garbage_collect(f"o{i}", m, [t])
        t.free()


def test_only_what_was_made_and_written_is_counted(manager, monkeypatch):
    """created counts segments made, not attempts; a worker's share counts exports and bytes_out once the bytes
    are in a segment (Ray writes them after share returns), not a failed extraction, nor a retry's again."""
    import errno

    started = ray.is_initialized()
    w = rt._RDTDeviceWorker("host")
    try:
        x = np.random.default_rng(4).standard_normal(256).astype(np.float32)
        w.put("x", x)
        tensor = w.share("x")
        assert w.stats()["exports"] == 0 and w.stats()["bytes_out"] == 0  # returned, not written yet

        def no_fds(*args):
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(rt.os, "memfd_create", no_fds)
        with pytest.raises(rt.DevbridgeTransportError, match="Too many open files.*EMFILE.*sending process"):
            manager.extract_tensor_transport_metadata("o", [tensor])
        monkeypatch.undo()
        assert manager.stats()["created"] == 0 and w.stats()["exports"] == 0 and w.stats()["bytes_out"] == 0
        meta = manager.extract_tensor_transport_metadata("o", [tensor])
        assert manager.extract_tensor_transport_metadata("o", [tensor]) is meta  # a retry: nothing new
        assert manager.stats()["created"] == 1
        assert w.stats()["exports"] == 1 and w.stats()["bytes_out"] == x.nbytes
        manager.garbage_collect("o", meta, [tensor])
    finally:
        w.close()
    assert ray.is_initialized() == started


def test_a_ref_for_an_actor_without_tensor_transport_is_reported(manager, caplog):
    """Ray queues the receive on the receiving actor's _ray_system concurrency group; an actor created without
    enable_tensor_transport=True has none and hangs for good. The transport cannot stop Ray (an exception there
    may be raised in a native callback), so it logs why, where the task was submitted, naming the actor."""

    class Handle:
        def __init__(self, enabled):
            self._ray_enable_tensor_transport = enabled

        def __repr__(self):
            return f"Actor(Plain, enabled={self._ray_enable_tensor_transport})"

    with caplog.at_level("ERROR", logger="devbridge.ray_transport"):
        manager.get_communicator_metadata(None, Handle(True))
        assert caplog.records == []
        manager.get_communicator_metadata(None, Handle(None))  # what Ray 2.60 sets for a plain actor
        manager.get_communicator_metadata(None, Handle(False))
    assert len(caplog.records) == 2
    assert "enable_tensor_transport=True" in caplog.records[0].getMessage()
    assert "enabled=None" in caplog.records[0].getMessage() and "enabled=False" in caplog.records[1].getMessage()


def test_accept_refuses_tokens_and_mismatched_names_in_process():
    """The plain worker class in this process (no Ray started): accept takes data, not a token, and as many
    names as tensors; a refused accept stores and counts nothing."""
    started = ray.is_initialized()
    w = rt._RDTDeviceWorker("host")
    try:
        bits = np.arange(4, dtype=np.uint16)
        token = w.put("bf", bits, dtype="bfloat16")
        one = w.share("bf")  # called in this very process: the tensor itself, as Ray hands an actor its own share
        two = w.share(["bf", "bf"])
        before = w.stats()
        with pytest.raises(devbridge.ForeignDomain, match="token"):
            w.accept("z", token)
        with pytest.raises(TypeError, match=r"2 names \['a', 'b'\] for one DeviceTensor"):
            w.accept(["a", "b"], one)
        with pytest.raises(TypeError, match="one name 'a' for a list of 2"):
            w.accept("a", two)
        with pytest.raises(ValueError, match="3 names"):
            w.accept(["a", "b", "c"], two)
        with pytest.raises(TypeError, match="5"):
            w.accept(["a", 5], two)
        with pytest.raises(ValueError, match=r"names \['a', 'a'\] name a tensor twice"):
            w.accept(["a", "a"], two)  # before: both stored, the first token stale at once
        with pytest.raises(TypeError, match="NoneType"):
            w.accept("a", None)
        after = w.stats()
        assert after["imports"] == before["imports"] and after["bytes_in"] == before["bytes_in"]
        assert after["refused_handles"] == before["refused_handles"] + 1 and list(w.tensors()) == ["bf"]
        refs = w.accept(["a", "b"], two)
        assert [r.name for r in refs] == ["a", "b"] and w.stats()["imports"] == before["imports"] + 2
        assert w.tensors()["a"]["dtype"] == "bfloat16" and same_bits(w.get("b"), bits)
        w.close()
        with pytest.raises(devbridge.Closed, match=w.domain):
            w.accept("c", one)
        assert w.stats()["bridge"] == {"closed": True}
    finally:
        w.close()
    assert ray.is_initialized() == started


# -------------------------------------------------------------------------------- on a local Ray cluster


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():  # pragma: no cover - another module's cluster
        ray.shutdown()
    runtime_env = {}
    if _FROM_CHECKOUT:
        source = _SOURCE

        def _hook():  # nested: pickled by value, so the workers need not import this test module
            import devbridge as _devbridge

            if source not in _devbridge.__path__:
                _devbridge.__path__.append(source)

        runtime_env["worker_process_setup_hook"] = _hook
    init_local(num_cpus=2, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False,
               configure_logging=False, runtime_env=runtime_env)
    try:
        yield
    finally:
        ray.shutdown()


def start(backend="host", **kw):
    w = rt.start_worker(backend, **kw)
    wait_until_ready(w, timeout=TIMEOUT)
    return w


@pytest.fixture(scope="module")
def workers(cluster):
    a, b = start("host"), start(OTHER_BACKEND)
    yield a, b
    for w in (a, b):
        ray.kill(w, no_restart=True)


def stats_of(worker):
    return get(worker.__ray_call__.remote(lambda self: rt.transport_stats()))


def test_hand_off_by_objectref_is_bit_exact_and_recycles_its_segment(workers):
    a, b = workers
    x = np.random.default_rng(1).standard_normal((512, 1000), dtype=np.float32)  # 2 MB: past the inline limit
    get(a.put.remote("x", x))
    ref = a.share.remote("x")
    y = get(b.accept.remote("y", ref))
    assert isinstance(y, TensorRef) and y.shape == x.shape and y.dtype == "float32"
    assert stats_of(a)["live"] == 1
    assert np.array_equal(get(b.get.remote("y")), x)
    # The same ref again: to the driver (a SegmentTensor over the mapping), and back to its sender (Ray hands
    # the sender its own tensor; accept stores a copy).
    here = get(ref)
    assert isinstance(here, rt.SegmentTensor) and np.array_equal(np.asarray(here), x)
    with pytest.warns(UserWarning, match="passed back to the actor that created it"):
        get(a.accept.remote("x_again", ref))
    # Overwrites x (in place on the host backend, in the very allocation x had when shared): the copy and the
    # segment, a snapshot taken when share returned, keep the old bytes.
    get(a.put.remote("x", np.zeros_like(x)))
    assert np.array_equal(get(a.get.remote("x_again")), x)
    # Accepted by its sender only after that write, or after x is deleted: still the snapshot, as elsewhere
    # (before: the zeros, or "has been freed").
    get(a.accept.remote("x_later", ref))
    assert np.array_equal(get(a.get.remote("x_later")), x)
    get(a.put.remote("x", x))
    shared_then_deleted = a.share.remote("x")
    get(a.delete.remote("x"))
    get(a.accept.remote("x_after_delete", shared_then_deleted))
    assert np.array_equal(get(a.get.remote("x_after_delete")), x)
    for name in ("x_later", "x_after_delete"):
        get(a.delete.remote(name))
    del shared_then_deleted
    get(b.accept.remote("z", ref))
    assert np.array_equal(get(b.get.remote("z")), x)
    # The other way, into the host worker: its bridge adopts the mapped segment as the tensor, no copy.
    before = get(a.stats.remote())["bridge"]
    back = b.share.remote("y")
    get(a.accept.remote("from_b", back))
    stats = get(a.stats.remote())["bridge"]
    assert stats["adopted_allocations"] == before["adopted_allocations"] + 1
    assert stats["copies_submitted"] == before["copies_submitted"]
    del ref, here, back
    assert eventually(lambda: stats_of(a)["live"] == 0 and stats_of(b)["live"] == 0)
    # What was received lives on without its ref (an adopted tensor holds its mapping, which keeps b's segment
    # aside until the tensor is replaced).
    assert np.array_equal(get(b.get.remote("y")), x) and np.array_equal(get(a.get.remote("from_b")), x)
    assert stats_of(b)["draining"] == 1
    if HAVE_TINYGRAD:
        get(a.run.remote(lambda t: t * 2, "from_b", "twice"))  # read in place by tinygrad
        assert np.array_equal(get(a.get.remote("twice")), x * 2)
    get(a.put.remote("from_b", np.ones_like(x)))  # read-only: replaced, never written into
    assert np.array_equal(get(a.get.remote("from_b")), np.ones_like(x))
    assert eventually(lambda: stats_of(b)["draining"] == 0 and stats_of(b)["pooled"] == 1)
    # The next share of that size is written into the pooled segment.
    reused = stats_of(b)["reused"]
    get(a.accept.remote("from_b", b.share.remote("y")))
    assert stats_of(b)["reused"] == reused + 1 and np.array_equal(get(a.get.remote("from_b")), x)


def test_several_tensors_and_dtypes_in_one_ref(workers):
    a, b = workers
    rng = np.random.default_rng(2)
    data = {"f16": rng.standard_normal((64, 3)).astype(np.float16), "i8": rng.integers(-100, 100, 4097).astype(np.int8),
            "u64": rng.integers(0, 1 << 62, size=(3, 5, 7), dtype=np.uint64)}
    bits = rng.integers(0, 1 << 16, size=(9, 9), dtype=np.uint16)
    for name, v in data.items():
        get(a.put.remote(name, v))
    get(a.put.remote("bf", bits, dtype="bfloat16"))
    names = [*data, "bf"]
    try:
        refs = get(b.accept.remote([f"r_{n}" for n in names], a.share.remote(names)))
    except devbridge.UnsupportedDType:  # OpenCL without cl_khr_fp16
        names = ["i8", "u64", "bf"]
        refs = get(b.accept.remote([f"r_{n}" for n in names], a.share.remote(names)))
    assert [r.name for r in refs] == [f"r_{n}" for n in names]
    assert get(b.tensors.remote())["r_bf"]["dtype"] == "bfloat16"
    for n in names:
        assert same_bits(get(b.get.remote(f"r_{n}")), bits if n == "bf" else data[n])


def test_the_driver_shares_its_own_device_tensor_with_ray_put(workers):
    _, b = workers
    x = np.random.default_rng(3).standard_normal((100, 100)).astype(np.float32)
    with devbridge.Bridge(backend="host") as bridge:
        t = bridge.upload(x, wait=True)
        ref = ray.put(t, _tensor_transport="devbridge")  # one-sided: the driver may be the sender
        assert rt.transport_stats()["live"] == 1
        get(b.accept.remote("from_driver", ref))
        assert np.array_equal(get(b.get.remote("from_driver")), x)
        del ref
        assert eventually(lambda: rt.transport_stats()["live"] == 0)
        t.free()


def test_a_dead_sender_fails_the_receiver_clearly(workers):
    _, b = workers
    sender = start("host", max_restarts=0)
    pid = get(sender.identity.remote())["pid"]
    get(sender.put.remote("s", np.arange(300_000, dtype=np.float32)))
    ref = sender.share.remote("s")
    assert stats_of(sender)["live"] == 1
    pid_b = get(b.identity.remote())["pid"]
    held_by_b = len(rt.segments(pid_b))
    ray.kill(sender, no_restart=True)
    assert eventually(lambda: not os.path.exists(f"/proc/{pid}") or rt._start_time(pid) is None)
    with pytest.raises(ray.exceptions.RayError, match="has died"):
        get(b.accept.remote("lost", ref))
    with pytest.raises(devbridge.UnknownDeviceHandle):
        get(b.get.remote("lost"))
    assert len(rt.segments(pid_b)) == held_by_b  # the failed receive kept nothing open
    del ref


def test_a_dead_receiver_neither_takes_the_sender_down_nor_leaks(workers):
    a, _ = workers
    receiver = start("host", max_restarts=0)
    pid = get(receiver.identity.remote())["pid"]
    get(a.put.remote("d", np.arange(100_000, dtype=np.int32)))
    # Segments earlier receivers still map (a tensor adopted in place lives in its segment) stay draining.
    draining = stats_of(a)["draining"]
    ref = a.share.remote("d")
    assert stats_of(a)["live"] == 1
    ray.kill(receiver, no_restart=True)
    # ray.kill only asks: a call sent before the process is gone could still run on it.
    assert eventually(lambda: not os.path.exists(f"/proc/{pid}") or rt._start_time(pid) is None)
    with pytest.raises(ray.exceptions.RayActorError):
        get(receiver.accept.remote("d", ref))
    # Ray kills both ends of a failed transfer unless the transport can abort; this one can (nothing waits).
    assert get(a.ping.remote()) == 1
    assert np.array_equal(np.asarray(get(ref)), np.arange(100_000, dtype=np.int32))
    del ref
    assert eventually(lambda: stats_of(a)["live"] == 0 and stats_of(a)["draining"] == draining)


def test_without_a_pool_a_freed_segment_is_closed(workers):
    a, b = workers
    pid_a = get(a.identity.remote())["pid"]
    get(a.__ray_call__.remote(lambda self: rt.set_pool_bytes(0)))
    try:
        assert eventually(lambda: stats_of(a)["pooled_bytes"] == 0)  # the pool emptied at once
        before = set(rt.segments(pid_a))  # what a maps as a receiver (tensors it adopted) stays
        get(a.put.remote("p", np.arange(70_000, dtype=np.float64)))
        ref = a.share.remote("p")
        get(b.accept.remote("p", ref))
        new = set(rt.segments(pid_a)) - before
        assert len(new) == 1
        del ref
        assert eventually(lambda: new.isdisjoint(rt.segments(pid_a)))
        assert np.array_equal(get(b.get.remote("p")), np.arange(70_000, dtype=np.float64))
    finally:
        get(a.__ray_call__.remote(lambda self: rt.set_pool_bytes(None)))
