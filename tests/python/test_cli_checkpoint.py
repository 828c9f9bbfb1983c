"""`devbridge checkpoint inspect FILE [--json OUT]`: the CLI's reading of checkpoint files.

Files are written by devbridge.checkpoint and by the safetensors package, then
damaged in each way the command must catch. The binary under test is
DEVBRIDGE_CLI_UNDER_TEST when set (as for the C++ CLI suite), else the release
build's (build/release/tools/devbridge/devbridge, which `make test` builds
first); without either the tests are skipped.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import zlib

import numpy as np
import pytest
import safetensors.numpy

import devbridge
from test_checkpoint_hostile import HOSTILE, _write

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cli() -> pathlib.Path:
    given = os.environ.get("DEVBRIDGE_CLI_UNDER_TEST")
    path = pathlib.Path(given) if given else ROOT / "build" / "release" / "tools" / "devbridge" / "devbridge"
    if not path.is_file():
        if given:
            pytest.fail(f"DEVBRIDGE_CLI_UNDER_TEST={given} is not a file")
        pytest.skip(f"no devbridge CLI at {path} (build it, or set DEVBRIDGE_CLI_UNDER_TEST)")
    return path


def run(*args: str, check_one_line: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(_cli()), *args], capture_output=True, text=True, errors="replace", timeout=120)
    if check_one_line and done.returncode != 0:
        assert done.stderr.count("\n") == 1, f"stderr is not one line: {done.stderr!r}"
    return done


@pytest.fixture()
def written(tmp_path) -> tuple[pathlib.Path, dict[str, np.ndarray], dict[str, str]]:
    """A devbridge checkpoint of three tensors (one larger than the 1 MiB ring) and what went in."""
    rng = np.random.default_rng(7)
    arrays = {
        "layer.weight": rng.standard_normal((600, 512), dtype=np.float32),
        "embed": rng.integers(0, 1 << 15, (33, 7), dtype=np.int16),
        "step": np.array([12345], dtype=np.int64),
    }
    path = tmp_path / "model.safetensors"
    with devbridge.Bridge(backend="host", ring_bytes=1 << 20, generation=3) as bridge:
        tensors = {name: bridge.upload(a, wait=True) for name, a in arrays.items()}
        meta = bridge.checkpoint(path, tensors, metadata={"note": "epoch 4"})
        for t in tensors.values():
            t.free()
    return path, arrays, meta


def test_good_checkpoint_text(written):
    path, arrays, meta = written
    done = run("checkpoint", "inspect", str(path))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    out = done.stdout
    assert "devbridge checkpoint, format version 1, generation 3" in out
    assert "'layer.weight'  float32  [600, 512]" in out
    assert "'embed'" in out and "int16" in out and "[33, 7]" in out
    assert "'step'" in out and "int64" in out and "[1]" in out
    assert "'note'" in out and "'epoch 4'" in out
    assert f"checksum: {meta['checksum']} verified" in out


def test_good_checkpoint_json(written, tmp_path):
    path, arrays, meta = written
    report_path = tmp_path / "report.json"
    done = run("checkpoint", "inspect", str(path), "--json", str(report_path))
    assert done.returncode == 0, done.stderr
    assert "verified" in done.stdout  # the text still goes to stdout when the JSON goes to a file
    report = json.loads(report_path.read_text())
    to_stdout = run("checkpoint", "inspect", str(path), "--json", "-")
    assert to_stdout.returncode == 0
    assert json.loads(to_stdout.stdout) == report  # '-': only the JSON on stdout

    assert report["command"] == "checkpoint inspect"
    assert report["file"] == str(path)
    assert report["ok"] is True and report["error"] is None
    assert report["devbridge"] is True and report["format_version"] == "1" and report["generation"] == 3
    assert report["checksum"] == {"status": "verified", "recorded": meta["checksum"], "computed": meta["checksum"]}
    assert report["metadata"] == meta
    assert report["file_bytes"] == path.stat().st_size
    assert report["file_bytes"] == 8 + report["header_bytes"] + report["data_bytes"]
    tensors = {t["name"]: t for t in report["tensors"]}
    assert set(tensors) == set(arrays)
    for name, a in arrays.items():
        t = tensors[name]
        assert t["dtype"] == str(a.dtype) and t["shape"] == list(a.shape) and t["nbytes"] == a.nbytes
        assert t["data_offsets"][1] - t["data_offsets"][0] == a.nbytes
    # In file order, tiling the data section: what checkpoint_info reads too.
    begins = [t["data_offsets"] for t in report["tensors"]]
    assert begins == sorted(begins) and begins[0][0] == 0 and begins[-1][1] == report["data_bytes"]
    info = devbridge.checkpoint_info(path)
    assert {n: (i["dtype"], list(i["shape"])) for n, i in info["tensors"].items()} == \
        {t["name"]: (t["dtype"], t["shape"]) for t in report["tensors"]}


def test_a_sha256_checkpoint_is_verified_too(tmp_path):
    path = tmp_path / "strong.safetensors"
    with devbridge.Bridge(backend="host", ring_bytes=1 << 20) as bridge:
        x = bridge.upload(np.random.default_rng(1).standard_normal(400_000, dtype=np.float32), wait=True)
        meta = bridge.checkpoint(path, {"x": x}, checksum="sha256")
        x.free()
    assert meta["checksum"].startswith("sha256:")
    done = run("checkpoint", "inspect", str(path))
    assert done.returncode == 0 and f"checksum: {meta['checksum']} verified" in done.stdout
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x80
    path.write_bytes(raw)
    report = _refused(path, "is corrupt", "sha256:")
    assert report["checksum"]["status"] == "mismatch"


def test_plain_safetensors_file(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file({"a": np.arange(10, dtype=np.float64), "b": np.ones((2, 3), np.uint8)}, str(path))
    done = run("checkpoint", "inspect", str(path))
    assert done.returncode == 0, done.stderr
    assert "without devbridge metadata" in done.stdout
    assert "no checksum to verify" in done.stdout
    assert "'a'" in done.stdout and "float64" in done.stdout and "[10]" in done.stdout
    report = json.loads(run("checkpoint", "inspect", str(path), "--json", "-").stdout)
    assert report["ok"] is True and report["devbridge"] is False and report["generation"] is None
    assert report["checksum"] == {"status": "none", "recorded": None, "computed": None}
    assert [t["name"] for t in report["tensors"]] == ["a", "b"]


def _refused(path: pathlib.Path, *reason: str) -> dict:
    done = run("checkpoint", "inspect", str(path))
    assert done.returncode == 1, (done.stdout, done.stderr)
    line = done.stderr.strip()
    assert line.startswith("devbridge checkpoint inspect: ")
    assert repr(str(path)) in line, line  # names the file
    for words in reason:
        assert words in line, line
    report = run("checkpoint", "inspect", str(path), "--json", "-")
    assert report.returncode == 1
    document = json.loads(report.stdout)
    assert document["ok"] is False and document["error"] == line.removeprefix("devbridge checkpoint inspect: ")
    return document


def test_flipped_data_byte_is_a_checksum_mismatch(written):
    path, _, meta = written
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01
    path.write_bytes(raw)
    report = _refused(path, "is corrupt", "checksum", meta["checksum"])
    assert report["checksum"]["status"] == "mismatch"
    assert report["checksum"]["recorded"] == meta["checksum"] != report["checksum"]["computed"]
    assert len(report["tensors"]) == 3  # the header was fine: it is still listed
    text = run("checkpoint", "inspect", str(path))
    assert "MISMATCH" in text.stdout
    with devbridge.Bridge(backend="host") as bridge, pytest.raises(devbridge.CheckpointError, match="corrupt"):
        bridge.restore(path)  # restore agrees


def test_truncated_file(written):
    path, _, _ = written
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])
    _refused(path, "is truncated", "need", "holds")
    path.write_bytes(raw[:50])
    _refused(path, "is truncated", "header")
    path.write_bytes(raw[:5])
    _refused(path, "not a safetensors file", "5 bytes")
    path.write_bytes(b"")
    _refused(path, "0 bytes")


def test_trailing_bytes(written):
    path, _, _ = written
    path.write_bytes(path.read_bytes() + b"\0" * 3)
    _refused(path, "3 bytes follow the last tensor")


def test_huge_header_length(tmp_path):
    path = tmp_path / "huge.safetensors"
    for length in ((1 << 64) - 1, 1 << 40, 100_000_001):
        path.write_bytes(length.to_bytes(8, "little") + b"{}")
        _refused(path, "not a safetensors file", f"header length of {length} bytes")
    path.write_bytes((5000).to_bytes(8, "little") + b"{}")
    _refused(path, "truncated", "header is 5000 bytes, the file 10")


def test_a_sharded_checkpoints_index_is_said_to_be_one(tmp_path):
    # It read as a safetensors file with a header of 7017841271895827067 bytes, and said no more.
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    _refused(path, "not a safetensors file", "a sharded checkpoint's index", "weight_map")


def test_not_safetensors(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("these are not the tensors you are looking for\n" * 20)
    _refused(path)  # the first 8 bytes read as an absurd header length
    path.write_bytes((12).to_bytes(8, "little") + b"not json!!!!")
    _refused(path, "not a safetensors file", "not JSON")
    path.write_bytes((8).to_bytes(8, "little") + b"[1,2,3] ")
    _refused(path, "not a JSON object")
    deep = b"[" * 5000 + b"]" * 5000
    path.write_bytes(len(deep).to_bytes(8, "little") + deep)
    _refused(path, "not JSON")


def _with_header(path: pathlib.Path, header: dict, data: bytes) -> pathlib.Path:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


@pytest.mark.parametrize("entry, reason", [
    # (a dtype devbridge lacks, or an empty tensor (even [0, 2**63, 4]), is listed, not refused:
    # test_checkpoint_probe_fixes.py)
    ({"dtype": 5, "shape": [2], "data_offsets": [0, 16]}, "dtype 5 is not one devbridge holds"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 16]}, "is not a list of non-negative integers"),
    ({"dtype": "F32", "shape": [1.5], "data_offsets": [0, 16]}, "is not a list of non-negative integers"),
    ({"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}, "is not a list of non-negative integers"),
    ({"dtype": "F32", "shape": [2**32, 2**32, 4], "data_offsets": [0, 16]}, "more than 2^64 bytes"),
    ({"dtype": "F32", "shape": [2**63, 2], "data_offsets": [0, 16]}, "more than 2^64 bytes"),
    ({"dtype": "F32", "shape": [2**64], "data_offsets": [0, 16]}, "not a list of non-negative integers"),
    ({"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}, "is 20 bytes, its data_offsets span 16"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, "are not [begin, end] byte offsets"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0]}, "are not [begin, end] byte offsets"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [2**64 - 8, 2**64 + 8]}, "are not [begin, end] byte offsets"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [2**64 - 17, 2**64 - 1]}, "starts at data byte"),
    ({"dtype": "F32", "shape": [4]}, "data_offsets null are not"),
    ([1, 2], "its header entry is not an object"),
])
def test_hostile_header_entries(tmp_path, entry, reason):
    path = _with_header(tmp_path / "bad.safetensors", {"t": entry}, bytes(16))
    report = _refused(path, "tensor 't'", reason)
    assert "tensors" not in report  # refused before its data


def test_overlapping_and_gapped_offsets(tmp_path):
    path = _with_header(tmp_path / "overlap.safetensors", {
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]},
    }, bytes(12))
    _refused(path, "tensor 'b' starts at data byte 4, expected 8", "overlap")
    path = _with_header(tmp_path / "gap.safetensors", {
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [8], "data_offsets": [10, 18]},
    }, bytes(18))
    _refused(path, "starts at data byte 10, expected 8")


def test_bad_devbridge_metadata(tmp_path):
    tensor = {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}
    path = _with_header(tmp_path / "m.safetensors", {"__metadata__": {"format": "devbridge-checkpoint"}, "t": tensor},
                        bytes(4))
    _refused(path, "without a valid checksum")
    path = _with_header(tmp_path / "m.safetensors", {"__metadata__": {"n": 1}, "t": tensor}, bytes(4))
    _refused(path, "__metadata__ is not a map of strings to strings")
    path = _with_header(tmp_path / "m.safetensors", {"__metadata__": {"dtypes": "{\"t\": \"int8\"}"}, "t": tensor},
                        bytes(4))
    _refused(path, "the metadata records dtype 'int8', the header 'U8'")
    path = _with_header(tmp_path / "m.safetensors", {"__metadata__": {"dtypes": "nope"}, "t": tensor}, bytes(4))
    _refused(path, "dtypes entry is not a JSON map")


def test_control_characters_stay_on_one_line(tmp_path):
    path = _with_header(tmp_path / "names.safetensors",
                        {"a\nb": {"dtype": 5, "shape": [1], "data_offsets": [0, 1]}}, bytes(1))
    _refused(path, "tensor 'a\\nb'")


def test_missing_file_and_directory(tmp_path):
    _refused(tmp_path / "nope.safetensors", "cannot open it", "No such file")
    _refused(tmp_path, "is not a regular file")


@pytest.mark.parametrize("args, words", [
    (["checkpoint"], "subcommand"),
    (["checkpoint", "inspect"], "file"),
    (["checkpoint", "inspekt", "x"], "unknown command 'checkpoint inspekt'"),
    (["checkpoint", "inspect", "a", "b"], ""),
    (["checkpoint", "inspect", "--bogus", "a"], "bogus"),
    (["checkpoint", "inspect", "a", "--json"], "json"),
    (["checkpoint", "inspect", "a", "--json", ""], "--json: '' is not a path"),
    (["chekpoint"], "commands: stream, info, checkpoint"),
])
def test_usage_errors(args, words):
    done = run(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert words in done.stderr
    assert done.stdout == ""


def test_unwritable_json_is_a_usage_error(written, tmp_path):
    path, _, _ = written
    done = run("checkpoint", "inspect", str(path), "--json", str(tmp_path / "no" / "such" / "dir.json"))
    assert done.returncode == 2 and "--json: cannot write" in done.stderr


def test_help_lists_the_command():
    done = run("--help", check_one_line=False)
    assert done.returncode == 0 and "checkpoint" in done.stdout
    done = run("checkpoint", "inspect", "--help", check_one_line=False)
    assert done.returncode == 0 and "--json" in done.stdout


@pytest.mark.parametrize("case", list(HOSTILE))
def test_inspect_and_python_refuse_a_hostile_header_alike(tmp_path, case):
    # One reader (include/devbridge/checkpoint_file.hpp) for both: the same refusal, word for word. The CLI
    # accepted a BOM, trailing NUL and garbage, rank 9, lone surrogates and duplicate names before.
    header, words = HOSTILE[case]
    path = tmp_path / "bad.safetensors"
    _write(path, header, bytes(4))
    report = _refused(path, words)
    with pytest.raises(devbridge.CheckpointError) as caught:
        devbridge.checkpoint_info(path)
    assert report["error"] == str(caught.value)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    # Opened O_NONBLOCK and refused after fstat; a plain open() waited for a writer forever (run's timeout
    # turns a hang into a failure).
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    _refused(fifo, "is not a regular file")


def test_fifty_thousand_tensors_are_inspected_in_linear_time(tmp_path):
    # The old reader was quadratic here (24-160 s); this completes in well under a second.
    n = 50_000
    header = {f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(n)}
    path = tmp_path / "many.safetensors"
    _write(path, json.dumps(header).encode(), bytes(n))
    report = json.loads(run("checkpoint", "inspect", str(path), "--json", "-").stdout)
    assert report["ok"] is True and len(report["tensors"]) == n
    assert len(devbridge.checkpoint_info(path)["tensors"]) == n


def test_a_devbridge_checkpoint_without_a_format_version_is_reported_as_version_1(tmp_path):
    # PORTABLE.md: a file without the key is read as version 1; the report said an empty version.
    path = tmp_path / "no_version.safetensors"
    x = np.arange(4, dtype=np.float32)
    safetensors.numpy.save_file({"x": x}, str(path), metadata={
        "format": "devbridge-checkpoint", "generation": "2", "checksum": f"crc32:{zlib.crc32(x.tobytes()):08x}"})
    done = run("checkpoint", "inspect", str(path), "--json", "-")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["devbridge"] is True and report["format_version"] == "1"
    assert "format version 1," in run("checkpoint", "inspect", str(path)).stdout
