// The transfer planner (transfer.hpp): validates the two ends, chooses the
// route from the backend's capabilities, and runs it over Bridge's public API.
#include "devbridge/transfer.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "core/describe.hpp"
#include "core/fail.hpp"
#include "core/log.hpp"
#include "devbridge/checked.hpp"
#include "transfer/lent_chunk.hpp"
#include "transfer/ring_chunks.hpp"
#include "transfer/transfer_room.hpp"

namespace devbridge {

std::string_view route_name(Route route) noexcept {
  switch (route) {
    case Route::Nothing: return "nothing";
    case Route::AdoptInPlace: return "adopt_in_place";
    case Route::RegisteredCopy: return "registered_copy";
    case Route::DirectCopy: return "direct_copy";
    case Route::RingChunks: return "ring_chunks";
    case Route::PeerCopy: return "peer_copy";
    case Route::StagedThroughRings: return "staged_through_rings";
    case Route::WriteInPlace: return "write_in_place";
    case Route::ReadInPlace: return "read_in_place";
  }
  return "unknown";
}

namespace {

using detail::describe;
using detail::fail;

// A lease of one element of `handle`: it holds the allocation's memory (past
// its free and a close) and nothing more, for what a callback kept of bytes
// it was lent in place (keep_lent_chunk_memory).
std::shared_ptr<void> lease_of_memory(Bridge& bridge, DeviceHandle handle) {
  const ObjectSpec spec = bridge.spec(handle);
  ViewSpec one{spec.dtype.value_or(DType::UInt8), {}};
  const int rank = spec.shape == ShapeKind::Tensor ? 1 : static_cast<int>(spec.shape);  // what its kind allows
  for (int i = 0; i < rank; ++i) one.shape.push_back(1);
  return std::make_shared<ViewLease>(bridge.view(handle, one, ViewWait::Refuse));
}

// What a fill keeps of bytes it writes in place: a lease taken during the
// write would be a view under the caller's own write (refused), so the
// owner it is handed is given the leases of `ranges`' allocations once the
// write has ended: as this goes, after the write returned or threw.
class KeptAfterWrite {
 public:
  KeptAfterWrite(Bridge& bridge, std::span<const DeviceRange> ranges) : bridge_(bridge), ranges_(ranges) {}
  ~KeptAfterWrite() { settle(); }
  KeptAfterWrite(const KeptAfterWrite&) = delete;
  KeptAfterWrite& operator=(const KeptAfterWrite&) = delete;
  const detail::LendingChunk::Keep& keep() const noexcept { return keep_; }

 private:
  void settle() noexcept {
    if (!owner_ || owner_.use_count() == 1) return;  // nothing kept, or let go already
    for (const DeviceRange& range : ranges_) {
      try {
        owner_->push_back(lease_of_memory(bridge_, range.handle));
      } catch (...) {  // freed or closed meanwhile by another thread: nothing left to hold
      }
    }
  }

  using Leases = std::vector<std::shared_ptr<void>>;
  Bridge& bridge_;
  std::span<const DeviceRange> ranges_;
  std::shared_ptr<Leases> owner_;
  const detail::LendingChunk::Keep keep_ = [this]() -> std::shared_ptr<void> {
    if (!owner_) owner_ = std::make_shared<Leases>();
    return owner_;
  };
};

// One end of a transfer, whatever the caller gave.
struct End {
  enum class Kind : std::uint8_t { Host, Ring, Region, Device, New } kind = Kind::Host;
  std::span<const std::byte> host_in;  // a HostSource
  std::span<std::byte> host_out;       // a HostDestination
  // A StreamSource / StreamDestination (kind Host): bytes made or consumed chunk by chunk.
  const std::function<void(std::uint64_t, std::span<std::byte>)>* fill = nullptr;
  const std::function<void(std::uint64_t, std::span<const std::byte>)>* sink = nullptr;
  bool streamed() const noexcept { return fill != nullptr || sink != nullptr; }
  HostRange ring;
  RegionRange region;
  Bridge* bridge = nullptr;  // Device and New: never null once resolved
  DeviceHandle handle;
  std::uint64_t offset = 0;
  std::optional<std::uint64_t> bytes;  // the length it fixes, if any
  ObjectSpec spec;  // New
  std::uint64_t extent = 0;
  std::uint32_t element_size = 1;

  bool device() const noexcept { return kind == Kind::Device || kind == Kind::New; }
  std::string name() const {
    switch (kind) {
      case Kind::Host:
        return fmt::format("the caller's {} {}host bytes", bytes.value_or(0), streamed() ? "streamed " : "");
      case Kind::Ring: return describe(ring);
      case Kind::Region: return describe(region);
      case Kind::Device: return describe(handle);
      case Kind::New: return "a new allocation";
    }
    return {};
  }
};

// Each endpoint the caller can give, as an End.
void fill(End& end, const HostSource& s, Bridge&) {
  end.kind = End::Kind::Host;
  end.host_in = s.bytes;
  end.bytes = s.bytes.size();
}
void fill(End& end, const HostDestination& d, Bridge&) {
  end.kind = End::Kind::Host;
  end.host_out = d.bytes;
  end.bytes = d.bytes.size();
}
void fill(End& end, const StreamSource& s, Bridge&) {
  if (!s.fill) fail(ErrorKind::InvalidRange, "a StreamSource of {} bytes has no fill function", s.bytes);
  end.kind = End::Kind::Host;
  end.fill = &s.fill;
  end.bytes = s.bytes;
}
void fill(End& end, const StreamDestination& d, Bridge&) {
  if (!d.sink) fail(ErrorKind::InvalidRange, "a StreamDestination of {} bytes has no sink function", d.bytes);
  end.kind = End::Kind::Host;
  end.sink = &d.sink;
  end.bytes = d.bytes;
}
void fill(End& end, const RingSpan& s, Bridge&) {
  end.kind = End::Kind::Ring;
  end.ring = s.range;
  end.bytes = s.range.len;
}
void fill(End& end, const RegionSpan& s, Bridge&) {
  end.kind = End::Kind::Region;
  end.region = s.range;
  end.bytes = s.range.len;
}
void fill(End& end, const DeviceSpan& s, Bridge& own) {
  end.kind = End::Kind::Device;
  end.bridge = s.bridge != nullptr ? s.bridge : &own;
  end.handle = s.handle;
  end.offset = s.offset;
  end.bytes = s.bytes;
}
void fill(End& end, const NewAllocation& d, Bridge& own) {
  end.kind = End::Kind::New;
  end.bridge = &own;
  end.spec = d.spec;
  end.extent = d.extent;
  end.element_size = spec_element_size(d.spec);
}

template <class Endpoint>
End resolve_end(const Endpoint& endpoint, Bridge& own) {
  End end;
  std::visit([&](const auto& e) { fill(end, e, own); }, endpoint);
  return end;
}

// The transfer, validated: both ends and its length.
struct Resolved {
  End source, destination;
  std::uint64_t bytes = 0;
  std::string_view verb;  // "upload", "download", "copy"

  bool upload() const noexcept { return !source.device(); }
  bool download() const noexcept { return !destination.device(); }
  Bridge& device_bridge() const noexcept { return *(destination.device() ? destination.bridge : source.bridge); }
  std::string describe_it() const {
    return fmt::format("{} of {} bytes from {} to {}", verb, bytes, source.name(), destination.name());
  }
};

Resolved resolve(const TransferSource& source, const TransferDestination& destination, Bridge& own) {
  Resolved r{resolve_end(source, own), resolve_end(destination, own), 0, {}};
  const bool source_device = r.source.device();
  const bool destination_device = r.destination.device();
  r.verb = source_device ? (destination_device ? "copy" : "download") : "upload";
  if (!source_device && !destination_device)
    fail(ErrorKind::InvalidRange, "a transfer from {} to {}: neither end is device memory", r.source.name(),
         r.destination.name());
  if (source_device != destination_device && &r.device_bridge() != &own)
    fail(ErrorKind::InvalidRange,
         "{} from {} to {}: host memory moves through the planner's own bridge, and the allocation belongs to "
         "another: use a planner of that bridge",
         r.verb, r.source.name(), r.destination.name());

  // spec() and extent() refuse a closed bridge and an unknown, old or foreign handle.
  for (End* end : {&r.source, &r.destination})
    if (end->kind == End::Kind::Device) {
      end->element_size = spec_element_size(end->bridge->spec(end->handle));
      end->extent = end->bridge->extent(end->handle);
    }
  // A new allocation is refused here as alloc_device would refuse it: plan() says so too.
  if (r.destination.kind == End::Kind::New) r.destination.bridge->check_allocation(r.destination.spec, r.destination.extent);
  // The length: the source's, else the destination's, else the rest of the source allocation.
  if (r.source.bytes)
    r.bytes = *r.source.bytes;
  else if (r.destination.bytes)
    r.bytes = *r.destination.bytes;
  else if (r.destination.kind == End::Kind::New)
    r.bytes = r.destination.extent;
  else
    r.bytes = r.source.offset <= r.source.extent ? r.source.extent - r.source.offset : 0;
  if (r.destination.bytes && *r.destination.bytes != r.bytes)
    fail(ErrorKind::InvalidRange, "{} of {} bytes from {} into {} of {} bytes: the lengths differ", r.verb, r.bytes,
         r.source.name(), r.destination.name(), *r.destination.bytes);
  for (const End* end : {&r.source, &r.destination})
    if (end->device())
      detail::check_device_range(r.verb, end == &r.source ? "from" : "into", end->name(), end->offset, r.bytes,
                                 end->extent, end->element_size);
  // Chunk by chunk, an overlapping copy within one allocation would read
  // bytes it has already overwritten (both ranges lie inside the extent, so
  // these sums do not overflow).
  if (r.source.kind == End::Kind::Device && r.destination.kind == End::Kind::Device &&
      r.source.bridge == r.destination.bridge && r.source.handle == r.destination.handle && r.bytes != 0 &&
      r.source.offset < r.destination.offset + r.bytes && r.destination.offset < r.source.offset + r.bytes)
    fail(ErrorKind::InvalidRange, "copy of {} bytes within {} from offset {} to offset {}: the ranges overlap", r.bytes,
         r.source.name(), r.source.offset, r.destination.offset);
  return r;
}

bool aligned(const void* pointer, std::uint64_t alignment) noexcept {
  return alignment <= 1 || reinterpret_cast<std::uintptr_t>(pointer) % alignment == 0;
}

// Why AdoptInPlace cannot take this upload; empty when it can.
std::string adopt_refusal(const Resolved& r, const TransferOptions& options, bool host_addressable) {
  if (r.destination.kind != End::Kind::New) return "adoption makes a new allocation; the destination is an existing one";
  if (!options.adopt) return "TransferOptions::adopt is off (the allocation would alias the caller's buffer)";
  if (r.bytes != r.destination.extent)
    return fmt::format("the buffer's {} bytes are not the whole extent of {} bytes", r.bytes, r.destination.extent);
  if (!aligned(r.source.host_in.data(), r.destination.spec.alignment))
    return fmt::format("the buffer does not start at a multiple of the spec's alignment {}", r.destination.spec.alignment);
  // Asked for by name, the backend's adopt_host decides (the fake adopts
  // too; Unsupported where the device cannot address host memory).
  if (!host_addressable && !options.route)
    return "device memory is not host memory here (BackendInfo::host_addressable is false)";
  return {};
}

// The route for `r` and why, or InvalidRange where options.route is not possible.
TransferPlan choose(const Resolved& r, const TransferOptions& options, const BackendCapabilities& info,
                    std::uint64_t chunk_bytes) {
  TransferPlan plan;
  plan.bytes = r.bytes;
  const bool host_buffer = (r.upload() && r.source.kind == End::Kind::Host) ||
                           (r.download() && r.destination.kind == End::Kind::Host);
  const bool cheap = info.host_addressable || info.cheap_registration;
  const std::optional<Route> forced = options.route;
  auto refuse = [&](std::string_view why) {
    fail(ErrorKind::InvalidRange, "TransferOptions::route {} is not possible for the {}: {}", route_name(*forced),
         r.describe_it(), why);
  };
  auto take = [&](Route route, std::string reason) {
    plan.route = route;
    plan.reason = std::move(reason);
  };

  if (r.bytes == 0) {
    take(Route::Nothing, "zero bytes: no copy");
  } else if (!r.upload() && !r.download()) {
    const bool other_bridge = r.source.bridge != r.destination.bridge;
    if (forced == Route::PeerCopy && !other_bridge) refuse("both allocations belong to one bridge");
    if (forced && *forced != Route::PeerCopy && *forced != Route::StagedThroughRings)
      refuse("device to device goes by peer_copy or staged_through_rings");
    if (forced ? *forced == Route::PeerCopy : other_bridge)
      take(Route::PeerCopy,
           "device to device between two bridges: Bridge::copy_to_peer, or staged through both rings where the "
           "backends have no direct path");
    else
      take(Route::StagedThroughRings, forced ? "as TransferOptions::route asks"
                                             : "device to device within one bridge: through its ring, chunk by chunk");
  } else if ((r.upload() && r.source.streamed()) || (r.download() && r.destination.streamed())) {
    const Route in_place_route = r.upload() ? Route::WriteInPlace : Route::ReadInPlace;
    const bool in_place = r.upload() ? info.host_addressable || info.maps_for_write : info.host_addressable;
    if (forced && *forced != Route::RingChunks && !(*forced == in_place_route && in_place))
      refuse(r.upload() ? "streamed bytes move by ring_chunks, or write_in_place where device memory is host memory "
                          "or can be mapped for writing (BackendInfo::host_addressable, maps_for_write)"
                        : "streamed bytes move out by ring_chunks, or read_in_place where device memory is host memory "
                          "(BackendInfo::host_addressable)");
    if (forced ? *forced == in_place_route : in_place)
      take(in_place_route,
           !r.upload() ? "bytes consumed chunk by chunk, on a device whose memory is host memory: read straight out "
                         "of the allocation, no ring (no copy before the consumer's)"
           : info.host_addressable
               ? "bytes made chunk by chunk, on a device whose memory is host memory: written straight into the "
                 "allocation, no ring (one copy instead of two)"
               : "bytes made chunk by chunk, on a device whose memory can be mapped for writing: written straight "
                 "into the mapped allocation, no ring (one copy instead of two)");
    else
      take(Route::RingChunks, "bytes made or consumed chunk by chunk: through the ring");
  } else if (!host_buffer) {
    if (forced && *forced != Route::DirectCopy) refuse("a ring range or registered region moves by one direct_copy");
    take(Route::DirectCopy, "the host bytes are already in the ring or a registered region: one copy");
  } else {
    const std::string no_adopt = r.upload() ? adopt_refusal(r, options, info.host_addressable) : "not an upload";
    if (forced) {
      if (*forced == Route::AdoptInPlace && !no_adopt.empty()) refuse(no_adopt);
      if (*forced != Route::AdoptInPlace && *forced != Route::RegisteredCopy && *forced != Route::RingChunks)
        refuse("a caller's host buffer moves by adopt_in_place, registered_copy or ring_chunks");
      take(*forced, "as TransferOptions::route asks");
    } else if (no_adopt.empty()) {
      take(Route::AdoptInPlace, "a read-only buffer on a device that addresses host memory: used in place, no copy");
    } else if (cheap && r.bytes >= options.registration_from_bytes) {
      take(Route::RegisteredCopy,
           fmt::format("registering is cheap here ({}) and {} bytes >= registration_from_bytes {}: one copy "
                       "instead of two through the ring",
                       info.host_addressable ? "host-addressable memory" : "host-unified memory", r.bytes,
                       options.registration_from_bytes));
    } else {
      take(Route::RingChunks,
           cheap ? fmt::format("{} bytes < registration_from_bytes {}: the ring's second copy costs less than "
                               "registering",
                               r.bytes, options.registration_from_bytes)
                 : std::string("registering pins every page here (BackendInfo::cheap_registration is false): "
                               "through the ring"));
    }
  }
  if (plan.route == Route::RingChunks || plan.route == Route::StagedThroughRings) plan.chunk_bytes = chunk_bytes;
  return plan;
}

// One chunk of a transfer staged through both rings: `move(landing)` with a
// range of `to`'s ring reserved for it (counted as held by a transfer).
// Short of room (Backpressure, on either ring) while either bridge has ranges
// waiting to go back as their copies end (release_host_after), it waits for
// one and tries again. While other transfers run on
// either bridge, the landing goes back and the chunk is tried again after a
// short pause, until their room has stayed quiet (RoomWatch) on both, for at
// most kWaitForOtherTransfers: their room comes back as their copies end,
// and nothing is held meanwhile that they could be waiting for. Alone,
// Backpressure stands.
// How long one look waits for a range a bridge releases after its copy.
constexpr auto kReleaseSlice = std::chrono::milliseconds(20);

template <class Move>
void stage_chunk_backing_off(Bridge& from, Bridge& to, std::uint64_t len, const TransferOptions& options, Move move) {
  const auto give_up = checked::deadline_after(std::max(options.wait_for_room, detail::kWaitForOtherTransfers));
  std::minstd_rand jitter(static_cast<std::uint32_t>(checked::Clock::now().time_since_epoch().count()) ^
                          static_cast<std::uint32_t>(reinterpret_cast<std::uintptr_t>(&len)));
  const detail::RunningTransfer on_from(from), on_to(to);
  detail::RoomWatch from_neighbours(from, 0), to_neighbours(to, 0);
  bool tried_again = false;
  for (;;) {
    try {
      // Counted before it is reserved, and so after it goes back: a
      // neighbour short of room in between would otherwise see none held.
      const detail::TransferRoom counted(to, len);
      const detail::ReservedRange landing(to, to.reserve(len, kRingAlignment, options.wait_for_room));
      move(landing.get());
      return;
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Backpressure || checked::Clock::now() >= give_up) throw;
      // Room held by ranges each bridge releases as their copies end (an
      // upload(wait=False)'s chunks, on this thread or another): it comes
      // back by itself, as with_room waits for it on one ring.
      if (to.wait_for_release_after(kReleaseSlice) || from.wait_for_release_after(kReleaseSlice)) {
        if (options.while_waiting) options.while_waiting();
        tried_again = false;
        continue;
      }
      const auto now = checked::Clock::now();
      if (!from_neighbours.others_running() && !to_neighbours.others_running()) {
        // Once more at once: room may have come back between the attempt and the look.
        if (std::exchange(tried_again, true)) throw;
        continue;
      }
      // Both watches look each time, so each knows when its neighbours last moved.
      const bool from_quiet = from_neighbours.others_quiet(now);
      if (to_neighbours.others_quiet(now) && from_quiet) throw;
      tried_again = false;
    }
    if (options.while_waiting) options.while_waiting();
    // Apart in time: transfers backing off from each other do not all come back at once.
    std::this_thread::sleep_for(std::chrono::microseconds(200 + jitter() % 800));
  }
}

// The same error, its message naming what was being done.
[[noreturn]] void rethrow_naming(const Error& error, std::string_view what) {
  throw Error(error.kind(), fmt::format("{}: {}", what, error.message()), error.fatal());
}

// An allocation the transfer made: freed unless it succeeds.
void free_allocation(Bridge& bridge, DeviceHandle handle) noexcept {
  try {
    bridge.free_device(handle);
  } catch (const Error& e) {
    // Closed, Broken or restarted: close() or restart() frees it.
    if (e.kind() != ErrorKind::AllocationStillInUse) return;
    try {
      bridge.release(handle);  // a copy may still use it: freed when the last one ends
    } catch (const Error&) {
    }
  }
}
using AllocationGuard = detail::Taken<DeviceHandle, free_allocation>;

// A registration of the caller's buffer for one call: unregistered at the
// end unless handed on (an adopted allocation keeps its region).
void unregister_region(Bridge& bridge, HostRegion region) noexcept {
  try {
    bridge.unregister_host(region);
  } catch (const Error& e) {
    // Closed or restarted: the region went with it. Still in use: only a
    // Broken bridge's copy could hold it; it is never copied from again.
    if (e.kind() == ErrorKind::AllocationStillInUse)
      detail::log().warn("transfer: {} left registered: {}", describe(region), e.message());
  }
}
using RegistrationGuard = detail::Taken<HostRegion, unregister_region>;

}  // namespace

TransferPlanner::TransferPlanner(Bridge& bridge, TransferOptions options)
    : bridge_(bridge), options_(std::move(options)) {
  const BridgeStats stats = bridge_.stats();
  // A closed bridge has no ring left to size chunks by.
  if (stats.closed) fail(ErrorKind::Closed, "the bridge is closed: a transfer planner cannot move bytes through it");
  const std::uint64_t ring = stats.ring_capacity;
  const std::uint64_t budget = stats.inflight_budget_bytes;
  if (options_.max_chunks_in_flight == 0)
    fail(ErrorKind::InvalidRange, "max_chunks_in_flight is 0: at least one chunk copy must be in flight");
  if (options_.cleanup_timeout < std::chrono::nanoseconds::zero())
    fail(ErrorKind::InvalidRange, "cleanup_timeout of {} ns is negative", options_.cleanup_timeout.count());
  if (options_.wait_for_room < std::chrono::nanoseconds::zero())
    fail(ErrorKind::InvalidRange, "wait_for_room of {} ns is negative", options_.wait_for_room.count());
  if (options_.chunk_bytes > ring)
    fail(ErrorKind::InvalidRange, "chunk_bytes of {} does not fit the ring of {} bytes", options_.chunk_bytes, ring);
  if (options_.chunk_bytes > budget)
    fail(ErrorKind::InvalidRange, "chunk_bytes of {} exceeds the in-flight budget of {} bytes", options_.chunk_bytes,
         budget);
  chunk_bytes_ = options_.chunk_bytes != 0 ? options_.chunk_bytes : detail::default_chunk_bytes(ring, budget);
  capabilities_ = bridge_.capabilities();
  if (chunk_bytes_ == 0)
    fail(ErrorKind::InvalidRange, "a ring of {} bytes with an in-flight budget of {} bytes leaves no room for a chunk",
         ring, budget);
}

TransferPlanner::~TransferPlanner() = default;

std::size_t TransferPlanner::stranded_ranges() const { return bridge_.stats().ring_releases_pending; }

std::size_t TransferPlanner::release_stranded() {
  try {
    bridge_.poll();  // applies completions, and with them the bridge's pending releases
  } catch (const Error&) {
    // Closed or Broken: the ranges wait for close() or a restart.
  }
  return stranded_ranges();
}

TransferPlan TransferPlanner::plan(const TransferSource& source, const TransferDestination& destination) const {
  const Resolved r = resolve(source, destination, bridge_);
  return choose(r, options_, capabilities_, chunk_bytes_);
}

TransferResult TransferPlanner::run(const TransferSource& source, const TransferDestination& destination) {
  return execute(source, destination, nullptr);
}

TransferResult TransferPlanner::submit(const TransferSource& source, const TransferDestination& destination) {
  std::vector<PendingCopy> pending;
  TransferResult result = execute(source, destination, &pending);
  result.pending = std::move(pending);
  return result;
}

TransferResult TransferPlanner::execute(const TransferSource& source, const TransferDestination& destination,
                                        std::vector<PendingCopy>* pending) {
  Resolved r = resolve(source, destination, bridge_);
  const TransferPlan plan = choose(r, options_, capabilities_, chunk_bytes_);
  TransferResult result{plan.route, r.bytes, std::nullopt, std::nullopt, {}};
  auto report_once = [&] {
    if (options_.progress) options_.progress(r.bytes, r.bytes);
  };

  if (plan.route == Route::AdoptInPlace) {
    RegistrationGuard registration(bridge_, bridge_.register_host_read_only(r.source.host_in));
    AllocationGuard adopted(bridge_, bridge_.adopt_host(RegionRange{registration.get(), 0, r.bytes},
                                                        r.destination.spec));
    report_once();  // may throw: the guards free the allocation, then unregister
    result.handle = adopted.keep();
    // The region lives as long as the allocation: the bridge refuses to
    // unregister it before, and gives it back with its generation.
    result.adopted_region = registration.keep();
    return result;
  }

  std::optional<AllocationGuard> allocation;
  if (r.destination.kind == End::Kind::New) {
    allocation.emplace(bridge_, bridge_.alloc_device(r.destination.spec, r.destination.extent));
    r.destination.handle = allocation->get();
  }
  const DeviceRange source_range{r.source.handle, r.source.offset, r.bytes};
  const DeviceRange destination_range{r.destination.handle, r.destination.offset, r.bytes};

  auto run_ring_chunks = [&] {
    const std::uint32_t element = r.upload() ? r.destination.element_size : r.source.element_size;
    detail::RingChunkJob job;
    job.direction = r.upload() ? CopyDirection::HostToDevice : CopyDirection::DeviceToHost;
    job.handle = r.upload() ? r.destination.handle : r.source.handle;
    job.device_offset = r.upload() ? r.destination.offset : r.source.offset;
    job.total = r.bytes;
    job.chunk_bytes = std::max<std::uint64_t>(chunk_bytes_ - chunk_bytes_ % element, element);
    job.source = r.source.host_in;
    job.destination = r.destination.host_out;
    job.fill = r.source.fill;
    job.sink = r.destination.sink;
    const detail::RingChunkSettings settings{.max_chunks_in_flight = options_.max_chunks_in_flight,
                                             .cleanup_timeout = options_.cleanup_timeout,
                                             .wait_for_room = options_.wait_for_room,
                                             .progress = &options_.progress,
                                             .while_waiting = &options_.while_waiting,
                                             .submitted = r.upload() ? pending : nullptr};
    detail::run_ring_chunks(bridge_, settings, job);
  };

  // An allocation's bytes handed to the caller's fill or sink in place, a
  // chunk (whole elements) at a time, as the ring route would, with progress.
  // Each chunk is held only while its callback runs (`hold_one(done, range)`
  // one write_in_place or read_in_place): a close or restart from another
  // thread waits for one chunk, not for the whole stream behind a slow
  // callback, and the next chunk then fails with Closed or
  // OldGenerationHandle.
  auto in_place_chunks = [&](const DeviceRange& all, std::uint64_t element, const auto& hold_one) {
    const std::uint64_t chunk = std::max<std::uint64_t>(chunk_bytes_ - chunk_bytes_ % element, element);
    for (std::uint64_t done = 0; done < r.bytes;) {
      const std::uint64_t len = std::min(chunk, r.bytes - done);
      hold_one(done, DeviceRange{all.handle, all.offset + done, len});
      done += len;
      if (options_.progress) options_.progress(done, r.bytes);
    }
  };

  switch (plan.route) {
    case Route::Nothing:
    case Route::AdoptInPlace:
      break;
    case Route::RegisteredCopy: {
      std::optional<RegistrationGuard> registration;
      try {
        registration.emplace(bridge_, r.upload() ? bridge_.register_host_read_only(r.source.host_in)
                                                 : bridge_.register_host(r.destination.host_out));
      } catch (const Error& e) {
        // The buffer overlaps a registration already there (the caller's
        // own): the ring takes any bytes, so a route the planner chose goes
        // that way instead; one the caller named is refused.
        if (e.kind() != ErrorKind::InvalidRange || options_.route)
          rethrow_naming(e, r.describe_it() + " (registered_copy)");
      }
      if (!registration) {
        result.route = Route::RingChunks;
        run_ring_chunks();
        break;
      }
      try {
        const RegionRange host{registration->get(), 0, r.bytes};
        if (r.upload())
          bridge_.host_to_device(host, destination_range, CopyMode::Sync);
        else
          bridge_.device_to_host(source_range, host, CopyMode::Sync);
      } catch (const Error& e) {
        rethrow_naming(e, r.describe_it() + " (registered_copy)");
      }
      report_once();
      break;
    }
    case Route::DirectCopy: {
      try {
        if (r.source.kind == End::Kind::Ring)
          bridge_.host_to_device(r.source.ring, destination_range, CopyMode::Sync);
        else if (r.source.kind == End::Kind::Region)
          bridge_.host_to_device(r.source.region, destination_range, CopyMode::Sync);
        else if (r.destination.kind == End::Kind::Ring)
          bridge_.device_to_host(source_range, r.destination.ring, CopyMode::Sync);
        else
          bridge_.device_to_host(source_range, r.destination.region, CopyMode::Sync);
      } catch (const Error& e) {
        rethrow_naming(e, r.describe_it() + " (direct_copy)");
      }
      report_once();
      break;
    }
    case Route::RingChunks:
      run_ring_chunks();
      break;
    case Route::WriteInPlace:
      try {
        in_place_chunks(destination_range, r.destination.element_size, [&](std::uint64_t at, const DeviceRange& part) {
          const KeptAfterWrite kept(bridge_, std::span(&part, 1));
          bridge_.write_in_place(std::span(&part, 1), [&](std::span<const std::span<std::byte>> pieces) {
            const detail::LendingChunk marked(kept.keep());
            (*r.source.fill)(at, pieces[0]);
          });
        });
      } catch (const Error& e) {
        rethrow_naming(e, r.describe_it() + " (write_in_place)");
      }
      break;
    case Route::ReadInPlace:
      try {
        in_place_chunks(source_range, r.source.element_size, [&](std::uint64_t at, const DeviceRange& part) {
          const detail::LendingChunk::Keep keep = [&] { return lease_of_memory(bridge_, part.handle); };
          bridge_.read_in_place(std::span(&part, 1), [&](std::span<const std::span<const std::byte>> pieces) {
            const detail::LendingChunk marked(keep);
            (*r.destination.sink)(at, pieces[0]);
          });
        });
      } catch (const Error& e) {
        rethrow_naming(e, r.describe_it() + " (read_in_place)");
      }
      break;
    case Route::PeerCopy:
    case Route::StagedThroughRings: {
      Bridge& from = *r.source.bridge;
      Bridge& to = *r.destination.bridge;
      if (plan.route == Route::PeerCopy) {
        try {
          if (from.copy_to_peer(source_range, to, destination_range)) {
            report_once();
            break;
          }
        } catch (const Error& e) {
          rethrow_naming(e, r.describe_it() + " (peer_copy)");
        }
        result.route = Route::StagedThroughRings;  // no direct path between these backends
      }
      // Chunk by chunk: down into the source's ring, out of it straight into
      // a range of the destination's ring, up from there. Each chunk is
      // whole elements of both ends and fits both rings with room to spare.
      const std::uint64_t element = std::lcm<std::uint64_t>(r.source.element_size, r.destination.element_size);
      std::uint64_t chunk = chunk_bytes_;
      for (Bridge* b : {&from, &to}) {
        const BridgeStats stats = b->stats();
        chunk = std::min(chunk, detail::default_chunk_bytes(stats.ring_capacity, stats.inflight_budget_bytes));
      }
      chunk = std::max(chunk - chunk % element, element);
      // The download does not wait for room other transfers hold on `from`
      // while this one holds its landing range on `to`: it backs off (the
      // landing given back) and tries the chunk again, so two transfers
      // crossing each other never each hold one ring and wait for the other.
      const detail::RingChunkSettings settings{.max_chunks_in_flight = 1,
                                               .cleanup_timeout = options_.cleanup_timeout,
                                               .wait_for_room = options_.wait_for_room,
                                               .while_waiting = &options_.while_waiting,
                                               .wait_for_other_transfers = false};
      std::uint64_t index = 0;
      for (std::uint64_t done = 0; done < r.bytes; ++index) {
        const std::uint64_t len = std::min(chunk, r.bytes - done);
        const std::uint64_t end = done + len;
        try {
          stage_chunk_backing_off(from, to, len, options_, [&](HostRange landing) {
            detail::RingChunkJob job;
            job.direction = CopyDirection::DeviceToHost;
            job.handle = r.source.handle;
            job.device_offset = checked::add_or_throw(r.source.offset, done, ErrorKind::InvalidRange, "source offset");
            job.total = len;
            job.chunk_bytes = len;
            // Leased: a progress callback (the caller's code) may close `to` meanwhile.
            const HostLease landed = to.lease_host(landing);
            job.destination = landed.bytes();
            detail::run_ring_chunks(from, settings, job);
            const DeviceRange up{r.destination.handle,
                                 checked::add_or_throw(r.destination.offset, done, ErrorKind::InvalidRange,
                                                       "destination offset"),
                                 len};
            to.host_to_device(landing, up, CopyMode::Sync);
          });
        } catch (const Error& e) {
          rethrow_naming(e, fmt::format("staged chunk {} (bytes {}..{} of the {})", index, done, end, r.describe_it()));
        }
        done = end;
        if (options_.progress) options_.progress(done, r.bytes);
      }
      break;
    }
  }
  if (allocation) result.handle = allocation->keep();
  return result;
}

std::vector<TransferResult> TransferPlanner::submit_scatter(const ScatterSource& source,
                                                           std::span<const DeviceSpan> destinations) {
  if (!source.fill) fail(ErrorKind::InvalidRange, "a ScatterSource has no fill function");
  // Each destination checked as an upload of its share would be; the route
  // WriteInPlace only where every one takes it.
  const std::function<void(std::uint64_t, std::span<std::byte>)> unused = [](std::uint64_t, std::span<std::byte>) {};
  std::vector<std::uint64_t> lengths;
  lengths.reserve(destinations.size());
  bool in_place = !destinations.empty();
  for (std::size_t i = 0; i < destinations.size(); ++i) {
    if (!destinations[i].bytes)
      fail(ErrorKind::InvalidRange, "scatter destination {} ({}) has no length: each takes its bytes of the stream", i,
           describe(destinations[i].handle));
    const StreamSource share{*destinations[i].bytes, unused};
    const Resolved r = resolve(share, destinations[i], bridge_);
    const TransferPlan plan = choose(r, options_, capabilities_, chunk_bytes_);
    in_place = in_place && (plan.route == Route::WriteInPlace || plan.route == Route::Nothing);
    lengths.push_back(r.bytes);
  }
  std::vector<TransferResult> results(destinations.size());
  if (in_place) {
    std::vector<DeviceRange> ranges;
    for (std::size_t i = 0; i < destinations.size(); ++i) {
      results[i].route = lengths[i] == 0 ? Route::Nothing : Route::WriteInPlace;
      results[i].bytes = lengths[i];
      if (lengths[i] != 0) ranges.push_back(DeviceRange{destinations[i].handle, destinations[i].offset, lengths[i]});
    }
    if (ranges.empty()) return results;
    const std::uint64_t total = std::accumulate(lengths.begin(), lengths.end(), std::uint64_t{0});
    const KeptAfterWrite kept(bridge_, ranges);
    try {
      bridge_.write_in_place(ranges, [&](std::span<const std::span<std::byte>> bytes) {
        const detail::LendingChunk marked(kept.keep());
        // Up to chunk_bytes_ of pieces per fill call, a destination cut where a chunk ends.
        std::vector<std::span<std::byte>> pieces;
        std::uint64_t at = 0, gathered = 0;
        for (std::span<std::byte> rest : bytes) {
          while (!rest.empty()) {
            const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(rest.size(), chunk_bytes_ - gathered));
            pieces.push_back(rest.first(take));
            rest = rest.subspan(take);
            gathered += take;
            if (gathered == chunk_bytes_) {
              source.fill(at, pieces);
              at += gathered;
              gathered = 0;
              pieces.clear();
              if (options_.progress) options_.progress(at, total);
            }
          }
        }
        if (!pieces.empty()) {
          source.fill(at, pieces);
          at += gathered;
          if (options_.progress) options_.progress(at, total);
        }
      });
    } catch (const Error& e) {
      rethrow_naming(e, fmt::format("scatter of {} bytes into {} allocations from {} (write_in_place)", total,
                                    destinations.size(), describe(destinations.front().handle)));
    }
    return results;
  }
  // One submit per destination, its share of the stream through the ring.
  std::uint64_t base = 0;
  for (std::size_t i = 0; i < destinations.size(); ++i) {
    const std::function<void(std::uint64_t, std::span<std::byte>)> share_fill =
        [&source, base](std::uint64_t offset, std::span<std::byte> chunk) {
          const std::span<std::byte> one[1] = {chunk};
          source.fill(base + offset, one);
        };
    try {
      results[i] = submit(StreamSource{lengths[i], share_fill}, destinations[i]);
    } catch (...) {
      // The earlier destinations' copies are this call's: none is left in flight.
      const auto deadline = std::chrono::steady_clock::now() + options_.cleanup_timeout;
      for (std::size_t j = 0; j < i; ++j)
        for (const PendingCopy& copy : results[j].pending) {
          try {
            const auto left = std::max(deadline - std::chrono::steady_clock::now(),
                                       std::chrono::steady_clock::duration::zero());
            bridge_.wait(copy.event, std::chrono::duration_cast<std::chrono::nanoseconds>(left));
          } catch (const Error&) {
          }
        }
      throw;
    }
    base += lengths[i];
  }
  return results;
}

DeviceHandle TransferPlanner::upload(std::span<const std::byte> bytes, const ObjectSpec& spec, std::uint64_t extent) {
  return *run(HostSource{bytes}, NewAllocation{spec, extent}).handle;
}

void TransferPlanner::upload_into(DeviceHandle handle, std::uint64_t device_offset, std::span<const std::byte> bytes) {
  run(HostSource{bytes}, DeviceSpan{handle, device_offset, std::nullopt, nullptr});
}

void TransferPlanner::download(DeviceHandle handle, std::uint64_t device_offset, std::span<std::byte> out) {
  run(DeviceSpan{handle, device_offset, std::nullopt, nullptr}, HostDestination{out});
}

}  // namespace devbridge
