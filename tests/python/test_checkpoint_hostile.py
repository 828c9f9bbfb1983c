"""Hostile checkpoint files through checkpoint_info and restore, and the names checkpoint refuses to write.

The header is read by the C++ reader `devbridge checkpoint inspect` uses too
(include/devbridge/checkpoint_file.hpp); tests/python/test_cli_checkpoint.py
checks the two refuse the same files with the same words. Each case here was
accepted, raised the wrong exception or hung before it.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import stat
import threading

import numpy as np
import pytest

import devbridge


def _write(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def _one(**fields) -> bytes:
    entry = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    entry.update(fields)
    return json.dumps({"a": entry}).encode()


ONE = _one()

HOSTILE = {
    "dtype a list": (_one(dtype=["F32"]), "tensor 'a': dtype [\"F32\"] is not one devbridge holds"),
    "dtype an object": (_one(dtype={"F32": 1}), "tensor 'a': dtype {\"F32\": 1} is not one devbridge holds"),
    "metadata a list": (b'{"__metadata__":[],' + ONE[1:], "__metadata__ is not a map of strings to strings"),
    "metadata false": (b'{"__metadata__":false,' + ONE[1:], "__metadata__ is not a map of strings to strings"),
    "metadata empty str": (b'{"__metadata__":"",' + ONE[1:], "__metadata__ is not a map of strings to strings"),
    "metadata 0": (b'{"__metadata__":0,' + ONE[1:], "__metadata__ is not a map of strings to strings"),
    "rank 9": (_one(shape=[1] * 9), "shape (1, 1, 1, 1, 1, 1, 1, 1, 1) has 9 dimensions, more than devbridge's 8"),
    "NUL and garbage": (ONE + b"\0garbage", "not JSON (trailing characters"),
    "BOM": (b"\xef\xbb\xbf" + ONE, "byte order mark"),
    "lone surrogate name": (ONE.replace(b'"a"', b'"\\ud800"'), "surrogate"),
    "lone surrogate metadata": (b'{"__metadata__":{"k":"\\udc00"},' + ONE[1:], "surrogate"),
    "invalid UTF-8 name": (ONE.replace(b'"a"', b'"a\xff"'), "invalid UTF-8"),
    "duplicate name": (b'{"a":' + ONE[5:-1] + b',"a":' + ONE[5:], "tensor 'a' appears twice"),
    "duplicate metadata key": (b'{"__metadata__":{"k":"1","k":"2"},' + ONE[1:], "__metadata__ is not a map"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_header_is_a_checkpoint_error(tmp_path, case):
    header, words = HOSTILE[case]
    path = tmp_path / "bad.safetensors"
    _write(path, header, bytes(4))
    with pytest.raises(devbridge.CheckpointError) as caught:
        devbridge.checkpoint_info(path)
    assert words in str(caught.value) and repr(str(path)) in str(caught.value)
    with devbridge.Bridge(backend="host") as bridge, pytest.raises(devbridge.CheckpointError) as restored:
        bridge.restore(path)  # refused before anything is allocated, for the same reason
    assert str(restored.value) == str(caught.value)


def test_whitespace_padding_is_accepted_as_the_safetensors_package_accepts_it(tmp_path):
    path = tmp_path / "padded.safetensors"
    _write(path, b" \n" + ONE + b" \t\r\n  ", np.array([1.5], np.float32).tobytes())
    assert devbridge.checkpoint_info(path)["tensors"]["a"]["shape"] == (1,)
    with devbridge.Bridge(backend="host") as bridge:
        assert bridge.download(bridge.restore(path)["a"])[0] == 1.5


def _unblocking_writer(path):
    """A thread that opens the FIFO for writing and closes it at once: a reader that opened the FIFO blocking
    is let go (and reads nothing), so code that would block fails the test instead of hanging it."""
    def write():
        with open(path, "wb"):
            pass
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def _release(path, thread):
    # The writer waits in open() for a reader; a non-blocking read end lets it finish.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    thread.join()
    os.close(fd)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    thread = _unblocking_writer(fifo)
    try:
        with pytest.raises(devbridge.CheckpointError, match="is not a regular file"):
            devbridge.checkpoint_info(fifo)
        with devbridge.Bridge(backend="host") as bridge, pytest.raises(devbridge.CheckpointError,
                                                                       match="is not a regular file"):
            bridge.restore(fifo)
    finally:
        _release(fifo, thread)


def test_a_directory_is_refused_and_a_missing_file_is_still_oserror(tmp_path):
    with pytest.raises(devbridge.CheckpointError, match="is not a regular file"):
        devbridge.checkpoint_info(tmp_path)
    with pytest.raises(FileNotFoundError):
        devbridge.checkpoint_info(tmp_path / "missing.safetensors")


def test_restore_reads_the_file_whose_header_it_checked(tmp_path, monkeypatch):
    # The data is read through the descriptor the header was read from: no second open by path, which could
    # find another file renamed into its place.
    path = tmp_path / "x.safetensors"
    with devbridge.Bridge(backend="host") as bridge:
        x = bridge.upload(np.arange(6, dtype=np.float32), wait=True)
        bridge.checkpoint(path, {"x": x})

        def no_open(*args, **kwargs):
            raise AssertionError(f"restore opened {args[0]!r} by path a second time")
        monkeypatch.setattr(builtins, "open", no_open)
        monkeypatch.setattr(io, "open", no_open)
        monkeypatch.setattr(os, "open", no_open)
        restored = bridge.restore(path)
        monkeypatch.undo()
        assert bridge.download(restored["x"]).tobytes() == np.arange(6, dtype=np.float32).tobytes()


@pytest.mark.parametrize("where", ["name", "metadata key", "metadata value"])
def test_checkpoint_refuses_what_is_not_utf8_before_writing_anything(tmp_path, where):
    path = tmp_path / "x.safetensors"
    with devbridge.Bridge(backend="host") as bridge:
        x = bridge.upload(np.arange(4, dtype=np.float32), wait=True)
        name = "\ud800" if where == "name" else "x"
        metadata = {"metadata key": {"k\udfff": "v"}, "metadata value": {"k": "v\ud800"}}.get(where)
        with pytest.raises(ValueError, match="not valid UTF-8") as caught:
            bridge.checkpoint(path, {name: x}, metadata=metadata)
        assert not isinstance(caught.value, UnicodeError)
        assert ("tensor name" if where == "name" else "metadata") in str(caught.value)
        assert list(tmp_path.iterdir()) == []  # no file, no temporary left behind


def _names_in(directory) -> list[str]:
    """The names in ``directory`` once the files checkpoints replaced are gone (their second names,
    ``.<name>.*.old``, are unlinked on a thread of their own after checkpoint returns)."""
    from devbridge import _checkpoint_write

    if _checkpoint_write._UNLINKER is not None:
        _checkpoint_write._UNLINKER.submit(lambda: None).result()  # the unlinker's queue has run
    return sorted(p.name for p in directory.iterdir())


def test_checkpoint_refuses_a_header_no_reader_takes_and_keeps_the_old_file(tmp_path):
    # 100 MB of metadata: a header past the 100,000,000 bytes restore, checkpoint_info and the safetensors
    # package read. It was written, and the rename replaced the good file with one nobody could read.
    path = tmp_path / "x.safetensors"
    with devbridge.Bridge(backend="host") as bridge:
        x = bridge.upload(np.arange(4, dtype=np.float32), wait=True)
        bridge.checkpoint(path, {"x": x})
        before = path.read_bytes()
        with pytest.raises(ValueError, match=r"header .* would be 1000002\d\d bytes, past the 100000000 ") as caught:
            bridge.checkpoint(path, {"x": x}, metadata={"notes": "n" * 100_000_000})
        assert repr(str(path)) in str(caught.value) and "nothing was written" in str(caught.value)
        assert path.read_bytes() == before  # the old checkpoint, whole
        assert _names_in(tmp_path) == ["x.safetensors"]  # no temporary left
        assert bridge.download(bridge.restore(path)["x"]).tolist() == [0, 1, 2, 3]


def test_the_header_limit_counts_every_tensor_name_up_to_the_last_byte(tmp_path, monkeypatch):
    # The limit is the reader's own (one constant, the index's too): a header of exactly that many bytes is
    # written, one byte more is refused, however it grew (here, many long names).
    from devbridge import _checkpoint_write

    path = tmp_path / "x.safetensors"
    with devbridge.Bridge(backend="host") as bridge:
        tensors = {f"layers.{i}." + "w" * 200: bridge.upload(np.full(2, i, np.float32), wait=True) for i in range(40)}
        bridge.checkpoint(path, tensors)
        header_bytes = int.from_bytes(path.read_bytes()[:8], "little")
        monkeypatch.setattr(_checkpoint_write, "_HEADER_LIMIT", header_bytes)
        bridge.checkpoint(path, tensors)  # exactly at the limit
        before = path.read_bytes()
        monkeypatch.setattr(_checkpoint_write, "_HEADER_LIMIT", header_bytes - 1)
        with pytest.raises(ValueError, match=f"would be {header_bytes} bytes, past the {header_bytes - 1} "):
            bridge.checkpoint(path, tensors)
        assert path.read_bytes() == before
        assert _names_in(tmp_path) == ["x.safetensors"]


def test_checkpoint_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    # safetensors' save_file writes through a link, as open() does; the rename replaced the link itself with
    # a regular file, and the target kept the old checkpoint.
    elsewhere = tmp_path / "store"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    target = elsewhere / "real.safetensors"
    link = tmp_path / "run" / "latest.safetensors"
    with devbridge.Bridge(backend="host") as bridge:
        bridge.checkpoint(target, {"w": bridge.upload(np.zeros(4, np.float32), wait=True)})
        os.chmod(target, 0o640)
        link.symlink_to(os.path.relpath(target, link.parent))
        bridge.checkpoint(link, {"w": bridge.upload(np.ones(4, np.float32), wait=True)})
        assert link.is_symlink() and os.path.samefile(link, target)
        assert bridge.download(bridge.restore(target)["w"]).tolist() == [1, 1, 1, 1]
        assert stat.S_IMODE(os.stat(target).st_mode) == 0o640  # the target's permissions, kept
        # The temporary went beside the target, and nothing is left in either directory.
        assert _names_in(elsewhere) == ["real.safetensors"]
        assert _names_in(tmp_path / "run") == ["latest.safetensors"]
        # A checkpoint killed while it wrote through the link left its temporary beside the target too.
        from devbridge._checkpoint_write import _remove_interrupted_checkpoint_files
        stale = elsewhere / ".real.safetensors.k1ll3d.tmp"
        stale.write_bytes(b"partial")
        assert _remove_interrupted_checkpoint_files(link) == [os.path.realpath(stale)]


# --------------------------------------------------------------------------- a sharded checkpoint's index


def _shard_and_index(tmp_path, weight_map=None) -> str:
    """A one-shard checkpoint's shard (``a``: [1.5]) and its index."""
    _write(tmp_path / "model.safetensors", ONE, np.array([1.5], np.float32).tobytes())
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map or {"a": "model.safetensors"}}))
    return str(index)


def test_a_fifo_named_as_an_index_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.safetensors.index.json"
    os.mkfifo(fifo)
    thread = _unblocking_writer(fifo)
    try:
        with devbridge.Bridge(backend="host") as bridge, pytest.raises(devbridge.CheckpointError) as caught:
            bridge.restore(fifo)
        assert str(caught.value) == f"{str(fifo)!r} is not a regular file"  # the words a .safetensors FIFO gets
    finally:
        _release(fifo, thread)


def test_an_index_that_cannot_be_opened_is_oserror_and_a_directory_is_refused(tmp_path):
    with devbridge.Bridge(backend="host") as bridge:
        with pytest.raises(FileNotFoundError):
            bridge.restore(tmp_path / "missing.safetensors.index.json")
        (tmp_path / "dir.index.json").mkdir()
        with pytest.raises(devbridge.CheckpointError, match="is not a regular file"):
            bridge.restore(tmp_path / "dir.index.json")
        assert bridge.stats()["live_allocations"] == 0


def test_an_index_too_large_or_too_deep_is_a_checkpoint_error(tmp_path, monkeypatch):
    from devbridge import _checkpoint_file

    index = _shard_and_index(tmp_path)
    deep = tmp_path / "deep.index.json"
    deep.write_text('{"weight_map": {"a": "model.safetensors"}, "metadata": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with devbridge.Bridge(backend="host") as bridge:
        with pytest.raises(devbridge.CheckpointError, match="nests too deeply") as caught:
            bridge.restore(deep)  # was a RecursionError
        assert repr(str(deep)) in str(caught.value)
        restored = bridge.restore(index)["a"]
        assert bridge.download(restored)[0] == 1.5
        restored.free()
        monkeypatch.setattr(_checkpoint_file, "_HEADER_LIMIT", os.path.getsize(index) - 1)
        with pytest.raises(devbridge.CheckpointError, match="past the .* bytes an index may hold") as caught:
            bridge.restore(index)
        assert repr(index) in str(caught.value)
        assert bridge.stats()["live_allocations"] == 0


def test_a_path_with_a_nul_is_refused_as_open_refuses_it(tmp_path):
    index = _shard_and_index(tmp_path)
    bogus = str(tmp_path / "model.safetensors") + "\0.missing"  # the part before the NUL is a real file
    with pytest.raises(ValueError, match="embedded null byte"):
        devbridge.checkpoint_info(bogus)
    with devbridge.Bridge(backend="host") as bridge:
        with pytest.raises(ValueError, match="embedded null byte"):
            bridge.restore(bogus)
        with pytest.raises(ValueError, match="embedded null byte"):
            bridge.restore(index + "\0.missing")
        with pytest.raises(ValueError, match="embedded null byte"):
            bridge.checkpoint(bogus, {"a": bridge.upload(np.ones(1, np.float32), wait=True)})
        nul_map = _shard_and_index(tmp_path, {"a": "model.safetensors\0.missing"})
        with pytest.raises(devbridge.CheckpointError, match="embedded null byte") as caught:
            bridge.restore(nul_map)
        assert repr(nul_map) in str(caught.value) and "'a'" in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "model.safetensors.index.json"]


UTF16 = json.dumps({"weight_map": {"a": "model.safetensors"}}).encode("utf-16")

LAX_INDEXES = {  # each was read: the last of two mappings won, a NaN passed, UTF-16 was decoded by guess
    "a name mapped twice": (b'{"weight_map": {"a": "model.safetensors", "a": "other.safetensors"}}',
                            "it gives 'a' twice in one JSON object"),
    "a second weight_map": (b'{"weight_map": {"a": "other.safetensors"}, "weight_map": {"a": "model.safetensors"}}',
                            "it gives 'weight_map' twice in one JSON object"),
    "a metadata key twice": (b'{"metadata": {"k": 1, "k": 2}, "weight_map": {"a": "model.safetensors"}}',
                             "it gives 'k' twice"),
    "NaN": (b'{"metadata": {"total_size": NaN}, "weight_map": {"a": "model.safetensors"}}', "it holds NaN"),
    "Infinity": (b'{"metadata": {"total_size": Infinity}, "weight_map": {"a": "model.safetensors"}}',
                 "it holds Infinity"),
    "-Infinity": (b'{"metadata": {"x": [-Infinity]}, "weight_map": {"a": "model.safetensors"}}', "it holds -Infinity"),
    "a number past a double": (b'{"metadata": {"total_size": 1e400}, "weight_map": {"a": "model.safetensors"}}',
                               "the number 1e400, past what a double holds"),
    "UTF-16": (UTF16, "is not UTF-8 (byte 0 is 0xff)"),
    "UTF-16, no byte order mark": (UTF16[2:], "is not the JSON index of a sharded checkpoint"),
    "Latin-1": ('{"weight_map": {"\u00e9": "model.safetensors"}}'.encode("latin-1"), "is not UTF-8 (byte 17 is 0xe9)"),
    "a UTF-8 byte order mark": (b"\xef\xbb\xbf" + UTF16.decode("utf-16").encode(), "BOM"),
    "a lone surrogate": (b'{"weight_map": {"a": "model.safetensors", "\\ud800": "model.safetensors"}}',
                         "lone surrogate is not valid UTF-8"),
}


@pytest.mark.parametrize("case", list(LAX_INDEXES))
def test_an_index_is_read_as_strictly_as_a_header(tmp_path, case):
    _shard_and_index(tmp_path)
    text, words = LAX_INDEXES[case]
    index = tmp_path / "lax.index.json"
    index.write_bytes(text)
    with devbridge.Bridge(backend="host") as bridge:
        with pytest.raises(devbridge.CheckpointError) as caught:
            bridge.restore(index)
        assert words in str(caught.value) and str(caught.value).startswith(repr(str(index)))
        assert bridge.stats()["live_allocations"] == 0


def test_what_a_json_file_holds_decides_between_an_index_and_a_safetensors_file(tmp_path):
    # A safetensors file named *.json went to the index's reader (a codec error); *.JSON was not an index.
    index = _shard_and_index(tmp_path)
    with devbridge.Bridge(backend="host") as bridge:
        for name in ("weights.json", "WEIGHTS.JSON"):
            _write(tmp_path / name, ONE, np.array([2.5], np.float32).tobytes())
            assert bridge.download(bridge.restore(tmp_path / name)["a"])[0] == 2.5
        shouted = tmp_path / "MODEL.SAFETENSORS.INDEX.JSON"
        os.rename(index, shouted)
        assert bridge.download(bridge.restore(shouted)["a"])[0] == 1.5
        neither = tmp_path / "neither.json"
        neither.write_bytes(b"\x00\xff\xfe garbage, no header length within the limit")
        with pytest.raises(devbridge.CheckpointError,
                           match="is not the JSON index of a sharded checkpoint \\(nor a safetensors file\\)"):
            bridge.restore(neither)
        assert bridge.stats()["live_allocations"] == 0
