// The transfer planner (include/devbridge/transfer.hpp) against every backend
// in backend_drivers.cpp: which route it chooses from the backend's
// capabilities and why, bytes bit-exact on every route for sizes 0, 1, odd,
// ring-sized and larger than the ring, device to device within and between
// bridges, and (on the fake, which fails a copy on demand) failures that keep
// their kind, name the range or chunk, and leave nothing registered, reserved
// or allocated. The ring-chunk pipeline itself is stager_test.cpp's.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backend_drivers.hpp"
#include "staging_test_support.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/transfer.hpp"

namespace devbridge::conformance {
namespace {

using Bytes = std::vector<std::byte>;

constexpr std::uint64_t kRing = 64 << 10;
constexpr std::uint64_t kAlignment = 64;

ObjectSpec bytes_spec(std::uint64_t extent) { return ObjectSpec{extent, kAlignment, DType::UInt8, ShapeKind::Vector}; }

// The smallest extent that holds `bytes` (extents are whole multiples of the alignment).
std::uint64_t extent_for(std::uint64_t bytes) {
  return (std::max<std::uint64_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
}
NewAllocation fresh(std::uint64_t bytes) { return NewAllocation{bytes_spec(extent_for(bytes)), extent_for(bytes)}; }


// Host bytes at an address aligned for adoption (a vector's data is not).
class AlignedBytes {
 public:
  explicit AlignedBytes(std::size_t n) : storage_(n + 4096) {
    const auto address = reinterpret_cast<std::uintptr_t>(storage_.data());
    offset_ = (4096 - address % 4096) % 4096;
    size_ = n;
  }
  std::span<std::byte> span() { return {storage_.data() + offset_, size_}; }

 private:
  Bytes storage_;
  std::size_t offset_ = 0, size_ = 0;
};

class TransferConformance : public DriverTest {
 protected:
  bool is_fake() const { return driver().name == "fake"; }
  fake::FakeBackend& fake_of(Bridge& b) { return *b.backend().test_controls()->fake(); }

  // A stream is written straight into the allocation here (WriteInPlace): device memory is host memory, or
  // can be mapped for writing.
  static bool writes_in_place(Bridge& b) {
    const auto info = b.backend_info();
    return info.host_addressable || info.maps_for_write;
  }

  // Registering is cheap here: above registration_from_bytes the planner registers instead of staging.
  bool cheap(Bridge& b) {
    const auto info = b.backend_info();
    return info.host_addressable || info.cheap_registration;
  }

  Bytes random_bytes(std::size_t n) {
    Bytes out(n);
    for (auto& b : out) b = static_cast<std::byte>(random_());
    return out;
  }

  // Nothing a transfer made is left on `b`: no registration, no reservation,
  // no copy in flight, and exactly `allocations` allocations.
  static void expect_nothing_left(Bridge& b, std::uint64_t allocations = 0) {
    const auto stats = b.stats();
    EXPECT_EQ(stats.host_regions, 0u);
    EXPECT_EQ(stats.ring_reservations, 0u);
    EXPECT_EQ(stats.copies_in_flight, 0u);
    EXPECT_EQ(stats.live_allocations, allocations);
  }

  std::unique_ptr<Bridge> second_bridge() {
    return std::make_unique<Bridge>(driver().make(), BridgeOptions{.generation = 1, .ring_bytes = kRing / 2});
  }

  std::mt19937_64 random_{std::hash<std::string>{}(::testing::UnitTest::GetInstance()->current_test_info()->name())};
};

const std::vector<std::uint64_t>& sizes() {
  static const std::vector<std::uint64_t> values{0, 1, 4097, kRing, 3 * kRing + 123};
  return values;
}

// ---- route choice ---------------------------------------------------------------

TEST_P(TransferConformance, TransferPlansTheRouteFromTheBackendsCapabilities) {
  auto& b = make_bridge(kRing);
  TransferPlanner planner(b);
  const bool cheap_here = cheap(b);
  const bool addressable = b.backend_info().host_addressable;
  AlignedBytes big(2 << 20);
  const Bytes small(1000);
  const auto big_spec = bytes_spec(big.span().size());
  const DeviceHandle h = b.alloc_device(big_spec, big.span().size());

  EXPECT_EQ(planner.plan(HostSource{{}}, NewAllocation{bytes_spec(4096), 4096}).route, Route::Nothing);
  // A new allocation alloc_device would refuse is refused by the plan too, with alloc_device's words.
  for (const std::uint64_t extent : {std::uint64_t{0}, std::uint64_t{8192}, ~std::uint64_t{0}})
    EXPECT_KIND(ErrorKind::InvalidExtent, planner.plan(HostSource{small}, NewAllocation{bytes_spec(4096), extent}),
                "at most max_extent");
  EXPECT_EQ(planner.plan(HostSource{small}, DeviceSpan{h}).route, Route::RingChunks);
  const auto large = planner.plan(HostSource{big.span()}, DeviceSpan{h});
  EXPECT_EQ(large.route, cheap_here ? Route::RegisteredCopy : Route::RingChunks) << large.reason;
  EXPECT_FALSE(large.reason.empty());
  EXPECT_EQ(planner.plan(DeviceSpan{h}, HostDestination{big.span()}).route,
            cheap_here ? Route::RegisteredCopy : Route::RingChunks);
  // Adoption only when permitted, and only where device memory is host memory.
  EXPECT_NE(planner.plan(HostSource{big.span()}, NewAllocation{big_spec, big.span().size()}).route,
            Route::AdoptInPlace);
  TransferPlanner adopting(b, {.adopt = true});
  const auto adopt = adopting.plan(HostSource{big.span()}, NewAllocation{big_spec, big.span().size()});
  EXPECT_EQ(adopt.route == Route::AdoptInPlace, addressable) << adopt.reason;
  // Never into an existing allocation, nor for a buffer that is not the whole extent.
  EXPECT_NE(adopting.plan(HostSource{big.span()}, DeviceSpan{h}).route, Route::AdoptInPlace);
  EXPECT_NE(adopting.plan(HostSource{big.span().first(4096)}, NewAllocation{big_spec, big.span().size()}).route,
            Route::AdoptInPlace);
  // Ring ranges and registered regions: one direct copy.
  const HostRange range = b.reserve(4096);
  EXPECT_EQ(planner.plan(RingSpan{range}, DeviceSpan{h}).route, Route::DirectCopy);
  EXPECT_EQ(planner.plan(DeviceSpan{h}, RingSpan{range}).route, Route::DirectCopy);
  b.release_host(range);
  // Device to device: within a bridge through its ring, between bridges a peer copy.
  EXPECT_EQ(planner.plan(DeviceSpan{h, 0, 4096}, DeviceSpan{h, 8192}).route, Route::StagedThroughRings);
  auto other = second_bridge();
  const DeviceHandle o = other->alloc_device(bytes_spec(4096), 4096);
  EXPECT_EQ(planner.plan(DeviceSpan{h, 0, 4096}, DeviceSpan{o, 0, std::nullopt, other.get()}).route, Route::PeerCopy);

  // A route the endpoints do not allow, asked for by name: InvalidRange naming why.
  TransferPlanner peer(b, {.route = Route::PeerCopy});
  EXPECT_KIND(ErrorKind::InvalidRange, peer.plan(HostSource{small}, DeviceSpan{h}), "route peer_copy is not possible");
  TransferPlanner adopt_into(b, {.route = Route::AdoptInPlace});
  EXPECT_KIND(ErrorKind::InvalidRange, adopt_into.plan(HostSource{small}, DeviceSpan{h}), "existing one");
  // Endpoints that cannot be: no device end, lengths that differ, past the extent, another bridge's host side.
  Bytes out(10);
  EXPECT_KIND(ErrorKind::InvalidRange, planner.plan(HostSource{small}, HostDestination{out}), "neither end");
  EXPECT_KIND(ErrorKind::InvalidRange, planner.plan(DeviceSpan{h, 0, 20}, HostDestination{out}), "lengths differ");
  EXPECT_KIND(ErrorKind::InvalidRange, planner.plan(HostSource{small}, DeviceSpan{h, big.span().size() - 10}),
              "past its extent");
  EXPECT_KIND(ErrorKind::InvalidRange, planner.plan(HostSource{small}, DeviceSpan{o, 0, std::nullopt, other.get()}),
              "another");
  EXPECT_KIND(ErrorKind::InvalidRange, planner.plan(DeviceSpan{h, 0, 4096}, DeviceSpan{h, 4095}), "overlap");
  b.free_device(h);
  expect_nothing_left(b);
}

// ---- bytes ------------------------------------------------------------------------

// Every host route, both ways, for sizes 0, 1, odd, the ring and past it.
TEST_P(TransferConformance, TransferEveryHostRouteIsBitExact) {
  auto& b = make_bridge(kRing);
  for (const std::optional<Route> route :
       {std::optional<Route>{}, std::optional{Route::RingChunks}, std::optional{Route::RegisteredCopy}}) {
    TransferPlanner planner(b, {.registration_from_bytes = 0, .route = route});
    for (const std::uint64_t size : sizes()) {
      SCOPED_TRACE(std::string(route ? route_name(*route) : "auto") + ", size " + std::to_string(size));
      const Bytes data = random_bytes(size);
      const auto up = planner.run(HostSource{data}, fresh(size));
      ASSERT_TRUE(up.handle);
      EXPECT_EQ(up.route, size == 0 ? Route::Nothing : route.value_or(cheap(b) ? Route::RegisteredCopy : Route::RingChunks));
      Bytes back(size);
      planner.run(DeviceSpan{*up.handle}, HostDestination{back});
      EXPECT_EQ(back, data);
      expect_nothing_left(b, 1);
      b.free_device(*up.handle);
    }
  }
}

// A buffer the caller registered already cannot be registered again for the
// call: a registered copy the planner chose goes through the ring instead;
// one the caller named is refused, naming the route.
TEST_P(TransferConformance, TransferTakesTheRingWhenTheBufferIsRegisteredAlready) {
  auto& b = make_bridge(kRing);
  const Bytes data = random_bytes(3 * kRing);
  TransferPlanner planner(b, {.registration_from_bytes = 0});
  const DeviceHandle h = planner.upload(data, bytes_spec(data.size()), data.size());
  Bytes out(data.size());
  const HostRegion region = b.register_host(out);
  const auto result = planner.run(DeviceSpan{h}, HostDestination{out});
  EXPECT_EQ(result.route, Route::RingChunks);
  EXPECT_EQ(out, data);
  TransferPlanner named(b, {.route = Route::RegisteredCopy});
  EXPECT_KIND(ErrorKind::InvalidRange, named.download(h, 0, out), "(registered_copy)");
  b.unregister_host(region);
  b.free_device(h);
  expect_nothing_left(b);
}

// Adopted in place where the backend can (the host, the fake): the
// allocation is the buffer itself; elsewhere Unsupported, nothing left.
TEST_P(TransferConformance, TransferAdoptsInPlaceWhereTheDeviceCan) {
  auto& b = make_bridge(kRing);
  TransferPlanner planner(b, {.adopt = true, .route = Route::AdoptInPlace});
  AlignedBytes buffer(3 * kRing + 64);
  const Bytes data = random_bytes(buffer.span().size());
  std::memcpy(buffer.span().data(), data.data(), data.size());
  const std::span<const std::byte> source = buffer.span();
  const auto spec = bytes_spec(source.size());
  TransferResult adopted;
  try {
    adopted = planner.run(HostSource{source}, NewAllocation{spec, source.size()});
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Unsupported) << e.what();
    expect_nothing_left(b);
    GTEST_SKIP() << "this backend cannot adopt host memory: " << e.what();
  }
  ASSERT_TRUE(adopted.handle && adopted.adopted_region);
  EXPECT_EQ(adopted.route, Route::AdoptInPlace);
  Bytes back(data.size());
  TransferPlanner(b).download(*adopted.handle, 0, back);
  EXPECT_EQ(back, data);
  // Read-only: an upload into it is refused.
  EXPECT_KIND(ErrorKind::InvalidRange, TransferPlanner(b).upload_into(*adopted.handle, 0, std::span(data).first(64)));
  b.free_device(*adopted.handle);
  b.unregister_host(*adopted.adopted_region);
  expect_nothing_left(b);
  // A progress callback that throws once the buffer is adopted: nothing adopted, nothing registered.
  TransferPlanner throwing(b, {.progress = [](std::uint64_t, std::uint64_t) { throw std::runtime_error("stop"); },
                               .adopt = true,
                               .route = Route::AdoptInPlace});
  EXPECT_THROW(throwing.run(HostSource{source}, NewAllocation{spec, source.size()}), std::runtime_error);
  expect_nothing_left(b);
}

// Ring ranges and registered regions the caller holds: one copy each way.
TEST_P(TransferConformance, TransferDirectCopiesFromTheRingAndARegion) {
  auto& b = make_bridge(kRing);
  TransferPlanner planner(b);
  const Bytes data = random_bytes(5000);
  const DeviceHandle h = b.alloc_device(bytes_spec(8192), 8192);
  const HostRange range = b.reserve(data.size());
  std::memcpy(b.host_bytes(range).data(), data.data(), data.size());
  EXPECT_EQ(planner.run(RingSpan{range}, DeviceSpan{h, 100}).route, Route::DirectCopy);
  Bytes region_bytes(data.size());
  const HostRegion region = b.register_host(region_bytes);
  EXPECT_EQ(planner.run(DeviceSpan{h, 100}, RegionSpan{RegionRange{region, 0, data.size()}}).route, Route::DirectCopy);
  EXPECT_EQ(region_bytes, data);
  b.unregister_host(region);
  b.release_host(range);
  b.free_device(h);
  expect_nothing_left(b);
}

// Device to device: within one bridge (through its ring) and between two
// (a peer copy, or through both rings where there is no direct path), into
// an existing allocation at an offset and into a new one.
TEST_P(TransferConformance, TransferDeviceToDeviceIsBitExact) {
  auto& b = make_bridge(kRing);
  auto other = second_bridge();
  TransferPlanner planner(b);
  TransferPlanner staged(b, {.route = Route::StagedThroughRings});
  for (const std::uint64_t size : sizes()) {
    SCOPED_TRACE("size " + std::to_string(size));
    const Bytes data = random_bytes(size);
    const DeviceHandle src = *planner.run(HostSource{data}, fresh(size)).handle;
    const std::uint64_t extent = extent_for(size + 64);
    const DeviceHandle within = b.alloc_device(bytes_spec(extent), extent);
    EXPECT_EQ(planner.run(DeviceSpan{src, 0, size}, DeviceSpan{within, 64}).route,
              size == 0 ? Route::Nothing : Route::StagedThroughRings);
    const DeviceHandle across = other->alloc_device(bytes_spec(extent), extent);
    for (TransferPlanner* p : {&planner, &staged}) {
      const auto result = p->run(DeviceSpan{src, 0, size}, DeviceSpan{across, 64, std::nullopt, other.get()});
      if (size != 0 && p == &staged) {
        EXPECT_EQ(result.route, Route::StagedThroughRings);
      } else if (size != 0) {
        EXPECT_TRUE(result.route == Route::PeerCopy || result.route == Route::StagedThroughRings);
      }
      Bytes back(size);
      TransferPlanner(*other).download(across, 64, back);
      EXPECT_EQ(back, data);
    }
    Bytes back(size);
    planner.download(within, 64, back);
    EXPECT_EQ(back, data);
    const auto copied = planner.run(DeviceSpan{within, 64, size}, fresh(size));
    ASSERT_TRUE(copied.handle);
    planner.download(*copied.handle, 0, back);
    EXPECT_EQ(back, data);
    for (const DeviceHandle h : {src, within, *copied.handle}) b.free_device(h);
    other->free_device(across);
    expect_nothing_left(b);
    expect_nothing_left(*other);
  }
}

// ---- failures (the fake) ------------------------------------------------------------

TEST_P(TransferConformance, TransferFailedRegisteredCopyIsNamedAndLeavesNothing) {
  if (!is_fake()) GTEST_SKIP() << "needs the fake's fault injection";
  auto& b = make_bridge(kRing);
  TransferPlanner planner(b, {.route = Route::RegisteredCopy});
  const Bytes data = random_bytes(3 * kRing);
  fake_of(b).inject(fake::Call::CopyHostToDevice, fake::Failure::CopyFailedAtSubmit);
  EXPECT_KIND(ErrorKind::DeviceCopyFailed, planner.upload(data, bytes_spec(data.size()), data.size()),
              "upload of 196608 bytes from the caller's 196608 host bytes to a new allocation (registered_copy)");
  expect_nothing_left(b);
  const DeviceHandle h = planner.upload(data, bytes_spec(data.size()), data.size());
  fake_of(b).inject(fake::Call::CopyDeviceToHost, fake::Failure::CopyFailedAtSubmit);
  Bytes back(data.size());
  EXPECT_KIND(ErrorKind::OutputCopyFailed, planner.download(h, 0, back), "(registered_copy)");
  expect_nothing_left(b, 1);
  b.free_device(h);
}

TEST_P(TransferConformance, TransferFailedStagedChunkIsNamedAndLeavesNothing) {
  if (!is_fake()) GTEST_SKIP() << "needs the fake's fault injection";
  auto& b = make_bridge(kRing);
  auto other = second_bridge();
  TransferPlanner planner(b, {.route = Route::StagedThroughRings});
  const Bytes data = random_bytes(3 * kRing);
  const DeviceHandle src = TransferPlanner(b).upload(data, bytes_spec(data.size()), data.size());
  // The second chunk's copy up into the destination fails.
  fake_of(*other).inject(fake::Call::CopyHostToDevice, fake::Failure::CopyFailedAtSubmit, 2);
  EXPECT_KIND(ErrorKind::DeviceCopyFailed,
              planner.run(DeviceSpan{src}, DeviceSpan{other->alloc_device(bytes_spec(data.size()), data.size()), 0,
                                                      std::nullopt, other.get()}),
              "staged chunk 1 (bytes 8192..16384");
  // The second chunk's copy down from the source fails; the new allocation goes with it.
  TransferPlanner into_new(*other, {.route = Route::StagedThroughRings});
  fake_of(b).inject(fake::Call::CopyDeviceToHost, fake::Failure::CopyFailedAtSubmit, 2);
  EXPECT_KIND(ErrorKind::OutputCopyFailed,
              into_new.run(DeviceSpan{src, 0, std::nullopt, &b}, NewAllocation{bytes_spec(data.size()), data.size()}),
              "staged chunk 1");
  expect_nothing_left(b, 1);
  expect_nothing_left(*other, 1);  // the first test's destination, the caller's
  b.free_device(src);
}

// Progress: per chunk on the ring, once for a one-copy route.
TEST_P(TransferConformance, TransferReportsProgress) {
  auto& b = make_bridge(kRing);
  std::vector<std::uint64_t> done;
  auto record = [&](std::uint64_t d, std::uint64_t) { done.push_back(d); };
  const Bytes data = random_bytes(kRing + 1);
  TransferPlanner registered(b, {.progress = record, .route = Route::RegisteredCopy});
  const DeviceHandle h = *registered.run(HostSource{data}, fresh(data.size())).handle;
  EXPECT_EQ(done, std::vector<std::uint64_t>{data.size()});
  done.clear();
  TransferPlanner chunks(b, {.progress = record, .route = Route::RingChunks});
  Bytes back(data.size());
  chunks.download(h, 0, back);
  EXPECT_EQ(done.size(), 5u) << "four chunks of a quarter ring and one byte";
  EXPECT_EQ(done.back(), data.size());
  EXPECT_EQ(back, data);
  b.free_device(h);
  expect_nothing_left(b);
}

// submit(): a ring-chunk upload returns with its copies in flight, their
// ranges already the bridge's; the bytes are there once the events complete.
// Uploads larger than the ring wait for the ranges the bridge releases.
TEST_P(TransferConformance, TransferSubmitLeavesTheCopiesInFlight) {
  auto& b = make_bridge(kRing);
  TransferPlanner planner(b, {.route = Route::RingChunks});
  for (const std::uint64_t size : sizes()) {
    SCOPED_TRACE("size " + std::to_string(size));
    const Bytes data = random_bytes(size);
    const auto up = planner.submit(HostSource{data}, fresh(size));
    ASSERT_TRUE(up.handle);
    std::uint64_t covered = 0;
    for (const PendingCopy& copy : up.pending) {
      EXPECT_EQ(copy.offset, covered);
      covered += copy.bytes;
      b.wait(copy.event);
    }
    EXPECT_LE(covered, size);
    EXPECT_EQ(b.stats().ring_reservations, 0u) << "the bridge released every range once its copy ended";
    Bytes back(size);
    planner.run(DeviceSpan{*up.handle}, HostDestination{back});
    EXPECT_EQ(back, data);
    b.free_device(*up.handle);
  }
  // Registered copies and downloads are synchronous: nothing pending.
  TransferPlanner registered(b, {.route = Route::RegisteredCopy});
  const Bytes data = random_bytes(4097);
  const auto up = registered.submit(HostSource{data}, fresh(data.size()));
  EXPECT_TRUE(up.pending.empty());
  b.free_device(*up.handle);
  expect_nothing_left(b);
}

TEST_P(TransferConformance, TransferSubmitNamesTheFailedChunkAndLeavesNothing) {
  if (!is_fake()) GTEST_SKIP() << "needs the fake's fault injection";
  auto& b = make_bridge(kRing);
  TransferPlanner planner(b, {.route = Route::RingChunks});
  const Bytes data = random_bytes(3 * kRing);
  fake_of(b).inject(fake::Call::CopyHostToDevice, fake::Failure::CopyFailedAtSubmit, 3);
  EXPECT_KIND(ErrorKind::DeviceCopyFailed, planner.submit(HostSource{data}, fresh(data.size())),
              "upload chunk 2 (bytes 32768..49152");
  b.poll();
  expect_nothing_left(b);
  // A copy failing at completion is the caller's to report: its event says so.
  fake_of(b).inject(fake::Call::CopyHostToDevice, fake::Failure::CopyFailedAtCompletion, 2);
  const auto up = planner.submit(HostSource{data}, fresh(data.size()));
  ASSERT_GE(up.pending.size(), 2u);
  EXPECT_EQ(up.pending[1].index, 1u);
  EXPECT_EQ(b.wait(up.pending[1].event).state, CopyState::Failed);
  for (const PendingCopy& copy : up.pending) (void)b.wait(copy.event);
  b.free_device(*up.handle);
  expect_nothing_left(b);
}

// Streamed ends: bytes made or consumed chunk by chunk, in order, through
// the ring; an exception from the caller's function ends the transfer as it
// is and leaves nothing reserved.
TEST_P(TransferConformance, TransferStreamsChunkByChunk) {
  auto& b = make_bridge(kRing);
  TransferPlanner planner(b);
  const Bytes data = random_bytes(3 * kRing + 123);
  const DeviceHandle h = b.alloc_device(bytes_spec(extent_for(data.size())), extent_for(data.size()));
  std::uint64_t expected = 0;
  const StreamSource source{data.size(), [&](std::uint64_t at, std::span<std::byte> chunk) {
                              EXPECT_EQ(at, expected);
                              expected += chunk.size();
                              std::memcpy(chunk.data(), data.data() + at, chunk.size());
                            }};
  const bool addressable = writes_in_place(b);  // host memory, or mapped for writing
  EXPECT_EQ(planner.plan(source, DeviceSpan{h}).route, addressable ? Route::WriteInPlace : Route::RingChunks);
  const auto up = planner.submit(source, DeviceSpan{h});
  EXPECT_EQ(up.pending.empty(), addressable);
  for (const PendingCopy& copy : up.pending) b.wait(copy.event);
  EXPECT_EQ(expected, data.size());
  Bytes back;
  const StreamDestination sink{data.size(), [&](std::uint64_t at, std::span<const std::byte> chunk) {
                                 EXPECT_EQ(at, back.size());
                                 back.insert(back.end(), chunk.begin(), chunk.end());
                               }};
  EXPECT_EQ(planner.run(DeviceSpan{h}, sink).route,
            b.backend_info().host_addressable ? Route::ReadInPlace : Route::RingChunks);
  EXPECT_EQ(back, data);
  TransferPlanner registered(b, {.route = Route::RegisteredCopy});
  EXPECT_KIND(ErrorKind::InvalidRange, registered.plan(DeviceSpan{h}, sink), "move out by ring_chunks");
  const StreamDestination failing{data.size(), [](std::uint64_t at, std::span<const std::byte>) {
                                    if (at != 0) throw std::runtime_error("the disk is full");
                                  }};
  EXPECT_THROW(planner.run(DeviceSpan{h}, failing), std::runtime_error);
  b.free_device(h);
  b.poll();
  expect_nothing_left(b);
}

// Where device memory is host memory, a stream is written straight into the
// allocation (WriteInPlace, Bridge::write_in_place): no ring, no copy; the
// allocation is held while the fill runs; a fill that throws leaves nothing.
// Elsewhere write_in_place is Unsupported and the stream takes the ring.
TEST_P(TransferConformance, TransferWritesAStreamInPlaceWhereDeviceMemoryIsHostMemory) {
  auto& b = make_bridge(kRing);
  const bool addressable = writes_in_place(b);  // host memory, or mapped for writing
  const Bytes data = random_bytes(3 * kRing + 123);
  const auto copies_before = b.stats().copies_submitted;
  TransferPlanner planner(b);
  const StreamSource source{data.size(), [&](std::uint64_t at, std::span<std::byte> chunk) {
                              EXPECT_LE(chunk.size(), planner.chunk_bytes());
                              std::memcpy(chunk.data(), data.data() + at, chunk.size());
                            }};
  const auto made = planner.submit(source, fresh(data.size()));
  for (const PendingCopy& copy : made.pending) b.wait(copy.event);
  EXPECT_EQ(made.route, addressable ? Route::WriteInPlace : Route::RingChunks);
  if (addressable) EXPECT_EQ(b.stats().copies_submitted, copies_before);
  Bytes back(data.size());
  planner.download(*made.handle, 0, back);
  EXPECT_EQ(back, data);

  const DeviceRange range{*made.handle, 0, 4096};
  if (!addressable) {
    EXPECT_KIND(ErrorKind::Unsupported, b.write_in_place(std::span(&range, 1), [](auto) {}), "mapped for writing");
    TransferPlanner in_place(b, {.route = Route::WriteInPlace});
    EXPECT_KIND(ErrorKind::InvalidRange, in_place.plan(source, fresh(data.size())), "write_in_place");
  } else {
    // Held while the write runs: a free is refused, a release deferred to its end.
    b.write_in_place(std::span(&range, 1), [&](std::span<const std::span<std::byte>> pieces) {
      ASSERT_EQ(pieces.size(), 1u);
      EXPECT_EQ(pieces[0].size(), 4096u);
      EXPECT_KIND(ErrorKind::AllocationStillInUse, b.free_device(*made.handle), "");
      std::memset(pieces[0].data(), 0x5a, 4096);
    });
    planner.download(*made.handle, 0, back);
    EXPECT_EQ(back[0], std::byte{0x5a});
    EXPECT_EQ(back[4095], std::byte{0x5a});
    EXPECT_EQ(back[4096], data[4096]);
  }
  b.free_device(*made.handle);

  // A fill that throws: the new allocation is freed, nothing is left held or reserved.
  const auto live = b.backend().test_controls() ? b.backend().test_controls()->live_allocations() : 0;
  const StreamSource failing{data.size(), [](std::uint64_t at, std::span<std::byte>) {
                               if (at != 0) throw std::runtime_error("the disk went away");
                             }};
  EXPECT_THROW(planner.submit(failing, fresh(data.size())), std::runtime_error);
  b.poll();
  expect_nothing_left(b);
  if (b.backend().test_controls()) EXPECT_LE(b.backend().test_controls()->live_allocations(), live);
}

// Where device memory is host memory, a stream out is read straight from the
// allocation (ReadInPlace, Bridge::read_in_place): no ring, no copy; the
// allocation is held while the sink runs; what was written into it before the
// call (a copy in flight, a launch) has landed first; a sink that throws
// leaves nothing. Elsewhere read_in_place is Unsupported and the stream takes
// the ring.
TEST_P(TransferConformance, TransferReadsAStreamInPlaceWhereDeviceMemoryIsHostMemory) {
  auto& b = make_bridge(kRing);
  const bool addressable = b.backend_info().host_addressable;
  const Bytes data = random_bytes(3 * kRing + 124);
  TransferPlanner planner(b);
  const DeviceHandle h = planner.upload(data, bytes_spec(extent_for(data.size())), extent_for(data.size()));
  b.poll();
  const auto copies_before = b.stats().copies_submitted;
  Bytes back;
  const StreamDestination sink{data.size(), [&](std::uint64_t at, std::span<const std::byte> chunk) {
                                 EXPECT_EQ(at, back.size());
                                 EXPECT_LE(chunk.size(), planner.chunk_bytes());
                                 back.insert(back.end(), chunk.begin(), chunk.end());
                               }};
  EXPECT_EQ(planner.run(DeviceSpan{h}, sink).route, addressable ? Route::ReadInPlace : Route::RingChunks);
  EXPECT_EQ(back, data);
  if (addressable) EXPECT_EQ(b.stats().copies_submitted, copies_before);

  const DeviceRange range{h, 4096, 4096};
  if (!addressable) {
    EXPECT_KIND(ErrorKind::Unsupported, b.read_in_place(std::span(&range, 1), [](auto) {}), "host memory");
    TransferPlanner in_place(b, {.route = Route::ReadInPlace});
    EXPECT_KIND(ErrorKind::InvalidRange, in_place.plan(DeviceSpan{h}, sink), "read_in_place");
    b.free_device(h);
    expect_nothing_left(b);
    return;
  }
  // Held while the read runs: a free is refused, a release deferred to its end.
  b.read_in_place(std::span(&range, 1), [&](std::span<const std::span<const std::byte>> pieces) {
    ASSERT_EQ(pieces.size(), 1u);
    ASSERT_EQ(pieces[0].size(), 4096u);
    EXPECT_EQ(std::memcmp(pieces[0].data(), data.data() + 4096, 4096), 0);
    EXPECT_KIND(ErrorKind::AllocationStillInUse, b.free_device(h), "");
  });

  // An upload in flight into the allocation, and a launch writing it, both
  // queued before the read, have landed when it reads. Where the backend can
  // hold its copies and launches, they are held until the read is waiting:
  // a read that did not wait would see the old bytes.
  auto* controls = b.backend().test_controls();
  const bool hold = controls && controls->can_hold_copies();
  constexpr std::uint64_t kCount = 1 << 16;
  const ObjectSpec floats{kCount * 4, 64, DType::Float32, ShapeKind::Vector};
  const DeviceHandle x = b.alloc_device(floats, kCount * 4), y = b.alloc_device(floats, kCount * 4);
  std::vector<float> values(kCount);
  for (std::size_t i = 0; i < kCount; ++i) values[i] = static_cast<float>(i % 1000);
  planner.upload_into(x, 0, std::as_bytes(std::span(values)));
  const Bytes fresh_bytes = random_bytes(kRing / 2);
  const HostRange staged = b.reserve(fresh_bytes.size());
  std::memcpy(b.host_bytes(staged).data(), fresh_bytes.data(), fresh_bytes.size());
  if (hold) controls->hold_copies(true);
  const auto up = b.host_to_device(staged, DeviceRange{h, 0, fresh_bytes.size()}, CopyMode::Async);
  b.launch_axpy(DeviceRange{x, 0, kCount * 4}, DeviceRange{y, 0, kCount * 4}, 2.0f, 1.0f);
  std::atomic<bool> read{false};
  std::thread reader([&] {
    const DeviceRange head{h, 0, fresh_bytes.size()};
    b.read_in_place(std::span(&head, 1), [&](std::span<const std::span<const std::byte>> pieces) {
      EXPECT_EQ(std::memcmp(pieces[0].data(), fresh_bytes.data(), fresh_bytes.size()), 0);
    });
    const DeviceRange out{y, 0, kCount * 4};
    b.read_in_place(std::span(&out, 1), [&](std::span<const std::span<const std::byte>> pieces) {
      const auto* got = reinterpret_cast<const float*>(pieces[0].data());
      EXPECT_EQ(got[0], 1.0f);
      EXPECT_EQ(got[kCount - 1], 2.0f * values[kCount - 1] + 1.0f);
    });
    read = true;
  });
  if (hold) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(read.load()) << "read_in_place read while a copy into its allocation was held";
    controls->hold_copies(false);
  }
  reader.join();
  EXPECT_EQ(b.wait(up).state, CopyState::Completed);
  b.release_host(staged);

  // A sink that throws ends the transfer; nothing is left held or reserved.
  const StreamDestination failing{data.size(), [](std::uint64_t at, std::span<const std::byte>) {
                                    if (at != 0) throw std::runtime_error("the disk is full");
                                  }};
  EXPECT_THROW(planner.run(DeviceSpan{h}, failing), std::runtime_error);
  for (const DeviceHandle handle : {h, x, y}) b.free_device(handle);
  b.poll();
  expect_nothing_left(b);
}

// An in-place callback (write_in_place's write, read_in_place's read) runs
// while its ranges are held, and a restart or close waits for every hold to
// end; a read in place waits for writes into its allocation. Called from
// inside the callback on its own thread, each would wait for that thread for
// good: they are refused instead (AllocationStillInUse, the bridge unchanged),
// and the callback's caller goes on. A read of another allocation, or of the
// one a read holds, goes ahead.
TEST_P(TransferConformance, InPlaceCallbacksRefuseWhatWouldWaitForThemselves) {
  auto& b = make_bridge(kRing);
  const Bytes data = random_bytes(8192);
  TransferPlanner planner(b);
  const ObjectSpec spec = bytes_spec(8192);
  const DeviceHandle h = planner.upload(data, spec, 8192), other = planner.upload(data, spec, 8192);
  const DeviceRange range{h, 0, 4096}, other_range{other, 0, 4096};
  const Generation generation = b.generation();
  const auto refused = [&] {
    EXPECT_KIND(ErrorKind::AllocationStillInUse, b.close(), "close called from inside a callback");
    EXPECT_KIND(ErrorKind::AllocationStillInUse, b.restart(generation + 1), "restart called from inside");
  };
  bool wrote = false, read = false;
  if (writes_in_place(b)) {
    b.write_in_place(std::span(&range, 1), [&](std::span<const std::span<std::byte>> pieces) {
      refused();
      const ViewSpec whole{DType::UInt8, Dims{4096}, std::nullopt, 0};
      EXPECT_KIND(ErrorKind::AllocationStillInUse, b.view(h, whole, ViewWait::Wait), "own write_in_place into it");
      b.view(other, whole).reset();  // another allocation: no wait
      if (b.backend_info().host_addressable) {
        EXPECT_KIND(ErrorKind::AllocationStillInUse, b.read_in_place(std::span(&range, 1), [](auto) {}),
                    "own write_in_place into it");
        b.read_in_place(std::span(&other_range, 1), [&](std::span<const std::span<const std::byte>> in) {
          EXPECT_EQ(std::memcmp(in[0].data(), data.data(), 4096), 0);
        });
      }
      std::memset(pieces[0].data(), 0x5a, pieces[0].size());
      wrote = true;
    });
    EXPECT_TRUE(wrote);
  } else {
    EXPECT_KIND(ErrorKind::Unsupported, b.write_in_place(std::span(&range, 1), [](auto) {}), "");
  }
  if (b.backend_info().host_addressable) {
    b.read_in_place(std::span(&range, 1), [&](std::span<const std::span<const std::byte>> pieces) {
      refused();
      b.read_in_place(std::span(&range, 1), [&](std::span<const std::span<const std::byte>> again) {
        EXPECT_EQ(again[0].data(), pieces[0].data());
      });
      read = true;
    });
    EXPECT_TRUE(read);
  }
  // Nothing was changed by the refusals: the same generation, the bytes written, every handle live.
  EXPECT_EQ(b.generation(), generation);
  Bytes back(4096);
  planner.download(h, 0, back);
  EXPECT_EQ(back, wrote ? Bytes(4096, std::byte{0x5a}) : Bytes(data.begin(), data.begin() + 4096));
  b.free_device(h);
  b.free_device(other);
  b.restart(generation + 1);
  expect_nothing_left(b);
}

// A fill or sink handed a ring chunk is the caller's code, and may close the
// bridge: the chunk stays allocated until it returns (a host lease, where
// host_bytes would be valid only until the close), so it reads and writes
// the whole chunk after the close without touching freed memory (AddressSanitizer
// runs this suite); the transfer then fails Closed, and the ring goes back
// when the call returns.
TEST_P(TransferConformance, ARingChunksCallbackThatClosesTheBridgeKeepsItsChunk) {
  const Bytes data = random_bytes(3 * kRing);
  for (const bool upload : {true, false}) {
    SCOPED_TRACE(upload ? "fill" : "sink");
    auto& b = make_bridge(kRing);
    auto* controls = b.backend().test_controls();
    TransferPlanner planner(b, {.route = Route::RingChunks});
    const DeviceHandle h = planner.upload(data, bytes_spec(data.size()), data.size());
    b.poll();
    bool closed = false;
    const auto close_then_touch = [&](std::span<std::byte> chunk) {
      if (closed) return;
      b.close();
      closed = true;
      EXPECT_EQ(b.stats().ring_reservations, 0u);
      if (const auto blocks = controls ? controls->live_host_blocks() : std::nullopt)
        EXPECT_EQ(*blocks, 1u) << "the ring is freed while a callback still holds a chunk of it";
      std::memset(chunk.data(), 0x33, chunk.size());  // still the chunk's: not freed by the close
      EXPECT_EQ(chunk.back(), std::byte{0x33});
    };
    if (upload) {
      const StreamSource fill{data.size(), [&](std::uint64_t, std::span<std::byte> chunk) { close_then_touch(chunk); }};
      EXPECT_KIND(ErrorKind::Closed, planner.run(fill, DeviceSpan{h}), "");
    } else {
      const StreamDestination sink{data.size(), [&](std::uint64_t, std::span<const std::byte> chunk) {
                                     close_then_touch({const_cast<std::byte*>(chunk.data()), chunk.size()});
                                   }};
      EXPECT_KIND(ErrorKind::Closed, planner.run(DeviceSpan{h}, sink), "");
    }
    EXPECT_TRUE(closed);
    if (controls) {
      EXPECT_EQ(controls->live_allocations(), 0u);
      if (const auto blocks = controls->live_host_blocks()) EXPECT_EQ(*blocks, 0u) << "the ring goes back once the call returns";
    }
  }
}

// A callback that keeps its chunk past the call (a binding's buffer export)
// takes keep_lent_chunk_memory(): the chunk's memory stays allocated, the
// ring's past the close and the tensor's own (read or written in place) past
// its release and the close, until the owner goes. ASan's run reads freed
// memory here as an error.
TEST_P(TransferConformance, AChunkKeptPastItsCallbackStaysAllocatedUntilItsOwnerGoes) {
  EXPECT_EQ(keep_lent_chunk_memory(), nullptr) << "outside a fill or sink there is no chunk to keep";
  const Bytes data = random_bytes(3 * kRing + 123);
  for (const bool upload : {true, false}) {
    SCOPED_TRACE(upload ? "fill" : "sink");
    auto& b = make_bridge(kRing);
    if (upload && !b.backend_info().host_addressable && b.backend_info().maps_for_write)
      continue;  // written through a mapping, which is gone when the write ends: nothing of it to keep
    auto* controls = b.backend().test_controls();
    TransferPlanner planner(b);
    DeviceHandle h = planner.upload(data, bytes_spec(extent_for(data.size())), extent_for(data.size()));
    std::shared_ptr<void> owner;
    std::span<const std::byte> kept;
    std::uint64_t kept_at = 0;
    // The last chunk: nothing after it uses the ring's bytes again, nor writes
    // where a kept chunk's lease (a view's) would refuse the write.
    const auto keep_last = [&](std::uint64_t at, std::span<std::byte> chunk) {
      if (upload) std::memcpy(chunk.data(), data.data() + at, chunk.size());
      if (at + chunk.size() != data.size()) return;
      owner = keep_lent_chunk_memory();
      kept = chunk;
      kept_at = at;
    };
    if (upload) {
      const StreamSource fill{data.size(), keep_last};
      planner.run(fill, DeviceSpan{h});
    } else {
      const StreamDestination sink{data.size(), [&](std::uint64_t at, std::span<const std::byte> chunk) {
                                     keep_last(at, {const_cast<std::byte*>(chunk.data()), chunk.size()});
                                   }};
      planner.run(DeviceSpan{h}, sink);
    }
    ASSERT_NE(owner, nullptr);
    ASSERT_FALSE(kept.empty());
    b.release(h);
    b.poll();
    b.close();
    EXPECT_TRUE(std::equal(kept.begin(), kept.end(), data.begin() + static_cast<std::ptrdiff_t>(kept_at)))
        << "the chunk's bytes, in memory still allocated";
    owner.reset();
    if (controls) {
      EXPECT_EQ(controls->live_allocations(), 0u) << "the owner gone, nothing stays";
      if (const auto blocks = controls->live_host_blocks()) EXPECT_EQ(*blocks, 0u);
    }
  }
}

// A close on another thread while a chunk's bytes are copied into or out of
// the ring: the copy holds a lease on its chunk, so the close never frees
// the ring under it (it did: the plain host-buffer paths copied through
// host_bytes, and a close beside a download crashed the process). Each
// transfer ends, whole or Closed; nothing else happens.
TEST_P(TransferConformance, ACloseOnAnotherThreadNeverFreesTheRingUnderAChunksCopy) {
  const Bytes data = random_bytes(4 * kRing);
  Bytes out(data.size());
  for (int round = 0; round < 12; ++round) {
    auto& b = make_bridge(kRing);
    if (is_fake()) fake_of(b).set_auto_complete(true);
    TransferPlanner planner(b, {.route = Route::RingChunks});
    const DeviceHandle h = planner.upload(data, bytes_spec(data.size()), data.size());
    std::atomic<bool> started{false};
    std::thread mover([&] {
      for (int i = 0;; ++i) {
        started = true;
        try {
          if (i % 2 == 0)
            planner.run(DeviceSpan{h}, HostDestination{out});
          else
            planner.run(HostSource{data}, DeviceSpan{h});
        } catch (const Error& e) {
          EXPECT_TRUE(e.kind() == ErrorKind::Closed) << e.what();
          return;
        }
      }
    });
    while (!started) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::microseconds(200 * (round % 6)));
    b.close();
    mover.join();
  }
}

// Transfers staged through both rings from several threads, both ways at
// once: each waits for the room the others hold, on either ring, instead of
// failing with Backpressure (a few in a hundred did: the landing range on the
// destination's ring was reserved at once or not at all), and none waits on
// another that waits on it (a crossing pair backs off instead).
TEST_P(TransferConformance, StagedTransfersSideBySideBothWaysWaitForEachOther) {
  auto& a = make_bridge(kRing);
  auto b = std::make_unique<Bridge>(driver().make(), BridgeOptions{.generation = 1, .ring_bytes = kRing});
  if (is_fake()) {
    fake_of(a).set_auto_complete(true);
    fake_of(*b).set_auto_complete(true);
  }
  const Bytes data = random_bytes(3 * kRing + 448);
  const auto placed = [&](Bridge& on) {
    return *TransferPlanner(on).run(HostSource{data}, NewAllocation{bytes_spec(data.size()), data.size()}).handle;
  };
  const DeviceHandle from_a = placed(a), from_b = placed(*b);
  std::atomic<int> failures{0};
  std::vector<std::thread> movers;
  for (int thread = 0; thread < 4; ++thread) {
    const bool a_to_b = thread != 3;
    movers.emplace_back([&, a_to_b] {
      Bridge& source = a_to_b ? a : *b;
      Bridge& destination = a_to_b ? *b : a;
      TransferPlanner planner(source, {.route = Route::StagedThroughRings});
      for (int i = 0; i < 25; ++i) {
        try {
          const DeviceHandle into = destination.alloc_device(bytes_spec(data.size()), data.size());
          planner.run(DeviceSpan{a_to_b ? from_a : from_b}, DeviceSpan{into, 0, std::nullopt, &destination});
          if (i % 8 == 0) {
            Bytes back(data.size());
            TransferPlanner(destination).download(into, 0, back);
            EXPECT_EQ(back, data);
          }
          destination.free_device(into);
        } catch (const Error& e) {
          ++failures;
          ADD_FAILURE() << (a_to_b ? "a -> b: " : "b -> a: ") << e.what();
        }
      }
    });
  }
  for (auto& mover : movers) mover.join();
  EXPECT_EQ(failures.load(), 0);
  a.free_device(from_a);
  b->free_device(from_b);
  expect_nothing_left(a);
  expect_nothing_left(*b);
}

// One stream into several allocations (submit_scatter): in place at once
// where device memory is host memory (pieces of up to chunk_bytes per fill),
// else one submit per allocation through the ring; bit-exact either way.
TEST_P(TransferConformance, TransferScattersOneStreamIntoSeveralAllocations) {
  auto& b = make_bridge(kRing);
  const bool addressable = writes_in_place(b);  // host memory, or mapped for writing
  const std::vector<std::uint64_t> lengths{1, 4097, kRing, 64, 3 * kRing + 123};
  std::uint64_t total = 0;
  for (auto n : lengths) total += n;
  const Bytes data = random_bytes(total);
  std::vector<DeviceHandle> handles;
  std::vector<DeviceSpan> targets;
  for (auto n : lengths) {
    handles.push_back(b.alloc_device(bytes_spec(extent_for(n)), extent_for(n)));
    targets.push_back(DeviceSpan{handles.back(), 0, n});
  }
  TransferPlanner planner(b);
  std::uint64_t expected = 0;
  const ScatterSource source{[&](std::uint64_t at, std::span<const std::span<std::byte>> pieces) {
    EXPECT_EQ(at, expected);
    std::uint64_t n = 0;
    for (const auto& piece : pieces) {
      std::memcpy(piece.data(), data.data() + at + n, piece.size());
      n += piece.size();
    }
    EXPECT_LE(n, planner.chunk_bytes());
    if (!addressable) EXPECT_EQ(pieces.size(), 1u);
    expected += n;
  }};
  const auto results = planner.submit_scatter(source, targets);
  ASSERT_EQ(results.size(), lengths.size());
  for (const auto& result : results) {
    EXPECT_EQ(result.route, addressable ? Route::WriteInPlace : Route::RingChunks);
    for (const PendingCopy& copy : result.pending) b.wait(copy.event);
  }
  EXPECT_EQ(expected, total);
  std::uint64_t at = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    Bytes back(lengths[i]);
    planner.download(handles[i], 0, back);
    EXPECT_TRUE(std::equal(back.begin(), back.end(), data.begin() + static_cast<std::ptrdiff_t>(at))) << i;
    at += lengths[i];
  }
  // A target without a length, and a fill that throws part-way: nothing left held.
  std::vector<DeviceSpan> unsized{DeviceSpan{handles[0]}};
  EXPECT_KIND(ErrorKind::InvalidRange, planner.submit_scatter(source, unsized), "no length");
  const ScatterSource failing{[](std::uint64_t at, std::span<const std::span<std::byte>>) {
    if (at != 0) throw std::runtime_error("short read");
  }};
  EXPECT_THROW(planner.submit_scatter(failing, targets), std::runtime_error);
  b.poll();
  for (const DeviceHandle h : handles) b.free_device(h);
  expect_nothing_left(b);
}

// Room another caller of the bridge holds (here, a reservation of the whole
// ring): refused at once by default, after the wait with wait_for_room,
// and taken as soon as it comes back while the call waits; negative waits
// are refused.
TEST_P(TransferConformance, TransferWaitsForRingRoomAnotherCallerHolds) {
  using namespace std::chrono_literals;
  auto& b = make_bridge(kRing);
  EXPECT_KIND(ErrorKind::InvalidRange, TransferPlanner(b, {.wait_for_room = -1ns}), "wait_for_room");
  const Bytes data = random_bytes(2 * kRing + 5);
  const DeviceHandle h = b.alloc_device(bytes_spec(extent_for(data.size())), extent_for(data.size()));
  const HostRange held = b.reserve(kRing);
  TransferPlanner at_once(b, {.route = Route::RingChunks});
  EXPECT_KIND(ErrorKind::Backpressure, at_once.run(HostSource{data}, DeviceSpan{h}), "upload chunk 0");
  TransferPlanner briefly(b, {.route = Route::RingChunks, .wait_for_room = 5ms});
  EXPECT_KIND(ErrorKind::Backpressure, briefly.run(HostSource{data}, DeviceSpan{h}), "upload chunk 0");
  TransferPlanner patient(b, {.route = Route::RingChunks, .wait_for_room = std::chrono::nanoseconds::max()});
  std::thread neighbour([&] {
    std::this_thread::sleep_for(20ms);
    b.release_host(held);
  });
  EXPECT_NO_THROW(patient.run(HostSource{data}, DeviceSpan{h}));
  neighbour.join();
  Bytes back(data.size());
  patient.run(DeviceSpan{h}, HostDestination{back});
  EXPECT_EQ(back, data);
  b.free_device(h);
  expect_nothing_left(b);
}

// wait_for_room is waited once for a chunk, however often it comes back
// short of room (it was waited twice: a restore's 60 s gave up after 120).
// Counted in the caller's while_waiting hook, called between 20 ms slices of
// a wait: one 200 ms wait makes about ten calls, two about twenty; a loaded
// machine makes fewer, never more.
TEST_P(TransferConformance, AChunkWaitsForRoomOnce) {
  using namespace std::chrono_literals;
  auto& b = make_bridge(kRing);
  const Bytes data = random_bytes(kRing);
  const DeviceHandle h = b.alloc_device(bytes_spec(extent_for(data.size())), extent_for(data.size()));
  const HostRange held = b.reserve(kRing);
  int calls = 0;
  const std::function<void()> count = [&] { ++calls; };
  TransferPlanner briefly(b, {.while_waiting = count, .route = Route::RingChunks, .wait_for_room = 200ms});
  EXPECT_KIND(ErrorKind::Backpressure, briefly.run(HostSource{data}, DeviceSpan{h}), "upload chunk 0");
  EXPECT_GE(calls, 1);
  EXPECT_LE(calls, 12);
  b.release_host(held);
  b.free_device(h);
  expect_nothing_left(b);
}

// A copy whose completion never comes (a hung device) keeps a transfer
// waiting, for its own copy or for room that copy holds: the caller's
// while_waiting hook ends the wait (Ctrl-C in Python, the CLI's stall
// limit), and cleanup then hands the ranges still in use to the bridge at
// once instead of waiting its cleanup_timeout for copies that never end.
TEST_P(TransferConformance, WhileWaitingEndsAWaitForALostCompletion) {
  using namespace std::chrono_literals;
  if (!is_fake()) GTEST_SKIP() << "needs the fake's fault injection";
  struct Interrupted {};
  auto& b = make_bridge(kRing);
  fake_of(b).set_auto_complete(true);
  int calls = 0;
  const TransferOptions interruptible{.cleanup_timeout = 60s,
                                      .while_waiting = [&] {
                                        if (++calls == 3) throw Interrupted{};
                                      },
                                      .route = Route::RingChunks};
  const Bytes data = random_bytes(kRing / 2);
  const DeviceHandle h = TransferPlanner(b).upload(data, bytes_spec(data.size()), data.size());

  fake_of(b).inject(fake::Call::CopyDeviceToHost, fake::Failure::LostCompletion);
  Bytes back(data.size());
  const auto started = std::chrono::steady_clock::now();
  EXPECT_THROW(TransferPlanner(b, interruptible).run(DeviceSpan{h}, HostDestination{back}), Interrupted);
  EXPECT_EQ(calls, 3);
  EXPECT_LT(std::chrono::steady_clock::now() - started, 30s) << "cleanup waited for a copy that never ends";
  EXPECT_EQ(b.stats().ring_releases_pending, 1u) << "the lost copy's range waits in the bridge";

  // The lost copy's range holds half the ring; a caller's reservation the rest: an upload waits for room.
  const HostRange held = b.reserve(b.stats().ring_capacity - b.stats().ring_used);
  calls = 0;
  EXPECT_THROW(TransferPlanner(b, interruptible).run(HostSource{data}, DeviceSpan{h}), Interrupted);
  EXPECT_EQ(calls, 3);
  b.release_host(held);
}

// The same for the in-flight budget: another caller's copy holds all of it
// (the fake keeps it in flight), and the planner's chunk copy waits for it
// to end (Admission) instead of failing.
TEST_P(TransferConformance, TransferWaitsForBudgetAnotherCallersCopyHolds) {
  using namespace std::chrono_literals;
  if (!is_fake()) GTEST_SKIP() << "needs the fake's held copies";
  constexpr std::uint64_t kChunk = 4096;
  auto& b = make_bridge(kRing, kChunk);
  auto& fake = fake_of(b);
  const DeviceHandle theirs = b.alloc_device(bytes_spec(kChunk), kChunk);
  const Bytes data = random_bytes(3 * kChunk);
  const DeviceHandle h = b.alloc_device(bytes_spec(data.size()), data.size());
  hold(true);
  const HostRange range = b.reserve(kChunk);
  const CopyEvent their_copy = b.host_to_device(range, DeviceRange{theirs, 0, kChunk}, CopyMode::Async);
  TransferPlanner at_once(b, {.chunk_bytes = kChunk, .route = Route::RingChunks});
  EXPECT_KIND(ErrorKind::Backpressure, at_once.run(HostSource{data}, DeviceSpan{h}), "upload chunk 0");
  std::atomic<bool> done{false};
  std::thread completer([&] {
    std::this_thread::sleep_for(20ms);  // the planner is waiting by now, or soon
    while (!done) {
      for (const CopyEvent& e : fake.pending()) fake.complete(e);
      std::this_thread::sleep_for(100us);
    }
  });
  TransferPlanner patient(b, {.chunk_bytes = kChunk, .route = Route::RingChunks, .wait_for_room = 10s});
  EXPECT_NO_THROW(patient.run(HostSource{data}, DeviceSpan{h}));
  done = true;
  completer.join();
  hold(false);
  EXPECT_EQ(b.wait(their_copy).state, CopyState::Completed);
  b.release_host(range);
  Bytes back(data.size());
  patient.run(DeviceSpan{h}, HostDestination{back});
  EXPECT_EQ(back, data);
  b.free_device(h);
  b.free_device(theirs);
  expect_nothing_left(b);
}

TEST_P(TransferConformance, TransferWaitsForRoomAnotherTransferHoldsWithoutBeingAsked) {
  using namespace std::chrono_literals;
  if (!is_fake()) GTEST_SKIP() << "needs the fake's held copies";
  constexpr std::uint64_t kChunk = 16 << 10;  // the ring (and the in-flight budget) holds four
  auto& b = make_bridge(kRing, kRing);
  auto& fake = fake_of(b);
  const Bytes theirs_data = random_bytes(8 * kChunk), ours_data = random_bytes(kChunk);
  const DeviceHandle theirs = b.alloc_device(bytes_spec(theirs_data.size()), theirs_data.size());
  const DeviceHandle ours = b.alloc_device(bytes_spec(kChunk), kChunk);
  hold(true);
  // Another caller's transfer fills the ring with its chunks in flight and waits for the oldest.
  std::thread neighbour([&] {
    TransferPlanner planner(b, {.chunk_bytes = kChunk, .route = Route::RingChunks});
    planner.run(HostSource{theirs_data}, DeviceSpan{theirs});
  });
  for (const auto deadline = std::chrono::steady_clock::now() + 10s; b.ring_free_bytes() >= kChunk;) {
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "the neighbour never filled the ring";
      break;
    }
    std::this_thread::sleep_for(100us);
  }
  std::atomic<bool> done{false};
  std::thread completer([&] {
    std::this_thread::sleep_for(20ms);  // this transfer is waiting by now, or soon
    while (!done) {
      for (const CopyEvent& e : fake.pending()) fake.complete(e);
      std::this_thread::sleep_for(100us);
    }
  });
  // wait_for_room 0: room a caller's own reservations hold is refused at once, a neighbour's waited for.
  TransferPlanner ours_planner(b, {.chunk_bytes = kChunk, .route = Route::RingChunks});
  EXPECT_NO_THROW(ours_planner.run(HostSource{ours_data}, DeviceSpan{ours}));
  neighbour.join();
  done = true;
  completer.join();
  hold(false);
  Bytes back(kChunk), theirs_back(theirs_data.size());
  ours_planner.run(DeviceSpan{ours}, HostDestination{back});
  ours_planner.run(DeviceSpan{theirs}, HostDestination{theirs_back});
  EXPECT_EQ(back, ours_data);
  EXPECT_EQ(theirs_back, theirs_data);
  b.free_device(ours);
  b.free_device(theirs);
  expect_nothing_left(b);
}

std::string driver_name(const ::testing::TestParamInfo<BackendDriver>& info) { return std::string(info.param.name); }

INSTANTIATE_TEST_SUITE_P(Backends, TransferConformance, ::testing::ValuesIn(backend_drivers()), driver_name);

}  // namespace
}  // namespace devbridge::conformance
