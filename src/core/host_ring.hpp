// The host ring's bookkeeping: which ranges of one host block are reserved,
// which are pinned by in-flight copies, and where head and tail are.
// Not thread-safe on its own: the bridge calls it under its lock.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "devbridge/backend.hpp"
#include "devbridge/types.hpp"

namespace devbridge::detail {

class HostRing {
 public:
  // Positions are logical byte counts (monotonic, never wrap), so
  // "before/after" comparisons stay trivial across any number of laps; each
  // reservation keeps its offset in the block beside its position. Every
  // live position lies in [tail, tail + capacity], all sums are checked
  // (devbridge/checked.hpp), and positions start over at 0 whenever the ring
  // empties, or are shifted down by the tail (rebase) in the rare case a new
  // one would not fit in 64 bits: any capacity up to 2^64-1 works.
  using Position = std::uint64_t;
  // Names a live reservation in O(1): reservations are numbered in order.
  using Key = std::uint64_t;

  HostRing() = default;
  explicit HostRing(HostBlock block) : block_(block) {}

  const HostBlock& block() const noexcept { return block_; }
  std::uint64_t capacity() const noexcept { return block_.bytes; }
  std::uint64_t used() const noexcept { return head_ - tail_; }
  std::uint64_t free_bytes() const noexcept { return capacity() - used(); }
  std::size_t reservations() const noexcept { return live_; }
  // Reservations that started a new lap while the ring still held others
  // (the rest of the lap too short, or used up exactly); a drained ring
  // starting over at offset 0 is not one.
  std::uint64_t wraps() const noexcept { return wraps_; }

  HostRange reserve(std::uint64_t bytes, std::uint64_t alignment);
  // Ends the reservation that `range` names exactly.
  void release(HostRange range);
  // The key of the live reservation `range` names exactly (as reserve
  // returned it), or InvalidRange naming the range and `what` asked for it.
  Key exact(HostRange range, const char* what) const;
  // Ends the reservation `key` names, if it is still live and still `range`:
  // Released; Pinned while a copy uses it (nothing changes); Gone when it
  // was released already (keys are never reused, so a range reserved again
  // since has another key and is never released here).
  enum class KeyRelease : std::uint8_t { Released, Pinned, Gone };
  KeyRelease release(Key key, HostRange range) noexcept;

  // Validates that `range` lies inside one live reservation and returns that
  // reservation's key (for pin/unpin). Throws InvalidRange naming the range.
  Key find(HostRange range) const;
  // A pinned reservation cannot be released, so its key stays valid.
  void pin(Key key) noexcept { at_key(key).pins++; }
  void unpin(Key key) noexcept;
  void unpin_all() noexcept;

  std::byte* data(HostRange range) const noexcept { return block_.data + range.offset; }

 private:
  struct Reservation {
    Position begin;
    std::uint64_t offset;  // begin % capacity, kept to avoid dividing on every lookup
    std::uint64_t len;
    std::uint32_t pins = 0;
    bool released = false;
  };
  // The key of the live reservation holding `range`, or kNoKey. (Not an
  // std::optional: returned through the stack, its flag byte stored and then
  // read back as part of a wider load defeats store-to-load forwarding, a
  // stall that made a sync copy 25 % slower than the instruction count says.)
  static constexpr Key kNoKey = ~Key{0};
  Key locate(HostRange range) const noexcept;
  void advance_tail() noexcept;
  // Shifts every position down by tail_ (offsets unchanged).
  void rebase() noexcept;

  // Reservations live in a power-of-two table indexed by key & mask: a
  // key's slot is one AND away (a deque's indexing and back() cost most of
  // a sync copy's ring lookup), and keys [front_key_, next_key_) never
  // outnumber the slots. Doubles when full; ordered by begin, as keys are.
  Reservation& at_key(Key key) noexcept { return slots_[key & mask_]; }
  const Reservation& at_key(Key key) const noexcept { return slots_[key & mask_]; }
  bool empty() const noexcept { return front_key_ == next_key_; }
  // Room for one more key (may throw, before anything changes).
  void make_room();

  HostBlock block_;
  std::vector<Reservation> slots_;
  Key mask_ = 0;
  Key front_key_ = 0;  // the oldest reservation not yet past the tail
  Key next_key_ = 0;   // the next reservation's key
  std::size_t live_ = 0;
  Position head_ = 0;  // end of the newest reservation
  Position tail_ = 0;  // begin of the oldest reservation still owned
  std::uint64_t head_offset_ = 0;  // block offset of head_ (where the next reservation would start)
  std::uint64_t tail_offset_ = 0;  // block offset of tail_
  std::uint64_t wraps_ = 0;
};

}  // namespace devbridge::detail
