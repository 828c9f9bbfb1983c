// The CUDA backend's fences (the seam's Queue/Fence): launches, the
// backend's own streams, a consumer's stream, the default streams, recycling
// of fence events, quiesce, and a faulted context. Skipped, with the probe's
// reason, without a usable driver; the emulated driver (DEVBRIDGE_LIBCUDA)
// runs them everywhere, and its test hooks make a few checks exact (skipped
// on a real driver).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/cuda_driver.hpp"
#include "cuda_test_support.hpp"
#include "devbridge/backends/cuda.hpp"

namespace devbridge::cuda {
namespace {

using namespace std::chrono_literals;
using testing::AllocationHolder;
using testing::emulator_hook;
using testing::FenceHolder;
using testing::HostBlockHolder;
using testing::OwnContext;
using detail::CU_STREAM_NON_BLOCKING;
using detail::CUcontext;
using detail::CUDA_ERROR_INVALID_VALUE;
using detail::CUDA_SUCCESS;
using detail::CUstream;

using Counter = unsigned long long (*)();
using FailRecord = void (*)(long long, int);

const detail::Driver& cu() { return detail::driver(); }

// `context` current for one scope.
class Current {
 public:
  explicit Current(void* context) {
    EXPECT_EQ(cu().cuCtxPushCurrent_v2(static_cast<CUcontext>(context)), CUDA_SUCCESS);
  }
  ~Current() {
    CUcontext popped = nullptr;
    cu().cuCtxPopCurrent_v2(&popped);
  }
  Current(const Current&) = delete;
  Current& operator=(const Current&) = delete;
};

// A consumer's stream in `context`, blocked by a host function until
// unblock() (what a DLPack consumer's or tinygrad's stream would be).
class ConsumerStream {
 public:
  explicit ConsumerStream(void* context) : context_(context) {
    Current current(context_);
    EXPECT_EQ(cu().cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  }
  ~ConsumerStream() {
    unblock();
    Current current(context_);
    cu().cuStreamSynchronize(stream_);
    cu().cuStreamDestroy_v2(stream_);
  }
  ConsumerStream(const ConsumerStream&) = delete;
  ConsumerStream& operator=(const ConsumerStream&) = delete;

  std::uintptr_t handle() const { return reinterpret_cast<std::uintptr_t>(stream_); }

  void block() {
    Current current(context_);
    ASSERT_EQ(cu().cuLaunchHostFunc(stream_, &ConsumerStream::wait, this), CUDA_SUCCESS);
  }
  void unblock() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    opened_.notify_all();
  }

 private:
  static void wait(void* data) {
    auto* self = static_cast<ConsumerStream*>(data);
    std::unique_lock lock(self->mutex_);
    self->opened_.wait(lock, [&] { return self->open_; });
  }

  void* context_;
  CUstream stream_ = nullptr;
  std::mutex mutex_;
  std::condition_variable opened_;
  bool open_ = false;
};

class CudaFenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const Probe found = probe();
    if (!found.available) GTEST_SKIP() << "no usable CUDA device: " << found.reason;
    backend_ = make_cuda_backend();
  }
  void TearDown() override {
    if (backend_) backend_->test_controls()->hold_copies(false);
  }

  CopyRequest copy(CopyDirection direction, std::uint64_t id, std::byte* host, const DeviceAllocation& device,
                   std::uint64_t len) {
    CopyRequest r;
    r.direction = direction;
    r.mode = CopyMode::Async;
    r.event = CopyEvent{7, 1, id};
    r.host = host;
    r.device = device;
    r.len = len;
    return r;
  }

  std::unique_ptr<Backend> backend_;
};

TEST_F(CudaFenceTest, ZeroFenceHasPassedAndAnEmptyLaunchGetsIt) {
  EXPECT_TRUE(backend_->fence_passed(Fence{}));
  EXPECT_TRUE(backend_->wait_fence(Fence{}, 0ns));
  backend_->release_fence(Fence{});  // nothing to give back
  AllocationHolder x{*backend_, backend_->allocate(4096, 256)};
  EXPECT_FALSE(backend_->launch_axpy(AxpyLaunch{x.allocation, 0, x.allocation, 0, 0, 1.0f, 0.0f}).pending());
}

TEST_F(CudaFenceTest, LaunchFencePendsWhileHeldAndPassesOnceReleased) {
  constexpr std::uint64_t kCount = 4096;
  AllocationHolder x{*backend_, backend_->allocate(kCount * sizeof(float), 256)};
  backend_->test_controls()->hold_copies(true);
  FenceHolder launched{*backend_, backend_->launch_axpy(AxpyLaunch{x.allocation, 0, x.allocation, 0, kCount, 2.0f, 1.0f})};
  ASSERT_TRUE(launched.fence.pending());
  FenceHolder compute{*backend_, backend_->record_fence(QueueRef{Queue::Compute})};
  EXPECT_FALSE(backend_->fence_passed(launched.fence)) << "a held launch finished";
  EXPECT_FALSE(backend_->fence_passed(compute.fence));
  EXPECT_FALSE(backend_->wait_fence(launched.fence, 0ns));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(backend_->wait_fence(launched.fence, 30ms));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 30ms);
  backend_->test_controls()->hold_copies(false);
  EXPECT_TRUE(backend_->wait_fence(launched.fence, 30s));
  EXPECT_TRUE(backend_->wait_fence(compute.fence, 30s));
  EXPECT_TRUE(backend_->fence_passed(launched.fence));
}

TEST_F(CudaFenceTest, WaitWithoutTimeoutReturnsWhenTheFencePasses) {
  AllocationHolder x{*backend_, backend_->allocate(4096, 256)};
  backend_->test_controls()->hold_copies(true);
  FenceHolder launched{*backend_, backend_->launch_axpy(AxpyLaunch{x.allocation, 0, x.allocation, 0, 1024, 1.0f, 0.0f})};
  auto waiter = std::async(std::launch::async, [&] {
    return backend_->wait_fence(launched.fence, std::chrono::nanoseconds::max());
  });
  EXPECT_EQ(waiter.wait_for(50ms), std::future_status::timeout) << "an unbounded wait returned while held";
  backend_->test_controls()->hold_copies(false);
  ASSERT_EQ(waiter.wait_for(30s), std::future_status::ready);
  EXPECT_TRUE(waiter.get());
}

TEST_F(CudaFenceTest, CopyStreamFencesFollowTheirCopies) {
  HostBlockHolder host{*backend_, backend_->allocate_host(1 << 16)};
  AllocationHolder device{*backend_, backend_->allocate(1 << 16, 256)};
  backend_->test_controls()->hold_copies(true);
  backend_->submit_copy(copy(CopyDirection::HostToDevice, 1, host.block.data, device.allocation, 1 << 15));
  backend_->submit_copy(copy(CopyDirection::DeviceToHost, 2, host.block.data + (1 << 15), device.allocation, 1 << 15));
  FenceHolder up{*backend_, backend_->record_fence(QueueRef{Queue::CopyUp})};
  FenceHolder down{*backend_, backend_->record_fence(QueueRef{Queue::CopyDown})};
  EXPECT_FALSE(backend_->fence_passed(up.fence));
  EXPECT_FALSE(backend_->fence_passed(down.fence));
  backend_->test_controls()->hold_copies(false);
  EXPECT_TRUE(backend_->wait_fence(up.fence, 30s));
  EXPECT_TRUE(backend_->wait_fence(down.fence, 30s));
  // A fence passes only after the copies before it: both are complete now.
  std::vector<Completion> drained;
  backend_->drain_completions(drained);
  EXPECT_EQ(drained.size(), 2u);
}

TEST_F(CudaFenceTest, QuiesceLeavesEveryFenceOnItsOwnStreamsPassed) {
  HostBlockHolder host{*backend_, backend_->allocate_host(1 << 16)};
  AllocationHolder device{*backend_, backend_->allocate(1 << 16, 256)};
  backend_->test_controls()->hold_copies(true);
  backend_->submit_copy(copy(CopyDirection::HostToDevice, 1, host.block.data, device.allocation, 1 << 15));
  FenceHolder launched{*backend_,
                       backend_->launch_axpy(AxpyLaunch{device.allocation, 0, device.allocation, 0, 1024, 1.0f, 0.0f})};
  backend_->submit_copy(copy(CopyDirection::DeviceToHost, 2, host.block.data + (1 << 15), device.allocation, 1 << 15));
  std::vector<std::unique_ptr<FenceHolder>> fences;
  for (Queue queue : {Queue::CopyUp, Queue::CopyDown, Queue::Compute})
    fences.push_back(std::make_unique<FenceHolder>(*backend_, backend_->record_fence(QueueRef{queue})));
  for (const auto& held : fences) EXPECT_FALSE(backend_->fence_passed(held->fence));
  EXPECT_FALSE(backend_->fence_passed(launched.fence));
  backend_->quiesce();
  // No wait: quiesce itself finished them.
  EXPECT_TRUE(backend_->fence_passed(launched.fence));
  for (const auto& held : fences) EXPECT_TRUE(backend_->fence_passed(held->fence));
  std::vector<Completion> drained;
  backend_->drain_completions(drained);
  EXPECT_EQ(drained.size(), 2u);
}

TEST_F(CudaFenceTest, ConsumerFencePendsUntilTheConsumerStreamRuns) {
  ConsumerStream consumer(context_of(*backend_));
  consumer.block();
  FenceHolder fence{*backend_, backend_->record_fence(QueueRef{Queue::Consumer, consumer.handle()})};
  ASSERT_TRUE(fence.fence.pending());
  EXPECT_FALSE(backend_->fence_passed(fence.fence));
  EXPECT_FALSE(backend_->wait_fence(fence.fence, 20ms));
  // quiesce() finishes the backend's streams only, never a consumer's.
  backend_->quiesce();
  EXPECT_FALSE(backend_->fence_passed(fence.fence));
  consumer.unblock();
  EXPECT_TRUE(backend_->wait_fence(fence.fence, 30s));
}

TEST_F(CudaFenceTest, FencesOnTheDefaultStreams) {
  for (std::uintptr_t stream : {std::uintptr_t{1}, std::uintptr_t{2}}) {
    FenceHolder fence{*backend_, backend_->record_fence(QueueRef{Queue::Consumer, stream})};
    EXPECT_TRUE(fence.fence.pending()) << stream;
    EXPECT_TRUE(backend_->wait_fence(fence.fence, 30s)) << stream;
  }
}

TEST_F(CudaFenceTest, ConsumerStreamZeroIsRefusedAsAmbiguous) {
  try {
    backend_->release_fence(backend_->record_fence(QueueRef{Queue::Consumer, 0}));
    FAIL() << "stream 0 was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::InvalidRange);
    EXPECT_FALSE(error.fatal());
    EXPECT_NE(std::string(error.message()).find("ambiguous"), std::string::npos) << error.what();
  }
}

TEST_F(CudaFenceTest, StreamOfAnotherContextIsRefused) {
  OwnContext own;
  if (own.context == nullptr) GTEST_SKIP() << "cuCtxCreate_v2 is not available to create a test context";
  ConsumerStream foreign(own.context);
  try {
    backend_->release_fence(backend_->record_fence(QueueRef{Queue::Consumer, foreign.handle()}));
    FAIL() << "a stream of another context was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::InvalidRange) << error.what();
    EXPECT_FALSE(error.fatal()) << error.what();
  }
  // The backend is fine afterwards.
  FenceHolder fence{*backend_, backend_->record_fence(QueueRef{Queue::Compute})};
  EXPECT_TRUE(backend_->wait_fence(fence.fence, 30s));
}

// Ordering a consumer's stream (a DLPack export's stream=) after the bridge's
// queues: a stream of another context is the caller's InvalidRange there too,
// not Unavailable (the driver's INVALID_CONTEXT read as a device problem).
TEST_F(CudaFenceTest, OrderingAStreamOfAnotherContextIsRefusedAsTheCallers) {
  OwnContext own;
  if (own.context == nullptr) GTEST_SKIP() << "cuCtxCreate_v2 is not available to create a test context";
  ConsumerStream foreign(own.context);
  try {
    backend_->order_consumer_queue(foreign.handle());
    FAIL() << "a stream of another context was ordered";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::InvalidRange) << error.what();
    EXPECT_FALSE(error.fatal()) << error.what();
    EXPECT_NE(std::string(error.message()).find("cuStreamWaitEvent(consumer stream)"), std::string::npos)
        << error.what();
  }
  FenceHolder fence{*backend_, backend_->record_fence(QueueRef{Queue::Compute})};
  EXPECT_TRUE(backend_->wait_fence(fence.fence, 30s));
}

TEST_F(CudaFenceTest, ReleasedFencesRecycleTheirEvents) {
  const auto created = emulator_hook<Counter>("devbridge_emulated_cuda_events_created");
  const auto destroyed = emulator_hook<Counter>("devbridge_emulated_cuda_events_destroyed");
  if (created == nullptr || destroyed == nullptr)
    GTEST_SKIP() << "the driver has no event counters (only the emulated one does)";
  AllocationHolder x{*backend_, backend_->allocate(4096, 256)};
  // Warm: the first launch may create the pool's first event.
  backend_->release_fence(backend_->launch_axpy(AxpyLaunch{x.allocation, 0, x.allocation, 0, 1024, 1.0f, 0.0f}));
  const auto created_before = created();
  const auto destroyed_before = destroyed();
  for (int i = 0; i < 200; ++i) {
    const Fence fence = backend_->launch_axpy(AxpyLaunch{x.allocation, 0, x.allocation, 0, 1024, 1.0f, 0.0f});
    ASSERT_TRUE(backend_->wait_fence(fence, 30s));
    backend_->release_fence(fence);
    backend_->release_fence(backend_->record_fence(QueueRef{i % 2 ? Queue::CopyUp : Queue::Consumer, 1}));
  }
  EXPECT_LE(created() - created_before, 1u) << "fences do not reuse their events";
  EXPECT_EQ(destroyed() - destroyed_before, 0u);

  // The pool is bounded: a burst of fences beyond it gives events back to
  // the driver once released, and the pool's worth is reused next time.
  constexpr int kBurst = 1000;
  std::vector<Fence> burst;
  for (int i = 0; i < kBurst; ++i) burst.push_back(backend_->record_fence(QueueRef{Queue::Compute}));
  const auto created_by_burst = created();
  for (const Fence& fence : burst) backend_->release_fence(fence);
  const auto kept = kBurst - static_cast<long long>(destroyed() - destroyed_before);
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, kBurst) << "released fence events are never destroyed";
  burst.clear();
  for (long long i = 0; i < kept; ++i) burst.push_back(backend_->record_fence(QueueRef{Queue::Compute}));
  EXPECT_EQ(created(), created_by_burst) << "the pool's events were not reused";
  for (const Fence& fence : burst) backend_->release_fence(fence);
}

// The launch's fence cannot be recorded (an injected cuEventRecord failure):
// launch_axpy throws, and only after the kernel finished, so nothing it
// could still write is handed back untracked.
TEST_F(CudaFenceTest, UnrecordableLaunchFenceFinishesTheKernelThenThrows) {
  const auto fail_record = emulator_hook<FailRecord>("devbridge_emulated_cuda_fail_event_record");
  if (fail_record == nullptr) GTEST_SKIP() << "only the emulated driver can fail cuEventRecord on demand";
  constexpr std::uint64_t kCount = 1 << 16;
  HostBlockHolder host{*backend_, backend_->allocate_host(kCount * sizeof(float))};
  AllocationHolder y{*backend_, backend_->allocate(kCount * sizeof(float), 256)};
  // The emulated driver's device memory is host memory: read it directly.
  auto* values = reinterpret_cast<float*>(y.allocation.address);
  std::fill(values, values + kCount, 1.0f);
  // A launch records the two lanes' markers, kernel_done_, then its fence.
  fail_record(3, CUDA_ERROR_INVALID_VALUE);
  try {
    backend_->release_fence(backend_->launch_axpy(AxpyLaunch{y.allocation, 0, y.allocation, 0, kCount, 3.0f, 1.0f}));
    fail_record(-1, 0);
    FAIL() << "the launch returned although its fence was not recorded";
  } catch (const Error& error) {
    fail_record(-1, 0);
    EXPECT_NE(std::string(error.message()).find("launch fence"), std::string::npos) << error.what();
    EXPECT_FALSE(error.fatal()) << error.what();
  }
  for (std::uint64_t i = 0; i < kCount; ++i) ASSERT_EQ(values[i], 4.0f) << "element " << i << " not written yet";
  // Still usable.
  FenceHolder again{*backend_, backend_->launch_axpy(AxpyLaunch{y.allocation, 0, y.allocation, 0, kCount, 1.0f, 0.0f})};
  EXPECT_TRUE(backend_->wait_fence(again.fence, 30s));
}

// A kernel that faults ends its context for good: its fences, and every
// other fence in that context, count as passed (nothing there runs any
// more), and a new fence cannot be recorded there (fatal).
TEST_F(CudaFenceTest, FencesInAFaultedContextCountAsPassed) {
  OwnContext own;
  if (own.context == nullptr) GTEST_SKIP() << "cuCtxCreate_v2 is not available to create a test context";
  {
    auto backend = make_cuda_backend(Options{0, own.context});
    AllocationHolder device{*backend, backend->allocate(1 << 20, 256)};
    ConsumerStream consumer(own.context);
    consumer.block();
    FenceHolder consumer_fence{*backend, backend->record_fence(QueueRef{Queue::Consumer, consumer.handle()})};
    backend->test_controls()->hold_copies(true);
    FenceHolder good{*backend,
                     backend->launch_axpy(AxpyLaunch{device.allocation, 0, device.allocation, 0, 1024, 1.0f, 0.0f})};
    // A forged allocation: the bridge never hands such a thing to a backend.
    const DeviceAllocation unmapped{0x1000, 1 << 20, 0};
    FenceHolder bad{*backend, backend->launch_axpy(AxpyLaunch{unmapped, 0, device.allocation, 0, 1 << 18, 1.0f, 0.0f})};
    FenceHolder after{*backend, backend->record_fence(QueueRef{Queue::Compute})};
    EXPECT_FALSE(backend->fence_passed(bad.fence));
    EXPECT_FALSE(backend->fence_passed(after.fence));
    backend->test_controls()->hold_copies(false);
    EXPECT_TRUE(backend->wait_fence(bad.fence, 30s));
    EXPECT_TRUE(backend->fence_passed(good.fence));
    EXPECT_TRUE(backend->fence_passed(after.fence));
    // The consumer's stream is blocked, but its context is gone: the work
    // before its fence will never run either.
    EXPECT_TRUE(backend->fence_passed(consumer_fence.fence));
    try {
      backend->release_fence(backend->record_fence(QueueRef{Queue::Compute}));
      ADD_FAILURE() << "a fence was recorded in a faulted context";
    } catch (const Error& error) {
      EXPECT_TRUE(error.fatal()) << error.what();
      EXPECT_NE(std::string(error.what()).find("CUDA_ERROR_"), std::string::npos) << error.what();
    }
    consumer.unblock();
  }
  // The primary context, used by everything else, is unaffected.
  FenceHolder healthy{*backend_, backend_->record_fence(QueueRef{Queue::Compute})};
  EXPECT_TRUE(backend_->wait_fence(healthy.fence, 30s));
}

TEST_F(CudaFenceTest, HoldOnlyHoldsWorkSubmittedAfterIt) {
  AllocationHolder x{*backend_, backend_->allocate(4096, 256)};
  FenceHolder before{*backend_, backend_->launch_axpy(AxpyLaunch{x.allocation, 0, x.allocation, 0, 1024, 1.0f, 0.0f})};
  ASSERT_TRUE(backend_->wait_fence(before.fence, 30s));
  backend_->test_controls()->hold_copies(true);
  EXPECT_TRUE(backend_->fence_passed(before.fence));
  FenceHolder held{*backend_, backend_->launch_axpy(AxpyLaunch{x.allocation, 0, x.allocation, 0, 1024, 1.0f, 0.0f})};
  EXPECT_FALSE(backend_->wait_fence(held.fence, 20ms));
  backend_->quiesce();  // lifts the hold
  EXPECT_TRUE(backend_->fence_passed(held.fence));
}

}  // namespace
}  // namespace devbridge::cuda
