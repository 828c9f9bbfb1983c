// The bridge's state machine. One lock guards all bookkeeping; backend work
// that can block (sync copies, compute, quiesce) runs outside it, with the
// allocation and ring range pinned so nothing is freed underneath.
#include "devbridge/bridge.hpp"

#include <algorithm>
#include <array>
#include <bitset>
#include <bit>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>
#include "core/allocation_table.hpp"
#include "core/describe.hpp"
#include "core/copy_timeline.hpp"
#include "core/device_pool.hpp"
#include "core/drop_queue.hpp"
#include "core/fail.hpp"
#include "core/host_ring.hpp"
#include "core/log.hpp"
#include "core/region_registry.hpp"
#include "core/release_after.hpp"
#include "core/slot_table.hpp"
#include "core/spin_lock.hpp"
#include "core/view_leases.hpp"
#include "devbridge/checked.hpp"
#include "devbridge/consumer_names.hpp"

namespace devbridge {

namespace {

using detail::describe;

std::atomic<std::uint64_t> g_next_domain{1};

ErrorKind copy_failure_kind(CopyDirection direction) {
  return direction == CopyDirection::HostToDevice ? ErrorKind::DeviceCopyFailed : ErrorKind::OutputCopyFailed;
}

// Backends may report a copy failure generically; the contract names it by
// direction. Other kinds pass through.
ErrorKind directed_kind(CopyDirection direction, ErrorKind kind) {
  const bool copy_kind = kind == ErrorKind::DeviceCopyFailed || kind == ErrorKind::OutputCopyFailed;
  return copy_kind ? copy_failure_kind(direction) : kind;
}

}  // namespace

namespace detail {

class BridgeCore {
 public:
  BridgeCore(std::unique_ptr<Backend> backend, const BridgeOptions& options)
      : backend_(std::move(backend)),
        domain_(g_next_domain.fetch_add(1)),
        generation_(options.generation),
        copies_(domain_, options.inflight_budget_bytes ? options.inflight_budget_bytes : options.ring_bytes,
                options.failed_record_limit),
        regions_(domain_) {
    if (!backend_) throw Error(ErrorKind::Unavailable, "bridge constructed without a backend");
    if (options.ring_bytes == 0) throw Error(ErrorKind::InvalidExtent, "ring_bytes must be non-zero");
    if (options.failed_record_limit == 0)
      throw Error(ErrorKind::InvalidExtent, "failed_record_limit must be at least 1");
    if (options.close_fence_timeout.count() < 0)
      throw Error(ErrorKind::InvalidRange,
                  fmt::format("close_fence_timeout of {} ns is negative", options.close_fence_timeout.count()));
    if (options.writes_under_view_timeout.count() < 0)
      throw Error(ErrorKind::InvalidRange, fmt::format("writes_under_view_timeout of {} ns is negative",
                                                       options.writes_under_view_timeout.count()));
    const auto info = backend_->describe();
    for (DType dtype : info.dtypes) element_sizes_[static_cast<std::uint8_t>(dtype)] = dtype_size(dtype);
    // Holding is not computing (docs/DECISIONS.md): launch_axpy asks the second.
    for (DType dtype : info.computed_dtypes()) computed_.set(static_cast<std::uint8_t>(dtype));
    device_text_ = fmt::format("{} device {} ({})", info.name, info.device_id.empty() ? "0" : info.device_id,
                               info.device_name);
    device_string_ = tinygrad_device(info.device_kind, info.device_ordinal);
    placement_ = ViewPlacement{device_string_, static_cast<int>(dlpack_device(info.device_kind)), info.device_ordinal};
    writes_under_view_ = options.writes_under_view;
    writes_under_view_timeout_ = options.writes_under_view_timeout;
    close_fence_timeout_ = options.close_fence_timeout;
    if (options.caching_pool == CachingPool::On ||
        (options.caching_pool == CachingPool::BackendDefault && backend_->caches_allocations()))
      pool_.emplace(options.pool_cap_bytes.value_or(info.pool_cap_bytes), backend_->part_alignment());
    // Last: nothing after it may throw, or the ring would leak.
    ring_ = HostRing(backend_->allocate_host(options.ring_bytes));
  }

  // The last lease of a closed bridge ends here: fences a lease left behind
  // (ViewLease::end_after) are waited for, bounded, before the backend goes.
  ~BridgeCore() {
    SpinLockHold lock(lock_);
    settle_fences(lock, "the bridge's last lease ended");
    free_cache_now();
  }

  // ---- lifetime of the core itself ----
  void detach_owner() noexcept {
    try {
      close();
    } catch (const std::exception& e) {
      log().error("devbridge: closing the bridge failed: {}", e.what());
    }
    bool last;
    {
      std::lock_guard guard(lock_);
      // Closed even if close() failed half way: leases ending from now on
      // take end_orphaned_view, the one that may delete the core.
      set_state(kClosed, true);
      owner_alive_ = false;
      last = outstanding_leases_ == 0;
    }
    if (last) delete this;
  }

  // ---- state checks ----
  void check_usable() const {
    if (closed()) throw Error(ErrorKind::Closed, "the bridge is closed");
    if (broken())
      fail(ErrorKind::Broken, "the bridge is broken ({}); restart it to recover", broken_reason_);
  }

  // Entry of every call that touches state: waits out a restart in progress.
  // The holder is not passed on: a noinline callee taking it would keep its
  // held flag in memory on every call. The wait leaves the lock held.
  void enter(SpinLockHold&) {
    if (__builtin_expect(state_ != 0, 0)) enter_slow();
  }
  [[gnu::noinline]] void enter_slow() {
    // A close refuses at once, even while it is still quiescing.
    block_while(lock_, [&] { return restarting() && !closed(); });
    if (fences_pending() && !restarting() && !closed()) reap_fences();
    check_usable();
  }

  // Sleeps on the condition variable while `busy()` holds; notify() wakes
  // sleepers only when there are some, so the hot paths never pay for it.
  template <class Lock, class Busy>
  void block_while(Lock& lock, Busy busy) {
    while (busy()) {
      ++waiters_;
      cv_.wait(lock);
      --waiters_;
    }
  }

  void notify() {
    if (waiters_) cv_.notify_all();
  }

  void mark_broken(const Error& error) {
    if (!broken()) {
      set_state(kBroken, true);
      broken_reason_ = std::string(error.what());
      log().error("devbridge: bridge (domain {}) is broken: {}", domain_, broken_reason_);
    }
  }

  // An orphan goes when nothing uses it; an abandoned one is forgotten, not
  // freed.
  void maybe_free_orphan(const AllocationTable::OrphanKey& key, Orphan& o) noexcept {
    if (o.used()) return;
    if (o.adopted_region) {
      if (!o.abandoned) end_adoption(o.device, o.adopted_region - 1);
    } else if (!o.abandoned) {
      if (const auto whole = keep_or_free_later(o.device, o.alignment)) backend_->free(*whole);
      // After close, nothing allocates again: what the orphan left cached goes too.
      if (closed() && !restarting()) free_cache_now();
    }
    allocations_.erase_orphan(key);
  }

  // ---- the drop queue ----
  // Ends every fenced use whose fence passed; frees what that leaves unused.
  // Any call that enters the bridge runs it while fences are pending.
  void reap_fences() noexcept {
    drops_.reap(
        *backend_, [&](const DropQueue::Entry& entry) { end_fenced_uses(entry); },
        [&](const Error& e) {
          if (e.fatal()) mark_broken(e);
          log().error("devbridge: testing a fence failed (the memory it holds stays allocated): {}", e.what());
        });
    set_state(kFencesPending, !drops_.empty());
  }

  void end_fenced_uses(const DropQueue::Entry& entry) noexcept {
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

  void add_fenced_uses(DropQueue::Entry&& entry) noexcept {
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
    set_state(kFencesPending, true);
  }

  // Holds the entry's allocations until a fence recorded now on its
  // consumer's queue passes. Throws, changing nothing, when the backend
  // cannot record one.
  void hold_until_consumer_fence(DropQueue::Entry&& held) {
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

  // Waits, outside the lock and for at most close_fence_timeout, for the
  // fences still pending (close, or the core's end); memory whose fence
  // does not pass in time is abandoned, never freed: the device may still
  // read it.
  template <class Lock>
  void settle_fences(Lock& lock, const char* when) noexcept {
    reap_fences();
    if (drops_.empty()) return;
    auto pending = drops_.take_all();
    set_state(kFencesPending, false);
    const auto deadline = checked::deadline_after(close_fence_timeout_);
    lock.unlock();
    std::vector<bool> passed(pending.size(), false);
    for (std::size_t i = 0; i < pending.size(); ++i) {
      const auto now = checked::Clock::now();
      const auto left = deadline > now ? std::chrono::nanoseconds(deadline - now) : std::chrono::nanoseconds(0);
      try {
        passed[i] = backend_->wait_fence(pending[i].fence, left);
      } catch (const std::exception& e) {
        log().error("devbridge: waiting for a fence failed: {}", e.what());
      }
    }
    lock.lock();
    for (std::size_t i = 0; i < pending.size(); ++i) {
      if (passed[i]) {
        end_fenced_uses(pending[i]);
      } else {
        abandon(pending[i], when);
      }
      backend_->release_fence(pending[i].fence);
    }
  }

  void abandon(const DropQueue::Entry& entry, const char* when) noexcept {
    ++abandoned_fences_;
    std::uint64_t bytes = 0;
    for (const auto id : entry.allocation_ids) {
      const AllocationTable::OrphanKey key{entry.generation, id};
      if (auto* orphan = allocations_.find_orphan(key)) {
        orphan->abandoned = true;
        bytes += orphan->device.bytes;
        --orphan->fences;
        maybe_free_orphan(key, *orphan);
      }
    }
    log().error("devbridge: {}, but a fence on {} had not passed after {} ns: the {} bytes it holds stay "
                "allocated for good (the device may still read them); {} fences abandoned so far",
                when, queue_text(entry.where), close_fence_timeout_.count(), bytes, abandoned_fences_);
  }

  static std::string queue_text(const QueueRef& where) {
    switch (where.queue) {
      case Queue::CopyUp: return "the upload queue";
      case Queue::CopyDown: return "the download queue";
      case Queue::Compute: return "the compute queue";
      case Queue::Consumer: break;
    }
    return fmt::format("consumer queue {:#x}", where.consumer);
  }

  // ---- handles ----
  // A handle or copy event of this bridge's domain and current generation.
  template <class Tagged>
  [[gnu::always_inline]] void check_tag(const Tagged& tagged) const {
    if (__builtin_expect(tagged.domain != domain_ || tagged.generation != generation_, 0)) fail_tag(tagged);
  }
  template <class Tagged>
  [[noreturn, gnu::cold, gnu::noinline]] void fail_tag(const Tagged& tagged) const {
    if (tagged.domain != domain_)
      fail(ErrorKind::ForeignDomain, "{} belongs to domain {}, this bridge is domain {}", describe(tagged),
           tagged.domain, domain_);
    if (tagged.generation < generation_)
      fail(ErrorKind::OldGenerationHandle, "{} is from generation {}, the bridge is at generation {}", describe(tagged),
           tagged.generation, generation_);
    fail(ErrorKind::UnknownDeviceHandle, "{} names generation {}, newer than the bridge's {}", describe(tagged),
         tagged.generation, generation_);
  }

  [[gnu::always_inline]] AllocationSlot& allocation(const DeviceHandle& h) {
    check_tag(h);
    return allocations_.live(h);
  }

  // Frees a released allocation once nothing uses it any more.
  [[gnu::always_inline]] void maybe_finish_release(std::uint32_t index) {
    auto& slot = allocations_[index];
    if (__builtin_expect(slot.released, 0) && slot.in_use && !slot.used()) free_slot(index);
  }

  // Out of line: every path that ends a use (a copy's unpin above all) tests
  // for a release, and only a released allocation's last use frees.
  [[gnu::noinline]] void free_slot(std::uint32_t index) {
    auto& slot = allocations_[index];
    if (slot.adopted_region) return end_adopted_slot(index);
    const DeviceAllocation device = slot.device;
    allocations_.retire(index);
    if (const auto whole = keep_or_free_later(device, slot.spec.alignment)) backend_->free(*whole);
  }

  // A backend call made under the lock; a fatal failure breaks the bridge.
  template <class Call>
  [[gnu::always_inline]] decltype(auto) call_backend(Call call) {
    try {
      return call();
    } catch (const Error& e) {
      if (e.fatal()) mark_broken(e);
      throw;
    }
  }

  // ---- registered host memory ----
  // The live region of this generation `r` names.
  std::uint32_t region_index(const HostRegion& r) {
    check_tag(r);
    return regions_.live_index(r);
  }

  // The live region a non-empty range lies in.
  std::uint32_t region_range_index(const RegionRange& range) {
    check_tag(range.region);
    return regions_.range_index(range);
  }

  HostRegion register_host(std::span<std::byte> bytes, bool read_only, Bridge::RegionRelease on_release) {
    if (bytes.empty()) fail(ErrorKind::InvalidExtent, "registering host memory of 0 bytes");
    const auto begin = reinterpret_cast<std::uintptr_t>(bytes.data());
    if (!bytes.data() || !checked::add(begin, bytes.size()))
      fail(ErrorKind::InvalidRange, "host memory at {:#x} of {} bytes is not an address range", begin, bytes.size());
    SpinLockHold lock(lock_);
    enter(lock);
    if (RegionRegistry::overlaps(begin, bytes.size(), ring_.block()))
      fail(ErrorKind::InvalidRange, "host memory [{:#x}, +{}) overlaps the bridge's own ring; stage through it instead",
           begin, bytes.size());
    const auto index = regions_.begin_register(bytes, read_only, generation_, std::move(on_release));
    HostBlock registered;
    auto failure = run_unlocked(lock, [&] {
      registered = read_only ? backend_->register_host_read_only(bytes.data(), bytes.size())
                             : backend_->register_host(bytes.data(), bytes.size());
    });
    if (failure) {
      regions_.cancel_register(index);
      if (failure->fatal()) mark_broken(*failure);
      throw *failure;
    }
    return regions_.finish_register(index, registered);
  }

  void unregister_host(const HostRegion& r) {
    SpinLockHold lock(lock_);
    enter(lock);
    check_tag(r);
    const HostBlock block = regions_.begin_unregister(r);
    run_unlocked(lock, [&] { backend_->unregister_host(block); });
    regions_.finish_unregister(id_slot(r.id));
  }

  std::span<std::byte> region_bytes(const HostRegion& r) {
    SpinLockHold lock(lock_);
    enter(lock);
    const auto& block = regions_[region_index(r)].block;
    return {block.data, block.bytes};
  }

  // ---- host memory adopted in place ----
  DeviceHandle adopt_host(const RegionRange& range, const ObjectSpec& spec) {
    const auto [elem, view_dtype] = checked_allocation(spec, range.len);
    SpinLockHold lock(lock_);
    enter(lock);
    const auto index = region_range_index(range);
    auto& region = regions_[index];
    if (!region.read_only)
      fail(ErrorKind::InvalidRange,
           "adopting {}: only a region registered read-only (register_host_read_only) can be adopted; a writable one "
           "could be a copy's source and destination at once",
           describe(range));
    const auto address = reinterpret_cast<std::uintptr_t>(region.block.data) + range.offset;
    if (address & (spec.alignment - 1))
      fail(ErrorKind::InvalidAlignment, "adopting {}: its first byte at {:#x} is not aligned to the spec's {} bytes",
           describe(range), address, spec.alignment);
    const auto slot_index = allocations_.acquire();  // before the backend: it may throw
    DeviceAllocation device;
    try {
      device = call_backend([&] { return backend_->adopt_host(region.block, range.offset, range.len); });
    } catch (...) {
      allocations_.unissue(slot_index);
      throw;
    }
    const auto id = allocations_.start_adopted(slot_index, spec, elem, view_dtype, range.len, device, index);
    regions_.add_adoption(index);
    return DeviceHandle{domain_, generation_, id};
  }

  bool region_retained(const HostRegion& r) noexcept {
    std::lock_guard guard(lock_);
    return regions_.registered(r, generation_, released_at_close_);
  }

  // Out of line: free_device and release inline their free path, and only
  // adopted memory comes here.
  [[gnu::noinline, gnu::cold]] void end_adopted_slot(std::uint32_t index) noexcept {
    const DeviceAllocation device = allocations_[index].device;
    const std::uint32_t region = allocations_[index].adopted_region - 1;
    allocations_.retire(index);
    end_adoption(device, region);
  }

  // The last use of an adopted allocation ended: back to its region, which
  // goes too if it was retained only for it.
  void end_adoption(const DeviceAllocation& device, std::uint32_t region) noexcept {
    backend_->release_adopted(device);
    regions_.end_adoption(region, [&](const HostBlock& block) { backend_->unregister_host(block); });
  }

  // ---- allocation ----

  // The element size and view dtype of an allocation of `extent` bytes of
  // `spec`, once both are valid. Needs no state: runs before the lock.
  [[gnu::always_inline]] std::pair<std::uint32_t, DType> checked_allocation(const ObjectSpec& spec,
                                                                            std::uint64_t extent) const {
    if (!is_power_of_two(spec.alignment))
      fail(ErrorKind::InvalidAlignment, "alignment {} is not a non-zero power of two", spec.alignment);
    // 0 for a dtype the device does not hold (or no dtype at all): the
    // extent check below then fails, and its cold path tells which.
    const std::uint32_t elem = spec.dtype ? element_sizes_[static_cast<std::uint8_t>(*spec.dtype)] : 1;
    const DType view_dtype = spec.dtype.value_or(DType::UInt8);
    if (extent == 0 || extent > spec.max_extent || (extent & (spec.alignment - 1)) || (extent & (elem - 1))) {
      if (elem == 0 && dtype_size(*spec.dtype) != 0) fail_unsupported_dtype(*spec.dtype, "an allocation");
      fail(ErrorKind::InvalidExtent,
           "extent {} must be non-zero, at most max_extent {}, and a multiple of the alignment {} "
           "and of the {} size {}",
           extent, spec.max_extent, spec.alignment, spec_dtype_name(spec), elem);
    }
    return {elem, view_dtype};
  }

  DeviceHandle alloc_device(const ObjectSpec& spec, std::uint64_t extent) {
    const auto [elem, view_dtype] = checked_allocation(spec, extent);
    if (pool_) return alloc_through_pool(spec, elem, view_dtype, extent);
    if (__builtin_expect(state_seen_.load(std::memory_order_relaxed) & (kClosed | kBroken), 0)) {
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

  // The backend's allocation of `asked` bytes for a request of `extent`
  // (returned in place: no copy on alloc_device's path).
  [[gnu::always_inline]] DeviceAllocation allocate(std::uint64_t asked, std::uint64_t extent,
                                                   std::uint64_t alignment) {
    try {
      return backend_->allocate(asked, alignment);
    } catch (const Error& e) {
      return allocate_after_refusal(e, asked, extent, alignment);
    }
  }

  // alloc_device with the caching pool on: a part of a free span that fits
  // the request's size class, else of a new segment from the backend.
  [[gnu::noinline]] DeviceHandle alloc_through_pool(const ObjectSpec& spec, std::uint32_t elem, DType view_dtype,
                                                    std::uint64_t extent) {
    const std::uint64_t class_bytes = DevicePool::size_class(extent);
    {
      SpinLockHold lock(lock_);
      enter(lock);
      allocations_.note_pool_request(extent);
      const auto part = call_backend([&] { return pool_->take(*backend_, class_bytes, spec.alignment); });
      allocations_.count_cache_lookup(part.has_value());
      if (part) return add_allocation(lock, spec, elem, view_dtype, extent, *part);
    }
    // The pool's shape never changes after construction: read unlocked.
    const DeviceAllocation segment =
        allocate(pool_->segment_bytes(class_bytes), extent, pool_->segment_alignment(spec.alignment));
    SpinLockHold lock(lock_);
    enter_or_free(lock, segment);
    allocations_.count_segment(segment.bytes);
    // If the part cannot be made, the segment stays cached for the next request.
    const DeviceAllocation part =
        call_backend([&] { return pool_->take_from_new(*backend_, segment, spec.alignment, class_bytes); });
    allocations_.note_reserved(*pool_);
    return add_allocation(lock, spec, elem, view_dtype, extent, part);
  }

  // enter(), giving the memory back to the backend if the bridge refuses.
  void enter_or_free(SpinLockHold& lock, const DeviceAllocation& device) {
    try {
      enter(lock);
    } catch (...) {
      lock.unlock();
      backend_->free(device);
      throw;
    }
  }

  // A new slot for memory the caller got (from the pool or the backend);
  // on failure the memory goes back where it came from... or to the backend,
  // which is where all memory ends up.
  DeviceHandle add_allocation(SpinLockHold& lock, const ObjectSpec& spec, std::uint32_t elem, DType view_dtype,
                              std::uint64_t extent, const DeviceAllocation& device) {
    std::uint32_t index;
    try {
      index = allocations_.acquire();
    } catch (...) {
      const auto whole = keep_or_free_later(device, spec.alignment);
      lock.unlock();
      if (whole) backend_->free(*whole);
      throw;
    }
    return DeviceHandle{domain_, generation_, allocations_.start(index, spec, elem, view_dtype, extent, device)};
  }

  // ---- memory: the pool and the backend ----
  // The backend refused `asked` bytes (the request's `extent`, or its size
  // class): a fatal error breaks the bridge; out of memory, the exact size is
  // tried (a size class may be past a per-buffer limit), then the bridge
  // reclaims what it can (completions that end last uses, passed fences, the
  // whole cache) and retries once, and the final error says what it held.
  [[gnu::noinline, gnu::cold]] DeviceAllocation allocate_after_refusal(const Error& refusal, std::uint64_t asked,
                                                                       std::uint64_t extent, std::uint64_t alignment) {
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
      fail(ErrorKind::AllocationFailed,
           "{}; retried once after releasing every cached block: the bridge held {} bytes in live allocations and {} "
           "cached (the largest cached block {} bytes) for a request of {} bytes",
           e.message(), held.in_use, held.cached, held.largest, extent);
    }
  }

  // The allocation, or nothing when the backend is out of memory.
  std::optional<DeviceAllocation> try_allocate(std::uint64_t bytes, std::uint64_t alignment) {
    try {
      return allocate_or_break(bytes, alignment);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::AllocationFailed && !e.fatal()) return std::nullopt;
      throw;
    }
  }

  DeviceAllocation allocate_or_break(std::uint64_t bytes, std::uint64_t alignment) {
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

  struct Held {
    std::uint64_t in_use = 0, cached = 0, largest = 0;
  };
  Held reclaim_for_retry() {
    SpinLockHold lock(lock_);
    enter(lock);
    allocations_.count_oom_retry();
    try {
      drain_locked();  // a completion may end the last use of a released allocation
    } catch (const std::exception& e) {
      log().warn("devbridge: draining completions before retrying an allocation failed: {}", e.what());
    }
    if (!drops_.empty()) reap_fences();
    const Held held{allocations_.allocated_bytes(), pool_ ? pool_->cached_bytes() : 0, pool_ ? pool_->largest_block() : 0};
    give_back_cache(lock);
    return held;
  }

  // Every cached block back to the backend; the frees run without the lock.
  void give_back_cache(SpinLockHold& lock) {
    const auto segments = take_free_segments();
    if (segments.empty()) return;
    lock.unlock();
    for (const auto& segment : segments) backend_->free(segment);
    lock.lock();
  }

  // Every wholly free segment, out of the pool and counted as freed; the
  // caller frees them in the backend.
  std::vector<DeviceAllocation> take_free_segments() noexcept {
    if (!pool_ || pool_->free_segments() == 0) return {};
    auto segments = pool_->release_free_segments();
    allocations_.count_backend_frees(segments.size());
    return segments;
  }

  // Memory no allocation uses any more: cached, or freed in the backend.
  // Under the lock; returns what the backend must still free (the memory,
  // or the pool's segment it was part of), which the caller frees now or
  // after unlocking.
  std::optional<DeviceAllocation> keep_or_free_later(const DeviceAllocation& device, std::uint64_t alignment) noexcept {
    std::optional<DeviceAllocation> whole = device;
    if (pool_) {
      try {
        whole = pool_->give_back(*backend_, device, alignment);
      } catch (const std::exception& e) {
        // The pool could not take it back: the memory stays allocated (never
        // freed under a part still handed out), lost to reuse.
        log().error("devbridge: the caching pool could not take back {} bytes at {:#x}: {}", device.bytes,
                    device.address, e.what());
        return std::nullopt;
      }
    }
    if (whole) allocations_.count_backend_frees(1);
    return whole;
  }

  // Under the lock, from inside a noexcept path: every whole free segment
  // back to the backend.
  void free_cache_now() noexcept {
    for (const auto& segment : take_free_segments()) backend_->free(segment);
  }

  void empty_cache() {
    SpinLockHold lock(lock_);
    enter(lock);
    give_back_cache(lock);
  }

  void reset_peak_memory() {
    std::lock_guard guard(lock_);
    allocations_.reset_peaks(pool_ ? &*pool_ : nullptr);
  }

  MemoryStats memory_stats() {
    std::lock_guard guard(lock_);
    MemoryStats m;
    allocations_.fill(m, pool_ ? &*pool_ : nullptr);
    return m;
  }

  std::string uses(const DeviceHandle& h, const AllocationSlot& slot) const {
    const std::uint32_t fenced = drops_.uses_of(h.generation, h.id);
    const std::uint32_t steps = slot.steps - std::min(slot.steps, fenced);
    std::string text = fmt::format("{} cop{} in flight, {} compute step{}, {}", slot.copies,
                                   slot.copies == 1 ? "y" : "ies", steps, steps == 1 ? "" : "s", views_text(h, slot));
    if (fenced)
      text += fmt::format(", {} use{} ending at a fence not yet passed (a launch, or a consumer's queue; release() "
                          "frees it once they pass)",
                          fenced, fenced == 1 ? "" : "s");
    return text;
  }

  std::string views_text(const DeviceHandle& h, const AllocationSlot& slot) const {
    return holders_.views_text(h.id, slot.views);
  }

  [[noreturn, gnu::cold, gnu::noinline]] void fail_write_under_view(const DeviceRange& range,
                                                                   const AllocationSlot& slot) const {
    fail(ErrorKind::AllocationStillInUse,
         "an upload into [offset {}, len {}] of {} would change bytes a view still reads (writes_under_view is "
         "\"{}): {}; end {} first, or choose writes_under_view \"wait\" or \"allow\"",
         range.offset, range.len, describe(range.handle),
         writes_under_view_ == WritesUnderView::Wait ? "wait\", and the wait timed out" : "refuse\"",
         views_text(range.handle, slot), slot.views == 1 ? "it" : "them");
  }

  [[noreturn, gnu::cold, gnu::noinline]] void fail_in_use(const DeviceHandle& h, const AllocationSlot& slot) const {
    fail(ErrorKind::AllocationStillInUse, "{} is still used: {}", describe(h), uses(h, slot));
  }

  [[gnu::always_inline]] void free_device(const DeviceHandle& h) {
    SpinLockHold lock(lock_);
    enter(lock);
    auto& slot = allocation(h);
    if (__builtin_expect(slot.used(), 0)) fail_in_use(h, slot);
    free_slot_then_unlock(lock, id_slot(h.id));
  }

  void release(const DeviceHandle& h) {
    SpinLockHold lock(lock_);
    enter(lock);
    auto& slot = allocation(h);
    slot.released = true;
    if (!slot.used()) free_slot_then_unlock(lock, id_slot(h.id));
  }

  // The backend's free runs after the lock is dropped: a driver free may
  // synchronize the device (cuMemFree does), and no other caller should spin
  // meanwhile. The slot is retired first, so nothing reaches the memory any
  // more. (Frees that the end of a last use triggers inside another call —
  // a completion, a lease ending — still run under the lock.)
  [[gnu::always_inline]] void free_slot_then_unlock(SpinLockHold& lock, std::uint32_t index) {
    auto& slot = allocations_[index];
    if (__builtin_expect(slot.adopted_region != 0, 0)) return end_adopted_slot(index);  // nothing the driver frees
    const DeviceAllocation device = slot.device;
    allocations_.retire(index);
    if (__builtin_expect(!pool_, 1)) {  // the common case: straight back to the backend
      allocations_.count_backend_frees(1);
      lock.unlock();
      backend_->free(device);
      return;
    }
    const auto whole = keep_or_free_later(device, slot.spec.alignment);
    lock.unlock();
    if (whole) backend_->free(*whole);
  }

  std::pair<ObjectSpec, std::uint64_t> spec_of(const DeviceHandle& h) {
    SpinLockHold lock(lock_);
    enter(lock);
    auto& slot = allocation(h);
    return {slot.spec, slot.extent};
  }

  // ---- ring ----
  HostRange reserve(std::uint64_t bytes, std::uint64_t alignment, std::chrono::nanoseconds timeout) {
    check_timeout(timeout, "reserve timeout");
    SpinLockHold lock(lock_);
    enter(lock);
    // Ranges handed to release_host_after whose copies are done go back first.
    if (__builtin_expect(!release_after_.empty(), 0)) drain_locked();
    if (__builtin_expect(timeout.count() == 0, 1)) return ring_.reserve(bytes, alignment);
    return reserve_waiting(lock, bytes, alignment, timeout);
  }
  // Room comes back only when a reservation is released (release_host
  // notifies): no completion or fence frees ring bytes, so the wait sleeps
  // on the condition variable rather than polling the backend. close()
  // notifies too, and enter() then refuses with Closed.
  [[gnu::noinline, gnu::cold]] HostRange reserve_waiting(SpinLockHold& lock, std::uint64_t bytes,
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
      ++waiters_;
      if (deadline == checked::Clock::time_point::max())
        cv_.wait(lock);
      else
        (void)cv_.wait_until(lock, deadline);
      --waiters_;
      enter(lock);
    }
  }
  // One slice of a wait for completions, then applies them (and so releases
  // the settled ranges of release_host_after).
  void wait_for_completion_slice(SpinLockHold& lock, checked::Clock::time_point deadline) {
    constexpr auto kSlice = std::chrono::milliseconds(2);
    const auto now = checked::Clock::now();
    lock.unlock();
    backend_->wait_for_completions(std::min<std::chrono::nanoseconds>(deadline - now, kSlice));
    lock.lock();
    enter(lock);
    drain_locked();
  }
  void release_host_after(HostRange range, const CopyEvent& event) {
    SpinLockHold lock(lock_);
    // Not enter(): a Broken bridge takes ranges too (its restart releases them).
    block_while(lock, [&] { return restarting() && !closed(); });
    check_not_closed();
    check_tag(event);
    bool done = copies_.state(event) != CopyState::Pending;  // UnknownDeviceHandle for an event never issued
    const auto key = ring_.exact(range, "release_host_after");
    if (release_after_.holds(key))
      fail(ErrorKind::InvalidRange, "host range [offset {}, len {}] is already waiting in release_host_after",
           range.offset, range.len);
    if (!done && !broken()) {
      drain_locked();  // its completion may be waiting in the backend
      done = settled(event);
    }
    if (done && ring_.release(key, range) == HostRing::KeyRelease::Released) {
      notify();
      return;
    }
    release_after_.add({range, key, event});
    notify();  // a reserve sleeping for room now waits on completions instead
  }
  bool settled(const CopyEvent& event) noexcept {
    try {
      return copies_.state(event) != CopyState::Pending;
    } catch (...) {
      return true;  // a forgotten failure: long settled
    }
  }
  void release_settled() noexcept {
    if (release_after_.release_settled(ring_, [&](const CopyEvent& e) { return settled(e); }) != 0) notify();
  }
  void release_host(HostRange range) {
    SpinLockHold lock(lock_);
    check_not_closed();
    ring_.release(range);
    notify();  // a reserve may be waiting for the room
  }
  std::span<std::byte> host_bytes(HostRange range) {
    SpinLockHold lock(lock_);
    check_not_closed();
    ring_.find(range);
    return {ring_.data(range), range.len};
  }
  void check_not_closed() const {
    if (closed()) throw Error(ErrorKind::Closed, "the bridge is closed");
  }
  std::span<std::byte> lease_host(HostRange range) {
    SpinLockHold lock(lock_);
    check_not_closed();
    ring_.find(range);
    ++host_leases_;
    ++outstanding_leases_;
    return {ring_.data(range), range.len};
  }
  // Ends a host lease; the ring block a close left behind goes with the last.
  void end_host_lease() noexcept {
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
  std::uint64_t ring_capacity() const noexcept { return ring_.capacity(); }
  std::uint64_t ring_free_bytes() {
    std::lock_guard guard(lock_);
    return ring_.free_bytes();
  }

  // ---- copies ----
  // Waits (draining completions itself, so no other thread need poll) until
  // `ready()` holds or the deadline passes. Called with the lock held.
  template <class Ready>
  bool wait_until(SpinLockHold& lock, std::chrono::steady_clock::time_point deadline, Ready ready) {
    constexpr auto kSlice = std::chrono::milliseconds(2);
    for (;;) {
      drain_locked();
      if (ready()) return true;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return false;
      lock.unlock();
      backend_->wait_for_completions(std::min<std::chrono::nanoseconds>(deadline - now, kSlice));
      lock.lock();
      enter(lock);
    }
  }

  // An upload into an allocation a view still reads, which the policy
  // guards, or into a read-only one (refused): the slow path sorts them out.
  bool guarded_write(const AllocationSlot& slot, CopyDirection direction) const noexcept {
    return (slot.views | slot.adopted_region) != 0 && direction == CopyDirection::HostToDevice &&
           (slot.adopted_region != 0 || writes_under_view_ != WritesUnderView::Allow);
  }

  [[noreturn, gnu::cold, gnu::noinline]] void fail_read_only(const DeviceRange& range, std::string_view what) const {
    fail(ErrorKind::InvalidRange,
         "{} [offset {}, len {}] of {}: it is read-only host memory adopted in place (adopt_host); allocate a "
         "tensor of its own to write into",
         what, range.offset, range.len, describe(range.handle));
  }

  // A write into `range` while views still read it: waits for them to end
  // where the options say so (writes_under_view "wait", until `deadline`,
  // set on the first call) and returns with the lock dropped and taken
  // again, so the caller checks everything again; otherwise, or once the
  // wait times out, refuses (AllocationStillInUse).
  void wait_out_views_or_fail(SpinLockHold& lock, const DeviceRange& range,
                              std::optional<checked::Clock::time_point>& deadline) {
    if (writes_under_view_ == WritesUnderView::Wait) {
      if (!deadline) deadline = checked::deadline_after(writes_under_view_timeout_);
      if (wait_until(lock, *deadline, [&] { return allocation(range.handle).views == 0; })) return;
    }
    fail_write_under_view(range, allocation(range.handle));
  }

  // Where a copy's host bytes are: a ring reservation's key, or a
  // registered region's slot with kRegionPin set (ring keys never reach it).
  static constexpr HostRing::Key kRegionPin = 1ull << 63;

  // The ring reservation holding `host` (validated), and its bytes.
  HostRing::Key locate_host(const HostRange& host, CopyDirection) const { return ring_.find(host); }
  std::byte* host_data(const HostRange& host, HostRing::Key) const noexcept { return ring_.data(host); }
  // The registered region holding `host` (validated), and its bytes.
  HostRing::Key locate_host(const RegionRange& host, CopyDirection direction) {
    const auto index = region_range_index(host);
    const auto& slot = regions_[index];
    if (slot.read_only && direction == CopyDirection::DeviceToHost)
      fail(ErrorKind::InvalidRange, "a download into {}: the region was registered read-only (uploads only)",
           describe(host));
    return kRegionPin | index;
  }
  std::byte* host_data(const RegionRange& host, HostRing::Key key) noexcept {
    return regions_[static_cast<std::uint32_t>(key)].block.data + host.offset;
  }

  // Bytes a copy moves; for a pitched one, after checking that its rows fit
  // both ranges and the allocation's element alignment.
  template <bool kPitched, class Host>
  std::uint64_t copy_bytes(const Host& host, const DeviceRange& device, const AllocationSlot& slot,
                           const CopyLayout& layout) const {
    if constexpr (!kPitched) {
      if (host.len != device.len)
        fail(ErrorKind::InvalidRange, "{} and device range of {} bytes differ in length", describe(host), device.len);
      return host.len;
    } else {
      if (!layout.pitched() || layout.row_bytes == 0)
        fail(ErrorKind::InvalidRange, "a pitched copy of {} rows of {} bytes moves nothing", layout.rows,
             layout.row_bytes);
      const auto host_span = layout_host_span(layout);
      const auto device_span = layout_device_span(layout);
      if (host_span > host.len)
        fail(ErrorKind::InvalidRange, "{} rows of {} bytes at a host pitch of {} reach {} bytes, past {}", layout.rows,
             layout.row_bytes, layout.host_pitch, host_span, describe(host));
      if (device_span > device.len)
        fail(ErrorKind::InvalidRange,
             "{} rows of {} bytes at a device pitch of {} reach {} bytes, past the device range [offset {}, len {}] "
             "of {}",
             layout.rows, layout.row_bytes, layout.device_pitch, device_span, device.offset, device.len,
             describe(device.handle));
      if ((layout.row_bytes | layout.device_pitch) & (slot.element_size - 1))
        fail(ErrorKind::InvalidRange, "rows of {} bytes at a device pitch of {} split the {} elements ({} bytes) of {}",
             layout.row_bytes, layout.device_pitch, spec_dtype_name(slot.spec), slot.element_size,
             describe(device.handle));
      return layout_bytes_moved(layout);
    }
  }

  // The slow half of a copy's admission: a write under live views, or no
  // room in the in-flight budget. Waits as the options and the admission
  // allow, then revalidates everything (the lock was dropped meanwhile).
  // Returns the allocation's slot and the host pin, since waiting may have
  // moved both, or throws; the caller's validation up to here is checked
  // again.
  // (Returned by value: locals of copy() whose address escaped would live in
  // memory on its fast path too.)
  struct Admitted {
    AllocationSlot* slot;
    HostRing::Key host_key;
  };
  template <class Host>
  [[gnu::noinline, gnu::cold]] Admitted admit(SpinLockHold& lock, CopyDirection direction, const Host& host,
                                              const DeviceRange& device, std::uint64_t bytes, CopyMode mode,
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

  // Every copy: between the ring or a registered region (Host) and an
  // allocation, of one contiguous run or (kPitched) of rows.
  template <bool kPitched = false, class Host>
  CopyEvent copy(CopyDirection direction, const Host& host, DeviceRange device, CopyMode mode, Admission admission,
                 const CopyLayout& layout = {}) {
    check_timeout(admission.wait_for_room, "wait_for_room");
    SpinLockHold lock(lock_);
    enter(lock);
    auto* slot = &allocation(device.handle);
    validate_device_range(device, *slot);
    const std::uint64_t bytes = copy_bytes<kPitched>(host, device, *slot, layout);
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
      return event;
    }

    // Sync: the copy itself runs unlocked; pins keep memory and range alive.
    // Its event is numbered only once it succeeded: a failed sync copy's
    // event is never handed out, so no id of it can read as Completed.
    pin(*slot, direction, host_key);
    const CopyEvent unnumbered{domain_, generation_, CopyTimeline::kSyncEventBit};
    const CopyRequest request{direction, mode,          unnumbered, host_data(host, host_key),
                              slot->device, device.offset, bytes,      layout};
    auto failure = run_unlocked(lock, [&] { backend_->submit_copy(request); });
    unpin(alloc_index, direction, host_key);
    if (failure) throw copy_error(direction, *failure);
    return CopyEvent{domain_, generation_, copies_.complete_sync()};
  }

  // ---- device to device, between bridges ----
  // One side of a peer copy, validated and held: counted as a copy of the
  // allocation (free_device refuses, release defers) and as a call in
  // progress (a restart or close waits for it). Each bridge's lock is taken
  // on its own, never both at once.
  struct PeerSide {
    DeviceAllocation device;
    std::uint32_t index;
  };
  PeerSide hold_for_peer_copy(const DeviceRange& range, CopyDirection direction) {
    SpinLockHold lock(lock_);
    enter(lock);
    auto* slot = &allocation(range.handle);
    validate_device_range(range, *slot);
    if (direction == CopyDirection::HostToDevice && slot->read_only()) fail_read_only(range, "a peer copy into");
    if (guarded_write(*slot, direction)) {
      std::optional<checked::Clock::time_point> deadline;
      wait_out_views_or_fail(lock, range, deadline);
      slot = &allocation(range.handle);  // the lock was dropped: check again
      validate_device_range(range, *slot);
    }
    ++slot->copies;
    if (direction == CopyDirection::HostToDevice) ++slot->uploads;
    ++calls_in_progress_;
    return {slot->device, id_slot(range.handle.id)};
  }
  void end_peer_copy(const PeerSide& side, CopyDirection direction, bool copied) noexcept {
    SpinLockHold lock(lock_);
    auto& slot = allocations_[side.index];
    --slot.copies;
    if (direction == CopyDirection::HostToDevice) --slot.uploads;
    if (copied) copies_.count_direct();
    maybe_finish_release(side.index);
    --calls_in_progress_;
    notify();
  }

  bool copy_to_peer(const DeviceRange& source, BridgeCore& destination, const DeviceRange& destination_range) {
    if (source.len != destination_range.len)
      fail(ErrorKind::InvalidRange, "device range of {} bytes of {} and device range of {} bytes of {} differ in "
           "length", source.len, describe(source.handle), destination_range.len, describe(destination_range.handle));
    if (&destination == this)
      fail(ErrorKind::Unsupported, "a peer copy goes to another bridge; within one bridge stage through the ring");
    const auto from = hold_for_peer_copy(source, CopyDirection::DeviceToHost);
    PeerSide to;
    try {
      to = destination.hold_for_peer_copy(destination_range, CopyDirection::HostToDevice);
    } catch (...) {
      end_peer_copy(from, CopyDirection::DeviceToHost, false);
      throw;
    }
    bool copied = false;
    std::optional<Error> failure;
    try {
      copied = backend_->copy_to_peer(from.device, source.offset, *destination.backend_, to.device,
                                      destination_range.offset, source.len);
    } catch (const Error& e) {
      failure.emplace(directed_kind(CopyDirection::HostToDevice, e.kind()), e.message(), e.fatal());
    } catch (const std::exception& e) {
      failure.emplace(ErrorKind::DeviceCopyFailed, fmt::format("the backend threw: {}", e.what()));
    }
    end_peer_copy(from, CopyDirection::DeviceToHost, copied);
    destination.end_peer_copy(to, CopyDirection::HostToDevice, copied);
    if (failure) {
      if (failure->fatal()) {
        // The device state is unknown on both sides: both bridges turn Broken.
        {
          SpinLockHold lock(lock_);
          mark_broken(*failure);
        }
        SpinLockHold lock(destination.lock_);
        destination.mark_broken(*failure);
      }
      throw *failure;
    }
    return copied;
  }

  // Runs blocking backend work without the lock. The caller has pinned what
  // the work uses; restart and close wait for calls_in_progress_ to drain.
  // Returns the backend's error, if any, with the lock held again.
  template <class Work>
  std::optional<Error> run_unlocked(SpinLockHold& lock, Work work) {
    ++calls_in_progress_;
    lock.unlock();
    std::optional<Error> failure;
    // Whatever the backend throws, the lock is taken back and the call
    // counted out: a restart waiting for calls_in_progress_ must not hang.
    try {
      work();
    } catch (const Error& e) {
      failure.emplace(e);
    } catch (const std::bad_alloc&) {
      failure.emplace(ErrorKind::AllocationFailed, "the backend ran out of host memory");
    } catch (const std::exception& e) {
      failure.emplace(ErrorKind::Unavailable, fmt::format("the backend threw: {}", e.what()));
    } catch (...) {
      failure.emplace(ErrorKind::Unavailable, "the backend threw an unknown exception");
    }
    lock.lock();
    --calls_in_progress_;
    notify();
    return failure;
  }

  // Inside a catch: an Error becomes the direction's copy error; anything
  // else goes on as it is.
  [[noreturn]] void rethrow_as_copy_error(CopyDirection direction) {
    try {
      throw;
    } catch (const Error& e) {
      throw copy_error(direction, e);
    }
  }

  Error copy_error(CopyDirection direction, const Error& e) {
    Error mapped(directed_kind(direction, e.kind()), e.message(), e.fatal());
    if (mapped.fatal()) mark_broken(mapped);
    copies_.count_failed();
    return mapped;
  }

  [[gnu::always_inline]] void pin(AllocationSlot& slot, CopyDirection direction, HostRing::Key host_key) {
    ++slot.copies;
    if (direction == CopyDirection::HostToDevice) ++slot.uploads;
    if (__builtin_expect(host_key & kRegionPin, 0))
      ++regions_[static_cast<std::uint32_t>(host_key)].copies;
    else
      ring_.pin(host_key);
  }

  // The copy no longer touches the allocation or the host range.
  [[gnu::always_inline]] void unpin(std::uint32_t allocation, CopyDirection direction, HostRing::Key host_key) {
    auto& slot = allocations_[allocation];
    --slot.copies;
    if (direction == CopyDirection::HostToDevice) --slot.uploads;
    if (__builtin_expect(host_key & kRegionPin, 0))
      --regions_[static_cast<std::uint32_t>(host_key)].copies;
    else
      ring_.unpin(host_key);
    maybe_finish_release(allocation);
  }

  std::size_t drain_locked() {
    drained_.clear();
    backend_->drain_completions(drained_);
    for (const auto& completion : drained_) apply(completion);
    if (__builtin_expect(!release_after_.empty(), 0)) release_settled();
    return drained_.size();
  }

  void apply(const Completion& c) {
    CopySlot* record = nullptr;
    if (c.event.domain == domain_ && c.event.generation == generation_) record = copies_.pending(c.event.id);
    if (!record) {
      // Never applied to another copy: ids carry domain, generation and version.
      const auto stale = copies_.count_stale();
      log().warn("devbridge: ignored a completion for {} ({}): bridge is domain {} generation {}; "
                 "{} stale completions so far",
                 describe(c.event), c.ok ? "ok" : "failed", domain_, generation_, stale);
      return;
    }
    unpin(record->allocation, record->direction, record->host_key);
    if (c.ok) return copies_.complete(c.event.id);
    // The failure is remembered so the event reads back as Failed; the host
    // range is unpinned and stays the caller's, to retry.
    const ErrorKind kind = directed_kind(record->direction, c.error);
    std::string message = c.message.empty() ? "the backend reported the copy failed" : c.message;
    if (c.fatal) mark_broken(Error(kind, message, true));
    copies_.record_failure(c.event.id, generation_, kind, std::move(message));
  }

  // The event's state, validating it first; `failure` gets its remembered failure.
  CopyState state_locked(const CopyEvent& e, FailedCopy** failure = nullptr) {
    check_tag(e);
    return copies_.state(e, failure);
  }

  // As state_locked; reading a failure here counts as observing it.
  CopyStatus status_locked(const CopyEvent& e) {
    check_tag(e);
    return copies_.observe(e);
  }

  CopyStatus copy_status(const CopyEvent& e) {
    SpinLockHold lock(lock_);
    enter(lock);
    drain_locked();
    return status_locked(e);
  }

  bool is_completed(const CopyEvent& e) {
    SpinLockHold lock(lock_);
    enter(lock);
    // Cheap first look: a retired event needs no drain.
    if (state_locked(e) == CopyState::Completed) return true;
    drain_locked();
    return state_locked(e) == CopyState::Completed;
  }

  static void check_timeout(std::chrono::nanoseconds timeout, const char* what) {
    if (timeout.count() < 0)
      fail(ErrorKind::InvalidRange, "{} of {} ns is negative; give zero to fail fast or a duration to wait", what,
           timeout.count());
  }

  CopyStatus wait(const CopyEvent& e, std::optional<std::chrono::nanoseconds> timeout) {
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

  std::size_t poll() {
    SpinLockHold lock(lock_);
    enter(lock);
    return drain_locked();
  }

  // ---- compute ----
  void begin_step(StepId step, std::span<const DeviceHandle> handles) {
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
    for (auto index : indices) ++allocations_[index].steps;
    steps_.emplace(step, std::move(indices));
  }

  void end_step(StepId step, std::optional<ConsumerQueue> after) {
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

  // Read-only after construction: no lock.
  void require_compute(DType dtype, std::string_view what) const {
    if (__builtin_expect(!computed_.test(static_cast<std::uint8_t>(dtype)), 0)) fail_not_computed(dtype, what);
  }

  void launch_axpy(const DeviceRange& x, const DeviceRange& y, float a, float b) {
    SpinLockHold lock(lock_);
    enter(lock);
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
    auto failure = run_unlocked(lock, [&] { held.fence = backend_->launch_axpy(launch); });
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

  // ---- views ----
  // Fills `view` in place: it is the lease's own storage (no copy on a hot path).
  // Inlined into Bridge::view, its only caller: one call per view, not two.
  [[gnu::always_inline]] void view(const DeviceHandle& h, const ViewSpec& spec, ViewWait wait_mode, TensorView& view) {
    SpinLockHold lock(lock_);
    enter(lock);
    auto* slot = &allocation(h);
    if (__builtin_expect(spec.dtype != slot->view_dtype, 0) &&
        (slot->spec.dtype || element_sizes_[static_cast<std::uint8_t>(spec.dtype)] == 0))
      fail_view_dtype(h, spec.dtype, *slot);
    shape_view(h, spec, *slot, placement_, view);
    if (slot->uploads) {
      if (wait_mode == ViewWait::Refuse)
        fail(ErrorKind::AllocationStillInUse,
             "{} has {} cop{} into it in flight; wait for them or ask the view to wait", describe(h), slot->uploads,
             slot->uploads == 1 ? "y" : "ies");
      wait_until(lock, std::chrono::steady_clock::time_point::max(), [&] {
        slot = &allocation(h);
        return slot->uploads == 0;
      });
    }
    call_backend([&] { backend_->validate_view(slot->device, view); });
    ++slot->views;
    ++outstanding_leases_;
  }

  // A view of a typed allocation has its dtype; one of an untyped allocation
  // any dtype its device holds.
  [[noreturn, gnu::cold, gnu::noinline]] void fail_view_dtype(const DeviceHandle& h, DType dtype,
                                                              const AllocationSlot& slot) const {
    if (slot.spec.dtype)
      fail(ErrorKind::InvalidViewDType, "view dtype {} differs from {}'s dtype {}", dtype_info(dtype).name, describe(h),
           spec_dtype_name(slot.spec));
    if (dtype_size(dtype) == 0)
      fail(ErrorKind::InvalidViewDType, "view of {}: dtype value {} is not a dtype", describe(h),
           static_cast<int>(dtype));
    fail_unsupported_dtype(dtype, "a view");
  }

  // A call that computes in a dtype the device holds but does not compute
  // in: names the dtype, the device, and what it does compute in.
  [[noreturn, gnu::cold, gnu::noinline]] void fail_not_computed(DType dtype, std::string_view what) const {
    fail(ErrorKind::UnsupportedDType,
         "{} computes in {}: the bridge's {} holds {} but does not compute in it (it computes in: {})", what,
         dtype_info(dtype).name, device_text_, dtype_info(dtype).name,
         dtype_names([&](DType d) { return computed_.test(static_cast<std::uint8_t>(d)); }));
  }

  // The names of the dtypes `picked` selects, for messages ("none" for none).
  template <class Picked>
  static std::string dtype_names(Picked picked) {
    std::string names;
    for (const auto& info : all_dtypes())
      if (picked(info.dtype)) names += fmt::format("{}{}", names.empty() ? "" : ", ", info.name);
    return names.empty() ? "none" : names;
  }

  // Names the dtype, the device, and what it does hold.
  [[noreturn, gnu::cold, gnu::noinline]] void fail_unsupported_dtype(DType dtype, std::string_view what) const {
    fail(ErrorKind::UnsupportedDType, "{} of dtype {}: the bridge's {} does not hold {} (it holds: {})", what,
         dtype_info(dtype).name, device_text_, dtype_info(dtype).name,
         dtype_names([&](DType d) { return element_sizes_[static_cast<std::uint8_t>(d)] != 0; }));
  }

  // Ends one lease. A lease of the current generation on an open bridge is the
  // common case and stays small; the rest (orphans, and leases of a bridge
  // whose close has not freed its memory yet) are out of line.
  void end_view(const DeviceHandle& h) noexcept {
    lock_.lock();
    --outstanding_leases_;
    if (__builtin_expect(h.generation != generation_ || closed(), 0)) return end_orphaned_view(h);
    const auto index = id_slot(h.id);
    auto& slot = allocations_[index];
    // Not in the table though the generation is current: a restart has made
    // it an orphan and dropped the lock (giving back the cache) before it
    // advanced the generation. The orphan's count must see this end.
    if (__builtin_expect(!slot.in_use || slot.version != id_version(h.id) || slot.views == 0, 0))
      return end_orphaned_view(h);
    --slot.views;
    if (__builtin_expect(slot.released, 0)) finish_release_out_of_line(index);
    lock_.unlock();
  }

  // A lease handed on (ViewLease::set_holder) ends: its holder's count first,
  // then as any lease. Kept apart so end_view, the hot path, never sees holders.
  [[gnu::noinline, gnu::cold]] void end_handed_on_view(const DeviceHandle& h, ViewHolder holder) noexcept {
    {
      std::lock_guard guard(lock_);
      if (h.generation == generation_) holders_.hand_back(h.id, holder);
    }
    end_view(h);
  }

  // Holds a lease's allocation until a fence recorded now on the consumer's
  // queue passes: the consumer may still read the view there (PyTorch's
  // record_stream). No enter(): a lease ends on a restarted or closed bridge
  // too. Throws, changing nothing, when the fence cannot be recorded.
  void hold_view_until_fence(const DeviceHandle& h, ConsumerQueue queue) {
    SpinLockHold lock(lock_);
    hold_until_consumer_fence(DropQueue::Entry{Fence{}, QueueRef{Queue::Consumer, queue.handle}, h.generation, {h.id}});
  }

  // A live lease of the current generation changes hands (ViewLease::set_holder).
  void set_view_holder(const DeviceHandle& h, ViewHolder from, ViewHolder to) noexcept {
    std::lock_guard guard(lock_);
    if (from == to || h.generation != generation_) return;  // an orphan's holder is never reported
    auto* slot = allocations_.find(h.id);
    if (!slot || slot->views == 0) return;
    holders_.hand_over(h.id, from, to);
  }

  // Keeps the backend call (and the registers it needs) out of end_view.
  [[gnu::noinline, gnu::cold]] void finish_release_out_of_line(std::uint32_t index) noexcept {
    maybe_finish_release(index);
  }

  // A lease from before a restart or close, or one a restart in progress has
  // already orphaned: its allocation is an orphan (see quiesce_and_free_all),
  // freed with its last lease. Called with the lock
  // held; releases it. The core deletes itself after its owner's last lease.
  [[gnu::noinline, gnu::cold]] void end_orphaned_view(const DeviceHandle& h) noexcept {
    bool last;
    {
      std::lock_guard guard(lock_, std::adopt_lock);
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

  // ---- restart / close ----
  // Stops new work, waits for calls running outside the lock, quiesces the
  // backend and frees everything the old generation held. If the quiesce
  // fails, the device may still be copying into allocations and ring ranges:
  // nothing is freed or unpinned, the bridge is Broken, and the error says so.
  void quiesce_and_free_all(SpinLockHold& lock, const char* what) {
    set_state(kRestarting, true);
    block_while(lock, [&] { return calls_in_progress_ != 0; });
    lock.unlock();
    std::optional<Error> failure;
    try {
      backend_->quiesce();
    } catch (const Error& e) {
      failure.emplace(e);
    } catch (const std::exception& e) {
      failure.emplace(ErrorKind::Unavailable, e.what(), true);
    }
    lock.lock();
    if (failure) {
      const Error error(failure->kind(),
                        fmt::format("{} failed: the backend's quiesce failed ({}); nothing was freed or unpinned, since "
                                    "the device may still use it; {} again to retry",
                                    what, failure->what(), what),
                        true);
      mark_broken(error);
      set_state(kRestarting, false);
      notify();
      throw error;
    }
    // The device is idle now: a failure to read its last completions loses
    // only their statistics, so it is logged and the old state freed anyway.
    if (!broken()) {
      try {
        drain_locked();
      } catch (const std::exception& e) {
        log().error("devbridge: draining completions during {} failed after a clean quiesce: {}", what, e.what());
      }
    }
    // The backend's own queues are idle now: their fences have passed.
    // Those on consumers' queues may not have; what they hold becomes an
    // orphan below, freed when they pass.
    reap_fences();
    // Copy ids start afresh in the new generation: an event is known only
    // if it was issued in the generation it names.
    copies_.restart();
    allocations_.for_each_in_use([&](std::uint32_t index, AllocationSlot& slot) {
      const auto id = make_id(index, slot.version);
      // Steps and launches are over (steps_ is cleared below, calls in
      // progress have ended): what steps still counts is fenced uses.
      const std::uint32_t fenced = slot.steps == 0 ? 0 : drops_.uses_of(generation_, id);
      if (slot.views == 0 && fenced == 0) return free_slot(index);
      // A live view may still be read (numpy, tinygrad), a consumer's queue
      // may still run over it: its memory stays until the last lease ends
      // and its fences pass, though the handle is refused from now on.
      allocations_.orphan(index, generation_, fenced);
    });
    steps_.clear();
    holders_.clear();
    ring_.unpin_all();
    // The device is idle: ranges waiting for their copies go back now.
    release_after_.release_all(ring_);
    // Registered regions belong to the old generation too: their handles
    // are refused from now on, and the backend unpins them.
    regions_.unregister_all([&](const HostBlock& block) { backend_->unregister_host(block); });
    // The cache goes back too: a restart or close leaves the backend holding
    // only what views and fences still keep.
    give_back_cache(lock);
  }

  void restart(Generation generation) {
    SpinLockHold lock(lock_);
    block_while(lock, [&] { return restarting(); });
    check_not_closed();
    if (generation <= generation_)
      fail(ErrorKind::OldGenerationHandle, "restart to generation {} refused: it must be greater than the current {}",
           generation, generation_);
    quiesce_and_free_all(lock, "restart");
    generation_ = generation;
    set_state(kBroken, false);
    broken_reason_.clear();
    ++restarts_;
    set_state(kRestarting, false);
    notify();
  }

  void close() {
    SpinLockHold lock(lock_);
    block_while(lock, [&] { return restarting(); });
    if (closed() && released_at_close_) return;
    // Closed first: every call blocked in the bridge (a wait, a waiting view,
    // a wait for room) and every later one fails with Closed from now on.
    set_state(kClosed, true);
    notify();
    quiesce_and_free_all(lock, "close");
    settle_fences(lock, "the bridge closed");
    // What the settled fences freed went to the pool: nothing allocates any more.
    give_back_cache(lock);
    if (host_leases_ == 0)
      backend_->free_host(ring_.block());
    else
      leased_ring_ = ring_.block();  // the last host lease frees it
    ring_ = HostRing();
    released_at_close_ = true;
    set_state(kRestarting, false);
    notify();
  }

  BridgeStats stats() {
    std::lock_guard guard(lock_);
    if (fences_pending() && !restarting() && !closed()) reap_fences();
    BridgeStats s;
    s.pending_fences = drops_.size();
    s.abandoned_fences = abandoned_fences_;
    s.generation = generation_;
    s.domain = domain_;
    s.broken = broken();
    s.closed = closed();
    allocations_.fill(s);
    copies_.fill(s);
    s.active_steps = steps_.size();
    s.restarts = restarts_;
    regions_.fill(s);
    s.ring_capacity = ring_.capacity();
    s.ring_used = ring_.used();
    s.ring_reservations = ring_.reservations();
    s.ring_releases_pending = release_after_.size();
    return s;
  }

  Generation generation() {
    std::lock_guard guard(lock_);
    return generation_;
  }

  Backend& backend() noexcept { return *backend_; }
  std::uint64_t domain() const noexcept { return domain_; }

 private:
  mutable SpinLock lock_;
  std::condition_variable_any cv_;
  std::unique_ptr<Backend> backend_;
  const std::uint64_t domain_;
  Generation generation_;
  HostRing ring_;
  ReleaseAfter release_after_;  // ranges handed to release_host_after
  CopyTimeline copies_;
  AllocationTable allocations_;
  RegionRegistry regions_;
  std::unordered_map<StepId, std::vector<std::uint32_t>> steps_;
  DropQueue drops_;
  std::optional<DevicePool> pool_;  // engaged when the caching pool is on; never changes after construction
  std::uint64_t abandoned_fences_ = 0;
  std::chrono::nanoseconds close_fence_timeout_{std::chrono::seconds(10)};
  WritesUnderView writes_under_view_ = WritesUnderView::Refuse;
  ViewHolders holders_;  // who holds the views handed on
  std::chrono::nanoseconds writes_under_view_timeout_ = std::chrono::nanoseconds::max();
  // Host leases (lease_host) keep the ring block past close(); the block a
  // close could not free yet waits here for the last one.
  std::uint64_t host_leases_ = 0;
  HostBlock leased_ring_;
  bool released_at_close_ = false;  // close() quiesced and freed: a later close() has nothing to do
  std::vector<Completion> drained_;
  std::uint64_t restarts_ = 0;
  std::uint64_t outstanding_leases_ = 0;
  std::uint32_t calls_in_progress_ = 0;
  std::uint32_t waiters_ = 0;
  // Why calls cannot go ahead as usual: bits of one byte, so that every entry
  // (enter) tests them with one compare.
  // kFencesPending sends every entry to the slow path while the drop queue
  // holds fences, so that any call reclaims what passed.
  enum StateBit : std::uint8_t { kRestarting = 1, kClosed = 2, kBroken = 4, kFencesPending = 8 };
  std::uint8_t state_ = 0;
  bool restarting() const noexcept { return state_ & kRestarting; }
  bool closed() const noexcept { return state_ & kClosed; }
  bool broken() const noexcept { return state_ & kBroken; }
  bool fences_pending() const noexcept { return state_ & kFencesPending; }
  void set_state(StateBit bit, bool on) noexcept {
    state_ = on ? static_cast<std::uint8_t>(state_ | bit) : static_cast<std::uint8_t>(state_ & ~bit);
    state_seen_.store(state_, std::memory_order_relaxed);
  }
  // state_ as last set, for a look without the lock (alloc_device's early
  // refusal); only a hint, the locked enter() decides.
  std::atomic<std::uint8_t> state_seen_{0};
  bool owner_alive_ = true;
  std::string broken_reason_;
  std::string device_string_;  // views point at it: it never changes after construction
  std::string device_text_;    // "opencl device 0:0 (pthread-...)", for errors
  // Indexed by DType's value (all 256, so no bound check): its size where the
  // device holds it, else 0. Read before the lock: set once, at construction.
  std::array<std::uint8_t, 256> element_sizes_{};
  std::bitset<256> computed_;  // dtypes the device computes in (BackendInfo::computed_dtypes)
  ViewPlacement placement_;  // read before the lock: set once, at construction
};

}  // namespace detail

// ---- ViewLease ----

ViewLease::ViewLease(ViewLease&& other) noexcept
    : core_(std::exchange(other.core_, nullptr)),
      handed_on_core_(std::exchange(other.handed_on_core_, nullptr)),
      view_(other.view_),
      holder_(other.holder_) {}

ViewLease& ViewLease::operator=(ViewLease&& other) noexcept {
  if (this != &other) {
    reset();
    core_ = std::exchange(other.core_, nullptr);
    handed_on_core_ = std::exchange(other.handed_on_core_, nullptr);
    view_ = other.view_;
    holder_ = other.holder_;
  }
  return *this;
}

ViewLease::~ViewLease() { reset(); }

void ViewLease::reset() noexcept {
  if (auto* core = std::exchange(core_, nullptr))
    core->end_view(view_.handle);
  else if (auto* handed_on = std::exchange(handed_on_core_, nullptr)) [[unlikely]]
    handed_on->end_handed_on_view(view_.handle, holder_);
}

void ViewLease::end_after(ConsumerQueue queue) {
  auto* core = core_ ? core_ : handed_on_core_;
  if (!core) return;
  core->hold_view_until_fence(view_.handle, queue);
  reset();
}

void ViewLease::set_holder(ViewHolder holder) noexcept {
  auto* core = core_ ? core_ : handed_on_core_;
  if (!core) return;
  core->set_view_holder(view_.handle, holder_, holder);
  holder_ = holder;
  core_ = holder == ViewHolder::Caller ? core : nullptr;
  handed_on_core_ = holder == ViewHolder::Caller ? nullptr : core;
}

// ---- HostLease ----

HostLease::HostLease(HostLease&& other) noexcept
    : core_(std::exchange(other.core_, nullptr)), bytes_(std::exchange(other.bytes_, {})) {}

HostLease& HostLease::operator=(HostLease&& other) noexcept {
  if (this != &other) {
    reset();
    core_ = std::exchange(other.core_, nullptr);
    bytes_ = std::exchange(other.bytes_, {});
  }
  return *this;
}

HostLease::~HostLease() { reset(); }

void HostLease::reset() noexcept {
  bytes_ = {};
  if (auto* core = std::exchange(core_, nullptr)) core->end_host_lease();
}

// ---- Bridge ----

void Bridge::Detach::operator()(detail::BridgeCore* core) const noexcept { core->detach_owner(); }

Bridge::Bridge(std::unique_ptr<Backend> backend, BridgeOptions options)
    : core_(new detail::BridgeCore(std::move(backend), options)) {}

Bridge::~Bridge() = default;

std::uint64_t Bridge::domain() const noexcept { return core_->domain(); }
Generation Bridge::generation() const { return core_->generation(); }
BackendInfo Bridge::backend_info() const { return core_->backend().describe(); }
void Bridge::require_compute(DType dtype, std::string_view what) const { core_->require_compute(dtype, what); }
BridgeStats Bridge::stats() const { return core_->stats(); }
MemoryStats Bridge::memory_stats() const { return core_->memory_stats(); }
void Bridge::reset_peak_memory() { core_->reset_peak_memory(); }
void Bridge::empty_cache() { core_->empty_cache(); }

DeviceHandle Bridge::alloc_device(const ObjectSpec& spec, std::uint64_t extent) {
  return core_->alloc_device(spec, extent);
}
void Bridge::free_device(DeviceHandle handle) { core_->free_device(handle); }
void Bridge::release(DeviceHandle handle) { core_->release(handle); }
std::uint64_t Bridge::extent(DeviceHandle handle) const { return core_->spec_of(handle).second; }
ObjectSpec Bridge::spec(DeviceHandle handle) const { return core_->spec_of(handle).first; }

HostRange Bridge::reserve(std::uint64_t bytes, std::uint64_t alignment, std::chrono::nanoseconds timeout) {
  return core_->reserve(bytes, alignment, timeout);
}
void Bridge::release_host(HostRange range) { core_->release_host(range); }
void Bridge::release_host_after(HostRange range, CopyEvent event) { core_->release_host_after(range, event); }
std::span<std::byte> Bridge::host_bytes(HostRange range) const { return core_->host_bytes(range); }
HostLease Bridge::lease_host(HostRange range) {
  HostLease lease;
  lease.bytes_ = core_->lease_host(range);
  lease.core_ = core_.get();
  return lease;
}
std::uint64_t Bridge::ring_capacity() const noexcept { return core_->ring_capacity(); }
std::uint64_t Bridge::ring_free_bytes() const { return core_->ring_free_bytes(); }

CopyEvent Bridge::host_to_device(HostRange host, DeviceRange device, CopyMode mode, Admission admission) {
  return core_->copy(CopyDirection::HostToDevice, host, device, mode, admission);
}
CopyEvent Bridge::device_to_host(DeviceRange device, HostRange host, CopyMode mode, Admission admission) {
  return core_->copy(CopyDirection::DeviceToHost, host, device, mode, admission);
}
CopyEvent Bridge::host_to_device(HostRange host, DeviceRange device, const CopyLayout& layout, CopyMode mode,
                                 Admission admission) {
  return core_->copy<true>(CopyDirection::HostToDevice, host, device, mode, admission, layout);
}
CopyEvent Bridge::device_to_host(DeviceRange device, HostRange host, const CopyLayout& layout, CopyMode mode,
                                 Admission admission) {
  return core_->copy<true>(CopyDirection::DeviceToHost, host, device, mode, admission, layout);
}
bool Bridge::copy_to_peer(DeviceRange source, Bridge& destination, DeviceRange destination_range) {
  return core_->copy_to_peer(source, *destination.core_, destination_range);
}
HostRegion Bridge::register_host(std::span<std::byte> bytes, RegionRelease on_release) {
  return core_->register_host(bytes, false, std::move(on_release));
}
HostRegion Bridge::register_host_read_only(std::span<const std::byte> bytes, RegionRelease on_release) {
  // Never written through: a download into a read-only region is refused.
  return core_->register_host({const_cast<std::byte*>(bytes.data()), bytes.size()}, true, std::move(on_release));
}
void Bridge::unregister_host(HostRegion region) { core_->unregister_host(region); }
std::span<std::byte> Bridge::region_bytes(HostRegion region) const { return core_->region_bytes(region); }
bool Bridge::region_retained(HostRegion region) const noexcept { return core_->region_retained(region); }
DeviceHandle Bridge::adopt_host(RegionRange range, const ObjectSpec& spec) { return core_->adopt_host(range, spec); }
CopyEvent Bridge::host_to_device(RegionRange host, DeviceRange device, CopyMode mode, Admission admission) {
  return core_->copy(CopyDirection::HostToDevice, host, device, mode, admission);
}
CopyEvent Bridge::device_to_host(DeviceRange device, RegionRange host, CopyMode mode, Admission admission) {
  return core_->copy(CopyDirection::DeviceToHost, host, device, mode, admission);
}
CopyEvent Bridge::host_to_device(RegionRange host, DeviceRange device, const CopyLayout& layout, CopyMode mode,
                                 Admission admission) {
  return core_->copy<true>(CopyDirection::HostToDevice, host, device, mode, admission, layout);
}
CopyEvent Bridge::device_to_host(DeviceRange device, RegionRange host, const CopyLayout& layout, CopyMode mode,
                                 Admission admission) {
  return core_->copy<true>(CopyDirection::DeviceToHost, host, device, mode, admission, layout);
}
CopyStatus Bridge::copy_status(CopyEvent event) { return core_->copy_status(event); }
bool Bridge::safe_to_release_host(CopyEvent event) { return core_->is_completed(event); }
bool Bridge::host_bytes_valid(CopyEvent event) { return core_->is_completed(event); }
CopyStatus Bridge::wait(CopyEvent event, std::optional<std::chrono::nanoseconds> timeout) {
  return core_->wait(event, timeout);
}
std::size_t Bridge::poll() { return core_->poll(); }

void Bridge::begin_step(StepId step, std::span<const DeviceHandle> handles) { core_->begin_step(step, handles); }
void Bridge::end_step(StepId step) { core_->end_step(step, std::nullopt); }
void Bridge::end_step(StepId step, ConsumerQueue after) { core_->end_step(step, after); }
void Bridge::launch_axpy(DeviceRange x, DeviceRange y, float a, float b) { core_->launch_axpy(x, y, a, b); }

ViewLease Bridge::view(DeviceHandle handle, const ViewSpec& spec, ViewWait wait) {
  ViewLease lease;
  core_->view(handle, spec, wait, lease.view_);
  lease.core_ = core_.get();
  return lease;
}

void Bridge::restart(Generation generation) { core_->restart(generation); }
void Bridge::close() { core_->close(); }
Backend& Bridge::backend() noexcept { return core_->backend(); }

}  // namespace devbridge
