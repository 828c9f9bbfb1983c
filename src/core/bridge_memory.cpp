// The bridge core's memory: allocation through the caching pool or the backend,
// retrying once out of memory, and the memory statistics (bridge_core.hpp).
#include "core/bridge_core.hpp"

namespace devbridge::detail {

void BridgeCore::maybe_free_orphan(const AllocationTable::OrphanKey& key, Orphan& o) noexcept {
  if (o.used()) return;
  if (o.adopted_region || o.abandoned) {
    if (o.adopted_region && !o.abandoned) end_adoption(o.device, o.adopted_region - 1);
    allocations_.erase_orphan(key);
    return;
  }
  const DeviceAllocation device = o.device;
  const std::uint64_t alignment = o.alignment;
  const FreedMemory freed{key.first, key.second, device.bytes, device.address, false};
  // Gone from the orphans first, and recorded once the memory went where it
  // goes (keep_or_free_later): the free's counters count it cached, or no
  // longer reserved.
  allocations_.erase_orphan({key.first, key.second});
  if (const auto whole = keep_or_free_later(device, alignment, trace_.on() ? &freed : nullptr))
    backend_->free(*whole);
  // After close, nothing allocates again: what the orphan left cached goes too.
  if (gate_.closed() && !gate_.restarting()) free_cache_now();
}

[[gnu::noinline]] void BridgeCore::free_slot(std::uint32_t index) {
  auto& slot = allocations_[index];
  if (slot.adopted_region) return end_adopted_slot(index);
  const DeviceAllocation device = slot.device;
  allocations_.retire(index);
  const auto whole = __builtin_expect(trace_.on(), 0) ? keep_or_free_recorded(index)
                                                                : keep_or_free_later(device, slot.spec.alignment);
  if (whole) backend_->free(*whole);
}

[[gnu::noinline]] std::optional<DeviceAllocation> BridgeCore::give_back_to_pool(std::uint32_t index) {
  auto& slot = allocations_[index];
  const DeviceAllocation device = slot.device;
  allocations_.retire(index);
  if (trace_.on()) [[unlikely]]
    return keep_or_free_recorded(index);
  return keep_or_free_later(device, slot.spec.alignment);
}

[[gnu::noinline, gnu::cold]] std::optional<DeviceAllocation> BridgeCore::keep_or_free_recorded(
    std::uint32_t index) noexcept {
  // The slot just retired keeps its fields until it is used again.
  const auto& slot = allocations_[index];
  const FreedMemory freed = trace_.freed_of(index);
  return keep_or_free_later(slot.device, slot.spec.alignment, &freed);
}

[[gnu::noinline]] DeviceHandle BridgeCore::alloc_through_pool(const ObjectSpec& spec, std::uint32_t elem,
                                                              DType view_dtype, std::uint64_t extent) {
  const std::uint64_t class_bytes = DevicePool::size_class(extent);
  std::vector<DeviceAllocation> surplus;  // free segments past the cap's room for the new one
  {
    SpinLockHold lock(lock_);
    enter(lock);
    allocations_.note_pool_request(extent);
    const auto splits = pool_->splits_made();
    const auto part = call_backend([&] { return pool_->take(*backend_, class_bytes, spec.alignment); });
    allocations_.count_cache_lookup(part.has_value());
    if (trace_.on()) [[unlikely]]
      trace_.pool_take(part ? TraceKind::PoolHit : TraceKind::PoolMiss, class_bytes, part ? part->bytes : 0,
                      pool_->splits_made() != splits);
    if (part) return add_allocation(lock, spec, elem, view_dtype, extent, *part);
    surplus = take_free_segments(pool_->keep_for(pool_->segment_bytes(class_bytes)));
  }
  for (const auto& segment : surplus) backend_->free(segment);
  // The pool's shape never changes after construction: read unlocked.
  const DeviceAllocation segment =
      allocate(pool_->segment_bytes(class_bytes), extent, pool_->segment_alignment(spec.alignment));
  SpinLockHold lock(lock_);
  enter_or_free(lock, segment);
  allocations_.count_segment(segment.bytes);
  // If the part cannot be made, the segment stays cached for the next request.
  const auto splits = pool_->splits_made();
  const DeviceAllocation part =
      call_backend([&] { return pool_->take_from_new(*backend_, segment, spec.alignment, class_bytes); });
  allocations_.note_reserved(*pool_);
  if (trace_.on() && pool_->splits_made() != splits) [[unlikely]]
    trace_.pool_take(TraceKind::PoolSplit, class_bytes, part.bytes, false);
  return add_allocation(lock, spec, elem, view_dtype, extent, part);
}

[[gnu::noinline, gnu::cold]] DeviceAllocation BridgeCore::allocate_after_refusal(const Error& refusal,
                                                                                 std::uint64_t asked,
                                                                                 std::uint64_t extent,
                                                                                 std::uint64_t alignment) {
  if (refusal.fatal()) {
    SpinLockHold lock(lock_);
    mark_broken(refusal);
  }
  if (refusal.kind() != ErrorKind::AllocationFailed || refusal.fatal()) throw refusal;
  if (asked != extent)
    if (auto device = try_allocate(extent, alignment)) return *device;
  const auto held = reclaim_for_retry();
  try {
    return allocate_or_break(extent, alignment);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::AllocationFailed) throw;
    {
      SpinLockHold lock(lock_);
      allocations_.count_oom_failure();
    }
    // Fragmentation: how much of the cache no request as large as the
    // largest free block could use (0 when nothing was cached).
    const std::string fragmentation =
        held.cached == 0
            ? std::string("fragmentation 0%: nothing was cached")
            : fmt::format("fragmentation {:.1f}% = 1 - {} / {}",
                          100.0 * (1.0 - static_cast<double>(held.largest) / static_cast<double>(held.cached)),
                          held.largest, held.cached);
    std::string dumped;
    {
      SpinLockHold lock(lock_);
      if (trace_.on() && !trace_.recording()->options().oom_dump_dir.empty()) {
        lock.unlock();
        dumped = dump_for_oom();
      }
    }
    fail(ErrorKind::AllocationFailed,
         "{}; retried once after releasing every cached block: before that, the bridge held {} bytes in live "
         "allocations{} and {} cached (the largest cached block {} bytes; {}) for a request of {} bytes; the largest "
         "holders: {}{}",
         e.message(), held.in_use,
         held.orphaned ? fmt::format(", {} kept from before a restart or close by views or fences", held.orphaned)
                       : std::string(),
         held.cached, held.largest, fragmentation, extent,
         held.holders.empty() ? "none (no live allocation)" : held.holders, dumped);
  }
}

std::optional<DeviceAllocation> BridgeCore::try_allocate(std::uint64_t bytes, std::uint64_t alignment) {
  try {
    return allocate_or_break(bytes, alignment);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::AllocationFailed && !e.fatal()) return std::nullopt;
    throw;
  }
}

DeviceAllocation BridgeCore::allocate_or_break(std::uint64_t bytes, std::uint64_t alignment) {
  try {
    return backend_->allocate(bytes, alignment);
  } catch (const Error& e) {
    if (e.fatal()) {
      SpinLockHold lock(lock_);
      mark_broken(e);
    }
    throw;
  }
}

BridgeCore::Held BridgeCore::reclaim_for_retry() {
  SpinLockHold lock(lock_);
  enter(lock);
  allocations_.count_oom_retry();
  try {
    drain_locked();  // a completion may end the last use of a released allocation
  } catch (const std::exception& e) {
    log().warn("devbridge: draining completions before retrying an allocation failed: {}", e.what());
  }
  if (!drops_.empty()) reap_fences();
  if (trace_.on()) [[unlikely]]
    trace_.memory(TraceKind::OomRetry, generation_, 0, 0);
  Held held{allocations_.allocated_bytes(), pool_ ? pool_->cached_bytes() : 0, pool_ ? pool_->largest_block() : 0,
            allocations_.orphaned_bytes(), {}};
  try {
    held.holders = top_holders_text(5);
  } catch (...) {
    // Only the message loses its detail.
  }
  give_back_cache(lock);
  return held;
}

void BridgeCore::give_back_cache(SpinLockHold& lock) {
  const auto segments = take_free_segments();
  if (segments.empty()) return;
  lock.unlock();
  for (const auto& segment : segments) backend_->free(segment);
  lock.lock();
}

std::vector<DeviceAllocation> BridgeCore::take_free_segments(std::uint64_t down_to) noexcept {
  if (!pool_ || pool_->free_segment_bytes() <= down_to) return {};
  auto segments = pool_->release_free_segments(down_to);
  allocations_.count_backend_frees(segments.size());
  if (trace_.on()) [[unlikely]] {
    std::uint64_t bytes = 0;
    for (const auto& segment : segments) bytes += segment.bytes;
    trace_.memory(TraceKind::PoolGiveBack, generation_, 0, bytes);
  }
  return segments;
}

std::optional<DeviceAllocation> BridgeCore::keep_or_free_later(const DeviceAllocation& device,
                                                               std::uint64_t alignment,
                                                               const FreedMemory* freed) noexcept {
  std::optional<DeviceAllocation> whole = device;
  if (pool_) {
    try {
      const auto coalesces = pool_->coalesces();
      whole = pool_->give_back(*backend_, device, alignment);
      if (trace_.on()) [[unlikely]]
        trace_.given_back(freed, device.bytes, pool_->coalesces() != coalesces, whole);
    } catch (const std::exception& e) {
      // The pool could not take it back: the memory stays allocated (never
      // freed under a part still handed out), lost to reuse.
      log().error("devbridge: the caching pool could not take back {} bytes at {:#x}: {}", device.bytes,
                  device.address, e.what());
      if (freed) [[unlikely]]
        trace_.given_back(freed, device.bytes, false, std::nullopt);  // the allocation ended all the same
      return std::nullopt;
    }
  } else if (freed) [[unlikely]] {
    trace_.given_back(freed, device.bytes, false, std::nullopt);
  }
  if (whole) allocations_.count_backend_frees(1);
  return whole;
}

void BridgeCore::free_cache_now() noexcept {
  for (const auto& segment : take_free_segments()) backend_->free(segment);
}

void BridgeCore::empty_cache() {
  SpinLockHold lock(lock_);
  enter(lock);
  give_back_cache(lock);
}

void BridgeCore::reset_peak_memory() {
  std::lock_guard guard(lock_);
  allocations_.reset_peaks(pool_ ? &*pool_ : nullptr);
}

MemoryStats BridgeCore::memory_stats() {
  std::lock_guard guard(lock_);
  MemoryStats m;
  allocations_.fill(m, pool_ ? &*pool_ : nullptr);
  return m;
}

}  // namespace devbridge::detail
