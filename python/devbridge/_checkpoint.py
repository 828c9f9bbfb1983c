"""Checkpoint files: safetensors checkpoint/restore of a bridge's tensors.

Pure Python over the staging layer (``_staging``) and the portable tensors' device
reads (``_portable``: a tensor resolved to what it names, streamed out through the
ring). See docs/PORTABLE.md.

* ``checkpoint(bridge, path, {name: tensor})`` writes a safetensors file
  atomically, with the generation and a checksum of the data in its metadata;
  ``restore(bridge, path)`` -> ``{name: DeviceTensor}`` verifies it while it
  streams, and frees everything when the file is bad.
* ``checkpoint_info(path)``: the header, after the checks ``restore`` makes first.

This module is that API and nothing else; the code lives in one module per
concept: ``_checkpoint_file`` (the format's constants, headers, ``checkpoint_info``,
a sharded checkpoint's index), ``_checkpoint_write`` (``checkpoint``) and
``_restore`` (``restore``, ``PendingRestore``). A test or tool that patches one of
their globals (``_before_read``, ``_HEADER_LIMIT``, ``_CLEANUP_WAIT_S``...) patches
it in the module that reads it, not here.
"""

from __future__ import annotations

from ._checkpoint_file import checkpoint_info
from ._checkpoint_write import checkpoint
from ._portable import CheckpointError
from ._restore import PendingRestore, restore

__all__ = ["CheckpointError", "PendingRestore", "checkpoint", "checkpoint_info", "restore"]
