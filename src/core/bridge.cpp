// The bridge core's drop queue, copies, compute and views (bridge_core.hpp).
#include "core/bridge_core.hpp"

#include <algorithm>

namespace devbridge::detail {

void BridgeCore::reap_fences() noexcept {
  drops_.reap(
      *backend_, [&](const DropQueue::Entry& entry) { end_fenced_uses(entry); },
      [&](const Error& e) {
        if (e.fatal()) mark_broken(e);
        log().error("devbridge: testing a fence failed (the memory it holds stays allocated): {}", e.what());
      });
  gate_.set(BridgeGate::kFencesPending, !drops_.empty());
}

void BridgeCore::end_fenced_uses(const DropQueue::Entry& entry) noexcept {
  if (trace_.on()) [[unlikely]]
    trace_.fence(TraceKind::FencePassed, entry);
  for (const auto id : entry.allocation_ids) {
    if (entry.generation == generation_) {
      if (auto* slot = allocations_.find(id)) {
        --slot->steps;
        maybe_finish_release(id_slot(id));
        continue;
      }
    }
    // The allocation left its generation (restart, close) while the fence
    // held it: an orphan now.
    const AllocationTable::OrphanKey key{entry.generation, id};
    if (auto* orphan = allocations_.find_orphan(key)) {
      --orphan->fences;
      maybe_free_orphan(key, *orphan);
    }
  }
}

void BridgeCore::add_fenced_uses(DropQueue::Entry&& entry) noexcept {
  if (trace_.on()) [[unlikely]]
    trace_.fence(TraceKind::FenceRecorded, entry);
  for (const auto id : entry.allocation_ids) {
    if (entry.generation == generation_) {
      if (auto* slot = allocations_.find(id)) {
        ++slot->steps;
        continue;
      }
    }
    if (auto* orphan = allocations_.find_orphan({entry.generation, id})) ++orphan->fences;
  }
  drops_.add(std::move(entry));
  gate_.set(BridgeGate::kFencesPending, true);
}

void BridgeCore::hold_until_consumer_fence(DropQueue::Entry&& held) {
  drops_.reserve_one();
  try {
    held.fence = backend_->record_fence(held.where);
  } catch (const Error& e) {
    drops_.cancel_reservation();
    if (e.fatal()) mark_broken(e);
    throw;
  } catch (...) {
    drops_.cancel_reservation();
    throw;
  }
  if (held.fence.pending())
    add_fenced_uses(std::move(held));
  else
    drops_.cancel_reservation();
}

std::string BridgeCore::uses(const DeviceHandle& h, const AllocationSlot& slot) const {
  const std::uint32_t fenced = drops_.uses_of(h.generation, h.id);
  const std::uint32_t steps = slot.steps - std::min(slot.steps, fenced);
  std::string text = fmt::format("{} cop{} in flight, {} compute step{}, {}", slot.copies,
                                 slot.copies == 1 ? "y" : "ies", steps, steps == 1 ? "" : "s", views_text(h, slot));
  if (fenced) {
    std::string queues;
    for (const auto& where : drops_.queues_holding(h.generation, h.id))
      queues += (queues.empty() ? "" : ", ") + queue_text(where) + (where.queue == Queue::Compute ? " (a launch)" : "");
    text += fmt::format(", {} use{} ending at a fence not yet passed on {} (release() frees it once they pass)", fenced,
                        fenced == 1 ? "" : "s", queues);
  }
  return text;
}

std::string BridgeCore::views_text(const DeviceHandle& h, const AllocationSlot& slot) const {
  return holders_.views_text(h.id, slot.views);
}

[[noreturn, gnu::cold, gnu::noinline]] void BridgeCore::fail_write_under_view(const DeviceRange& range,
                                                                 const AllocationSlot& slot) const {
  fail(ErrorKind::AllocationStillInUse,
       "an upload into [offset {}, len {}] of {} would change bytes a view still reads (writes_under_view is "
       "\"{}): {}; end {} first, or choose writes_under_view \"wait\" or \"allow\"",
       range.offset, range.len, describe(range.handle),
       writes_under_view_ == WritesUnderView::Wait ? "wait\", and the wait timed out" : "refuse\"",
       views_text(range.handle, slot), slot.views == 1 ? "it" : "them");
}

[[noreturn, gnu::cold, gnu::noinline]] void BridgeCore::fail_in_use(const DeviceHandle& h,
                                                                    const AllocationSlot& slot) const {
  fail(ErrorKind::AllocationStillInUse, "{} is still used: {}", describe(h), uses(h, slot));
}

std::pair<ObjectSpec, std::uint64_t> BridgeCore::spec_of(const DeviceHandle& h) {
  SpinLockHold lock(lock_);
  enter(lock);
  auto& slot = allocation(h);
  return {slot.spec, slot.extent};
}

[[gnu::noinline, gnu::cold]] HostRange BridgeCore::reserve_waiting(SpinLockHold& lock, std::uint64_t bytes,
                                                       std::uint64_t alignment, std::chrono::nanoseconds timeout) {
  const auto deadline = checked::deadline_after(timeout);
  for (;;) {
    try {
      return ring_.reserve(bytes, alignment);
    } catch (const Error& e) {
      // Out of room: wait while time is left. Anything else (a size past
      // the ring, a bad alignment) never fits: refused at once.
      if (e.kind() != ErrorKind::Backpressure || checked::Clock::now() >= deadline) throw;
    }
    if (!release_after_.empty()) {
      // Ranges wait for their copies (release_host_after): room comes back
      // with a completion, so this wait drains them as wait() does.
      wait_for_completion_slice(lock, deadline);
      continue;
    }
    gate_.sleep(lock, deadline == checked::Clock::time_point::max() ? std::nullopt : std::optional(deadline));
    enter(lock);
  }
}

void BridgeCore::wait_for_completion_slice(SpinLockHold& lock, checked::Clock::time_point deadline) {
  constexpr auto kSlice = std::chrono::milliseconds(2);
  const auto now = checked::Clock::now();
  lock.unlock();
  backend_->wait_for_completions(std::min<std::chrono::nanoseconds>(deadline - now, kSlice));
  lock.lock();
  enter(lock);
  drain_locked();
}

void BridgeCore::release_host_after(HostRange range, const CopyEvent& event) {
  SpinLockHold lock(lock_);
  // Not enter(): a Broken bridge takes ranges too (its restart releases them).
  gate_.block_while(lock, [&] { return gate_.restarting() && !gate_.closed(); });
  gate_.check_not_closed();
  check_tag(event);
  bool done = copies_.state(event) != CopyState::Pending;  // UnknownDeviceHandle for an event never issued
  const auto key = ring_.exact(range, "release_host_after");
  if (release_after_.holds(key))
    fail(ErrorKind::InvalidRange, "host range [offset {}, len {}] is already waiting in release_host_after",
         range.offset, range.len);
  if (!done && !gate_.broken()) {
    drain_locked();  // its completion may be waiting in the backend
    done = settled(event);
  }
  if (done && ring_.release(key, range) == HostRing::KeyRelease::Released) {
    gate_.notify();
    return;
  }
  release_after_.add({range, key, event});
  gate_.notify();  // a reserve sleeping for room now waits on completions instead
}

bool BridgeCore::wait_for_release_after(std::chrono::nanoseconds timeout) {
  check_timeout(timeout, "wait_for_release_after timeout");
  SpinLockHold lock(lock_);
  enter(lock);
  const std::size_t waiting = release_after_.size();
  if (waiting == 0) return false;
  const auto deadline = checked::deadline_after(timeout);
  for (drain_locked(); release_after_.size() >= waiting;) {
    if (checked::Clock::now() >= deadline) return false;
    wait_for_completion_slice(lock, deadline);
  }
  return true;
}

bool BridgeCore::settled(const CopyEvent& event) noexcept {
  try {
    return copies_.state(event) != CopyState::Pending;
  } catch (...) {
    return true;  // a forgotten failure: long settled
  }
}

void BridgeCore::release_settled() noexcept {
  if (release_after_.release_settled(ring_, [&](const CopyEvent& e) { return settled(e); }) != 0) gate_.notify();
}

void BridgeCore::release_host(HostRange range) {
  SpinLockHold lock(lock_);
  gate_.check_not_closed();
  try {
    ring_.release(range);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::AllocationStillInUse || !apply_completions_before_refusing()) throw;
    ring_.release(range);
  }
  gate_.notify();  // a reserve may be waiting for the room
}

bool BridgeCore::apply_completions_before_refusing() {
  if (gate_.broken() || gate_.restarting()) return false;  // as elsewhere: a broken or restarting bridge drains nothing
  return drain_locked() != 0;
}

void BridgeCore::free_once_copies_applied(const DeviceHandle& h) {
  SpinLockHold lock(lock_);
  enter(lock);
  if (allocation(h).copies != 0) apply_completions_before_refusing();
  auto& slot = allocation(h);  // a completion's release never ends a slot that was not released
  if (slot.used()) fail_in_use(h, slot);
  free_slot_then_unlock(lock, id_slot(h.id));
}

std::span<std::byte> BridgeCore::host_bytes(HostRange range) {
  SpinLockHold lock(lock_);
  gate_.check_not_closed();
  ring_.find(range);
  return {ring_.data(range), range.len};
}

std::span<std::byte> BridgeCore::lease_host(HostRange range) {
  SpinLockHold lock(lock_);
  gate_.check_not_closed();
  ring_.find(range);
  ++host_leases_;
  ++outstanding_leases_;
  return {ring_.data(range), range.len};
}

void BridgeCore::end_host_lease() noexcept {
  bool last;
  {
    std::lock_guard guard(lock_);
    --outstanding_leases_;
    if (--host_leases_ == 0 && leased_ring_.data) {
      backend_->free_host(leased_ring_);
      leased_ring_ = HostBlock{};
    }
    last = !owner_alive_ && outstanding_leases_ == 0;
  }
  if (last) delete this;
}

std::uint64_t BridgeCore::ring_free_bytes() {
  std::lock_guard guard(lock_);
  return ring_.free_bytes();
}

[[noreturn, gnu::cold, gnu::noinline]] void BridgeCore::fail_read_only(const DeviceRange& range,
                                                                       std::string_view what) const {
  fail(ErrorKind::InvalidRange,
       "{} [offset {}, len {}] of {}: it is read-only host memory adopted in place (adopt_host); allocate a "
       "tensor of its own to write into",
       what, range.offset, range.len, describe(range.handle));
}

void BridgeCore::wait_out_views_or_fail(SpinLockHold& lock, const DeviceRange& range,
                            std::optional<checked::Clock::time_point>& deadline) {
  if (writes_under_view_ == WritesUnderView::Wait) {
    if (!deadline) deadline = checked::deadline_after(writes_under_view_timeout_);
    if (wait_until(lock, *deadline, [&] { return allocation(range.handle).views == 0; })) return;
  }
  fail_write_under_view(range, allocation(range.handle));
}

template <class Host>
[[gnu::noinline, gnu::cold]] BridgeCore::Admitted BridgeCore::admit(SpinLockHold& lock, CopyDirection direction,
                                                                    const Host& host, const DeviceRange& device,
                                                                    std::uint64_t bytes, CopyMode mode,
                                                                    const Admission& admission) {
  std::optional<checked::Clock::time_point> room_deadline, views_deadline;
  for (;;) {
    auto* slot = &allocation(device.handle);
    validate_device_range(device, *slot);
    const auto host_key = locate_host(host, direction);
    if (direction == CopyDirection::HostToDevice && slot->read_only()) fail_read_only(device, "an upload into");
    if (guarded_write(*slot, direction)) {
      wait_out_views_or_fail(lock, device, views_deadline);
      continue;  // the lock was dropped: check everything again
    }
    if (mode == CopyMode::Sync || copies_.has_room(bytes)) return {slot, host_key};
    if (bytes > copies_.inflight_budget())
      fail(ErrorKind::Backpressure, "a copy of {} bytes exceeds the whole in-flight budget of {} bytes", bytes,
           copies_.inflight_budget());
    if (!room_deadline) room_deadline = checked::deadline_after(admission.wait_for_room);
    const bool room = admission.wait_for_room.count() > 0 &&
                      wait_until(lock, *room_deadline, [&] { return copies_.has_room(bytes); });
    if (!room)
      fail(ErrorKind::Backpressure, "{} bytes in flight of a {}-byte budget; no room for {} more",
           copies_.inflight_bytes(), copies_.inflight_budget(), bytes);
  }
}

template BridgeCore::Admitted BridgeCore::admit(SpinLockHold&, CopyDirection, const HostRange&, const DeviceRange&,
                                                std::uint64_t, CopyMode, const Admission&);
template BridgeCore::Admitted BridgeCore::admit(SpinLockHold&, CopyDirection, const RegionRange&, const DeviceRange&,
                                                std::uint64_t, CopyMode, const Admission&);

[[noreturn]] void BridgeCore::rethrow_as_copy_error(CopyDirection direction) {
  try {
    throw;
  } catch (const Error& e) {
    throw copy_error(direction, e);
  }
}

Error BridgeCore::copy_error(CopyDirection direction, const Error& e) {
  Error mapped(directed_kind(direction, e.kind()), e.message(), e.fatal());
  if (mapped.fatal()) mark_broken(mapped);
  copies_.count_failed();
  return mapped;
}

CopyStatus BridgeCore::copy_status(const CopyEvent& e) {
  SpinLockHold lock(lock_);
  enter(lock);
  drain_locked();
  return status_locked(e);
}

bool BridgeCore::is_completed(const CopyEvent& e) {
  SpinLockHold lock(lock_);
  enter(lock);
  // Cheap first look: a retired event needs no drain.
  if (state_locked(e) == CopyState::Completed) return true;
  drain_locked();
  return state_locked(e) == CopyState::Completed;
}

void BridgeCore::check_timeout(std::chrono::nanoseconds timeout, const char* what) {
  if (timeout.count() < 0)
    fail(ErrorKind::InvalidRange, "{} of {} ns is negative; give zero to fail fast or a duration to wait", what,
         timeout.count());
}

CopyStatus BridgeCore::wait(const CopyEvent& e, std::optional<std::chrono::nanoseconds> timeout) {
  if (timeout) check_timeout(*timeout, "wait timeout");
  const auto deadline = timeout ? checked::deadline_after(*timeout) : checked::Clock::time_point::max();
  SpinLockHold lock(lock_);
  enter(lock);
  CopyStatus status;
  wait_until(lock, deadline, [&] {
    status = status_locked(e);
    return status.state != CopyState::Pending;
  });
  return status;
}

std::size_t BridgeCore::poll() {
  SpinLockHold lock(lock_);
  enter(lock);
  return drain_locked();
}

void BridgeCore::begin_step(StepId step, std::span<const DeviceHandle> handles) {
  SpinLockHold lock(lock_);
  enter(lock);
  if (steps_.contains(step))
    fail(ErrorKind::Unsupported, "step {} is already active; end it first", step);
  std::vector<std::uint32_t> indices;
  indices.reserve(handles.size());
  for (const auto& h : handles) {
    allocation(h);  // validates; throws before anything changes
    indices.push_back(id_slot(h.id));
  }
  // A handle listed twice (an in-place step's input and output) is one use:
  // counted twice, a refused free would name two steps where one runs.
  // (std::sort/unique: clang 14's ranges cannot take libstdc++ 12's subrange, and the fuzzer builds with it.)
  std::sort(indices.begin(), indices.end());
  indices.erase(std::unique(indices.begin(), indices.end()), indices.end());
  for (auto index : indices) ++allocations_[index].steps;
  steps_.emplace(step, std::move(indices));
}

void BridgeCore::end_step(StepId step, std::optional<ConsumerQueue> after) {
  SpinLockHold lock(lock_);
  enter(lock);
  auto it = steps_.find(step);
  if (it == steps_.end())
    fail(ErrorKind::UnknownDeviceHandle,
         "step {} is not active (never begun, already ended, or from before a restart)", step);
  if (after) {
    // The consumer's queue may still run the step: its allocations stay
    // held until a fence recorded there now passes.
    DropQueue::Entry held{Fence{}, QueueRef{Queue::Consumer, after->handle}, generation_, {}};
    held.allocation_ids.reserve(it->second.size());
    for (auto index : it->second) held.allocation_ids.push_back(make_id(index, allocations_[index].version));
    hold_until_consumer_fence(std::move(held));
  }
  for (auto index : it->second) {
    --allocations_[index].steps;
    maybe_finish_release(index);
  }
  steps_.erase(it);
}

void BridgeCore::launch_axpy(const DeviceRange& x, const DeviceRange& y, float a, float b) {
  SpinLockHold lock(lock_);
  enter(lock);
  (void)allocation(x.handle);  // x's handle is refused before y's
  // As free_device: a copy into y that ended unpolled holds nothing, so the
  // completions waiting are applied before y's copies can refuse the launch
  // (they may end either operand, which is looked up again).
  if (allocation(y.handle).copies != 0) apply_completions_before_refusing();
  auto& xs = allocation(x.handle);
  auto& ys = allocation(y.handle);
  // Untyped operands are read as float32: their ranges must be aligned to it.
  for (const auto* s : {&xs, &ys})
    if (s->spec.dtype && *s->spec.dtype != DType::Float32)
      fail(ErrorKind::InvalidViewDType, "axpy runs over float32; an operand holds {}", spec_dtype_name(s->spec));
  validate_device_range(x, xs);
  validate_device_range(y, ys);
  if (ys.read_only()) fail_read_only(y, "axpy's output");
  for (const auto* r : {&x, &y})
    if ((r->offset | r->len) % sizeof(float))
      fail(ErrorKind::InvalidRange, "axpy range [offset {}, len {}] of {} is not aligned to float32 (4 bytes)",
           r->offset, r->len, describe(r->handle));
  if (x.len != y.len)
    fail(ErrorKind::InvalidRange, "axpy ranges differ in length: {} vs {} bytes", x.len, y.len);
  // The same range is element-wise in place; a shifted overlap would read
  // elements another work item already wrote, in whatever order the device
  // runs them (each backend gave another result).
  if (x.handle == y.handle && x.offset != y.offset &&
      (x.offset < y.offset ? y.offset - x.offset : x.offset - y.offset) < x.len)
    fail(ErrorKind::InvalidRange,
         "axpy's x [offset {}, len {}] and y [offset {}, len {}] of {} overlap without being the same range: the "
         "result would depend on the order the device runs the elements in",
         x.offset, x.len, y.offset, y.len, describe(x.handle));
  require_compute(DType::Float32, "axpy");
  if (ys.copies)
    fail(ErrorKind::AllocationStillInUse, "axpy would write {} while it has {} cop{} in flight", describe(y.handle),
         ys.copies, ys.copies == 1 ? "y" : "ies");
  const AxpyLaunch launch{xs.device, x.offset, ys.device, y.offset, x.len / sizeof(float), a, b};
  const auto xi = id_slot(x.handle.id), yi = id_slot(y.handle.id);
  // The kernel may still run when the launch returns: its use of x and y
  // ends at its fence. Everything that can fail is done before it starts.
  DropQueue::Entry held{Fence{}, QueueRef{Queue::Compute}, generation_, {x.handle.id, y.handle.id}};
  drops_.reserve_one();
  ++xs.steps;
  ++ys.steps;
  const std::uint64_t launched = trace_.on() ? trace_.ticks() : 0;
  auto failure = gate_.run_unlocked(lock, [&] { held.fence = backend_->launch_axpy(launch); });
  if (trace_.on() && !failure) [[unlikely]] {
    // The launch's slice runs from its call to its fence (keyed by the
    // fence's token: end_fenced_uses ends it), or ends at once without one.
    if (held.fence.pending()) {
      auto begin = trace_record(TraceKind::LaunchBegin, generation_, y.handle.id);
      begin.ts_ns = launched;
      begin.slice = held.fence.token;
      begin.offset = y.offset;
      begin.bytes = y.len;
      begin.track = TraceTrack::Compute;
      trace_.record(begin);
    } else {
      trace_.whole_slice(TraceTrack::Compute, y, launched, true);
    }
  }
  // A restart waits for calls in progress: x and y are still this generation's.
  for (auto index : {xi, yi}) --allocations_[index].steps;
  if (!failure && held.fence.pending())
    add_fenced_uses(std::move(held));
  else
    drops_.cancel_reservation();
  for (auto index : {xi, yi}) maybe_finish_release(index);
  if (failure) {
    if (failure->fatal()) mark_broken(*failure);
    throw *failure;
  }
}

[[noreturn, gnu::cold, gnu::noinline]] void BridgeCore::fail_view_dtype(const DeviceHandle& h, DType dtype,
                                                            const AllocationSlot& slot) const {
  if (slot.spec.dtype)
    fail(ErrorKind::InvalidViewDType, "view dtype {} differs from {}'s dtype {}", dtype_info(dtype).name, describe(h),
         spec_dtype_name(slot.spec));
  if (dtype_size(dtype) == 0)
    fail(ErrorKind::InvalidViewDType, "view of {}: dtype value {} is not a dtype", describe(h),
         static_cast<int>(dtype));
  dtypes_.fail_not_held(dtype, "a view");
}

[[noreturn, gnu::cold, gnu::noinline]] void BridgeCore::fail_view_during_upload(const DeviceHandle& h,
                                                                               const AllocationSlot& slot) const {
  fail(ErrorKind::AllocationStillInUse, "{} has {} cop{} into it in flight; wait for them or ask the view to wait",
       describe(h), slot.uploads, slot.uploads == 1 ? "y" : "ies");
}

void BridgeCore::refuse_waiting_for_own_write(const DeviceHandle& h) const {
  if (inside_own_in_place_callback(id_slot(h.id), /*writes=*/true))
    fail(ErrorKind::AllocationStillInUse,
         "a view of {} waits for the copies into it to end, and it was asked for from inside this thread's own "
         "write_in_place into it (a fill handed its bytes), which ends only when that returns; take the view "
         "after the transfer",
         describe(h));
}

void BridgeCore::end_handed_on_view(const DeviceHandle& h, ViewHolder holder) noexcept {
  {
    std::lock_guard guard(lock_);
    if (h.generation == generation_) holders_.hand_back(h.id, holder);
  }
  end_view(h);
}

void BridgeCore::hold_view_until_fence(const DeviceHandle& h, ConsumerQueue queue) {
  SpinLockHold lock(lock_);
  hold_until_consumer_fence(DropQueue::Entry{Fence{}, QueueRef{Queue::Consumer, queue.handle}, h.generation, {h.id}});
}

void BridgeCore::set_view_holder(const DeviceHandle& h, ViewHolder from, ViewHolder to) noexcept {
  std::lock_guard guard(lock_);
  if (from == to || h.generation != generation_) return;  // an orphan's holder is never reported
  auto* slot = allocations_.find(h.id);
  if (!slot || slot->views == 0) return;
  holders_.hand_over(h.id, from, to);
  if (trace_.on()) [[unlikely]]
    trace_.view(TraceKind::ViewHandedOn, h, to);
}

[[gnu::noinline, gnu::cold]] void BridgeCore::finish_release_out_of_line(std::uint32_t index) noexcept {
  maybe_finish_release(index);
}

bool BridgeCore::share_view(const DeviceHandle& h) {
  SpinLockHold lock(lock_);
  std::uint32_t* views = nullptr;  // the count the shared lease is on: the slot's, or its orphan's
  if (h.generation == generation_ && !gate_.closed()) {
    const auto index = id_slot(h.id);
    // The lease being shared keeps the slot's views above 0; a restart while
    // the lock is dropped below makes an orphan of it instead.
    const auto leased = [&]() -> AllocationSlot* {
      auto& slot = allocations_[index];
      return slot.in_use && slot.version == id_version(h.id) && slot.views > 0 ? &slot : nullptr;
    };
    if (const auto* slot = leased(); slot && slot->uploads != 0) {
      refuse_waiting_for_own_write(h);
      wait_until(lock, std::chrono::steady_clock::time_point::max(), [&] {
        const auto* now = leased();
        return now == nullptr || now->uploads == 0;
      });
    }
    if (auto* slot = leased()) views = &slot->views;
  }
  if (!views)
    if (auto* orphan = allocations_.find_orphan({h.generation, h.id}); orphan && orphan->views > 0)
      views = &orphan->views;
  if (!views) return false;
  ++*views;
  ++outstanding_leases_;
  if (trace_.on()) [[unlikely]]
    trace_.view(TraceKind::ViewBegin, h, ViewHolder::Caller);
  return true;
}

[[gnu::noinline, gnu::cold]] void BridgeCore::end_orphaned_view(const DeviceHandle& h) noexcept {
  bool last;
  {
    std::lock_guard guard(lock_, std::adopt_lock);
    if (trace_.on()) [[unlikely]]
      trace_.view(TraceKind::ViewEnd, h, ViewHolder::Caller);
    if (!drops_.empty()) reap_fences();
    const AllocationTable::OrphanKey key{h.generation, h.id};
    if (auto* orphan = allocations_.find_orphan(key)) {
      --orphan->views;
      maybe_free_orphan(key, *orphan);
    } else if (h.generation == generation_) {
      // Closed, but its quiesce failed: the allocation is still in the
      // table, and a retried close must see this lease gone.
      const auto index = id_slot(h.id);
      auto& slot = allocations_[index];
      if (slot.in_use && slot.version == id_version(h.id) && slot.views > 0) --slot.views;
    }
    last = !owner_alive_ && outstanding_leases_ == 0;
  }
  if (last) delete this;
}

}  // namespace devbridge::detail
