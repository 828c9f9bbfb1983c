// The bridge core's hot paths, defined out of the class (bridge_core.hpp
// declares them and includes this at its end): a copy, the completions that
// end copies, a view's lease, an allocation and its free. Defined in a header, not a .cpp, so that
// Bridge's forwarding functions inline them; kept out of the class so that
// bridge_core.hpp reads as the orchestrator's declarations.
#pragma once

#include "core/bridge_core.hpp"

namespace devbridge::detail {

template <class Ready>
bool BridgeCore::wait_until(SpinLockHold& lock, std::chrono::steady_clock::time_point deadline, Ready ready) {
  constexpr auto kSlice = std::chrono::milliseconds(2);
  for (;;) {
    drain_locked();
    if (ready()) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    lock.unlock();
    // What it throws leaves with the lock dropped: nothing here is taken yet.
    if (WaitCheck* check = WaitCheck::current()) [[unlikely]]
      check->look(now);
    {
      const RuntimeLockReleased runtime;  // no sleep here with the GIL held
      backend_->wait_for_completions(std::min<std::chrono::nanoseconds>(deadline - now, kSlice));
    }
    lock.lock();
    enter(lock);
  }
}

template <bool kPitched, class Host>
CopyEvent BridgeCore::copy(CopyDirection direction, const Host& host, DeviceRange device, CopyMode mode,
                           Admission admission, const CopyLayout& layout) {
  check_timeout(admission.wait_for_room, "wait_for_room");
  SpinLockHold lock(lock_);
  enter(lock);
  auto* slot = &allocation(device.handle);
  validate_device_range(device, *slot);
  const std::uint64_t bytes = checked_copy_bytes<kPitched>(host, device, *slot, layout);
  auto host_key = locate_host(host, direction);
  if (__builtin_expect(guarded_write(*slot, direction) || (mode == CopyMode::Async && !copies_.has_room(bytes)), 0))
  {
    const auto admitted = admit(lock, direction, host, device, bytes, mode, admission);
    slot = admitted.slot;
    host_key = admitted.host_key;
  }

  const auto alloc_index = id_slot(device.handle.id);
  if (mode == CopyMode::Async) {
    const auto id = copies_.begin_async(direction, alloc_index, host_key, bytes);  // before pin: it may throw
    pin(*slot, direction, host_key);
    const CopyEvent event{domain_, generation_, id};
    // Submission is an enqueue: it stays under the lock, so a completion
    // can never be drained before its record exists.
    try {
      backend_->submit_copy(
          {direction, mode, event, host_data(host, host_key), slot->device, device.offset, bytes, layout});
    } catch (...) {
      // Never submitted, never handed out: the event stays unknown.
      unpin(alloc_index, direction, host_key);
      copies_.cancel_async(id);
      rethrow_as_copy_error(direction);
    }
    copies_.submitted();
    if (trace_.on()) [[unlikely]]
      trace_.copy_begin(direction, device, id, bytes);
    return event;
  }

  // Sync: the copy itself runs unlocked; pins keep memory and range alive.
  // Its event is numbered only once it succeeded: a failed sync copy's
  // event is never handed out, so no id of it can read as Completed.
  pin(*slot, direction, host_key);
  const std::uint64_t began = trace_.on() ? trace_.ticks() : 0;
  const CopyEvent unnumbered{domain_, generation_, CopyTimeline::kSyncEventBit};
  const CopyRequest request{direction, mode,          unnumbered, host_data(host, host_key),
                            slot->device, device.offset, bytes,      layout};
  auto failure = gate_.run_unlocked(lock, [&] { backend_->submit_copy(request); });
  unpin(alloc_index, direction, host_key);
  if (began) [[unlikely]]  // trace_whole_slice checks the recorder is still on
    trace_.whole_slice(direction == CopyDirection::HostToDevice ? TraceTrack::CopyUp : TraceTrack::CopyDown, device,
                      began, !failure);
  if (failure) throw copy_error(direction, *failure);
  return CopyEvent{domain_, generation_, copies_.complete_sync()};
}

[[gnu::always_inline]] inline void BridgeCore::pin(AllocationSlot& slot, CopyDirection direction,
                                                   HostRing::Key host_key) {
  ++slot.copies;
  if (direction == CopyDirection::HostToDevice) ++slot.uploads;
  if (__builtin_expect(host_key & kRegionPin, 0))
    ++regions_[static_cast<std::uint32_t>(host_key)].copies;
  else
    ring_.pin(host_key);
}

[[gnu::always_inline]] inline void BridgeCore::unpin(std::uint32_t allocation, CopyDirection direction,
                                                     HostRing::Key host_key) {
  auto& slot = allocations_[allocation];
  --slot.copies;
  if (direction == CopyDirection::HostToDevice) --slot.uploads;
  if (__builtin_expect(host_key & kRegionPin, 0))
    --regions_[static_cast<std::uint32_t>(host_key)].copies;
  else
    ring_.unpin(host_key);
  maybe_finish_release(allocation);
}

inline std::size_t BridgeCore::drain_locked() {
  drained_.clear();
  backend_->drain_completions(drained_);
  // Once per drain, before they apply, out of line: a recorder call inside
  // apply() kept it from being inlined into this loop (+10 instructions a
  // completion, recording or not).
  if (trace_.on() && !drained_.empty()) [[unlikely]]
    trace_.completions(drained_, domain_);
  for (const auto& completion : drained_) apply(completion);
  // Events settle and ranges unpin only in apply(): with nothing applied,
  // no waiting range can have become releasable since the last scan.
  if (__builtin_expect(!release_after_.empty(), 0) && !drained_.empty()) release_settled();
  return drained_.size();
}

inline void BridgeCore::apply(const Completion& c) {
  CopySlot* record = copies_.settling(c, domain_, generation_);
  if (!record) return;
  unpin(record->allocation, record->direction, record->host_key);
  if (c.ok) return copies_.complete(c.event.id);
  // The failure is remembered so the event reads back as Failed; the host
  // range is unpinned and stays the caller's, to retry.
  const ErrorKind kind = directed_kind(record->direction, c.error);
  std::string message = c.message.empty() ? "the backend reported the copy failed" : c.message;
  if (c.fatal) mark_broken(Error(kind, message, true));
  copies_.record_failure(c.event.id, generation_, kind, std::move(message));
}

[[gnu::always_inline]] inline TensorView BridgeCore::view(const DeviceHandle& h, const ViewSpec& spec,
                                                          ViewWait wait_mode) {
  SpinLockHold lock(lock_);
  enter(lock);
  auto* slot = &allocation(h);
  if (__builtin_expect(spec.dtype != slot->view_dtype, 0) &&
      (slot->spec.dtype || dtypes_.element_size(spec.dtype) == 0))
    fail_view_dtype(h, spec.dtype, *slot);
  TensorView view = shape_view(h, spec, *slot, placement_);
  if (__builtin_expect(slot->uploads != 0, 0)) {
    if (wait_mode == ViewWait::Refuse) fail_view_during_upload(h, *slot);
    refuse_waiting_for_own_write(h);
    wait_until(lock, std::chrono::steady_clock::time_point::max(), [&] {
      slot = &allocation(h);
      return slot->uploads == 0;
    });
  }
  call_backend([&] { backend_->validate_view(slot->device, view); });
  ++slot->views;
  ++outstanding_leases_;
  if (trace_.on()) [[unlikely]]
    trace_.view(TraceKind::ViewBegin, h, ViewHolder::Caller);
  return view;
}

inline void BridgeCore::end_view(const DeviceHandle& h) noexcept {
  lock_.lock();
  --outstanding_leases_;
  if (__builtin_expect(h.generation != generation_ || gate_.closed(), 0)) return end_orphaned_view(h);
  const auto index = id_slot(h.id);
  auto& slot = allocations_[index];
  // Not in the table though the generation is current: a restart has made
  // it an orphan and dropped the lock (giving back the cache) before it
  // advanced the generation. The orphan's count must see this end.
  if (__builtin_expect(!slot.in_use || slot.version != id_version(h.id) || slot.views == 0, 0))
    return end_orphaned_view(h);
  --slot.views;
  // One out-of-line path for both rare cases: a recorder call in here kept
  // the slot and index in callee-saved registers on every lease's end.
  if (__builtin_expect(slot.released || trace_.on(), 0)) return end_view_out_of_line(h, index);
  lock_.unlock();
}
inline void BridgeCore::end_view_out_of_line(const DeviceHandle& h, std::uint32_t index) noexcept {
  if (trace_.on()) trace_.view(TraceKind::ViewEnd, h, ViewHolder::Caller);
  if (allocations_[index].released) finish_release_out_of_line(index);
  lock_.unlock();
}

inline DeviceHandle BridgeCore::alloc_device(const ObjectSpec& spec, std::uint64_t extent) {
  const auto [elem, view_dtype] = dtypes_.checked_allocation(spec, extent);
  if (pool_) return alloc_through_pool(spec, elem, view_dtype, extent);
  if (__builtin_expect(gate_.seen_closed_or_broken(), 0)) {
    // Refused before the driver is asked (a racing close costs an
    // allocation freed again below).
    SpinLockHold lock(lock_);
    enter(lock);
  }
  // The driver's allocation runs without the lock: it can take
  // milliseconds and synchronize the device (cuMemAlloc), and no other
  // caller should spin meanwhile. A restart in progress is waited out by
  // enter() afterwards, and the memory joins the new generation.
  const DeviceAllocation device = allocate(extent, extent, spec.alignment);
  SpinLockHold lock(lock_);
  enter_or_free(lock, device);
  return add_allocation(lock, spec, elem, view_dtype, extent, device);
}

inline DeviceAllocation BridgeCore::allocate(std::uint64_t asked, std::uint64_t extent, std::uint64_t alignment) {
  try {
    return backend_->allocate(asked, alignment);
  } catch (const Error& e) {
    return allocate_after_refusal(e, asked, extent, alignment);
  }
}

inline void BridgeCore::enter_or_free(SpinLockHold& lock, const DeviceAllocation& device) {
  try {
    enter(lock);
  } catch (...) {
    lock.unlock();
    backend_->free(device);
    throw;
  }
}

inline DeviceHandle BridgeCore::add_allocation(SpinLockHold& lock, const ObjectSpec& spec, std::uint32_t elem,
                                              DType view_dtype, std::uint64_t extent, const DeviceAllocation& device) {
  std::uint32_t index;
  try {
    index = allocations_.acquire();
  } catch (...) {
    const auto whole = keep_or_free_later(device, spec.alignment);
    lock.unlock();
    if (whole) backend_->free(*whole);
    throw;
  }
  const DeviceHandle handle{domain_, generation_, allocations_.start(index, spec, elem, view_dtype, extent, device)};
  if (trace_.on()) [[unlikely]]
    trace_.memory(TraceKind::Allocate, generation_, handle.id, extent, device.address);
  return handle;
}

inline void BridgeCore::free_device(const DeviceHandle& h) {
  SpinLockHold lock(lock_);
  enter(lock);
  auto& slot = allocation(h);
  if (__builtin_expect(slot.used(), 0)) fail_in_use(h, slot);
  free_slot_then_unlock(lock, id_slot(h.id));
}

inline void BridgeCore::release(const DeviceHandle& h) {
  SpinLockHold lock(lock_);
  enter(lock);
  auto& slot = allocation(h);
  slot.released = true;
  if (trace_.on()) [[unlikely]]
    trace_.memory(TraceKind::Release, h.generation, h.id, slot.extent);
  if (!slot.used()) free_slot_then_unlock(lock, id_slot(h.id));
}

inline void BridgeCore::free_slot_then_unlock(SpinLockHold& lock, std::uint32_t index) {
  auto& slot = allocations_[index];
  if (__builtin_expect(slot.adopted_region != 0, 0)) return end_adopted_slot(index);  // nothing the driver frees
  if (__builtin_expect(!frees_off_common_path_, 1))
    return free_to_backend_then_unlock<false>(lock, index);  // the common case
  if (!pool_) return free_to_backend_then_unlock<true>(lock, index);
  const auto whole = give_back_to_pool(index);
  lock.unlock();
  if (whole) backend_->free(*whole);
}

template <bool kRecorded>
void BridgeCore::free_to_backend_then_unlock(SpinLockHold& lock, std::uint32_t index) {
  // Recorded once the slot is retired (it keeps its fields until it is
  // used again), where only `device`, on the stack, is live across the
  // call: before the retire, the call kept the slot in a callee-saved
  // register on every free, recording or not.
  const DeviceAllocation device = allocations_[index].device;
  allocations_.retire(index);
  allocations_.count_backend_frees(1);
  if constexpr (kRecorded)
    if (trace_.on()) [[unlikely]]
      trace_.freed_slot(index);
  lock.unlock();
  backend_->free(device);
}

}  // namespace devbridge::detail
