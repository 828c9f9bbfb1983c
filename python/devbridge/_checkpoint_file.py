"""The checkpoint file format and the reading of its headers: what ``checkpoint`` writes and ``restore`` reads.

Owns the format's constants (``FORMAT`` and its version, the checksums a
checkpoint may record and their digests, ``_HEADER_LIMIT``), the check of a
path argument, a safetensors file's header opened and checked against the file
(``_open_checkpoint``, through the C++ reader ``devbridge checkpoint inspect``
uses: ``_Header`` of ``_Entry``), ``checkpoint_info``, and a sharded
checkpoint's index: its strict JSON reading (``_read_index``), its shards
opened and checked against it (``_open_shard``, ``_shards_of``), and how an
index is told from a safetensors file named ``*.json``
(``_starts_as_safetensors``). It allocates and writes nothing; the writer is
``_checkpoint_write``, the restore ``_restore``. See docs/PORTABLE.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import stat
from typing import Any, BinaryIO, Callable, NamedTuple

from ._devbridge import _checkpoint_open
from ._portable import CheckpointError


FORMAT = "devbridge-checkpoint"
FORMAT_VERSION = "1"
# Checksums a checkpoint may record: algorithm -> hex digits. checkpoint writes crc32 by default (see
# docs/PORTABLE.md, "Checksums"); restore and `devbridge checkpoint inspect` verify both.
_CHECKSUM_DIGITS = {"sha256": 64, "crc32": 8}
# The most bytes a safetensors header may hold: the C++ reader's (kHeaderLimit, checkpoint_file.hpp) and the
# safetensors package's limit. checkpoint writes no header past it (no reader would take the file), and a
# sharded checkpoint's index is refused past it, as a header is.
_HEADER_LIMIT = 100_000_000


def _checked_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, not {type(path).__name__}")
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"path must name a str path, not {type(path).__name__}")
    if not path:
        raise ValueError("path is empty")
    if "\0" in path:  # as open() refuses it: the C library would open the name before the NUL
        raise ValueError(f"path {path!r}: embedded null byte")
    return path


try:  # ISA-L's CRC-32: the same checksum as zlib's, 5x faster here
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a dependency; where its wheel is missing, zlib's
    from zlib import crc32 as _crc32


class _Crc32:
    """CRC-32 (zlib's: the IEEE polynomial, as gzip and PNG) behind hashlib's interface."""

    name = "crc32"

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = _crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _new_digest(algorithm: str) -> Any:
    return hashlib.sha256() if algorithm == "sha256" else _Crc32()


def _os_error_in_context(error: OSError, context: str, outcome: str) -> OSError:
    """``error`` as the same kind of OSError (same errno, so the same subclass), its message in
    ``context``: "[Errno 28] <context>: No space left on device; <outcome>"."""
    if error.errno is None:
        return error
    return OSError(error.errno, f"{context}: {error.strerror or os.strerror(error.errno)}; {outcome}")


class _Entry(NamedTuple):
    name: str
    dtype: str  # devbridge's name; the file's own spelling for a dtype devbridge lacks
    shape: tuple[int, ...]
    begin: int
    end: int
    # Why restore cannot take it (an empty shape, a dtype devbridge lacks), naming the file and the tensor; the
    # header reader keeps such an entry so the file's other tensors stay restorable: refused only when chosen.
    unrestorable: str | None = None


class _Header(NamedTuple):
    metadata: dict[str, str]
    entries: list[_Entry]  # in file order

    @property
    def checksum(self) -> str | None:
        """The checksum a devbridge checkpoint records (``format`` is devbridge's, as the C++ reader decides,
        which checked it is well-formed), else None: a plain safetensors file's metadata is its writer's own,
        a ``checksum`` key in it too."""
        if self.metadata.get("format") != FORMAT:
            return None
        # The reader takes hex digits in either case; the digests this compares with are lowercase.
        return self.metadata["checksum"].lower()


def _open_checkpoint(path: str) -> tuple[BinaryIO, _Header]:
    """Opens ``path`` and checks its header against the file before anything is allocated: the C++
    reader ``devbridge checkpoint inspect`` uses (include/devbridge/checkpoint_file.hpp), so both refuse
    the same files with the same reasons. Returns the file the header was read through (unbuffered,
    positioned at the data section) and the header; ``CheckpointError`` names the file when refused."""
    fd, metadata, tensors, data_start = _checkpoint_open(os.fsencode(path), repr(path))
    try:
        file = io.FileIO(fd, "rb", closefd=True)
    except BaseException:
        os.close(fd)
        raise
    file.seek(data_start)
    return file, _Header(metadata, [_Entry(*t) for t in tensors])


def _info_of(entry: _Entry) -> dict[str, Any]:
    """``checkpoint_info``'s entry of a tensor: an unrestorable one says why."""
    info = {"dtype": entry.dtype, "shape": entry.shape, "nbytes": entry.end - entry.begin}
    if entry.unrestorable is not None:
        info["unrestorable"] = entry.unrestorable
    return info


def checkpoint_info(path: Any) -> dict[str, Any]:
    """A checkpoint's header without restoring it: ``{"metadata": {...}, "tensors": {name: {"dtype",
    "shape", "nbytes"}}}`` (devbridge dtype names), after the same checks ``restore`` makes first. A tensor
    ``restore`` cannot take (an empty one, a dtype devbridge lacks: its ``"dtype"`` is then the file's
    spelling) is listed with ``"unrestorable"``, why; the file's other tensors can still be restored.

    ``path`` is what ``restore`` takes: a safetensors file, or a sharded checkpoint's index (told apart as
    ``restore`` tells them). For an index, ``"tensors"`` is every tensor its ``weight_map`` names, each as
    the shard the index maps it to holds it (what ``restore(index)`` returns), ``"metadata"`` is empty (the
    index's own ``"metadata"``, such as ``total_size``, is no safetensors metadata, and ``restore`` reads
    none of it), and ``"shards"`` maps each shard file named in the index to its own ``__metadata__``."""
    path = _checked_path(path)
    if path.lower().endswith(".json") and not _starts_as_safetensors(path):  # restore's own dispatch
        return _sharded_info(path)
    file, header = _open_checkpoint(path)
    file.close()
    return {"metadata": dict(header.metadata),
            "tensors": {e.name: _info_of(e) for e in header.entries}}


def _open_shard(index_path: str, directory: str, shard: str, names: list[str], said: str) -> tuple[BinaryIO, _Header]:
    """One shard of a sharded checkpoint opened and its header checked against the index: each tensor of
    ``names`` (those the index maps to it) is in it; ``CheckpointError`` otherwise, ending with ``said``."""
    try:
        file, header = _open_checkpoint(os.path.join(directory, shard))
    except FileNotFoundError:
        raise CheckpointError(f"{index_path!r} maps {names[0]!r} to {shard!r}, which is not there{said}") from None
    except OSError as error:  # not a directory, no permission...: the same kind, in the index's words
        raise _os_error_in_context(error, f"{index_path!r} maps {names[0]!r} to {shard!r}, which cannot be opened",
                                   said.removeprefix("; ") or "nothing was read") from error
    except CheckpointError as error:  # a directory, not safetensors, corrupt: the reader's words, in the index's
        raise CheckpointError(f"{index_path!r} maps {names[0]!r} to {shard!r}, which is refused: {error}{said}") \
            from None
    absent = sorted(set(names) - {e.name for e in header.entries})
    if absent:
        file.close()
        raise CheckpointError(f"{index_path!r} maps {absent[0]!r} to {shard!r}, which holds no such tensor{said}")
    return file, header


def _shards_of(weight_map: dict[str, str], wants: Callable[[str], bool], directory: str) -> dict[str, list[str]]:
    """The tensors ``wants`` of each shard the index names, by shard: one shard however the index spells its
    file (``x`` and ``./x``, a link and the file it names, are one file, read once), under the first spelling
    the index uses."""
    spelling_of: dict[object, str] = {}  # by file: (device, inode), or the spelling of a file not there
    by_spelling: dict[str, str] = {}
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not wants(name):
            continue
        spelt = os.path.normpath(shard)
        if spelt not in by_spelling:
            try:
                st = os.stat(os.path.join(directory, spelt))
                file: object = (st.st_dev, st.st_ino)
            except (OSError, ValueError):  # not there, or unreadable: opening it says why
                file = spelt
            by_spelling[spelt] = spelling_of.setdefault(file, spelt)
        by_shard.setdefault(by_spelling[spelt], []).append(name)
    return by_shard


def _sharded_info(index_path: str) -> dict[str, Any]:
    """``checkpoint_info`` of a sharded checkpoint's index: the index read by ``restore``'s reader
    (``_read_index``), every shard's header opened and checked against it as ``_restore_sharded`` does
    before it allocates, with its words (less its "nothing was restored": nothing is)."""
    weight_map = _read_index(index_path)
    directory = os.path.dirname(os.path.abspath(index_path))
    by_shard = _shards_of(weight_map, lambda name: True, directory)
    tensors: dict[str, dict[str, Any]] = {}
    shards: dict[str, dict[str, str]] = {}
    for shard in sorted(by_shard):
        file, header = _open_shard(index_path, directory, shard, by_shard[shard], "")
        file.close()
        wanted = frozenset(by_shard[shard])
        tensors.update({e.name: _info_of(e) for e in header.entries if e.name in wanted})
        shards[shard] = dict(header.metadata)
    return {"metadata": {}, "tensors": tensors, "shards": shards}


def _starts_as_safetensors(path: str) -> bool:
    """Whether the regular file at ``path`` starts as a safetensors file does, with the 8-byte little-endian
    length of its header, within ``_HEADER_LIMIT``: its last four bytes are zero. An index is JSON text, which
    starts with whitespace or ``{`` and holds no NUL, so no index does. For a file named ``*.json``, which may
    be either. False where it cannot tell (a path that cannot be opened, a FIFO, a file of under 8 bytes): the
    index's reader then says why."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO: no wait
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        prefix = os.pread(fd, 8, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return len(prefix) == 8 and int.from_bytes(prefix, "little") <= _HEADER_LIMIT


class _IndexRefused(ValueError):
    """What the index's strict JSON reading refuses, in words that follow the index's name."""


def _object_of_unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object of the index, refused if it gives a key twice (a tensor mapped to two shards, a second
    ``weight_map``): which one counts would be a parser's guess (Python's takes the last), so neither does,
    as in a header."""
    unique = dict(pairs)
    if len(unique) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _IndexRefused(f"it gives {key!r} twice in one JSON object (which one counts would be a "
                                    f"parser's guess, so neither does)")
            seen.add(key)
    return unique


def _no_constant(name: str) -> Any:
    raise _IndexRefused(f"it holds {name}, which is not JSON (RFC 8259)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: infinity by another name
        raise _IndexRefused(f"it holds the number {text}, past what a double holds")
    return value


def _first_lone_surrogate(value: Any) -> str | None:
    """The first str in the parsed JSON ``value`` (keys too) that has no UTF-8, else None; without recursion,
    whatever the nesting the parser took."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return item
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return None


def _read_index(index_path: str) -> dict[str, str]:
    """A sharded checkpoint's ``weight_map`` (tensor name -> shard file beside the index), checked: JSON as
    strict as a header's (UTF-8, no key given twice in an object, no NaN or Infinity, no lone surrogate), an
    object whose ``weight_map`` maps str names to plain relative file names (no absolute path, no ``..``, no
    NUL). The index is opened as a checkpoint is: a path that cannot be opened is ``OSError``; a FIFO, a
    device or a directory, or a file past ``_HEADER_LIMIT`` bytes, a ``CheckpointError`` at once."""
    fd = os.open(index_path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))  # a FIFO: no wait
    try:
        if not stat.S_ISREG((st := os.fstat(fd)).st_mode):
            raise CheckpointError(f"{index_path!r} is not a regular file")
        os.set_blocking(fd, True)
        with open(fd, "rb", closefd=False) as f:  # its size, then what it holds (it may have grown since)
            if st.st_size > _HEADER_LIMIT or len(text := f.read(_HEADER_LIMIT + 1)) > _HEADER_LIMIT:
                raise CheckpointError(f"{index_path!r} is past the {_HEADER_LIMIT} bytes an index may hold "
                                      f"(as a safetensors header): not the index of a sharded checkpoint")
    finally:
        os.close(fd)
    neither = f"{index_path!r} is not the JSON index of a sharded checkpoint (nor a safetensors file)"
    try:  # strictly, as a header: json.loads(bytes) would take UTF-16 and UTF-32 too, guessing which
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{neither}: it is not UTF-8 (byte {e.start} is {text[e.start]:#04x})") from None
    try:
        index = json.loads(decoded, object_pairs_hook=_object_of_unique_keys, parse_constant=_no_constant,
                           parse_float=_finite_float)
    except _IndexRefused as e:
        raise CheckpointError(f"{index_path!r} is not read as the index of a sharded checkpoint: {e}") from None
    except ValueError as e:  # not JSON
        raise CheckpointError(f"{neither}: {e}") from None
    except RecursionError:
        raise CheckpointError(f"{index_path!r} is not a JSON index of a sharded checkpoint: its JSON nests "
                              f"too deeply to read") from None
    lone = _first_lone_surrogate(index)
    if lone is not None:  # a "\ud800" escape: a str with no UTF-8, refused anywhere in a header too
        raise CheckpointError(f"{index_path!r} is not read as the index of a sharded checkpoint: it holds the "
                              f"string {lone!r}, whose escape of a lone surrogate is not valid UTF-8")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path!r} has no weight_map (tensor name -> shard file): "
                              f"not the index of a sharded checkpoint")
    if not weight_map:
        raise CheckpointError(f"{index_path!r} has an empty weight_map (tensor name -> shard file): it maps no "
                              f"tensor to a shard, so there is nothing to restore")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index_path!r} maps {name!r} to {shard!r}, not a file name")
        if "\0" in shard:  # the C library would open the name before the NUL
            raise CheckpointError(f"{index_path!r} maps {name!r} to {shard!r}, not a file name: embedded null byte")
        if os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
            raise CheckpointError(f"{index_path!r} maps {name!r} to {shard!r}: shards must lie beside the index")
    return weight_map
