// The drop queue: uses of device memory that end on a device queue rather
// than at a host call. A launch, a compute step ended "after this stream", a
// view a consumer reads on its own stream: each leaves a fence and the
// allocations it holds. The bridge frees (or hands back for reuse) an
// allocation only once every fence holding it has passed, tested by any
// bridge call; no caller has to poll.
//
// Not thread-safe: the bridge calls it under its lock, except for the
// blocking wait of settle(), which runs on entries it took out first.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "devbridge/backend.hpp"
#include "devbridge/types.hpp"

namespace devbridge::detail {

class DropQueue {
 public:
  struct Entry {
    Fence fence;
    QueueRef where;
    Generation generation = 0;
    std::vector<std::uint64_t> allocation_ids;  // one per use the fence holds (an id may repeat)
  };

  bool empty() const noexcept { return entries_.empty(); }
  std::size_t size() const noexcept { return entries_.size(); }

  // Room for one more entry, taken before the work whose fence it will hold
  // starts: adding the entry afterwards cannot fail, so no fence of work
  // already on a queue is ever lost to an allocation failure.
  void reserve_one() {
    entries_.reserve(entries_.size() + reserved_ + 1);
    ++reserved_;
  }
  void cancel_reservation() noexcept { --reserved_; }
  void add(Entry&& entry) noexcept {
    --reserved_;
    entries_.push_back(std::move(entry));  // within the reserved capacity: no allocation
  }

  // Tests the fences, oldest first. A queue runs in order, so once one of its
  // fences is pending the later ones on it are not asked about (a driver call
  // each). For every fence that passed, `passed(entry)` runs, then the
  // backend forgets the fence. A backend error counts as "not passed" (the
  // memory stays held) and is handed to `fault`. Returns how many passed.
  template <class Passed, class Fault>
  std::size_t reap(Backend& backend, Passed&& passed, Fault&& fault) {
    std::size_t kept = 0, reaped = 0;
    blocked_.clear();
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      auto& entry = entries_[i];
      if (!is_blocked(entry.where) && test(backend, entry.fence, fault)) {
        passed(entry);
        backend.release_fence(entry.fence);
        ++reaped;
        continue;
      }
      note_blocked(entry.where);
      if (kept != i) entries_[kept] = std::move(entry);
      ++kept;
    }
    entries_.resize(kept);
    return reaped;
  }

  // How many uses of the allocation the pending fences hold (messages, and
  // restart: a cold scan).
  std::uint32_t uses_of(Generation generation, std::uint64_t id) const noexcept {
    std::uint32_t n = 0;
    for (const auto& entry : entries_)
      if (entry.generation == generation)
        for (const auto held : entry.allocation_ids) n += held == id;
    return n;
  }

  // The queues whose pending fences hold the allocation, each once (messages).
  std::vector<QueueRef> queues_holding(Generation generation, std::uint64_t id) const {
    std::vector<QueueRef> queues;
    for (const auto& entry : entries_)
      if (entry.generation == generation && std::ranges::find(entry.allocation_ids, id) != entry.allocation_ids.end() &&
          std::ranges::find(queues, entry.where) == queues.end())
        queues.push_back(entry.where);
    return queues;
  }

  // Takes every entry out, for a wait outside the lock (close).
  // Only a launch in flight holds a reservation across an unlock, and close
  // (and the core's end) take everything only once no call is in progress:
  // nothing reserved is lost with the old vector.
  std::vector<Entry> take_all() noexcept { return std::exchange(entries_, {}); }

 private:
  template <class Fault>
  static bool test(Backend& backend, Fence fence, Fault& fault) {
    try {
      return backend.fence_passed(fence);
    } catch (const Error& e) {
      fault(e);
    } catch (const std::exception& e) {
      fault(Error(ErrorKind::Unavailable, std::string("the backend threw testing a fence: ") + e.what(), true));
    }
    return false;
  }
  bool is_blocked(const QueueRef& where) const noexcept {
    for (const auto& queue : blocked_)
      if (queue == where) return true;
    return false;
  }
  void note_blocked(const QueueRef& where) noexcept {
    // A full list only costs later tests of that queue, never correctness.
    if (blocked_.size() < blocked_.capacity() && !is_blocked(where)) blocked_.push_back(where);
  }

  std::vector<Entry> entries_;
  std::size_t reserved_ = 0;
  // Queues seen pending during one reap; capacity fixed at construction so
  // that a reap never allocates.
  std::vector<QueueRef> blocked_ = [] {
    std::vector<QueueRef> v;
    v.reserve(16);
    return v;
  }();
};

}  // namespace devbridge::detail
