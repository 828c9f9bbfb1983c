// The Stager (include/devbridge/stager.hpp) against every backend in
// backend_drivers.cpp: round trips through a ring much smaller than the data,
// offsets, hostile sizes, Backpressure, Closed, progress, and (on the fake,
// which can fail a chunk copy on demand) cleanup after a failure that leaves
// nothing behind and never releases a range a copy may still use.
//
// After each test body the bridge must hold nothing the Stager made: no ring
// reservation, no copy in flight, no allocation it did not hand back.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend_drivers.hpp"
#include "staging_test_support.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/stager.hpp"

namespace devbridge::conformance {
namespace {

using namespace std::chrono_literals;
using Bytes = std::vector<std::byte>;

constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
constexpr std::uint64_t kRing = 64 << 10;
constexpr std::uint64_t kDefaultChunk = kRing / 4;  // the Stager's default for this ring

ObjectSpec bytes_spec(std::uint64_t extent) { return ObjectSpec{extent, 1, DType::UInt8, ShapeKind::Vector}; }


::testing::AssertionResult same_bytes(std::span<const std::byte> actual, std::span<const std::byte> expected) {
  if (actual.size() != expected.size())
    return ::testing::AssertionFailure() << actual.size() << " bytes, expected " << expected.size();
  for (std::size_t i = 0; i < actual.size(); ++i)
    if (actual[i] != expected[i]) return ::testing::AssertionFailure() << "first difference at byte " << i;
  return ::testing::AssertionSuccess();
}

// Downloads [offset, offset + expected.size()) through `stager` and compares it with `expected`.
::testing::AssertionResult device_holds(Stager& stager, DeviceHandle handle, std::uint64_t offset,
                                        std::span<const std::byte> expected) {
  Bytes back(expected.size());
  stager.download(handle, offset, back);
  return same_bytes(back, expected);
}

class StagerConformance : public DriverTest {
 protected:
  bool is_fake() const { return driver().name == "fake"; }
  fake::FakeBackend& fake_backend() { return *bridge_->backend().test_controls()->fake(); }

  Bridge& make_bridge(std::uint64_t ring_bytes = kRing, std::uint64_t inflight_budget = 0) {
    return DriverTest::make_bridge(ring_bytes, inflight_budget);
  }

  Bytes random_bytes(std::size_t n) {
    Bytes out(n);
    for (auto& b : out) b = static_cast<std::byte>(random_());
    return out;
  }

  // Nothing the Stager made is left: no reservation, no copy in flight, and
  // the device holds exactly `allocations` allocations.
  void expect_nothing_left(std::uint64_t allocations = 0) {
    const auto stats = bridge_->stats();
    EXPECT_EQ(stats.ring_reservations, 0u);
    EXPECT_EQ(stats.ring_used, 0u);
    EXPECT_EQ(stats.copies_in_flight, 0u);
    EXPECT_EQ(stats.inflight_bytes, 0u);
    EXPECT_EQ(stats.live_allocations, allocations);
    // A pool that packs small allocations into one segment holds fewer
    // backend allocations than the bridge has; none is left all the same.
    if (allocations == 0 || !bridge_->memory_stats().pool_splits)
      EXPECT_EQ(backend_live_allocations(), allocations);
  }

  std::mt19937_64 random_{std::hash<std::string>{}(
      ::testing::UnitTest::GetInstance()->current_test_info()->name())};
};

// ---- round trips -------------------------------------------------------------

// 1 byte, sizes around and between chunk boundaries, and 16x the ring: every
// byte comes back, and each range went back to the ring on the way.
TEST_P(StagerConformance, StagerRoundTripsAreBitExact) {
  auto& b = make_bridge();
  Stager stager(b);
  ASSERT_EQ(stager.chunk_bytes(), kDefaultChunk);
  for (const std::uint64_t size : {std::uint64_t{1}, kDefaultChunk - 1, kDefaultChunk, kDefaultChunk + 1,
                                   3 * kDefaultChunk + 123, kRing + 7, std::uint64_t{1} << 20}) {
    SCOPED_TRACE("size " + std::to_string(size));
    const Bytes data = random_bytes(size);
    const DeviceHandle h = stager.upload(data, bytes_spec(size), size);
    EXPECT_TRUE(device_holds(stager, h, 0, data));
    expect_nothing_left(1);
    b.free_device(h);
  }
  expect_nothing_left();
}

// A wider dtype: chunks stay whole elements, and a size that is not a
// multiple of the chunk still arrives exactly.
TEST_P(StagerConformance, StagerRoundTripsFloat32WithOddChunks) {
  auto& b = make_bridge();
  Stager stager(b, {.chunk_bytes = 10000, .max_chunks_in_flight = 3});  // not a multiple of 4096
  constexpr std::uint64_t kBytes = 4 * 77777;
  constexpr std::uint64_t kExtent = (kBytes + 255) / 256 * 256;  // the data need not fill the extent
  const Bytes data = random_bytes(kBytes);
  const DeviceHandle h = stager.upload(data, ObjectSpec{kExtent, 256, DType::Float32, ShapeKind::Vector}, kExtent);
  EXPECT_TRUE(device_holds(stager, h, 0, data));
  b.free_device(h);
  expect_nothing_left();
}

// upload_into writes exactly [offset, offset + n); download at an offset
// reads exactly that.
TEST_P(StagerConformance, StagerUploadIntoAnOffsetTouchesOnlyThoseBytes) {
  auto& b = make_bridge();
  Stager stager(b);
  constexpr std::uint64_t kExtent = 256 << 10;
  constexpr std::uint64_t kOffset = 12345;
  constexpr std::uint64_t kLen = 100001;
  Bytes model(kExtent, std::byte{0xA5});
  const DeviceHandle h = stager.upload(model, bytes_spec(kExtent), kExtent);

  const Bytes data = random_bytes(kLen);
  stager.upload_into(h, kOffset, data);
  std::memcpy(model.data() + kOffset, data.data(), kLen);

  EXPECT_TRUE(device_holds(stager, h, 0, model));
  EXPECT_TRUE(device_holds(stager, h, kOffset, data));
  // Zero bytes at the very end is a valid no-op.
  stager.upload_into(h, kExtent, {});
  b.free_device(h);
  expect_nothing_left();
}

// ---- hostile numbers -----------------------------------------------------------

TEST_P(StagerConformance, StagerRefusesHostileSizesAndOffsetsAndLeaksNothing) {
  auto& b = make_bridge();
  Stager stager(b);
  constexpr std::uint64_t kExtent = 64 << 10;
  const DeviceHandle h = stager.upload(Bytes(kExtent), bytes_spec(kExtent), kExtent);
  const DeviceHandle f32 =
      stager.upload(Bytes(kExtent), ObjectSpec{kExtent, 64, DType::Float32, ShapeKind::Vector}, kExtent);
  const Bytes data(100);
  Bytes out(100);
  for (const std::uint64_t offset : {kMax, kMax - 99, kMax - 50, std::uint64_t{1} << 63, kExtent, kExtent - 99}) {
    SCOPED_TRACE("device offset " + std::to_string(offset));
    EXPECT_KIND(ErrorKind::InvalidRange, stager.upload_into(h, offset, data), std::to_string(offset));
    EXPECT_KIND(ErrorKind::InvalidRange, stager.download(h, offset, out), std::to_string(offset));
  }
  // Not whole float32 elements.
  EXPECT_KIND(ErrorKind::InvalidRange, stager.upload_into(f32, 2, Bytes(8)), "element size 4");
  EXPECT_KIND(ErrorKind::InvalidRange, stager.download(f32, 0, std::span(out).first(7)), "element size 4");
  // More bytes than the extent: refused before anything is allocated.
  EXPECT_KIND(ErrorKind::InvalidRange, stager.upload(Bytes(kExtent + 1), bytes_spec(kExtent + 1), kExtent),
              "past its extent");
  // A handle the bridge never issued.
  EXPECT_KIND(ErrorKind::UnknownDeviceHandle,
              stager.upload_into(DeviceHandle{h.domain, h.generation, h.id + 1000}, 0, data));
  expect_nothing_left(2);

  // Options that could never stage anything.
  EXPECT_KIND(ErrorKind::InvalidRange, Stager(b, {.chunk_bytes = kRing + 1}), "does not fit the ring");
  EXPECT_KIND(ErrorKind::InvalidRange, Stager(b, {.chunk_bytes = kMax}), "does not fit the ring");
  EXPECT_KIND(ErrorKind::InvalidRange, Stager(b, {.max_chunks_in_flight = 0}), "max_chunks_in_flight");
  EXPECT_KIND(ErrorKind::InvalidRange, Stager(b, {.cleanup_timeout = -1ns}), "cleanup_timeout");

  // The bridge and the Stager still work.
  const Bytes fresh = random_bytes(kExtent);
  stager.upload_into(h, 0, fresh);
  EXPECT_TRUE(device_holds(stager, h, 0, fresh));
  b.free_device(h);
  b.free_device(f32);
  expect_nothing_left();
}

// ---- backpressure ------------------------------------------------------------------

// An in-flight budget of one chunk (and a ring of four) under a window of 8
// chunks: every Backpressure is answered by finishing the oldest chunk.
TEST_P(StagerConformance, StagerCompletesUnderATinyInFlightBudget) {
  for (const std::uint64_t budget : {std::uint64_t{4096}, kDefaultChunk}) {
    SCOPED_TRACE("in-flight budget " + std::to_string(budget));
    auto& b = make_bridge(kRing, budget);
    Stager stager(b, {.max_chunks_in_flight = 8});
    EXPECT_LE(stager.chunk_bytes(), budget);
    constexpr std::uint64_t kBytes = 1 << 20;
    const Bytes data = random_bytes(kBytes);
    const DeviceHandle h = stager.upload(data, bytes_spec(kBytes), kBytes);
    EXPECT_TRUE(device_holds(stager, h, 0, data));
    b.free_device(h);
    expect_nothing_left();
  }
}

// On the fake, copies complete only while the budget is full (and then the
// oldest only), so the Stager gets past each full budget only by waiting for
// its own oldest chunk; a Backpressure it did not answer would end the upload.
TEST_P(StagerConformance, StagerWaitsForItsOldestChunkOnBackpressure) {
  if (!is_fake()) GTEST_SKIP() << "needs the fake's per-copy completion";
  constexpr std::uint64_t kChunk = 8 << 10;
  constexpr std::uint64_t kChunks = 41;  // the last one 5 bytes
  constexpr std::uint64_t kBytes = (kChunks - 1) * kChunk + 5;
  auto& b = make_bridge(kRing, 2 * kChunk);
  auto& fake = fake_backend();
  Stager stager(b, {.chunk_bytes = kChunk, .max_chunks_in_flight = 8});
  const Bytes data = random_bytes(kBytes);
  const DeviceHandle h = b.alloc_device(bytes_spec(kBytes), kBytes);

  hold(true);
  std::atomic<bool> done{false};
  std::atomic<std::uint64_t> completed_when_full{0};
  std::thread completer([&] {
    while (!done) {
      const auto stats = b.stats();
      const auto pending = fake.pending();
      // Two pending here and in the bridge: the last completion has been applied.
      const bool full = stats.inflight_bytes == 2 * kChunk && pending.size() == 2;
      const bool all_submitted = stats.copies_submitted == kChunks && !pending.empty();
      if ((full || all_submitted) && fake.complete(pending.front())) {
        completed_when_full += full;
      } else {
        std::this_thread::sleep_for(20us);
      }
    }
  });
  EXPECT_NO_THROW(stager.upload_into(h, 0, data));
  done = true;
  completer.join();
  hold(false);
  EXPECT_EQ(completed_when_full.load(), kChunks - 2) << "each chunk after the first two waited for a full budget";
  EXPECT_TRUE(device_holds(stager, h, 0, data));
  b.free_device(h);
  expect_nothing_left();
}

// ---- failures -------------------------------------------------------------------------

// A chunk copy that fails mid-transfer (at submit or at completion, either
// direction) surfaces with the chunk named; the upload's allocation is freed
// and every range is back.
TEST_P(StagerConformance, StagerFailedChunkIsNamedAndLeavesNothing) {
  if (!is_fake()) GTEST_SKIP() << "needs the fake's fault injection";
  using fake::Call;
  using fake::Failure;
  auto& b = make_bridge();
  Stager stager(b);
  constexpr std::uint64_t kBytes = 1 << 20;
  const Bytes data = random_bytes(kBytes);
  // Chunk 2 is bytes 32768..49152 of the 16 KiB chunks.
  const std::string chunk2 = "chunk 2 (bytes 32768..49152 of 1048576";
  for (const Failure failure : {Failure::CopyFailedAtSubmit, Failure::CopyFailedAtCompletion}) {
    SCOPED_TRACE(std::string(fake::failure_name(failure)));
    fake_backend().inject(Call::CopyHostToDevice, failure, 3);
    EXPECT_KIND(ErrorKind::DeviceCopyFailed, stager.upload(data, bytes_spec(kBytes), kBytes), "upload " + chunk2);
    expect_nothing_left();
    EXPECT_EQ(stager.stranded_ranges(), 0u);

    const DeviceHandle h = stager.upload(data, bytes_spec(kBytes), kBytes);
    fake_backend().inject(Call::CopyDeviceToHost, failure, 3);
    Bytes back(kBytes);
    EXPECT_KIND(ErrorKind::OutputCopyFailed, stager.download(h, 0, back), "download " + chunk2);
    // The chunks before the failed one arrived.
    EXPECT_TRUE(same_bytes(std::span(back).first(2 * kDefaultChunk), std::span(data).first(2 * kDefaultChunk)));
    expect_nothing_left(1);
    b.free_device(h);
  }
  // A Broken bridge (a fatal copy failure) refuses every call; close() frees everything.
  fake_backend().inject(Call::CopyHostToDevice, Failure::Fatal, 2);
  EXPECT_KIND(ErrorKind::DeviceCopyFailed, stager.upload(data, bytes_spec(kBytes), kBytes), "upload chunk 1");
  EXPECT_TRUE(b.stats().broken);
  EXPECT_KIND(ErrorKind::Broken, stager.upload(data, bytes_spec(kBytes), kBytes));
  b.close();
  EXPECT_EQ(backend_live_allocations(), 0u);
}

// A chunk fails while later chunks are still in flight and never complete
// within the cleanup timeout: their ranges are not released (the device may
// still read them) but handed to the bridge (release_host_after), the
// allocation's free is deferred; once the copies end, the bridge itself gives
// everything back, with no call of the Stager's.
TEST_P(StagerConformance, StagerNeverReleasesARangeACopyMayStillUse) {
  if (!is_fake()) GTEST_SKIP() << "needs the fake's per-copy completion";
  auto& b = make_bridge();
  auto& fake = fake_backend();
  Stager stager(b, {.max_chunks_in_flight = 4, .cleanup_timeout = 20ms});
  constexpr std::uint64_t kBytes = 1 << 20;
  const Bytes data = random_bytes(kBytes);

  hold(true);
  std::thread failer([&] {
    // Fail the oldest copy once the window is full (four chunks in flight).
    for (;;) {
      const auto pending = fake.pending();
      if (pending.size() == 4) {
        fake.complete(pending.front(), false);
        return;
      }
      std::this_thread::sleep_for(50us);
    }
  });
  EXPECT_KIND(ErrorKind::DeviceCopyFailed, stager.upload(data, bytes_spec(kBytes), kBytes),
              "upload chunk 0 (bytes 0..16384 of 1048576");
  failer.join();

  EXPECT_EQ(stager.stranded_ranges(), 3u);
  auto stats = b.stats();
  EXPECT_EQ(stats.ring_releases_pending, 3u) << "the planner holds no ranges: the bridge does";
  EXPECT_EQ(stats.copies_in_flight, 3u);
  EXPECT_EQ(stats.ring_reservations, 3u) << "the ranges of copies in flight must stay reserved";
  EXPECT_EQ(backend_live_allocations(), 1u) << "freed under copies still in flight";

  hold(false);  // the copies end
  b.poll();       // applying their completions releases the ranges
  EXPECT_EQ(b.stats().ring_releases_pending, 0u);
  EXPECT_EQ(b.stats().ring_reservations, 0u);
  EXPECT_EQ(stager.stranded_ranges(), 0u);
  EXPECT_EQ(stager.release_stranded(), 0u);
  expect_nothing_left();
}

// ---- Closed, restart -----------------------------------------------------------------------

TEST_P(StagerConformance, StagerRefusesAClosedBridge) {
  auto& b = make_bridge();
  const Bytes data = random_bytes(3 * kDefaultChunk);
  const DeviceHandle h = b.alloc_device(bytes_spec(data.size()), data.size());
  Stager stager(b);
  b.close();
  EXPECT_KIND(ErrorKind::Closed, Stager{b}, "closed");
  EXPECT_KIND(ErrorKind::Closed, stager.upload(data, bytes_spec(data.size()), data.size()));
  EXPECT_KIND(ErrorKind::Closed, stager.upload_into(h, 0, data));
  Bytes out(data.size());
  EXPECT_KIND(ErrorKind::Closed, stager.download(h, 0, out));
  EXPECT_EQ(backend_live_allocations(), 0u);
}

TEST_P(StagerConformance, StagerCloseDuringAnUploadSurfacesAsClosed) {
  auto& b = make_bridge();
  constexpr std::uint64_t kBytes = 1 << 20;
  const Bytes data = random_bytes(kBytes);
  Stager stager(b, {.progress = [&](std::uint64_t done, std::uint64_t) {
                      if (done == 3 * kDefaultChunk) b.close();
                    }});
  EXPECT_KIND(ErrorKind::Closed, stager.upload(data, bytes_spec(kBytes), kBytes), "upload chunk");
  EXPECT_EQ(stager.stranded_ranges(), 0u);
  EXPECT_EQ(backend_live_allocations(), 0u);
}

TEST_P(StagerConformance, StagerRestartDuringADownloadLeavesNothing) {
  auto& b = make_bridge();
  constexpr std::uint64_t kBytes = 1 << 20;
  Stager loader(b);
  const DeviceHandle h = loader.upload(random_bytes(kBytes), bytes_spec(kBytes), kBytes);
  Stager stager(b, {.progress = [&](std::uint64_t done, std::uint64_t) {
                      if (done == 2 * kDefaultChunk) b.restart(2);
                    }});
  Bytes out(kBytes);
  EXPECT_KIND(ErrorKind::OldGenerationHandle, stager.download(h, 0, out), "download chunk");
  EXPECT_EQ(stager.stranded_ranges(), 0u);
  expect_nothing_left();
}

// ---- progress ---------------------------------------------------------------------------------

TEST_P(StagerConformance, StagerReportsProgressPerChunk) {
  auto& b = make_bridge();
  std::vector<std::pair<std::uint64_t, std::uint64_t>> calls;
  Stager stager(b, {.progress = [&](std::uint64_t done, std::uint64_t total) { calls.emplace_back(done, total); }});
  constexpr std::uint64_t kBytes = 6 * kDefaultChunk + 1000;
  const Bytes data = random_bytes(kBytes);
  const DeviceHandle h = stager.upload(data, bytes_spec(kBytes), kBytes);
  EXPECT_TRUE(device_holds(stager, h, 0, data));

  ASSERT_EQ(calls.size(), 2 * 7u) << "seven chunks each way";
  for (std::size_t i = 0; i < calls.size(); ++i) {
    const std::uint64_t chunk = i % 7;
    EXPECT_EQ(calls[i].second, kBytes);
    EXPECT_EQ(calls[i].first, std::min((chunk + 1) * kDefaultChunk, kBytes)) << "call " << i;
  }
  // A progress callback that throws ends the call; nothing is left behind.
  Stager throwing(b, {.progress = [](std::uint64_t done, std::uint64_t) {
                        if (done > kDefaultChunk) throw std::runtime_error("stop");
                      }});
  Bytes out(kBytes);
  EXPECT_THROW(throwing.download(h, 0, out), std::runtime_error);
  EXPECT_EQ(throwing.stranded_ranges(), 0u);
  expect_nothing_left(1);
  b.free_device(h);
}

std::string driver_name(const ::testing::TestParamInfo<BackendDriver>& info) { return std::string(info.param.name); }

INSTANTIATE_TEST_SUITE_P(Backends, StagerConformance, ::testing::ValuesIn(backend_drivers()), driver_name);

}  // namespace
}  // namespace devbridge::conformance
