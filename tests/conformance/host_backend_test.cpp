// The host backend's own promises, below the bridge: what it describes, real
// aligned memory, the ring's page-locking (and the note when it is refused),
// allocation failures that name their size, the engine's ordering of copies
// and launches by bytes, and its fences.
// What every backend must do lives in conformance_test.cpp.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backends/host/copy_engine.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/backends/host.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/consumer_names.hpp"

namespace devbridge {
namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

std::vector<std::byte> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; i += 8) {
    const std::uint64_t word = rng();
    std::memcpy(out.data() + i, &word, std::min<std::size_t>(8, n - i));
  }
  return out;
}

std::string cpuinfo_model_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      auto value = line.substr(line.find(':') + 1);
      value.erase(0, value.find_first_not_of(" \t"));
      return value;
    }
  }
  return {};
}

std::byte* at(const DeviceAllocation& a, std::uint64_t offset = 0) {
  return reinterpret_cast<std::byte*>(a.address) + offset;
}

CopyRequest copy(CopyDirection direction, CopyMode mode, std::uint64_t id, std::byte* host,
                 const DeviceAllocation& device, std::uint64_t device_offset, std::uint64_t len) {
  return CopyRequest{direction, mode, CopyEvent{1, 1, id}, host, device, device_offset, len, CopyLayout{}};
}

// Drains until `count` completions have arrived.
std::vector<Completion> drain(Backend& backend, std::size_t count) {
  std::vector<Completion> out;
  while (out.size() < count) {
    backend.wait_for_completions(std::chrono::milliseconds(100));
    backend.drain_completions(out);
  }
  return out;
}

TEST(HostBackend, DescribesTheCpu) {
  auto backend = host::make_host_backend();
  auto info = backend->describe();
  EXPECT_EQ(info.name, "host");
  EXPECT_EQ(info.vendor, "cpu");
  EXPECT_EQ(info.device_kind, DeviceKind::Cpu);
  EXPECT_EQ(tinygrad_device(info.device_kind, info.device_ordinal), "CPU");
  EXPECT_EQ(dlpack_device(info.device_kind), DLPackDevice::CPU);
  EXPECT_EQ(info.device_ordinal, 0);
  EXPECT_FALSE(info.device_name.empty());
  if (const auto model = cpuinfo_model_name(); !model.empty()) {
    EXPECT_EQ(info.device_name, model);
  }
  EXPECT_GT(info.total_memory, 0u);
  EXPECT_GT(info.free_memory, 0u);
  EXPECT_LE(info.free_memory, info.total_memory);
  EXPECT_EQ(info.dtypes.size(), static_cast<std::size_t>(kDTypeCount));
  EXPECT_FALSE(info.host_memory_page_locked) << "no ring yet";
  EXPECT_NE(info.notes.find("no host ring"), std::string::npos) << info.notes;

  const auto block = backend->allocate_host(1 << 20);
  info = backend->describe();
  EXPECT_EQ(info.host_memory_page_locked, block.page_locked);
  EXPECT_NE(info.notes.find("mlock"), std::string::npos) << info.notes;
  backend->free_host(block);
}

TEST(HostBackend, AllocationsAreAlignedWritableMemory) {
  auto backend = host::make_host_backend();
  std::vector<DeviceAllocation> allocations;
  for (const std::uint64_t alignment : {1, 8, 64, 256, 4096, 1 << 16}) {
    const auto a = backend->allocate(1000 + alignment, alignment);
    EXPECT_EQ(a.address % std::max<std::uint64_t>(alignment, 64), 0u) << "alignment " << alignment;
    EXPECT_EQ(a.bytes, 1000 + alignment);
    std::memset(at(a), 0x3c, a.bytes);  // real memory: writable end to end
    allocations.push_back(a);
  }
  EXPECT_EQ(backend->test_controls()->live_allocations(), allocations.size());
  for (const auto& a : allocations) backend->free(a);
  EXPECT_EQ(backend->test_controls()->live_allocations(), 0u);
}

// The backend keeps no cache of its own (the bridge's pool keeps freed
// memory warm, where memory_stats shows it): a freed block goes back to the C
// library at once, and live_bytes counts exactly what is live.
TEST(HostBackend, AFreedBlockGoesBackAtOnceAndLiveBytesCountWhatIsLive) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kBlock = 8u << 20;
  EXPECT_TRUE(backend->describe().caches_allocations) << "the bridge's pool keeps freed blocks warm";
  EXPECT_EQ(backend->describe().pool_cap_bytes, 512u << 20);
  const auto first = backend->allocate(kBlock, 256);
  EXPECT_EQ(first.address % (2u << 20), 0u);  // huge-page aligned from 4 MiB up
  std::memset(at(first), 0x5a, kBlock);
  const auto small = backend->allocate(4096, 64);
  EXPECT_EQ(*backend->test_controls()->live_bytes(), kBlock + 4096);
  backend->free(first);
  EXPECT_EQ(backend->test_controls()->live_allocations(), 1u);
  EXPECT_EQ(*backend->test_controls()->live_bytes(), 4096u) << "nothing of the freed block is held";
  backend->free(small);
  EXPECT_EQ(*backend->test_controls()->live_bytes(), 0u);
  EXPECT_EQ(backend->test_controls()->live_allocations(), 0u);
}

TEST(HostBackend, AllocationFailureNamesBytesAskedAndFree) {
  if (kSanitized) {
    GTEST_SKIP() << "sanitizer allocators abort on a 1 EiB request instead of returning ENOMEM";
  }
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kHuge = 1ull << 60;
  try {
    backend->allocate(kHuge, 64);
    FAIL() << "a 1 EiB allocation succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::AllocationFailed);
    const std::string message(e.message());
    EXPECT_NE(message.find(std::to_string(kHuge)), std::string::npos) << message;
    // Refused before anything is mapped: more than the machine has.
    EXPECT_NE(message.find("the machine has"), std::string::npos) << message;
    EXPECT_NE(message.find("available"), std::string::npos) << message;
  }
  EXPECT_EQ(backend->test_controls()->live_allocations(), 0u);
  try {
    backend->allocate(64, 3);
    FAIL() << "alignment 3 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidAlignment);
  }
}

// MemAvailable plus SwapFree, from /proc/meminfo: what the machine can back now.
std::uint64_t memory_the_machine_has() {
  std::ifstream in("/proc/meminfo");
  std::uint64_t total = 0;
  for (std::string line; std::getline(in, line);) {
    for (const char* key : {"MemAvailable:", "SwapFree:"}) {
      if (line.rfind(key, 0) == 0) total += std::stoull(line.substr(std::strlen(key))) * 1024;
    }
  }
  return total;
}

// An allocation or a ring past what the machine can back was mapped anyway
// (overcommit), and the process killed once its pages were touched: the
// fake fills its memory at once, and mlock touches a ring's. Refused first,
// with AllocationFailed naming the figures; nothing is left allocated.
TEST(HostBackend, MemoryPastWhatTheMachineHasIsRefusedBeforeAnythingIsTouched) {
  const std::uint64_t has = memory_the_machine_has();
  ASSERT_GT(has, 0u);
  const std::uint64_t asked = has + (4ull << 30);
  auto host = host::make_host_backend();
  fake::FakeBackend fake(1ull << 50);
  const std::function<void()> attempts[] = {[&] { host->allocate(asked, 64); }, [&] { host->allocate_host(asked); },
                                            [&] { fake.allocate(asked, 64); }, [&] { fake.allocate_host(asked); }};
  for (const auto& attempt : attempts) {
    try {
      attempt();
      ADD_FAILURE() << asked << " bytes were given";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::AllocationFailed);
      const std::string message(e.message());
      EXPECT_NE(message.find(std::to_string(asked)), std::string::npos) << message;
      EXPECT_NE(message.find("the machine has"), std::string::npos) << message;
    }
  }
  EXPECT_EQ(host->test_controls()->live_allocations(), 0u);
  EXPECT_EQ(*host->test_controls()->live_host_blocks(), 0u);
  EXPECT_EQ(fake.live_allocations(), 0u);
  EXPECT_EQ(fake.live_host_blocks(), 0u);
}

TEST(HostBackend, HostBlocksArePageAlignedAndCounted) {
  auto backend = host::make_host_backend();
  const auto block = backend->allocate_host(10000);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block.data) % static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE)), 0u);
  EXPECT_EQ(block.bytes, 10000u);
  std::memset(block.data, 0x77, block.bytes);
  EXPECT_EQ(*backend->test_controls()->live_host_blocks(), 1u);
  backend->free_host(block);
  EXPECT_EQ(*backend->test_controls()->live_host_blocks(), 0u);
}

// Where mlock is refused the ring still works; describe() says why. The child
// drops the privilege to lock memory (RLIMIT_MEMLOCK 0, and root gives up its
// uid, which drops CAP_IPC_LOCK).
// Runs in a death-test child: exits 0 when the refusal is reported.
[[noreturn]] void allocate_ring_without_mlock_privilege() {
  const rlimit none{0, 0};
  if (setrlimit(RLIMIT_MEMLOCK, &none) != 0) _exit(2);
  if (geteuid() == 0 && setuid(65534) != 0) _exit(3);
  auto backend = host::make_host_backend();
  const auto block = backend->allocate_host(4 << 20);
  std::memset(block.data, 1, block.bytes);
  const auto info = backend->describe();
  const bool reported = !block.page_locked && !info.host_memory_page_locked &&
                        info.notes.find("mlock failed") != std::string::npos &&
                        info.notes.find("RLIMIT_MEMLOCK=") != std::string::npos;
  if (!reported) {
    std::fprintf(stderr, "page_locked=%d notes=%s\n", block.page_locked, info.notes.c_str());
    _exit(1);
  }
  backend->free_host(block);
  _exit(0);
}

TEST(HostBackend, RefusedMlockIsReportedNotThrown) {
  if (kSanitized) {
    GTEST_SKIP() << "sanitizers intercept mlock and report success without locking anything";
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(allocate_ring_without_mlock_privilege(), ::testing::ExitedWithCode(0), "");
}

TEST(HostBackend, HeldCopiesStayQueuedUntilQuiesce) {
  auto backend = host::make_host_backend();
  const auto device = backend->allocate(4096, 64);
  const auto block = backend->allocate_host(4096);
  const auto data = random_bytes(4096, 1);
  std::memcpy(block.data, data.data(), data.size());
  std::memset(at(device), 0, 4096);

  backend->test_controls()->hold_copies(true);
  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, block.data, device, 0, 4096));
  std::vector<Completion> out;
  // Nothing can complete while held, so this wait can only time out.
  EXPECT_FALSE(backend->wait_for_completions(std::chrono::milliseconds(5)));
  backend->drain_completions(out);
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(std::to_integer<int>(*at(device)), 0) << "a held copy moved bytes";

  backend->quiesce();  // lifts the hold and finishes the copy
  backend->drain_completions(out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(out[0].ok);
  EXPECT_EQ(out[0].event.id, 1u);
  EXPECT_EQ(std::memcmp(at(device), data.data(), 4096), 0);
  backend->free(device);
  backend->free_host(block);
}

// Completions come back in submission order per direction, and a download
// queued behind an upload of the same bytes waits for it even though the two
// run on different engine threads.
TEST(HostBackend, EngineOrdersByDirectionAndByBytes) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kChunk = 1 << 20;
  constexpr int kChunks = 16;
  const auto device = backend->allocate(kChunk * kChunks, 64);
  const auto block = backend->allocate_host(2 * kChunk * kChunks);
  const auto data = random_bytes(kChunk * kChunks, 2);
  std::memcpy(block.data, data.data(), data.size());
  std::byte* out = block.data + kChunk * kChunks;
  std::memset(out, 0x5a, kChunk * kChunks);

  backend->test_controls()->hold_copies(true);  // everything queued before anything runs
  for (int i = 0; i < kChunks; ++i) {
    backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 100 + i, block.data + i * kChunk, device,
                              i * kChunk, kChunk));
    backend->submit_copy(copy(CopyDirection::DeviceToHost, CopyMode::Async, 200 + i, out + i * kChunk, device,
                              i * kChunk, kChunk));
  }
  backend->test_controls()->hold_copies(false);
  const auto completions = drain(*backend, 2 * kChunks);
  std::vector<std::uint64_t> uploads, downloads;
  for (const auto& c : completions) {
    EXPECT_TRUE(c.ok);
    (c.event.id < 200 ? uploads : downloads).push_back(c.event.id);
  }
  EXPECT_TRUE(std::is_sorted(uploads.begin(), uploads.end()));
  EXPECT_TRUE(std::is_sorted(downloads.begin(), downloads.end()));
  EXPECT_EQ(std::memcmp(out, data.data(), data.size()), 0) << "a download overtook the upload of its bytes";
  backend->free(device);
  backend->free_host(block);
}

// A sync copy runs on the caller's thread, yet after earlier async copies of
// the same bytes (read after write, and write after read).
TEST(HostBackend, SyncCopiesOrderAfterEarlierAsyncCopiesOfTheirBytes) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kLen = 32 << 20;
  const auto device = backend->allocate(kLen, 64);
  const auto block = backend->allocate_host(3 * kLen);
  const auto first = random_bytes(kLen, 3);
  const auto second = random_bytes(kLen, 4);
  std::byte* in1 = block.data;
  std::byte* in2 = block.data + kLen;
  std::byte* out = block.data + 2 * kLen;
  std::memcpy(in1, first.data(), kLen);
  std::memcpy(in2, second.data(), kLen);

  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, in1, device, 0, kLen));
  backend->submit_copy(copy(CopyDirection::DeviceToHost, CopyMode::Sync, 2, out, device, 0, kLen));
  EXPECT_EQ(std::memcmp(out, first.data(), kLen), 0) << "sync download overtook an async upload";

  backend->submit_copy(copy(CopyDirection::DeviceToHost, CopyMode::Async, 3, out, device, 0, kLen));
  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Sync, 4, in2, device, 0, kLen));
  drain(*backend, 2);
  EXPECT_EQ(std::memcmp(out, first.data(), kLen), 0) << "sync upload overwrote bytes an earlier download read";
  EXPECT_EQ(std::memcmp(at(device), second.data(), kLen), 0);
  backend->free(device);
  backend->free_host(block);
}

// A small async copy on an idle engine runs at once on the caller: its
// completion is there to drain as soon as submit returns.
TEST(HostBackend, SmallCopyOnAnIdleEngineCompletesAtSubmit) {
  auto backend = host::make_host_backend();
  const auto device = backend->allocate(4096, 64);
  const auto block = backend->allocate_host(4096);
  const auto data = random_bytes(4096, 6);
  std::memcpy(block.data, data.data(), data.size());
  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, block.data, device, 0, 4096));
  std::vector<Completion> out;
  backend->drain_completions(out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].event.id, 1u);
  EXPECT_EQ(std::memcmp(at(device), data.data(), 4096), 0);
  backend->free(device);
  backend->free_host(block);
}

// ...but never ahead of queued work it must follow: behind a copy in its own
// direction, or behind a copy of the other direction that touches its bytes.
TEST(HostBackend, SmallCopiesNeverOvertakeQueuedWork) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kBig = 32 << 20;
  constexpr std::uint64_t kSmall = 4096;
  const auto device = backend->allocate(kBig, 64);
  const auto block = backend->allocate_host(2 * kBig + kSmall);
  std::byte* big_in = block.data;
  std::byte* big_out = block.data + kBig;
  std::byte* small_in = block.data + 2 * kBig;
  const auto old_bytes = random_bytes(kBig, 7);
  const auto new_bytes = random_bytes(kSmall, 8);
  std::memcpy(big_in, old_bytes.data(), kBig);
  std::memcpy(small_in, new_bytes.data(), kSmall);

  // Same direction: the small upload completes after the big one.
  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, big_in, device, 0, kBig));
  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 2, small_in, device, 0, kSmall));
  auto completions = drain(*backend, 2);
  EXPECT_EQ(completions[0].event.id, 1u);
  EXPECT_EQ(completions[1].event.id, 2u);
  EXPECT_EQ(std::memcmp(at(device), new_bytes.data(), kSmall), 0) << "the later small upload must land last";

  // Other direction, same bytes: a small upload into the tail of a big
  // download's range waits for the download (which reaches the tail last).
  std::memcpy(at(device), old_bytes.data(), kBig);
  backend->submit_copy(copy(CopyDirection::DeviceToHost, CopyMode::Async, 3, big_out, device, 0, kBig));
  backend->submit_copy(
      copy(CopyDirection::HostToDevice, CopyMode::Async, 4, small_in, device, kBig - kSmall, kSmall));
  drain(*backend, 2);
  EXPECT_EQ(std::memcmp(big_out, old_bytes.data(), kBig), 0) << "a small upload overtook the download of its bytes";
  EXPECT_EQ(std::memcmp(at(device, kBig - kSmall), new_bytes.data(), kSmall), 0);
  backend->free(device);
  backend->free_host(block);
}

// With inline copies off, every async copy goes through the engine threads.
TEST(HostBackend, EngineOnlyModeStillCompletesSmallCopies) {
  auto backend = host::make_host_backend(host::Options{.inline_async_max_bytes = 0});
  const auto device = backend->allocate(4096, 64);
  const auto block = backend->allocate_host(4096);
  const auto data = random_bytes(4096, 9);
  std::memcpy(block.data, data.data(), data.size());
  for (std::uint64_t id = 1; id <= 100; ++id) {
    backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, id, block.data, device, 0, 4096));
    const auto completions = drain(*backend, 1);
    ASSERT_EQ(completions.size(), 1u);
    EXPECT_EQ(completions[0].event.id, id);
  }
  EXPECT_EQ(std::memcmp(at(device), data.data(), 4096), 0);
  EXPECT_EQ(backend->describe().notes.find("run on the caller"), std::string::npos);
  backend->free(device);
  backend->free_host(block);
}

// ---- launches: queued like a kernel, done at their fence ----

constexpr auto kForever = std::chrono::nanoseconds::max();

std::vector<float> random_floats(std::size_t n, std::uint32_t seed) {
  std::vector<float> values(n);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-10.0f, 10.0f);
  for (auto& v : values) v = dist(rng);
  return values;
}

// How many of the x.size() floats at `y` are not a * x[i] + b.
std::size_t wrong_axpy(const std::byte* y, const std::vector<float>& x, float a, float b) {
  std::vector<float> result(x.size());
  std::memcpy(result.data(), y, x.size() * sizeof(float));
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < x.size(); ++i) wrong += result[i] != a * x[i] + b;
  return wrong;
}

TEST(HostBackend, AxpyWaitsForTheUploadIntoX) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kCount = 4 << 20;
  constexpr std::uint64_t kBytes = kCount * sizeof(float);
  const auto x = backend->allocate(kBytes, 64);
  const auto y = backend->allocate(kBytes, 64);
  const auto block = backend->allocate_host(kBytes);
  const auto values = random_floats(kCount, 5);
  std::memcpy(block.data, values.data(), kBytes);
  std::memset(at(x), 0, kBytes);

  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, block.data, x, 0, kBytes));
  const Fence fence = backend->launch_axpy(AxpyLaunch{x, 0, y, 0, kCount, 3.0f, 0.5f});
  EXPECT_TRUE(fence.pending()) << "a 16 MiB launch behind a queued upload cannot have run inline";
  ASSERT_TRUE(backend->wait_fence(fence, kForever));
  EXPECT_TRUE(backend->fence_passed(fence));
  backend->release_fence(fence);
  EXPECT_EQ(wrong_axpy(at(y), values, 3.0f, 0.5f), 0u);
  EXPECT_THROW(backend->launch_axpy(AxpyLaunch{x, 4, y, 0, kCount, 1.0f, 0.0f}), Error);
  drain(*backend, 1);
  backend->free(x);
  backend->free(y);
  backend->free_host(block);
}

// The same with everything queued before anything runs: the launch's lane
// must wait for the upload's, not merely find it done.
TEST(HostBackend, HeldLaunchAfterAHeldUploadIntoXSeesTheUploadedBytes) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kCount = 1024;  // small enough to run inline, were it allowed
  constexpr std::uint64_t kBytes = kCount * sizeof(float);
  const auto x = backend->allocate(kBytes, 64);
  const auto y = backend->allocate(kBytes, 64);
  const auto block = backend->allocate_host(kBytes);
  const auto values = random_floats(kCount, 11);
  std::memcpy(block.data, values.data(), kBytes);
  std::memset(at(x), 0, kBytes);

  backend->test_controls()->hold_copies(true);
  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, block.data, x, 0, kBytes));
  const Fence fence = backend->launch_axpy(AxpyLaunch{x, 0, y, 0, kCount, -2.0f, 1.0f});
  ASSERT_TRUE(fence.pending());
  backend->test_controls()->hold_copies(false);
  ASSERT_TRUE(backend->wait_fence(fence, kForever));
  EXPECT_EQ(wrong_axpy(at(y), values, -2.0f, 1.0f), 0u);
  drain(*backend, 1);
  backend->free(x);
  backend->free(y);
  backend->free_host(block);
}

// The use-after-free the old design allowed: a launch used to be "done" when
// its call returned. Held, it has not even started, and its fence says so.
TEST(HostBackend, HeldLaunchFencePendsUntilTheHoldIsLifted) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kCount = 256;
  const auto x = backend->allocate(kCount * sizeof(float), 64);
  const auto y = backend->allocate(kCount * sizeof(float), 64);
  const auto values = random_floats(kCount, 12);
  std::memcpy(at(x), values.data(), kCount * sizeof(float));
  std::memset(at(y), 0, kCount * sizeof(float));

  backend->test_controls()->hold_copies(true);
  const Fence fence = backend->launch_axpy(AxpyLaunch{x, 0, y, 0, kCount, 2.0f, 1.0f});
  ASSERT_TRUE(fence.pending());
  EXPECT_FALSE(backend->fence_passed(fence));
  EXPECT_FALSE(backend->wait_fence(fence, std::chrono::milliseconds(5)));
  EXPECT_EQ(std::to_integer<int>(*at(y)), 0) << "a held launch wrote y";

  backend->test_controls()->hold_copies(false);
  ASSERT_TRUE(backend->wait_fence(fence, kForever));
  EXPECT_TRUE(backend->fence_passed(fence));
  EXPECT_EQ(wrong_axpy(at(y), values, 2.0f, 1.0f), 0u);
  backend->release_fence(fence);
  backend->free(x);
  backend->free(y);
}

TEST(HostBackend, QuiescePassesEveryFenceOnItsOwnQueues) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kCount = 256;
  constexpr std::uint64_t kBytes = kCount * sizeof(float);
  const auto x = backend->allocate(kBytes, 64);
  const auto y = backend->allocate(kBytes, 64);
  const auto block = backend->allocate_host(2 * kBytes);
  const auto values = random_floats(kCount, 13);
  std::memcpy(block.data, values.data(), kBytes);

  backend->test_controls()->hold_copies(true);
  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, block.data, x, 0, kBytes));
  const Fence launched = backend->launch_axpy(AxpyLaunch{x, 0, y, 0, kCount, 0.5f, -1.0f});
  backend->submit_copy(copy(CopyDirection::DeviceToHost, CopyMode::Async, 2, block.data + kBytes, y, 0, kBytes));
  std::vector<Fence> fences{launched};
  for (const Queue queue : {Queue::CopyUp, Queue::CopyDown, Queue::Compute}) {
    fences.push_back(backend->record_fence(QueueRef{queue}));
    EXPECT_TRUE(fences.back().pending()) << static_cast<int>(queue);
    EXPECT_FALSE(backend->fence_passed(fences.back())) << static_cast<int>(queue);
  }

  backend->quiesce();  // lifts the hold and finishes everything
  for (const Fence fence : fences) EXPECT_TRUE(backend->fence_passed(fence));
  for (const Queue queue : {Queue::CopyUp, Queue::CopyDown, Queue::Compute}) {
    EXPECT_FALSE(backend->record_fence(QueueRef{queue}).pending()) << "an idle queue's fence has passed already";
  }
  EXPECT_EQ(wrong_axpy(block.data + kBytes, values, 0.5f, -1.0f), 0u) << "the download must see the launch's y";
  for (const Fence fence : fences) backend->release_fence(fence);
  drain(*backend, 2);
  backend->free(x);
  backend->free(y);
  backend->free_host(block);
}

// Copies submitted after a launch order against its bytes: a download of y
// (async or sync) gets the computed values, and an upload into x waits until
// the launch has read the old ones.
TEST(HostBackend, CopiesAfterALaunchOrderAgainstItsBytes) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kCount = 4 << 20;  // 16 MiB: queued, and long enough to overtake if unordered
  constexpr std::uint64_t kBytes = kCount * sizeof(float);
  const auto x = backend->allocate(kBytes, 64);
  const auto y = backend->allocate(kBytes, 64);
  const auto block = backend->allocate_host(3 * kBytes);
  const auto values = random_floats(kCount, 14);
  const auto other = random_floats(kCount, 15);
  std::memcpy(at(x), values.data(), kBytes);
  std::byte* down_async = block.data;
  std::byte* down_sync = block.data + kBytes;
  std::byte* up = block.data + 2 * kBytes;
  std::memcpy(up, other.data(), kBytes);

  const Fence fence = backend->launch_axpy(AxpyLaunch{x, 0, y, 0, kCount, 1.5f, 2.0f});
  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, up, x, 0, kBytes));
  backend->submit_copy(copy(CopyDirection::DeviceToHost, CopyMode::Async, 2, down_async, y, 0, kBytes));
  backend->submit_copy(copy(CopyDirection::DeviceToHost, CopyMode::Sync, 3, down_sync, y, 0, kBytes));
  EXPECT_EQ(wrong_axpy(down_sync, values, 1.5f, 2.0f), 0u) << "a sync download overtook the launch";
  drain(*backend, 2);
  EXPECT_EQ(wrong_axpy(down_async, values, 1.5f, 2.0f), 0u) << "an async download overtook the launch";
  EXPECT_EQ(wrong_axpy(at(y), values, 1.5f, 2.0f), 0u) << "an upload into x overtook the launch reading it";
  EXPECT_EQ(std::memcmp(at(x), other.data(), kBytes), 0);
  EXPECT_TRUE(backend->wait_fence(fence, kForever));
  backend->free(x);
  backend->free(y);
  backend->free_host(block);
}

// An in-place launch (y = x) waits for a queued download still reading x.
TEST(HostBackend, InPlaceLaunchWaitsForADownloadOfItsBytes) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kCount = 1024;
  constexpr std::uint64_t kBytes = kCount * sizeof(float);
  const auto x = backend->allocate(kBytes, 64);
  const auto block = backend->allocate_host(kBytes);
  const auto values = random_floats(kCount, 16);
  std::memcpy(at(x), values.data(), kBytes);

  backend->test_controls()->hold_copies(true);
  backend->submit_copy(copy(CopyDirection::DeviceToHost, CopyMode::Async, 1, block.data, x, 0, kBytes));
  const Fence fence = backend->launch_axpy(AxpyLaunch{x, 0, x, 0, kCount, 4.0f, 0.0f});
  backend->test_controls()->hold_copies(false);
  ASSERT_TRUE(backend->wait_fence(fence, kForever));
  drain(*backend, 1);
  EXPECT_EQ(std::memcmp(block.data, values.data(), kBytes), 0) << "the launch overwrote x under a download";
  EXPECT_EQ(wrong_axpy(at(x), values, 4.0f, 0.0f), 0u);
  backend->free(x);
  backend->free_host(block);
}

TEST(HostBackend, RecordFenceOnEachOwnQueueCoversWhatWasQueuedThere) {
  auto backend = host::make_host_backend();
  for (const Queue queue : {Queue::CopyUp, Queue::CopyDown, Queue::Compute}) {
    EXPECT_FALSE(backend->record_fence(QueueRef{queue}).pending()) << "idle queue " << static_cast<int>(queue);
  }
  constexpr std::uint64_t kCount = 256;
  constexpr std::uint64_t kBytes = kCount * sizeof(float);
  const auto up_target = backend->allocate(kBytes, 64);
  const auto down_source = backend->allocate(kBytes, 64);
  const auto x = backend->allocate(kBytes, 64);
  const auto y = backend->allocate(kBytes, 64);
  const auto block = backend->allocate_host(2 * kBytes);
  std::memset(at(x), 0, kBytes);

  backend->test_controls()->hold_copies(true);
  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, block.data, up_target, 0, kBytes));
  backend->submit_copy(
      copy(CopyDirection::DeviceToHost, CopyMode::Async, 2, block.data + kBytes, down_source, 0, kBytes));
  const Fence launched = backend->launch_axpy(AxpyLaunch{x, 0, y, 0, kCount, 1.0f, 1.0f});
  const Fence up = backend->record_fence(QueueRef{Queue::CopyUp});
  const Fence down = backend->record_fence(QueueRef{Queue::CopyDown});
  const Fence compute = backend->record_fence(QueueRef{Queue::Compute});
  for (const Fence fence : {up, down, compute}) {
    ASSERT_TRUE(fence.pending());
    EXPECT_FALSE(backend->fence_passed(fence));
  }
  EXPECT_NE(up.token, down.token);
  EXPECT_NE(down.token, compute.token);
  EXPECT_EQ(compute.token, launched.token) << "nothing queued on Compute after the launch";

  backend->test_controls()->hold_copies(false);
  for (const Fence fence : {up, down, compute}) EXPECT_TRUE(backend->wait_fence(fence, kForever));
  drain(*backend, 2);
  for (const Fence fence : {up, down, compute, launched}) backend->release_fence(fence);
  for (const auto& a : {up_target, down_source, x, y}) backend->free(a);
  backend->free_host(block);
}

// A CPU consumer is done when its call returns: there is no queue of its to
// record on, and the backend says so rather than pretend.
TEST(HostBackend, ConsumerQueueFenceIsUnsupported) {
  auto backend = host::make_host_backend();
  try {
    backend->record_fence(QueueRef{Queue::Consumer, 1});
    FAIL() << "a fence on a consumer queue was recorded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Unsupported);
    EXPECT_NE(std::string(e.message()).find("stream None"), std::string::npos) << e.message();
  }
}

TEST(HostBackend, WaitFenceTimesOutThenPassesOnceReleased) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kCount = 256;
  const auto x = backend->allocate(kCount * sizeof(float), 64);
  std::memset(at(x), 0, kCount * sizeof(float));
  backend->test_controls()->hold_copies(true);
  const Fence fence = backend->launch_axpy(AxpyLaunch{x, 0, x, 0, kCount, 1.0f, 1.0f});
  ASSERT_TRUE(fence.pending());
  EXPECT_FALSE(backend->wait_fence(fence, std::chrono::nanoseconds::zero()));
  EXPECT_FALSE(backend->wait_fence(fence, std::chrono::nanoseconds(-1)));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(backend->wait_fence(fence, std::chrono::milliseconds(20)));  // past the spin, into the sleep
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(20));

  // Released from another thread while this one sleeps with no deadline
  // (a timeout too large to add to the clock means "until done").
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    backend->test_controls()->hold_copies(false);
  });
  EXPECT_TRUE(backend->wait_fence(fence, kForever));
  releaser.join();
  EXPECT_TRUE(backend->wait_fence(fence, std::chrono::nanoseconds::zero()));
  backend->release_fence(fence);
  backend->free(x);
}

TEST(HostBackend, PassedFenceAndForeignTokens) {
  auto backend = host::make_host_backend();
  EXPECT_TRUE(backend->fence_passed(Fence{}));
  EXPECT_TRUE(backend->wait_fence(Fence{}, std::chrono::nanoseconds::zero()));
  backend->release_fence(Fence{});
  // Lane bits 0, and a sequence number never issued.
  for (const std::uintptr_t token : {std::uintptr_t{4}, (std::uintptr_t{1000} << 2) | 1}) {
    try {
      backend->fence_passed(Fence{token});
      FAIL() << "token " << token << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Unsupported);
    }
  }
}

// A small launch on an idle engine runs at once and hands back the passed
// fence; with inline work off it goes to the compute thread.
TEST(HostBackend, SmallLaunchOnAnIdleEngineRunsAtOnceUnlessInlineIsOff) {
  for (const std::uint64_t inline_max : {std::uint64_t{16} << 10, std::uint64_t{0}}) {
    auto backend = host::make_host_backend(host::Options{.inline_async_max_bytes = inline_max});
    constexpr std::uint64_t kCount = 1024;
    const auto x = backend->allocate(kCount * sizeof(float), 64);
    const auto y = backend->allocate(kCount * sizeof(float), 64);
    const auto values = random_floats(kCount, 17);
    std::memcpy(at(x), values.data(), kCount * sizeof(float));
    const Fence fence = backend->launch_axpy(AxpyLaunch{x, 0, y, 0, kCount, 3.0f, 3.0f});
    if (inline_max > 0) {
      EXPECT_FALSE(fence.pending());
    } else {
      EXPECT_TRUE(fence.pending());
      EXPECT_TRUE(backend->wait_fence(fence, kForever));
      backend->release_fence(fence);
    }
    EXPECT_EQ(wrong_axpy(at(y), values, 3.0f, 3.0f), 0u) << "inline_async_max_bytes " << inline_max;
    backend->free(x);
    backend->free(y);
  }
}

// Unaligned offsets: the loop loads and stores through memcpy.
TEST(HostBackend, LaunchAtUnalignedOffsets) {
  auto backend = host::make_host_backend(host::Options{.inline_async_max_bytes = 0});
  constexpr std::uint64_t kCount = 1000;
  const auto x = backend->allocate(kCount * sizeof(float) + 3, 64);
  const auto y = backend->allocate(kCount * sizeof(float) + 1, 64);
  const auto values = random_floats(kCount, 18);
  std::memcpy(at(x, 3), values.data(), kCount * sizeof(float));
  const Fence fence = backend->launch_axpy(AxpyLaunch{x, 3, y, 1, kCount, -1.0f, 0.25f});
  ASSERT_TRUE(backend->wait_fence(fence, kForever));
  EXPECT_EQ(wrong_axpy(at(y, 1), values, -1.0f, 0.25f), 0u);
  backend->free(x);
  backend->free(y);
}

// Upload, compute, download, chunk after chunk, all queued on the three
// lanes at once (nothing inline): every result must come out of the
// computation on its own chunk's uploaded bytes.
TEST(HostBackend, PipelinedUploadLaunchDownloadStaysOrdered) {
  auto backend = host::make_host_backend(host::Options{.inline_async_max_bytes = 0});
  constexpr std::uint64_t kCount = 64 << 10;
  constexpr std::uint64_t kBytes = kCount * sizeof(float);
  constexpr int kChunks = 24;
  const auto x = backend->allocate(kBytes, 64);  // reused by every chunk: write-after-read hazards
  const auto y = backend->allocate(kBytes, 64);
  const auto block = backend->allocate_host(2 * kBytes * kChunks);
  std::vector<std::vector<float>> inputs;
  for (int i = 0; i < kChunks; ++i) {
    inputs.push_back(random_floats(kCount, 100 + i));
    std::memcpy(block.data + i * kBytes, inputs.back().data(), kBytes);
  }
  std::byte* outputs = block.data + kChunks * kBytes;
  Fence last;
  for (int i = 0; i < kChunks; ++i) {
    backend->submit_copy(
        copy(CopyDirection::HostToDevice, CopyMode::Async, 2 * i, block.data + i * kBytes, x, 0, kBytes));
    last = backend->launch_axpy(AxpyLaunch{x, 0, y, 0, kCount, static_cast<float>(i), 1.0f});
    backend->submit_copy(
        copy(CopyDirection::DeviceToHost, CopyMode::Async, 2 * i + 1, outputs + i * kBytes, y, 0, kBytes));
  }
  drain(*backend, 2 * kChunks);
  EXPECT_TRUE(backend->wait_fence(last, kForever));
  for (int i = 0; i < kChunks; ++i) {
    EXPECT_EQ(wrong_axpy(outputs + i * kBytes, inputs[i], static_cast<float>(i), 1.0f), 0u) << "chunk " << i;
  }
  backend->free(x);
  backend->free(y);
  backend->free_host(block);
}

TEST(HostBackend, OutOfBoundsCopyIsRefusedAtSubmit) {
  auto backend = host::make_host_backend();
  const auto device = backend->allocate(4096, 64);
  const auto block = backend->allocate_host(8192);
  try {
    backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, block.data, device, 4000, 100));
    FAIL() << "copy past the allocation accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidRange);
  }
  backend->free(device);
  backend->free_host(block);
}

// Destroying a backend with copies and launches still queued neither hangs
// nor runs them late, and frees what its owner forgot.
TEST(HostBackend, DestructionDropsQueuedCopiesAndFreesLeftovers) {
  auto backend = host::make_host_backend();
  const auto device = backend->allocate(1 << 20, 64);
  const auto block = backend->allocate_host(1 << 20);
  backend->test_controls()->hold_copies(true);
  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, block.data, device, 0, 1 << 20));
  const auto x = backend->allocate(1 << 20, 64);
  const Fence fence = backend->launch_axpy(AxpyLaunch{x, 0, device, 0, (1 << 20) / sizeof(float), 1.0f, 0.0f});
  EXPECT_TRUE(fence.pending());
  backend.reset();  // ASan/LSan would report a leak or a late write here
  SUCCEED();
}

// The host backend's engine threads alive in this process.
int engine_threads() {
  const auto& names = host::detail::CopyEngine::kThreadNames;
  int count = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    if (std::getline(comm, name) && std::find(names.begin(), names.end(), name) != names.end()) ++count;
  }
  return count;
}

TEST(HostBackend, AClosedBridgeHoldsNoEngineThreadWhileAViewOutlivesIt) {
  const int before = engine_threads();
  Bridge bridge(host::make_host_backend(), BridgeOptions{1, 1 << 20, 0});
  const DeviceHandle h = bridge.alloc_device(ObjectSpec{4096, 64, DType::Float32, ShapeKind::Vector}, 4096);
  EXPECT_EQ(engine_threads(), before + 3);
  ViewLease lease = bridge.view(h, ViewSpec{DType::Float32, {1024}, {}, 0}, ViewWait::Refuse);
  auto* values = reinterpret_cast<float*>(static_cast<std::uintptr_t>(lease.view().data));
  bridge.close();
  EXPECT_EQ(engine_threads(), before) << "the closed bridge's engine threads still run";
  values[1023] = 1.5f;  // the view's memory stays until the view ends
  EXPECT_EQ(values[1023], 1.5f);
  lease = ViewLease();
}

TEST(HostBackend, TestControlsSayWhatTheyCount) {
  auto backend = host::make_host_backend();
  TestControls* controls = backend->test_controls();
  ASSERT_NE(controls, nullptr);
  EXPECT_EQ(controls->live_allocations(), 0u);
  EXPECT_EQ(controls->live_bytes(), std::optional<std::uint64_t>(0));
  EXPECT_EQ(controls->live_host_blocks(), std::optional<std::uint64_t>(0));
  EXPECT_FALSE(controls->live_fences().has_value()) << "the host backend counts no fences";
  EXPECT_TRUE(controls->can_hold_copies());
  EXPECT_EQ(controls->fake(), nullptr) << "only the fake has the fake's controls";
}

}  // namespace
}  // namespace devbridge
