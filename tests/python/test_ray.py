"""devbridge.ray on a local Ray cluster: put/run/get, cross-backend hand-off, kill-and-restore, stale handles.

The plain worker class in this process first (no Ray started: argument checks, run's results, counters,
close, stale checkpoint files, wait_until_ready's retry rule), then one cluster for the module (started on
loopback by ``init_local`` and shut down by the ``cluster`` fixture), small arrays, a timeout on every
ray.get. Skipped when Ray (or tinygrad) is not installed.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import tempfile
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'devbridge[ray]'; "
                                        "requirements-dev.txt installs it)")
pytest.importorskip("tinygrad", reason="tinygrad is not installed (DeviceWorker.run computes with it)")

import devbridge  # noqa: E402
from conftest import same_bits  # noqa: E402
import devbridge.ray as dray  # noqa: E402
import devbridge._ray_worker as ray_worker  # noqa: E402
from devbridge._intake import _numpy_dtype  # noqa: E402
from devbridge.ray import TensorRef, init_local, non_loopback_addresses, start_worker, wait_until_ready  # noqa: E402

TIMEOUT = 60  # seconds, for every ray.get
HAVE_OPENCL = any(b["name"] == "opencl" and b["available"] for b in devbridge.list_backends())
OTHER_BACKEND = "opencl" if HAVE_OPENCL else "host"


def get(ref, timeout=TIMEOUT):
    return ray.get(ref, timeout=timeout)


# ------------------------------------------------------------------ the plain class, in this process (no Ray)


@pytest.fixture
def local_worker():
    w = dray._DeviceWorker("host")
    yield w
    w.close()


def test_the_plain_class_runs_in_process_and_never_starts_ray():
    """Documented to run in-process (domain local-..., generation 1): asking Ray who it is would start a Ray
    instance, on the machine's network address."""
    started = ray.is_initialized()
    w = dray._DeviceWorker("host")
    try:
        assert w.domain.startswith("local-") and w.generation == 1
        w.put("x", np.arange(4, dtype=np.float32))
        identity = w.identity()
        assert identity["domain"] == w.domain and identity["pid"] == os.getpid()
        assert w.stats()["puts"] == 1
        assert ray.is_initialized() == started
        if not started:
            assert identity["node_id"] is None
    finally:
        w.close()
    assert ray.is_initialized() == started


def _bf16_bits(x):
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # exact for these values


@pytest.mark.parametrize("backend", ["host", "opencl"])
def test_run_keeps_a_results_shape_and_dtype(backend):
    """0-d results stay 0-d; a dtype numpy lacks (bfloat16, float8) is stored as itself, bit for bit, where the
    results are staged back (OpenCL; a 0-d result on the host backend), not as tinygrad's float32 numpy()."""
    if backend == "opencl" and not HAVE_OPENCL:
        pytest.skip("no OpenCL device")
    from tinygrad import Tensor, dtypes

    w = dray._DeviceWorker(backend)
    try:
        x = np.arange(12, dtype=np.float32) * 0.5 - 3  # exact in bfloat16 and float8_e4m3fn
        w.put("x", x)
        w.put("s", np.array(5, np.int32))
        total = w.run(lambda t: t.sum(), "x", "sum")
        assert total.shape == () and w.get("sum").shape == () and w.get("sum") == x.sum()
        assert w.run(lambda t: t + 1, "s", "s1").shape == ()
        assert w.get("s1").shape == () and w.get("s1") == 6 and w.get("s1").dtype == np.int32
        bf0 = w.run(lambda t: t.sum().cast(dtypes.bfloat16), "x", "bf0")  # 0-d: staged back on every backend
        assert bf0.dtype == "bfloat16" and bf0.shape == () and w.tensors()["bf0"]["dtype"] == "bfloat16"
        assert same_bits(w.get("bf0"), _bf16_bits(x.sum()))
        if backend == "host":
            return  # the host backend computes a shaped result in place (assign), in the kernel's own dtype
        bf = w.run(lambda t: t.cast(dtypes.bfloat16), "x", "bf")
        assert bf.dtype == "bfloat16" and bf.shape == (12,) and w.tensors()["bf"]["dtype"] == "bfloat16"
        assert same_bits(w.get("bf"), _bf16_bits(x))
        f8 = w.run(lambda t: t.cast(dtypes.fp8e4m3), "x", "f8")
        assert f8.dtype == "float8_e4m3fn" and w.tensors()["f8"]["nbytes"] == 12
        want = Tensor(x, device="CPU").cast(dtypes.fp8e4m3).bitcast(dtypes.uint8).numpy()
        assert same_bits(w.get("f8"), want)
    finally:
        w.close()


def test_run_is_all_or_nothing(local_worker):
    w = local_worker
    w.put("x", np.ones(4, np.float32))
    called = []

    def pair(t):
        called.append(1)
        return t + 1, t + 2

    with pytest.raises(TypeError, match="7"):
        w.run(pair, "x", ["y", 7])  # checked before fn runs
    with pytest.raises(TypeError, match="''"):
        w.run(pair, "x", ["y", ""])
    with pytest.raises(ValueError, match="twice"):
        w.run(pair, "x", ["y", "y"])
    assert called == []
    with pytest.raises(ValueError, match="returned 2 tensors"):
        w.run(pair, "x", ["y", "z", "u"])

    def fails(t):
        raise RuntimeError("fn failed")

    with pytest.raises(RuntimeError, match="fn failed"):
        w.run(fails, "x", "y")
    with pytest.raises(TypeError, match=r"returned None.*\['y'\]"):
        w.run(lambda t: None, "x", "y")
    with pytest.raises(TypeError, match="returned int"):
        w.run(lambda t: 3, "x", ["y"])
    assert list(w.tensors()) == ["x"] and w.stats()["runs"] == 0
    assert w.stats()["bridge"]["live_allocations"] == 1  # nothing made is left behind
    assert w.run(pair, "x", ["y", "z"])[1].name == "z" and w.stats()["runs"] == 1


def test_run_names_the_worker_and_outputs_of_what_fn_raises_and_refuses_what_is_no_fn(local_worker):
    """An exception out of fn keeps its type, names the worker and the outputs, and chains the original; fn or
    inputs of the wrong kind are a TypeError naming them (before: a bare TypeError from deep inside)."""
    w = local_worker
    w.put("x", np.ones(4, np.float32))

    def fails(t):
        raise KeyError("inner")

    with pytest.raises(KeyError, match=rf"{w.domain}.*fails.*\['y'\].*inner") as caught:
        w.run(fails, "x", "y")
    assert isinstance(caught.value.__cause__, KeyError) and str(caught.value.__cause__) == "'inner'"
    with pytest.raises(TypeError, match=rf"{w.domain}: run: fn must be callable.*int"):
        w.run(5, "x", "y")
    with pytest.raises(TypeError, match=rf"{w.domain}: run: inputs .*NoneType"):
        w.run(lambda t: t, None, "y")
    assert list(w.tensors()) == ["x"] and w.stats()["runs"] == 0


@pytest.mark.parametrize("backend", ["host", "opencl"])
def test_run_over_a_bfloat16_input_tinygrad_cannot_compile_is_unsupported(backend):
    """A kernel over a bfloat16 input that tinygrad's CPU device cannot build (clang without __bf16 on the target)
    is devbridge.Unsupported naming the worker, the input and its dtype, as documented: before, the host backend
    raised UnsupportedDType naming a DeviceHandle, OpenCL a raw CalledProcessError from clang."""
    if backend == "opencl" and not HAVE_OPENCL:
        pytest.skip("no OpenCL device")
    w = dray._DeviceWorker(backend)
    try:
        w.put("x", np.array([0x3F80, 0x4000], np.uint16), dtype="bfloat16")
        try:
            w.run(lambda t: t.contiguous(), "x", "y")
        except devbridge.Unsupported as error:
            assert w.domain in str(error) and "'x'" in str(error) and "bfloat16" in str(error)
        else:  # this tinygrad builds bfloat16 kernels here: nothing to refuse, and it is stored as itself
            assert w.tensors()["y"]["dtype"] == "bfloat16"
    finally:
        w.close()


def test_start_worker_refuses_concurrent_calls():
    """A worker runs one call at a time: a threaded actor failed every run inside tinygrad (its sqlite objects
    used from another thread). Refused before any actor exists, so no cluster is needed."""
    for options in ({"max_concurrency": 4}, {"concurrency_groups": {"io": 2}}):
        with pytest.raises(ValueError, match="one call at a time"):
            start_worker("host", ray_options=options)


def test_tokens_name_the_process_that_issued_them(local_worker):
    """A token from an earlier process of the worker (same domain, even the same generation: a hand-made bridge
    restart then a restart by Ray) is OldGenerationHandle; before, it was accepted and read the new process's
    tensor of that name and version."""
    w = local_worker
    token = w.put("x", np.arange(3, dtype=np.float32))
    assert token.incarnation == w.identity()["incarnation"] == w.incarnation
    earlier = TensorRef(token.domain, token.generation, token.name, token.version, token.shape, token.dtype,
                        "an-earlier-process")
    with pytest.raises(devbridge.OldGenerationHandle, match="earlier process"):
        w.get(earlier)
    assert same_bits(w.get(token), np.arange(3, dtype=np.float32))


def test_put_refuses_what_is_not_data_and_counts_only_what_it_stores(local_worker):
    w = local_worker
    x = np.arange(6, dtype=np.float32)
    token = w.put("x", x)
    kept = ("puts", "imports", "bytes_in")
    counts = {k: w.stats()[k] for k in (*kept, "refused_handles")}
    with pytest.raises(TypeError, match=r"\['a'\]"):
        w.put(["a"], x)
    with pytest.raises(TypeError, match="None"):
        w.put(None, x)
    with pytest.raises(TypeError, match="NoneType"):
        w.put("v", None)
    with pytest.raises(TypeError, match="str"):
        w.put("v", "hello")
    with pytest.raises(TypeError, match="object"):
        w.put("v", object())
    with pytest.raises(devbridge.ForeignDomain, match="token"):
        w.put("z", token)  # the token is not the data, here as in import_
    with pytest.raises(devbridge.ForeignDomain, match="token"):
        w.import_("z", token)
    with pytest.raises(TypeError, match="5"):
        w.import_(5, w.export("x"))
    with pytest.raises(ValueError, match=rf"{w.domain}: put 'v': dtype='float64'"):
        w.put("v", x, dtype="float64")  # 4-byte items relabelled as 8-byte ones
    with pytest.raises(ValueError, match=rf"{w.domain}: put 'v': the int {2**70} is out of the range"):
        w.put("v", 2**70)  # before: "not int"
    for key in (5, ["x"]):
        with pytest.raises(TypeError, match=rf"{w.domain}: a tensor is named by a str"):
            w.get(key)
    after = w.stats()
    assert {k: after[k] for k in kept} == {k: counts[k] for k in kept}
    assert after["refused_handles"] == counts["refused_handles"] + 2
    assert list(w.tensors()) == ["x"] and after["bridge"]["live_allocations"] == 1
    w.put("l", [1.0, 2.0])  # what numpy reads as numbers still goes
    assert w.stats()["puts"] == counts["puts"] + 1 and w.stats()["bytes_in"] == counts["bytes_in"] + 16


def test_checkpoint_names_and_metadata(local_worker, tmp_path):
    w = local_worker
    w.put("bf", np.ones(4, np.float32))
    w.put("other", np.zeros(3, np.float32))
    path = tmp_path / "one.safetensors"
    assert w.checkpoint(str(path), names="bf") == str(path)  # a str is one name, not its characters
    info = devbridge.checkpoint_info(path)
    assert sorted(info["tensors"]) == ["bf"]
    for key in ("devbridge_ray_domain", "devbridge_ray_generation"):
        with pytest.raises(ValueError, match=key):
            w.checkpoint(str(tmp_path / "meta.safetensors"), metadata={key: "99"})
    assert not (tmp_path / "meta.safetensors").exists() and w.stats()["checkpoints"] == 1
    w.checkpoint(str(tmp_path / "meta.safetensors"), metadata={"step": "7"})
    meta = devbridge.checkpoint_info(tmp_path / "meta.safetensors")["metadata"]
    assert meta["step"] == "7" and meta["devbridge_ray_domain"] == w.domain and meta["devbridge_ray_generation"] == "1"


def test_a_closed_worker_says_so_and_still_reports(local_worker):
    w = local_worker
    w.put("x", np.ones(4, np.float32))
    w.close()
    stats = w.stats()  # so that a user can confirm nothing is held
    assert stats["closed"] and stats["bridge"] == {"closed": True}
    assert stats["tensors"] == 0 and stats["tensor_bytes"] == 0 and stats["puts"] == 1
    assert w.identity()["domain"] == w.domain and w.tensors() == {} and w.ping() == 1
    for call in (lambda: w.put("x", np.ones(4, np.float32)), lambda: w.get("x"), lambda: w.run(lambda t: t, "x", "y"),
                 lambda: w.checkpoint("/nonexistent/x.safetensors")):
        with pytest.raises(devbridge.Closed, match=w.domain):
            call()
    w.close()  # again: nothing happens


def _random_of(name, shape, rng):
    """Random values of devbridge dtype ``name`` as its numpy dtype (ml_dtypes' for bfloat16/float8), finite."""
    if name == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if name.startswith(("int", "uint")):
        return rng.integers(0, 100, shape).astype(name)
    return (rng.standard_normal(shape) * 4).astype(np.float32).astype(_numpy_dtype(name))


@pytest.mark.parametrize("backend", ["host", "opencl"])
def test_run_takes_every_dtype_the_worker_stores(backend):
    """Every dtype a worker stores goes into run() as that tinygrad dtype, bit for bit, on a backend whose inputs
    are copied out for tinygrad (OpenCL) as on the host backend (zero-copy): before, a float8 input on OpenCL was a
    raw KeyError from tinygrad (it takes no ml_dtypes array)."""
    if backend == "opencl" and not HAVE_OPENCL:
        pytest.skip("no OpenCL device")
    from tinygrad import dtypes

    rng = np.random.default_rng(41)
    w = dray._DeviceWorker(backend)
    try:
        for name in devbridge.dtypes():
            for shape in [(7,), (2, 3), ()]:
                x = _random_of(name, shape, rng)
                w.put("x", x, dtype=name)
                seen = []

                def identity(t, seen=seen):
                    seen.append((t.dtype, t.shape))
                    return t

                try:
                    ref = w.run(identity, "x", "y")
                except devbridge.Unsupported as error:
                    # Zero-copy bfloat16 buffers: tinygrad's CPU kernels need clang's __bf16, which some
                    # targets lack. Said as documented: the worker, the input and its dtype.
                    assert backend == "host" and name == "bfloat16", (name, shape, error)
                    assert w.domain in str(error) and "input 'x' is bfloat16" in str(error)
                    continue
                tinygrad_dtype = getattr(dtypes, devbridge.dtype_info(name)["tinygrad_name"])
                assert seen == [(tinygrad_dtype, shape)], (name, shape)
                assert ref.dtype == name and ref.shape == shape
                assert same_bits(w.get("y"), w.get("x")), (name, shape)
                if name.startswith(("float", "bfloat")):  # computed with, not only handed through
                    w.run(lambda t: t.cast(dtypes.float32) * 2, "x", "f")
                    assert np.array_equal(w.get("f"), np.asarray(x).astype(np.float32) * 2), (name, shape)
    finally:
        w.close()


@pytest.mark.parametrize("backend", ["host", "opencl"])
def test_a_restart_of_the_workers_bridge_is_followed(backend):
    """worker.bridge.restart(g) retires every allocation: the worker moves to generation g with its bridge (so
    its identity and tokens agree with the bridge), drops the names (a lookup says what took them), refuses the
    old tokens, and a put of a name it held allocates anew; before, it stayed at generation 1 and every put of an
    existing name of the same shape and dtype wrote into the retired handle (OldGenerationHandle, for ever)."""
    if backend == "opencl" and not HAVE_OPENCL:
        pytest.skip("no OpenCL device")
    rng = np.random.default_rng(5)
    w = dray._DeviceWorker(backend)
    try:
        old = w.put("x", rng.standard_normal(8).astype(np.float32))
        w.put("y", rng.standard_normal(3).astype(np.float32))
        w.bridge.restart(2)
        assert w.ping() == 2 and w.generation == w.bridge.generation == 2 and w.identity()["generation"] == 2
        assert w.tensors() == {}
        for _ in range(2):  # into the same name, shape and dtype: again and again
            x = rng.standard_normal(8).astype(np.float32)
            token = w.put("x", x)
            assert token.generation == 2 and same_bits(w.get("x"), x) and same_bits(w.get(token), x)
        with pytest.raises(devbridge.OldGenerationHandle, match="generation 1"):
            w.get(old)
        with pytest.raises(devbridge.UnknownDeviceHandle, match="bridge was restarted from generation 1 to 2"):
            w.get("y")
        assert list(w.tensors()) == ["x"] and w.handle("x").generation == 2
        stats = w.stats()
        assert stats["generation"] == 2 and stats["tensors"] == 1 and stats["bridge"]["live_allocations"] == 1
        w.run(lambda t: t + 1, "x", "z")
        assert same_bits(w.get("z"), x + 1)
    finally:
        w.close()


def test_every_method_taking_a_key_takes_a_tensorref(local_worker, tmp_path):
    """A TensorRef is a key wherever a name is: handle(), checkpoint(names=...) (stored under the tensor's name,
    not the token), get, export, run, delete; before, handle(TensorRef) was a raw KeyError."""
    w = local_worker
    rng = np.random.default_rng(9)
    x, other = rng.standard_normal(5).astype(np.float32), rng.standard_normal(2).astype(np.float32)
    token = w.put("x", x)
    w.put("other", other)
    assert w.handle(token) == token == w.handle("x")
    assert same_bits(w.get(token), x) and same_bits(np.asarray(w.export(token)), x)
    path = tmp_path / "by_token.safetensors"
    w.checkpoint(str(path), names=token)
    assert sorted(devbridge.checkpoint_info(path)["tensors"]) == ["x"]
    w.checkpoint(str(path), names=[token, "other"])
    assert sorted(devbridge.checkpoint_info(path)["tensors"]) == ["other", "x"]
    assert same_bits(w.get(w.run(lambda t: t * 2, token, "y")), x * 2)
    w.put("x", x + 1)  # the token now names a replaced tensor: refused everywhere, as the bridge refuses
    for call in (lambda: w.handle(token), lambda: w.checkpoint(str(path), names=[token]), lambda: w.delete(token)):
        with pytest.raises(devbridge.UnknownDeviceHandle, match="replaced"):
            call()
    w.delete(w.handle("x"))
    assert sorted(w.tensors()) == ["other", "y"]


def test_put_refuses_an_empty_array_and_stores_bytes_as_uint8(local_worker):
    """What docs/RAY.md says put does with these (as Bridge.upload, PYTHON.md)."""
    w = local_worker
    for empty in (np.zeros(0, np.float32), np.zeros((3, 0), np.int64)):
        with pytest.raises(ValueError, match="empty"):
            w.put("e", empty)
    data = np.random.default_rng(8).integers(0, 256, 5, dtype=np.uint8).tobytes()
    for value in (data, bytearray(data), memoryview(data)):
        token = w.put("b", value)
        assert token.dtype == "uint8" and token.shape == (5,) and w.get("b").tobytes() == data
    assert list(w.tensors()) == ["b"]


def test_identity_reports_the_backend_auto_resolved_to():
    w = dray._DeviceWorker("auto")
    try:
        backend = w.identity()["backend"]
        assert backend == w.bridge.backend != "auto" and w.stats()["backend"] == backend
    finally:
        w.close()


def test_a_restarted_worker_removes_an_interrupted_checkpoints_files(tmp_path, monkeypatch):
    """A process killed in the middle of checkpoint() leaves its temporary file (and the replaced file's second
    name) beside the checkpoint: the worker Ray restarts removes them before restoring; a first start does not."""
    path = tmp_path / "w.safetensors"
    first = dray._DeviceWorker("host", checkpoint=str(path))
    try:
        first.put("x", np.arange(8, dtype=np.float32))
        first.checkpoint()
    finally:
        first.close()
    fd, tmp = tempfile.mkstemp(prefix=".w.safetensors.", suffix=".tmp", dir=tmp_path)  # what the writer makes
    os.write(fd, b"partial")
    os.close(fd)
    old = tmp_path / ".w.safetensors.abcd_123.old"
    os.link(path, old)
    others = [tmp_path / n for n in (".v.safetensors.abcd1234.tmp", "w.safetensors.abcd1234.tmp",
                                     ".w.safetensors.abcd1234.keep", ".w.safetensors.tmp")]
    for other in others:
        other.write_bytes(b"not the writer's")
    again = dray._DeviceWorker("host", checkpoint=str(path))  # generation 1: a first start removes nothing
    again.close()
    assert os.path.exists(tmp) and old.exists()
    monkeypatch.setattr(ray_worker, "_actor_identity", lambda: ("local-restarted", 2))
    restarted = dray._DeviceWorker("host", checkpoint=str(path))
    try:
        assert sorted(restarted.stats()["stale_removed"]) == sorted([str(old), tmp])
        assert not os.path.exists(tmp) and not old.exists() and all(o.exists() for o in others)
        assert restarted.stats()["restored_names"] == ["x"]
        assert np.array_equal(restarted.get("x"), np.arange(8, dtype=np.float32))
    finally:
        restarted.close()


class _FakeActor:
    """Stands for an actor handle: ``ping.remote()`` whose ``ray.get`` (patched) raises or answers in turn."""

    class _Method:
        def remote(self):
            return "ping"

    def __init__(self):
        self.ping = self._Method()


def _answering(answers: list):
    """A stand-in for ray.get that returns (or raises) the next of ``answers``, whatever it is asked."""

    def fake_get(ref, timeout=None):
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return fake_get


def test_wait_until_ready_retries_a_restarting_worker_and_not_a_dead_one(monkeypatch):
    answers = [ray.exceptions.ActorUnavailableError("restarting", None), ray.exceptions.RayActorError(), 2]
    monkeypatch.setattr(ray, "get", _answering(answers))
    monkeypatch.setattr(dray, "_restarting", lambda worker: False)
    assert wait_until_ready(_FakeActor(), timeout=10, min_generation=2) == 2 and answers == []
    answers[:] = [ray.exceptions.ActorDiedError(), 2]
    began = time.monotonic()
    with pytest.raises(ray.exceptions.ActorDiedError, match="dead for good") as caught:
        wait_until_ready(_FakeActor(), timeout=10)
    assert time.monotonic() - began < 5 and answers == [2]
    assert isinstance(caught.value.__cause__, ray.exceptions.ActorDiedError)
    # Unless the GCS says Ray is restarting it (the ping reached the process that died).
    monkeypatch.setattr(dray, "_restarting", lambda worker: True)
    answers[:] = [ray.exceptions.ActorDiedError(), 3]
    assert wait_until_ready(_FakeActor(), timeout=10) == 3


def test_wait_until_ready_replacing_waits_past_the_dying_process(monkeypatch):
    """After a hand-made bridge restart, the process Ray starts next may have the generation of the dying one:
    replacing= (an incarnation, or a token of the old process) skips the old process's answers."""
    answers = [{"generation": 2, "incarnation": "old"}, ray.exceptions.ActorUnavailableError("restarting", None),
               {"generation": 2, "incarnation": "new"}]

    class Actor:
        class identity:
            @staticmethod
            def remote():
                return "identity"

    monkeypatch.setattr(ray, "get", _answering(answers))
    old_token = TensorRef("w", 2, "x", 1, (1,), "float32", "old")
    assert wait_until_ready(Actor(), timeout=10, min_generation=2, replacing=old_token) == 2 and answers == []


# -------------------------------------------------------------------------------- on a local Ray cluster


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():  # pragma: no cover - another module's cluster
        ray.shutdown()
    init_local(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False,
               configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def host_worker(cluster):
    w = start_worker("host")
    wait_until_ready(w, timeout=TIMEOUT)
    yield w
    ray.kill(w, no_restart=True)


@pytest.fixture(scope="module")
def other_worker(cluster):
    w = start_worker(OTHER_BACKEND)
    wait_until_ready(w, timeout=TIMEOUT)
    yield w
    ray.kill(w, no_restart=True)


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (ip.ipv4_mapped or ip).is_loopback if ip.version == 6 else ip.is_loopback


def _listening_sockets(root: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of each TCP socket listening in process ``root`` or its descendants
    (Ray's GCS, raylet, agents and workers are the driver's), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rpartition(")")[2].split()[1]), []).append(int(entry))
        except OSError:
            continue  # exited meanwhile
    inodes: dict[str, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if link.startswith("socket:["):
                inodes[link[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                try:
                    with open(f"/proc/{inodes[fields[9]]}/comm") as f:
                        name = f.read().strip()
                except OSError:
                    name = "(exited)"
                found.append((str(ipaddress.ip_address(raw)), int(port, 16), name))
    return found


def test_ray_keeps_its_traffic_on_loopback(host_worker):
    """init_local's instance (what every test, example and benchmark starts) names and listens on 127.0.0.1
    only, never on the machine's network address."""
    assert _loopback(ray.util.get_node_ip_address())
    assert _loopback(ray.get_runtime_context().gcs_address.rpartition(":")[0])
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert nodes and all(_loopback(n["NodeManagerAddress"]) for n in nodes), nodes
    assert _loopback(get(host_worker.__ray_call__.remote(lambda self: ray.util.get_node_ip_address())))
    assert non_loopback_addresses() == []
    if sys.platform.startswith("linux"):
        sockets = _listening_sockets(os.getpid())
        names = {name for _, _, name in sockets}
        assert "gcs_server" in names and "raylet" in names, sockets
        assert all(_loopback(address) for address, _, _ in sockets), sockets
    with pytest.raises(TypeError, match="address"):
        init_local(address="auto")  # never joins whatever RAY_ADDRESS names


def test_put_run_get(host_worker):
    w = host_worker
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 48), dtype=np.float32)
    m = rng.standard_normal((48, 16), dtype=np.float32)
    ref = get(w.put.remote("x", x))
    assert isinstance(ref, TensorRef) and ref.name == "x" and ref.shape == (32, 48) and ref.dtype == "float32"
    get(w.put.remote("m", ray.put(m)))            # an ObjectRef argument: resolved by Ray, staged from shm
    get(w.put.remote("m2", [ray.put(m)]))         # a nested ObjectRef: fetched by the worker
    out = get(w.run.remote(lambda a, b: (a @ b).relu(), ["x", "m"], ["y"]))
    assert [r.name for r in out] == ["y"] and out[0].shape == (32, 16)
    y = get(w.get.remote("y"))
    np.testing.assert_allclose(y, np.maximum(x @ m, 0), rtol=1e-5, atol=1e-5)
    # Elementwise results are bit-exact; the worker's tokens name its inputs too; several outputs.
    a, b = get(w.run.remote(lambda t, s: (t * 2 + s, t - 1), [ref, "x"], ["a", "b"]))
    assert np.array_equal(get(w.get.remote(a)), x * 2 + x) and np.array_equal(get(w.get.remote("b")), x - 1)
    assert np.array_equal(get(w.get.remote("m2")), m)
    # Tensors fn creates without device= land on the worker's device (no mixed-device failure).
    from tinygrad import Tensor
    one = get(w.run.remote(lambda t: t + Tensor.ones(*t.shape), "x", "x1"))
    assert isinstance(one, TensorRef)
    assert np.array_equal(get(w.get.remote("x1")), x + 1)
    stats = get(w.stats.remote())
    assert stats["puts"] >= 3 and stats["runs"] >= 3 and stats["generation"] == 1 and stats["backend"] == "host"
    assert stats["bridge"]["live_views"] == 0


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8", "float16", "float64"])
def test_put_get_dtypes_bit_exact(host_worker, other_worker, dtype):
    data = (np.random.default_rng(2).standard_normal(1000) * 50).astype(dtype).reshape(10, 100)
    for w in (host_worker, other_worker):
        try:
            get(w.put.remote("d", data))
        except devbridge.UnsupportedDType:
            continue  # OpenCL without cl_khr_fp16
        back = get(w.get.remote("d"))
        assert back.dtype == data.dtype and back.shape == data.shape and np.array_equal(back, data)


def test_cross_backend_hand_off_is_bit_exact(host_worker, other_worker):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 257), dtype=np.float32)
    get(host_worker.put.remote("h", x))
    # host -> other (OpenCL where available), through the object store, then back.
    exported = host_worker.export.remote("h")
    portable = get(exported)
    assert isinstance(portable, devbridge.PortableTensor) and np.array_equal(np.asarray(portable), x)
    ref = get(other_worker.import_.remote("h", exported))
    assert ref.shape == x.shape and ref.dtype == "float32"
    assert np.array_equal(get(other_worker.get.remote("h")), x)
    get(other_worker.run.remote(lambda t: t * 3 - 1, "h", "h3"))
    get(host_worker.import_.remote("back", other_worker.export.remote("h3")))
    h3 = get(other_worker.get.remote("h3"))
    np.testing.assert_allclose(h3, x * 3 - 1, rtol=1e-6, atol=1e-6)  # tinygrad may fuse (fma)
    assert np.array_equal(get(host_worker.get.remote("back")), h3)
    # A dtype numpy lacks travels as its bits.
    bits = rng.integers(0, 1 << 16, size=(33,), dtype=np.uint16)
    get(host_worker.put.remote("bf", bits, dtype="bfloat16"))
    get(other_worker.import_.remote("bf", host_worker.export.remote("bf")))
    assert get(other_worker.tensors.remote())["bf"]["dtype"] == "bfloat16"
    assert same_bits(get(other_worker.get.remote("bf")), bits)


def test_a_host_worker_adopts_a_handed_over_export_with_no_copy(host_worker):
    w = host_worker
    x = np.random.default_rng(5).standard_normal((256, 300), dtype=np.float32)  # > Ray's inline limit
    before = get(w.stats.remote())["bridge"]
    get(w.put.remote("adopt_a", ray.put(x)))  # put copies: a worker's own state must not pin the object store
    assert get(w.stats.remote())["bridge"]["adopted_allocations"] == before["adopted_allocations"]
    # The same exported object imported twice (one buffer, adopted twice), read, computed on.
    ref = w.export.remote("adopt_a")
    submitted = get(w.stats.remote())["bridge"]["copies_submitted"]
    get(w.import_.remote("adopt_b", ref))
    get(w.import_.remote("adopt_c", ref))
    stats = get(w.stats.remote())["bridge"]
    assert stats["adopted_allocations"] == before["adopted_allocations"] + 2
    assert stats["copies_submitted"] == submitted  # nothing was copied in
    assert np.array_equal(get(w.get.remote("adopt_b")), x) and np.array_equal(get(w.get.remote("adopt_c")), x)
    get(w.run.remote(lambda t, u: t + u, ["adopt_b", "adopt_c"], ["adopt_d"]))
    assert np.array_equal(get(w.get.remote("adopt_d")), x + x)
    # A put over an adopted tensor of the same shape never writes into the (immutable) buffer.
    get(w.put.remote("adopt_b", np.zeros_like(x)))
    assert np.array_equal(get(w.get.remote("adopt_b")), np.zeros_like(x))
    assert np.array_equal(get(w.get.remote("adopt_c")), x) and np.array_equal(get(ref).numpy(), x)
    for name in ("adopt_a", "adopt_b", "adopt_c", "adopt_d"):
        get(w.delete.remote(name))
    stats = get(w.stats.remote())["bridge"]
    assert stats["adopted_allocations"] == before["adopted_allocations"] and stats["live_views"] == 0


def test_tokens_of_other_workers_or_replaced_tensors_are_refused(host_worker, other_worker):
    ref = get(host_worker.put.remote("t", np.arange(10, dtype=np.int32)))
    with pytest.raises(devbridge.ForeignDomain):
        get(other_worker.get.remote(ref))
    with pytest.raises(devbridge.ForeignDomain):
        get(other_worker.import_.remote("t", ref))  # the token is not the tensor: hand over export()
    newer = get(host_worker.put.remote("t", np.arange(10, 20, dtype=np.int32)))
    with pytest.raises(devbridge.UnknownDeviceHandle):
        get(host_worker.get.remote(ref))            # replaced since
    assert np.array_equal(get(host_worker.get.remote(newer)), np.arange(10, 20))
    get(host_worker.delete.remote("t"))
    with pytest.raises(devbridge.UnknownDeviceHandle):
        get(host_worker.get.remote(newer))
    with pytest.raises(devbridge.UnknownDeviceHandle):
        get(host_worker.get.remote("no such tensor"))
    forged = TensorRef(newer.domain, newer.generation + 1, newer.name, newer.version, newer.shape, newer.dtype,
                       newer.incarnation)
    with pytest.raises(devbridge.ForeignDomain):
        get(host_worker.get.remote(forged))
    assert get(host_worker.stats.remote())["refused_handles"] >= 3


def test_checkpoint_and_restore_explicit(host_worker, tmp_path):
    path = tmp_path / "explicit.safetensors"
    get(host_worker.put.remote("c", np.full((5, 7), 2.5, np.float32)))
    assert get(host_worker.checkpoint.remote(str(path), names=["c"])) == str(path)
    assert tuple(devbridge.checkpoint_info(path)["tensors"]["c"]["shape"]) == (5, 7)
    old = get(host_worker.put.remote("c", np.zeros((5, 7), np.float32)))
    assert get(host_worker.restore.remote(str(path))) == ["c"]
    assert np.array_equal(get(host_worker.get.remote("c")), np.full((5, 7), 2.5, np.float32))
    with pytest.raises(devbridge.UnknownDeviceHandle):
        get(host_worker.get.remote(old))            # restore replaced it


def test_worker_killed_mid_run_restarts_restores_and_refuses_old_handles(cluster, tmp_path):
    path = tmp_path / "worker.safetensors"
    w = start_worker(OTHER_BACKEND, checkpoint=str(path), max_restarts=2)
    try:
        assert wait_until_ready(w, timeout=TIMEOUT) == 1
        x = np.random.default_rng(4).standard_normal((16, 16), dtype=np.float32)
        tx = get(w.put.remote("x", x))
        ty = get(w.run.remote(lambda t: t * 2, "x", "y"))
        get(w.checkpoint.remote())
        get(w.put.remote("late", np.ones(4, np.float32)))   # after the checkpoint: lost with the process

        def slow(t):
            import time as _time
            _time.sleep(30)
            return t + 1

        in_flight = w.run.remote(slow, "y", "z")
        time.sleep(0.5)
        ray.kill(w, no_restart=False)
        with pytest.raises(ray.exceptions.RayActorError):
            get(in_flight)
        assert wait_until_ready(w, timeout=TIMEOUT, min_generation=2) == 2
        stats = get(w.stats.remote())
        assert stats["generation"] == 2 and stats["restored_from"] == str(path)
        assert stats["restored_names"] == ["x", "y"] and stats["bridge"]["generation"] == 2
        # Names come back (bit-exact); tokens from the dead process are refused, never accepted.
        assert np.array_equal(get(w.get.remote("x")), x) and np.array_equal(get(w.get.remote("y")), x * 2)
        for stale in (tx, ty):
            with pytest.raises(devbridge.OldGenerationHandle):
                get(w.get.remote(stale))
        with pytest.raises(devbridge.OldGenerationHandle):
            get(w.run.remote(lambda t: t, [ty], ["copy"]))
        with pytest.raises(devbridge.UnknownDeviceHandle):
            get(w.get.remote("late"))
        # The pipeline continues: fresh tokens of generation 2 work.
        fresh = get(w.handle.remote("y"))
        assert fresh.generation == 2
        get(w.run.remote(lambda t: t + 1, fresh, "z"))
        assert np.array_equal(get(w.get.remote("z")), x * 2 + 1)
    finally:
        ray.kill(w, no_restart=True)


def test_tokens_of_a_process_restarted_by_hand_then_by_ray_are_refused(cluster):
    """bridge.restart(2) by hand, then a kill Ray restarts from: the new process is at generation 2 again, with its
    versions from 1; the old process's token names the same generation, name and version, and is refused."""
    w = start_worker("host", max_restarts=1)
    try:
        wait_until_ready(w, timeout=TIMEOUT)
        get(w.__ray_call__.remote(lambda self: self.bridge.restart(2)))
        old = get(w.put.remote("x", np.arange(10, dtype=np.float32)))
        assert old.generation == 2
        ray.kill(w, no_restart=False)
        assert wait_until_ready(w, timeout=TIMEOUT, min_generation=2, replacing=old) == 2
        new = get(w.put.remote("x", np.full(10, -1, np.float32)))
        assert (new.generation, new.version) == (old.generation, old.version) and new.incarnation != old.incarnation
        with pytest.raises(devbridge.OldGenerationHandle, match="earlier process"):
            get(w.get.remote(old))
        assert np.array_equal(get(w.get.remote(new)), np.full(10, -1, np.float32))
    finally:
        ray.kill(w, no_restart=True)


def test_wait_until_ready_raises_at_once_for_a_worker_dead_for_good(cluster):
    w = start_worker("host", max_restarts=0)
    assert wait_until_ready(w, timeout=TIMEOUT) == 1
    ray.kill(w, no_restart=True)
    began = time.monotonic()
    with pytest.raises(ray.exceptions.ActorDiedError, match="dead for good") as caught:
        wait_until_ready(w, timeout=30, min_generation=2)
    assert time.monotonic() - began < 20 and w._actor_id.hex() in str(caught.value)


def test_a_damaged_checkpoint_stops_the_restarted_worker_and_reaches_the_driver(cluster, tmp_path):
    """The restart fails once (not once per restart Ray allows), and wait_until_ready raises the
    CheckpointError at once instead of timing out on a worker that will never answer."""
    path = tmp_path / "damaged.safetensors"
    w = start_worker("host", checkpoint=str(path), max_restarts=3)
    try:
        assert wait_until_ready(w, timeout=TIMEOUT) == 1
        get(w.put.remote("x", np.arange(1024, dtype=np.float32)))
        get(w.checkpoint.remote())
        damaged = bytearray(path.read_bytes())
        damaged[-1] ^= 0xFF  # a bit of the data: the file's checksum no longer matches
        path.write_bytes(bytes(damaged))
        ray.kill(w, no_restart=False)
        with pytest.raises(devbridge.CheckpointError, match="corrupt") as caught:
            wait_until_ready(w, timeout=TIMEOUT, min_generation=2)
        message = str(caught.value)
        assert str(path) in message and "generation 2" in message and "stays down" in message
        assert isinstance(caught.value.__cause__, ray.exceptions.ActorDiedError)
        with pytest.raises(ray.exceptions.ActorDiedError, match="CheckpointError"):
            get(w.ping.remote())  # dead for good: not restarted again
        assert path.read_bytes() == bytes(damaged)  # left as it was, for whoever looks into it
    finally:
        ray.kill(w, no_restart=True)
