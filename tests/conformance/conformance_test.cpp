// The backend conformance suite: every rule of the contract that depends on
// what a backend does, run through the Bridge against every backend in
// backend_drivers.cpp. One test body per rule; no backend has its own copy.
//
// Conventions:
//  - Data is random (seeded per test, so a failure reproduces); untouched
//    bytes are checked against poison written first (kDevicePoison on the
//    device, kHostPoison in the ring).
//  - Waits block without a timeout; ctest's TIMEOUT catches a hang. No
//    assertion depends on how fast anything runs.
//  - "Pending" states are asserted only while the driver holds copies; a
//    backend that cannot hold skips those checks (and says so).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend_drivers.hpp"
#include "conformance_support.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/consumer_names.hpp"
#include "forwarding_backend.hpp"

namespace devbridge::conformance {
namespace {

// ---- description ---------------------------------------------------------

TEST_P(BackendConformance, DescribesItselfAndItsViews) {
  auto& b = make_bridge();
  const auto info = b.backend_info();
  EXPECT_EQ(info.name, driver().name);
  EXPECT_FALSE(info.vendor.empty());
  EXPECT_FALSE(info.device_name.empty());
  EXPECT_FALSE(tinygrad_device(info.device_kind, info.device_ordinal).empty());
  EXPECT_FALSE(info.dtypes.empty());
  EXPECT_LE(info.free_memory, info.total_memory == 0 ? info.free_memory : info.total_memory);

  const auto h = b.alloc_device(ObjectSpec{4096, 64, DType::UInt8, ShapeKind::Matrix}, 4096);
  const auto lease = b.view(h, view_spec(DType::UInt8, Dims{64, 64}));
  EXPECT_EQ(lease->device, tinygrad_device(info.device_kind, info.device_ordinal));
  EXPECT_EQ(lease->dlpack_device_type, static_cast<int>(dlpack_device(info.device_kind)));
  EXPECT_EQ(lease->device_ordinal, info.device_ordinal);
  EXPECT_NE(lease->data, 0u);
  EXPECT_TRUE(lease->contiguous());
}

// ---- exact bytes ---------------------------------------------------------

// Copies of every direction and mode move exactly the bytes asked: nothing
// outside the device range or the host range changes, and an upload leaves
// its source untouched.
TEST_P(BackendConformance, CopiesMoveExactlyTheRequestedBytes) {
  auto& b = make_bridge();
  constexpr std::uint64_t kExtent = 64 << 10;
  const auto h = b.alloc_device(bytes_spec(kExtent, 1), kExtent);
  write_device(h, 0, Bytes(kExtent, kDevicePoison));

  for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
    SCOPED_TRACE(mode == CopyMode::Sync ? "sync" : "async");
    write_device(h, 0, Bytes(kExtent, kDevicePoison));
    // Odd offsets and lengths: nothing may round to a word or a line.
    const std::uint64_t offset = 1000 + random_.below(1000) * 2 + 1;
    const std::uint64_t len = 5000 + random_.below(3000) * 2 + 1;
    const Bytes data = random_.bytes_not(len, kDevicePoison);

    // Upload from the middle of a poisoned reservation.
    const auto up = reserve_poisoned(len + 2 * kGuard);
    std::memcpy(b.host_bytes(up).data() + kGuard, data.data(), len);
    const auto up_event = b.host_to_device(HostRange{up.offset + kGuard, len}, DeviceRange{h, offset, len}, mode);
    if (mode == CopyMode::Async) {
      EXPECT_EQ(b.wait(up_event).state, CopyState::Completed);
    }
    EXPECT_TRUE(b.safe_to_release_host(up_event));
    const auto up_host = b.host_bytes(up);
    EXPECT_TRUE(bytes_equal(slice(up_host, kGuard, len), data, "upload source after the upload"));
    EXPECT_TRUE(all_bytes_are(up_host.first(kGuard), kHostPoison, "bytes before the upload source"));
    EXPECT_TRUE(all_bytes_are(up_host.last(kGuard), kHostPoison, "bytes after the upload source"));
    b.release_host(up);

    // Download exactly that range into the middle of another poisoned reservation.
    const auto down = reserve_poisoned(len + 2 * kGuard);
    const auto down_event =
        b.device_to_host(DeviceRange{h, offset, len}, HostRange{down.offset + kGuard, len}, mode);
    if (mode == CopyMode::Async) {
      EXPECT_EQ(b.wait(down_event).state, CopyState::Completed);
    }
    EXPECT_TRUE(b.host_bytes_valid(down_event));
    const auto down_host = b.host_bytes(down);
    EXPECT_TRUE(bytes_equal(slice(down_host, kGuard, len), data, "downloaded bytes"));
    EXPECT_TRUE(all_bytes_are(down_host.first(kGuard), kHostPoison, "host bytes before the download"));
    EXPECT_TRUE(all_bytes_are(down_host.last(kGuard), kHostPoison, "host bytes after the download"));
    b.release_host(down);

    // The device outside [offset, offset + len) still holds its poison.
    const Bytes device = read_device(h, 0, kExtent);
    EXPECT_TRUE(all_bytes_are(slice(device, 0, offset), kDevicePoison, "device bytes before the upload"));
    EXPECT_TRUE(bytes_equal(slice(device, offset, len), data, "device bytes of the upload"));
    EXPECT_TRUE(all_bytes_are(slice(device, offset + len, kExtent - offset - len), kDevicePoison,
                              "device bytes after the upload"));
  }
  b.free_device(h);
  EXPECT_EQ(backend_live_allocations(), 0u);
}

// Many async copies scattered over one allocation, some overlapping, all in
// flight at once; the device ends up as if they ran in submission order.
TEST_P(BackendConformance, ScatteredAsyncUploadsLandInSubmissionOrder) {
  auto& b = make_bridge();
  constexpr std::uint64_t kExtent = 256 << 10;
  const auto h = b.alloc_device(bytes_spec(kExtent, 1), kExtent);
  write_device(h, 0, Bytes(kExtent, kDevicePoison));
  Bytes model(kExtent, kDevicePoison);

  std::vector<std::pair<CopyEvent, HostRange>> in_flight;
  for (int i = 0; i < 48; ++i) {
    const std::uint64_t len = 1 + random_.below(16 << 10);
    const std::uint64_t offset = random_.below(kExtent - len + 1);
    const Bytes data = random_.bytes(len);
    const auto range = reserve_with(data);
    in_flight.emplace_back(b.host_to_device(range, DeviceRange{h, offset, len}, CopyMode::Async), range);
    std::memcpy(model.data() + offset, data.data(), len);
  }
  for (const auto& [event, range] : in_flight) {
    EXPECT_EQ(b.wait(event).state, CopyState::Completed);
    b.release_host(range);
  }
  EXPECT_TRUE(bytes_equal(read_device(h, 0, kExtent), model, "device after 48 overlapping uploads"));
  EXPECT_EQ(b.stats().copy_records, 0u) << "completed copy records must be retired";
}

// ---- ordering and safe-release points -----------------------------------

TEST_P(BackendConformance, AsyncCompletionOrderAndSafeReleasePoints) {
  if (!can_hold()) GTEST_SKIP() << driver().name << " cannot hold copies, so pending states cannot be pinned down";
  auto& b = make_bridge();
  constexpr std::uint64_t kHalf = 16 << 10;
  const auto h = b.alloc_device(bytes_spec(2 * kHalf), 2 * kHalf);
  const Bytes first = random_.bytes(kHalf);
  const Bytes second = random_.bytes(kHalf);
  const auto a = reserve_with(first);
  const auto c = reserve_with(second);
  const auto out = reserve_poisoned(2 * kHalf);

  hold(true);
  const auto e1 = b.host_to_device(a, DeviceRange{h, 0, kHalf}, CopyMode::Async);
  const auto e2 = b.host_to_device(c, DeviceRange{h, kHalf, kHalf}, CopyMode::Async);
  const auto e3 = b.device_to_host(DeviceRange{h, 0, 2 * kHalf}, out, CopyMode::Async);

  // In flight: nothing is safe, nothing is valid, nothing can be freed.
  EXPECT_EQ(b.copy_status(e1).state, CopyState::Pending);
  EXPECT_EQ(b.copy_status(e2).state, CopyState::Pending);
  EXPECT_FALSE(b.safe_to_release_host(e1));
  EXPECT_FALSE(b.safe_to_release_host(e2));
  EXPECT_FALSE(b.host_bytes_valid(e3));
  EXPECT_KIND(ErrorKind::AllocationStillInUse, b.release_host(a));
  EXPECT_KIND(ErrorKind::AllocationStillInUse, b.release_host(out));
  EXPECT_KIND(ErrorKind::AllocationStillInUse, b.free_device(h));
  EXPECT_KIND(ErrorKind::AllocationStillInUse, b.view(h, view_spec(DType::UInt8, Dims{2 * kHalf})));
  EXPECT_EQ(b.stats().copies_in_flight, 3u);
  EXPECT_TRUE(all_bytes_are(b.host_bytes(out), kHostPoison, "download target before its copy ran"));

  hold(false);
  // Same-direction copies complete in submission order: once the second
  // upload is complete, the first is too, without waiting for it.
  EXPECT_EQ(b.wait(e2).state, CopyState::Completed);
  EXPECT_EQ(b.copy_status(e1).state, CopyState::Completed);
  EXPECT_TRUE(b.safe_to_release_host(e1));
  // The download was submitted after both uploads into its bytes: it sees them.
  EXPECT_EQ(b.wait(e3).state, CopyState::Completed);
  EXPECT_TRUE(b.host_bytes_valid(e3));
  Bytes expected = first;
  expected.insert(expected.end(), second.begin(), second.end());
  EXPECT_TRUE(bytes_equal(b.host_bytes(out), expected, "download after two uploads"));

  b.release_host(a);
  b.release_host(c);
  b.release_host(out);
  const auto stats = b.stats();
  EXPECT_EQ(stats.copies_in_flight, 0u);
  EXPECT_EQ(stats.copy_records, 0u);
  EXPECT_EQ(stats.inflight_bytes, 0u);
  b.free_device(h);
}

// Once an upload is safe to release, the producer may overwrite the range at
// once: the device keeps what was uploaded.
TEST_P(BackendConformance, SafeReleaseMeansTheHostRangeMayBeReused) {
  auto& b = make_bridge();
  constexpr std::uint64_t kLen = 1 << 20;
  const auto h = b.alloc_device(bytes_spec(kLen), kLen);
  const Bytes data = random_.bytes(kLen);
  const auto range = reserve_with(data);
  const auto event = b.host_to_device(range, DeviceRange{h, 0, kLen}, CopyMode::Async);
  ASSERT_EQ(b.wait(event).state, CopyState::Completed);
  ASSERT_TRUE(b.safe_to_release_host(event));
  random_.fill(b.host_bytes(range));  // the producer's next chunk
  b.release_host(range);
  EXPECT_TRUE(bytes_equal(read_device(h, 0, kLen), data, "device after the source range was reused"));
}

// Async copies of both directions touching the same device bytes run in
// submission order, like copies on one stream: a download submitted after an
// upload sees the upload, and an upload submitted after a download does not
// change what the download returns. (The bridge does not order them; the
// backend must.)
TEST_P(BackendConformance, AsyncCopiesOfTheSameBytesAreOrderedAcrossDirections) {
  auto& b = make_bridge(32ull << 20);
  constexpr std::uint64_t kLen = 4 << 20;
  const auto h = b.alloc_device(bytes_spec(kLen), kLen);
  const Bytes first = random_.bytes(kLen);
  const Bytes second = random_.bytes(kLen);
  const auto in1 = reserve_with(first);
  const auto in2 = reserve_with(second);
  const auto out1 = reserve_poisoned(kLen);
  const auto out2 = reserve_poisoned(kLen);

  // Held where possible, so all four are queued before any runs and both
  // directions start together when released.
  if (can_hold()) hold(true);
  const auto up1 = b.host_to_device(in1, DeviceRange{h, 0, kLen}, CopyMode::Async);
  const auto down1 = b.device_to_host(DeviceRange{h, 0, kLen}, out1, CopyMode::Async);  // read after write
  const auto up2 = b.host_to_device(in2, DeviceRange{h, 0, kLen}, CopyMode::Async);     // write after read
  const auto down2 = b.device_to_host(DeviceRange{h, 0, kLen}, out2, CopyMode::Async);
  if (can_hold()) hold(false);
  for (const auto& e : {up1, down1, up2, down2}) EXPECT_EQ(b.wait(e).state, CopyState::Completed);
  EXPECT_TRUE(bytes_equal(b.host_bytes(out1), first, "download between two uploads"));
  EXPECT_TRUE(bytes_equal(b.host_bytes(out2), second, "download after the second upload"));

  // A sync copy orders after earlier async work on its bytes too.
  const auto up3 = b.host_to_device(in1, DeviceRange{h, 0, kLen}, CopyMode::Async);
  b.device_to_host(DeviceRange{h, 0, kLen}, out1, CopyMode::Sync);
  EXPECT_TRUE(bytes_equal(b.host_bytes(out1), first, "sync download after an async upload"));
  EXPECT_EQ(b.wait(up3).state, CopyState::Completed);
  for (const auto& r : {in1, in2, out1, out2}) b.release_host(r);
}

// The compute step runs after the uploads into x and before downloads of y
// submitted after it.
TEST_P(BackendConformance, AxpyRunsBetweenItsUploadAndItsDownload) {
  auto& b = make_bridge();
  constexpr std::uint64_t kCount = 64 << 10;
  constexpr std::uint64_t kBytes = kCount * sizeof(float);
  const ObjectSpec spec{kBytes, 64, DType::Float32, ShapeKind::Vector};
  const auto x = b.alloc_device(spec, kBytes);
  const auto y = b.alloc_device(spec, kBytes);
  std::vector<float> values(kCount);
  std::uniform_real_distribution<float> dist(-1000.0f, 1000.0f);
  for (auto& v : values) v = dist(random_.engine());
  const auto in = reserve_with(std::as_bytes(std::span(values)));
  const auto out = reserve_poisoned(kBytes);

  const float a = 2.5f, c = -1.25f;
  const auto up = b.host_to_device(in, DeviceRange{x, 0, kBytes}, CopyMode::Async);
  b.launch_axpy(DeviceRange{x, 0, kBytes}, DeviceRange{y, 0, kBytes}, a, c);
  const auto down = b.device_to_host(DeviceRange{y, 0, kBytes}, out, CopyMode::Async);
  EXPECT_EQ(b.wait(down).state, CopyState::Completed);
  EXPECT_EQ(b.wait(up).state, CopyState::Completed);

  std::vector<float> result(kCount);
  std::memcpy(result.data(), b.host_bytes(out).data(), kBytes);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < kCount; ++i) {
    const float expected = a * values[i] + c;
    // A device may fuse the multiply-add: allow its rounding, nothing more.
    if (!(std::fabs(result[i] - expected) <= 1e-6f * std::max(1.0f, std::fabs(expected)))) {
      if (++wrong <= 3) ADD_FAILURE() << "y[" << i << "] = " << result[i] << ", expected " << expected;
    }
  }
  EXPECT_EQ(wrong, 0u);
  b.release_host(in);
  b.release_host(out);
}

// ---- copies racing with frees and views ----------------------------------

TEST_P(BackendConformance, FreeAndReleaseWhileCopiesAreInFlight) {
  auto& b = make_bridge();
  constexpr std::uint64_t kLen = 2 << 20;
  const auto h = b.alloc_device(bytes_spec(kLen), kLen);
  const Bytes data = random_.bytes(kLen);
  const auto in = reserve_with(data);
  const auto out = reserve_poisoned(kLen);

  if (can_hold()) hold(true);
  const auto up = b.host_to_device(in, DeviceRange{h, 0, kLen}, CopyMode::Async);
  const auto down = b.device_to_host(DeviceRange{h, 0, kLen}, out, CopyMode::Async);
  if (can_hold()) {
    EXPECT_KIND(ErrorKind::AllocationStillInUse, b.free_device(h));
    EXPECT_EQ(backend_live_allocations(), 1u) << "a refused free changes nothing";
    EXPECT_EQ(b.extent(h), kLen);
  }
  // Deferred free: the handle is dead at once, the memory lives until the
  // copies end, and the copies still complete correctly.
  b.release(h);
  EXPECT_KIND(ErrorKind::UnknownDeviceHandle, b.extent(h));
  EXPECT_KIND(ErrorKind::UnknownDeviceHandle, b.host_to_device(in, DeviceRange{h, 0, kLen}, CopyMode::Async));
  if (can_hold()) {
    EXPECT_EQ(backend_live_allocations(), 1u) << "released while copies are in flight: memory must stay";
    hold(false);
  }
  EXPECT_EQ(b.wait(up).state, CopyState::Completed);
  EXPECT_EQ(b.wait(down).state, CopyState::Completed);
  EXPECT_TRUE(bytes_equal(b.host_bytes(out), data, "download from a released allocation"));
  b.poll();
  EXPECT_EQ(backend_live_allocations(), 0u) << "the last copy ended: the released allocation must be freed";
  EXPECT_EQ(b.stats().live_allocations, 0u);
  b.release_host(in);
  b.release_host(out);
}

TEST_P(BackendConformance, ViewsWaitForUploadsAndHoldTheirAllocation) {
  auto& b = make_bridge();
  constexpr std::uint64_t kCount = 256 << 10;
  constexpr std::uint64_t kBytes = kCount * sizeof(float);
  const auto h = b.alloc_device(ObjectSpec{kBytes, 64, DType::Float32, ShapeKind::Matrix}, kBytes);
  const Bytes data = random_.bytes(kBytes);
  const auto in = reserve_with(data);
  const ViewSpec spec = view_spec(DType::Float32, Dims{512, 512});

  if (can_hold()) {
    hold(true);
    const auto up = b.host_to_device(in, DeviceRange{h, 0, kBytes}, CopyMode::Async);
    EXPECT_KIND(ErrorKind::AllocationStillInUse, b.view(h, spec, ViewWait::Refuse));
    hold(false);
    EXPECT_EQ(b.wait(up).state, CopyState::Completed);
  }
  // Racing: the view waits for the upload it was asked after.
  const auto up = b.host_to_device(in, DeviceRange{h, 0, kBytes}, CopyMode::Async);
  auto lease = b.view(h, spec, ViewWait::Wait);
  EXPECT_TRUE(b.safe_to_release_host(up)) << "a waiting view returns only after the uploads into it";
  if (driver().host_addressable) {
    const std::span<const std::byte> seen(reinterpret_cast<const std::byte*>(lease->data + lease->byte_offset), kBytes);
    EXPECT_TRUE(bytes_equal(seen, data, "bytes seen through the view"));
  }

  // A live view is a use: no free; a release waits for the view's end.
  EXPECT_KIND(ErrorKind::AllocationStillInUse, b.free_device(h));
  EXPECT_EQ(b.stats().live_views, 1u);
  b.release(h);
  EXPECT_EQ(backend_live_allocations(), 1u) << "released under a live view: memory must stay";
  lease.reset();
  EXPECT_EQ(backend_live_allocations(), 0u) << "the view ended: the released allocation must be freed";
  EXPECT_EQ(b.stats().live_views, 0u);
  b.release_host(in);
}

// Several threads allocate, copy, view, free and release at once; every byte
// still arrives and nothing leaks.
TEST_P(BackendConformance, ConcurrentCopiesFreesAndViewsStayConsistent) {
  auto& b = make_bridge(16ull << 20);
  constexpr int kThreads = 4;
  constexpr int kIterations = 150;
  std::atomic<int> failures{0};

  auto worker = [&](int thread_index) {
    Random random(seed_for_current_test() + static_cast<std::uint64_t>(thread_index));
    for (int i = 0; i < kIterations && failures.load() == 0; ++i) {
      const std::uint64_t count = 1 + random.below(8 << 10);
      const std::uint64_t bytes = count * sizeof(float);
      const auto h = b.alloc_device(ObjectSpec{bytes, 4, DType::Float32, ShapeKind::Vector}, bytes);
      // One reservation holds both the source and the destination, so a
      // thread never holds ring space while waiting for more.
      HostRange range;
      for (;;) {
        try {
          range = b.reserve(2 * bytes);
          break;
        } catch (const Error& e) {
          if (e.kind() != ErrorKind::Backpressure) throw;
          std::this_thread::yield();
        }
      }
      const HostRange in{range.offset, bytes};
      const HostRange out{range.offset + bytes, bytes};
      const Bytes data = random.bytes(bytes);
      std::memcpy(b.host_bytes(in).data(), data.data(), bytes);
      std::memset(b.host_bytes(out).data(), static_cast<int>(kHostPoison), bytes);

      const auto up = b.host_to_device(in, DeviceRange{h, 0, bytes}, CopyMode::Async);
      std::optional<CopyEvent> down;
      switch (random.below(3)) {
        case 0: {  // view racing with the upload, then release under the view
          auto lease = b.view(h, view_spec(DType::Float32, Dims{static_cast<std::int64_t>(count)}), ViewWait::Wait);
          if (driver().host_addressable &&
              std::memcmp(reinterpret_cast<const void*>(lease->data), data.data(), bytes) != 0) {
            ADD_FAILURE() << "thread " << thread_index << " iteration " << i << ": view bytes differ";
            ++failures;
          }
          if (!throws_kind(ErrorKind::AllocationStillInUse, [&] { b.free_device(h); })) ++failures;
          down = b.device_to_host(DeviceRange{h, 0, bytes}, out, CopyMode::Async);
          b.release(h);
          break;
        }
        case 1:  // release while both copies are (likely) in flight
          down = b.device_to_host(DeviceRange{h, 0, bytes}, out, CopyMode::Async);
          b.release(h);
          break;
        default:  // plain free once the copies are done
          down = b.device_to_host(DeviceRange{h, 0, bytes}, out, CopyMode::Async);
          if (b.wait(*down).state != CopyState::Completed) ++failures;
          b.free_device(h);
          break;
      }
      if (b.wait(*down).state != CopyState::Completed || b.wait(up).state != CopyState::Completed) ++failures;
      if (std::memcmp(b.host_bytes(out).data(), data.data(), bytes) != 0) {
        ADD_FAILURE() << "thread " << thread_index << " iteration " << i << ": downloaded bytes differ";
        ++failures;
      }
      b.release_host(range);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();

  EXPECT_EQ(failures.load(), 0);
  b.poll();
  const auto stats = b.stats();
  EXPECT_EQ(stats.live_allocations, 0u);
  EXPECT_EQ(stats.copy_records, 0u);
  EXPECT_EQ(stats.live_views, 0u);
  EXPECT_EQ(stats.ring_reservations, 0u);
  EXPECT_EQ(stats.copies_failed, 0u);
  EXPECT_EQ(backend_live_allocations(), 0u);
}

// ---- restart -------------------------------------------------------------

TEST_P(BackendConformance, RestartWithCopiesInFlightRefusesTheOldAndLeaksNothing) {
  auto& b = make_bridge(64ull << 20);
  constexpr std::uint64_t kLen = 4 << 20;
  constexpr int kUploads = 6;
  std::vector<DeviceHandle> handles;
  std::vector<HostRange> ranges;
  std::vector<CopyEvent> events;
  const Bytes data = random_.bytes(kLen);

  if (can_hold()) hold(true);
  for (int i = 0; i < kUploads; ++i) {
    handles.push_back(b.alloc_device(bytes_spec(kLen), kLen));
    ranges.push_back(reserve_with(data));
    events.push_back(b.host_to_device(ranges.back(), DeviceRange{handles.back(), 0, kLen}, CopyMode::Async));
  }
  for (int i = 0; i < 2; ++i) {
    ranges.push_back(reserve_poisoned(kLen));
    events.push_back(b.device_to_host(DeviceRange{handles[i], 0, kLen}, ranges.back(), CopyMode::Async));
  }
  const auto viewed = b.alloc_device(bytes_spec(kLen), kLen);
  auto lease = b.view(viewed, view_spec(DType::UInt8, Dims{static_cast<std::int64_t>(kLen)}));
  const DeviceHandle step_handles[] = {handles[0], viewed};
  b.begin_step(7, step_handles);
  if (can_hold()) {
    EXPECT_EQ(b.stats().copies_in_flight, events.size());
  }

  const auto generation = b.generation();
  b.restart(generation + 1);
  if (can_hold()) hold(false);  // the fake's auto-complete back on; the host's hold ended with quiesce

  EXPECT_EQ(b.generation(), generation + 1);
  // Everything is freed but the viewed allocation, whose view may still be read.
  EXPECT_EQ(backend_live_allocations(), 1u) << "restart must free every allocation of the old generation";
  auto stats = b.stats();
  EXPECT_EQ(stats.live_allocations, 0u);
  EXPECT_EQ(stats.orphaned_allocations, 1u);
  EXPECT_EQ(stats.copy_records, 0u);
  EXPECT_EQ(stats.copies_in_flight, 0u);
  EXPECT_EQ(stats.inflight_bytes, 0u);
  EXPECT_EQ(stats.active_steps, 0u);

  for (const auto& h : handles) EXPECT_KIND(ErrorKind::OldGenerationHandle, b.free_device(h));
  EXPECT_KIND(ErrorKind::OldGenerationHandle, b.view(viewed, view_spec(DType::UInt8, Dims{1})));
  for (const auto& e : events) {
    EXPECT_KIND(ErrorKind::OldGenerationHandle, b.copy_status(e));
    EXPECT_KIND(ErrorKind::OldGenerationHandle, b.wait(e));
  }
  EXPECT_ANY_THROW(b.end_step(7));
  lease.reset();  // a lease from before the restart ends, and frees what it held
  EXPECT_EQ(backend_live_allocations(), 0u);
  EXPECT_EQ(b.stats().orphaned_allocations, 0u);
  // Late completions of the old work, if any arrive, are counted, never applied.
  b.poll();
  EXPECT_EQ(b.stats().copies_in_flight, 0u);

  // The ring ranges are the caller's again, and the new generation works.
  for (const auto& r : ranges) b.release_host(r);
  const auto h = b.alloc_device(bytes_spec(kLen), kLen);
  const Bytes fresh = random_.bytes(kLen);
  write_device(h, 0, fresh, CopyMode::Async);
  EXPECT_TRUE(bytes_equal(read_device(h, 0, kLen), fresh, "device after restart"));
  b.free_device(h);
  EXPECT_EQ(backend_live_allocations(), 0u);
}

TEST_P(BackendConformance, RepeatedRestartsUnderLoadLeakNothing) {
  auto& b = make_bridge(16ull << 20);
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::vector<HostRange> ranges;
    for (int i = 0; i < 4; ++i) {
      const std::uint64_t len = (1 + random_.below(1024)) * 1024;
      const auto h = b.alloc_device(bytes_spec(len, 1024), len);
      ranges.push_back(b.reserve(len));
      random_.fill(b.host_bytes(ranges.back()));
      b.host_to_device(ranges.back(), DeviceRange{h, 0, len}, CopyMode::Async);
      if (random_.coin()) b.device_to_host(DeviceRange{h, 0, len}, ranges.back(), CopyMode::Async);
      if (random_.coin()) b.release(h);
    }
    b.restart(b.generation() + 1);
    EXPECT_EQ(backend_live_allocations(), 0u);
    EXPECT_EQ(b.stats().copy_records, 0u);
    for (const auto& r : ranges) b.release_host(r);
  }
  EXPECT_EQ(b.stats().restarts, 20u);
}

// ---- dtypes and sizes ----------------------------------------------------

TEST_P(BackendConformance, EveryAdvertisedDTypeRoundTripsAndViews) {
  auto& b = make_bridge();
  const auto info = b.backend_info();
  ASSERT_FALSE(info.dtypes.empty());
  constexpr std::int64_t kCount = 257;  // odd: no dtype's vector width divides it
  for (const DType dtype : info.dtypes) {
    const auto& dinfo = dtype_info(dtype);
    SCOPED_TRACE(std::string(dinfo.name));
    const std::uint64_t bytes = kCount * dinfo.size;
    const auto h = b.alloc_device(ObjectSpec{bytes, dinfo.size, dtype, ShapeKind::Vector}, bytes);
    Bytes data = random_.bytes(bytes);
    if (dtype == DType::Bool) {
      for (auto& v : data) v = static_cast<std::byte>(std::to_integer<unsigned>(v) & 1u);
    }
    write_device(h, 0, data, CopyMode::Async);
    EXPECT_TRUE(bytes_equal(read_device(h, 0, bytes), data, "round trip"));

    auto lease = b.view(h, view_spec(dtype, Dims{kCount}));
    EXPECT_EQ(lease->dtype, dtype);
    EXPECT_EQ(lease->shape, (Dims{kCount}));
    EXPECT_EQ(lease->strides, (Dims{1}));
    EXPECT_EQ(lease->device, tinygrad_device(info.device_kind, info.device_ordinal));
    if (driver().host_addressable) {
      const std::span<const std::byte> seen(reinterpret_cast<const std::byte*>(lease->data), bytes);
      EXPECT_TRUE(bytes_equal(seen, data, "bytes seen through the view"));
    }
    const DType other = dtype == DType::UInt8 ? DType::Int8 : DType::UInt8;
    EXPECT_KIND(ErrorKind::InvalidViewDType, b.view(h, view_spec(other, Dims{1})));
    lease.reset();
    b.free_device(h);
  }
  EXPECT_EQ(backend_live_allocations(), 0u);
}

// Storage is not compute (CONTRACT.md, Version 3): every backend holds every
// dtype, and an untyped allocation takes a view of each bit-exact; what the
// device computes in is a subset of what it holds.
TEST_P(BackendConformance, EveryBackendHoldsEveryDTypeAndComputesInASubset) {
  auto& b = make_bridge();
  const auto info = b.backend_info();
  for (const auto& d : all_dtypes()) {
    SCOPED_TRACE(std::string(d.name));
    EXPECT_EQ(std::ranges::count(info.dtypes, d.dtype), 1);
  }
  for (const DType dtype : info.computed_dtypes()) EXPECT_EQ(std::ranges::count(info.dtypes, dtype), 1);
  // One untyped allocation, viewed as every dtype after a bit-exact round trip.
  constexpr std::uint64_t kBytes = 4096;
  const auto h = b.alloc_device(ObjectSpec{kBytes, 64, std::nullopt, ShapeKind::Tensor}, kBytes);
  const Bytes data = random_.bytes(kBytes);
  write_device(h, 0, data, CopyMode::Async);
  EXPECT_TRUE(bytes_equal(read_device(h, 0, kBytes), data, "untyped round trip"));
  for (const auto& d : all_dtypes()) {
    SCOPED_TRACE(std::string(d.name));
    auto lease = b.view(h, view_spec(d.dtype, Dims{static_cast<std::int64_t>(kBytes / d.size)}));
    EXPECT_EQ(lease->dtype, d.dtype);
  }
  b.free_device(h);
}

// A device that holds float32 but does not compute in it: axpy is refused
// with UnsupportedDType naming the compute list, and nothing else changes.
class ComputesNoFloat32 final : public testing::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  BackendInfo describe() override {
    BackendInfo info = ForwardingBackend::describe();
    info.compute_dtypes.clear();
    for (const auto& d : all_dtypes())
      if (d.dtype != DType::Float32) info.compute_dtypes.push_back(d.dtype);
    return info;
  }
};

TEST_P(BackendConformance, ComputeIsRefusedInADTypeTheDeviceOnlyHolds) {
  Bridge b(std::make_unique<ComputesNoFloat32>(std::shared_ptr<Backend>(driver().make())),
           BridgeOptions{.ring_bytes = 1 << 20});
  constexpr std::uint64_t kBytes = 1024;
  const ObjectSpec spec{kBytes, 64, DType::Float32, ShapeKind::Vector};
  const auto x = b.alloc_device(spec, kBytes);  // held: allocates, copies and views
  const auto y = b.alloc_device(spec, kBytes);
  const auto range = b.reserve(kBytes);
  b.host_to_device(range, DeviceRange{x, 0, kBytes}, CopyMode::Sync);
  { auto lease = b.view(x, view_spec(DType::Float32, Dims{256})); }
  try {
    b.launch_axpy(DeviceRange{x, 0, kBytes}, DeviceRange{y, 0, kBytes}, 2.0f, 1.0f);
    ADD_FAILURE() << "axpy in float32 ran on a device that does not compute in it";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::UnsupportedDType);
    EXPECT_NE(std::string_view(e.what()).find("holds float32 but does not compute in it"), std::string_view::npos)
        << e.what();
  }
  b.release_host(range);
  b.free_device(x);
  b.free_device(y);
}

TEST_P(BackendConformance, QuarterGigabyteCopiesArriveExactly) {
  constexpr std::uint64_t kLen = 256ull << 20;
  auto& b = make_bridge(kLen);
  const auto h = b.alloc_device(bytes_spec(kLen, 4096), kLen);
  const auto range = b.reserve(kLen);
  const auto host = b.host_bytes(range);
  random_.fill(host);
  const Bytes expected(host.begin(), host.end());

  const auto up = b.host_to_device(range, DeviceRange{h, 0, kLen}, CopyMode::Async);
  ASSERT_EQ(b.wait(up).state, CopyState::Completed);
  std::memset(host.data(), static_cast<int>(kHostPoison), kLen);
  const auto down = b.device_to_host(DeviceRange{h, 0, kLen}, range, CopyMode::Async);
  ASSERT_EQ(b.wait(down).state, CopyState::Completed);
  EXPECT_TRUE(bytes_equal(host, expected, "256 MiB async round trip"));

  // And synchronously, shifted by one byte so nothing is page-aligned.
  std::memset(host.data(), static_cast<int>(kHostPoison), kLen);
  b.device_to_host(DeviceRange{h, 1, kLen - 1}, HostRange{range.offset, kLen - 1}, CopyMode::Sync);
  EXPECT_TRUE(bytes_equal(host.first(kLen - 1), std::span(expected).subspan(1), "256 MiB sync download, shifted"));
  EXPECT_EQ(host[kLen - 1], kHostPoison);
  b.release_host(range);
  b.free_device(h);
}

TEST_P(BackendConformance, SingleElementCopiesTouchOnlyThatElement) {
  auto& b = make_bridge();
  // A one-byte allocation.
  const auto tiny = b.alloc_device(bytes_spec(1, 1), 1);
  const Bytes one = random_.bytes_not(1, kHostPoison);
  for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
    write_device(tiny, 0, Bytes{kDevicePoison});
    write_device(tiny, 0, one, mode);
    EXPECT_TRUE(bytes_equal(read_device(tiny, 0, 1), one, "one-byte allocation"));
  }
  b.free_device(tiny);

  // One float64 in the middle of eight.
  constexpr std::uint64_t kElem = 8;
  const auto h = b.alloc_device(ObjectSpec{8 * kElem, kElem, DType::Float64, ShapeKind::Vector}, 8 * kElem);
  write_device(h, 0, Bytes(8 * kElem, kDevicePoison));
  const Bytes element = random_.bytes_not(kElem, kDevicePoison);
  write_device(h, 3 * kElem, element, CopyMode::Async);
  const Bytes device = read_device(h, 0, 8 * kElem);
  EXPECT_TRUE(all_bytes_are(slice(device, 0, 3 * kElem), kDevicePoison, "elements before"));
  EXPECT_TRUE(bytes_equal(slice(device, 3 * kElem, kElem), element, "the element"));
  EXPECT_TRUE(all_bytes_are(slice(device, 4 * kElem, 4 * kElem), kDevicePoison, "elements after"));
  EXPECT_TRUE(bytes_equal(read_device(h, 3 * kElem, kElem), element, "one-element download"));
  b.free_device(h);
}

// ---- the ring ------------------------------------------------------------

// A small ring cycled many times over, with several chunks in flight,
// released out of order, and the ring full now and then: every chunk's bytes
// round-trip, reservations wrap, and the ring ends empty.
TEST_P(BackendConformance, RingWrapsAroundManyTimesWithCopiesInFlight) {
  constexpr std::uint64_t kRing = 64 << 10;
  constexpr std::uint64_t kMaxChunk = 12 << 10;
  constexpr std::size_t kDepth = 4;
  auto& b = make_bridge(kRing);
  const auto h = b.alloc_device(bytes_spec(kDepth * kMaxChunk, 1), kDepth * kMaxChunk);

  struct Chunk {
    HostRange in, out;
    Bytes data;
    CopyEvent up, down;
    std::uint64_t slot = 0;
  };
  std::vector<std::uint64_t> free_slots;
  for (std::uint64_t i = 0; i < kDepth; ++i) free_slots.push_back(i);
  std::deque<Chunk> chunks;
  std::uint64_t bytes_cycled = 0;
  int wraps = 0;
  std::uint64_t last_offset = 0;

  auto finish = [&](std::size_t index) {
    Chunk chunk = std::move(chunks[index]);
    chunks.erase(chunks.begin() + static_cast<std::ptrdiff_t>(index));
    EXPECT_EQ(b.wait(chunk.down).state, CopyState::Completed);
    EXPECT_TRUE(b.safe_to_release_host(chunk.up));
    EXPECT_TRUE(bytes_equal(b.host_bytes(chunk.out), chunk.data, "chunk after its round trip"));
    free_slots.push_back(chunk.slot);
    // Out of order on purpose: sometimes the output range first.
    if (random_.coin()) {
      b.release_host(chunk.out);
      b.release_host(chunk.in);
    } else {
      b.release_host(chunk.in);
      b.release_host(chunk.out);
    }
  };
  auto reserve = [&](std::uint64_t len) {
    for (;;) {
      try {
        const auto r = b.reserve(len, std::uint64_t{1} << random_.below(7));
        if (r.offset < last_offset) ++wraps;
        last_offset = r.offset;
        return r;
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::Backpressure || chunks.empty()) throw;
        finish(0);  // full: retire the oldest chunk and try again
      }
    }
  };

  for (int i = 0; i < 400; ++i) {
    if (chunks.size() == kDepth) finish(random_.below(chunks.size()));
    const std::uint64_t len = 1 + random_.below(kMaxChunk);
    Chunk chunk;
    chunk.data = random_.bytes_not(len, kHostPoison);
    chunk.in = reserve(len);
    std::memcpy(b.host_bytes(chunk.in).data(), chunk.data.data(), len);
    chunk.out = reserve(len);
    std::memset(b.host_bytes(chunk.out).data(), static_cast<int>(kHostPoison), len);
    // Each chunk in flight owns a distinct slot of the device allocation.
    chunk.slot = free_slots.back();
    free_slots.pop_back();
    const std::uint64_t at = chunk.slot * kMaxChunk;
    chunk.up = b.host_to_device(chunk.in, DeviceRange{h, at, len}, CopyMode::Async);
    chunk.down = b.device_to_host(DeviceRange{h, at, len}, chunk.out, CopyMode::Async);
    bytes_cycled += 2 * len;
    chunks.push_back(std::move(chunk));
  }
  while (!chunks.empty()) finish(0);

  EXPECT_GT(bytes_cycled, 50 * kRing);
  EXPECT_GE(wraps, 20) << "the ring should have wrapped many times";
  const auto stats = b.stats();
  EXPECT_EQ(stats.ring_used, 0u);
  EXPECT_EQ(stats.ring_reservations, 0u);
  EXPECT_EQ(stats.copy_records, 0u);
  EXPECT_EQ(b.ring_free_bytes(), kRing);
}

std::string driver_name(const ::testing::TestParamInfo<BackendDriver>& info) { return std::string(info.param.name); }

// ---- capabilities ----------------------------------------------------------

// What describe() says the backend can do beyond the hooks every backend has
// is what it does (adoption is checked where it is used: registered_host_test).
TEST_P(BackendConformance, CapabilitiesSayWhatTheBackendDoes) {
  auto& b = make_bridge(1 << 20);
  const BackendInfo info = b.backend_info();
  EXPECT_EQ(info.consumer_queues, static_cast<bool>(driver().consumer_queue))
      << "the conformance row has a consumer queue exactly where describe() says consumer_queues";
  if (!info.consumer_queues)
    EXPECT_KIND(ErrorKind::Unsupported, b.backend().record_fence(QueueRef{Queue::Consumer, 1}));
  EXPECT_EQ(info.part_alignment & (info.part_alignment - 1), 0u) << "part_alignment is 0 or a power of two";
  EXPECT_NE(info.pool_cap_bytes, 0u) << "a default pool that keeps nothing is caching_pool off";

  // A peer copy to a second bridge of the same backend moves the bytes
  // exactly where describe() says peer_copy; elsewhere it says no.
  Bridge other(driver().make(), BridgeOptions{.generation = 1, .ring_bytes = 1 << 20});
  const ObjectSpec spec{4096, 256, DType::UInt8, ShapeKind::Vector};
  const DeviceHandle x = b.alloc_device(spec, 4096);
  const DeviceHandle y = other.alloc_device(spec, 4096);
  EXPECT_EQ(b.copy_to_peer(DeviceRange{x, 0, 4096}, other, DeviceRange{y, 0, 4096}), info.peer_copy);
  other.free_device(y);
  b.free_device(x);
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendConformance, ::testing::ValuesIn(backend_drivers()), driver_name);

}  // namespace
}  // namespace devbridge::conformance
