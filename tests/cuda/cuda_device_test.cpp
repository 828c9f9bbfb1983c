// The CUDA backend on a real device. Every test here is skipped, with the
// probe's reason, on a machine without a usable GPU and driver.
//
// The last test faults a context on purpose; it makes its own context for
// that, so the primary context (shared by every other test in the process)
// stays healthy.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "backends/cuda/cuda_driver.hpp"
#include "cuda_test_support.hpp"
#include "devbridge/backends/cuda.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/consumer_names.hpp"

namespace devbridge::cuda {
namespace {

using namespace std::chrono_literals;
using testing::AllocationHolder;
using testing::FenceHolder;
using testing::HostBlockHolder;
using testing::OwnContext;
using detail::CUcontext;
using detail::CUDA_SUCCESS;
using detail::CUdeviceptr;

void fill_random(std::byte* data, std::size_t bytes, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const std::uint64_t word = generator() | 0x0101010101010101ull;  // never a zero byte
    std::memcpy(data + i, &word, 8);
  }
  for (; i < bytes; ++i) data[i] = static_cast<std::byte>((generator() & 0xfe) | 1);
}

void fill_random_floats(float* data, std::size_t count, std::uint64_t seed) {
  std::mt19937 generator(static_cast<std::uint32_t>(seed));
  std::uniform_real_distribution<float> value(-1000.0f, 1000.0f);
  for (std::size_t i = 0; i < count; ++i) data[i] = value(generator);
}

CUcontext current_context() {
  CUcontext current = nullptr;
  detail::driver().cuCtxGetCurrent(&current);
  return current;
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const Probe found = probe();
    if (!found.available) GTEST_SKIP() << "no usable CUDA device: " << found.reason;
    backend_ = make_cuda_backend();
  }

  // Waits for and drains completions until every event in `ids` has one.
  std::map<std::uint64_t, Completion> collect(const std::set<std::uint64_t>& ids) {
    std::map<std::uint64_t, Completion> seen;
    std::vector<Completion> drained;
    while (seen.size() < ids.size()) {
      backend_->wait_for_completions(100ms);
      drained.clear();
      backend_->drain_completions(drained);
      for (Completion& completion : drained) {
        EXPECT_TRUE(ids.count(completion.event.id)) << "unexpected completion " << completion.event.id;
        EXPECT_TRUE(seen.emplace(completion.event.id, completion).second)
            << "completion " << completion.event.id << " reported twice";
      }
    }
    return seen;
  }

  CopyRequest request(CopyDirection direction, CopyMode mode, std::uint64_t id, std::byte* host,
                      const DeviceAllocation& device, std::uint64_t offset, std::uint64_t len) {
    return testing::copy_request(7, direction, mode, id, host, device, offset, len);
  }

  std::unique_ptr<Backend> backend_;
};

TEST_F(CudaDeviceTest, DescribesTheDevice) {
  const BackendInfo info = backend_->describe();
  EXPECT_EQ(info.name, "cuda");
  EXPECT_EQ(info.vendor, "nvidia");
  EXPECT_FALSE(info.device_name.empty());
  EXPECT_EQ(info.device_kind, DeviceKind::Cuda);
  EXPECT_EQ(tinygrad_device(info.device_kind, info.device_ordinal), "CUDA:0");
  EXPECT_EQ(info.device_ordinal, 0);
  EXPECT_EQ(dlpack_device(info.device_kind), DLPackDevice::CUDA);
  EXPECT_GT(info.total_memory, 0u);
  EXPECT_GT(info.free_memory, 0u);
  EXPECT_LE(info.free_memory, info.total_memory);
  EXPECT_EQ(static_cast<int>(info.dtypes.size()), kDTypeCount);
  EXPECT_TRUE(info.host_memory_page_locked);
  EXPECT_NE(info.notes.find("compute capability"), std::string::npos) << info.notes;
  std::cout << "device: " << info.device_name << "\nnotes: " << info.notes << std::endl;
}

TEST_F(CudaDeviceTest, AllocationsHonourTheAlignmentAsked) {
  for (std::uint64_t alignment : {1ull, 64ull, 256ull, 4096ull, 1ull << 16, 1ull << 21}) {
    const DeviceAllocation allocation = backend_->allocate(1000 * 4, alignment);
    EXPECT_EQ(allocation.address % std::max<std::uint64_t>(alignment, 256), 0u) << alignment;
    EXPECT_EQ(allocation.bytes, 4000u);
    EXPECT_EQ(backend_->test_controls()->live_allocations(), 1u);
    backend_->free(allocation);
    EXPECT_EQ(backend_->test_controls()->live_allocations(), 0u);
  }
}

TEST_F(CudaDeviceTest, OutOfMemoryIsAllocationFailedWithBytesAskedAndFree) {
  const std::uint64_t too_much = 1ull << 52;  // 4 PiB
  try {
    (void)backend_->allocate(too_much, 256);
    FAIL() << "a 4 PiB allocation succeeded";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::AllocationFailed);
    EXPECT_FALSE(error.fatal());
    const std::string message(error.message());
    EXPECT_NE(message.find("CUDA_ERROR_OUT_OF_MEMORY"), std::string::npos) << message;
    EXPECT_NE(message.find(std::to_string(too_much)), std::string::npos) << message;
    EXPECT_NE(message.find("bytes free of"), std::string::npos) << message;
  }
  EXPECT_EQ(backend_->test_controls()->live_allocations(), 0u);
  // The device is fine afterwards.
  AllocationHolder ok{*backend_, backend_->allocate(1 << 20, 256)};
  EXPECT_NE(ok.allocation.address, 0u);
}

TEST_F(CudaDeviceTest, SyncCopiesMoveExactlyTheRequestedBytes) {
  constexpr std::uint64_t kBytes = 1 << 20;
  HostBlockHolder host{*backend_, backend_->allocate_host(3 * kBytes)};
  ASSERT_TRUE(host.block.page_locked);
  AllocationHolder device{*backend_, backend_->allocate(kBytes, 256)};
  std::byte* poison = host.block.data;
  std::byte* payload = host.block.data + kBytes;
  std::byte* back = host.block.data + 2 * kBytes;

  // Poison the whole allocation, then overwrite its middle.
  std::memset(poison, 0xA5, kBytes);
  backend_->submit_copy(request(CopyDirection::HostToDevice, CopyMode::Sync, 1, poison, device.allocation, 0, kBytes));
  fill_random(payload, kBytes, 1);
  const std::uint64_t offset = 4096 + 12;
  const std::uint64_t len = kBytes / 2 + 3;
  backend_->submit_copy(
      request(CopyDirection::HostToDevice, CopyMode::Sync, 2, payload, device.allocation, offset, len));

  std::memset(back, 0, kBytes);
  backend_->submit_copy(request(CopyDirection::DeviceToHost, CopyMode::Sync, 3, back, device.allocation, 0, kBytes));
  EXPECT_EQ(std::memcmp(back, poison, offset), 0) << "bytes before the copied range changed";
  EXPECT_EQ(std::memcmp(back + offset, payload, len), 0) << "copied bytes differ";
  EXPECT_EQ(std::memcmp(back + offset + len, poison, kBytes - offset - len), 0) << "bytes after the range changed";

  std::vector<Completion> drained;
  backend_->drain_completions(drained);
  EXPECT_TRUE(drained.empty()) << "sync copies must not report completions";
}

TEST_F(CudaDeviceTest, AsyncCopiesReportEveryCompletionOnce) {
  constexpr std::uint64_t kChunk = 256 << 10;
  constexpr int kChunks = 64;
  HostBlockHolder host{*backend_, backend_->allocate_host(2 * kChunk * kChunks)};
  AllocationHolder device{*backend_, backend_->allocate(kChunk * kChunks, 256)};
  std::byte* out = host.block.data;
  std::byte* in = host.block.data + kChunk * kChunks;
  fill_random(out, kChunk * kChunks, 2);
  std::memset(in, 0, kChunk * kChunks);

  std::set<std::uint64_t> uploads;
  for (int i = 0; i < kChunks; ++i) {
    backend_->submit_copy(request(CopyDirection::HostToDevice, CopyMode::Async, 100 + i, out + i * kChunk,
                                  device.allocation, i * kChunk, kChunk));
    uploads.insert(100 + i);
  }
  for (const auto& [id, completion] : collect(uploads)) EXPECT_TRUE(completion.ok) << id << completion.message;

  std::set<std::uint64_t> downloads;
  for (int i = 0; i < kChunks; ++i) {
    backend_->submit_copy(request(CopyDirection::DeviceToHost, CopyMode::Async, 1000 + i, in + i * kChunk,
                                  device.allocation, i * kChunk, kChunk));
    downloads.insert(1000 + i);
  }
  for (const auto& [id, completion] : collect(downloads)) EXPECT_TRUE(completion.ok) << id << completion.message;
  EXPECT_EQ(std::memcmp(in, out, kChunk * kChunks), 0);
}

TEST_F(CudaDeviceTest, ManySmallCopiesRecycleEvents) {
  HostBlockHolder host{*backend_, backend_->allocate_host(4096)};
  AllocationHolder device{*backend_, backend_->allocate(4096, 256)};
  fill_random(host.block.data, 4096, 3);
  std::set<std::uint64_t> ids;
  for (std::uint64_t i = 0; i < 5000; ++i) {
    backend_->submit_copy(request(i % 2 ? CopyDirection::DeviceToHost : CopyDirection::HostToDevice,
                                  CopyMode::Async, i + 1, host.block.data, device.allocation, 0, 64));
    ids.insert(i + 1);
  }
  const auto seen = collect(ids);
  EXPECT_EQ(seen.size(), ids.size());
}

TEST_F(CudaDeviceTest, QuiesceFinishesWorkWhoseCompletionsAreThenDrained) {
  constexpr std::uint64_t kBytes = 8 << 20;
  HostBlockHolder host{*backend_, backend_->allocate_host(kBytes)};
  AllocationHolder device{*backend_, backend_->allocate(kBytes, 256)};
  fill_random(host.block.data, kBytes, 4);
  for (std::uint64_t i = 0; i < 8; ++i) {
    backend_->submit_copy(request(i % 2 ? CopyDirection::DeviceToHost : CopyDirection::HostToDevice,
                                  CopyMode::Async, 50 + i, host.block.data + i * (kBytes / 8), device.allocation,
                                  i * (kBytes / 8), kBytes / 8));
  }
  backend_->quiesce();
  std::vector<Completion> drained;
  backend_->drain_completions(drained);
  EXPECT_EQ(drained.size(), 8u);
  for (const Completion& completion : drained) EXPECT_TRUE(completion.ok) << completion.message;
}

TEST_F(CudaDeviceTest, HeldCopiesStayPendingUntilReleased) {
  HostBlockHolder host{*backend_, backend_->allocate_host(1 << 20)};
  AllocationHolder device{*backend_, backend_->allocate(1 << 20, 256)};
  fill_random(host.block.data, 1 << 20, 11);
  backend_->test_controls()->hold_copies(true);
  backend_->submit_copy(request(CopyDirection::HostToDevice, CopyMode::Async, 1, host.block.data,
                                device.allocation, 0, 1 << 19));
  backend_->submit_copy(request(CopyDirection::DeviceToHost, CopyMode::Async, 2, host.block.data + (1 << 19),
                                device.allocation, 0, 1 << 19));
  EXPECT_FALSE(backend_->wait_for_completions(20ms)) << "a held copy completed";
  std::vector<Completion> drained;
  backend_->drain_completions(drained);
  EXPECT_TRUE(drained.empty());
  backend_->test_controls()->hold_copies(false);
  const auto seen = collect({1, 2});
  EXPECT_EQ(std::memcmp(host.block.data, host.block.data + (1 << 19), 1 << 19), 0)
      << "the download did not wait for the upload of the same bytes";

  // quiesce() lifts a hold too.
  backend_->test_controls()->hold_copies(true);
  backend_->submit_copy(request(CopyDirection::HostToDevice, CopyMode::Async, 3, host.block.data,
                                device.allocation, 0, 4096));
  backend_->quiesce();
  drained.clear();
  backend_->drain_completions(drained);
  ASSERT_EQ(drained.size(), 1u);
  EXPECT_TRUE(drained[0].ok);
}

TEST_F(CudaDeviceTest, WaitWithNothingInFlightTimesOut) {
  EXPECT_FALSE(backend_->wait_for_completions(1ms));
}

TEST_F(CudaDeviceTest, AxpyRunsAfterItsUploadAndBeforeTheDownload) {
  // Submitted back to back with no host wait: only the backend's stream-event
  // ordering makes the result right.
  constexpr std::uint64_t kCount = (16 << 20) / sizeof(float);
  constexpr std::uint64_t kBytes = kCount * sizeof(float);
  HostBlockHolder host{*backend_, backend_->allocate_host(2 * kBytes)};
  AllocationHolder x{*backend_, backend_->allocate(kBytes, 256)};
  AllocationHolder y{*backend_, backend_->allocate(kBytes, 256)};
  auto* input = reinterpret_cast<float*>(host.block.data);
  auto* output = reinterpret_cast<float*>(host.block.data + kBytes);
  fill_random_floats(input, kCount, 5);
  std::fill(output, output + kCount, 0.0f);
  const float a = 2.5f;
  const float b = -1.25f;

  backend_->submit_copy(request(CopyDirection::HostToDevice, CopyMode::Async, 1, host.block.data, x.allocation, 0,
                                kBytes));
  FenceHolder launched{*backend_, backend_->launch_axpy(AxpyLaunch{x.allocation, 0, y.allocation, 0, kCount, a, b})};
  EXPECT_TRUE(launched.fence.pending());
  backend_->submit_copy(request(CopyDirection::DeviceToHost, CopyMode::Async, 2, host.block.data + kBytes,
                                y.allocation, 0, kBytes));
  for (const auto& [id, completion] : collect({1, 2})) EXPECT_TRUE(completion.ok) << id << completion.message;

  std::uint64_t mismatches = 0;
  for (std::uint64_t i = 0; i < kCount; ++i) {
    const float product = a * input[i];  // rounded on its own, as the kernel does
    const float expected = product + b;
    if (std::memcmp(&expected, &output[i], sizeof(float)) != 0 && ++mismatches < 5)
      ADD_FAILURE() << "element " << i << ": " << output[i] << " != " << expected;
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST_F(CudaDeviceTest, AxpyInPlaceAndAtAnOffset) {
  constexpr std::uint64_t kCount = 100003;
  constexpr std::uint64_t kOffset = 64;
  constexpr std::uint64_t kBytes = kCount * sizeof(float) + kOffset;
  HostBlockHolder host{*backend_, backend_->allocate_host(2 * kBytes)};
  AllocationHolder x{*backend_, backend_->allocate(kBytes, 256)};
  auto* input = reinterpret_cast<float*>(host.block.data + kOffset);
  fill_random_floats(input, kCount, 6);
  backend_->submit_copy(
      request(CopyDirection::HostToDevice, CopyMode::Sync, 1, host.block.data, x.allocation, 0, kBytes));
  FenceHolder launched{*backend_,
                      backend_->launch_axpy(AxpyLaunch{x.allocation, kOffset, x.allocation, kOffset, kCount, -3.0f, 0.5f})};
  backend_->submit_copy(
      request(CopyDirection::DeviceToHost, CopyMode::Sync, 2, host.block.data + kBytes, x.allocation, 0, kBytes));
  const auto* output = reinterpret_cast<const float*>(host.block.data + kBytes + kOffset);
  for (std::uint64_t i = 0; i < kCount; ++i) {
    const float product = -3.0f * input[i];
    const float expected = product + 0.5f;
    ASSERT_EQ(std::memcmp(&expected, &output[i], sizeof(float)), 0) << "element " << i;
  }
}

TEST_F(CudaDeviceTest, AxpyRefusesRangesThatWouldFaultTheDevice) {
  AllocationHolder x{*backend_, backend_->allocate(4096, 256)};
  for (const AxpyLaunch& bad : {AxpyLaunch{x.allocation, 2, x.allocation, 0, 16, 1.0f, 0.0f},
                                AxpyLaunch{x.allocation, 0, x.allocation, 0, 1025, 1.0f, 0.0f},
                                AxpyLaunch{x.allocation, 4096, x.allocation, 0, 1, 1.0f, 0.0f}}) {
    try {
      backend_->release_fence(backend_->launch_axpy(bad));
      ADD_FAILURE() << "a launch outside the allocation was accepted";
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::InvalidRange);
      EXPECT_FALSE(error.fatal());
    }
  }
  // Still healthy.
  FenceHolder launched{*backend_, backend_->launch_axpy(AxpyLaunch{x.allocation, 0, x.allocation, 0, 1024, 1.0f, 0.0f})};
  backend_->quiesce();
  EXPECT_TRUE(backend_->fence_passed(launched.fence));
}

TEST_F(CudaDeviceTest, NeverLeavesItsContextCurrent) {
  ASSERT_EQ(current_context(), nullptr) << "the test thread starts with a context current";
  HostBlockHolder host{*backend_, backend_->allocate_host(1 << 20)};
  EXPECT_EQ(current_context(), nullptr);
  AllocationHolder device{*backend_, backend_->allocate(1 << 20, 256)};
  EXPECT_EQ(current_context(), nullptr);
  fill_random(host.block.data, 1 << 20, 7);
  backend_->submit_copy(request(CopyDirection::HostToDevice, CopyMode::Async, 1, host.block.data,
                                device.allocation, 0, 1 << 20));
  EXPECT_EQ(current_context(), nullptr);
  FenceHolder launched{*backend_,
                      backend_->launch_axpy(AxpyLaunch{device.allocation, 0, device.allocation, 0, 1024, 1.0f, 1.0f})};
  EXPECT_EQ(current_context(), nullptr);
  (void)backend_->fence_passed(launched.fence);
  EXPECT_EQ(current_context(), nullptr);
  EXPECT_TRUE(backend_->wait_fence(launched.fence, 30s));
  EXPECT_EQ(current_context(), nullptr);
  FenceHolder up{*backend_, backend_->record_fence(QueueRef{Queue::CopyUp})};
  FenceHolder legacy{*backend_, backend_->record_fence(QueueRef{Queue::Consumer, 1})};
  EXPECT_EQ(current_context(), nullptr);
  backend_->wait_for_completions(10ms);
  EXPECT_EQ(current_context(), nullptr);
  collect({1});
  EXPECT_EQ(current_context(), nullptr);
  (void)backend_->describe();
  backend_->quiesce();
  EXPECT_EQ(current_context(), nullptr);
  order_stream_after_submitted_work(*backend_, 1);
  EXPECT_EQ(current_context(), nullptr);
}

TEST_F(CudaDeviceTest, UsesACallerContextAndLeavesTheCallersCurrentContextAlone) {
  OwnContext own;
  if (own.context == nullptr) GTEST_SKIP() << "cuCtxCreate_v2 is not available to create a test context";
  {
    auto backend = make_cuda_backend(Options{0, own.context});
    EXPECT_EQ(context_of(*backend), own.context);
    EXPECT_NE(backend->describe().notes.find("caller's context"), std::string::npos);

    // The test thread has the primary context current (as a library using
    // the runtime API would); the backend must leave it so.
    CUcontext primary = static_cast<CUcontext>(context_of(*backend_));
    ASSERT_EQ(detail::driver().cuCtxPushCurrent_v2(primary), CUDA_SUCCESS);
    {
      HostBlockHolder host{*backend, backend->allocate_host(1 << 16)};
      AllocationHolder device{*backend, backend->allocate(1 << 16, 256)};
      EXPECT_EQ(current_context(), primary);
      fill_random(host.block.data, 1 << 15, 8);
      backend->submit_copy(request(CopyDirection::HostToDevice, CopyMode::Sync, 1, host.block.data,
                                   device.allocation, 0, 1 << 15));
      backend->submit_copy(request(CopyDirection::DeviceToHost, CopyMode::Sync, 2, host.block.data + (1 << 15),
                                   device.allocation, 0, 1 << 15));
      EXPECT_EQ(current_context(), primary);
      EXPECT_EQ(std::memcmp(host.block.data, host.block.data + (1 << 15), 1 << 15), 0);
    }
    CUcontext popped = nullptr;
    detail::driver().cuCtxPopCurrent_v2(&popped);
    EXPECT_EQ(popped, primary);
  }
  // The backend did not destroy or release the caller's context.
  ASSERT_EQ(detail::driver().cuCtxPushCurrent_v2(own.context), CUDA_SUCCESS);
  CUdeviceptr probe_pointer = 0;
  EXPECT_EQ(detail::driver().cuMemAlloc_v2(&probe_pointer, 4096), CUDA_SUCCESS);
  if (probe_pointer != 0) detail::driver().cuMemFree_v2(probe_pointer);
  CUcontext popped = nullptr;
  detail::driver().cuCtxPopCurrent_v2(&popped);
}

TEST_F(CudaDeviceTest, BridgeRoundTripWithComputeViewsAndRestart) {
  Bridge bridge(make_cuda_backend(), BridgeOptions{1, 64 << 20, 0});
  constexpr std::uint64_t kCount = (4 << 20) / sizeof(float);
  constexpr std::uint64_t kBytes = kCount * sizeof(float);
  const ObjectSpec spec{kBytes, 256, DType::Float32, ShapeKind::Tensor};
  const DeviceHandle x = bridge.alloc_device(spec, kBytes);
  const DeviceHandle y = bridge.alloc_device(spec, kBytes);
  const HostRange in = bridge.reserve(kBytes);
  const HostRange out = bridge.reserve(kBytes);
  auto* input = reinterpret_cast<float*>(bridge.host_bytes(in).data());
  fill_random_floats(input, kCount, 9);

  const CopyEvent up = bridge.host_to_device(in, DeviceRange{x, 0, kBytes}, CopyMode::Async);
  bridge.launch_axpy(DeviceRange{x, 0, kBytes}, DeviceRange{y, 0, kBytes}, 0.75f, 3.0f);
  const CopyEvent down = bridge.device_to_host(DeviceRange{y, 0, kBytes}, out, CopyMode::Async);
  EXPECT_EQ(bridge.wait(up, 30s).state, CopyState::Completed);
  EXPECT_EQ(bridge.wait(down, 30s).state, CopyState::Completed);
  EXPECT_TRUE(bridge.host_bytes_valid(down));
  const auto* output = reinterpret_cast<const float*>(bridge.host_bytes(out).data());
  for (std::uint64_t i = 0; i < kCount; ++i) {
    const float product = 0.75f * input[i];
    const float expected = product + 3.0f;
    ASSERT_EQ(std::memcmp(&expected, &output[i], sizeof(float)), 0) << "element " << i;
  }

  {
    ViewSpec view_spec;
    view_spec.dtype = DType::Float32;
    view_spec.shape = Dims{static_cast<std::int64_t>(kCount)};
    ViewLease view = bridge.view(y, view_spec, ViewWait::Wait);
    EXPECT_EQ(view->device, "CUDA:0");
    EXPECT_EQ(view->dlpack_device_type, static_cast<int>(DLPackDevice::CUDA));
    EXPECT_NE(view->data, 0u);
  }

  bridge.release_host(in);
  bridge.release_host(out);
  // Work in flight across a restart: the backend ends with nothing allocated.
  const HostRange again = bridge.reserve(kBytes);
  (void)bridge.host_to_device(again, DeviceRange{x, 0, kBytes}, CopyMode::Async);
  EXPECT_EQ(bridge.backend().test_controls()->live_allocations(), 2u);
  bridge.restart(2);
  EXPECT_EQ(bridge.backend().test_controls()->live_allocations(), 0u);
  EXPECT_EQ(bridge.stats().live_allocations, 0u);
}

// Last on purpose (and in a context of its own): a kernel reading an
// unmapped address faults the context. Every later completion in it reports
// a fatal failure naming the driver's error, and the backend tears down.
TEST_F(CudaDeviceTest, DeviceFaultInItsOwnContextIsFatal) {
  OwnContext own;
  if (own.context == nullptr) GTEST_SKIP() << "cuCtxCreate_v2 is not available to create a test context";
  {
    auto backend = make_cuda_backend(Options{0, own.context});
    HostBlockHolder host{*backend, backend->allocate_host(1 << 20)};
    AllocationHolder device{*backend, backend->allocate(1 << 20, 256)};
    // A forged allocation: the bridge never hands such a thing to a backend.
    const DeviceAllocation unmapped{0x1000, 1 << 20, 0};
    bool fatal_seen = false;
    try {
      backend->release_fence(backend->launch_axpy(AxpyLaunch{unmapped, 0, device.allocation, 0, 1 << 18, 1.0f, 0.0f}));
    } catch (const Error& error) {
      // A fast fault can surface on the launch's own follow-up calls.
      EXPECT_TRUE(error.fatal()) << error.what();
      EXPECT_NE(std::string(error.what()).find("CUDA_ERROR_"), std::string::npos) << error.what();
      fatal_seen = true;
    }
    try {
      // Ordered after the kernel; the fault may already be visible here.
      backend->submit_copy(request(CopyDirection::DeviceToHost, CopyMode::Async, 1, host.block.data,
                                   device.allocation, 0, 1 << 20));
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::OutputCopyFailed);
      EXPECT_TRUE(error.fatal()) << error.what();
      EXPECT_NE(std::string(error.what()).find("CUDA_ERROR_"), std::string::npos) << error.what();
      fatal_seen = true;
    }
    std::vector<Completion> drained;
    for (int round = 0; round < 1000 && !fatal_seen; ++round) {
      try {
        backend->wait_for_completions(10ms);
        drained.clear();
        backend->drain_completions(drained);
        for (const Completion& completion : drained) {
          EXPECT_FALSE(completion.ok);
          EXPECT_EQ(completion.error, ErrorKind::OutputCopyFailed);
          EXPECT_TRUE(completion.fatal);
          EXPECT_NE(completion.message.find("CUDA_ERROR_"), std::string::npos) << completion.message;
          fatal_seen = fatal_seen || completion.fatal;
        }
      } catch (const Error& error) {
        // The fault may surface on the call itself instead.
        EXPECT_TRUE(error.fatal()) << error.what();
        fatal_seen = fatal_seen || error.fatal();
      }
    }
    EXPECT_TRUE(fatal_seen);
    try {
      backend->submit_copy(request(CopyDirection::HostToDevice, CopyMode::Sync, 2, host.block.data,
                                   device.allocation, 0, 4096));
      ADD_FAILURE() << "a copy in a faulted context succeeded";
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::DeviceCopyFailed);
      EXPECT_TRUE(error.fatal()) << error.what();
    }
  }
  // The primary context, used by everything else, is unaffected.
  AllocationHolder healthy{*backend_, backend_->allocate(4096, 256)};
  EXPECT_NE(healthy.allocation.address, 0u);
}

}  // namespace
}  // namespace devbridge::cuda
