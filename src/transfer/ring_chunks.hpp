// The ring-chunk pipeline (TransferPlanner's RingChunks route, and one leg of
// StagedThroughRings): caller bytes <-> ring chunks <-> device, a window of
// chunk copies in flight, each range released as soon as its copy allows,
// Backpressure answered by finishing this call's oldest chunk, and cleanup
// that never releases a range a copy may still read or write.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "devbridge/bridge.hpp"
#include "devbridge/transfer.hpp"
#include "devbridge/types.hpp"

namespace devbridge::detail {

// One chunked upload or download, validated by the caller.
struct RingChunkJob {
  CopyDirection direction = CopyDirection::HostToDevice;
  DeviceHandle handle;
  std::uint64_t device_offset = 0;
  std::uint64_t total = 0;
  std::uint64_t chunk_bytes = 0;  // whole elements of the allocation
  std::span<const std::byte> source;  // uploads
  std::span<std::byte> destination;   // downloads
  // Set: a StreamSource's fill writes each upload chunk into the ring
  // instead of a copy from `source`; a StreamDestination's sink reads each
  // download chunk from the ring instead of a copy into `destination`.
  const std::function<void(std::uint64_t, std::span<std::byte>)>* fill = nullptr;
  const std::function<void(std::uint64_t, std::span<const std::byte>)>* sink = nullptr;
};

// How long a transfer short of room waits, at most, while other transfers
// on its bridge hold it or give it back (their chunks in flight): long
// enough for any busy neighbour, short enough that one whose copies stalled
// is reported.
inline constexpr std::chrono::nanoseconds kWaitForOtherTransfers = std::chrono::seconds(60);

struct RingChunkSettings {
  std::uint32_t max_chunks_in_flight = 4;
  std::chrono::nanoseconds cleanup_timeout{0};
  // How long a wait for room lasts at least (TransferOptions).
  std::chrono::nanoseconds wait_for_room{0};
  // Null: no progress reported.
  const std::function<void(std::uint64_t, std::uint64_t)>* progress = nullptr;
  // Null: waits for copies and room are not interrupted (TransferOptions).
  const std::function<void()>* while_waiting = nullptr;
  // False: room other transfers hold is waited for no longer than
  // wait_for_room says (a staged transfer's download, which holds a landing
  // range on another bridge meanwhile: it backs off instead of waiting, so
  // two transfers crossing each other never wait on each other's rings).
  bool wait_for_other_transfers = true;
  // Uploads only (TransferPlanner::submit): non-null, each chunk's range is
  // handed to the bridge (release_host_after) as soon as its copy is
  // submitted, its copy recorded here, and nothing is waited for; room the
  // ring or the budget lacks is waited for as the bridge releases ranges.
  std::vector<PendingCopy>* submitted = nullptr;
};

// Runs `job` through `bridge`'s ring. Ranges a failed call could not give
// back at once (a copy may still use them) are handed to the bridge
// (Bridge::release_host_after), which releases each once its copy is done.
void run_ring_chunks(Bridge& bridge, const RingChunkSettings& settings, const RingChunkJob& job);

// Gives `range` back to the ring; false while it must stay reserved (a copy
// may still use it, or the bridge is Broken).
bool try_release(Bridge& bridge, HostRange range) noexcept;

// Something a call took from `bridge` (a ring range, a registration, an
// allocation): given back by `GiveBack` when the guard ends, unless kept.
template <class T, void (*GiveBack)(Bridge&, T) noexcept>
class Taken {
 public:
  Taken(Bridge& bridge, T value) noexcept : bridge_(bridge), value_(value) {}
  Taken(const Taken&) = delete;
  Taken& operator=(const Taken&) = delete;
  ~Taken() {
    if (!kept_) GiveBack(bridge_, value_);
  }
  T get() const noexcept { return value_; }
  // Hands it on (to the window, to the caller): no longer given back here.
  T keep() noexcept {
    kept_ = true;
    return value_;
  }

 private:
  Bridge& bridge_;
  T value_;
  bool kept_ = false;
};

inline void give_back_range(Bridge& bridge, HostRange range) noexcept { try_release(bridge, range); }
// A range this call reserved that no copy uses yet: released unless handed
// on to the window (which then owns it).
using ReservedRange = Taken<HostRange, give_back_range>;

// The default chunk for a ring and an in-flight budget (TransferOptions::chunk_bytes).
std::uint64_t default_chunk_bytes(std::uint64_t ring_capacity, std::uint64_t inflight_budget);

// Refuses (InvalidRange) `bytes` at `device_offset` unless they lie inside
// `extent` and are whole elements of `element_size`, before any copy starts;
// `end` ("from", "into") says which end of the transfer `target` is.
void check_device_range(std::string_view verb, std::string_view end, std::string_view target,
                        std::uint64_t device_offset, std::uint64_t bytes, std::uint64_t extent,
                        std::uint32_t element_size);

}  // namespace devbridge::detail
