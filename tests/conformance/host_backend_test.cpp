// The host backend's own promises, below the bridge: what it describes, real
// aligned memory, the ring's page-locking (and the note when it is refused),
// allocation failures that name their size, and the copy engine's ordering.
// What every backend must do lives in conformance_test.cpp.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "devbridge/backends/fake.hpp"
#include "devbridge/backends/host.hpp"

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
  return CopyRequest{direction, mode, CopyEvent{1, 1, id}, host, device, device_offset, len};
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
  EXPECT_EQ(info.device_string, "CPU");
  EXPECT_EQ(info.dlpack_device, DLPackDevice::CPU);
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
  EXPECT_EQ(host::live_allocations(*backend), allocations.size());
  for (const auto& a : allocations) backend->free(a);
  EXPECT_EQ(host::live_allocations(*backend), 0u);
}

// A freed large block is kept warm for the next allocation of its size (no
// page faults), at most four of them; live_allocations counts only live ones.
TEST(HostBackend, AFreedLargeBlockIsReusedWarmAndTheCacheIsBounded) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kBlock = 8u << 20;
  const auto first = backend->allocate(kBlock, 256);
  EXPECT_EQ(first.address % (2u << 20), 0u);  // huge-page aligned from 4 MiB up
  std::memset(at(first), 0x5a, kBlock);
  backend->free(first);
  EXPECT_EQ(backend->live_allocations(), 0u);
  const auto again = backend->allocate(kBlock, 256);
  EXPECT_EQ(again.address, first.address);
  const auto other_size = backend->allocate(kBlock + 4096, 256);  // exact sizes only
  EXPECT_NE(other_size.address, first.address);
  backend->free(again);
  backend->free(other_size);
  std::vector<DeviceAllocation> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(backend->allocate(kBlock, 256));
  EXPECT_EQ(backend->live_allocations(), 6u);
  for (const auto& block : blocks) backend->free(block);
  // The four freed last are warm, the oldest went back to the C library.
  std::vector<std::uint64_t> reused;
  for (int i = 0; i < 4; ++i) {
    const auto block = backend->allocate(kBlock, 256);
    reused.push_back(block.address);
  }
  for (int i = 2; i < 6; ++i) EXPECT_NE(std::ranges::count(reused, blocks[i].address), 0) << i;
  for (const auto address : reused) backend->free(DeviceAllocation{address, kBlock, address});
  EXPECT_EQ(backend->live_allocations(), 0u);
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
    EXPECT_NE(message.find("available"), std::string::npos) << message;
    EXPECT_NE(message.find("ENOMEM"), std::string::npos) << message;
  }
  EXPECT_EQ(host::live_allocations(*backend), 0u);
  try {
    backend->allocate(64, 3);
    FAIL() << "alignment 3 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidAlignment);
  }
}

TEST(HostBackend, HostBlocksArePageAlignedAndCounted) {
  auto backend = host::make_host_backend();
  const auto block = backend->allocate_host(10000);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block.data) % static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE)), 0u);
  EXPECT_EQ(block.bytes, 10000u);
  std::memset(block.data, 0x77, block.bytes);
  EXPECT_EQ(host::live_host_blocks(*backend), 1u);
  backend->free_host(block);
  EXPECT_EQ(host::live_host_blocks(*backend), 0u);
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

  host::hold_copies(*backend, true);
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

  host::hold_copies(*backend, true);  // everything queued before anything runs
  for (int i = 0; i < kChunks; ++i) {
    backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 100 + i, block.data + i * kChunk, device,
                              i * kChunk, kChunk));
    backend->submit_copy(copy(CopyDirection::DeviceToHost, CopyMode::Async, 200 + i, out + i * kChunk, device,
                              i * kChunk, kChunk));
  }
  host::hold_copies(*backend, false);
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

TEST(HostBackend, AxpyWaitsForTheUploadIntoX) {
  auto backend = host::make_host_backend();
  constexpr std::uint64_t kCount = 4 << 20;
  constexpr std::uint64_t kBytes = kCount * sizeof(float);
  const auto x = backend->allocate(kBytes, 64);
  const auto y = backend->allocate(kBytes, 64);
  const auto block = backend->allocate_host(kBytes);
  std::vector<float> values(kCount);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-10.0f, 10.0f);
  for (auto& v : values) v = dist(rng);
  std::memcpy(block.data, values.data(), kBytes);
  std::memset(at(x), 0, kBytes);

  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, block.data, x, 0, kBytes));
  backend->launch_axpy(AxpyLaunch{x, 0, y, 0, kCount, 3.0f, 0.5f});
  std::vector<float> result(kCount);
  std::memcpy(result.data(), at(y), kBytes);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < kCount; ++i) wrong += result[i] != 3.0f * values[i] + 0.5f;
  EXPECT_EQ(wrong, 0u);
  EXPECT_THROW(backend->launch_axpy(AxpyLaunch{x, 4, y, 0, kCount, 1.0f, 0.0f}), Error);
  drain(*backend, 1);
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

// Destroying a backend with copies still queued neither hangs nor runs them
// late, and frees what its owner forgot.
TEST(HostBackend, DestructionDropsQueuedCopiesAndFreesLeftovers) {
  auto backend = host::make_host_backend();
  const auto device = backend->allocate(1 << 20, 64);
  const auto block = backend->allocate_host(1 << 20);
  host::hold_copies(*backend, true);
  backend->submit_copy(copy(CopyDirection::HostToDevice, CopyMode::Async, 1, block.data, device, 0, 1 << 20));
  backend.reset();  // ASan/LSan would report a leak or a late write here
  SUCCEED();
}

TEST(HostBackend, ObservationHooksRefuseOtherBackends) {
  fake::FakeBackend fake;
  try {
    host::live_allocations(fake);
    FAIL() << "live_allocations accepted the fake backend";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Unsupported);
  }
}

}  // namespace
}  // namespace devbridge
