// Room running transfers hold on each bridge's ring (transfer_room.hpp).
#include "transfer/transfer_room.hpp"

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace devbridge::detail {

namespace {

// What one bridge's running transfers hold: bytes counted, transfers running,
// and how often counted room went back (a neighbour watching for progress
// compares it across its wait).
struct Held {
  std::uint64_t bytes = 0;
  std::uint64_t transfers = 0;
  std::uint64_t returns = 0;
};

class RoomHeldByTransfers {
 public:
  static RoomHeldByTransfers& instance() {
    static RoomHeldByTransfers held;
    return held;
  }
  void add(const Bridge* bridge, std::uint64_t bytes) {
    std::lock_guard lock(mutex_);
    by_bridge_[bridge].bytes += bytes;
  }
  // `returned`: the bytes went back to the ring (not a chunk standing aside).
  void remove(const Bridge* bridge, std::uint64_t bytes, bool returned) noexcept {
    std::lock_guard lock(mutex_);
    const auto it = by_bridge_.find(bridge);
    if (it == by_bridge_.end()) return;
    it->second.bytes -= std::min(it->second.bytes, bytes);
    if (returned) ++it->second.returns;
    forget_if_idle(it);
  }
  void start(const Bridge* bridge) {
    std::lock_guard lock(mutex_);
    ++by_bridge_[bridge].transfers;
  }
  void finish(const Bridge* bridge) noexcept {
    std::lock_guard lock(mutex_);
    const auto it = by_bridge_.find(bridge);
    if (it == by_bridge_.end()) return;
    --it->second.transfers;
    forget_if_idle(it);
  }
  Held look(const Bridge* bridge) const noexcept {
    std::lock_guard lock(mutex_);
    const auto it = by_bridge_.find(bridge);
    return it == by_bridge_.end() ? Held{} : it->second;
  }

 private:
  // An entry lives while a transfer runs or room is counted, so `returns`
  // only starts over once nobody can be watching it.
  void forget_if_idle(std::unordered_map<const Bridge*, Held>::iterator it) noexcept {
    if (it->second.bytes == 0 && it->second.transfers == 0) by_bridge_.erase(it);
  }

  mutable std::mutex mutex_;
  std::unordered_map<const Bridge*, Held> by_bridge_;
};

}  // namespace

RunningTransfer::RunningTransfer(const Bridge& bridge) noexcept : bridge_(&bridge) {
  try {
    RoomHeldByTransfers::instance().start(bridge_);
    counted_ = true;
  } catch (...) {
    // Not counted (no memory for the entry): a neighbour short of room then refuses sooner, nothing worse.
  }
}

RunningTransfer::~RunningTransfer() {
  if (counted_) RoomHeldByTransfers::instance().finish(bridge_);
}

TransferRoom::TransferRoom(const Bridge& bridge, std::uint64_t bytes) noexcept : bridge_(&bridge) {
  try {
    RoomHeldByTransfers::instance().add(bridge_, bytes);
    bytes_ = bytes;
  } catch (...) {
    // Not counted: a neighbour short of room then refuses sooner, nothing worse.
  }
}

TransferRoom::~TransferRoom() {
  if (bytes_ != 0) RoomHeldByTransfers::instance().remove(bridge_, bytes_, true);
}

void TransferRoom::give_back(const Bridge& bridge, std::uint64_t bytes) noexcept {
  if (bytes != 0) RoomHeldByTransfers::instance().remove(&bridge, bytes, true);
}

TransferRoom::StandAside::StandAside(TransferRoom& room) noexcept : room_(room) {
  if (room_.bytes_ != 0) RoomHeldByTransfers::instance().remove(room_.bridge_, room_.bytes_, false);
}

TransferRoom::StandAside::~StandAside() {
  if (room_.bytes_ == 0) return;
  try {
    RoomHeldByTransfers::instance().add(room_.bridge_, room_.bytes_);
  } catch (...) {
    room_.bytes_ = 0;  // not counted any more: a neighbour short of room then refuses sooner
  }
}

RoomWatch::RoomWatch(const Bridge& bridge, std::uint64_t own) noexcept
    : bridge_(&bridge), own_(own), returns_seen_(RoomHeldByTransfers::instance().look(bridge_).returns),
      quiet_since_(checked::Clock::now()) {}

bool RoomWatch::others_running() const noexcept {
  const Held held = RoomHeldByTransfers::instance().look(bridge_);
  return held.bytes > own_ || held.transfers > 1;  // the caller is one of them
}

bool RoomWatch::others_quiet(checked::Clock::time_point now) noexcept {
  const Held held = RoomHeldByTransfers::instance().look(bridge_);
  if (held.bytes > own_ || held.returns != returns_seen_) {
    returns_seen_ = held.returns;
    quiet_since_ = now;
    return false;
  }
  return now - quiet_since_ >= kQuietBeforeRefusing;
}

}  // namespace devbridge::detail
