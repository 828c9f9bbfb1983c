"""Sharded and partial restores (issue #26, item 3), against files the ``safetensors`` package writes.

A sharded checkpoint as the ecosystem writes it (``model.safetensors.index.json`` with a ``weight_map``
beside its shards) restores bit-exact, its shards read in parallel; ``names=``/``prefix=`` choose tensors
and ``rows=`` a contiguous run of a tensor's rows, reading only those bytes; every refusal comes before
anything is allocated and names what is wrong, and a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

import devbridge
from conftest import auto_bridge, collect

RING = 1 << 20


@pytest.fixture(params=["fake", "host", "opencl", "cuda"])
def pb(request):
    yield from auto_bridge(request.param, ring_bytes=RING)


def model_arrays(rng) -> dict[str, np.ndarray]:
    """A small model: matrices larger than the ring, small vectors, a scalar, three dtypes."""
    return {
        "embed.weight": rng.standard_normal((700, 513)).astype(np.float32),  # ~1.4 MB: past the ring
        "layers.0.attn.weight": rng.standard_normal((64, 96)).astype(np.float16),
        "layers.0.attn.bias": rng.standard_normal(96).astype(np.float32),
        "layers.1.attn.weight": rng.standard_normal((64, 96)).astype(np.float16),
        "layers.1.mlp.weight": rng.integers(-9, 9, size=(33, 17)).astype(np.int64),
        "step": np.array(7, dtype=np.int64),
    }


def write_sharded(tmp_path, arrays: dict[str, np.ndarray], shards: int = 3) -> str:
    """Shards as ``transformers``' save_pretrained names them, and their index."""
    names = list(arrays)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        safetensors.numpy.save_file({n: arrays[n] for n in part}, str(tmp_path / shard))
        weight_map.update({n: shard for n in part})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": sum(a.nbytes for a in arrays.values())},
                                 "weight_map": weight_map}))
    return str(index)


def nothing_left(b: devbridge.Bridge) -> None:
    collect()
    s = b.stats()
    assert (s["live_allocations"], s["ring_reservations"], s["copies_in_flight"]) == (0, 0, 0)


def assert_restored(restored: dict, expected: dict[str, np.ndarray]) -> None:
    assert sorted(restored) == sorted(expected)
    for name, array in expected.items():
        back = restored[name].numpy()
        assert back.dtype == array.dtype and back.shape == array.shape, name
        assert back.tobytes() == array.tobytes(), name


def free(restored: dict) -> None:
    for tensor in restored.values():
        tensor.free()


def restored_then_freed(b: devbridge.Bridge, restored: dict, expected: dict[str, np.ndarray]) -> None:
    """``restored`` holds exactly ``expected``; freed, nothing of it is left on ``b``."""
    assert_restored(restored, expected)
    free(restored)
    nothing_left(b)


def test_a_sharded_checkpoint_restores_bit_exact(pb, rng, tmp_path):
    arrays = model_arrays(rng)
    restored_then_freed(pb, pb.restore(write_sharded(tmp_path, arrays)), arrays)


def test_names_and_prefix_restore_only_those_tensors(pb, rng, tmp_path):
    arrays = model_arrays(rng)
    single = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(arrays, str(single))
    index = write_sharded(tmp_path, arrays)
    for path in (str(single), index):
        restored = pb.restore(path, names=["step", "layers.1.mlp.weight"])
        assert_restored(restored, {n: arrays[n] for n in ("step", "layers.1.mlp.weight")})
        free(restored)
        restored = pb.restore(path, prefix="layers.0.")
        assert_restored(restored, {n: a for n, a in arrays.items() if n.startswith("layers.0.")})
        free(restored)
        restored = pb.restore(path, names=lambda n: n.endswith(".weight"), prefix="layers.")
        assert_restored(restored, {n: a for n, a in arrays.items() if n.startswith("layers.") and n.endswith(".weight")})
        free(restored)
        assert pb.restore(path, prefix="no.such.") == {}
    nothing_left(pb)


def test_rows_restore_a_slice_of_the_first_dimension(pb, rng, tmp_path):
    arrays = model_arrays(rng)
    single = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(arrays, str(single))
    index = write_sharded(tmp_path, arrays)
    cases = {"embed.weight": slice(123, 611), "layers.1.mlp.weight": slice(-5, None),
             "layers.0.attn.bias": slice(None, 1)}
    for path in (str(single), index):
        restored = pb.restore(path, names=list(cases), rows=cases)
        assert_restored(restored, {n: arrays[n][s] for n, s in cases.items()})
        free(restored)
        # rows alone: every tensor, those named cut to their rows
        restored = pb.restore(path, rows={"embed.weight": slice(0, 2)})
        assert_restored(restored, {n: (a[0:2] if n == "embed.weight" else a) for n, a in arrays.items()})
        free(restored)
    nothing_left(pb)


def test_a_partial_restore_of_a_checksummed_checkpoint_needs_verify_false(pb, rng, tmp_path):
    arrays = model_arrays(rng)
    path = str(tmp_path / "ours.safetensors")
    tensors = {n: pb.upload(a) for n, a in arrays.items()}
    pb.checkpoint(path, tensors)
    free(tensors)
    with pytest.raises(ValueError, match="verify=False"):
        pb.restore(path, prefix="layers.")
    nothing_left(pb)
    restored = pb.restore(path, prefix="layers.", rows={"layers.0.attn.weight": slice(1, 3)}, verify=False)
    expected = {n: a for n, a in arrays.items() if n.startswith("layers.")}
    expected["layers.0.attn.weight"] = arrays["layers.0.attn.weight"][1:3]
    assert_restored(restored, expected)
    free(restored)
    whole = pb.restore(path)  # verified, as before
    assert_restored(whole, arrays)
    free(whole)
    nothing_left(pb)


def test_rows_take_any_integer_bounds(pb, rng, tmp_path):
    arrays = model_arrays(rng)
    path = str(tmp_path / "model.safetensors")
    safetensors.numpy.save_file(arrays, path)
    rows = {"embed.weight": slice(np.int64(3), np.uint16(9)), "layers.1.mlp.weight": slice(np.int32(-4), None)}
    restored = pb.restore(path, names=list(rows), rows=rows)
    assert_restored(restored, {"embed.weight": arrays["embed.weight"][3:9],
                               "layers.1.mlp.weight": arrays["layers.1.mlp.weight"][-4:]})
    free(restored)
    nothing_left(pb)


def test_a_selection_of_everything_is_not_partial_and_is_verified(pb, rng, tmp_path):
    arrays = model_arrays(rng)
    path = tmp_path / "ours.safetensors"
    tensors = {n: pb.upload(a) for n, a in arrays.items()}
    pb.checkpoint(path, tensors)
    free(tensors)
    everything = [{"names": list(arrays)}, {"prefix": ""}, {"names": lambda n: True},
                  {"names": list(arrays), "rows": {"embed.weight": slice(None), "layers.0.attn.bias": slice(0, 96)}}]
    for kwargs in everything:  # verify=True is fine: every byte is read, and checked
        restored_then_freed(pb, pb.restore(path, **kwargs), arrays)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the last byte of the data section
    path.write_bytes(bytes(data))
    for kwargs in everything:
        with pytest.raises(devbridge.CheckpointError, match="is corrupt"):
            pb.restore(path, **kwargs)
        nothing_left(pb)


def test_a_plain_files_own_checksum_metadata_is_not_devbridges(pb, rng, tmp_path):
    """A file the package wrote with a ``checksum`` entry of its writer's own restores unverified, whole or
    in part, as any plain safetensors file (it was taken for devbridge's: "corrupt", or verify=False asked)."""
    arrays = model_arrays(rng)
    path = str(tmp_path / "plain.safetensors")
    for recorded in ("crc32:00000000", "sha256:" + "0" * 64, "md5:abc"):
        safetensors.numpy.save_file(arrays, path, metadata={"checksum": recorded})
        assert devbridge.checkpoint_info(path)["metadata"] == {"checksum": recorded}
        restored_then_freed(pb, pb.restore(path), arrays)
        restored_then_freed(pb, pb.restore(path, rows={"embed.weight": slice(0, 2)}),
                            {n: (a[0:2] if n == "embed.weight" else a) for n, a in arrays.items()})


@pytest.mark.parametrize("kwargs,error,match", [
    ({"names": "step"}, TypeError, "not one string"),
    ({"names": 5}, TypeError, "iterable of str"),
    ({"names": ["step", 3]}, TypeError, "only str"),
    ({"prefix": b"layers"}, TypeError, "prefix must be a str"),
    ({"rows": [("step", slice(0, 1))]}, TypeError, "rows must map"),
    ({"rows": {"embed.weight": 3}}, TypeError, "rows must map"),
    ({"rows": {"embed.weight": slice(0, 4, 2)}}, ValueError, "step 1"),
    ({"rows": {"embed.weight": slice(0, 4, 1.0)}}, TypeError, "step must be int or None"),
    ({"rows": {"embed.weight": slice(0, 4, True)}}, TypeError, "step must be int or None"),
    ({"rows": {"embed.weight": slice(0.5, 4)}}, TypeError, "int or None"),
    ({"rows": {"embed.weight": slice(np.float64(0), 4)}}, TypeError, "int or None"),
    ({"rows": {"embed.weight": slice(False, 4)}}, TypeError, "int or None"),
    ({"rows": {"embed.weight": slice(np.bool_(True), 4)}}, TypeError, "int or None"),
    ({"rows": {"embed.weight": slice(9, 4)}}, ValueError, "selects no row"),
    ({"rows": {"embed.weight": slice(700, None)}}, ValueError, "selects no row"),
    ({"rows": {"step": slice(0, 1)}}, ValueError, "scalar"),
    ({"names": ["step", "nope"]}, devbridge.CheckpointError, "'nope'"),
    ({"rows": {"nope": slice(0, 1)}}, devbridge.CheckpointError, "'nope'"),
    ({"prefix": "layers.", "rows": {"embed.weight": slice(0, 1)}}, ValueError, "leave out"),
])
def test_bad_selections_are_refused_before_anything_is_allocated(pb, rng, tmp_path, kwargs, error, match):
    arrays = model_arrays(rng)
    single = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(arrays, str(single))
    index = write_sharded(tmp_path, arrays)
    for path in (str(single), index):
        with pytest.raises(error, match=match):
            pb.restore(path, **kwargs)
        nothing_left(pb)


def test_a_file_and_an_index_refuse_a_selection_in_the_same_words(pb, rng, tmp_path):
    """One selection rule (the library's) for a file and for a sharded index's weight_map: the same refusal,
    naming the first five missing names in order, and a names= callable asked once per name."""
    arrays = model_arrays(rng)
    single = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(arrays, str(single))
    index = write_sharded(tmp_path, arrays)
    missing = [f"gone.{i}" for i in range(7)]
    said = []
    for path in (str(single), index):
        with pytest.raises(devbridge.CheckpointError) as refused:
            pb.restore(path, names=["step", *missing], rows={"absent": slice(0, 1)})
        said.append(str(refused.value).replace(repr(path), "PATH"))
        nothing_left(pb)
    assert said[0] == said[1]
    assert "holds no tensor named 'absent', 'gone.0', 'gone.1', 'gone.2', 'gone.3' and more" in said[0]
    for path in (str(single), index):
        asked = []
        restored = pb.restore(path, names=lambda name: asked.append(name) or name.startswith("layers."))
        assert sorted(asked) == sorted(arrays) and sorted(restored) == sorted(n for n in arrays if n.startswith("layers."))
        free(restored)


def bad_indexes(directory, good: dict) -> list[tuple[str, Any]]:
    """Indexes restore refuses (each by its reason), made from a good one's weight_map and written into
    ``directory``: (the reason, the index's path)."""
    weight_map = good["weight_map"]
    cases = {
        "not json": b"{weight_map",
        "no weight_map": json.dumps({"metadata": {}}).encode(),
        "a list": json.dumps([1, 2]).encode(),
        "a key twice": b'{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}',
        "a shard outside": json.dumps({"weight_map": {**weight_map, "step": "../elsewhere.safetensors"}}).encode(),
        "an absolute shard": json.dumps({"weight_map": {**weight_map, "step": "/etc/passwd"}}).encode(),
        "a missing shard": json.dumps({"weight_map": {**weight_map, "step": "gone.safetensors"}}).encode(),
        "a shard without the tensor": json.dumps(
            {"weight_map": {**weight_map, "step": weight_map["embed.weight"]}}).encode(),
    }
    if weight_map["step"] == weight_map["embed.weight"]:
        del cases["a shard without the tensor"]
    written = []
    for what, text in cases.items():
        bad = directory / f"bad-{len(text)}.index.json"
        bad.write_bytes(text)
        written.append((what, bad))
    return written


def test_a_bad_index_or_shard_is_named_and_restores_nothing(pb, rng, tmp_path):
    arrays = model_arrays(rng)
    index = write_sharded(tmp_path, arrays)
    good = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for what, bad in bad_indexes(tmp_path, good):
        with pytest.raises(devbridge.CheckpointError) as refused:
            pb.restore(str(bad))
        assert "bad-" in str(refused.value), what
        nothing_left(pb)
    # A shard that fails while others restore: everything restored is freed.
    (tmp_path / good["weight_map"]["embed.weight"]).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(devbridge.CheckpointError):
        pb.restore(index)
    nothing_left(pb)


@pytest.mark.parametrize("other_spelling", ["./whole.safetensors", "link.safetensors", "hard.safetensors"])
def test_an_index_naming_a_shard_two_ways_reads_it_as_one_file(pb, rng, tmp_path, other_spelling):
    # "x" and "./x" (or a link to x) are one file: it was opened twice, each time for part of its tensors, and
    # a devbridge shard's checksum then refused the restore as mapping only some of its tensors.
    arrays = model_arrays(rng)
    tensors = {name: pb.upload(a, wait=True) for name, a in arrays.items()}
    pb.checkpoint(tmp_path / "whole.safetensors", tensors)
    free(tensors)
    os.symlink("whole.safetensors", tmp_path / "link.safetensors")
    os.link(tmp_path / "whole.safetensors", tmp_path / "hard.safetensors")
    names = sorted(arrays)
    weight_map = {name: (other_spelling if i % 2 else "whole.safetensors") for i, name in enumerate(names)}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert list(devbridge.checkpoint_info(str(index))["shards"]) == ["whole.safetensors"]
    restored_then_freed(pb, pb.restore(str(index)), arrays)


def test_an_index_mapping_part_of_a_checksummed_shard_says_so(pb, rng, tmp_path):
    # Not a partial restore the caller asked for: the index leaves tensors of the shard out, so the shard's
    # checksum (of all of them) cannot be verified; the error says that, and verify=False restores them.
    arrays = model_arrays(rng)
    tensors = {name: pb.upload(a, wait=True) for name, a in arrays.items()}
    pb.checkpoint(tmp_path / "whole.safetensors", tensors)
    free(tensors)
    kept = {name: arrays[name] for name in ("step", "layers.0.attn.bias")}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {name: "whole.safetensors" for name in kept}}))
    with pytest.raises(devbridge.CheckpointError, match=r"maps 2 of the 6 tensors of 'whole.safetensors'.*verify=False"):
        pb.restore(str(index))
    nothing_left(pb)
    assert set(devbridge.checkpoint_info(str(index))["tensors"]) == set(kept)
    restored_then_freed(pb, pb.restore(str(index), verify=False), kept)


def test_a_shard_the_system_will_not_open_is_named_with_its_index(pb, rng, tmp_path):
    arrays = model_arrays(rng)
    write_sharded(tmp_path, arrays)
    good = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index = tmp_path / "odd.index.json"
    index.write_text(json.dumps({"weight_map": {**good["weight_map"], "step": good["weight_map"]["step"] + "/x"}}))
    for call in (lambda: pb.restore(str(index)), lambda: devbridge.checkpoint_info(str(index))):
        with pytest.raises(NotADirectoryError) as refused:
            call()
        assert "odd.index.json" in str(refused.value) and "'step'" in str(refused.value)
    nothing_left(pb)


def test_restore_takes_numpy_bools_for_its_flags(pb, rng, tmp_path):
    arrays = model_arrays(rng)
    index = write_sharded(tmp_path, arrays)
    pending = pb.restore(index, wait=np.False_, verify=np.True_)
    restored_then_freed(pb, pending.tensors(), arrays)
    with pytest.raises(TypeError, match="wait must be a bool, not builtins.int"):
        pb.restore(index, wait=1)


# ------------------------------------------------------------------------ checkpoint_info of an index


@pytest.fixture
def hb():
    yield from auto_bridge("host", ring_bytes=RING)


def test_checkpoint_info_of_an_index_is_the_union_of_what_restore_restores(hb, rng, tmp_path):
    # Before, checkpoint_info read the index as a safetensors file: "header length of 7017841271895827067
    # bytes", though restore takes it.
    arrays = model_arrays(rng)
    index = write_sharded(tmp_path, arrays)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    # A shard's own metadata, and a tensor a shard holds that the index does not map (restore leaves it out).
    first = sorted(set(weight_map.values()))[0]
    mine = {n: arrays[n] for n, s in weight_map.items() if s == first}
    safetensors.numpy.save_file({**mine, "unmapped": np.zeros(3, np.float32)}, str(tmp_path / first),
                                metadata={"written_by": "test"})
    restored = hb.restore(index)
    for path in (index, tmp_path / "model.safetensors.index.json"):  # a str or a PathLike, as restore
        info = devbridge.checkpoint_info(path)
        assert list(info["tensors"]) == list(restored), "the same tensors, in the order restore returns them"
        assert "unmapped" not in info["tensors"]
        for name, array in arrays.items():
            dtype = devbridge._intake._dtype_name(array.dtype)
            assert info["tensors"][name] == {"dtype": dtype, "shape": array.shape, "nbytes": array.nbytes}, name
            assert (restored[name].dtype, restored[name].shape) == (dtype, array.shape)
        assert info["metadata"] == {}  # the index's "metadata" (total_size) is no safetensors metadata
        assert info["shards"] == {s: devbridge.checkpoint_info(tmp_path / s)["metadata"]
                                  for s in set(weight_map.values())}
        assert info["shards"][first] == {"written_by": "test"}
    free(restored)
    # Dispatched as restore dispatches: a .JSON name in any case is an index, a safetensors file named .json
    # is a file.
    upper = tmp_path / "MODEL.SAFETENSORS.INDEX.JSON"
    upper.write_bytes((tmp_path / "model.safetensors.index.json").read_bytes())
    assert devbridge.checkpoint_info(upper)["tensors"] == info["tensors"]
    plain = tmp_path / "weights.json"
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, str(plain))
    assert devbridge.checkpoint_info(plain) == {"metadata": {}, "tensors": {"w": {"dtype": "float32", "shape": (2,),
                                                                                   "nbytes": 8}}}
    assert list(hb.restore(str(plain))) == ["w"]
    nothing_left(hb)


def test_checkpoint_info_refuses_a_bad_index_as_restore_does(hb, rng, tmp_path):
    arrays = model_arrays(rng)
    write_sharded(tmp_path, arrays)
    good = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for what, bad in bad_indexes(tmp_path, good):
        with pytest.raises(devbridge.CheckpointError) as by_restore:
            hb.restore(str(bad))
        with pytest.raises(devbridge.CheckpointError) as by_info:
            devbridge.checkpoint_info(bad)
        # The same reader, the same words (restore adds that it restored nothing).
        assert str(by_info.value) == str(by_restore.value).replace("; nothing was restored", ""), what
        assert "bad-" in str(by_info.value) and "header length" not in str(by_info.value), what
    (tmp_path / good["weight_map"]["embed.weight"]).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(devbridge.CheckpointError, match=good["weight_map"]["embed.weight"]):
        devbridge.checkpoint_info(tmp_path / "model.safetensors.index.json")
    nothing_left(hb)
