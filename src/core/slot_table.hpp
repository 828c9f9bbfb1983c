// Versioned slot tables: how the bridge's components (allocations, copies,
// registered regions) number their records so that an id is never handed
// out twice inside a domain.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "devbridge/error.hpp"

namespace devbridge::detail {

// Handle and event ids: the low half is a slot index, the high half the
// slot's use count. A slot whose count would wrap is retired, never reused,
// so an id is never handed out twice inside a domain.
constexpr std::uint64_t make_id(std::uint32_t slot, std::uint32_t version) {
  return (std::uint64_t{version} << 32) | slot;
}
constexpr std::uint32_t id_slot(std::uint64_t id) { return static_cast<std::uint32_t>(id); }
constexpr std::uint32_t id_version(std::uint64_t id) { return static_cast<std::uint32_t>(id >> 32); }

// Small free-list table of versioned slots, shared by allocations and copies.
// The free list is threaded through next_free_ (one entry per slot, grown
// with the slots), so taking and returning a slot never checks a capacity or
// calls out of line: they are most of an allocation, a free or an async copy.
template <class Slot>
class SlotTable {
 public:
  // Returns a free slot index, its version already bumped for the new use.
  // The caller writes every other field (Slot::start), so a slot is written
  // once per use rather than cleared and then filled.
  [[gnu::always_inline]] std::uint32_t acquire() {
    if (__builtin_expect(free_head_ == kNone, 0)) grow();
    const std::uint32_t index = free_head_;
    free_head_ = next_free_[index];
    ++slots_[index].version;
    ++live_;
    return index;
  }
  // Only `in_use` must be cleared: the next acquire's caller writes the rest.
  [[gnu::always_inline]] void retire(std::uint32_t index) {
    auto& slot = slots_[index];
    slot.in_use = false;
    --live_;
    if (slot.version != std::numeric_limits<std::uint32_t>::max()) {
      next_free_[index] = free_head_;
      free_head_ = index;
    }
  }
  // Gives back a slot whose id was never handed out (its use failed before
  // the caller saw it): the version goes back too, so that id stays unknown.
  void unissue(std::uint32_t index) {
    --slots_[index].version;
    retire(index);
  }
  Slot* find(std::uint64_t id) noexcept {
    const auto index = id_slot(id);
    if (index >= size_) return nullptr;
    auto& slot = slots_[index];
    return (slot.in_use && slot.version == id_version(id)) ? &slot : nullptr;
  }
  const Slot* find(std::uint64_t id) const noexcept { return const_cast<SlotTable*>(this)->find(id); }
  Slot& operator[](std::uint32_t index) noexcept { return slots_[index]; }
  const Slot& operator[](std::uint32_t index) const noexcept { return slots_[index]; }
  const Slot* at(std::uint32_t index) const noexcept { return index < slots_.size() ? &slots_[index] : nullptr; }
  std::size_t live() const noexcept { return live_; }
  template <class F>
  void for_each_in_use(F&& f) {
    for (std::uint32_t i = 0; i < slots_.size(); ++i)
      if (slots_[i].in_use) f(i, slots_[i]);
  }
  template <class F>
  void for_each_in_use(F&& f) const {
    for (std::uint32_t i = 0; i < slots_.size(); ++i)
      if (slots_[i].in_use) f(i, slots_[i]);
  }

 private:
  static constexpr std::uint32_t kNone = std::numeric_limits<std::uint32_t>::max();

  // A new slot at the end, on the free list.
  [[gnu::noinline]] void grow() {
    if (slots_.size() >= kNone)
      throw Error(ErrorKind::AllocationFailed, "bridge slot table exhausted (2^32 - 1 live records)");
    next_free_.push_back(free_head_);
    try {
      slots_.emplace_back();
    } catch (...) {
      next_free_.pop_back();  // the two stay the same length
      throw;
    }
    free_head_ = size_++;
  }

  std::vector<Slot> slots_;
  std::vector<std::uint32_t> next_free_;
  std::uint32_t free_head_ = kNone;
  std::uint32_t size_ = 0;  // slots_.size(), without the division by sizeof(Slot)
  std::size_t live_ = 0;
};

}  // namespace devbridge::detail
