// The transfer planner (issue #24): one place that, given where bytes are and
// where they go, chooses how they travel from the backend's capabilities and
// moves them, over Bridge's public API only (every rule of the contract still
// holds underneath it).
//
//   devbridge::TransferPlanner planner(bridge);
//   auto plan = planner.plan(HostSource{bytes}, NewAllocation{spec, extent});   // Route + why
//   auto result = planner.run(HostSource{bytes}, NewAllocation{spec, extent}); // result.handle
//
// Routes, best first, each taken only where the endpoints and the backend
// allow it (plan() says which and why):
//   AdoptInPlace    a read-only caller buffer becomes the allocation itself
//                   (Bridge::adopt_host), no copy: only with
//                   TransferOptions::adopt, on a device whose memory is host
//                   memory (BackendInfo::host_addressable); the result aliases
//                   the buffer, which must outlive it unchanged.
//   RegisteredCopy  the caller's buffer registered for the call (read-only for
//                   uploads), one copy, unregistered: where registering is
//                   cheap (host_addressable or cheap_registration) and the
//                   buffer is at least registration_from_bytes.
//   DirectCopy      one copy from or into the ring range or registered region
//                   the caller gives.
//   WriteInPlace    bytes made chunk by chunk (a StreamSource) written
//                   straight into the destination's memory, no ring: only
//                   on a device whose memory is host memory
//                   (BackendInfo::host_addressable; Bridge::write_in_place).
//   ReadInPlace     bytes consumed chunk by chunk (a StreamDestination) read
//                   straight out of the source's memory, no ring: only on a
//                   device whose memory is host memory
//                   (BackendInfo::host_addressable; Bridge::read_in_place).
//   RingChunks      through the bridge's ring: a bounded window of chunk
//                   copies in flight, each range released once its copy allows;
//                   the route of a StreamSource / StreamDestination (bytes
//                   made or consumed chunk by chunk: a file, a hash) where
//                   neither in-place route can take it.
//   PeerCopy        device to device across bridges (Bridge::copy_to_peer);
//                   where the backends have no direct path, StagedThroughRings.
//   StagedThroughRings  device to device chunk by chunk: into the source's
//                   ring, straight into a range of the destination's ring, up.
//
// A planner is not thread-safe: give each thread its own (the Bridge under
// it is). It must not outlive its Bridge.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "devbridge/bridge.hpp"
#include "devbridge/types.hpp"

namespace devbridge {

enum class Route : std::uint8_t {
  Nothing,  // zero bytes: no copy (a new allocation is still made)
  AdoptInPlace,
  RegisteredCopy,
  DirectCopy,
  RingChunks,
  PeerCopy,
  StagedThroughRings,
  WriteInPlace,
  ReadInPlace,
};
// "nothing", "adopt_in_place", "registered_copy", "direct_copy",
// "ring_chunks", "peer_copy", "staged_through_rings", "write_in_place",
// "read_in_place".
std::string_view route_name(Route route) noexcept;

// ---- endpoints ----
// A caller's host bytes, valid and unchanged for the call (for AdoptInPlace:
// for the life of the allocation).
struct HostSource {
  std::span<const std::byte> bytes;
};
// A caller's host bytes the transfer writes, valid for the call.
struct HostDestination {
  std::span<std::byte> bytes;
};
// Bytes the caller produces chunk by chunk (a file read, a decoder): `fill`
// writes bytes [offset, offset + chunk.size()) of the source into `chunk`, a
// ring range, in order, or, by WriteInPlace where device memory is host
// memory, the destination's own bytes. They exist nowhere to register. An
// exception `fill` throws ends the transfer as it is.
struct StreamSource {
  std::uint64_t bytes = 0;
  std::function<void(std::uint64_t offset, std::span<std::byte> chunk)> fill{};
};
// Bytes the caller consumes chunk by chunk (a file write, a hash): `sink`
// reads bytes [offset, offset + chunk.size()) of the transfer from `chunk`,
// valid only during the call and never to be written, in order: a ring range,
// or, by ReadInPlace where device memory is host memory, the source's own
// bytes.
struct StreamDestination {
  std::uint64_t bytes = 0;
  std::function<void(std::uint64_t offset, std::span<const std::byte> chunk)> sink{};
};
// A range the caller reserved in the planner's bridge's ring.
struct RingSpan {
  HostRange range;
};
// A range of a region registered with the planner's bridge.
struct RegionSpan {
  RegionRange range;
};
// Bytes [offset, offset + bytes) of an allocation of `bridge` (null: the
// planner's). A source's `bytes` unset means as many as the destination
// holds; a destination's is the source's length (set, it must agree).
struct DeviceSpan {
  DeviceHandle handle;
  std::uint64_t offset = 0;
  std::optional<std::uint64_t> bytes = std::nullopt;
  Bridge* bridge = nullptr;
};
// A new allocation of the planner's bridge holding the bytes at offset 0.
struct NewAllocation {
  ObjectSpec spec;
  std::uint64_t extent = 0;
};

// Bytes the caller makes into several allocations at once (submit_scatter):
// `fill` writes bytes [offset, offset + the pieces' total) of the stream into
// `pieces`, in order, each piece the next bytes of one destination (a
// destination may be cut across calls). The pieces are the destinations' own
// memory by WriteInPlace (one call may fill many small tensors: one read of
// adjacent file bytes), else one ring chunk per call.
struct ScatterSource {
  std::function<void(std::uint64_t offset, std::span<const std::span<std::byte>> pieces)> fill{};
};

// Called from inside a fill or sink a TransferPlanner runs on this thread:
// an owner that keeps the memory of the chunk the callback was handed
// allocated until it is destroyed (a ring chunk: the ring, past a close; an
// allocation's own bytes, read or written in place: the allocation, past its
// free and a close, from the end of the write on); null elsewhere. The
// bridge may still use the bytes again: this is for a binding whose caller
// kept a reference to a chunk past its call against the rules (Python's
// buffer exports), so that what it holds reads stale bytes, never freed
// memory.
std::shared_ptr<void> keep_lent_chunk_memory();

using TransferSource = std::variant<HostSource, RingSpan, RegionSpan, DeviceSpan, StreamSource>;
using TransferDestination =
    std::variant<HostDestination, RingSpan, RegionSpan, DeviceSpan, NewAllocation, StreamDestination>;

struct TransferOptions {
  // ---- ring chunks (the fields, in order, of the Stager's options) ----
  // Bytes staged per chunk. 0 (the default): a quarter of the ring and at
  // most half the bridge's in-flight budget, rounded down to 4096, at least
  // 4096 (less only when the ring or the budget is smaller than that). A
  // chunk larger than the ring or the in-flight budget could never be staged:
  // the constructor refuses it with InvalidRange.
  std::uint64_t chunk_bytes = 0;
  // Chunk copies kept in flight at once (at least 1); the ring and the
  // in-flight budget bound it too (on Backpressure the oldest chunk finishes).
  std::uint32_t max_chunks_in_flight = 4;
  // After a failure, how long cleanup waits in all for this call's copies
  // still in flight before handing their ranges to the bridge, which releases
  // each once its copy ends (Bridge::release_host_after; stranded_ranges()).
  // Negative is refused with InvalidRange; nanoseconds::max() waits until
  // they end (or the bridge closes).
  std::chrono::nanoseconds cleanup_timeout = std::chrono::seconds(30);
  // Called as bytes land (after each chunk, or once for a one-copy route)
  // with the bytes done so far and the total. It may throw: the call then
  // cleans up and propagates the exception.
  std::function<void(std::uint64_t done, std::uint64_t total)> progress = nullptr;
  // Called about every 20 ms while a ring-chunk transfer waits for a copy of
  // its own or for ring room copies hold (a lost completion would otherwise
  // keep it waiting for good). It may throw (a stop signal, a stall limit,
  // Python's KeyboardInterrupt): the call then cleans up as for any failure
  // (within cleanup_timeout) and propagates the exception. Null: the waits
  // are not interrupted.
  std::function<void()> while_waiting = nullptr;

  // ---- route choice ----
  // The caller permits AdoptInPlace: the new allocation may alias the
  // source buffer, which then must stay alive and unchanged while it lives.
  bool adopt = false;
  // Smallest buffer worth a registration where registering is cheap (below
  // it the ring's second memcpy costs less than registering).
  std::uint64_t registration_from_bytes = 1ull << 20;
  // Take this route instead of choosing one (tests, benchmarks, the Stager);
  // refused with InvalidRange, naming why, where the endpoints do not allow it.
  std::optional<Route> route = std::nullopt;

  // ---- room held by others ----
  // When the ring or the in-flight budget is full and none of this call's
  // own chunks is left to finish (another caller of the bridge holds the
  // room: a second planner, a consumer's reservations), how long the call
  // waits for room to come back before Backpressure; each time it is short
  // of room, so a long transfer behind a busy neighbour fails only when the
  // neighbour stalls. The bridge wakes the wait as ranges are released and
  // copies end. 0 (the default): refuse at once. Negative is refused with
  // InvalidRange; nanoseconds::max() waits until there is room (or the
  // bridge closes). Room that another transfer on the same bridge holds
  // (another planner call's chunks in flight, any thread) comes back as its
  // copies end: that is waited for at least 60 s whatever this says, so
  // concurrent transfers share the ring instead of failing.
  std::chrono::nanoseconds wait_for_room{0};
};

struct TransferPlan {
  Route route = Route::Nothing;
  std::string reason;      // why this route, in words (docs, `devbridge info`, Python display)
  std::uint64_t bytes = 0;  // the transfer's length
  std::uint64_t chunk_bytes = 0;  // RingChunks / StagedThroughRings: bytes per chunk
};

// A chunk copy submit() left in flight: its ring range is the bridge's
// (Bridge::release_host_after), released once the copy ends.
struct PendingCopy {
  CopyEvent event;
  std::uint64_t index = 0;   // the chunk's number, from 0
  std::uint64_t offset = 0;  // its first byte, counted from the start of the transfer
  std::uint64_t bytes = 0;
};

struct TransferResult {
  Route route = Route::Nothing;  // the route taken (PeerCopy may end as StagedThroughRings)
  std::uint64_t bytes = 0;
  // NewAllocation: the allocation made (read-only when adopted).
  std::optional<DeviceHandle> handle{};
  // AdoptInPlace: the read-only registration of the caller's buffer the
  // allocation lies in. The bridge refuses to unregister it while the
  // allocation lives; the caller unregisters it (Bridge::unregister_host)
  // once the allocation is freed, or a restart or close() gives it back.
  std::optional<HostRegion> adopted_region{};
  // submit() only: the chunk copies still in flight, oldest first. The
  // destination holds the bytes once every event has completed
  // (Bridge::wait); a failed one keeps its error for the caller to report.
  std::vector<PendingCopy> pending{};
};

class TransferPlanner {
 public:
  // Throws InvalidRange for an unusable option (chunk_bytes larger than the
  // ring or the in-flight budget, max_chunks_in_flight 0, a negative
  // cleanup_timeout), Closed when the bridge is closed already.
  explicit TransferPlanner(Bridge& bridge, TransferOptions options = {});
  // Holds no ranges: those a failed call could not release wait in the
  // bridge (Bridge::release_host_after).
  ~TransferPlanner();
  TransferPlanner(const TransferPlanner&) = delete;
  TransferPlanner& operator=(const TransferPlanner&) = delete;

  // Which route run() would take, and why; validates the endpoints as run()
  // does (InvalidRange naming the range at fault, UnknownDeviceHandle, ...)
  // and changes nothing.
  TransferPlan plan(const TransferSource& source, const TransferDestination& destination) const;
  // Moves the bytes; returns once they have landed. Every error keeps the
  // kind the bridge gave (DeviceCopyFailed, OutputCopyFailed, Closed, Broken,
  // Backpressure when the room is held by others, ...) and names the chunk
  // or range at fault: "upload chunk 3 (bytes 49152..65536 of 1048576, device
  // offset 49152 of handle {...}): DeviceCopyFailed: ...". On failure nothing
  // is left registered or reserved that no copy uses, and a NewAllocation is
  // freed (a deferred release() if a copy may still use it); a destination
  // may hold the chunks that completed before the failure.
  TransferResult run(const TransferSource& source, const TransferDestination& destination);
  // As run(), but an upload by RingChunks returns once every chunk is staged
  // and its copy submitted, without waiting for the copies: each range goes
  // to the bridge at once (Bridge::release_host_after), and result.pending
  // holds the copies still in flight, for the caller to wait on before the
  // destination is read (the source buffer is no longer needed). Every other
  // route is synchronous and leaves result.pending empty. The in-flight
  // window (max_chunks_in_flight) does not apply: where the ring or the
  // budget is full, submit() waits for ranges the bridge releases as their
  // copies end. On failure it waits (up to cleanup_timeout) for the copies it
  // submitted, frees a NewAllocation and names the chunk as run() does.
  TransferResult submit(const TransferSource& source, const TransferDestination& destination);
  // submit() of one stream into several allocations, in order: each
  // destination's `bytes` must be set (its share of the stream). Where every
  // destination can take WriteInPlace, one Bridge::write_in_place holds them
  // all and `fill` is called with up to chunk_bytes() of pieces at a time;
  // otherwise each destination is a submit() of a StreamSource. One result
  // per destination (route, bytes, its copies in flight, offsets counted
  // from the destination's own start). On failure every copy it submitted is
  // waited for (up to cleanup_timeout) and the error names the destination.
  std::vector<TransferResult> submit_scatter(const ScatterSource& source, std::span<const DeviceSpan> destinations);

  // The everyday three.
  DeviceHandle upload(std::span<const std::byte> bytes, const ObjectSpec& spec, std::uint64_t extent);
  void upload_into(DeviceHandle handle, std::uint64_t device_offset, std::span<const std::byte> bytes);
  void download(DeviceHandle handle, std::uint64_t device_offset, std::span<std::byte> out);

  const TransferOptions& options() const noexcept { return options_; }
  Bridge& bridge() const noexcept { return bridge_; }
  // The chunk size in use (options.chunk_bytes or its default; a transfer
  // into an allocation of wider elements rounds it down to a whole element).
  std::uint64_t chunk_bytes() const noexcept { return chunk_bytes_; }
  // Ring ranges still waiting in the bridge for their copies to end
  // (Bridge::release_host_after: BridgeStats::ring_releases_pending, which
  // counts every caller's, not only this planner's): a failed call hands
  // over the ranges its copies may still use. The bridge releases each once
  // its copy ends (noticed by any call that applies completions, or reserve).
  std::size_t stranded_ranges() const;
  // Applies the bridge's completions (Bridge::poll), releasing the waiting
  // ranges whose copies ended; returns how many still wait.
  std::size_t release_stranded();

 private:
  TransferResult execute(const TransferSource& source, const TransferDestination& destination,
                         std::vector<PendingCopy>* pending);

  Bridge& bridge_;
  TransferOptions options_;
  std::uint64_t chunk_bytes_ = 0;
  // What the route depends on, asked of the backend once: describe() can
  // cost tens of microseconds (the host reads /proc/meminfo), which a
  // restore of thousands of small tensors would pay twice per tensor.
  BackendCapabilities capabilities_;
};

}  // namespace devbridge
