// The fake backend on its own: the tool every other core test leans on must
// itself do exactly what it promises.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <set>
#include <stdexcept>
#include <thread>

#include <unistd.h>

#include "support.hpp"
#include "devbridge/backends.hpp"
#include "devbridge/consumer_names.hpp"

namespace devbridge::testing {
namespace {

struct FakeFixture : ::testing::Test {
  FakeBackend fake{1 << 20};
  HostBlock host;
  DeviceAllocation device;

  void SetUp() override {
    host = fake.allocate_host(4096);
    device = fake.allocate(1024, 64);
    fake.clear_calls();
  }
  void TearDown() override {
    fake.quiesce();  // drop what a test left pending, so the free below is not "under a copy"
    fake.free(device);
    fake.free_host(host);
    EXPECT_EQ(fake.live_allocations(), 0u);
    EXPECT_EQ(fake.live_host_blocks(), 0u);
  }

  CopyRequest h2d(CopyMode mode, std::uint64_t host_offset, std::uint64_t device_offset, std::uint64_t len,
                  std::uint64_t id) {
    CopyRequest r;
    r.direction = CopyDirection::HostToDevice;
    r.mode = mode;
    r.event = CopyEvent{7, 1, id};
    r.host = host.data + host_offset;
    r.device = device;
    r.device_offset = device_offset;
    r.len = len;
    return r;
  }
  CopyRequest d2h(CopyMode mode, std::uint64_t host_offset, std::uint64_t device_offset, std::uint64_t len,
                  std::uint64_t id) {
    CopyRequest r = h2d(mode, host_offset, device_offset, len, id);
    r.direction = CopyDirection::DeviceToHost;
    return r;
  }
  std::byte* device_bytes() { return reinterpret_cast<std::byte*>(device.address); }
  void put_host(std::uint64_t offset, const std::vector<std::byte>& data) {
    std::memcpy(host.data + offset, data.data(), data.size());
  }
  std::vector<Completion> drain() {
    std::vector<Completion> out;
    fake.drain_completions(out);
    return out;
  }
};

TEST(FakeNames, CallAndFailureNamesAreSnakeCase) {
  EXPECT_EQ(fake::call_name(Call::Allocate), "allocate");
  EXPECT_EQ(fake::call_name(Call::Free), "free");
  EXPECT_EQ(fake::call_name(Call::AllocateHost), "allocate_host");
  EXPECT_EQ(fake::call_name(Call::FreeHost), "free_host");
  EXPECT_EQ(fake::call_name(Call::CopyHostToDevice), "copy_h2d");
  EXPECT_EQ(fake::call_name(Call::CopyDeviceToHost), "copy_d2h");
  EXPECT_EQ(fake::call_name(Call::Launch), "launch");
  EXPECT_EQ(fake::call_name(Call::ValidateView), "validate_view");
  EXPECT_EQ(fake::call_name(Call::Quiesce), "quiesce");
  EXPECT_EQ(fake::failure_name(Failure::AllocationFailed), "allocation_failed");
  EXPECT_EQ(fake::failure_name(Failure::CopyFailedAtSubmit), "copy_failed_at_submit");
  EXPECT_EQ(fake::failure_name(Failure::CopyFailedAtCompletion), "copy_failed_at_completion");
  EXPECT_EQ(fake::failure_name(Failure::InvalidView), "invalid_view");
  EXPECT_EQ(fake::failure_name(Failure::LostCompletion), "lost_completion");
  EXPECT_EQ(fake::failure_name(Failure::DuplicatedCompletion), "duplicated_completion");
  EXPECT_EQ(fake::failure_name(Failure::LateCompletion), "late_completion");
  EXPECT_EQ(fake::failure_name(Failure::Fatal), "fatal");
}

TEST(FakeDescribe, HostMemoryDeviceWithEveryDType) {
  FakeBackend fake(1 << 20);
  const BackendInfo info = fake.describe();
  EXPECT_EQ(info.name, "fake");
  EXPECT_EQ(info.vendor, "fake");
  EXPECT_EQ(info.device_kind, DeviceKind::Cpu);
  EXPECT_EQ(tinygrad_device(info.device_kind, info.device_ordinal), "CPU");
  EXPECT_EQ(dlpack_device(info.device_kind), DLPackDevice::CPU);
  EXPECT_EQ(info.total_memory, 1u << 20);
  EXPECT_EQ(info.free_memory, 1u << 20);
  EXPECT_EQ(info.dtypes.size(), static_cast<std::size_t>(kDTypeCount));
  EXPECT_TRUE(fake::make_fake_backend() != nullptr);
}

TEST(FakeInject, RefusesFailuresThatCannotApply) {
  FakeBackend fake;
  EXPECT_THROW(fake.inject(Call::Allocate, Failure::InvalidView), std::invalid_argument);
  EXPECT_THROW(fake.inject(Call::Free, Failure::Fatal), std::invalid_argument);
  EXPECT_THROW(fake.inject(Call::ValidateView, Failure::LostCompletion), std::invalid_argument);
  EXPECT_THROW(fake.inject(Call::Allocate, Failure::AllocationFailed, 0), std::invalid_argument);
}

TEST(FakeAllocate, RecordsExactArgumentsAndCountsLiveAllocations) {
  FakeBackend fake(1 << 20);
  const DeviceAllocation a = fake.allocate(256, 128);
  EXPECT_EQ(a.bytes, 256u);
  EXPECT_EQ(a.address % 128, 0u);
  EXPECT_EQ(fake.live_allocations(), 1u);
  EXPECT_EQ(fake.describe().free_memory, (1u << 20) - 256);
  fake.free(a);
  EXPECT_EQ(fake.live_allocations(), 0u);
  const auto calls = fake.calls();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].call, Call::Allocate);
  EXPECT_EQ(calls[0].bytes, 256u);
  EXPECT_EQ(calls[0].alignment, 128u);
  EXPECT_EQ(calls[0].address, a.address);
  EXPECT_EQ(calls[1].call, Call::Free);
  EXPECT_EQ(calls[1].address, a.address);
  EXPECT_EQ(calls[1].bytes, 256u);
}

// A fake streaming for hours made a record per call, kept for ever.
TEST(FakeCalls, TheLogKeepsTheLatestCallsAndCountsThoseItDrops) {
  FakeBackend fake(1 << 20);
  constexpr std::size_t kept = FakeBackend::kKeptCalls;
  const std::uint64_t made = 5 * kept + 3;  // allocates and frees
  for (std::uint64_t i = 0; i < made / 2; ++i) fake.free(fake.allocate(64 + 64 * (i % 4), 64));
  const DeviceAllocation last = fake.allocate(4096, 256);
  const auto calls = fake.calls();
  EXPECT_GE(calls.size(), kept);
  EXPECT_LT(calls.size(), 2 * kept);
  EXPECT_EQ(calls.size() + fake.dropped_calls(), made);
  EXPECT_EQ(calls.back().call, Call::Allocate);  // the newest, whole: its address is set after it is recorded
  EXPECT_EQ(calls.back().bytes, 4096u);
  EXPECT_EQ(calls.back().alignment, 256u);
  EXPECT_EQ(calls.back().address, last.address);
  fake.free(last);
  EXPECT_EQ(fake.live_allocations(), 0u);
}

TEST(FakeAllocate, OutOfMemoryNamesBytesAskedAndFree) {
  FakeBackend fake(1000);
  const std::string message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, fake.allocate(4096, 64));
  EXPECT_NE(message.find("4096"), std::string::npos) << message;
  EXPECT_NE(message.find("1000"), std::string::npos) << message;
  EXPECT_EQ(fake.live_allocations(), 0u);
}

TEST(FakeAllocate, InjectionIsOneShotOnTheNthCall) {
  FakeBackend fake(1 << 20);
  fake.inject(Call::Allocate, Failure::AllocationFailed, 2);
  const DeviceAllocation first = fake.allocate(64, 64);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, fake.allocate(64, 64));
  const DeviceAllocation third = fake.allocate(64, 64);
  EXPECT_EQ(fake.live_allocations(), 2u);
  fake.free(first);
  fake.free(third);
  EXPECT_CALLS(&fake, Call::Allocate, Call::Allocate, Call::Allocate, Call::Free, Call::Free);
}

TEST(FakeAllocate, FatalIsMarkedFatal) {
  FakeBackend fake;
  fake.inject(Call::Allocate, Failure::Fatal);
  try {
    fake.allocate(64, 64);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_TRUE(e.fatal());
    EXPECT_EQ(e.kind(), ErrorKind::AllocationFailed);
  }
  fake.inject(Call::Quiesce, Failure::Fatal);
  try {
    fake.quiesce();
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_TRUE(e.fatal());
  }
}

TEST_F(FakeFixture, SyncCopiesMoveBytesAtSubmit) {
  const auto data = random_bytes(256, 1);
  put_host(100, data);
  fake.submit_copy(h2d(CopyMode::Sync, 100, 64, 256, 1));
  EXPECT_EQ(0, std::memcmp(device_bytes() + 64, data.data(), 256));
  fake.submit_copy(d2h(CopyMode::Sync, 2000, 64, 256, 2));
  EXPECT_EQ(0, std::memcmp(host.data + 2000, data.data(), 256));
  EXPECT_TRUE(drain().empty());
  const auto calls = fake.calls();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0].call, Call::CopyHostToDevice);
  EXPECT_EQ(calls[0].host_offset, 100u);
  EXPECT_EQ(calls[0].device_offset, 64u);
  EXPECT_EQ(calls[0].bytes, 256u);
  EXPECT_EQ(calls[0].mode, CopyMode::Sync);
  EXPECT_EQ(calls[0].address, device.address);
  EXPECT_EQ(calls[1].call, Call::CopyDeviceToHost);
  EXPECT_EQ(calls[1].host_offset, 2000u);
  EXPECT_EQ((calls[1].event), (CopyEvent{7, 1, 2}));
}

TEST_F(FakeFixture, AsyncCopyMovesBytesOnlyWhenCompleted) {
  const auto data = random_bytes(128, 2);
  put_host(0, data);
  const std::vector<std::byte> before(device_bytes(), device_bytes() + 128);
  fake.submit_copy(h2d(CopyMode::Async, 0, 0, 128, 5));
  EXPECT_EQ(fake.pending(), (std::vector<CopyEvent>{{7, 1, 5}}));
  EXPECT_EQ(0, std::memcmp(device_bytes(), before.data(), 128));
  EXPECT_FALSE(fake.wait_for_completions(std::chrono::nanoseconds(0)));
  EXPECT_TRUE(fake.complete(CopyEvent{7, 1, 5}));
  EXPECT_FALSE(fake.complete(CopyEvent{7, 1, 5}));
  EXPECT_TRUE(fake.wait_for_completions(std::chrono::nanoseconds(0)));
  EXPECT_EQ(0, std::memcmp(device_bytes(), data.data(), 128));
  const auto completions = drain();
  ASSERT_EQ(completions.size(), 1u);
  EXPECT_TRUE(completions[0].ok);
  EXPECT_EQ(completions[0].event, (CopyEvent{7, 1, 5}));
  EXPECT_TRUE(fake.pending().empty());
}

TEST_F(FakeFixture, CompleteAllIsOldestFirstAndFailureMovesNothing) {
  put_host(0, random_bytes(64, 3));
  fake.submit_copy(d2h(CopyMode::Async, 0, 0, 64, 1));
  fake.submit_copy(d2h(CopyMode::Async, 64, 0, 64, 2));
  const std::vector<std::byte> before(host.data, host.data + 128);
  EXPECT_EQ(fake.complete_all(false), 2u);
  EXPECT_EQ(0, std::memcmp(host.data, before.data(), 128));
  const auto completions = drain();
  ASSERT_EQ(completions.size(), 2u);
  EXPECT_EQ(completions[0].event.id, 1u);
  EXPECT_EQ(completions[1].event.id, 2u);
  EXPECT_FALSE(completions[0].ok);
  EXPECT_EQ(completions[0].error, ErrorKind::OutputCopyFailed);
  EXPECT_FALSE(completions[0].message.empty());
}

TEST_F(FakeFixture, CopyFailedAtSubmitThrowsTheDirectionsKind) {
  fake.inject(Call::CopyHostToDevice, Failure::CopyFailedAtSubmit);
  fake.inject(Call::CopyDeviceToHost, Failure::CopyFailedAtSubmit);
  const std::vector<std::byte> device_before(device_bytes(), device_bytes() + 64);
  const std::vector<std::byte> host_before(host.data, host.data + 64);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::DeviceCopyFailed, fake.submit_copy(h2d(CopyMode::Sync, 0, 0, 64, 1)));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OutputCopyFailed, fake.submit_copy(d2h(CopyMode::Async, 0, 0, 64, 2)));
  EXPECT_EQ(0, std::memcmp(device_bytes(), device_before.data(), 64));
  EXPECT_EQ(0, std::memcmp(host.data, host_before.data(), 64));
  EXPECT_TRUE(fake.pending().empty());
  EXPECT_CALLS(&fake, Call::CopyHostToDevice, Call::CopyDeviceToHost);
}

TEST_F(FakeFixture, CopyFailedAtCompletionReportsFailureWithoutMovingBytes) {
  put_host(0, random_bytes(64, 4));
  fake.inject(Call::CopyHostToDevice, Failure::CopyFailedAtCompletion);
  const std::vector<std::byte> before(device_bytes(), device_bytes() + 64);
  fake.submit_copy(h2d(CopyMode::Async, 0, 0, 64, 1));
  EXPECT_TRUE(fake.complete(CopyEvent{7, 1, 1}, /*ok=*/true));
  EXPECT_EQ(0, std::memcmp(device_bytes(), before.data(), 64));
  const auto completions = drain();
  ASSERT_EQ(completions.size(), 1u);
  EXPECT_FALSE(completions[0].ok);
  EXPECT_EQ(completions[0].error, ErrorKind::DeviceCopyFailed);
}

TEST_F(FakeFixture, LostAndDuplicatedCompletions) {
  put_host(0, random_bytes(64, 5));
  fake.inject(Call::CopyHostToDevice, Failure::LostCompletion, 1);
  fake.inject(Call::CopyHostToDevice, Failure::DuplicatedCompletion, 2);
  fake.submit_copy(h2d(CopyMode::Async, 0, 0, 64, 1));
  fake.submit_copy(h2d(CopyMode::Async, 0, 64, 64, 2));
  EXPECT_EQ(fake.complete_all(), 2u);
  const auto completions = drain();
  ASSERT_EQ(completions.size(), 2u);
  EXPECT_EQ(completions[0].event.id, 2u);
  EXPECT_EQ(completions[1].event.id, 2u);
  // The lost copy still happened on the device.
  EXPECT_EQ(0, std::memcmp(device_bytes(), host.data, 64));
}

TEST_F(FakeFixture, QuiesceDropsPendingCopiesButLateCompletionSurvives) {
  put_host(0, random_bytes(128, 6));
  const std::vector<std::byte> before(device_bytes(), device_bytes() + 128);
  fake.inject(Call::CopyHostToDevice, Failure::LateCompletion, 2);
  fake.submit_copy(h2d(CopyMode::Async, 0, 0, 64, 1));    // dropped
  fake.submit_copy(h2d(CopyMode::Async, 64, 64, 64, 2));  // late
  fake.quiesce();
  EXPECT_TRUE(fake.pending().empty());
  EXPECT_EQ(0, std::memcmp(device_bytes(), before.data(), 64)) << "a cancelled copy moved bytes";
  EXPECT_EQ(0, std::memcmp(device_bytes() + 64, host.data + 64, 64)) << "the late copy finished at quiesce";
  // Held back past the quiesce (and past any drain right after it) ...
  EXPECT_TRUE(drain().empty());
  EXPECT_FALSE(fake.wait_for_completions(std::chrono::nanoseconds(0)));
  // ... until new work is submitted: then it lands among the new completions.
  fake.submit_copy(h2d(CopyMode::Async, 0, 0, 64, 3));
  EXPECT_TRUE(fake.wait_for_completions(std::chrono::nanoseconds(0)));
  const auto completions = drain();
  ASSERT_EQ(completions.size(), 1u);
  EXPECT_EQ(completions[0].event.id, 2u);
  EXPECT_TRUE(drain().empty());
  EXPECT_EQ(fake.pending(), (std::vector<CopyEvent>{{7, 1, 3}}));
  EXPECT_CALLS(&fake, Call::CopyHostToDevice, Call::CopyHostToDevice, Call::Quiesce, Call::CopyHostToDevice);
}

TEST_F(FakeFixture, AutoCompleteReportsAtSubmit) {
  put_host(0, random_bytes(64, 7));
  fake.set_auto_complete(true);
  fake.submit_copy(h2d(CopyMode::Async, 0, 0, 64, 1));
  EXPECT_TRUE(fake.pending().empty());
  EXPECT_EQ(0, std::memcmp(device_bytes(), host.data, 64));
  EXPECT_EQ(drain().size(), 1u);
}

TEST_F(FakeFixture, ForgedCompletionIsDeliveredAsIs) {
  fake.report_completion(CopyEvent{1, 2, 3}, false);
  const auto completions = drain();
  ASSERT_EQ(completions.size(), 1u);
  EXPECT_EQ(completions[0].event, (CopyEvent{1, 2, 3}));
  EXPECT_FALSE(completions[0].ok);
}

TEST_F(FakeFixture, RangesOutsideTheAllocationAreCaughtNotCopied) {
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, fake.submit_copy(h2d(CopyMode::Sync, 0, 1000, 64, 1)));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, fake.submit_copy(h2d(CopyMode::Sync, 0, UINT64_MAX, 2, 2)));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, fake.submit_copy(h2d(CopyMode::Sync, 4090, 0, 64, 3)));
}

TEST_F(FakeFixture, ValidateViewInjection) {
  TensorView view;
  fake.validate_view(device, view);
  fake.inject(Call::ValidateView, Failure::InvalidView);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, fake.validate_view(device, view));
  fake.validate_view(device, view);
  EXPECT_CALLS(&fake, Call::ValidateView, Call::ValidateView, Call::ValidateView);
}

TEST_F(FakeFixture, LaunchAxpyComputesOverRealMemory) {
  const DeviceAllocation y = fake.allocate(64, 64);
  float x_values[16];
  for (int i = 0; i < 16; ++i) x_values[i] = static_cast<float>(i) * 1.5f - 3.0f;
  std::memcpy(device_bytes(), x_values, sizeof x_values);
  fake.launch_axpy(AxpyLaunch{device, 0, y, 0, 16, 2.0f, 0.5f});
  float y_values[16];
  std::memcpy(y_values, reinterpret_cast<const void*>(y.address), sizeof y_values);
  for (int i = 0; i < 16; ++i) EXPECT_FLOAT_EQ(y_values[i], 2.0f * x_values[i] + 0.5f);
  fake.free(y);
}

TEST_F(FakeFixture, WaitForCompletionsWakesOnAnotherThreadsCompletion) {
  put_host(0, random_bytes(64, 8));
  fake.submit_copy(h2d(CopyMode::Async, 0, 0, 64, 1));
  std::thread completer([&] { fake.complete(CopyEvent{7, 1, 1}); });
  while (!fake.wait_for_completions(std::chrono::milliseconds(50))) {
  }
  completer.join();
  EXPECT_EQ(drain().size(), 1u);
}

// ---- Backing::None: bookkeeping only ----

// This process's resident memory now (/proc/self/statm), in bytes.
std::uint64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::uint64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
}

constexpr std::uint64_t kGiB = 1ull << 30;

TEST(FakeWithoutBacking, AllocationsAreAddressRangesWithNoMemoryBehindThem) {
  FakeBackend fake(80 * kGiB, {}, fake::Backing::None);
  const auto before = resident_bytes();
  const DeviceAllocation a = fake.allocate(40 * kGiB, 256);
  const DeviceAllocation b = fake.allocate(40 * kGiB - 4096, 1 << 21);
  // 80 GiB live, and the process holds no more than it did (a few pages of bookkeeping at most).
  EXPECT_LT(resident_bytes(), before + (64ull << 20)) << "no host memory behind the allocations";
  EXPECT_EQ(fake.live_allocations(), 2u);
  EXPECT_EQ(fake.describe().free_memory, 4096u);
  EXPECT_NE(a.address, 0u);
  EXPECT_EQ(a.address % 256, 0u);
  EXPECT_EQ(b.address % (1 << 21), 0u) << "aligned as asked";
  EXPECT_TRUE(a.address + a.bytes <= b.address || b.address + b.bytes <= a.address) << "ranges never overlap";
  // What memory_bytes allows is enforced as before.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationFailed, fake.allocate(8192, 64));
  // Parts are ranges inside their whole.
  const DeviceAllocation part = fake.make_part(a, 1024, 512);
  EXPECT_EQ(part.address, a.address + 1024);
  EXPECT_EQ(fake.live_parts(), 1u);
  fake.release_part(part);
  fake.free(a);
  fake.free(b);
  EXPECT_EQ(fake.live_allocations(), 0u);
  EXPECT_EQ(fake.describe().free_memory, 80 * kGiB);
  // Freed ranges are not handed out again: every allocation's address is its own.
  std::set<std::uint64_t> addresses;
  for (int i = 0; i < 100; ++i) {
    const auto c = fake.allocate(kGiB, 64);
    EXPECT_TRUE(addresses.insert(c.address).second);
    fake.free(c);
  }
  EXPECT_NE(fake.describe().notes.find("backing=none"), std::string::npos) << fake.describe().notes;
}

TEST(FakeWithoutBacking, AnythingThatWouldTouchTheBytesIsRefused) {
  FakeBackend fake(1 << 30, {}, fake::Backing::None);
  const HostBlock host = fake.allocate_host(4096);  // the ring stays real memory
  std::memset(host.data, 1, 4096);
  const DeviceAllocation device = fake.allocate(4096, 64);
  CopyRequest r;
  r.direction = CopyDirection::HostToDevice;
  r.mode = CopyMode::Sync;
  r.event = CopyEvent{7, 1, 1};
  r.host = host.data;
  r.device = device;
  r.len = 64;
  auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unsupported, fake.submit_copy(r));
  EXPECT_NE(message.find("no memory behind it"), std::string::npos) << message;
  r.mode = CopyMode::Async;
  r.direction = CopyDirection::DeviceToHost;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unsupported, fake.submit_copy(r));
  EXPECT_TRUE(fake.pending().empty()) << "refused at submit, never pending";
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unsupported, fake.validate_view(device, TensorView{}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unsupported, fake.launch_axpy(AxpyLaunch{device, 0, device, 0, 16, 1.0f, 0.0f}));
  FakeBackend peer(1 << 20);
  const DeviceAllocation backed = peer.allocate(4096, 64);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unsupported, fake.copy_to_peer(device, 0, peer, backed, 0, 64));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unsupported, peer.copy_to_peer(backed, 0, fake, device, 0, 64));
  for (int i = 0; i < 4096; ++i) ASSERT_EQ(host.data[i], std::byte{1}) << "nothing was written at " << i;
  peer.free(backed);
  fake.free(device);
  fake.free_host(host);
  EXPECT_EQ(fake.live_allocations(), 0u);
  EXPECT_EQ(fake.live_host_blocks(), 0u);
}

TEST(FakeWithoutBacking, TheFactoryTakesBackingNoneAndABridgeReplaysOnIt) {
  // What `devbridge trace replay` does: allocations and frees through the
  // caching pool of a bridge on an 80 GiB fake, in a few kilobytes.
  const auto before = resident_bytes();
  Bridge bridge(make_backend("fake", {{"memory_bytes", std::to_string(80 * kGiB)}, {"backing", "none"}}),
                BridgeOptions{.ring_bytes = 1 << 16, .caching_pool = CachingPool::On});
  const ObjectSpec spec{16 * kGiB, 256, std::nullopt, ShapeKind::Vector};
  const auto big = bridge.alloc_device(spec, 16 * kGiB);
  const auto other = bridge.alloc_device(spec, 16 * kGiB);
  EXPECT_LT(resident_bytes(), before + (64ull << 20)) << "32 GiB allocated, no host memory behind it";
  EXPECT_EQ(bridge.memory_stats().allocated_bytes, 32 * kGiB);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::Unsupported, bridge.view(big, ViewSpec{DType::UInt8, Dims{16}, std::nullopt, 0}));
  bridge.free_device(big);
  const auto again = bridge.alloc_device(spec, 16 * kGiB);
  EXPECT_EQ(bridge.memory_stats().cache_hits, 1u) << "16 GiB reused from the cache";
  const auto small = bridge.alloc_device(spec, 4096);  // a part of a split segment
  for (const auto& h : {again, other, small}) bridge.free_device(h);
  EXPECT_EQ(bridge.memory_stats().allocated_bytes, 0u);
  // Anything but host or none is refused, naming the option.
  try {
    make_backend("fake", {{"backing", "disk"}});
    ADD_FAILURE() << "backing=disk accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Unsupported);
    EXPECT_NE(std::string(e.what()).find("backing"), std::string::npos) << e.what();
  }
  FakeBackend* host_backed = nullptr;
  auto backend = make_backend("fake", {{"backing", "host"}});
  host_backed = backend->test_controls()->fake();
  ASSERT_NE(host_backed, nullptr);
  const auto a = host_backed->allocate(64, 64);
  EXPECT_EQ(*reinterpret_cast<const std::byte*>(a.address), std::byte{0xA5}) << "real memory, filled";
  host_backed->free(a);
}

// ---- free: no scan of every live allocation ----

TEST(FakeFree, StillWarnsAboutALivePartOrACopyInFlightAndOnlyThen) {
  FakeBackend fake(1 << 24);
  const HostBlock host = fake.allocate_host(4096);
  const DeviceAllocation whole = fake.allocate(4096, 512);
  const DeviceAllocation part = fake.make_part(whole, 512, 512);
  const DeviceAllocation copied = fake.allocate(4096, 64);
  const DeviceAllocation quiet = fake.allocate(4096, 64);
  CopyRequest r;
  r.direction = CopyDirection::HostToDevice;
  r.mode = CopyMode::Async;
  r.event = CopyEvent{7, 1, 42};
  r.host = host.data;
  r.device = copied;
  r.len = 64;
  fake.submit_copy(r);
  ::testing::internal::CaptureStderr();
  fake.free(quiet);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "") << "nothing to warn about";
  ::testing::internal::CaptureStderr();
  fake.free(whole);
  fake.free(copied);
  const auto warnings = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warnings.find("freed while its part"), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("freed while copy event {domain 7, generation 1, id 0x2a} is in flight"), std::string::npos)
      << warnings;
  fake.release_part(part);
  // A copy completed (or dropped by quiesce) no longer counts against its allocation.
  const DeviceAllocation again = fake.allocate(4096, 64);
  r.device = again;
  r.event.id = 43;
  fake.submit_copy(r);
  r.event.id = 44;
  fake.submit_copy(r);
  EXPECT_TRUE(fake.complete(CopyEvent{7, 1, 43}));
  fake.quiesce();
  const DeviceAllocation whole_again = fake.allocate(4096, 512);
  fake.release_part(fake.make_part(whole_again, 0, 512));
  ::testing::internal::CaptureStderr();
  fake.free(again);
  fake.free(whole_again);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  fake.free_host(host);
  EXPECT_EQ(fake.live_allocations(), 0u);
  EXPECT_EQ(fake.live_parts(), 0u);
}

TEST(FakeFree, TearingDownManyLiveAllocationsFreesEachOnce) {
  // A free used to look through every live allocation and pending copy:
  // tearing down n live allocations was O(n^2) (40,000 took 15 s in a
  // replay). 200,000 here: seconds, not hours, without a time limit asserted.
  constexpr std::size_t kLive = 200000;
  FakeBackend fake(1ull << 40);
  std::vector<DeviceAllocation> live;
  live.reserve(kLive);
  for (std::size_t i = 0; i < kLive; ++i) live.push_back(fake.allocate(256, 256));
  EXPECT_EQ(fake.live_allocations(), kLive);
  for (const auto& a : live) fake.free(a);
  EXPECT_EQ(fake.live_allocations(), 0u);
  // The log keeps the latest calls (FakeCalls): all allocates came first, so
  // it ends in frees, each of a different allocation.
  const auto calls = fake.calls();
  EXPECT_EQ(calls.size() + fake.dropped_calls(), 2 * kLive);
  std::set<std::uint64_t> freed;
  for (const RecordedCall& c : calls) {
    if (c.call == Call::Free) {
      EXPECT_TRUE(freed.insert(c.address).second) << "freed twice: " << c.address;
    }
  }
  EXPECT_EQ(freed.size(), std::min(calls.size(), kLive));
}

}  // namespace
}  // namespace devbridge::testing
