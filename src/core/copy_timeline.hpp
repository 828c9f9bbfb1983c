// The copy timeline: what the bridge knows about the copies it issued in the
// current generation. Pending async copies hold a versioned record; a copy
// that completed or failed gives its record back at once, and a failure is
// remembered in a bounded log so its event keeps reading as Failed. Also the
// in-flight budget (bytes of async copies not yet completed) and the copy
// counters of BridgeStats.
//
// Not thread-safe: the bridge calls it under its lock. It knows nothing of
// allocations or host ranges: a record carries the allocation's slot and the
// host pin for the bridge to unpin when the copy ends.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>

#include "core/host_ring.hpp"
#include "core/slot_table.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::detail {

// An async copy in flight.
struct CopySlot {
  std::uint32_t version = 0;
  bool in_use = false;
  CopyDirection direction = CopyDirection::HostToDevice;
  std::uint32_t allocation = 0;
  HostRing::Key host_key = 0;  // a ring reservation's, or a registered region's (see BridgeCore::kRegionPin)
  std::uint64_t bytes = 0;
  // The newest version of this slot whose failure was forgotten (evicted from
  // the failure log). A retired event at or below it may have failed, so it
  // never reads as Completed. Kept across uses of the slot: start() leaves it.
  std::uint32_t forgotten_failure_version = 0;
  // Every field but the version and the watermark, for a new use of the slot.
  [[gnu::always_inline]] void start(CopyDirection new_direction, std::uint32_t new_allocation,
                                    HostRing::Key new_host_key, std::uint64_t new_bytes) {
    in_use = true;
    direction = new_direction;
    allocation = new_allocation;
    host_key = new_host_key;
    bytes = new_bytes;
  }
};

// A failed async copy, remembered after its record was retired.
struct FailedCopy {
  ErrorKind kind;
  bool observed;  // read back by wait or copy_status
  std::string message;
};

class CopyTimeline {
 public:
  // Sync copies need no record: their event is done when the call returns.
  // Their ids have this bit set, so they never collide with async ones.
  static constexpr std::uint64_t kSyncEventBit = 1ull << 63;

  CopyTimeline(std::uint64_t domain, std::uint64_t inflight_budget, std::uint32_t failure_limit)
      : domain_(domain), inflight_budget_(inflight_budget), failure_limit_(failure_limit) {}

  // ---- the in-flight budget ----
  // inflight_bytes_ never exceeds the budget, so the room left cannot wrap.
  [[gnu::always_inline]] bool has_room(std::uint64_t bytes) const noexcept {
    return bytes <= inflight_budget_ - inflight_bytes_;
  }
  std::uint64_t inflight_budget() const noexcept { return inflight_budget_; }
  std::uint64_t inflight_bytes() const noexcept { return inflight_bytes_; }

  // ---- issuing ----
  // A record for an async copy about to be submitted; its bytes count in
  // flight. Returns the event's id. Throws (AllocationFailed) only before
  // anything changed.
  [[gnu::always_inline]] std::uint64_t begin_async(CopyDirection direction, std::uint32_t allocation,
                                                   HostRing::Key host_key, std::uint64_t bytes) {
    const auto index = records_.acquire();
    auto& record = records_[index];
    record.start(direction, allocation, host_key, bytes);
    inflight_bytes_ += bytes;
    return make_id(index, record.version);
  }
  // The submission of `id` (begin_async) failed: its event was never handed out.
  void cancel_async(std::uint64_t id) noexcept {
    inflight_bytes_ -= records_[id_slot(id)].bytes;
    records_.unissue(id_slot(id));
  }
  [[gnu::always_inline]] void submitted() noexcept { ++submitted_; }
  // A sync copy that succeeded: its event's id. A failed one is never numbered.
  [[gnu::always_inline]] std::uint64_t complete_sync() noexcept {
    ++submitted_;
    ++completed_;
    return kSyncEventBit | ++sync_issued_;
  }
  // A copy that failed before it had a record (a sync copy, a refused submission).
  void count_failed() noexcept { ++failed_; }
  // A peer copy: done when the call returns, no event.
  void count_direct() noexcept {
    ++submitted_;
    ++completed_;
  }

  // ---- completions ----
  // The pending record `id` names, if it is one (nullptr for a stale or
  // sync id: never applied to another copy).
  [[gnu::always_inline]] CopySlot* pending(std::uint64_t id) noexcept {
    return (id & kSyncEventBit) ? nullptr : records_.find(id);
  }
  const CopySlot* pending(std::uint64_t id) const noexcept {
    return (id & kSyncEventBit) ? nullptr : records_.find(id);
  }
  // The copy ended: its record goes, its bytes leave the budget. A failure
  // is remembered so its event reads back as Failed.
  void complete(std::uint64_t id) noexcept {
    inflight_bytes_ -= records_[id_slot(id)].bytes;
    records_.retire(id_slot(id));
    ++completed_;
  }
  void record_failure(std::uint64_t id, Generation generation, ErrorKind kind, std::string message);
  // The pending record a completion settles; null for a stale one (another
  // domain or generation, an id never issued or settled already), which is
  // counted and logged and never applied to another copy: ids carry domain,
  // generation and version.
  [[gnu::always_inline]] CopySlot* settling(const Completion& c, std::uint64_t domain, Generation generation) {
    CopySlot* record = c.event.domain == domain && c.event.generation == generation ? pending(c.event.id) : nullptr;
    if (__builtin_expect(!record, 0)) ignore_stale(c, domain, generation);
    return record;
  }
  [[gnu::cold, gnu::noinline]] void ignore_stale(const Completion& c, std::uint64_t domain, Generation generation);

  // ---- reading an event ----
  // The event's state; `failure` gets its remembered failure. The caller
  // checked its domain and generation.
  [[gnu::always_inline]] CopyState state(const CopyEvent& e, FailedCopy** failure = nullptr) {
    if (e.id & kSyncEventBit) {
      const auto sequence = e.id & ~kSyncEventBit;
      if (sequence == 0 || sequence > sync_issued_) fail_never_issued(e);
      return CopyState::Completed;  // a sync copy that failed threw instead of returning its event
    }
    const auto* slot = records_.at(id_slot(e.id));
    const auto version = id_version(e.id);
    // The table starts afresh each generation: an id from an older one is unknown.
    if (!slot || version == 0 || version > slot->version) fail_never_issued(e);
    if (version == slot->version && slot->in_use) return CopyState::Pending;
    // Issued (acquire bumped the version) and since retired: it completed or failed.
    if (__builtin_expect(!failures_.empty(), 0)) {
      if (auto it = failures_.find(e.id); it != failures_.end()) {
        if (failure) *failure = &it->second;
        return CopyState::Failed;
      }
    }
    if (__builtin_expect(version <= slot->forgotten_failure_version, 0)) fail_forgotten(e);
    return CopyState::Completed;
  }
  // As state(); reading a failure here counts as observing it.
  CopyStatus observe(const CopyEvent& e);

  // ---- a new generation ----
  // Copy ids start afresh: an event is known only in the generation it names.
  // The device is idle: nothing is in flight any more.
  void restart() noexcept;

  void fill(BridgeStats& s) const noexcept;

 private:
  [[noreturn, gnu::cold]] void fail_never_issued(const CopyEvent& e) const;
  [[noreturn, gnu::cold]] void fail_forgotten(const CopyEvent& e) const;
  void forget_oldest_failure(Generation generation);

  const std::uint64_t domain_;
  const std::uint64_t inflight_budget_;
  const std::uint32_t failure_limit_;
  SlotTable<CopySlot> records_;
  std::uint64_t inflight_bytes_ = 0;
  std::uint64_t sync_issued_ = 0;
  // Failed copies, by event id, remembered so their events read as Failed;
  // at most failure_limit_ of them, oldest first in failure_order_.
  std::unordered_map<std::uint64_t, FailedCopy> failures_;
  std::deque<std::uint64_t> failure_order_;
  std::uint64_t unobserved_failures_ = 0;
  std::uint64_t failures_evicted_ = 0;
  std::uint64_t submitted_ = 0, completed_ = 0, failed_ = 0, stale_ = 0;
};

}  // namespace devbridge::detail
