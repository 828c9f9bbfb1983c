// Device-to-device copies between two bridges over CUDA backends
// (Bridge::copy_to_peer, Backend::copy_to_peer): within one context
// (cuMemcpyDtoDAsync), between two contexts of one device and between two
// devices (cuMemcpyPeerAsync), ordered after work already submitted to
// either bridge, refused (false) towards another kind of device, and every
// failure a DeviceCopyFailed naming both sides.
//
// Skipped with the probe's reason without a usable driver; run against the
// emulated driver by the emulated.* ctest entries, and across two emulated
// devices by emulated.TwoDevices.PeerCopies (DEVBRIDGE_EMULATED_CUDA_DEVICES=2).
// Tests that need an emulator hook (an injected copy failure, the event
// counters) skip on a real driver, as does the two-device test on a machine
// with one GPU.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_driver.hpp"
#include "cuda_test_support.hpp"
#include "devbridge/backends.hpp"
#include "devbridge/backends/cuda.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::cuda {
namespace {

using namespace std::chrono_literals;
using testing::AllocationHolder;
using testing::OwnContext;
using detail::CUcontext;
using detail::CUDA_ERROR_ILLEGAL_ADDRESS;
using detail::CUDA_ERROR_INVALID_VALUE;
using detail::CUDA_SUCCESS;

constexpr std::byte kPoison{0xA5};
constexpr std::uint64_t kBytes = 8192;

using FailCopy = void (*)(long long, int);
using EventCount = unsigned long long (*)();

FailCopy fail_copy_hook() { return testing::emulator_hook<FailCopy>("devbridge_emulated_cuda_fail_copy"); }

// Events the driver made and has not destroyed, where it counts them.
std::optional<unsigned long long> live_events() {
  auto created = testing::emulator_hook<EventCount>("devbridge_emulated_cuda_events_created");
  auto destroyed = testing::emulator_hook<EventCount>("devbridge_emulated_cuda_events_destroyed");
  if (created == nullptr || destroyed == nullptr) return std::nullopt;
  return created() - destroyed();
}

// Never the poison byte, so a byte that was not copied cannot pass for one that was.
std::vector<std::byte> random_bytes(std::size_t bytes, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::vector<std::byte> data(bytes);
  for (auto& value : data) {
    do {
      value = static_cast<std::byte>(generator() & 0xff);
    } while (value == kPoison);
  }
  return data;
}

std::unique_ptr<Bridge> make_bridge(std::string_view backend, const BackendOptions& options = {}) {
  return std::make_unique<Bridge>(make_backend(backend, options), BridgeOptions{1, 1 << 20, 0});
}

BackendOptions in_context(CUcontext context) {
  return BackendOptions{{"context", std::to_string(reinterpret_cast<std::uintptr_t>(context))}};
}

DeviceHandle alloc(Bridge& bridge, std::uint64_t bytes = kBytes, DType dtype = DType::UInt8) {
  return bridge.alloc_device(ObjectSpec{bytes, 256, dtype, ShapeKind::Tensor}, bytes);
}

void write(Bridge& bridge, DeviceHandle handle, std::uint64_t offset, std::span<const std::byte> data) {
  const HostRange staging = bridge.reserve(data.size());
  std::memcpy(bridge.host_bytes(staging).data(), data.data(), data.size());
  (void)bridge.host_to_device(staging, DeviceRange{handle, offset, data.size()}, CopyMode::Sync);
  bridge.release_host(staging);
}

void poison(Bridge& bridge, DeviceHandle handle, std::uint64_t bytes = kBytes) {
  write(bridge, handle, 0, std::vector<std::byte>(bytes, kPoison));
}

std::vector<std::byte> read(Bridge& bridge, DeviceHandle handle, std::uint64_t bytes = kBytes) {
  const HostRange staging = bridge.reserve(bytes);
  (void)bridge.device_to_host(DeviceRange{handle, 0, bytes}, staging, CopyMode::Sync);
  const auto host = bridge.host_bytes(staging);
  std::vector<std::byte> out(host.begin(), host.end());
  bridge.release_host(staging);
  return out;
}

// `after` is `before` with [destination_offset, +len) replaced by
// `source`'s [source_offset, +len); reports the first few differences.
void expect_landed(const std::vector<std::byte>& after, const std::vector<std::byte>& before,
                   const std::vector<std::byte>& source, std::uint64_t source_offset,
                   std::uint64_t destination_offset, std::uint64_t len, const std::string& what) {
  ASSERT_EQ(after.size(), before.size());
  int reported = 0;
  for (std::uint64_t i = 0; i < after.size() && reported < 4; ++i) {
    const bool inside = i >= destination_offset && i - destination_offset < len;
    const std::byte expected = inside ? source[source_offset + (i - destination_offset)] : before[i];
    if (after[i] == expected) continue;
    ADD_FAILURE() << what << ": byte " << i << " is " << static_cast<int>(after[i]) << ", expected "
                  << static_cast<int>(expected) << (inside ? " (copied)" : " (outside the range: untouched)");
    ++reported;
  }
}

// Frees the handles and the bridge's cache: the backend then holds nothing.
void expect_no_leaks(Bridge& bridge, std::initializer_list<DeviceHandle> handles, const std::string& what) {
  for (const DeviceHandle& handle : handles) bridge.free_device(handle);
  bridge.empty_cache();
  EXPECT_EQ(bridge.stats().live_allocations, 0u) << what;
  if (is_cuda_backend(bridge.backend())) {
    EXPECT_EQ(bridge.backend().test_controls()->live_allocations(), 0u) << what;
  }
}

class CudaPeerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const Probe found = probe();
    if (!found.available) GTEST_SKIP() << "no usable CUDA device: " << found.reason;
    device_count_ = found.device_count;
    events_at_start_ = live_events();
  }

  void TearDown() override {
    if (FailCopy fail = fail_copy_hook()) fail(-1, CUDA_SUCCESS);
    // The bridges are gone: every event their backends made is destroyed.
    if (events_at_start_) {
      EXPECT_EQ(live_events(), events_at_start_) << "events left behind";
    }
  }

  // Copies at odd offsets and lengths from `from` into `to`, each over a
  // freshly poisoned destination: only the range changes.
  static void expect_exact_copies(Bridge& from, Bridge& to, const std::string& what) {
    const DeviceHandle source = alloc(from);
    const DeviceHandle destination = alloc(to);
    const auto data = random_bytes(kBytes, 11);
    write(from, source, 0, data);
    struct Case {
      std::uint64_t source_offset, destination_offset, len;
    };
    for (const Case c : {Case{0, 0, kBytes}, Case{1, 3, 1}, Case{7, 513, 1001}, Case{4095, 1, 4097},
                         Case{0, kBytes - 257, 257}, Case{kBytes - 3, 0, 3}}) {
      poison(to, destination);
      const auto before = read(to, destination);
      ASSERT_TRUE(from.copy_to_peer(DeviceRange{source, c.source_offset, c.len}, to,
                                    DeviceRange{destination, c.destination_offset, c.len}))
          << what;
      expect_landed(read(to, destination), before, data, c.source_offset, c.destination_offset, c.len,
                    what + ", " + std::to_string(c.len) + " bytes from " + std::to_string(c.source_offset) + " to " +
                        std::to_string(c.destination_offset));
      EXPECT_EQ(read(from, source), data) << what << ": the source changed";
    }
    EXPECT_FALSE(from.stats().broken);
    EXPECT_FALSE(to.stats().broken);
    expect_no_leaks(from, {source}, what + ", source bridge");
    expect_no_leaks(to, {destination}, what + ", destination bridge");
  }

  int device_count_ = 0;
  std::optional<unsigned long long> events_at_start_;
};

// Two bridges on one device share its primary context: cuMemcpyDtoDAsync.
TEST_F(CudaPeerTest, WithinOneContextBytesLandExactly) {
  auto a = make_bridge("cuda");
  auto b = make_bridge("cuda");
  ASSERT_EQ(context_of(a->backend()), context_of(b->backend()));
  expect_exact_copies(*a, *b, "primary context to primary context");
  expect_exact_copies(*b, *a, "back again");
}

// A caller's context on the same device: another address space, so
// cuMemcpyPeerAsync (the emulator refuses cuMemcpyDtoDAsync across
// contexts, as the memory is not mapped there).
TEST_F(CudaPeerTest, BetweenTwoContextsOfOneDeviceBytesLandExactly) {
  OwnContext own;
  if (own.context == nullptr) GTEST_SKIP() << "cuCtxCreate_v2 is not available to create a test context";
  auto primary = make_bridge("cuda");
  auto caller = make_bridge("cuda", in_context(own.context));
  ASSERT_NE(context_of(primary->backend()), context_of(caller->backend()));
  expect_exact_copies(*primary, *caller, "primary context to a caller's context");
  expect_exact_copies(*caller, *primary, "a caller's context to the primary context");
}

// Run with two devices by emulated.TwoDevices.PeerCopies.
TEST_F(CudaPeerTest, BetweenTwoDevicesBytesLandExactly) {
  if (device_count_ < 2) GTEST_SKIP() << "needs two CUDA devices (" << device_count_ << " present)";
  auto zero = make_bridge("cuda", {{"device", "0"}});
  auto one = make_bridge("cuda", {{"device", "1"}});
  ASSERT_EQ(one->backend_info().device_ordinal, 1);
  ASSERT_NE(context_of(zero->backend()), context_of(one->backend()));
  expect_exact_copies(*zero, *one, "device 0 to device 1");
  expect_exact_copies(*one, *zero, "device 1 to device 0");
}

// Runs copy_to_peer on a thread of its own, so the test can see it wait.
class CopyInBackground {
 public:
  CopyInBackground(Bridge& from, DeviceRange source, Bridge& to, DeviceRange destination)
      : thread_([&, source, destination] {
          try {
            copied_ = from.copy_to_peer(source, to, destination);
          } catch (...) {
            failure_ = std::current_exception();
          }
          done_ = true;
        }) {}
  ~CopyInBackground() {
    if (thread_.joinable()) thread_.join();
  }
  bool done() const { return done_; }
  bool finish() {
    thread_.join();
    if (failure_) std::rethrow_exception(failure_);
    return copied_;
  }

 private:
  std::atomic<bool> done_{false};
  bool copied_ = false;
  std::exception_ptr failure_;
  std::thread thread_;  // last: starts once the rest exists
};

// An upload into the source still pending (its stream held): the copy waits
// for it on the device, and copies the uploaded bytes, not the old ones.
TEST_F(CudaPeerTest, OrderedAfterAPendingUploadIntoTheSource) {
  auto a = make_bridge("cuda");
  auto b = make_bridge("cuda");
  const DeviceHandle source = alloc(*a);
  const DeviceHandle destination = alloc(*b);
  poison(*a, source);
  poison(*b, destination);
  const auto data = random_bytes(kBytes, 21);
  const HostRange staging = a->reserve(kBytes);
  std::memcpy(a->host_bytes(staging).data(), data.data(), kBytes);

  a->backend().test_controls()->hold_copies(true);
  const CopyEvent up = a->host_to_device(staging, DeviceRange{source, 0, kBytes}, CopyMode::Async);
  {
    CopyInBackground copy(*a, DeviceRange{source, 5, 4001}, *b, DeviceRange{destination, 9, 4001});
    std::this_thread::sleep_for(200ms);
    EXPECT_FALSE(copy.done()) << "the copy returned while the upload into its source was pending";
    EXPECT_EQ(a->copy_status(up).state, CopyState::Pending);
    a->backend().test_controls()->hold_copies(false);
    EXPECT_TRUE(copy.finish());
  }
  EXPECT_EQ(a->wait(up, 30s).state, CopyState::Completed);
  a->release_host(staging);
  expect_landed(read(*b, destination), std::vector<std::byte>(kBytes, kPoison), data, 5, 9, 4001,
                "after a pending upload");
  expect_no_leaks(*a, {source}, "source bridge");
  expect_no_leaks(*b, {destination}, "destination bridge");
}

// A download from the destination still pending (its stream held): the copy
// must not overwrite the bytes before the download has read them.
TEST_F(CudaPeerTest, OrderedAfterAPendingDownloadFromTheDestination) {
  auto a = make_bridge("cuda");
  auto b = make_bridge("cuda");
  const DeviceHandle source = alloc(*a);
  const DeviceHandle destination = alloc(*b);
  const auto data = random_bytes(kBytes, 31);
  write(*a, source, 0, data);
  poison(*b, destination);
  const HostRange out = b->reserve(kBytes);
  std::memset(b->host_bytes(out).data(), 0, kBytes);

  b->backend().test_controls()->hold_copies(true);
  const CopyEvent down = b->device_to_host(DeviceRange{destination, 0, kBytes}, out, CopyMode::Async);
  {
    CopyInBackground copy(*a, DeviceRange{source, 0, kBytes}, *b, DeviceRange{destination, 0, kBytes});
    std::this_thread::sleep_for(200ms);
    EXPECT_FALSE(copy.done()) << "the copy returned while a download from its destination was pending";
    b->backend().test_controls()->hold_copies(false);
    EXPECT_TRUE(copy.finish());
  }
  ASSERT_EQ(b->wait(down, 30s).state, CopyState::Completed);
  const auto downloaded = b->host_bytes(out);
  EXPECT_EQ(std::vector<std::byte>(downloaded.begin(), downloaded.end()), std::vector<std::byte>(kBytes, kPoison))
      << "the pending download saw the copy's bytes";
  b->release_host(out);
  EXPECT_EQ(read(*b, destination), data);
  expect_no_leaks(*a, {source}, "source bridge");
  expect_no_leaks(*b, {destination}, "destination bridge");
}

// A launch on the source's compute stream still pending: the copy reads its
// result.
TEST_F(CudaPeerTest, OrderedAfterAPendingLaunchOnTheSource) {
  constexpr std::uint64_t kCount = kBytes / sizeof(float);
  auto a = make_bridge("cuda");
  auto b = make_bridge("cuda");
  const DeviceHandle x = alloc(*a, kBytes, DType::Float32);
  const DeviceHandle y = alloc(*a, kBytes, DType::Float32);
  const DeviceHandle destination = alloc(*b, kBytes, DType::Float32);
  std::vector<float> input(kCount);
  for (std::uint64_t i = 0; i < kCount; ++i) input[i] = static_cast<float>(i) * 0.5f - 7.0f;
  write(*a, x, 0, std::as_bytes(std::span(input)));
  poison(*a, y);
  poison(*b, destination);

  a->backend().test_controls()->hold_copies(true);
  a->launch_axpy(DeviceRange{x, 0, kBytes}, DeviceRange{y, 0, kBytes}, 2.0f, 1.0f);
  {
    CopyInBackground copy(*a, DeviceRange{y, 0, kBytes}, *b, DeviceRange{destination, 0, kBytes});
    std::this_thread::sleep_for(200ms);
    EXPECT_FALSE(copy.done()) << "the copy returned while the launch writing its source was pending";
    a->backend().test_controls()->hold_copies(false);
    EXPECT_TRUE(copy.finish());
  }
  const auto landed = read(*b, destination);
  std::vector<float> output(kCount);
  std::memcpy(output.data(), landed.data(), kBytes);
  for (std::uint64_t i = 0; i < kCount; ++i) {
    const float product = 2.0f * input[i];
    const float expected = product + 1.0f;
    ASSERT_EQ(std::memcmp(&expected, &output[i], sizeof(float)), 0) << "element " << i;
  }
  expect_no_leaks(*a, {x, y}, "source bridge");
  expect_no_leaks(*b, {destination}, "destination bridge");
}

// No direct path to host memory or to the fake: false, and nothing changes
// on either side (the caller stages through the host instead).
TEST_F(CudaPeerTest, AnotherKindOfDeviceHasNoDirectPath) {
  auto gpu = make_bridge("cuda");
  const DeviceHandle gpu_bytes = alloc(*gpu);
  const auto data = random_bytes(kBytes, 41);
  write(*gpu, gpu_bytes, 0, data);
  for (const char* other_name : {"host", "fake"}) {
    SCOPED_TRACE(other_name);
    auto other = make_bridge(other_name);
    const DeviceHandle other_bytes = alloc(*other);
    const bool readable = std::string_view(other_name) == "host";  // the fake's copies are scripted
    if (readable) poison(*other, other_bytes);
    const BridgeStats gpu_before = gpu->stats();
    const BridgeStats other_before = other->stats();

    EXPECT_FALSE(gpu->copy_to_peer(DeviceRange{gpu_bytes, 3, 1001}, *other, DeviceRange{other_bytes, 5, 1001}));
    EXPECT_FALSE(other->copy_to_peer(DeviceRange{other_bytes, 5, 1001}, *gpu, DeviceRange{gpu_bytes, 3, 1001}));

    for (const auto& [bridge, before] : {std::pair{gpu.get(), gpu_before}, std::pair{other.get(), other_before}}) {
      const BridgeStats after = bridge->stats();
      EXPECT_FALSE(after.broken);
      EXPECT_EQ(after.copies_submitted, before.copies_submitted);
      EXPECT_EQ(after.copies_completed, before.copies_completed);
      EXPECT_EQ(after.copies_failed, before.copies_failed);
      EXPECT_EQ(after.copies_in_flight, 0u);
      EXPECT_EQ(after.live_allocations, before.live_allocations);
    }
    EXPECT_EQ(read(*gpu, gpu_bytes), data);
    if (readable) {
      EXPECT_EQ(read(*other, other_bytes), std::vector<std::byte>(kBytes, kPoison));
    }
    expect_no_leaks(*other, {other_bytes}, std::string(other_name) + " bridge");
  }
  expect_no_leaks(*gpu, {gpu_bytes}, "cuda bridge");
}

TEST_F(CudaPeerTest, RangesOutsideTheirAllocationsAreInvalidRange) {
  auto a = make_bridge("cuda");
  auto b = make_bridge("cuda");
  const DeviceHandle source = alloc(*a);
  const DeviceHandle destination = alloc(*b);
  const auto data = random_bytes(kBytes, 51);
  write(*a, source, 0, data);
  poison(*b, destination);
  const auto refused = [&](DeviceRange from, DeviceRange to, const std::string& what) {
    try {
      (void)a->copy_to_peer(from, *b, to);
      ADD_FAILURE() << what << " was accepted";
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::InvalidRange) << what << ": " << error.what();
    }
  };
  refused(DeviceRange{source, 1, kBytes}, DeviceRange{destination, 0, kBytes}, "a source range one byte past");
  refused(DeviceRange{source, 0, 16}, DeviceRange{destination, kBytes - 15, 16}, "a destination range one byte past");
  refused(DeviceRange{source, std::numeric_limits<std::uint64_t>::max(), 2}, DeviceRange{destination, 0, 2},
          "a source offset that wraps");
  EXPECT_EQ(read(*b, destination), std::vector<std::byte>(kBytes, kPoison)) << "a refused copy wrote";
  EXPECT_FALSE(a->stats().broken);
  EXPECT_FALSE(b->stats().broken);
  expect_no_leaks(*a, {source}, "source bridge");
  expect_no_leaks(*b, {destination}, "destination bridge");
}

// The backend checks the ranges itself too (the bridge has checked them
// before it calls, so this is the backend's own guard), before it even
// looks at the destination.
TEST_F(CudaPeerTest, BackendRefusesRangesOutsideItsAllocations) {
  auto a = make_cuda_backend();
  auto b = make_cuda_backend();
  auto host = make_backend("host");
  AllocationHolder source{*a, a->allocate(4096, 256)};
  AllocationHolder destination{*b, b->allocate(4096, 256)};
  const auto refused = [&](std::uint64_t source_offset, Backend& to, std::uint64_t destination_offset,
                           std::uint64_t len, const std::string& what) {
    try {
      (void)a->copy_to_peer(source.allocation, source_offset, to, destination.allocation, destination_offset, len);
      ADD_FAILURE() << what << " was accepted";
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::InvalidRange) << what << ": " << error.what();
      EXPECT_NE(std::string(error.what()).find(std::to_string(len)), std::string::npos)
          << what << ": the message names no range: " << error.what();
    }
  };
  refused(1, *b, 0, 4096, "a source range one byte past");
  refused(0, *b, 4000, 97, "a destination range one byte past");
  refused(std::numeric_limits<std::uint64_t>::max() - 1, *b, 0, 4, "a source offset that wraps");
  refused(0, *b, std::numeric_limits<std::uint64_t>::max(), 2, "a destination offset that wraps");
  refused(4000, *host, 0, 200, "a bad range towards another kind of device");
  EXPECT_FALSE(a->copy_to_peer(source.allocation, 0, *host, destination.allocation, 0, 4096));
  EXPECT_TRUE(a->copy_to_peer(source.allocation, 0, *b, destination.allocation, 0, 4096));
  EXPECT_TRUE(a->copy_to_peer(source.allocation, 0, *b, destination.allocation, 4096, 0)) << "an empty copy";
}

// A copy the driver refuses: DeviceCopyFailed naming both sides and the
// length; neither bridge breaks, nothing landed, and the next copy works.
TEST_F(CudaPeerTest, InjectedCopyFailureIsDeviceCopyFailedAndBothBridgesGoOn) {
  FailCopy fail_copy = fail_copy_hook();
  if (fail_copy == nullptr) GTEST_SKIP() << "needs the emulated driver's copy failure hook";
  OwnContext own;
  auto a = make_bridge("cuda");
  auto b = make_bridge("cuda");
  std::unique_ptr<Bridge> c;
  if (own.context != nullptr) c = make_bridge("cuda", in_context(own.context));
  for (Bridge* to : {b.get(), c.get()}) {
    if (to == nullptr) continue;
    const bool same_context = context_of(a->backend()) == context_of(to->backend());
    SCOPED_TRACE(same_context ? "one context" : "between contexts");
    const DeviceHandle source = alloc(*a);
    const DeviceHandle destination = alloc(*to);
    const auto data = random_bytes(kBytes, 61);
    write(*a, source, 0, data);
    poison(*to, destination);
    fail_copy(0, CUDA_ERROR_INVALID_VALUE);
    try {
      (void)a->copy_to_peer(DeviceRange{source, 3, 777}, *to, DeviceRange{destination, 11, 777});
      ADD_FAILURE() << "the refused copy succeeded";
    } catch (const Error& error) {
      const std::string message = error.what();
      EXPECT_EQ(error.kind(), ErrorKind::DeviceCopyFailed) << message;
      EXPECT_FALSE(error.fatal()) << message;
      EXPECT_NE(message.find(same_context ? "cuMemcpyDtoDAsync" : "cuMemcpyPeerAsync"), std::string::npos) << message;
      EXPECT_NE(message.find("CUDA_ERROR_INVALID_VALUE"), std::string::npos) << message;
      EXPECT_NE(message.find("777 bytes"), std::string::npos) << message;
      EXPECT_NE(message.find("CUDA:0"), std::string::npos) << message;
      EXPECT_NE(message.find("+3"), std::string::npos) << "the source's offset: " << message;
      EXPECT_NE(message.find("+11"), std::string::npos) << "the destination's offset: " << message;
    }
    fail_copy(-1, CUDA_SUCCESS);
    EXPECT_FALSE(a->stats().broken);
    EXPECT_FALSE(to->stats().broken);
    EXPECT_EQ(read(*to, destination), std::vector<std::byte>(kBytes, kPoison)) << "the refused copy wrote";
    // Both go on: the same copy again, and the bridges' own copies.
    EXPECT_TRUE(a->copy_to_peer(DeviceRange{source, 3, 777}, *to, DeviceRange{destination, 11, 777}));
    expect_landed(read(*to, destination), std::vector<std::byte>(kBytes, kPoison), data, 3, 11, 777, "retried");
    EXPECT_EQ(read(*a, source), data);
    expect_no_leaks(*a, {source}, "source bridge");
    expect_no_leaks(*to, {destination}, "destination bridge");
  }
}

// A fatal code (a sticky error) breaks both bridges, as the device state is
// unknown on both sides; a restart brings them back with nothing leaked.
TEST_F(CudaPeerTest, FatalCopyFailureBreaksBothBridges) {
  FailCopy fail_copy = fail_copy_hook();
  if (fail_copy == nullptr) GTEST_SKIP() << "needs the emulated driver's copy failure hook";
  auto a = make_bridge("cuda");
  auto b = make_bridge("cuda");
  const DeviceHandle source = alloc(*a);
  const DeviceHandle destination = alloc(*b);
  fail_copy(0, CUDA_ERROR_ILLEGAL_ADDRESS);
  try {
    (void)a->copy_to_peer(DeviceRange{source, 0, 64}, *b, DeviceRange{destination, 0, 64});
    ADD_FAILURE() << "the refused copy succeeded";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::DeviceCopyFailed) << error.what();
    EXPECT_TRUE(error.fatal()) << error.what();
    EXPECT_NE(std::string(error.what()).find("CUDA_ERROR_ILLEGAL_ADDRESS"), std::string::npos) << error.what();
  }
  fail_copy(-1, CUDA_SUCCESS);
  EXPECT_TRUE(a->stats().broken);
  EXPECT_TRUE(b->stats().broken);
  // The emulated context did not really fault: a restart brings both back.
  for (Bridge* bridge : {a.get(), b.get()}) {
    bridge->restart(2);
    EXPECT_FALSE(bridge->stats().broken);
    EXPECT_EQ(bridge->backend().test_controls()->live_allocations(), 0u);
  }
  const DeviceHandle again = alloc(*a);
  const DeviceHandle into = alloc(*b);
  const auto data = random_bytes(kBytes, 71);
  write(*a, again, 0, data);
  EXPECT_TRUE(a->copy_to_peer(DeviceRange{again, 0, kBytes}, *b, DeviceRange{into, 0, kBytes}));
  EXPECT_EQ(read(*b, into), data);
  expect_no_leaks(*a, {again}, "source bridge");
  expect_no_leaks(*b, {into}, "destination bridge");
}

// Copies both ways at once, each bridge the other's source: no lock order
// between two backends can deadlock, and every copy lands.
TEST_F(CudaPeerTest, ConcurrentCopiesBothWays) {
  auto a = make_bridge("cuda");
  auto b = make_bridge("cuda");
  const DeviceHandle a_source = alloc(*a);
  const DeviceHandle a_destination = alloc(*a);
  const DeviceHandle b_source = alloc(*b);
  const DeviceHandle b_destination = alloc(*b);
  const auto a_data = random_bytes(kBytes, 81);
  const auto b_data = random_bytes(kBytes, 82);
  write(*a, a_source, 0, a_data);
  write(*b, b_source, 0, b_data);
  std::atomic<int> failures{0};
  const auto copy_many = [&](Bridge& from, DeviceHandle source, Bridge& to, DeviceHandle destination) {
    for (int i = 0; i < 50; ++i) {
      try {
        if (!from.copy_to_peer(DeviceRange{source, 0, kBytes}, to, DeviceRange{destination, 0, kBytes})) ++failures;
      } catch (const std::exception&) {
        ++failures;
      }
    }
  };
  std::thread forth([&] { copy_many(*a, a_source, *b, b_destination); });
  std::thread back([&] { copy_many(*b, b_source, *a, a_destination); });
  forth.join();
  back.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(read(*b, b_destination), a_data);
  EXPECT_EQ(read(*a, a_destination), b_data);
  expect_no_leaks(*a, {a_source, a_destination}, "bridge a");
  expect_no_leaks(*b, {b_source, b_destination}, "bridge b");
}

}  // namespace
}  // namespace devbridge::cuda
