// The bridge's recording sites: what the core tells the flight recorder
// (flight_recorder.hpp) as it works, each event that changes memory stamped
// with the memory counters read from the components that hold them (the
// allocation table, the caching pool, the host ring, the copy timeline).
// Owns the recorder: the one being recorded into, and the last one kept for
// the dumps after recording stops.
//
// The core tests on() before it calls a site, so a bridge that does not
// record pays that one branch; the sites are out of line. Not thread-safe:
// the core's lock guards this as it guards the components it reads.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "core/allocation_table.hpp"
#include "core/copy_timeline.hpp"
#include "core/device_pool.hpp"
#include "core/drop_queue.hpp"
#include "core/flight_recorder.hpp"
#include "core/host_ring.hpp"

namespace devbridge::detail {

class TraceSites {
 public:
  // `generation`: the bridge's own, which a restart changes (read at each event).
  TraceSites(const AllocationTable& allocations, const std::optional<DevicePool>& pool, const HostRing& ring,
             const CopyTimeline& copies, const Generation& generation) noexcept
      : allocations_(allocations), pool_(pool), ring_(ring), copies_(copies), generation_(generation) {}

  // Whether recording is on: the one test every recording site is behind.
  bool on() const noexcept { return recording_ != nullptr; }
  FlightRecorder* recording() const noexcept { return recording_; }
  // What was recorded last, kept after stop() for the dumps (null if never).
  FlightRecorder* kept() const noexcept { return recorder_.get(); }
  // Read by the bindings before they enter the core (no lock).
  bool records_stacks() const noexcept { return records_stacks_.load(std::memory_order_relaxed); }

  // Records into `recorder` from now on; returns the one it replaces, for
  // the caller to free once the core's lock is dropped (a large ring takes
  // a while to free).
  std::unique_ptr<FlightRecorder> start(std::unique_ptr<FlightRecorder> recorder) noexcept;
  // Stops recording; what was recorded stays kept().
  void stop() noexcept;
  // The number of the next out-of-memory dump this bridge writes.
  std::uint64_t next_oom_dump() noexcept { return ++oom_dumps_; }

  // What a free records (the flight recorder's `free`): the allocation's
  // generation and id, its bytes and address, whether it ended a deferred
  // release.
  struct FreedMemory {
    Generation generation;
    std::uint64_t id, bytes, address;
    bool deferred;
  };
  // The free of the allocation in slot `index`, just retired (its fields stay
  // until the slot is used again).
  FreedMemory freed_of(std::uint32_t index) const noexcept;

  // ---- the sites, each reached only past a test of on() ----
  // A record built by the caller (counters sampled here when it has them).
  [[gnu::noinline, gnu::cold]] void record(TraceRecord record) noexcept;
  // `address`: the memory's, for an allocation's own events (allocate, free).
  [[gnu::noinline, gnu::cold]] void memory(TraceKind kind, Generation generation, std::uint64_t id,
                                           std::uint64_t bytes, std::uint64_t address = 0) noexcept;
  // The allocation in slot `index` was just retired (its fields stay until
  // the slot is used again): its memory goes back to the backend (no pool).
  [[gnu::noinline, gnu::cold]] void freed_slot(std::uint32_t index) noexcept;
  // After the pool took back a part of `part_bytes`: the free (`freed`, if
  // one is recorded), then what the pool did with it.
  [[gnu::noinline, gnu::cold]] void given_back(const FreedMemory* freed, std::uint64_t part_bytes, bool coalesced,
                                               const std::optional<DeviceAllocation>& whole) noexcept;
  // A pool hit, miss or split for a request of `class_bytes`, served by a
  // part of `part_bytes` (0: none yet), counted as allocated: it is the
  // request's from here on (its allocate follows); then a split if `split`.
  [[gnu::noinline, gnu::cold]] void pool_take(TraceKind kind, std::uint64_t class_bytes, std::uint64_t part_bytes,
                                              bool split) noexcept;
  // Now, in the recorder's ticks (a slice's begin).
  [[gnu::noinline, gnu::cold]] std::uint64_t ticks() const noexcept { return recording_->ticks(); }
  // An async copy's begin: its slice ends when its completion applies.
  [[gnu::noinline, gnu::cold]] void copy_begin(CopyDirection direction, const DeviceRange& device,
                                               std::uint64_t event_id, std::uint64_t bytes) noexcept;
  // A slice that began at `began` (the recorder's ticks) and ends now, in
  // one record: a sync copy, a peer copy's side, a launch without a fence.
  // `in_place`: bytes written into host-addressable memory (write_in_place), not a copy.
  [[gnu::noinline, gnu::cold]] void whole_slice(TraceTrack track, const DeviceRange& range, std::uint64_t began,
                                                bool ok, bool in_place = false) noexcept;
  // The ends of the async copies `drained` holds, about to apply (those of
  // `domain` and this generation that are still pending).
  [[gnu::noinline, gnu::cold]] void completions(std::span<const Completion> drained, std::uint64_t domain) noexcept;
  [[gnu::noinline, gnu::cold]] void view(TraceKind kind, const DeviceHandle& h, ViewHolder holder) noexcept;
  [[gnu::noinline, gnu::cold]] void fence(TraceKind kind, const DropQueue::Entry& entry) noexcept;

  // The memory counters now. Without a pool, reserved is memory_stats()'s:
  // the live allocations and the orphans views or fences still hold (rare:
  // a count's test first).
  [[gnu::always_inline]] TraceCounters counters() const noexcept {
    const std::uint64_t allocated = allocations_.allocated_bytes();
    const std::uint64_t reserved = pool_                                ? pool_->reserved_bytes()
                                   : allocations_.orphan_count() == 0 ? allocated
                                                                       : reserved_with_orphans();
    return TraceCounters{allocated, reserved, pool_ ? pool_->cached_bytes() : 0, ring_.used(),
                         copies_.inflight_bytes()};
  }

 private:
  // Inline into its two callers (both out of line): a call more on every recorded free.
  [[gnu::always_inline]] void freed(const FreedMemory& freed) noexcept;
  [[gnu::noinline, gnu::cold]] std::uint64_t reserved_with_orphans() const noexcept {
    return allocations_.reserved_bytes(nullptr);
  }

  const AllocationTable& allocations_;
  const std::optional<DevicePool>& pool_;
  const HostRing& ring_;
  const CopyTimeline& copies_;
  const Generation& generation_;
  FlightRecorder* recording_ = nullptr;  // recorder_'s while recording, else null
  std::unique_ptr<FlightRecorder> recorder_;
  std::atomic<bool> records_stacks_{false};
  std::uint64_t oom_dumps_ = 0;
};

}  // namespace devbridge::detail
