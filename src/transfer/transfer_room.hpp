// Ring room that running transfers hold, per bridge, and the one rule for a
// transfer short of room: wait while its neighbours hold room or give some
// back (it comes back as their copies end), refuse (Backpressure) once they
// have been quiet for a while (the room is held by something else: a range
// the caller keeps, which no waiting brings back).
//
// Counts are kept by the transfers themselves, so they lag the ring: a
// neighbour's reserve may have succeeded a moment before it counts the range.
// Hence "quiet for a while" (kQuietBeforeRefusing) rather than "holds nothing
// now": refusing on one look failed busy neighbours (threads sharing a small
// ring got Backpressure while others' fresh ranges were not counted yet).
#pragma once

#include <chrono>
#include <cstdint>
#include <utility>

#include "devbridge/bridge.hpp"
#include "devbridge/checked.hpp"

namespace devbridge::detail {

// How long the neighbours of a transfer short of room must hold none and
// give none back before it is refused: far longer than a thread takes from
// a reserve to counting it, short enough to refuse promptly when the room is
// the caller's.
inline constexpr std::chrono::nanoseconds kQuietBeforeRefusing = std::chrono::milliseconds(100);

// While it lives, a transfer runs on `bridge`: a neighbour short of room
// waits (RoomWatch) rather than refusing at once, even while this one holds
// nothing (it may be waiting for room too, or have just reserved some).
class RunningTransfer {
 public:
  explicit RunningTransfer(const Bridge& bridge) noexcept;
  ~RunningTransfer();
  RunningTransfer(const RunningTransfer&) = delete;
  RunningTransfer& operator=(const RunningTransfer&) = delete;

 private:
  const Bridge* bridge_;
  bool counted_ = false;
};

// Ring bytes a transfer holds (a chunk, a staged transfer's landing range),
// counted from before they are reserved, so a neighbour short of room in
// between sees them held; taken off when it ends, unless kept (then whoever
// keeps them gives them back, give_back).
class TransferRoom {
 public:
  TransferRoom(const Bridge& bridge, std::uint64_t bytes) noexcept;
  ~TransferRoom();
  TransferRoom(const TransferRoom&) = delete;
  TransferRoom& operator=(const TransferRoom&) = delete;

  std::uint64_t bytes() const noexcept { return bytes_; }
  // Hands the count on; give_back(bridge, bytes) ends it.
  std::uint64_t keep() noexcept { return std::exchange(bytes_, 0); }
  // Kept bytes whose range went back to the ring: room came back.
  static void give_back(const Bridge& bridge, std::uint64_t bytes) noexcept;

  // While it waits to reserve, a chunk holds no room: out of the count, or
  // transfers waiting side by side would each wait for room none of them
  // holds (a caller's range blocking the ring stalled them all).
  class StandAside {
   public:
    explicit StandAside(TransferRoom& room) noexcept;
    ~StandAside();
    StandAside(const StandAside&) = delete;
    StandAside& operator=(const StandAside&) = delete;

   private:
    TransferRoom& room_;
  };

 private:
  const Bridge* bridge_;
  std::uint64_t bytes_ = 0;
};

// Whether a transfer short of room on `bridge` should keep waiting, asked
// by a RunningTransfer there: its neighbours (everything but the `own` bytes
// it counts itself) hold room, give some back, or did either within
// kQuietBeforeRefusing.
class RoomWatch {
 public:
  RoomWatch(const Bridge& bridge, std::uint64_t own) noexcept;

  // Other transfers run on the bridge, or hold room there.
  bool others_running() const noexcept;
  // No other transfer has held room or given any back for kQuietBeforeRefusing.
  bool others_quiet(checked::Clock::time_point now) noexcept;

 private:
  const Bridge* bridge_;
  std::uint64_t own_;
  std::uint64_t returns_seen_ = 0;
  checked::Clock::time_point quiet_since_;
};

}  // namespace devbridge::detail
