// CONTRACT.md "Compute" and "Tensor views".
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "support.hpp"
#include "devbridge/consumer_names.hpp"
#include "devbridge/wait_check.hpp"

namespace devbridge::testing {
namespace {

using ComputeTest = BridgeTest;
using ViewTest = BridgeTest;

// ---- steps ------------------------------------------------------------------

TEST_F(ComputeTest, StepPinsEveryNamedAllocationUntilItEnds) {
  const DeviceHandle a = bridge->alloc_device(bytes_spec(), 64);
  const DeviceHandle b = bridge->alloc_device(bytes_spec(), 64);
  const DeviceHandle handles[] = {a, b};
  bridge->begin_step(1, handles);
  EXPECT_EQ(bridge->stats().active_steps, 1u);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(a));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(b));
  bridge->end_step(1);
  EXPECT_EQ(bridge->stats().active_steps, 0u);
  bridge->free_device(a);
  bridge->free_device(b);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(ComputeTest, StepNamingAStaleOrForeignHandleIsRefusedAndPinsNothing) {
  const DeviceHandle good = bridge->alloc_device(bytes_spec(), 64);
  const DeviceHandle freed = bridge->alloc_device(bytes_spec(), 64);
  bridge->free_device(freed);
  {
    const DeviceHandle handles[] = {good, freed};
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->begin_step(1, handles));
  }
  Bridge other(std::make_unique<FakeBackend>(), default_options());
  const DeviceHandle foreign = other.alloc_device(bytes_spec(), 64);
  {
    const DeviceHandle handles[] = {good, foreign};
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::ForeignDomain, bridge->begin_step(2, handles));
  }
  // Nothing was pinned by the refused steps.
  EXPECT_EQ(bridge->stats().active_steps, 0u);
  bridge->free_device(good);
  // A handle from before a restart.
  const DeviceHandle old = bridge->alloc_device(bytes_spec(), 64);
  bridge->restart(2);
  {
    const DeviceHandle handles[] = {old};
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->begin_step(3, handles));
  }
  EXPECT_EQ(bridge->stats().active_steps, 0u);
}

TEST_F(ComputeTest, EndingAnUnknownStepIsRefused) {
  EXPECT_ANY_THROW(bridge->end_step(42));
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const DeviceHandle handles[] = {h};
  bridge->begin_step(42, handles);
  bridge->end_step(42);
  EXPECT_ANY_THROW(bridge->end_step(42));
}

TEST_F(ComputeTest, AHandleListedTwiceInAStepIsOneUse) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64), other = bridge->alloc_device(bytes_spec(), 64);
  const DeviceHandle in_place[] = {h, h, other};  // an in-place step: input and output
  bridge->begin_step(7, in_place);
  const std::string message = expect_error(ErrorKind::AllocationStillInUse, [&] { bridge->free_device(h); });
  EXPECT_NE(message.find("1 compute step"), std::string::npos) << message;
  EXPECT_EQ(message.find("2 compute steps"), std::string::npos) << message;
  bridge->end_step(7);
  bridge->free_device(h);
  bridge->free_device(other);
  EXPECT_EQ(bridge->stats().live_allocations, 0u);
}

TEST_F(ComputeTest, StepsDoNotSurviveARestart) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  const DeviceHandle handles[] = {h};
  bridge->begin_step(5, handles);
  bridge->restart(2);
  EXPECT_EQ(fake->live_allocations(), 0u);
  EXPECT_EQ(bridge->stats().active_steps, 0u);
  EXPECT_ANY_THROW(bridge->end_step(5));
}

TEST_F(ComputeTest, AxpyComputesOverDeviceMemoryInOrderWithCopies) {
  const DeviceHandle x = bridge->alloc_device(float_spec(), 256);
  const DeviceHandle y = bridge->alloc_device(float_spec(), 256);
  const HostRange in = bridge->reserve(256);
  float values[64];
  for (int i = 0; i < 64; ++i) values[i] = static_cast<float>(i) * 0.75f - 11.0f;
  std::memcpy(bridge->host_bytes(in).data(), values, sizeof values);
  bridge->host_to_device(in, DeviceRange{x, 0, 256}, CopyMode::Sync);
  fake->clear_calls();
  bridge->launch_axpy(DeviceRange{x, 0, 256}, DeviceRange{y, 0, 256}, 3.0f, -1.0f);
  const HostRange out = bridge->reserve(256);
  const CopyEvent e = bridge->device_to_host(DeviceRange{y, 0, 256}, out, CopyMode::Async);
  complete(e);
  float got[64];
  std::memcpy(got, bridge->host_bytes(out).data(), sizeof got);
  for (int i = 0; i < 64; ++i) EXPECT_FLOAT_EQ(got[i], 3.0f * values[i] - 1.0f);
  const auto calls = fake->calls();
  ASSERT_EQ(call_kinds(calls), (std::vector<Call>{Call::Launch, Call::CopyDeviceToHost})) << describe_calls(calls);
  EXPECT_EQ(calls[0].bytes, 256u);
}

TEST_F(ComputeTest, AxpyRefusesNonFloatAndUnequalRanges) {
  const DeviceHandle x = bridge->alloc_device(float_spec(), 256);
  const DeviceHandle y = bridge->alloc_device(float_spec(), 256);
  const DeviceHandle bytes = bridge->alloc_device(bytes_spec(), 256);
  fake->clear_calls();
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidViewDType,
                         bridge->launch_axpy(DeviceRange{bytes, 0, 256}, DeviceRange{y, 0, 256}, 1, 0));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->launch_axpy(DeviceRange{x, 0, 128}, DeviceRange{y, 0, 256}, 1, 0));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange,
                         bridge->launch_axpy(DeviceRange{x, 0, 512}, DeviceRange{y, 0, 512}, 1, 0));
  EXPECT_CALLS(fake);
}

// Shifted ranges of one allocation gave each backend its own result (the
// order its work items ran in); the same range, or ranges apart, are fine.
TEST_F(ComputeTest, AxpyRefusesShiftedOverlapInOneAllocation) {
  const DeviceHandle x = bridge->alloc_device(float_spec(), 1024);
  fake->clear_calls();
  for (const auto& [x_offset, y_offset] : {std::pair<std::uint64_t, std::uint64_t>{0, 4}, {4, 0}, {0, 252}, {252, 0}}) {
    const auto message = EXPECT_DEVBRIDGE_ERROR(
        ErrorKind::InvalidRange,
        bridge->launch_axpy(DeviceRange{x, x_offset, 256}, DeviceRange{x, y_offset, 256}, 1, 0));
    EXPECT_NE(message.find("overlap without being the same range"), std::string::npos) << message;
  }
  EXPECT_CALLS(fake);
  bridge->launch_axpy(DeviceRange{x, 0, 256}, DeviceRange{x, 0, 256}, 2, 0);    // in place, element by element
  bridge->launch_axpy(DeviceRange{x, 0, 256}, DeviceRange{x, 256, 256}, 2, 0);  // side by side
  bridge->launch_axpy(DeviceRange{x, 512, 256}, DeviceRange{x, 0, 256}, 2, 0);
}

// ---- views --------------------------------------------------------------------

TEST_F(ViewTest, ViewDescribesTheAllocationTheWayTinygradAndDLPackDo) {
  const DeviceHandle h = bridge->alloc_device(float_spec(), 4096);
  const std::uint64_t address = fake->calls().at(0).address;
  fake->clear_calls();
  ViewLease lease = bridge->view(h, ViewSpec{DType::Float32, {4, 8, 16}, std::nullopt, 1024});
  ASSERT_TRUE(lease);
  EXPECT_EQ(lease->data, address);
  EXPECT_EQ(lease->device, "CPU");
  EXPECT_EQ(lease->dlpack_device_type, static_cast<int>(DLPackDevice::CPU));
  EXPECT_EQ(lease->dtype, DType::Float32);
  EXPECT_EQ(lease->shape, (Dims{4, 8, 16}));
  EXPECT_EQ(lease->strides, (Dims{128, 16, 1}));
  EXPECT_TRUE(lease->contiguous());
  EXPECT_EQ(lease->byte_offset, 1024u);
  EXPECT_EQ(lease->handle, h);
  EXPECT_EQ(bridge->stats().live_views, 1u);
  const auto calls = fake->calls();
  ASSERT_EQ(calls.size(), 1u) << describe_calls(calls);
  EXPECT_EQ(calls[0].call, Call::ValidateView);
  EXPECT_EQ(calls[0].address, address);
  EXPECT_EQ(calls[0].device_offset, 1024u);
  lease.reset();
  EXPECT_FALSE(lease);
  EXPECT_EQ(bridge->stats().live_views, 0u);
}

TEST_F(ViewTest, ExplicitStridesAndExactFitAreAccepted) {
  const DeviceHandle h = bridge->alloc_device(float_spec(), 256);  // 64 floats
  // A transposed 8x8 view: strides {1, 8}, reaching element 63 exactly.
  ViewLease lease = bridge->view(h, ViewSpec{DType::Float32, {8, 8}, Dims{1, 8}, 0});
  EXPECT_FALSE(lease->contiguous());
  // The last element exactly at the end of the extent.
  ViewLease tail = bridge->view(h, ViewSpec{DType::Float32, {1}, std::nullopt, 252});
  EXPECT_EQ(bridge->stats().live_views, 2u);
}

TEST_F(ViewTest, WrongDTypeIsInvalidViewDType) {
  const DeviceHandle h = bridge->alloc_device(float_spec(), 256);
  fake->clear_calls();
  const std::string message = EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::InvalidViewDType, bridge->view(h, ViewSpec{DType::Int32, {64}, std::nullopt, 0}));
  EXPECT_NE(message.find("int32"), std::string::npos) << message;
  EXPECT_CALLS(fake);
  EXPECT_EQ(bridge->stats().live_views, 0u);
}

TEST_F(ViewTest, ShapesThatDoNotFitAreInvalidTensorView) {
  const DeviceHandle h = bridge->alloc_device(float_spec(), 256);  // 64 floats
  fake->clear_calls();
  auto refused = [&](ViewSpec spec) {
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, bridge->view(h, spec));
  };
  refused({DType::Float32, {65}, std::nullopt, 0});                 // one element too many
  refused({DType::Float32, {64}, std::nullopt, 4});                 // offset pushes it past the end
  refused({DType::Float32, {1}, std::nullopt, 256});                // offset at the end
  refused({DType::Float32, {1}, std::nullopt, UINT64_MAX - 3});     // offset overflow
  refused({DType::Float32, {8, 8}, Dims{9, 1}, 0});                 // strides reach past the end
  refused({DType::Float32, {2, 2}, Dims{INT64_MAX / 2, 1}, 0});     // stride overflow
  refused({DType::Float32, {INT64_MAX, 2}, std::nullopt, 0});       // size overflow
  refused({DType::Float32, {0}, std::nullopt, 0});                  // zero dimension
  refused({DType::Float32, {4, -1}, std::nullopt, 0});              // negative dimension
  refused({DType::Float32, {4}, Dims{1, 1}, 0});                    // rank mismatch
  refused({DType::Float32, {4}, Dims{-1}, 0});                      // reaches before the start
  refused({DType::Float32, {4}, std::nullopt, 2});                  // offset not a multiple of the element
  EXPECT_CALLS(fake);
  EXPECT_EQ(bridge->stats().live_views, 0u);
  bridge->free_device(h);  // no refused view left a lease behind
}

// The checks clamp a huge offset to keep their arithmetic in 64 bits; the
// message said the clamped bytes ([2^62 - 1, ...) for any offset past 2^62).
TEST_F(ViewTest, ARefusedViewNamesTheBytesTheCallerAskedFor) {
  const DeviceHandle h = bridge->alloc_device(float_spec(), 256);
  const auto message = [&](ViewSpec spec) {
    return EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, bridge->view(h, spec));
  };
  const auto expect_named = [](const std::string& text, const std::string& part) {
    EXPECT_NE(text.find(part), std::string::npos) << text;
  };
  expect_named(message({DType::Float32, {1}, std::nullopt, UINT64_MAX - 3}),
               "reach bytes [18446744073709551612, past 2^64) outside the extent (byte offset 18446744073709551612)");
  expect_named(message({DType::Float32, {1}, std::nullopt, std::uint64_t{1} << 62}),
               "reach bytes [4611686018427387904, 4611686018427387908)");
  expect_named(message({DType::Float32, {4}, Dims{2}, 1ull << 63}),
               "reach bytes [9223372036854775808, 9223372036854775836)");
  expect_named(message({DType::Float32, {4}, Dims{-1}, 4}), "reach 8 bytes before the allocation's start");
  bridge->free_device(h);
}

TEST_F(ViewTest, BackendRefusalIsInvalidTensorViewAndLeavesNoLease) {
  const DeviceHandle h = bridge->alloc_device(float_spec(), 256);
  fake->inject(Call::ValidateView, Failure::InvalidView);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, bridge->view(h, ViewSpec{DType::Float32, {64}, std::nullopt, 0}));
  EXPECT_EQ(bridge->stats().live_views, 0u);
  bridge->free_device(h);
  EXPECT_CALLS(fake, Call::Allocate, Call::ValidateView, Call::Free);
}

TEST_F(ViewTest, RefusedWhileACopyIntoTheAllocationIsInFlight) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  const HostRange range = filled_range(256, 41);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 256}, CopyMode::Async);
  fake->clear_calls();
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->view(h, ViewSpec{DType::UInt8, {256}, std::nullopt, 0}));
  EXPECT_CALLS(fake);
  complete(e);
  ViewLease lease = bridge->view(h, ViewSpec{DType::UInt8, {256}, std::nullopt, 0});
  EXPECT_TRUE(lease);
}

TEST_F(ViewTest, CopyOutOfTheAllocationDoesNotBlockAView) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  const HostRange out = bridge->reserve(256);
  const CopyEvent e = bridge->device_to_host(DeviceRange{h, 0, 256}, out, CopyMode::Async);
  ViewLease lease = bridge->view(h, ViewSpec{DType::UInt8, {256}, std::nullopt, 0});
  EXPECT_TRUE(lease);
  complete(e);
}

TEST_F(ViewTest, ViewWaitWaitsForTheCopyAndSeesItsBytes) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  std::vector<std::byte> data;
  const HostRange range = filled_range(256, 42, &data);
  const CopyEvent e = bridge->host_to_device(range, DeviceRange{h, 0, 256}, CopyMode::Async);
  std::atomic<bool> started{false};
  std::thread completer([&] {
    while (!started.load()) std::this_thread::yield();
    fake->complete(e);
  });
  started = true;
  ViewLease lease = bridge->view(h, ViewSpec{DType::UInt8, {256}, std::nullopt, 0}, ViewWait::Wait);
  completer.join();
  ASSERT_TRUE(lease);
  EXPECT_EQ(bridge->copy_status(e).state, CopyState::Completed);
  const auto* bytes = reinterpret_cast<const std::byte*>(lease->data);
  EXPECT_EQ(0, std::memcmp(bytes, data.data(), 256));
}

// A binding's WaitCheck (Python's Ctrl-C) ends a view's wait for an upload
// whose completion never comes: the call fails with what the check threw,
// having taken no lease; once the copy completes a view is taken as usual.
TEST_F(ViewTest, AWaitCheckEndsAViewsWaitForAnUploadThatNeverCompletes) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 256);
  const CopyEvent e = bridge->host_to_device(filled_range(256, 7), DeviceRange{h, 0, 256}, CopyMode::Async);
  struct Interrupted {};
  int looks = 0;
  {
    const WaitCheck check(
        [&] {
          if (++looks == 3) throw Interrupted{};
        },
        std::chrono::milliseconds(5));
    EXPECT_THROW(bridge->view(h, ViewSpec{DType::UInt8, {256}, std::nullopt, 0}, ViewWait::Wait), Interrupted);
  }
  EXPECT_EQ(looks, 3);
  EXPECT_EQ(bridge->stats().live_views, 0u);
  EXPECT_EQ(WaitCheck::current(), nullptr);
  fake->complete(e);
  EXPECT_TRUE(bridge->view(h, ViewSpec{DType::UInt8, {256}, std::nullopt, 0}, ViewWait::Wait));
}

TEST_F(ViewTest, LeaseIsMovableAndEndsOnce) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  ViewLease a = bridge->view(h, ViewSpec{DType::UInt8, {64}, std::nullopt, 0});
  ViewLease b = std::move(a);
  EXPECT_FALSE(a);
  EXPECT_TRUE(b);
  EXPECT_EQ(bridge->stats().live_views, 1u);
  ViewLease c;
  c = std::move(b);
  EXPECT_EQ(bridge->stats().live_views, 1u);
  c.reset();
  c.reset();
  EXPECT_EQ(bridge->stats().live_views, 0u);
  bridge->free_device(h);
}

TEST_F(ViewTest, LeaseFromBeforeARestartEndsHarmlessly) {
  const DeviceHandle old = bridge->alloc_device(bytes_spec(), 64);
  ViewLease lease = bridge->view(old, ViewSpec{DType::UInt8, {64}, std::nullopt, 0});
  bridge->restart(2);
  // The old handle is refused, but its memory stays while the view lives.
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::OldGenerationHandle, bridge->free_device(old));
  EXPECT_EQ(fake->live_allocations(), 1u);
  // A new allocation may land in the old one's slot; the old lease must not touch it.
  const DeviceHandle fresh = bridge->alloc_device(bytes_spec(), 64);
  ViewLease fresh_lease = bridge->view(fresh, ViewSpec{DType::UInt8, {64}, std::nullopt, 0});
  lease.reset();
  EXPECT_EQ(fake->live_allocations(), 1u);  // only the fresh one
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(fresh));
  fresh_lease.reset();
  bridge->free_device(fresh);
}

TEST_F(ViewTest, LeaseOutlivingTheBridgeEndsHarmlessly) {
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  ViewLease lease = bridge->view(h, ViewSpec{DType::UInt8, {64}, std::nullopt, 0});
  bridge.reset();  // closes: frees everything
  lease.reset();   // must not touch freed memory (ASan watches)
  SUCCEED();
}

TEST_F(ViewTest, ASharedLeaseHoldsTheAllocationAfterItIsReleasedOrOrphaned) {
  const ViewSpec spec{DType::UInt8, {64}, std::nullopt, 0};
  const DeviceHandle h = bridge->alloc_device(bytes_spec(), 64);
  ViewLease lease = bridge->view(h, spec);
  bridge->release(h);  // deferred: the view reads it
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, bridge->view(h, spec));  // no new view by its handle
  ViewLease shared = lease.share();
  ASSERT_TRUE(shared) << "a consumer handed the view gets a lease of its own";
  EXPECT_EQ(shared->data, lease->data);
  EXPECT_EQ(shared->handle, h);
  EXPECT_EQ(bridge->stats().live_views, 2u);
  lease.reset();
  EXPECT_EQ(fake->live_allocations(), 1u) << "the shared lease holds it";
  ViewLease shared_again = shared.share();
  bridge->restart(2);  // an orphan now, held by the two shares
  ViewLease after_restart = shared_again.share();
  ASSERT_TRUE(after_restart);
  shared.reset();
  shared_again.reset();
  EXPECT_EQ(fake->live_allocations(), 1u);
  after_restart.reset();
  EXPECT_EQ(fake->live_allocations(), 0u) << "the last share let it go";
  EXPECT_FALSE(after_restart.share()) << "an ended lease shares nothing";
  EXPECT_EQ(bridge->stats().live_views, 0u);
}

}  // namespace
}  // namespace devbridge::testing
