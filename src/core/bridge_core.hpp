// The bridge's core: the state machine behind Bridge. One lock guards all
// bookkeeping; backend work that can block (sync copies, compute, quiesce)
// runs outside it, with the allocation and ring range pinned so nothing is
// freed underneath. The core orchestrates its components (allocation table,
// copy timeline, region registry, host ring, caching pool, drop queue, view
// holders, the flight recorder's sites) under that lock.
//
// Its hot paths are defined in headers so that Bridge's forwarding functions
// inline them: entry and lookup here; allocations and frees, copies,
// completions and views in bridge_core_inline.hpp (included at the end); the rest is defined by
// area: bridge.cpp (the drop queue, copies, compute, views), bridge_memory.cpp
// (the pool and the backend), bridge_regions.cpp (registered and adopted host
// memory), peer_copy.cpp (device to device between bridges), in_place.cpp
// (device memory the CPU reaches, written and read without the ring),
// bridge_lifecycle.cpp (construction, restart, close, statistics) and
// bridge_api.cpp (Bridge, ViewLease and HostLease over it).
#pragma once

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
#include "core/bridge_gate.hpp"
#include "core/describe.hpp"
#include "core/device_dtypes.hpp"
#include "core/copy_timeline.hpp"
#include "core/device_pool.hpp"
#include "core/drop_queue.hpp"
#include "core/fail.hpp"
#include "core/flight_recorder.hpp"
#include "core/host_ring.hpp"
#include "core/log.hpp"
#include "core/region_registry.hpp"
#include "core/release_after.hpp"
#include "core/slot_table.hpp"
#include "core/tags.hpp"
#include "core/trace_sites.hpp"
#include "core/spin_lock.hpp"
#include "core/view_leases.hpp"
#include "devbridge/checked.hpp"
#include "devbridge/consumer_names.hpp"
#include "devbridge/recorder.hpp"
#include "devbridge/wait_check.hpp"

namespace devbridge::detail {

inline ErrorKind copy_failure_kind(CopyDirection direction) {
  return direction == CopyDirection::HostToDevice ? ErrorKind::DeviceCopyFailed : ErrorKind::OutputCopyFailed;
}

// Backends may report a copy failure generically; the contract names it by
// direction. Other kinds pass through.
inline ErrorKind directed_kind(CopyDirection direction, ErrorKind kind) {
  const bool copy_kind = kind == ErrorKind::DeviceCopyFailed || kind == ErrorKind::OutputCopyFailed;
  return copy_kind ? copy_failure_kind(direction) : kind;
}

class BridgeCore {
 public:
  BridgeCore(std::unique_ptr<Backend> backend, const BridgeOptions& options);

  // The last lease of a closed bridge ends here: fences a lease left behind
  // (ViewLease::end_after) are waited for, bounded, before the backend goes.
  ~BridgeCore();

  // ---- lifetime of the core itself ----
  void detach_owner() noexcept;

  // Entry of every call that touches state: waits out a restart in progress.
  // The holder is not passed on: a noinline callee taking it would keep its
  // held flag in memory on every call. The wait leaves the lock held.
  void enter(SpinLockHold&) {
    if (__builtin_expect(!gate_.open(), 0)) enter_slow();
  }
  [[gnu::noinline]] void enter_slow();

  void mark_broken(const Error& error);

  // An orphan goes when nothing uses it; an abandoned one is forgotten, not
  // freed.
  void maybe_free_orphan(const AllocationTable::OrphanKey& key, Orphan& o) noexcept;

  // ---- the drop queue ----
  // Ends every fenced use whose fence passed; frees what that leaves unused.
  // Any call that enters the bridge runs it while fences are pending.
  void reap_fences() noexcept;
  void end_fenced_uses(const DropQueue::Entry& entry) noexcept;
  void add_fenced_uses(DropQueue::Entry&& entry) noexcept;

  // Holds the entry's allocations until a fence recorded now on its
  // consumer's queue passes. Throws, changing nothing, when the backend
  // cannot record one.
  void hold_until_consumer_fence(DropQueue::Entry&& held);

  // Waits, outside the lock and for at most close_fence_timeout, for the
  // fences still pending (close, or the core's end); memory whose fence
  // does not pass in time is abandoned, never freed: the device may still
  // read it.
  template <class Lock>
  void settle_fences(Lock& lock, const char* when) noexcept;
  void abandon(const DropQueue::Entry& entry, const char* when) noexcept;
  static std::string queue_text(const QueueRef& where);

  // ---- handles ----
  // A handle or copy event of this bridge's domain and current generation.
  template <class Tagged>
  [[gnu::always_inline]] void check_tag(const Tagged& tagged) const {
    if (__builtin_expect(tagged.domain != domain_ || tagged.generation != generation_, 0))
      fail_tag(tagged, domain_, generation_);
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
  [[gnu::noinline]] void free_slot(std::uint32_t index);

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

  // The same for a backend call made without the lock (one that may wait
  // long): the lock is taken only to mark the bridge broken.
  template <class Call>
  decltype(auto) call_backend_unlocked(Call call) {
    try {
      return call();
    } catch (const Error& e) {
      if (e.fatal()) {
        SpinLockHold lock(lock_);
        mark_broken(e);
      }
      throw;
    }
  }

  // ---- registered host memory ----
  // The live region of this generation `r` names.
  std::uint32_t region_index(const HostRegion& r);

  // The live region a non-empty range lies in.
  std::uint32_t region_range_index(const RegionRange& range);
  HostRegion register_host(std::span<std::byte> bytes, bool read_only, Bridge::RegionRelease on_release);
  // False: retained for its adoptions (AfterAdoptions::Wait), unregistered after the last.
  bool unregister_host(const HostRegion& r, AfterAdoptions adopted = AfterAdoptions::Refuse);
  std::span<std::byte> region_bytes(const HostRegion& r);

  // ---- host memory adopted in place ----
  DeviceHandle adopt_host(const RegionRange& range, const ObjectSpec& spec);
  bool region_retained(const HostRegion& r) noexcept;

  // Out of line: free_device and release inline their free path, and only
  // adopted memory comes here.
  [[gnu::noinline, gnu::cold]] void end_adopted_slot(std::uint32_t index) noexcept;

  // The last use of an adopted allocation ended: back to its region, which
  // goes too if it was retained only for it.
  void end_adoption(const DeviceAllocation& device, std::uint32_t region) noexcept;

  const BackendCapabilities& capabilities() const noexcept { return capabilities_; }

  // ---- allocation ----

  // Read-only after construction: no lock.
  void check_allocation(const ObjectSpec& spec, std::uint64_t extent) const {
    (void)dtypes_.checked_allocation(spec, extent);
  }

  DeviceHandle alloc_device(const ObjectSpec& spec, std::uint64_t extent);

  // The backend's allocation of `asked` bytes for a request of `extent`
  // (returned in place: no copy on alloc_device's path).
  [[gnu::always_inline]] DeviceAllocation allocate(std::uint64_t asked, std::uint64_t extent,
                                                   std::uint64_t alignment);

  // alloc_device with the caching pool on: a part of a free span that fits
  // the request's size class, else of a new segment from the backend.
  [[gnu::noinline]] DeviceHandle alloc_through_pool(const ObjectSpec& spec, std::uint32_t elem, DType view_dtype,
                                                    std::uint64_t extent);

  // enter(), giving the memory back to the backend if the bridge refuses.
  void enter_or_free(SpinLockHold& lock, const DeviceAllocation& device);

  // A new slot for memory the caller got (from the pool or the backend);
  // on failure the memory goes back where it came from... or to the backend,
  // which is where all memory ends up.
  DeviceHandle add_allocation(SpinLockHold& lock, const ObjectSpec& spec, std::uint32_t elem, DType view_dtype,
                              std::uint64_t extent, const DeviceAllocation& device);

  // ---- memory: the pool and the backend ----
  // The backend refused `asked` bytes (the request's `extent`, or its size
  // class): a fatal error breaks the bridge; out of memory, the exact size is
  // tried (a size class may be past a per-buffer limit), then the bridge
  // reclaims what it can (completions that end last uses, passed fences, the
  // whole cache) and retries once, and the final error says what it held.
  [[gnu::noinline, gnu::cold]] DeviceAllocation allocate_after_refusal(const Error& refusal, std::uint64_t asked,
                                                                       std::uint64_t extent, std::uint64_t alignment);

  // The allocation, or nothing when the backend is out of memory.
  std::optional<DeviceAllocation> try_allocate(std::uint64_t bytes, std::uint64_t alignment);
  DeviceAllocation allocate_or_break(std::uint64_t bytes, std::uint64_t alignment);

  struct Held {
    std::uint64_t in_use = 0, cached = 0, largest = 0;
    std::uint64_t orphaned = 0;  // kept from earlier generations by their views and fences
    std::string holders;  // the largest live allocations and orphans, and what holds each
  };
  Held reclaim_for_retry();

  // Every cached block back to the backend; the frees run without the lock.
  void give_back_cache(SpinLockHold& lock);

  // Wholly free segments, out of the pool and counted as freed, until at
  // most `down_to` bytes of them are left; the caller frees them in the backend.
  std::vector<DeviceAllocation> take_free_segments(std::uint64_t down_to = 0) noexcept;

  using FreedMemory = TraceSites::FreedMemory;
  // Memory no allocation uses any more: cached, or freed in the backend.
  // Under the lock; returns what the backend must still free (the memory,
  // or the pool's segment it was part of), which the caller frees now or
  // after unlocking. `freed` (recording only): the free to record, once the
  // memory went where it goes, so its counters count it there.
  std::optional<DeviceAllocation> keep_or_free_later(const DeviceAllocation& device, std::uint64_t alignment,
                                                     const FreedMemory* freed = nullptr) noexcept;
  // keep_or_free_later of the allocation in slot `index`, just retired, recording its free.
  [[gnu::noinline, gnu::cold]] std::optional<DeviceAllocation> keep_or_free_recorded(std::uint32_t index) noexcept;

  // Under the lock, from inside a noexcept path: every whole free segment
  // back to the backend.
  void free_cache_now() noexcept;
  void empty_cache();
  void reset_peak_memory();
  MemoryStats memory_stats();
  std::string uses(const DeviceHandle& h, const AllocationSlot& slot) const;
  std::string views_text(const DeviceHandle& h, const AllocationSlot& slot) const;

  [[noreturn, gnu::cold, gnu::noinline]] void fail_write_under_view(const DeviceRange& range,
                                                                   const AllocationSlot& slot) const;

  [[noreturn, gnu::cold, gnu::noinline]] void fail_in_use(const DeviceHandle& h, const AllocationSlot& slot) const;

  [[gnu::always_inline]] void free_device(const DeviceHandle& h);
  // free_device after it refused an allocation in use: its copies may have
  // ended in the backend without the bridge having heard yet (the caller
  // polled nothing since); their completions are applied, and only a use
  // that remains refuses the free. (Bridge::free_device calls it on the
  // refusal: any branch on free_device's own path cost every free and every
  // view 5-8 instructions.)
  [[gnu::noinline, gnu::cold]] void free_once_copies_applied(const DeviceHandle& h);
  // Under the lock, before refusing something its copies in flight hold (a
  // range, an allocation): a copy that ended in the backend unpolled holds
  // nothing, so the completions waiting there are applied first. True when
  // any was (the refusal is worth looking at again).
  bool apply_completions_before_refusing();

  void release(const DeviceHandle& h);

  // The backend's free runs after the lock is dropped: a driver free may
  // synchronize the device (cuMemFree does), and no other caller should spin
  // meanwhile. The slot is retired first, so nothing reaches the memory any
  // more. (Frees that the end of a last use triggers inside another call —
  // a completion, a lease ending — still run under the lock.)
  [[gnu::always_inline]] void free_slot_then_unlock(SpinLockHold& lock, std::uint32_t index);
  template <bool kRecorded>
  [[gnu::always_inline]] void free_to_backend_then_unlock(SpinLockHold& lock, std::uint32_t index);
  // Under the lock; what the backend must still free (see keep_or_free_later).
  // Out of line and not handed the lock, which would then live in memory on
  // the common path too.
  [[gnu::noinline]] std::optional<DeviceAllocation> give_back_to_pool(std::uint32_t index);

  std::pair<ObjectSpec, std::uint64_t> spec_of(const DeviceHandle& h);

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
  // Room comes back when a reservation is released: by release_host (which
  // notifies, so the wait sleeps on the condition variable), or by a
  // completion when ranges wait in release_host_after (then the wait drains
  // completions in short slices instead). close() notifies too, and enter()
  // then refuses with Closed.
  [[gnu::noinline, gnu::cold]] HostRange reserve_waiting(SpinLockHold& lock, std::uint64_t bytes,
                                                         std::uint64_t alignment, std::chrono::nanoseconds timeout);
  // One slice of a wait for completions, then applies them (and so releases
  // the settled ranges of release_host_after).
  void wait_for_completion_slice(SpinLockHold& lock, checked::Clock::time_point deadline);
  void release_host_after(HostRange range, const CopyEvent& event);
  bool wait_for_release_after(std::chrono::nanoseconds timeout);
  bool settled(const CopyEvent& event) noexcept;
  void release_settled() noexcept;
  void release_host(HostRange range);
  std::span<std::byte> host_bytes(HostRange range);
  std::span<std::byte> lease_host(HostRange range);
  // Ends a host lease; the ring block a close left behind goes with the last.
  void end_host_lease() noexcept;
  std::uint64_t ring_capacity() const noexcept { return ring_.capacity(); }
  std::uint64_t ring_free_bytes();

  // ---- copies ----
  // Waits (draining completions itself, so no other thread need poll) until
  // `ready()` holds or the deadline passes. Called with the lock held.
  template <class Ready>
  bool wait_until(SpinLockHold& lock, std::chrono::steady_clock::time_point deadline, Ready ready);

  // An upload into an allocation a view still reads, which the policy
  // guards, or into a read-only one (refused): the slow path sorts them out.
  bool guarded_write(const AllocationSlot& slot, CopyDirection direction) const noexcept {
    return (slot.views | slot.adopted_region) != 0 && direction == CopyDirection::HostToDevice &&
           (slot.adopted_region != 0 || writes_under_view_ != WritesUnderView::Allow);
  }

  [[noreturn, gnu::cold, gnu::noinline]] void fail_read_only(const DeviceRange& range, std::string_view what) const;

  // A write into `range` while views still read it: waits for them to end
  // where the options say so (writes_under_view "wait", until `deadline`,
  // set on the first call) and returns with the lock dropped and taken
  // again, so the caller checks everything again; otherwise, or once the
  // wait times out, refuses (AllocationStillInUse).
  void wait_out_views_or_fail(SpinLockHold& lock, const DeviceRange& range,
                              std::optional<checked::Clock::time_point>& deadline);

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
  // Defined, for HostRange and RegionRange, in bridge.cpp.
  template <class Host>
  [[gnu::noinline, gnu::cold]] Admitted admit(SpinLockHold& lock, CopyDirection direction, const Host& host,
                                              const DeviceRange& device, std::uint64_t bytes, CopyMode mode,
                                              const Admission& admission);

  // Every copy: between the ring or a registered region (Host) and an
  // allocation, of one contiguous run or (kPitched) of rows.
  template <bool kPitched = false, class Host>
  CopyEvent copy(CopyDirection direction, const Host& host, DeviceRange device, CopyMode mode, Admission admission,
                 const CopyLayout& layout = {});

  // ---- device to device, between bridges ----
  // One side of a peer copy, validated and held: counted as a copy of the
  // allocation (free_device refuses, release defers) and as a call in
  // progress (a restart or close waits for it). Each bridge's lock is taken
  // on its own, never both at once.
  struct PeerSide {
    DeviceAllocation device;
    std::uint32_t index;
    // For the peer track, when recording: when the copy began (the
    // recorder's ticks), and its range.
    std::uint64_t began = 0;
    DeviceRange range;
  };
  PeerSide hold_for_peer_copy(const DeviceRange& range, CopyDirection direction);
  // How a held range's use ended: nothing moved (a peer copy fell back, or
  // failed before it began), a direct peer copy (counted and recorded on the
  // peer track), or write_in_place's or read_in_place's caller returned or
  // threw (recorded on the copy-up or copy-down track).
  enum class HeldEnd : std::uint8_t { Untouched, PeerCopied, InPlace, InPlaceFailed };
  void end_peer_copy(const PeerSide& side, CopyDirection direction, HeldEnd how) noexcept;
  bool copy_to_peer(const DeviceRange& source, BridgeCore& destination, const DeviceRange& destination_range);
  // Bridge::write_in_place: each range held as a peer copy's destination is
  // (validated, writes_under_view, read-only refused) while `write` fills
  // the host bytes of host-addressable device memory (in_place.cpp).
  void write_in_place(std::span<const DeviceRange> ranges,
                      const std::function<void(std::span<const std::span<std::byte>>)>& write);
  // Bridge::read_in_place: each range held as a peer copy's source is, once
  // the copies into it in flight have landed and the launches queued before
  // the call have run, while `read` reads its host bytes.
  void read_in_place(std::span<const DeviceRange> ranges,
                     const std::function<void(std::span<const std::span<const std::byte>>)>& read);
  // Waits until no copy into any of the ranges' allocations is in flight;
  // true when one of them has launches or steps that may still write it.
  bool settle_writes_before_reading(std::span<const DeviceRange> ranges);
  // Until everything queued on the backend's compute queue so far has run.
  void wait_for_launches();
  // Whether this thread runs one of this bridge's in-place callbacks (the
  // `write` or `read` above) that holds allocation `index` (any allocation:
  // nullopt), writing into it when `writes`. A call made from inside one
  // that would wait for it to return (a restart or close, a read of what it
  // writes) is refused instead of waiting for its own thread.
  bool inside_own_in_place_callback(std::optional<std::uint32_t> index = std::nullopt,
                                    bool writes = false) const noexcept;
  // AllocationStillInUse for a restart or close (`what`) inside one.
  void refuse_inside_own_callback(const char* what) const;

  // Inside a catch: an Error becomes the direction's copy error; anything
  // else goes on as it is.
  [[noreturn]] void rethrow_as_copy_error(CopyDirection direction);
  Error copy_error(CopyDirection direction, const Error& e);

  [[gnu::always_inline]] void pin(AllocationSlot& slot, CopyDirection direction, HostRing::Key host_key);
  // The copy no longer touches the allocation or the host range.
  [[gnu::always_inline]] void unpin(std::uint32_t allocation, CopyDirection direction, HostRing::Key host_key);
  // Applies the completions the backend has: copies end, ranges unpin.
  std::size_t drain_locked();
  void apply(const Completion& c);

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

  CopyStatus copy_status(const CopyEvent& e);
  bool is_completed(const CopyEvent& e);
  static void check_timeout(std::chrono::nanoseconds timeout, const char* what);
  CopyStatus wait(const CopyEvent& e, std::optional<std::chrono::nanoseconds> timeout);
  std::size_t poll();

  // ---- compute ----
  void begin_step(StepId step, std::span<const DeviceHandle> handles);
  void end_step(StepId step, std::optional<ConsumerQueue> after);

  // Read-only after construction: no lock.
  void require_compute(DType dtype, std::string_view what) const { dtypes_.require_compute(dtype, what); }

  void launch_axpy(const DeviceRange& x, const DeviceRange& y, float a, float b);

  // ---- views ----
  // Returned in place: the view is built in the lease's own storage (no copy
  // and no zero-fill on a hot path). Inlined into the lease's constructor,
  // its only caller: one call per view, not two.
  [[gnu::always_inline]] TensorView view(const DeviceHandle& h, const ViewSpec& spec, ViewWait wait_mode);

  [[noreturn, gnu::cold, gnu::noinline]] void fail_view_during_upload(const DeviceHandle& h,
                                                                      const AllocationSlot& slot) const;
  // A view that would wait for uploads into `h` from inside this thread's
  // own write_in_place into it (a fill taking a view of what it fills):
  // AllocationStillInUse, since that write ends only when the caller returns.
  [[gnu::cold, gnu::noinline]] void refuse_waiting_for_own_write(const DeviceHandle& h) const;

  // A view of a typed allocation has its dtype; one of an untyped allocation
  // any dtype its device holds.
  [[noreturn, gnu::cold, gnu::noinline]] void fail_view_dtype(const DeviceHandle& h, DType dtype,
                                                              const AllocationSlot& slot) const;

  // Ends one lease. A lease of the current generation on an open bridge is the
  // common case and stays small; the rest (orphans, and leases of a bridge
  // whose close has not freed its memory yet) are out of line.
  void end_view(const DeviceHandle& h) noexcept;
  [[gnu::noinline, gnu::cold]] void end_view_out_of_line(const DeviceHandle& h, std::uint32_t index) noexcept;

  // Another lease of the view a live lease of `h` has (ViewLease::share):
  // counted where that lease is (the slot, or the orphan a restart or close
  // made of it), after uploads in flight into a current slot have ended, as
  // a new view waits for them. False when no lease of `h` is live.
  bool share_view(const DeviceHandle& h);

  // A lease handed on (ViewLease::set_holder) ends: its holder's count first,
  // then as any lease. Kept apart so end_view, the hot path, never sees holders.
  [[gnu::noinline, gnu::cold]] void end_handed_on_view(const DeviceHandle& h, ViewHolder holder) noexcept;

  // Holds a lease's allocation until a fence recorded now on the consumer's
  // queue passes: the consumer may still read the view there (PyTorch's
  // record_stream). No enter(): a lease ends on a restarted or closed bridge
  // too. Throws, changing nothing, when the fence cannot be recorded.
  void hold_view_until_fence(const DeviceHandle& h, ConsumerQueue queue);

  // A live lease of the current generation changes hands (ViewLease::set_holder).
  void set_view_holder(const DeviceHandle& h, ViewHolder from, ViewHolder to) noexcept;

  // Keeps the backend call (and the registers it needs) out of end_view.
  [[gnu::noinline, gnu::cold]] void finish_release_out_of_line(std::uint32_t index) noexcept;

  // A lease from before a restart or close, or one a restart in progress has
  // already orphaned: its allocation is an orphan (see quiesce_and_free_all),
  // freed with its last lease. Called with the lock
  // held; releases it. The core deletes itself after its owner's last lease.
  [[gnu::noinline, gnu::cold]] void end_orphaned_view(const DeviceHandle& h) noexcept;

  // ---- restart / close ----
  // Stops new work, waits for calls running outside the lock, quiesces the
  // backend and frees everything the old generation held. If the quiesce
  // fails, the device may still be copying into allocations and ring ranges:
  // nothing is freed or unpinned, the bridge is Broken, and the error says so.
  void quiesce_and_free_all(SpinLockHold& lock, const char* what);
  void restart(Generation generation);
  void close();
  BridgeStats stats();
  Generation generation();

  Backend& backend() noexcept { return *backend_; }
  std::uint64_t domain() const noexcept { return domain_; }

  // ---- the flight recorder (flight_recorder.hpp; its sites: trace_sites.hpp) ----
  void record(const RecordOptions& options);
  void stop_recording() noexcept;
  bool records_stacks() const noexcept { return trace_.records_stacks(); }
  // What is recorded, copied under the lock; formatted without it.
  TraceDump trace_dump();
  std::string memory_snapshot_json();
  // The final out-of-memory message's detail: fragmentation and the top
  // holders by bytes; with the recorder on and oom_dump_dir set, the dump.
  std::string top_holders_text(std::size_t count);
  // What keeps an orphan of an earlier generation: its views, its fences.
  static std::string orphan_holders_text(const Orphan& orphan);
  std::string dump_for_oom();

 private:
  mutable SpinLock lock_;
  BridgeGate gate_;  // restarting, closed, broken; calls outside the lock; sleepers
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
  bool owner_alive_ = true;
  std::string device_string_;  // views point at it: it never changes after construction
  // What the backend can do, read once, at construction: fixed for the bridge's life.
  BackendCapabilities capabilities_;
  DeviceDtypes dtypes_;  // read before the lock: set once, at construction
  ViewPlacement placement_;  // read before the lock: set once, at construction
  // Whether a free leaves the common path (straight back to the backend,
  // unrecorded): the caching pool is on, or the recorder. The common path
  // tests this one flag, not both. Under the lock.
  bool frees_off_common_path_ = false;

  // The flight recorder's sites, reading the counters of the components above.
  TraceSites trace_{allocations_, pool_, ring_, copies_, generation_};
  std::string backend_name_;  // BackendInfo's name and device id, for the dumps
  std::string device_id_;
};

}  // namespace devbridge::detail

#include "core/bridge_core_inline.hpp"
