// Boundary tables: every size, offset, alignment, shape, stride and timeout a
// caller gives the Bridge, at 0, 1, max-1, max, 2^63 and 2^64-1 (where the
// value means something), each with the exact outcome expected, against
// every backend (the same rows as the conformance suite).
//
// After every refusal the bridge must be as it was (CONTRACT.md: "a call that
// fails changes nothing"): the backend holds the same number of device
// allocations, and an allocate + upload + download round trip still moves
// exactly its bytes. A refused Bridge construction must leave the backend
// holding nothing.
//
// The bridge borrows the fixture's backend (BorrowedBackend), so a backend
// outlives a bridge whose constructor failed and its counts can be read then.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "forwarding_backend.hpp"
#include "backend_drivers.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/backends/host.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::conformance {
namespace {

using namespace std::chrono_literals;

constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();  // 2^64-1
constexpr std::uint64_t k2p63 = 1ull << 63;
constexpr std::int64_t kI64Max = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t kI64Min = std::numeric_limits<std::int64_t>::min();

// The outcome a row expects: an error kind, or success (nullopt).
using Outcome = std::optional<ErrorKind>;
constexpr Outcome kOk = std::nullopt;

std::string outcome_text(Outcome outcome) { return outcome ? std::string(kind_name(*outcome)) : "success"; }

// Runs `statement` and compares what happened with `expected`. A crash is a
// failure of the whole binary, which is what the old code did for some rows.
::testing::AssertionResult outcome_is(Outcome expected, const std::function<void()>& statement,
                                      std::string* message = nullptr) {
  try {
    statement();
  } catch (const Error& e) {
    if (message) *message = e.what();
    if (expected && e.kind() == *expected) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "expected " << outcome_text(expected) << ", got " << kind_name(e.kind())
                                         << ": " << e.what();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "expected " << outcome_text(expected) << ", got std::exception "
                                         << e.what();
  }
  if (!expected) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected " << outcome_text(expected) << ", the call succeeded";
}

// Lends a backend to a bridge without giving it away.
using BorrowedBackend = testing::ForwardingBackend;

ObjectSpec spec_of(std::uint64_t max_extent, std::uint64_t alignment, DType dtype = DType::UInt8,
                   ShapeKind shape = ShapeKind::Tensor) {
  return ObjectSpec{max_extent, alignment, dtype, shape};
}

class BoundaryTest : public ::testing::TestWithParam<BackendDriver> {
 protected:
  static constexpr std::uint64_t kRing = 1 << 20;

  void SetUp() override {
    if (driver().unavailable_reason) {
      if (const auto why = driver().unavailable_reason(); !why.empty())
        GTEST_SKIP() << "backend " << driver().name << " is unavailable here: " << why;
    }
    backend_ = driver().make();
  }

  void TearDown() override {
    if (held_) hold(false);
    bridge_.reset();
    if (backend_) {
      EXPECT_EQ(live_allocations(), 0u) << "device allocations left after the bridge closed";
      if (const auto blocks = live_host_blocks()) { EXPECT_EQ(*blocks, 0u) << "host blocks left after the bridge closed"; }
    }
  }

  const BackendDriver& driver() const { return GetParam(); }

  std::unique_ptr<Bridge> new_bridge(BridgeOptions options) {
    return std::make_unique<Bridge>(std::make_unique<BorrowedBackend>(*backend_), options);
  }
  Bridge& make_bridge(std::uint64_t ring_bytes = kRing, std::uint64_t inflight_budget = 0) {
    bridge_.reset();
    bridge_ = new_bridge(BridgeOptions{.generation = 1, .ring_bytes = ring_bytes,
                                       .inflight_budget_bytes = inflight_budget});
    return *bridge_;
  }
  Bridge& bridge() { return *bridge_; }

  bool can_hold() const {
    const TestControls* controls = backend_->test_controls();
    return controls != nullptr && controls->can_hold_copies();
  }
  void hold(bool on) {
    ASSERT_TRUE(can_hold()) << driver().name << " cannot hold copies";
    backend_->test_controls()->hold_copies(on);
    held_ = on;
  }

  // Device allocations the backend itself holds.
  std::uint64_t live_allocations() const {
    if (const TestControls* controls = backend_->test_controls()) return controls->live_allocations();
    return bridge_ ? bridge_->stats().live_allocations : 0;
  }
  // Host blocks the backend holds, where it can count them.
  std::optional<std::uint64_t> live_host_blocks() const {
    const TestControls* controls = backend_->test_controls();
    return controls != nullptr ? controls->live_host_blocks() : std::nullopt;
  }

  // The bridge works after whatever was refused: a fresh allocation takes a
  // sync upload, an async upload over part of it, and both downloads return
  // exactly those bytes; freed again, the backend holds what it held before.
  void expect_usable(std::uint64_t allocations_before) {
    auto& b = bridge();
    const auto before = b.stats();
    constexpr std::uint64_t kBytes = 4096;
    std::vector<std::byte> data(kBytes);
    for (auto& byte : data) byte = static_cast<std::byte>(random_());
    DeviceHandle h;
    ASSERT_TRUE(outcome_is(kOk, [&] { h = b.alloc_device(spec_of(kBytes, 64), kBytes); }));
    EXPECT_EQ(live_allocations(), allocations_before + 1);

    const auto up = b.reserve(kBytes);
    std::memcpy(b.host_bytes(up).data(), data.data(), kBytes);
    b.host_to_device(up, DeviceRange{h, 0, kBytes}, CopyMode::Sync);
    std::memset(b.host_bytes(up).data() + 100, 0x33, 200);
    std::memset(data.data() + 100, 0x33, 200);
    const auto e = b.host_to_device(HostRange{up.offset + 100, 200}, DeviceRange{h, 100, 200}, CopyMode::Async);
    EXPECT_EQ(b.wait(e).state, CopyState::Completed);
    b.release_host(up);

    for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
      const auto down = b.reserve(kBytes);
      std::memset(b.host_bytes(down).data(), 0, kBytes);
      const auto d = b.device_to_host(DeviceRange{h, 0, kBytes}, down, mode);
      if (mode == CopyMode::Async) { EXPECT_EQ(b.wait(d).state, CopyState::Completed); }
      EXPECT_EQ(std::memcmp(b.host_bytes(down).data(), data.data(), kBytes), 0)
          << (mode == CopyMode::Sync ? "sync" : "async") << " download after a refusal differs from the upload";
      b.release_host(down);
    }
    b.free_device(h);
    EXPECT_EQ(live_allocations(), allocations_before) << "a device allocation leaked";
    const auto after = b.stats();
    EXPECT_EQ(after.ring_reservations, before.ring_reservations);
    EXPECT_EQ(after.copies_in_flight, 0u);
    EXPECT_EQ(after.live_views, before.live_views);
    EXPECT_FALSE(after.broken);
  }

  std::unique_ptr<Backend> backend_;  // declared first: outlives bridge_
  std::unique_ptr<Bridge> bridge_;
  bool held_ = false;
  std::mt19937_64 random_{0xB0DA};
};

// ---- ring_bytes -------------------------------------------------------------

// Defects 1 and 2 (issue 10): a ring within 4095 bytes of 2^64 crashed the fake
// (the aligned size wrapped) and was accepted by OpenCL (bytes + page wrapped)
// until a write overran it. Every too-large ring is AllocationFailed naming
// the size asked, and leaves the backend holding nothing.
TEST_P(BoundaryTest, RingBytes) {
  struct Row {
    std::uint64_t ring_bytes;
    Outcome expected;
  };
  const Row rows[] = {
      {0, ErrorKind::InvalidExtent},
      {1, kOk},
      {4096, kOk},
      {k2p63, ErrorKind::AllocationFailed},
      {kMax - 8192, ErrorKind::AllocationFailed},
      {kMax - 4096, ErrorKind::AllocationFailed},
      {kMax - 4095, ErrorKind::AllocationFailed},
      {kMax - 64, ErrorKind::AllocationFailed},
      {kMax - 1, ErrorKind::AllocationFailed},
      {kMax, ErrorKind::AllocationFailed},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE("ring_bytes " + std::to_string(row.ring_bytes));
    std::unique_ptr<Bridge> b;
    std::string message;
    EXPECT_TRUE(outcome_is(
        row.expected, [&] { b = new_bridge(BridgeOptions{.generation = 1, .ring_bytes = row.ring_bytes}); },
        &message));
    if (row.expected == ErrorKind::AllocationFailed) {
      EXPECT_NE(message.find(std::to_string(row.ring_bytes)), std::string::npos)
          << "the refusal should name the size asked: " << message;
    }
    if (b) {
      // The whole ring is usable: reserve it all, write its last byte, move it
      // through the device and back.
      EXPECT_EQ(b->ring_capacity(), row.ring_bytes);
      const auto h = b->alloc_device(spec_of(1, 1), 1);
      const auto r = b->reserve(row.ring_bytes, 1);
      EXPECT_EQ(r.len, row.ring_bytes);
      const HostRange last{r.offset + r.len - 1, 1};
      b->host_bytes(last)[0] = std::byte{0x7E};
      b->host_to_device(last, DeviceRange{h, 0, 1}, CopyMode::Sync);
      b->host_bytes(last)[0] = std::byte{0};
      b->device_to_host(DeviceRange{h, 0, 1}, last, CopyMode::Sync);
      EXPECT_EQ(b->host_bytes(last)[0], std::byte{0x7E});
      b->release_host(r);
      b->free_device(h);
      b.reset();
    }
    EXPECT_EQ(live_allocations(), 0u);
    if (const auto blocks = live_host_blocks()) { EXPECT_EQ(*blocks, 0u) << "a refused ring leaked its host block"; }
  }
  // The backend still serves a bridge after every refusal.
  make_bridge();
  expect_usable(0);
}

// ---- alloc_device: spec.max_extent, spec.alignment, extent -------------------

TEST_P(BoundaryTest, AllocDeviceExtentAndAlignment) {
  struct Row {
    std::uint64_t max_extent;
    std::uint64_t alignment;
    DType dtype;
    std::uint64_t extent;
    Outcome expected;
  };
  const Row rows[] = {
      // alignment
      {kMax, 0, DType::UInt8, 64, ErrorKind::InvalidAlignment},
      {kMax, 1, DType::UInt8, 1, kOk},
      {kMax, 3, DType::UInt8, 3, ErrorKind::InvalidAlignment},
      {kMax, 4096, DType::UInt8, 4096, kOk},
      {kMax, k2p63, DType::UInt8, 4096, ErrorKind::InvalidExtent},  // not a multiple of it
      {kMax, k2p63, DType::UInt8, k2p63, ErrorKind::AllocationFailed},
      {kMax, k2p63 + 1, DType::UInt8, k2p63, ErrorKind::InvalidAlignment},
      {kMax, kMax - 1, DType::UInt8, kMax - 1, ErrorKind::InvalidAlignment},
      {kMax, kMax, DType::UInt8, kMax, ErrorKind::InvalidAlignment},
      // extent
      {kMax, 1, DType::UInt8, 0, ErrorKind::InvalidExtent},
      {kMax, 64, DType::UInt8, 64, kOk},
      {kMax, 1, DType::UInt8, k2p63, ErrorKind::AllocationFailed},
      {kMax, 1, DType::UInt8, kMax - 1, ErrorKind::AllocationFailed},
      {kMax, 1, DType::UInt8, kMax, ErrorKind::AllocationFailed},
      {kMax, 64, DType::UInt8, kMax - 63, ErrorKind::AllocationFailed},  // 2^64-64: the largest 64-multiple
      {kMax, 4096, DType::UInt8, kMax - 4095, ErrorKind::AllocationFailed},
      {kMax, 64, DType::UInt8, kMax - 64, ErrorKind::InvalidExtent},  // not a multiple of 64
      // max_extent
      {0, 1, DType::UInt8, 1, ErrorKind::InvalidExtent},
      {1, 1, DType::UInt8, 1, kOk},
      {4096, 64, DType::UInt8, 4096, kOk},
      {4096, 64, DType::UInt8, 4096 + 64, ErrorKind::InvalidExtent},
      {kMax - 1, 1, DType::UInt8, kMax, ErrorKind::InvalidExtent},
      {k2p63, 1, DType::UInt8, k2p63 + 1, ErrorKind::InvalidExtent},
      // the dtype's size
      {kMax, 4, DType::Float32, 2, ErrorKind::InvalidExtent},
      {kMax, 4, DType::Float32, 4, kOk},
      {kMax, 4, DType::Float32, kMax - 3, ErrorKind::AllocationFailed},
      {kMax, 8, DType::Float64, kMax - 7, ErrorKind::AllocationFailed},
      {kMax, 1, DType::Float64, 12, ErrorKind::InvalidExtent},
  };
  auto& b = make_bridge();
  for (const Row& row : rows) {
    SCOPED_TRACE("max_extent " + std::to_string(row.max_extent) + ", alignment " + std::to_string(row.alignment) +
                 ", " + std::string(dtype_info(row.dtype).name) + ", extent " + std::to_string(row.extent));
    const auto before = live_allocations();
    DeviceHandle h;
    EXPECT_TRUE(outcome_is(row.expected, [&] { h = b.alloc_device(spec_of(row.max_extent, row.alignment, row.dtype),
                                                                  row.extent); }));
    if (!row.expected) {
      EXPECT_EQ(b.extent(h), row.extent);
      EXPECT_EQ(live_allocations(), before + 1);
      b.free_device(h);
    }
    EXPECT_EQ(live_allocations(), before);
    expect_usable(before);
  }
}

// ---- reserve: bytes and alignment ----------------------------------------------

TEST_P(BoundaryTest, ReserveBytesAndAlignment) {
  struct Row {
    std::uint64_t bytes;
    std::uint64_t alignment;
    Outcome expected;
  };
  const Row rows[] = {
      {0, 64, ErrorKind::InvalidRange},
      {1, 64, kOk},
      {1, 1, kOk},
      {kRing - 1, 64, kOk},
      {kRing, 64, kOk},
      {kRing + 1, 64, ErrorKind::InvalidRange},
      {k2p63, 64, ErrorKind::InvalidRange},
      {kMax - 1, 64, ErrorKind::InvalidRange},
      {kMax, 64, ErrorKind::InvalidRange},
      {kMax, 1, ErrorKind::InvalidRange},
      {64, 0, ErrorKind::InvalidAlignment},
      {64, 3, ErrorKind::InvalidAlignment},
      {64, 4095, ErrorKind::InvalidAlignment},
      {64, 4096, kOk},
      {64, 8192, ErrorKind::InvalidAlignment},
      {64, k2p63, ErrorKind::InvalidAlignment},
      {64, kMax - 1, ErrorKind::InvalidAlignment},
      {64, kMax, ErrorKind::InvalidAlignment},
  };
  auto& b = make_bridge();
  for (const Row& row : rows) {
    SCOPED_TRACE("reserve " + std::to_string(row.bytes) + " bytes, alignment " + std::to_string(row.alignment));
    HostRange r;
    EXPECT_TRUE(outcome_is(row.expected, [&] { r = b.reserve(row.bytes, row.alignment); }));
    if (!row.expected) {
      EXPECT_EQ(r.len, row.bytes);
      EXPECT_EQ(r.offset % row.alignment, 0u);
      EXPECT_LE(r.offset + r.len, kRing);
      b.release_host(r);
    }
    EXPECT_EQ(b.stats().ring_reservations, 0u);
    EXPECT_EQ(b.ring_free_bytes(), kRing);
    expect_usable(0);
  }
}

// Near full: what fits is handed out, what does not is Backpressure, never a
// range past the end or over a live one.
TEST_P(BoundaryTest, ReserveAtTheEndOfTheRing) {
  auto& b = make_bridge();
  const auto most = b.reserve(kRing - 1, 1);
  EXPECT_EQ(most.offset, 0u);
  EXPECT_TRUE(outcome_is(ErrorKind::Backpressure, [&] { b.reserve(1, 4096); }));  // aligned: past the end
  EXPECT_TRUE(outcome_is(ErrorKind::Backpressure, [&] { b.reserve(2, 1); }));
  const auto last = b.reserve(1, 1);
  EXPECT_EQ(last.offset, kRing - 1);
  EXPECT_TRUE(outcome_is(ErrorKind::Backpressure, [&] { b.reserve(1, 1); }));
  b.release_host(most);
  // The head is at the end: the next reservation starts a lap, and may take
  // everything before the one live byte.
  const auto wrapped = b.reserve(kRing - 1, 4096);
  EXPECT_EQ(wrapped.offset, 0u);
  EXPECT_TRUE(outcome_is(ErrorKind::Backpressure, [&] { b.reserve(1, 1); }));
  b.release_host(last);
  b.release_host(wrapped);
  EXPECT_EQ(b.ring_free_bytes(), kRing);
  expect_usable(0);
}

// ---- copies: host and device offsets and lengths ----------------------------

TEST_P(BoundaryTest, CopyOffsetsAndLengths) {
  constexpr std::uint64_t kExtent = 4096;
  auto& b = make_bridge();
  const auto h = b.alloc_device(spec_of(kExtent, 64), kExtent);
  const auto r = b.reserve(kExtent, 64);
  ASSERT_EQ(r.offset, 0u) << "the rows below assume the reservation starts the ring";
  struct Row {
    const char* name;
    HostRange host;
    std::uint64_t device_offset;
    std::uint64_t device_len;
    Outcome expected;
  };
  const Row rows[] = {
      {"whole", {0, kExtent}, 0, kExtent, kOk},
      {"first byte", {0, 1}, 0, 1, kOk},
      {"last byte", {kExtent - 1, 1}, kExtent - 1, 1, kOk},
      {"empty", {0, 0}, 0, 0, ErrorKind::InvalidRange},
      {"device offset = extent", {0, 1}, kExtent, 1, ErrorKind::InvalidRange},
      {"device one past the end", {0, kExtent + 1}, 0, kExtent + 1, ErrorKind::InvalidRange},
      {"device offset 2^63", {0, 1}, k2p63, 1, ErrorKind::InvalidRange},
      {"device offset 2^64-1", {0, 1}, kMax, 1, ErrorKind::InvalidRange},
      {"device offset 2^64-2, len 2", {0, 2}, kMax - 1, 2, ErrorKind::InvalidRange},
      {"device len 2^64-1", {1, kMax}, 1, kMax, ErrorKind::InvalidRange},
      {"device 2^63 + 2^63 wraps to 0", {0, k2p63}, k2p63, k2p63, ErrorKind::InvalidRange},
      {"device 4095 + (2^64-4094) wraps to 1", {0, kMax - 4093}, kExtent - 1, kMax - 4093, ErrorKind::InvalidRange},
      {"host offset = capacity", {kRing, 1}, 0, 1, ErrorKind::InvalidRange},
      {"host outside the reservation", {kExtent, 1}, 0, 1, ErrorKind::InvalidRange},
      {"host offset 2^63", {k2p63, 1}, 0, 1, ErrorKind::InvalidRange},
      {"host offset 2^64-1", {kMax, 1}, 0, 1, ErrorKind::InvalidRange},
      {"host 2^64-1 + 2 wraps into the reservation", {kMax, 2}, 0, 2, ErrorKind::InvalidRange},
      {"host (2^64-4094) + 4096 wraps to 1", {kMax - 4093, kExtent}, 0, kExtent, ErrorKind::InvalidRange},
      {"host offset 2^63, len 64", {k2p63, 64}, 0, 64, ErrorKind::InvalidRange},
      {"lengths differ", {0, kExtent}, 0, kExtent - 1, ErrorKind::InvalidRange},
      {"lengths differ by 2^63", {0, 1}, 0, k2p63 + 1, ErrorKind::InvalidRange},
  };
  for (const Row& row : rows) {
    for (const CopyDirection direction : {CopyDirection::HostToDevice, CopyDirection::DeviceToHost}) {
      for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
        SCOPED_TRACE(std::string(row.name) + (direction == CopyDirection::HostToDevice ? ", h2d" : ", d2h") +
                     (mode == CopyMode::Sync ? ", sync" : ", async"));
        const DeviceRange device{h, row.device_offset, row.device_len};
        CopyEvent e;
        EXPECT_TRUE(outcome_is(row.expected, [&] {
          e = direction == CopyDirection::HostToDevice ? b.host_to_device(row.host, device, mode)
                                                       : b.device_to_host(device, row.host, mode);
        }));
        if (!row.expected && mode == CopyMode::Async) { EXPECT_EQ(b.wait(e).state, CopyState::Completed); }
        const auto stats = b.stats();
        EXPECT_EQ(stats.copies_in_flight, 0u);
        EXPECT_EQ(stats.inflight_bytes, 0u);
        EXPECT_EQ(stats.copy_records, 0u);
      }
    }
  }
  b.release_host(r);
  expect_usable(1);
  b.free_device(h);
}

// launch_axpy's ranges go through the same checks.
TEST_P(BoundaryTest, AxpyOffsetsAndLengths) {
#if defined(__SANITIZE_ADDRESS__)
  // After PoCL has compiled and run the axpy kernel, LeakSanitizer's
  // exit-time tracer crashes on its threads ("Tracer caught signal 11") in
  // every run, after the test passed. The release and TSan runs cover this row.
  if (driver().name == "opencl") GTEST_SKIP() << "LeakSanitizer's tracer crashes on PoCL's kernel threads";
#endif
  constexpr std::uint64_t kExtent = 4096;
  auto& b = make_bridge();
  const auto spec = spec_of(kExtent, 64, DType::Float32);
  const auto x = b.alloc_device(spec, kExtent);
  const auto y = b.alloc_device(spec, kExtent);
  struct Row {
    const char* name;
    std::uint64_t offset;
    std::uint64_t len;
    Outcome expected;
  };
  const Row rows[] = {
      {"whole", 0, kExtent, kOk},
      {"last element", kExtent - 4, 4, kOk},
      {"empty", 0, 0, ErrorKind::InvalidRange},
      {"offset = extent", kExtent, 4, ErrorKind::InvalidRange},
      {"misaligned", 2, 4, ErrorKind::InvalidRange},
      {"offset 2^63", k2p63, 4, ErrorKind::InvalidRange},
      {"offset 2^64-4", kMax - 3, 4, ErrorKind::InvalidRange},
      {"2^63 + 2^63 wraps to 0", k2p63, k2p63, ErrorKind::InvalidRange},
      {"len 2^64-4", 4, kMax - 3, ErrorKind::InvalidRange},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(row.name);
    EXPECT_TRUE(outcome_is(row.expected, [&] {
      b.launch_axpy(DeviceRange{x, row.offset, row.len}, DeviceRange{y, row.offset, row.len}, 2.0f, 1.0f);
    }));
    EXPECT_EQ(b.stats().active_steps, 0u);
  }
  expect_usable(2);
  // Released, not freed: on a device that runs launches asynchronously the
  // last one's use ends at its fence, which may not have passed yet (the
  // emulated CUDA driver under load: free_device was AllocationStillInUse).
  b.release(x);
  b.release(y);
}

// ---- views: byte_offset, shape, strides -------------------------------------------

TEST_P(BoundaryTest, ViewOffsetsShapesAndStrides) {
  constexpr std::uint64_t kExtent = 4096;
  constexpr std::int64_t kN = kExtent;
  auto& b = make_bridge();
  const DeviceHandle bytes = b.alloc_device(spec_of(kExtent, 64, DType::UInt8), kExtent);
  const DeviceHandle floats = b.alloc_device(spec_of(kExtent, 64, DType::Float32), kExtent);
  constexpr auto ITV = ErrorKind::InvalidTensorView;
  struct Row {
    const char* name;
    DType dtype;
    Dims shape;
    std::optional<Dims> strides;
    std::uint64_t byte_offset;
    Outcome expected;
  };
  const Row rows[] = {
      // byte_offset
      {"whole", DType::UInt8, {kN}, std::nullopt, 0, kOk},
      {"offset 1", DType::UInt8, {kN - 1}, std::nullopt, 1, kOk},
      {"offset extent-1", DType::UInt8, {1}, std::nullopt, kExtent - 1, kOk},
      {"offset extent", DType::UInt8, {1}, std::nullopt, kExtent, ITV},
      {"offset 2^63", DType::UInt8, {1}, std::nullopt, k2p63, ITV},
      {"offset 2^64-2", DType::UInt8, {1}, std::nullopt, kMax - 1, ITV},
      {"offset 2^64-1", DType::UInt8, {1}, std::nullopt, kMax, ITV},
      {"float offset not a multiple of 4", DType::Float32, {1}, std::nullopt, 2, ITV},
      {"float last element", DType::Float32, {1}, std::nullopt, kExtent - 4, kOk},
      {"float offset 2^64-4", DType::Float32, {1}, std::nullopt, kMax - 3, ITV},
      // shape
      {"shape extent+1", DType::UInt8, {kN + 1}, std::nullopt, 0, ITV},
      {"shape 0", DType::UInt8, {0}, std::nullopt, 0, ITV},
      {"shape -1", DType::UInt8, {-1}, std::nullopt, 0, ITV},
      {"shape int64 max", DType::UInt8, {kI64Max}, std::nullopt, 0, ITV},
      {"shape int64 min", DType::UInt8, {kI64Min}, std::nullopt, 0, ITV},
      {"shape 2^32 x 2^32 (2^64 elements)", DType::UInt8, {1ll << 32, 1ll << 32}, std::nullopt, 0, ITV},
      {"shape 2^31 x 2^31 x 4 (2^64 elements)", DType::UInt8, {1ll << 31, 1ll << 31, 4}, std::nullopt, 0, ITV},
      {"float shape 2^62 (2^64 bytes)", DType::Float32, {1ll << 62}, std::nullopt, 0, ITV},
      {"float shape 2^61 (2^63 bytes)", DType::Float32, {1ll << 61}, std::nullopt, 0, ITV},
      {"64 x 64", DType::UInt8, {64, 64}, std::nullopt, 0, kOk},
      {"8 dims", DType::UInt8, {2, 2, 2, 2, 2, 2, 2, 2}, std::nullopt, 0, kOk},
      // strides (elements)
      {"stride 1", DType::UInt8, {kN}, Dims{1}, 0, kOk},
      {"stride reaching the last byte", DType::UInt8, {2}, Dims{kN - 1}, 0, kOk},
      {"stride reaching past the end", DType::UInt8, {2}, Dims{kN}, 0, ITV},
      {"stride 0 (broadcast)", DType::UInt8, {4}, Dims{0}, 0, kOk},
      {"stride int64 max", DType::UInt8, {2}, Dims{kI64Max}, 0, ITV},
      {"stride int64 max, 3 elements", DType::UInt8, {3}, Dims{kI64Max}, 0, ITV},
      {"stride int64 min", DType::UInt8, {2}, Dims{kI64Min}, kExtent - 1, ITV},
      {"stride -1 from offset 1", DType::UInt8, {2}, Dims{-1}, 1, kOk},
      {"stride -1 from offset 0", DType::UInt8, {2}, Dims{-1}, 0, ITV},
      {"stride 2^62 over 4", DType::UInt8, {4}, Dims{1ll << 62}, 0, ITV},
      {"float stride 2^61", DType::Float32, {2}, Dims{1ll << 61}, 0, ITV},
      {"stride 1, offset 2^64-1", DType::UInt8, {1}, Dims{1}, kMax, ITV},
      {"stride -1, offset 2^64-1", DType::UInt8, {2}, Dims{-1}, kMax, ITV},
      {"strides of another rank", DType::UInt8, {2, 2}, Dims{1}, 0, ITV},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(row.name);
    const DeviceHandle h = row.dtype == DType::Float32 ? floats : bytes;
    ViewLease lease;
    EXPECT_TRUE(outcome_is(row.expected, [&] {
      lease = b.view(h, ViewSpec{row.dtype, row.shape, row.strides, row.byte_offset});
    }));
    if (!row.expected) {
      EXPECT_EQ(lease->shape, row.shape);
      EXPECT_EQ(lease->byte_offset, row.byte_offset);
      EXPECT_EQ(b.stats().live_views, 1u);
      lease.reset();
    }
    EXPECT_EQ(b.stats().live_views, 0u);
  }
  expect_usable(2);
  // Nothing is left leasing the allocations: both can be freed now.
  EXPECT_TRUE(outcome_is(kOk, [&] { b.free_device(bytes); }));
  EXPECT_TRUE(outcome_is(kOk, [&] { b.free_device(floats); }));
}

// ---- timeouts -------------------------------------------------------------------

// CONTRACT.md, "Bounded records, hostile input": a huge or infinite timeout
// waits until done; a negative one is a usage error (InvalidRange here).
TEST_P(BoundaryTest, WaitTimeouts) {
  if (!can_hold()) GTEST_SKIP() << driver().name << " cannot hold copies";
  auto& b = make_bridge();
  const auto h = b.alloc_device(spec_of(4096, 64), 4096);
  const auto r = b.reserve(4096);

  struct Row {
    const char* name;
    std::chrono::nanoseconds timeout;
    Outcome expected;
    bool waits_until_done;  // else it returns Pending while the copy is held
  };
  const Row rows[] = {
      {"0", 0ns, kOk, false},
      {"1 ns", 1ns, kOk, false},
      {"-1 ns", -1ns, ErrorKind::InvalidRange, false},
      {"nanoseconds::min()", std::chrono::nanoseconds::min(), ErrorKind::InvalidRange, false},
      {"2^62 ns (146 years)", std::chrono::nanoseconds(1ll << 62), kOk, true},
      {"nanoseconds::max()-1", std::chrono::nanoseconds::max() - 1ns, kOk, true},
      {"nanoseconds::max()", std::chrono::nanoseconds::max(), kOk, true},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(std::string("wait timeout ") + row.name);
    hold(true);
    const auto e = b.host_to_device(r, DeviceRange{h, 0, 4096}, CopyMode::Async);
    std::thread releaser;
    if (row.waits_until_done) {
      releaser = std::thread([this] {
        std::this_thread::sleep_for(50ms);
        hold(false);
      });
    }
    CopyStatus status;
    EXPECT_TRUE(outcome_is(row.expected, [&] { status = b.wait(e, row.timeout); }));
    if (releaser.joinable()) {
      releaser.join();
      if (!row.expected) { EXPECT_EQ(status.state, CopyState::Completed) << "a huge timeout must wait until done"; }
    } else {
      if (!row.expected) { EXPECT_EQ(status.state, CopyState::Pending); }
      hold(false);
    }
    EXPECT_EQ(b.wait(e).state, CopyState::Completed);
  }
  b.release_host(r);
  expect_usable(1);
  b.free_device(h);
}

TEST_P(BoundaryTest, WaitForRoomTimeouts) {
  if (!can_hold()) GTEST_SKIP() << driver().name << " cannot hold copies";
  constexpr std::uint64_t kBudget = 4096;
  auto& b = make_bridge(kRing, kBudget);
  const auto h = b.alloc_device(spec_of(2 * kBudget, 64), 2 * kBudget);
  const auto first = b.reserve(kBudget);
  const auto second = b.reserve(kBudget);

  struct Row {
    const char* name;
    std::chrono::nanoseconds wait_for_room;
    Outcome expected;
    bool waits_until_room;
  };
  const Row rows[] = {
      {"0", 0ns, ErrorKind::Backpressure, false},
      {"1 ns", 1ns, ErrorKind::Backpressure, false},
      {"-1 ns", -1ns, ErrorKind::InvalidRange, false},
      {"nanoseconds::min()", std::chrono::nanoseconds::min(), ErrorKind::InvalidRange, false},
      {"2^62 ns (146 years)", std::chrono::nanoseconds(1ll << 62), kOk, true},
      {"nanoseconds::max()", std::chrono::nanoseconds::max(), kOk, true},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(std::string("wait_for_room ") + row.name);
    hold(true);
    const auto e1 = b.host_to_device(first, DeviceRange{h, 0, kBudget}, CopyMode::Async);  // the whole budget
    std::thread releaser;
    if (row.waits_until_room) {
      releaser = std::thread([this] {
        std::this_thread::sleep_for(50ms);
        hold(false);
      });
    }
    CopyEvent e2;
    EXPECT_TRUE(outcome_is(row.expected, [&] {
      e2 = b.host_to_device(second, DeviceRange{h, kBudget, kBudget}, CopyMode::Async,
                            Admission{row.wait_for_room});
    }));
    if (releaser.joinable()) {
      releaser.join();
    } else {
      hold(false);
    }
    EXPECT_EQ(b.wait(e1).state, CopyState::Completed);
    if (!row.expected) { EXPECT_EQ(b.wait(e2).state, CopyState::Completed); }
    EXPECT_EQ(b.stats().inflight_bytes, 0u);
  }
  b.release_host(first);
  b.release_host(second);
  expect_usable(1);
  b.free_device(h);
}

std::string driver_name(const ::testing::TestParamInfo<BackendDriver>& info) { return std::string(info.param.name); }

INSTANTIATE_TEST_SUITE_P(Backends, BoundaryTest, ::testing::ValuesIn(backend_drivers()), driver_name);

// ---- the ring's bookkeeping at 2^64-1 bytes ------------------------------------

// A fake whose ring claims 2^64-1 bytes over a real 4096-byte block: no
// backend can allocate that much, but the ring's arithmetic must hold for any
// capacity a backend reports. Only ranges inside the first 4096 bytes are
// ever copied.
class HugeRingBackend final : public testing::ForwardingBackend {
 public:
  HugeRingBackend() : ForwardingBackend(fake_) { fake_.set_auto_complete(true); }
  fake::FakeBackend& fake() { return fake_; }
  HostBlock allocate_host(std::uint64_t bytes) override {
    real_ = fake_.allocate_host(4096);
    HostBlock claimed = real_;
    claimed.bytes = bytes;
    return claimed;
  }
  void free_host(const HostBlock&) noexcept override { fake_.free_host(real_); }

 private:
  fake::FakeBackend fake_;
  HostBlock real_;
};

TEST(HostRingBoundary, RingOfTwoToThe64MinusOneBytesKeepsItsBookkeeping) {
  constexpr std::uint64_t k2p62 = 1ull << 62;
  auto owned = std::make_unique<HugeRingBackend>();
  auto& backend = *owned;
  Bridge b(std::move(owned), BridgeOptions{.generation = 1, .ring_bytes = kMax});
  ASSERT_EQ(b.ring_capacity(), kMax);

  const auto r1 = b.reserve(k2p63, 1);
  EXPECT_EQ(r1.offset, 0u);
  const auto r2 = b.reserve(k2p62, 4096);
  EXPECT_EQ(r2.offset, k2p63);
  // 2^62 more would end at 2^64, one byte past the ring: full, not wrapped.
  EXPECT_TRUE(outcome_is(ErrorKind::Backpressure, [&] { b.reserve(k2p62, 1); }));
  const auto r3 = b.reserve(k2p62 - 1, 1);  // exactly the rest
  EXPECT_EQ(r3.offset, k2p63 + k2p62);
  EXPECT_EQ(b.ring_free_bytes(), 0u);
  EXPECT_TRUE(outcome_is(ErrorKind::Backpressure, [&] { b.reserve(1, 1); }));

  // Releasing the first half makes room for a second lap.
  b.release_host(r1);
  const auto r4 = b.reserve(k2p63, 4096);
  EXPECT_EQ(r4.offset, 0u);
  EXPECT_TRUE(outcome_is(ErrorKind::Backpressure, [&] { b.reserve(1, 1); }));
  // Lookups still find exactly the live reservations.
  EXPECT_TRUE(outcome_is(ErrorKind::InvalidRange, [&] { b.release_host(HostRange{k2p63, k2p62 - 1}); }));
  EXPECT_TRUE(outcome_is(ErrorKind::InvalidRange, [&] { b.release_host(HostRange{kMax, 1}); }));
  EXPECT_TRUE(outcome_is(ErrorKind::InvalidRange, [&] { b.host_bytes(HostRange{kMax - 1, 2}); }));
  const auto h = b.alloc_device(ObjectSpec{64, 64, DType::UInt8, ShapeKind::Vector}, 64);
  auto bytes = b.host_bytes(HostRange{0, 64});
  for (std::size_t i = 0; i < 64; ++i) bytes[i] = static_cast<std::byte>(i + 1);
  b.host_to_device(HostRange{0, 64}, DeviceRange{h, 0, 64}, CopyMode::Sync);
  std::memset(bytes.data(), 0, 64);
  const auto e = b.device_to_host(DeviceRange{h, 0, 64}, HostRange{0, 64}, CopyMode::Async);
  EXPECT_EQ(b.wait(e).state, CopyState::Completed);
  for (std::size_t i = 0; i < 64; ++i) EXPECT_EQ(bytes[i], static_cast<std::byte>(i + 1)) << "byte " << i;
  b.release_host(r2);
  b.release_host(r3);
  b.release_host(r4);
  EXPECT_EQ(b.ring_free_bytes(), kMax);

  // Many laps of 2^62-byte reservations, one always live, so the ring never
  // empties: 2^62 * 3 fit in a lap, the fourth starts the next at 0. The
  // logical positions pass 2^64 after a few laps and must not wrap.
  HostRange live = b.reserve(k2p62, 1);
  for (int i = 1; i <= 40; ++i) {
    SCOPED_TRACE("reservation " + std::to_string(i));
    HostRange next;
    ASSERT_TRUE(outcome_is(kOk, [&] { next = b.reserve(k2p62, 1); }));
    EXPECT_EQ(next.offset, static_cast<std::uint64_t>(i % 3) * k2p62);
    ASSERT_TRUE(outcome_is(kOk, [&] { b.release_host(live); }));
    live = next;
    EXPECT_EQ(b.stats().ring_reservations, 1u);
    EXPECT_EQ(b.stats().ring_used, k2p62);  // the skipped end of a lap lies behind the tail
  }
  b.release_host(live);
  EXPECT_EQ(b.ring_free_bytes(), kMax);
  b.free_device(h);
  EXPECT_EQ(backend.fake().live_allocations(), 0u);
}

// ---- the backends themselves ------------------------------------------------------

// The fake's own allocations near 2^64 (a fake with that much "memory", so
// its budget check does not refuse first): the aligned size used to wrap.
TEST(FakeBackendBoundary, HugeAllocationsAreRefusedNotWrapped) {
  fake::FakeBackend fake(kMax);
  for (const std::uint64_t bytes : {kMax, kMax - 1, kMax - 63, kMax - 4095, k2p63}) {
    SCOPED_TRACE("allocate " + std::to_string(bytes));
    std::string message;
    EXPECT_TRUE(outcome_is(ErrorKind::AllocationFailed, [&] { fake.allocate(bytes, 64); }, &message));
    EXPECT_NE(message.find(std::to_string(bytes)), std::string::npos) << message;
    EXPECT_TRUE(outcome_is(ErrorKind::AllocationFailed, [&] { fake.allocate_host(bytes); }, &message));
    EXPECT_NE(message.find(std::to_string(bytes)), std::string::npos) << message;
  }
  // An alignment that rounds a small size past 2^64 is refused too.
  EXPECT_TRUE(outcome_is(ErrorKind::AllocationFailed, [&] { fake.allocate(k2p63 + 1, k2p63); }));
  EXPECT_EQ(fake.live_allocations(), 0u);
  EXPECT_EQ(fake.live_host_blocks(), 0u);
  const auto a = fake.allocate(64, 64);
  fake.free(a);
  EXPECT_EQ(fake.live_allocations(), 0u);
}

// wait_for_completions with a timeout too large to add to the clock waits
// for the completion (it used to wrap and return false at once).
TEST(FakeBackendBoundary, AHugeWaitTimeoutWaitsForTheCompletion) {
  fake::FakeBackend fake;
  const HostBlock ring = fake.allocate_host(4096);
  const DeviceAllocation device = fake.allocate(4096, 64);
  const CopyEvent event{1, 1, 42};
  fake.submit_copy(CopyRequest{CopyDirection::HostToDevice, CopyMode::Async, event, ring.data, device, 0, 4096, CopyLayout{}});
  std::thread completer([&] {
    std::this_thread::sleep_for(50ms);
    fake.complete(event);
  });
  for (const auto timeout : {std::chrono::nanoseconds::max(), std::chrono::nanoseconds::max() - 1ns}) {
    EXPECT_TRUE(fake.wait_for_completions(timeout));
  }
  completer.join();
  std::vector<Completion> drained;
  fake.drain_completions(drained);
  ASSERT_EQ(drained.size(), 1u);
  EXPECT_EQ(drained[0].event, event);
  EXPECT_FALSE(fake.wait_for_completions(0ns));
  EXPECT_FALSE(fake.wait_for_completions(-1ns));
  fake.free(device);
  fake.free_host(ring);
}

// Whether a failure kind can fire on a call kind, as the CLI asks before a
// run (--fake-inject) and inject() enforces.
TEST(FakeBackendBoundary, AppliesMatchesWhatInjectAccepts) {
  using fake::Call;
  using fake::Failure;
  const Call calls[] = {Call::Allocate,         Call::Free,     Call::AllocateHost,
                        Call::FreeHost,         Call::CopyHostToDevice, Call::CopyDeviceToHost,
                        Call::Launch,           Call::ValidateView,     Call::Quiesce};
  const Failure failures[] = {Failure::AllocationFailed,     Failure::CopyFailedAtSubmit,
                              Failure::CopyFailedAtCompletion, Failure::InvalidView,
                              Failure::LostCompletion,       Failure::DuplicatedCompletion,
                              Failure::LateCompletion,       Failure::Fatal};
  int applicable = 0;
  for (const Call call : calls) {
    for (const Failure failure : failures) {
      SCOPED_TRACE(std::string(fake::failure_name(failure)) + " on " + std::string(fake::call_name(call)));
      fake::FakeBackend backend;
      bool accepted = true;
      try {
        backend.inject(call, failure);
      } catch (const std::invalid_argument&) {
        accepted = false;
      }
      EXPECT_EQ(fake::applies(call, failure), accepted);
      applicable += accepted;
    }
  }
  // The examples of impossible combinations.
  EXPECT_FALSE(fake::applies(Call::Free, Failure::Fatal));
  EXPECT_FALSE(fake::applies(Call::CopyHostToDevice, Failure::AllocationFailed));
  EXPECT_FALSE(fake::applies(Call::Allocate, Failure::InvalidView));
  EXPECT_TRUE(fake::applies(Call::Allocate, Failure::AllocationFailed));
  EXPECT_TRUE(fake::applies(Call::Quiesce, Failure::Fatal));
  EXPECT_EQ(applicable, 2 + 5 * 2 + 1 + 7);
}

}  // namespace
}  // namespace devbridge::conformance
