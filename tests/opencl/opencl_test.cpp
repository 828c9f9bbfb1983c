// The OpenCL backend's own rules: how cl_int codes map into the vocabulary
// (no device needed), and what the conformance suite does not cover on a
// real device: device choice, the per-buffer limit, what a view names, how
// the registry offers the backend, and fences as OpenCL events (held
// launches, markers on a consumer's queue, contexts, event references).
#include "devbridge/backends/opencl.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backends/opencl/opencl_api.hpp"
#include "backends/opencl/opencl_errors.hpp"
#include "devbridge/backends.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/consumer_names.hpp"
#include "devbridge/error.hpp"

namespace devbridge::opencl {
namespace {

using detail::classify;
using detail::error_name;
using detail::make_error;
using detail::Operation;
using ::testing::HasSubstr;
using namespace abi;  // OpenCL's names, as cl.h would give them

// ---- the cl_int table ----

TEST(OpenCLErrors, NamesKnownCodesAndNumbersUnknownOnes) {
  EXPECT_EQ(error_name(0), "CL_SUCCESS");
  EXPECT_EQ(error_name(-4), "CL_MEM_OBJECT_ALLOCATION_FAILURE");
  EXPECT_EQ(error_name(-61), "CL_INVALID_BUFFER_SIZE");
  EXPECT_EQ(error_name(-1001), "CL_PLATFORM_NOT_FOUND_KHR");
  EXPECT_EQ(error_name(-9999), "cl_int -9999");
}

TEST(OpenCLErrors, AnOrdinaryFailureTakesTheOperationsKind) {
  for (const auto& [operation, kind] : {std::pair{Operation::Upload, ErrorKind::DeviceCopyFailed},
                                       std::pair{Operation::Download, ErrorKind::OutputCopyFailed},
                                       std::pair{Operation::Allocate, ErrorKind::AllocationFailed},
                                       std::pair{Operation::Setup, ErrorKind::Unavailable}}) {
    const auto cls = classify(-30 /* INVALID_VALUE */, operation);
    EXPECT_EQ(cls.kind, kind);
    EXPECT_FALSE(cls.fatal);
  }
}

TEST(OpenCLErrors, OutOfMemoryIsAllocationFailedOnlyWhenAllocating) {
  EXPECT_EQ(classify(-4, Operation::Allocate).kind, ErrorKind::AllocationFailed);
  EXPECT_EQ(classify(-61, Operation::Allocate).kind, ErrorKind::AllocationFailed);
  EXPECT_EQ(classify(-6, Operation::Upload).kind, ErrorKind::DeviceCopyFailed);
  EXPECT_FALSE(classify(-4, Operation::Allocate).fatal);
}

TEST(OpenCLErrors, ALostDeviceOrPoisonedQueueIsFatal) {
  // OUT_OF_RESOURCES is how GPU drivers report a crashed kernel.
  EXPECT_EQ(classify(-5, Operation::Upload).kind, ErrorKind::DeviceCopyFailed);
  EXPECT_TRUE(classify(-5, Operation::Upload).fatal);
  EXPECT_EQ(classify(-5, Operation::Launch).kind, ErrorKind::Broken);
  EXPECT_TRUE(classify(-2, Operation::Download).fatal);
  EXPECT_TRUE(classify(-14, Operation::Download).fatal);
  // A negative execution status that is no cl_int error: the command was
  // terminated abnormally.
  EXPECT_EQ(classify(-9999, Operation::Upload).kind, ErrorKind::DeviceCopyFailed);
  EXPECT_TRUE(classify(-9999, Operation::Upload).fatal);
}

TEST(OpenCLErrors, MissingDriverAndUnbuildableKernelAreEnvironmentKinds) {
  EXPECT_EQ(classify(-1001, Operation::Setup).kind, ErrorKind::Unavailable);
  EXPECT_EQ(classify(-1, Operation::Setup).kind, ErrorKind::Unavailable);
  EXPECT_EQ(classify(-11, Operation::Launch).kind, ErrorKind::Unsupported);
  EXPECT_EQ(classify(-3, Operation::Launch).kind, ErrorKind::Unsupported);
}

TEST(OpenCLErrors, MessagesNameTheCallTheCodeAndTheDetail) {
  const Error error = make_error(-4, "clCreateBuffer", Operation::Allocate, "4096 bytes asked");
  EXPECT_EQ(error.kind(), ErrorKind::AllocationFailed);
  EXPECT_THAT(error.what(), HasSubstr("clCreateBuffer: CL_MEM_OBJECT_ALLOCATION_FAILURE (-4); 4096 bytes asked"));
  EXPECT_THAT(make_error(-5, "clEnqueueReadBuffer", Operation::Download).what(), HasSubstr("unusable"));
}

// ---- on a device ----

class OpenCLDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    const Probe found = probe();
    if (!found.available) GTEST_SKIP() << "no OpenCL device here: " << found.reason;
  }
};

// Sets an environment variable for one test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

template <class F>
Error error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no devbridge::Error was thrown";
  return Error(ErrorKind::Broken, "nothing thrown");
}

TEST_F(OpenCLDevice, ProbeNamesTheDeviceItWouldOpen) {
  const Probe found = probe();
  EXPECT_GE(found.device_count, 1);
  EXPECT_FALSE(found.chosen_device.empty());
  EXPECT_TRUE(found.reason.empty());
}

TEST_F(OpenCLDevice, DescribesItselfTheWayTinygradAndDLPackNameOpenCL) {
  auto backend = make_opencl_backend();
  const BackendInfo info = backend->describe();
  EXPECT_EQ(info.name, "opencl");
  EXPECT_EQ(info.device_kind, DeviceKind::OpenCL);
  EXPECT_EQ(tinygrad_device(info.device_kind, info.device_ordinal), "CL");
  EXPECT_EQ(dlpack_device(info.device_kind), DLPackDevice::OpenCL);
  EXPECT_GT(info.total_memory, 0u);
  EXPECT_FALSE(info.device_name.empty());
  EXPECT_TRUE(is_opencl_backend(*backend));
}

// Every dtype is held (buffers hold bytes); half and double are computed in
// only with cl_khr_fp16 / cl_khr_fp64, bfloat16 and the float8s never (PoCL
// on a CPU has fp64 and not fp16).
TEST_F(OpenCLDevice, HoldsEveryDTypeAndComputesInHalfAndDoubleOnlyWithTheirExtensions) {
  const BackendInfo info = make_opencl_backend()->describe();
  const auto computes = [&](DType dtype) { return std::ranges::count(info.computed_dtypes(), dtype) == 1; };
  const auto has = [&](std::string_view name) { return std::ranges::count(info.capabilities, name) == 1; };
  for (const auto& dtype : all_dtypes()) EXPECT_EQ(std::ranges::count(info.dtypes, dtype.dtype), 1) << dtype.name;
  EXPECT_EQ(computes(DType::Float16), has("cl_khr_fp16"));
  EXPECT_EQ(computes(DType::Float64), has("cl_khr_fp64"));
  for (DType never : {DType::BFloat16, DType::Fp8E4M3, DType::Fp8E5M2}) EXPECT_FALSE(computes(never));
  EXPECT_TRUE(computes(DType::Float32));
  EXPECT_EQ(info.device_id, "0:0");
}

// A float16 tensor is stored and moved bit-exact on a device without
// cl_khr_fp16 (a checkpoint restores onto it): holding needs no kernel.
TEST_F(OpenCLDevice, ABridgeHoldsFloat16WithoutTheExtension) {
  Bridge bridge(make_opencl_backend(), BridgeOptions{.ring_bytes = 1 << 20});
  constexpr std::uint64_t kBytes = 1024;
  const auto h = bridge.alloc_device(ObjectSpec{kBytes, 2, DType::Float16}, kBytes);
  const auto up = bridge.reserve(kBytes);
  const auto down = bridge.reserve(kBytes);
  auto in = bridge.host_bytes(up);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::byte>(i * 131 + 7);
  bridge.host_to_device(up, DeviceRange{h, 0, kBytes}, CopyMode::Sync);
  bridge.device_to_host(DeviceRange{h, 0, kBytes}, down, CopyMode::Sync);
  const auto out = bridge.host_bytes(down);
  EXPECT_TRUE(std::equal(in.begin(), in.end(), out.begin()));
  { auto lease = bridge.view(h, ViewSpec{DType::Float16, Dims{512}, std::nullopt, 0}); }
  bridge.release_host(up);
  bridge.release_host(down);
  bridge.free_device(h);
}

TEST_F(OpenCLDevice, TheDeviceOptionPicksPlatformAndDevice) {
  EXPECT_EQ(make_opencl_backend(BackendOptions{{"device", "0:0"}})->describe().device_id, "0:0");
  const Error missing = error_of([] { make_opencl_backend(BackendOptions{{"device", "5:0"}}); });
  EXPECT_EQ(missing.kind(), ErrorKind::Unavailable);
  const Error malformed = error_of([] { make_opencl_backend(BackendOptions{{"device", "zero"}}); });
  EXPECT_EQ(malformed.kind(), ErrorKind::Unsupported);
  EXPECT_THAT(malformed.what(), HasSubstr("device='zero'"));
  // Strictly two decimal indexes: an index past int's range named another device once (it wrapped).
  for (const char* bad : {"4294967296:0", "4294967297:0", " +0: 0", "0:0 ", "-0:0", "0:", ":0", "0x0:0", "0:0:0"})
    EXPECT_EQ(error_of([&] { make_opencl_backend(BackendOptions{{"device", bad}}); }).kind(), ErrorKind::Unsupported)
        << bad;
  const Error unknown = error_of([] { make_opencl_backend(BackendOptions{{"ordinal", "0"}}); });
  EXPECT_EQ(unknown.kind(), ErrorKind::Unsupported);
  EXPECT_THAT(unknown.what(), HasSubstr("no option 'ordinal'"));
}

TEST_F(OpenCLDevice, ADeviceThatIsNotThereIsUnavailableAndNamed) {
  const Error by_options = error_of([] { make_opencl_backend(Options{.platform = 7, .device = 3}); });
  EXPECT_EQ(by_options.kind(), ErrorKind::Unavailable);
  EXPECT_THAT(by_options.what(), HasSubstr("no OpenCL device 7:3"));

  const ScopedEnv bad("DEVBRIDGE_OPENCL_DEVICE", "first");
  const Error by_env = error_of([] { make_opencl_backend(); });
  EXPECT_EQ(by_env.kind(), ErrorKind::Unavailable);
  EXPECT_THAT(by_env.what(), HasSubstr("DEVBRIDGE_OPENCL_DEVICE='first' is not <platform>:<device>"));
}

TEST_F(OpenCLDevice, TheEnvironmentChoosesTheDevice) {
  {
    const ScopedEnv first("DEVBRIDGE_OPENCL_DEVICE", "0:0");
    auto backend = make_opencl_backend();
    EXPECT_THAT(backend->describe().notes, HasSubstr("device 0:0"));
  }
  // 0:0 is also the default here; a device that is not there proves the variable is read.
  const ScopedEnv missing("DEVBRIDGE_OPENCL_DEVICE", "0:99");
  EXPECT_THAT(error_of([] { make_opencl_backend(); }).what(), HasSubstr("no OpenCL device 0:99"));
}

TEST_F(OpenCLDevice, ABufferOverTheDevicesLimitIsRefusedBeforeTheDriverSeesIt) {
  Bridge bridge(make_opencl_backend(), BridgeOptions{.ring_bytes = 1 << 20});
  auto& backend = bridge.backend();
  const Error error = error_of([&] { backend.allocate(std::uint64_t{1} << 62, 64); });
  EXPECT_EQ(error.kind(), ErrorKind::AllocationFailed);
  EXPECT_THAT(error.what(), HasSubstr("CL_DEVICE_MAX_MEM_ALLOC_SIZE"));
  EXPECT_THAT(error.what(), HasSubstr(std::to_string(std::uint64_t{1} << 62)));
  EXPECT_EQ(backend.test_controls()->live_allocations(), 0u);
}

// Issue 10, defect 2: a ring within a page of 2^64 wrapped `bytes + page`
// into a 4 KiB buffer that reported the whole size. Every ring the device
// cannot hold in one buffer is AllocationFailed naming the size asked.
TEST_F(OpenCLDevice, ARingTooLargeForOneBufferIsRefusedNamingItsSize) {
  auto backend = make_opencl_backend();
  constexpr std::uint64_t kMax = ~std::uint64_t{0};
  for (const std::uint64_t bytes : {kMax, kMax - 1, kMax - 4095, kMax - 4096, std::uint64_t{1} << 63}) {
    SCOPED_TRACE("allocate_host " + std::to_string(bytes));
    const Error error = error_of([&] { backend->allocate_host(bytes); });
    EXPECT_EQ(error.kind(), ErrorKind::AllocationFailed);
    EXPECT_THAT(error.what(), HasSubstr(std::to_string(bytes)));
  }
  const HostBlock block = backend->allocate_host(4096);
  EXPECT_EQ(block.bytes, 4096u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block.data) % 4096, 0u);
  std::memset(block.data, 0x5A, 4096);  // all of it is there
  backend->free_host(block);
}

// Ranges that reach the backend past the bridge are the seam's InvalidRange.
TEST_F(OpenCLDevice, RangesOutsideABufferAreInvalidRange) {
  auto backend = make_opencl_backend();
  constexpr std::uint64_t kMax = ~std::uint64_t{0};
  const HostBlock ring = backend->allocate_host(4096);
  const DeviceAllocation buffer = backend->allocate(4096, 64);
  struct Range {
    std::uint64_t offset, len;
  };
  for (const Range range : {Range{4096, 1}, Range{1, 4096}, Range{kMax, 2}, Range{std::uint64_t{1} << 63,
                                                                                  std::uint64_t{1} << 63}}) {
    SCOPED_TRACE("device range " + std::to_string(range.offset) + " +" + std::to_string(range.len));
    for (const CopyMode mode : {CopyMode::Sync, CopyMode::Async}) {
      const CopyRequest request{CopyDirection::HostToDevice, mode, CopyEvent{1, 1, 1}, ring.data, buffer,
                                range.offset, range.len, CopyLayout{}};
      EXPECT_EQ(error_of([&] { backend->submit_copy(request); }).kind(), ErrorKind::InvalidRange);
    }
    const AxpyLaunch launch{buffer, range.offset, buffer, 0, range.len / 4 + 1, 1.0f, 0.0f};
    EXPECT_EQ(error_of([&] { backend->launch_axpy(launch); }).kind(), ErrorKind::InvalidRange);
  }
  // Not whole float32 elements, and a count whose byte size does not fit.
  EXPECT_EQ(error_of([&] { backend->launch_axpy(AxpyLaunch{buffer, 2, buffer, 0, 4, 1.0f, 0.0f}); }).kind(),
            ErrorKind::InvalidRange);
  EXPECT_EQ(error_of([&] { backend->launch_axpy(AxpyLaunch{buffer, 0, buffer, 0, kMax / 2, 1.0f, 0.0f}); }).kind(),
            ErrorKind::InvalidRange);
  std::vector<Completion> drained;
  backend->quiesce();
  backend->drain_completions(drained);
  EXPECT_TRUE(drained.empty()) << "a refused copy must not be reported";
  backend->free(buffer);
  backend->free_host(ring);
  EXPECT_EQ(backend->test_controls()->live_allocations(), 0u);
}

// A timeout too large to add to the clock waits; it does not return at once.
TEST_F(OpenCLDevice, AHugeWaitTimeoutWaitsForTheCopy) {
  auto backend = make_opencl_backend();
  const HostBlock ring = backend->allocate_host(4096);
  const DeviceAllocation buffer = backend->allocate(4096, 64);
  backend->test_controls()->hold_copies(true);
  backend->submit_copy(CopyRequest{CopyDirection::HostToDevice, CopyMode::Async, CopyEvent{1, 1, 7}, ring.data,
                                   buffer, 0, 4096, CopyLayout{}});
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    backend->test_controls()->hold_copies(false);
  });
  std::vector<Completion> drained;
  const auto start = std::chrono::steady_clock::now();
  while (drained.empty()) {
    EXPECT_TRUE(backend->wait_for_completions(std::chrono::nanoseconds::max()));
    backend->drain_completions(drained);
    ASSERT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  }
  releaser.join();
  ASSERT_EQ(drained.size(), 1u);
  EXPECT_TRUE(drained[0].ok);
  backend->free(buffer);
  backend->free_host(ring);
}

TEST_F(OpenCLDevice, AViewNamesTheBufferByHandleWithTheOffsetApart) {
  Bridge bridge(make_opencl_backend(), BridgeOptions{.ring_bytes = 1 << 20});
  const DeviceHandle h = bridge.alloc_device(ObjectSpec{4096, 64, DType::Float32, ShapeKind::Vector}, 4096);
  const ViewLease lease = bridge.view(h, ViewSpec{DType::Float32, Dims{16}, std::nullopt, 64});
  EXPECT_NE(lease->data, 0u);  // the cl_mem
  EXPECT_EQ(lease->byte_offset, 64u);
  EXPECT_EQ(lease->device, "CL");
  EXPECT_EQ(lease->dlpack_device_type, static_cast<int>(DLPackDevice::OpenCL));
  EXPECT_EQ(bridge.backend().test_controls()->live_allocations(), 1u);
}

TEST_F(OpenCLDevice, TheRegistryOffersItByNameAndAutoOnlyForAGpu) {
  EXPECT_TRUE(is_opencl_backend(*make_backend("opencl")));
  bool listed = false;
  for (const auto& entry : list_backends()) {
    if (entry.name == "opencl") listed = entry.built && entry.available;
  }
  EXPECT_TRUE(listed);
  auto chosen = make_backend("auto");
  EXPECT_EQ(is_opencl_backend(*chosen), probe().has_gpu) << "auto chose " << chosen->describe().name;
}

// ---- fences ----

const detail::Api& cl() { return detail::api(); }

cl_event as_event(Fence fence) { return reinterpret_cast<cl_event>(fence.token); }

cl_uint reference_count(cl_event event) {
  cl_uint count = 0;
  EXPECT_EQ(cl().clGetEventInfo(event, CL_EVENT_REFERENCE_COUNT, sizeof count, &count, nullptr), CL_SUCCESS);
  return count;
}

cl_device_id device_of(cl_context context) {
  cl_device_id device = nullptr;
  EXPECT_EQ(cl().clGetContextInfo(context, CL_CONTEXT_DEVICES, sizeof device, &device, nullptr), CL_SUCCESS);
  return device;
}

// An in-order queue of the test's, standing in for a consumer's (pyopencl,
// tinygrad); block() parks it behind a user event.
class ConsumerQueue {
 public:
  explicit ConsumerQueue(cl_context context) : context_(context) {
    cl_int result = CL_SUCCESS;
    queue_ = cl().clCreateCommandQueue(context_, device_of(context_), 0, &result);
    EXPECT_EQ(result, CL_SUCCESS);
  }
  ~ConsumerQueue() {
    unblock();
    cl().clFinish(queue_);
    cl().clReleaseCommandQueue(queue_);
  }
  ConsumerQueue(const ConsumerQueue&) = delete;
  ConsumerQueue& operator=(const ConsumerQueue&) = delete;

  cl_command_queue get() const { return queue_; }
  std::uintptr_t handle() const { return reinterpret_cast<std::uintptr_t>(queue_); }
  QueueRef ref() const { return QueueRef{Queue::Consumer, handle()}; }

  void block() {
    cl_int result = CL_SUCCESS;
    gate_ = cl().clCreateUserEvent(context_, &result);
    ASSERT_EQ(result, CL_SUCCESS);
    ASSERT_EQ(cl().clEnqueueMarkerWithWaitList(queue_, 1, &gate_, nullptr), CL_SUCCESS);
    cl().clFlush(queue_);
  }
  void unblock() {
    if (gate_ == nullptr) return;
    cl().clSetUserEventStatus(gate_, CL_COMPLETE);
    cl().clReleaseEvent(gate_);
    gate_ = nullptr;
    cl().clFlush(queue_);
  }

 private:
  cl_context context_;
  cl_command_queue queue_ = nullptr;
  cl_event gate_ = nullptr;
};

// A context of the test's own on the same device: its queues are not the backend's.
class OtherContext {
 public:
  explicit OtherContext(cl_device_id device) {
    cl_int result = CL_SUCCESS;
    context_ = cl().clCreateContext(nullptr, 1, &device, nullptr, nullptr, &result);
    EXPECT_EQ(result, CL_SUCCESS);
  }
  ~OtherContext() { cl().clReleaseContext(context_); }
  OtherContext(const OtherContext&) = delete;
  OtherContext& operator=(const OtherContext&) = delete;
  cl_context get() const { return context_; }

 private:
  cl_context context_ = nullptr;
};

// A backend with a ring, an x buffer holding 0..n-1 and a y buffer, to launch over.
class OpenCLFences : public OpenCLDevice {
 protected:
  static constexpr std::uint64_t kCount = 1024;
  static constexpr std::uint64_t kBytes = kCount * sizeof(float);

  void SetUp() override {
    OpenCLDevice::SetUp();
    if (IsSkipped()) return;
    backend_ = make_opencl_backend();
    ring_ = backend_->allocate_host(2 * kBytes);
    x_ = backend_->allocate(kBytes, 64);
    y_ = backend_->allocate(kBytes, 64);
    auto* values = reinterpret_cast<float*>(ring_.data);
    for (std::uint64_t i = 0; i < kCount; ++i) values[i] = static_cast<float>(i);
    copy(CopyDirection::HostToDevice, x_, 0);
  }
  void TearDown() override {
    if (!backend_) return;
    backend_->quiesce();
    std::vector<Completion> drained;
    backend_->drain_completions(drained);
    backend_->free(x_);
    backend_->free(y_);
    backend_->free_host(ring_);
    EXPECT_EQ(backend_->test_controls()->live_allocations(), 0u);
    EXPECT_EQ(*backend_->test_controls()->live_fences(), 0u) << "a fence was never given back";
  }

  void copy(CopyDirection direction, const DeviceAllocation& buffer, std::uint64_t ring_offset,
            CopyMode mode = CopyMode::Sync, std::uint64_t id = 1) {
    backend_->submit_copy(
        CopyRequest{direction, mode, CopyEvent{1, 1, id}, ring_.data + ring_offset, buffer, 0, kBytes, CopyLayout{}});
  }
  Fence launch() { return backend_->launch_axpy(AxpyLaunch{x_, 0, y_, 0, kCount, 2.0f, 1.0f}); }
  // y as the launch left it, read back through the ring's second half.
  void expect_y_computed() {
    copy(CopyDirection::DeviceToHost, y_, kBytes);
    const auto* y = reinterpret_cast<const float*>(ring_.data + kBytes);
    for (std::uint64_t i = 0; i < kCount; i += 127) ASSERT_EQ(y[i], 2.0f * static_cast<float>(i) + 1.0f) << i;
  }
  cl_context context() { return reinterpret_cast<cl_context>(backend_->describe().native_context); }

  std::unique_ptr<Backend> backend_;
  HostBlock ring_;
  DeviceAllocation x_, y_;
};

TEST_F(OpenCLFences, ALaunchsFencePendsWhileHeldAndPassesOnceLifted) {
  backend_->test_controls()->hold_copies(true);
  const Fence fence = launch();
  ASSERT_TRUE(fence.pending());
  EXPECT_EQ(*backend_->test_controls()->live_fences(), 1u);
  EXPECT_FALSE(backend_->fence_passed(fence));
  EXPECT_FALSE(backend_->wait_fence(fence, std::chrono::nanoseconds::zero()));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(backend_->wait_fence(fence, std::chrono::milliseconds(30)));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(30));
  EXPECT_FALSE(backend_->fence_passed(fence)) << "the held kernel ran";

  // A timeout too large to add to the clock waits until the fence passes.
  std::thread lifter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    backend_->test_controls()->hold_copies(false);
  });
  EXPECT_TRUE(backend_->wait_fence(fence, std::chrono::nanoseconds::max()));
  lifter.join();
  EXPECT_TRUE(backend_->fence_passed(fence));
  backend_->release_fence(fence);
  EXPECT_EQ(*backend_->test_controls()->live_fences(), 0u);
  expect_y_computed();
}

TEST_F(OpenCLFences, AnEmptyLaunchHasAlreadyPassed) {
  EXPECT_FALSE(backend_->launch_axpy(AxpyLaunch{x_, 0, y_, 0, 0, 2.0f, 1.0f}).pending());
  EXPECT_EQ(*backend_->test_controls()->live_fences(), 0u);
}

TEST_F(OpenCLFences, QuiesceLeavesEveryFenceOnItsOwnQueuesPassed) {
  backend_->test_controls()->hold_copies(true);
  copy(CopyDirection::HostToDevice, x_, 0, CopyMode::Async, 2);
  std::vector<Fence> fences{launch()};
  for (const Queue queue : {Queue::CopyUp, Queue::CopyDown, Queue::Compute})
    fences.push_back(backend_->record_fence(QueueRef{queue}));
  for (const Fence fence : fences) {
    ASSERT_TRUE(fence.pending());
    EXPECT_FALSE(backend_->fence_passed(fence)) << "a fence after held work passed";
  }
  backend_->quiesce();
  for (const Fence fence : fences) {
    EXPECT_TRUE(backend_->fence_passed(fence)) << "quiesce left a fence on its own queue pending";
    backend_->release_fence(fence);
  }
  expect_y_computed();
}

TEST_F(OpenCLFences, AFenceOnTheBridgesQueuesWaitsForEverythingBeforeIt) {
  backend_->test_controls()->hold_copies(true);
  copy(CopyDirection::DeviceToHost, x_, 0, CopyMode::Async, 2);
  // Copies up and down and the compute role share one in-order queue: a
  // fence on any of them waits for the held download.
  const Fence fence = backend_->record_fence(QueueRef{Queue::CopyUp});
  EXPECT_FALSE(backend_->wait_fence(fence, std::chrono::milliseconds(20)));
  backend_->test_controls()->hold_copies(false);
  EXPECT_TRUE(backend_->wait_fence(fence, std::chrono::seconds(30)));
  std::vector<Completion> drained;
  while (drained.empty()) {
    backend_->wait_for_completions(std::chrono::seconds(1));
    backend_->drain_completions(drained);
  }
  EXPECT_TRUE(drained[0].ok) << drained[0].message;
  backend_->release_fence(fence);
}

TEST_F(OpenCLFences, AConsumersFenceOnABlockedQueuePendsUntilUnblocked) {
  ConsumerQueue consumer(context());
  consumer.block();
  const Fence fence = backend_->record_fence(consumer.ref());
  ASSERT_TRUE(fence.pending());
  EXPECT_FALSE(backend_->fence_passed(fence));
  EXPECT_FALSE(backend_->wait_fence(fence, std::chrono::milliseconds(20)));
  // Not the backend's queue: quiesce neither finishes nor waits for it.
  backend_->quiesce();
  EXPECT_FALSE(backend_->fence_passed(fence));
  consumer.unblock();
  EXPECT_TRUE(backend_->wait_fence(fence, std::chrono::seconds(30)));
  backend_->release_fence(fence);
}

TEST_F(OpenCLFences, AQueueOfAnotherContextIsRefusedNamingTheMismatch) {
  OtherContext other(device_of(context()));
  ConsumerQueue foreign(other.get());
  for (const auto& attempt : std::vector<std::function<void()>>{
           [&] { backend_->record_fence(foreign.ref()); }, [&] { backend_->order_consumer_queue(foreign.handle()); }}) {
    const Error refused = error_of(attempt);
    EXPECT_EQ(refused.kind(), ErrorKind::ForeignDomain);
    EXPECT_THAT(refused.what(), HasSubstr("belongs to OpenCL context"));
    EXPECT_THAT(refused.what(), HasSubstr("native_context"));
  }
  const Error none = error_of([&] { backend_->record_fence(QueueRef{Queue::Consumer, 0}); });
  EXPECT_EQ(none.kind(), ErrorKind::Unsupported);
  EXPECT_THAT(none.what(), HasSubstr("no default queue"));
  EXPECT_EQ(error_of([&] { backend_->order_consumer_queue(0); }).kind(), ErrorKind::Unsupported);
  EXPECT_EQ(*backend_->test_controls()->live_fences(), 0u) << "a refused fence left an event behind";
}

// A consumer's queue arrives as a number (DLPack's `stream`), and the
// driver dereferences whatever it is handed: CUDA's default streams (1, 2),
// small numbers, unaligned or unmapped addresses and memory that is not an
// OpenCL object are refused before the driver sees them (each crashed the
// process), and a real queue of the context still works.
TEST_F(OpenCLFences, ANumberThatCannotBeAQueueIsRefusedWithoutReachingTheDriver) {
  std::vector<std::uintptr_t> plain_memory(64, 0x5a5a5a5a5a5a5a5aull);  // readable, not an OpenCL object
  const auto unmapped = [] {
    void* page = ::mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ::munmap(page, 4096);
    return reinterpret_cast<std::uintptr_t>(page);
  }();
  ConsumerQueue real(context());
  for (const std::uintptr_t number :
       {std::uintptr_t{1}, std::uintptr_t{2}, std::uintptr_t{5}, std::uintptr_t{4096}, real.handle() + 1, unmapped,
        reinterpret_cast<std::uintptr_t>(plain_memory.data() + 8)}) {
    for (const auto& attempt : std::vector<std::function<void()>>{
             [&] { backend_->record_fence(QueueRef{Queue::Consumer, number}); },
             [&] { backend_->order_consumer_queue(number); }}) {
      const Error refused = error_of(attempt);
      EXPECT_EQ(refused.kind(), ErrorKind::Unsupported) << number << ": " << refused.what();
      EXPECT_THAT(refused.what(), HasSubstr("is not a cl_command_queue")) << number;
      EXPECT_THAT(refused.what(), HasSubstr(fmt::format("{:#x}", number)));
    }
  }
  EXPECT_EQ(*backend_->test_controls()->live_fences(), 0u) << "a refused fence left an event behind";
  const Fence fence = backend_->record_fence(real.ref());
  EXPECT_TRUE(backend_->wait_fence(fence, std::chrono::seconds(30)));
  backend_->release_fence(fence);
  backend_->order_consumer_queue(real.handle());
}

// DLPack's `stream`: the consumer's queue waits on the device for the
// bridge's held work; a read it enqueues then sees the kernel's output.
TEST_F(OpenCLFences, OrderingAConsumersQueueMakesItWaitForTheBridgesWork) {
  ConsumerQueue consumer(context());
  backend_->test_controls()->hold_copies(true);
  const Fence launched = launch();
  backend_->order_consumer_queue(consumer.handle());
  std::vector<float> seen(kCount, -1.0f);
  cl_event read = nullptr;
  ASSERT_EQ(cl().clEnqueueReadBuffer(consumer.get(), reinterpret_cast<cl_mem>(y_.token), CL_FALSE, 0, kBytes,
                                     seen.data(), 0, nullptr, &read),
            CL_SUCCESS);
  cl().clFlush(consumer.get());
  const Fence after = backend_->record_fence(consumer.ref());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  cl_int status = CL_QUEUED;
  ASSERT_EQ(cl().clGetEventInfo(read, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, nullptr),
            CL_SUCCESS);
  EXPECT_GT(status, CL_COMPLETE) << "the consumer read before the bridge's held launch ran";
  EXPECT_FALSE(backend_->fence_passed(after));

  backend_->test_controls()->hold_copies(false);
  EXPECT_TRUE(backend_->wait_fence(after, std::chrono::seconds(30)));
  ASSERT_EQ(cl().clWaitForEvents(1, &read), CL_SUCCESS);
  cl().clReleaseEvent(read);
  for (std::uint64_t i = 0; i < kCount; i += 127) EXPECT_EQ(seen[i], 2.0f * static_cast<float>(i) + 1.0f) << i;
  EXPECT_TRUE(backend_->fence_passed(launched));
  backend_->release_fence(launched);
  backend_->release_fence(after);
  EXPECT_EQ(*backend_->test_controls()->live_fences(), 0u) << "ordering left its marker behind";
}

// The backend holds exactly one reference to a fence's event and gives it
// back in release_fence: counted on the event itself.
TEST_F(OpenCLFences, ReleasingAFenceGivesBackItsOneEventReference) {
  ConsumerQueue consumer(context());
  const std::vector<Fence> fences{launch(), backend_->record_fence(QueueRef{Queue::Compute}),
                                  backend_->record_fence(consumer.ref())};
  EXPECT_EQ(*backend_->test_controls()->live_fences(), fences.size());
  backend_->quiesce();
  cl().clFinish(consumer.get());
  for (const Fence fence : fences) {
    ASSERT_TRUE(backend_->wait_fence(fence, std::chrono::seconds(30)));
    cl_event event = as_event(fence);
    ASSERT_EQ(cl().clRetainEvent(event), CL_SUCCESS);  // keeps it countable past release_fence
    const cl_uint before = reference_count(event);
    backend_->release_fence(fence);
    EXPECT_EQ(reference_count(event), before - 1);
    cl().clReleaseEvent(event);
  }
  EXPECT_EQ(*backend_->test_controls()->live_fences(), 0u);
}

// A command that ended abnormally runs no more: whatever its fence holds may go.
TEST_F(OpenCLFences, AFenceBehindAFailedCommandHasPassed) {
  cl_int result = CL_SUCCESS;
  cl_event failed = cl().clCreateUserEvent(context(), &result);
  ASSERT_EQ(result, CL_SUCCESS);
  const Fence fence{reinterpret_cast<std::uintptr_t>(failed)};  // the test's own event, never released by the backend
  EXPECT_FALSE(backend_->fence_passed(fence));
  ASSERT_EQ(cl().clSetUserEventStatus(failed, -9999), CL_SUCCESS);
  EXPECT_TRUE(backend_->fence_passed(fence));
  EXPECT_TRUE(backend_->wait_fence(fence, std::chrono::seconds(1)));
  cl().clReleaseEvent(failed);
}

TEST_F(OpenCLFences, NativeContextIsTheContextOfTheBridgesBuffers) {
  cl_context of_buffer = nullptr;
  ASSERT_EQ(cl().clGetCommandQueueInfo(ConsumerQueue(context()).get(), CL_QUEUE_CONTEXT, sizeof of_buffer, &of_buffer,
                                       nullptr),
            CL_SUCCESS);
  EXPECT_EQ(of_buffer, context());
}

// Through the bridge: a release right after a launch on a held queue waits
// for the kernel (the use-after-free the old seam allowed), and every fence
// is given back.
TEST_F(OpenCLDevice, ABridgeFreesMemoryUnderAHeldLaunchOnlyAfterTheKernel) {
  // Without the caching pool, so that "freed" means back in the driver.
  Bridge bridge(make_opencl_backend(), BridgeOptions{.ring_bytes = 1 << 20, .caching_pool = CachingPool::Off});
  Backend& backend = bridge.backend();
  const ObjectSpec spec{4096, 64, DType::Float32, ShapeKind::Vector};
  const DeviceHandle x = bridge.alloc_device(spec, 4096);
  const DeviceHandle y = bridge.alloc_device(spec, 4096);
  backend.test_controls()->hold_copies(true);
  bridge.launch_axpy(DeviceRange{x, 0, 4096}, DeviceRange{y, 0, 4096}, 2.0f, 1.0f);
  bridge.release(x);
  bridge.release(y);
  bridge.poll();
  EXPECT_EQ(backend.test_controls()->live_allocations(), 2u) << "memory freed under a held kernel";
  EXPECT_GE(*backend.test_controls()->live_fences(), 1u) << "the launch's fence is not held";
  backend.test_controls()->hold_copies(false);
  const auto start = std::chrono::steady_clock::now();
  while (backend.test_controls()->live_allocations() != 0) {
    ASSERT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "never freed";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    bridge.poll();
  }
  EXPECT_EQ(*backend.test_controls()->live_fences(), 0u) << "a passed fence was not given back";
}

TEST(OpenCLControls, AnotherBackendAnswersOnlyWhatItCounts) {
  auto backend = make_backend("fake");
  EXPECT_FALSE(is_opencl_backend(*backend));
  ASSERT_NE(backend->test_controls(), nullptr);
  EXPECT_NE(backend->test_controls()->fake(), nullptr);
  auto host = make_backend("host");
  ASSERT_NE(host->test_controls(), nullptr);
  EXPECT_FALSE(host->test_controls()->live_fences().has_value()) << "the host backend counts no fences";
  EXPECT_FALSE(host->test_controls()->live_registrations().has_value());
}

}  // namespace
}  // namespace devbridge::opencl
