"""Prefetcher: feeds batches to a consumer from device memory, uploading the next ones meanwhile.

    for x, y in devbridge.Prefetcher(bridge, batches, depth=2, to="tinygrad"):
        loss = step(x, y)            # x, y: zero-copy tinygrad Tensors over device memory

See the "Prefetcher" section of docs/PYTHON.md. Pure Python over the staging
layer (``_staging``): each batch is staged through the ring in chunks
(``_stage_into``), its ranges go back once their copies complete (the bridge
releases them itself: ``release_host_after``), and only the batch handed out is waited for.

Design, in short:

* ``depth + 1`` device slots, each a set of allocations for one batch (one per
  array of the batch: ``_allocation_plan``), made on first use and reused.
* ``__next__`` first issues uploads into every slot the consumer is done with
  (synchronously: the copies themselves are asynchronous), then waits for the
  batch it returns. No thread: nothing runs while the consumer computes except
  the copies already submitted.
* A slot the consumer has had is reusable once everything handed out from it
  is gone: weak references to the objects yielded (the tinygrad ``Buffer``
  holding each tensor's lease, or the ``DeviceTensor``), and then the bridge
  itself, which refuses an upload into an allocation a live view still reads
  (``writes_under_view="refuse"``, the default), for views the weak references
  cannot see (a DLPack array, a ``TensorView`` taken from a ``DeviceTensor``).
* A slot still held once batches after it were handed out is kept for good by something other than the
  loop's variables (TinyJit keeps the batch of its capture call; a list keeps DeviceTensors, or DLPack
  arrays of them, which only the bridge's refusal shows): when no slot is free it is *retired*, its memory
  left to its holder (freed when that lets go), and a fresh slot takes the next batch; at most
  ``depth + 1`` retired slots are held at once.
* The bridge closing ends the iteration with ``Closed`` at once, a wait for a slot included. The bridge
  restarting retires every slot (they are the old generation's): the batches pulled from the source and
  not handed out yet are staged again, from the arrays the Prefetcher still holds, into fresh slots of the
  new generation (``_follow_bridge``), so the loop goes on with no batch lost or repeated.
"""

from __future__ import annotations

import collections
import gc
import numbers
import operator
import time
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ._devbridge import Bridge, DeviceHandle, ObjectSpec, _alloc_into, _without_waiting_for_a_restart
from ._errors import AllocationStillInUse, BridgeError, Broken, Closed
from ._intake import _dtype_name, _intake
from ._staging import (DeviceTensor, _checked_timeout, _cleanup, _free_or_release, _NotCopyable, _stage_into,
                       spec_for_array)

_TARGETS = ("tinygrad", "device")
# Backoff while the consumer (another thread, or garbage awaiting collection) still holds every slot.
_SLOT_POLL_MIN_S, _SLOT_POLL_MAX_S = 0.001, 0.05
# What a consumer keeps for good (TinyJit's capture call keeps its input batch) may pin this many slots per
# depth + 1 at once: each is left to its holder and replaced by a fresh one, so memory stays bounded.
_RETIRED_PER_SLOT = 1


# ------------------------------------------------------------------------------------------ batches


class _Batch:
    """One batch from the source, flattened: its arrays, what to call each in a message, and how to
    rebuild the caller's structure (an array, a tuple, a list or a dict) around what is handed out."""

    __slots__ = ("index", "arrays", "labels", "rebuild")

    def __init__(self, index: int, batch: Any) -> None:
        self.index = index
        if isinstance(batch, dict):
            keys = list(batch)
            items = [batch[k] for k in keys]
            self.labels = [f"key {k!r}" for k in keys]
            self.rebuild: Callable[[list[Any]], Any] = lambda out: dict(zip(keys, out))
        elif isinstance(batch, (tuple, list)):
            items = list(batch)
            kind = type(batch)
            self.labels = [f"item {i}" for i in range(len(items))]
            if kind is tuple or kind is list:
                self.rebuild = kind
            elif hasattr(kind, "_make"):  # a namedtuple
                self.rebuild = kind._make
            else:
                self.rebuild = lambda out, kind=kind: kind(out)
        else:
            items = [batch]
            self.labels = [""]
            self.rebuild = lambda out: out[0]
        if not items:
            raise ValueError(f"an empty {type(batch).__name__}: there is nothing to upload")
        self.arrays: list[np.ndarray] = []
        for position, item in enumerate(items):
            try:
                self.arrays.append(_intake(item, "upload"))
            except (TypeError, ValueError) as error:
                raise _batch_error(error, index, self.where(position)) from error

    def where(self, position: int) -> str:
        """' (item 1)', ' (key 'x')', or '' for a batch that is one array."""
        return f" ({self.labels[position]})" if self.labels[position] else ""


def _allocation_plan(batch: _Batch, alignment: int) -> list[tuple[ObjectSpec, int]]:
    """How a batch lies on the device: one allocation (spec, extent) per array.

    The one place that decides it; with untyped allocations (``ObjectSpec(..., "bytes")``) it can pack a
    batch's arrays into one allocation instead (``_Slot.fits`` and the hand-out then follow the plan)."""
    return [spec_for_array(a.shape, _dtype_name(a.dtype), alignment) for a in batch.arrays]


# -------------------------------------------------------------------------------------------- slots


class _BatchTensor(DeviceTensor):
    """A ``DeviceTensor`` over a Prefetcher slot (what ``to="device"`` hands out).

    The allocation stays the Prefetcher's, which uploads a later batch into it once this tensor and
    every view, DLPack array and tinygrad tensor from it are gone; ``free()`` (or the end of a ``with``
    block) only says the consumer is done with it. After the Prefetcher closes, a tensor still alive
    owns its allocation: it is freed when the tensor is (or at ``free()``)."""

    _finalizer: weakref.finalize | None = None

    def _release(self) -> None:  # what free() and the collector do with it
        self._freed = True
        if self._finalizer is not None:
            self._finalizer()


class _Slot:
    """One batch's worth of device allocations, and what the consumer still holds of them."""

    __slots__ = ("handles", "plan", "batch_index", "tensors", "holders", "hidden_holder")

    def __init__(self) -> None:
        self.handles: list[DeviceHandle] = []
        self.plan: list[tuple[ObjectSpec, int]] = []
        self.batch_index: int | None = None  # the batch it holds (or last held)
        self.tensors: list[_BatchTensor] = []  # that batch's arrays on the device, with their upload events
        self.holders: list[weakref.ref] = []  # what the consumer was handed; empty before hand-out
        self.hidden_holder: str | None = None  # the bridge's reason, when it refused the last upload into it

    def fits(self, plan: list[tuple[ObjectSpec, int]]) -> bool:
        """True when the slot's allocations can take a batch of this plan (same dtypes, room enough)."""
        return len(plan) == len(self.plan) == len(self.handles) and all(
            new.dtype == old.dtype and new.alignment == old.alignment and extent <= old_extent
            for (new, extent), (old, old_extent) in zip(plan, self.plan))

    def _live_holders(self) -> list[Any]:
        """What the consumer still holds of the slot (a DeviceTensor it has freed holds nothing)."""
        live = (ref() for ref in self.holders)
        return [h for h in live if h is not None and not (isinstance(h, _BatchTensor) and h.freed)]

    def held(self) -> bool:
        """True while something handed out from the slot is still alive."""
        return bool(self._live_holders())

    def release(self, bridge: Bridge, *, keep_hidden: bool = False) -> list[DeviceHandle]:
        """Frees the allocations (deferred by the bridge while views, DLPack arrays or tinygrad tensors
        still read them; owned by a handed-out ``DeviceTensor`` still alive, freed with it).

        ``keep_hidden`` (retiring the slot): an allocation that nothing the slot handed out holds, but that
        the bridge will not free because a view reads it (a DLPack array, a ``TensorView``), is left
        allocated and returned, for ``_Retired`` to tell when that view is gone."""
        hidden: list[DeviceHandle] = []
        for position, handle in enumerate(self.handles):
            # What was handed out for this allocation (holders follow the handles' order), if still held.
            holder = self.holders[position]() if position < len(self.holders) else None
            if isinstance(holder, _BatchTensor) and holder.freed:
                holder = None
            if isinstance(holder, _BatchTensor) and holder.handle == handle:
                holder._finalizer = weakref.finalize(holder, _free_or_release, bridge, handle)
                holder._finalizer.atexit = False  # at exit the bridge goes with the process
            elif keep_hidden and holder is None:
                try:
                    bridge.free(handle)
                except AllocationStillInUse:
                    hidden.append(handle)  # a view the weak references cannot see reads it
                except BridgeError:
                    pass  # closed, or a restart retired it
            else:
                _free_or_release(bridge, handle)
        self.handles, self.plan, self.tensors, self.holders, self.hidden_holder = [], [], [], [], None
        return hidden


class _Retired:
    """A slot retired while something still holds it: what was handed out from it (weak references, as
    ``_Slot.holders``) and the allocations only a view holds (freed here once the bridge lets them go)."""

    __slots__ = ("index", "holders", "hidden")

    def __init__(self, index: int, holders: list[weakref.ref], hidden: list[DeviceHandle]) -> None:
        self.index, self.holders, self.hidden = index, holders, hidden

    def alive(self, bridge: Bridge) -> bool:
        """True while its holder lives. An allocation a hidden view holds is tried: the bridge frees it
        once no view reads it (and refuses, ``AllocationStillInUse``, while one does)."""
        still: list[DeviceHandle] = []
        for handle in self.hidden:
            try:
                bridge.free(handle)
            except AllocationStillInUse:
                still.append(handle)
            except BridgeError:
                pass  # closed, or a restart retired it: not the Prefetcher's any more
        self.hidden = still
        if still:
            return True
        live = (ref() for ref in self.holders)
        return any(h is not None and not (isinstance(h, _BatchTensor) and h.freed) for h in live)

    def release(self, bridge: Bridge) -> None:
        """Leaves the hidden allocations to the bridge: freed when their last view goes."""
        for handle in self.hidden:
            _free_or_release(bridge, handle)
        self.hidden = []


class _Loaded:
    """A batch issued into a slot (or the error that stopped it), waiting to be handed out. An error
    staging a batch keeps the batch (a restart stages it again: ``Prefetcher._restarted``); a batch a
    restart took the slot of waits, slotless, in ``Prefetcher._restage``."""

    __slots__ = ("batch", "slot", "error")

    def __init__(self, batch: _Batch | None, slot: _Slot | None, error: BaseException | None = None) -> None:
        self.batch, self.slot, self.error = batch, slot, error


# ------------------------------------------------------------------------------------------- errors


def _batch_error(error: BaseException, index: int, where: str = "") -> BaseException:
    """``error`` again, its message naming the batch (and the array), chained to it; ``.batch_index``.

    Bridge errors keep their class (``except devbridge.DeviceCopyFailed`` still works) and ``.fatal``;
    another exception keeps its class when it can be built from a message, else becomes a RuntimeError."""
    prefix = f"Prefetcher batch {index}{where}: "
    if isinstance(error, BridgeError):
        new: BaseException = type(error)(prefix + error.message)
        new.fatal = getattr(error, "fatal", False)
    else:
        try:
            new = type(error)(prefix + str(error))
        except Exception:  # noqa: BLE001 - a constructor that takes more than a message
            new = RuntimeError(f"{prefix}{type(error).__name__}: {error}")
    new.batch_index = index
    new.__cause__ = error
    return new


def _wrapped(error: BaseException) -> bool:
    """Errors that get the batch's name; KeyboardInterrupt, SystemExit and the like pass as they are."""
    return isinstance(error, Exception)


# ------------------------------------------------------------------------------------ argument checks


def _checked_depth(depth: Any) -> int:
    if isinstance(depth, bool) or not isinstance(depth, numbers.Integral):
        raise TypeError(f"depth must be an int, not {type(depth).__name__}")
    depth = operator.index(depth)
    if depth < 1:
        raise ValueError(f"depth must be at least 1, not {depth}")
    return depth


# ----------------------------------------------------------------------------------------- Prefetcher


class Prefetcher(_NotCopyable):
    """Iterates ``batches`` as device tensors, uploading the next ``depth`` batches while the consumer works.

    ``Prefetcher(bridge, batches, depth=2, to="tinygrad", *, timeout=10.0, alignment=256)``

    * ``batches``: any iterable of batches; a batch is an array (numpy, or any C-contiguous
      buffer-protocol object), or a tuple, list or dict of them (a namedtuple stays one).
    * Each step hands out the same structure with every array on the device: ``to="tinygrad"`` zero-copy
      tinygrad Tensors (``DeviceTensor.to_tinygrad``), ``to="device"`` ``DeviceTensor``s.
    * Device memory is bounded: ``depth + 1`` slots of one batch each (the batches uploading, and the one
      the consumer holds), made on first use and reused. A slot is reused only once the consumer is done
      with it: every tensor handed out from it (and every tensor computed from one, lazily or not, every
      view and DLPack array) is gone. A slot the consumer keeps past the batch after it (TinyJit keeps its
      capture call's batch for as long as the jitted function lives) is retired when no slot is free: its
      memory is left to its holder and a fresh slot replaces it, at most ``depth + 1`` retired slots held
      at once (a ``RuntimeWarning`` says so, once). When every slot is still held after that, the next step
      waits up to ``timeout`` seconds (``None``: without bound), then raises ``AllocationStillInUse``
      naming the batch and what holds the slots. The source is asked for that batch before the wait (and
      the batch kept for the next attempt), so at its end ``next()`` raises ``StopIteration`` at once.
    * A failure on the producer side (the source raising, an array that cannot be staged, a copy that
      fails) is raised at the batch where it happened, once the batches before it have been handed out:
      the same class (``DeviceCopyFailed``, ``ValueError``...) with ``Prefetcher batch <i>...`` in its
      message, ``.batch_index``, chained (``__cause__``) to the original; then everything is released.
      A fatal one (``.fatal``: the bridge is ``Broken``, so no batch before it can be read either) is raised
      as itself at the first ``next()`` that would hand out an earlier batch, not as that batch's ``Broken``.
    * A batch whose upload has not completed ``timeout`` seconds into the wait for it (a hung device) raises
      ``TimeoutError`` naming it (``.batch_index``); the Prefetcher closes without waiting for the copies in
      flight, as after an interrupt (Ctrl-C): the bridge frees the slots once those copies end.
    * ``close()`` (also the end of a ``with`` block, exhaustion, a producer error, and garbage collection
      after ``break``) waits for the copies in flight, frees every slot (deferred while the consumer still
      holds one) and closes the source iterator when it has ``close()``.
    * ``bridge.close()`` ends the iteration: ``next()`` raises ``Closed`` (naming the batch) at once, a
      wait for a slot in another thread included, and the Prefetcher closes. ``bridge.restart()`` does not:
      the batches pulled from the source but not handed out yet are staged again into fresh slots of the
      new generation, so the loop goes on with every batch, in order (those handed out before the restart
      are the old generation's: see "Restart and live views" in docs/PYTHON.md).
    """

    def __init__(self, bridge: Bridge, batches: Iterable[Any], depth: int = 2, to: str = "tinygrad", *,
                 timeout: float | None = 10.0, alignment: int = 256) -> None:
        self._closed = True  # until fully built: __del__ of a half-built Prefetcher has nothing to release
        if not isinstance(bridge, Bridge):
            raise TypeError(f"bridge must be a devbridge.Bridge, not {type(bridge).__name__}")
        self._depth = _checked_depth(depth)
        if not isinstance(to, str):
            raise TypeError(f'to must be "tinygrad" or "device", not {type(to).__name__}')
        if to not in _TARGETS:
            raise ValueError(f'to must be "tinygrad" or "device", not {to!r}')
        self._timeout = _checked_timeout(timeout)
        spec_for_array((1,), "uint8", alignment)  # checks alignment now rather than at the first batch
        self._alignment = operator.index(alignment)
        if to == "tinygrad":
            from . import _tinygrad

            _tinygrad._import_tinygrad()  # Unavailable now, not at the first batch, when tinygrad is missing
            self._tinygrad = _tinygrad
        self._to = to
        self._source: Iterator[Any] = iter(batches)
        self._bridge = bridge
        self._slots: list[_Slot] = []
        # Slots retired while their holders live.
        self._retired: list[_Retired] = []
        self._warned_retired = False
        self._last_handed_out: int | None = None  # the batch the loop's variables hold
        self._loaded: collections.deque[_Loaded] = collections.deque()
        self._next_index = 0  # the index of the next batch the source yields
        self._pulled: _Batch | None = None  # taken from the source (or from _restage), waiting for a slot
        # Batches pulled whose slots a restart took, to stage again before the source is asked for more (and
        # the error that ended the producer after them), in batch order.
        self._restage: collections.deque[_Loaded] = collections.deque()
        self._source_done = False  # nothing more is asked of the source: it ended, or the producer stopped
        self._source_ended = False  # the source itself ended (StopIteration, or its error)
        self._generation = self._bridge_generation()  # the generation the slots are allocated in
        self._handed_out = 0
        self._closed = False

    # ---- public ----

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def retired(self) -> int:
        """Retired slots whose holders still live (see the class doc): at most ``depth + 1``."""
        return len(self._live_retired())

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        while True:
            try:
                self._follow_bridge()
                self._issue(need_one=True)
            except BaseException as error:
                if not _wrapped(error):  # Ctrl-C while staging or waiting for a slot: ended at once
                    self._close(wait=False)
                raise
            if not self._loaded:
                self.close()
                raise StopIteration
            loaded = self._loaded.popleft()
            if loaded.error is not None:
                self.close()
                raise loaded.error
            try:
                out = self._hand_out(loaded.batch, loaded.slot)
                self._handed_out += 1
                self._last_handed_out = loaded.batch.index
                return out
            except BaseException as error:
                if _wrapped(error) and self._bridge_generation() not in (None, self._generation):
                    # Restarted (by another thread) since the batch was staged: it is staged again.
                    self._loaded.appendleft(loaded)
                    continue
                fatal = self._fatal_behind(error)
                # Nothing is waited for after an interrupt (Ctrl-C) or an upload that did not complete in time
                # (a hung device): the bridge frees the slots once their copies end.
                self._close(wait=_wrapped(error) and not isinstance(error, TimeoutError))
                if fatal is not None:
                    raise fatal
                if not _wrapped(error) or getattr(error, "batch_index", None) is not None:
                    raise
                raise _batch_error(error, loaded.batch.index) from error

    def close(self) -> None:
        """Ends the iteration and releases everything (idempotent): see the class doc."""
        self._close(wait=True)

    def _fatal_behind(self, error: BaseException) -> BaseException | None:
        """When handing out a batch raised ``Broken``, the fatal failure staging a later batch that broke the
        bridge, if that is what did (its own error, for the consumer: not the earlier batch's ``Broken``)."""
        if not isinstance(error, Broken):
            return None
        for loaded in self._loaded:
            if loaded.error is not None and getattr(loaded.error, "fatal", False):
                return loaded.error
        return None

    def _close(self, *, wait: bool) -> None:
        """``close()``; ``wait``: the copies in flight are waited for first (bounded), so the frees happen now.
        Without it (an interrupt, a hung device) nothing is waited for: the bridge frees each slot, and lets
        its ring ranges go, once the copies into it end. An interrupt of that wait still releases everything."""
        if self._closed:
            return
        self._closed = True
        bridge = self._bridge
        try:
            try:
                in_flight = [event for loaded in self._loaded if loaded.slot is not None
                             for tensor in loaded.slot.tensors for event, _, _ in tensor._events]
                if wait and in_flight and not bridge.closed:
                    _cleanup(bridge, in_flight)  # freeing under a copy would only defer the free
            finally:
                for slot in self._slots:
                    slot.release(bridge)
                self._slots.clear()
                for retired in self._retired:
                    retired.release(bridge)  # the bridge frees each once its holder lets go
                self._retired.clear()
                self._loaded.clear()
                self._restage.clear()
                self._pulled = None
        finally:
            close_source = getattr(self._source, "close", None)
            self._source = iter(())
            if callable(close_source):
                close_source()  # a generator's finally blocks run now, not at some later collection

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Left by an interrupt (Ctrl-C in the loop's body): nothing is waited for, as in next().
        self._close(wait=exc_type is None or issubclass(exc_type, Exception))

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                _without_waiting_for_a_restart(self.close)  # as DeviceTensor.__del__: never waiting for a restart
            except Exception:  # noqa: BLE001 - nothing to raise to from a finalizer
                pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._loaded)} loaded ahead"
        retired = f", {self.retired} retired" if self._retired else ""
        return (f"Prefetcher(depth={self._depth}, to={self._to!r}, {self._handed_out} batches handed out, "
                f"{len(self._slots)} slots{retired}, {state})")

    # ---- the producer side ----

    def _issue(self, *, need_one: bool) -> None:
        """Uploads the next batches into every slot the consumer is done with. ``need_one``: returns only
        once a batch is loaded (or the source is done), waiting for a slot up to the timeout."""
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        pause = _SLOT_POLL_MIN_S
        collected = False
        refused: set[int] = set()  # slots the bridge would not write into on this pass
        while self._pulled is not None or self._restage or not self._source_done:
            self._follow_bridge()  # Closed at once, even while waiting for a slot; a restart's new slots
            slot = self._free_slot(refused)
            if slot is not None:
                if not self._issue_into(slot):
                    refused.add(id(slot))
                continue
            if not need_one or self._loaded:
                return
            # Every slot is held, and the consumer needs a batch: ask the source for it before waiting for a
            # slot, so that at its end (or at its error) next() says so at once rather than waiting, and
            # timing out, for a slot no batch needs. The batch pulled is kept (self._pulled) until a slot
            # takes it, however many attempts that takes.
            if self._pull() is None:
                continue  # the source is done, or its error is loaded for the consumer: the loop ends
            # Tensors caught in reference cycles go only with a collection; after that,
            # only another thread (or a bridge that waits itself) can let go of one.
            if not collected:
                gc.collect()
                collected = True
            elif self._retire_pinned():
                pass  # a fresh slot takes the batch
            elif deadline is not None and time.monotonic() >= deadline:
                raise AllocationStillInUse(self._all_held_message())
            else:
                time.sleep(pause if deadline is None else min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, _SLOT_POLL_MAX_S)
            refused.clear()

    def _live_retired(self) -> list[_Retired]:
        self._retired = [retired for retired in self._retired if retired.alive(self._bridge)]
        return self._retired

    def _retire_pinned(self) -> bool:
        """Retires the oldest slot held past the batch handed out after it, unless the cap is reached:
        its allocations are released (the bridge frees them once the holder lets go; a DeviceTensor still
        referenced owns its own) and it leaves the slots, so a fresh one is made. True if one was."""
        if len(self._live_retired()) >= _RETIRED_PER_SLOT * (self._depth + 1) or self._last_handed_out is None:
            return False
        busy = {id(loaded.slot) for loaded in self._loaded}
        # Held: by what was handed out (weak references tell), or by a view of it the bridge alone sees (it
        # refused the last upload into the slot: a DLPack array, a TensorView taken from a DeviceTensor).
        pinned = [slot for slot in self._slots if id(slot) not in busy and slot.batch_index is not None
                  and slot.batch_index < self._last_handed_out and (slot.held() or slot.hidden_holder is not None)]
        if not pinned:
            return False
        slot = min(pinned, key=lambda s: s.batch_index)
        self._slots.remove(slot)
        if not self._warned_retired:
            self._warned_retired = True
            if slot.held():
                what = ("tinygrad tensors (or tensors computed from them)" if self._to == "tinygrad"
                        else "DeviceTensors")
                keeper = "so does a list of batches"
            else:  # the bridge refused to write under a view of it
                what = "views (DLPack arrays or TensorViews of its DeviceTensors)"
                keeper = "so does a list of numpy.from_dlpack(x) arrays"
            warnings.warn(
                f"Prefetcher: batch {slot.batch_index}'s {what} are still alive after batch "
                f"{self._last_handed_out} was handed out, so something keeps them beyond the loop (TinyJit "
                f"keeps the batch of its capture call for as long as the jitted function lives; {keeper}). "
                f"Its device slot is retired: its memory stays with its holder until that lets go, "
                f"and a fresh slot takes the next batch (at most {_RETIRED_PER_SLOT * (self._depth + 1)} retired "
                f"slots held at once, then the Prefetcher waits). Said once per Prefetcher.",
                RuntimeWarning, stacklevel=4)  # the frame iterating: _issue, __next__, then the caller
        index, holders = slot.batch_index, slot.holders
        hidden = slot.release(self._bridge, keep_hidden=True)
        self._retired.append(_Retired(index, holders, hidden))
        return True

    def _free_slot(self, skip: set[int]) -> _Slot | None:
        """A slot no batch is loading into and nothing handed out holds; a new one while fewer than depth + 1."""
        busy = {id(loaded.slot) for loaded in self._loaded} | skip
        for slot in self._slots:
            if id(slot) not in busy and not slot.held():
                return slot
        if len(self._slots) < self._depth + 1:
            slot = _Slot()
            self._slots.append(slot)
            return slot
        return None

    def _pull(self) -> _Batch | None:
        """The next batch (kept until a slot takes it): one a restart took the slot of, else the source's.
        None once there is none (the source is done, or the error that ended it is loaded)."""
        if self._pulled is None:
            if self._restage:
                waiting = self._restage.popleft()
                if waiting.error is not None:
                    self._loaded.append(waiting)  # the producer's error, after the batches before it
                    return None
                self._pulled = waiting.batch
                return self._pulled
            if self._source_done:
                return None
            index = self._next_index
            try:
                batch = next(self._source)
            except StopIteration:
                self._source_done = self._source_ended = True
                return None
            except BaseException as error:
                self._source_ended = True
                self._stop(index, error)
                return None
            self._next_index += 1
            try:
                self._pulled = _Batch(index, batch)
            except BaseException as error:
                self._source_ended = True
                self._stop(index, error)
                return None
        return self._pulled

    def _stop(self, index: int, error: BaseException, batch: _Batch | None = None) -> None:
        """The producer failed at batch ``index`` (staging ``batch``, when given): nothing more is pulled,
        and the consumer gets the error there, after the batches before it (an interrupt is raised at once)."""
        self._source_done = True
        self._pulled = None
        if not _wrapped(error):
            raise error
        self._loaded.append(_Loaded(batch, None, error if getattr(error, "batch_index", None) is not None
                                    else _batch_error(error, index)))

    # ---- the bridge closing or restarting under the loop ----

    def _bridge_generation(self) -> int | None:
        """The bridge's generation; None once it is closed."""
        try:
            return None if self._bridge.closed else self._bridge.generation
        except Closed:
            return None

    def _follow_bridge(self) -> None:
        """``Closed`` (and the Prefetcher closes) once the bridge is closed; after a restart, stages again
        what the old generation's slots held (``_restarted``)."""
        generation = self._bridge_generation()
        if generation is None:
            if self._loaded and self._loaded[0].batch is not None:
                index = self._loaded[0].batch.index
            else:
                index = self._next_index if self._pulled is None else self._pulled.index
            self.close()
            error = Closed(f"Prefetcher batch {index}: the bridge is closed (bridge.close()), so no batch can "
                           f"be staged or handed out any more")
            error.batch_index = index
            raise error
        if generation != self._generation:
            self._restarted(generation)

    def _restarted(self, generation: int) -> None:
        """The bridge was restarted: every handle, view and copy of the old generation is retired, the
        slots with them. The batches loaded into them (and the one pulled, waiting for a slot) are staged
        again from their arrays, which the Prefetcher still holds, into fresh slots; a failure staging one
        in the old generation (a bridge error: the old worker's) is forgotten, and the batch staged again.
        What was handed out before stays the consumer's (memory a view still reads stays valid)."""
        bridge = self._bridge
        waiting: list[_Loaded] = list(self._restage)
        for loaded in self._loaded:
            if loaded.error is None:
                waiting.append(_Loaded(loaded.batch, None))
            elif loaded.batch is not None and isinstance(loaded.error, BridgeError):
                waiting.append(_Loaded(loaded.batch, None))
                self._source_done = self._source_ended  # the source goes on after it
            else:
                waiting.append(loaded)
        if self._pulled is not None:
            waiting.append(_Loaded(self._pulled, None))
            self._pulled = None
        waiting.sort(key=lambda w: w.batch.index if w.error is None else w.error.batch_index)
        self._restage = collections.deque(waiting)
        self._loaded.clear()
        # No copy of the old generation is waited for: the bridge retired them.
        for slot in self._slots:
            slot.release(bridge)
        for retired in self._retired:
            retired.release(bridge)
        self._slots, self._retired = [], []
        self._generation = generation

    def _issue_into(self, slot: _Slot) -> bool:
        """Uploads the next batch into ``slot`` (or records why the producer stopped). False when the bridge
        refused to write into the slot because a view still reads it: the batch waits for another slot."""
        batch = self._pull()
        if batch is None:
            return True
        bridge = self._bridge
        position = 0
        tensors: list[_BatchTensor] = []
        try:
            plan = _allocation_plan(batch, self._alignment)
            if not slot.fits(plan):
                slot.release(bridge)  # a first batch, or its shapes or dtypes changed: allocate for it
                for spec, extent in plan:
                    # Appended by the call that allocates: Ctrl-C cannot land between the two. The plan after
                    # it: a slot left with one handle more than its plan no longer fits, and is freed whole.
                    _alloc_into(bridge, spec, extent, slot.handles)
                    slot.plan.append((spec, extent))
            try:
                for position, (array, handle) in enumerate(zip(batch.arrays, slot.handles)):
                    events = _stage_into(bridge, array, handle)
                    tensors.append(_BatchTensor(bridge, handle, array.shape, _dtype_name(array.dtype), events))
            except BaseException as error:
                # The arrays staged before the failing one: their copies end before the slot is reused
                # or freed, and their ranges go back. Not after an interrupt, which ends next() at once and
                # closes the Prefetcher: the bridge frees the slot once those copies end.
                if _wrapped(error):
                    _cleanup(bridge, [event for t in tensors for event, _, _ in t._events])
                raise
        except AllocationStillInUse as error:
            if slot.holders:
                # A view the weak references cannot see (a DLPack array, a TensorView from a DeviceTensor)
                # still reads the slot, and the bridge refused to write under it (nothing was written into
                # that allocation; the arrays before it were, which nothing the consumer holds reads).
                slot.hidden_holder = error.message
                return False
            self._stop(batch.index, _batch_error(error, batch.index, batch.where(position)), batch)
            return True
        except BaseException as error:
            if _wrapped(error) and self._bridge_generation() not in (None, self._generation):
                return True  # restarted under the staging (another thread): the batch waits, pulled, for _restarted
            if _wrapped(error):
                error = _batch_error(error, batch.index, batch.where(position))
            self._stop(batch.index, error, batch)
            return True
        self._pulled = None
        slot.batch_index, slot.tensors, slot.holders, slot.hidden_holder = batch.index, tensors, [], None
        self._loaded.append(_Loaded(batch, slot))
        return True

    # ---- the consumer side ----

    def _hand_out(self, batch: _Batch, slot: _Slot) -> Any:
        """Waits for the batch's copies; returns its structure over the device (and starts tracking it)."""
        out: list[Any] = []
        holders: list[weakref.ref] = []
        for position, tensor in enumerate(slot.tensors):
            try:
                if not tensor.wait(self._timeout):
                    raise TimeoutError(f"its upload did not complete within {self._timeout} s")
                if self._to == "device":
                    out.append(tensor)
                    holders.append(weakref.ref(tensor))
                else:
                    with tensor.view() as view:
                        t, buffer = self._tinygrad.hand_off(view)
                    out.append(t)
                    holders.append(weakref.ref(buffer))  # the lease lives exactly as long as this Buffer
            except BaseException as error:
                if not _wrapped(error):
                    raise
                raise _batch_error(error, batch.index, batch.where(position)) from error
        if self._to == "tinygrad":
            self._tinygrad.warn_if_not_default(out[0].device, stacklevel=3)  # the frame iterating
        # The slot keeps no strong reference to what it handed out: its holders tell when that is gone.
        slot.holders, slot.tensors = holders, []
        return batch.rebuild(out)

    def _all_held_message(self) -> str:
        held = []
        for slot in self._slots:
            if slot.held():
                what = ("its tinygrad tensors (or tensors computed from them, lazily or not) are alive"
                        if self._to == "tinygrad" else "its DeviceTensors are still referenced")
            elif slot.hidden_holder is not None:
                what = f"the bridge refused to write into it: {slot.hidden_holder}"
            else:
                continue
            held.append(f"batch {slot.batch_index}: {what}")
        waited = "without a bound" if self._timeout is None else f"{self._timeout} s"
        index = self._next_index if self._pulled is None else self._pulled.index
        retired = self._live_retired()
        kept = (f" {len(retired)} more slots are retired, still held by what keeps their batches "
                f"({', '.join(str(r.index) for r in retired)}): "
                f"at most {_RETIRED_PER_SLOT * (self._depth + 1)} at once."
                if retired else "")
        return (f"Prefetcher batch {index}: no device slot "
                f"came free in {waited}: all {len(self._slots)} slots (depth {self._depth} + 1) hold batches the "
                f"consumer has not let go of ({'; '.join(held)}).{kept} The loop's variables hold the batch last "
                f"handed out; a batch kept beyond it (a list of batches, of DLPack arrays of them or of results "
                f"computed from them, a lazy graph, .grad; TinyJit keeps only its capture call's, which the "
                f"Prefetcher retires) stays until dropped: drop what you keep, realize results you keep "
                f"(.realize() or .numpy()), or raise depth.")


__all__ = ["Prefetcher"]
