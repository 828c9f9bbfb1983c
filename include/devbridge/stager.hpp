// The staging layer (issue #13): one call moves a span of bytes of any size
// between host memory and a device allocation through the bridge's host ring,
// in chunks, with the ring bookkeeping users otherwise write by hand. It is
// the transfer planner's (transfer.hpp) ring-chunks face: every call takes
// Route::RingChunks, whatever the backend could do instead (use a
// TransferPlanner to let it choose).
//
//   devbridge::Stager stager(bridge);
//   auto h = stager.upload(std::as_bytes(std::span(weights)), spec, extent);  // returns once on the device
//   stager.download(h, 0, std::as_writable_bytes(std::span(out)));
//
// A Stager is not thread-safe: give each thread its own (the Bridge under
// them is). It must not outlive its Bridge.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "devbridge/bridge.hpp"
#include "devbridge/transfer.hpp"
#include "devbridge/types.hpp"

namespace devbridge {

struct StagerOptions {
  // Bytes staged per chunk. 0 (the default): a quarter of the ring and at
  // most half the bridge's in-flight budget, rounded down to 4096, at least
  // 4096 (less only when the ring or the budget is smaller than that).
  // A chunk larger than the ring or the in-flight budget could never be
  // staged: the constructor refuses it with InvalidRange.
  std::uint64_t chunk_bytes = 0;
  // Chunk copies kept in flight at once (at least 1). More overlaps the
  // memcpy into the ring with the device copies; the ring and the in-flight
  // budget bound it too (on Backpressure the Stager finishes its oldest chunk).
  std::uint32_t max_chunks_in_flight = 4;
  // After a failure, how long cleanup waits in all for this call's copies
  // still in flight before handing their ranges to the bridge, which releases
  // each once its copy ends (Bridge::release_host_after; stranded_ranges()).
  // Negative is refused with InvalidRange; nanoseconds::max() waits until
  // they end (or the bridge closes).
  std::chrono::nanoseconds cleanup_timeout = std::chrono::seconds(30);
  // Called after each chunk has completed and its ring range is back, with
  // the bytes of this call done so far and its total. It may throw: the call
  // then cleans up and propagates the exception.
  std::function<void(std::uint64_t done, std::uint64_t total)> progress = nullptr;
};

class Stager {
 public:
  // Throws InvalidRange for an unusable option (chunk_bytes larger than the
  // ring or the in-flight budget, max_chunks_in_flight 0, a negative
  // cleanup_timeout), Closed when the bridge is closed already.
  explicit Stager(Bridge& bridge, StagerOptions options = {});
  // Holds no ranges: those a failed call could not release wait in the
  // bridge (Bridge::release_host_after).
  ~Stager();
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  // A new allocation of `spec` and `extent` holding `bytes` at offset 0.
  // Returns once every chunk copy has completed. On any failure the
  // allocation is freed (a deferred release() if a copy may still use it)
  // and nothing is returned. InvalidRange, before anything is allocated,
  // when `bytes` does not fit the extent or is not a whole number of the
  // spec's elements.
  DeviceHandle upload(std::span<const std::byte> bytes, const ObjectSpec& spec, std::uint64_t extent);
  // `bytes` into an existing allocation at `device_offset`. Returns once
  // every chunk copy has completed. Offset and size must be multiples of the
  // allocation's element size and lie inside its extent (InvalidRange,
  // checked before any copy). On failure the bytes before the failed chunk
  // may already be on the device. Into an allocation a live view reads, the
  // bridge's BridgeOptions::writes_under_view decides (by default each chunk
  // is refused: AllocationStillInUse naming chunk 0).
  void upload_into(DeviceHandle handle, std::uint64_t device_offset, std::span<const std::byte> bytes);
  // `out.size()` bytes of the allocation from `device_offset` into `out`,
  // validated like upload_into. On failure `out` holds the chunks that
  // completed before it.
  void download(DeviceHandle handle, std::uint64_t device_offset, std::span<std::byte> out);

  // Every error propagates as devbridge::Error of the kind the bridge gave
  // (DeviceCopyFailed, OutputCopyFailed, Closed, Broken, Backpressure when
  // the room is held by others, ...); its message names the chunk:
  // "upload chunk 3 (bytes 49152..65536 of 1048576, device offset 49152 of
  // handle {...}): DeviceCopyFailed: ...". Cleanup never releases a ring
  // range a copy may still read or write: it waits up to cleanup_timeout,
  // then hands the ranges still in use to the bridge (release_host_after).

  // The chunk size in use (options.chunk_bytes or its default; a call into
  // an allocation of wider elements rounds it down to a whole element).
  std::uint64_t chunk_bytes() const noexcept { return planner_.chunk_bytes(); }
  // Ring ranges still waiting in the bridge for their copies to end
  // (TransferPlanner::stranded_ranges: the bridge's count, every caller's).
  std::size_t stranded_ranges() const { return planner_.stranded_ranges(); }
  // Applies the bridge's completions, releasing the waiting ranges whose
  // copies ended; returns how many still wait.
  std::size_t release_stranded() { return planner_.release_stranded(); }

 private:
  TransferPlanner planner_;
};

}  // namespace devbridge
