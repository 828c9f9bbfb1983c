// Views and the bytes under them: the writes-under-view guard
// (BridgeOptions::writes_under_view), who holds a view (ViewLease::set_holder)
// in the messages, and untyped allocations that views of several dtypes share.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "support.hpp"

namespace devbridge::testing {
namespace {

using namespace std::chrono_literals;

ObjectSpec untyped_spec(std::uint64_t max_extent = 1 << 20) {
  return ObjectSpec{max_extent, 256, std::nullopt, ShapeKind::Tensor};
}

ViewSpec view_of(DType dtype, Dims shape, std::uint64_t byte_offset = 0) {
  return ViewSpec{dtype, shape, std::nullopt, byte_offset};
}

class ViewGuardTest : public BridgeTest {
 protected:
  void with_policy(WritesUnderView policy, std::chrono::nanoseconds timeout = std::chrono::nanoseconds::max()) {
    BridgeOptions options = default_options();
    options.writes_under_view = policy;
    options.writes_under_view_timeout = timeout;
    rebuild(options);
  }
  // A sync upload of `len` fresh bytes into `h` at `offset`.
  CopyEvent upload(DeviceHandle h, std::uint64_t len, std::uint64_t seed, std::uint64_t offset = 0) {
    HostRange r = filled_range(len, seed);
    struct Release {
      Bridge& bridge;
      HostRange range;
      ~Release() { bridge.release_host(range); }
    } release{*bridge, r};
    return bridge->host_to_device(r, DeviceRange{h, offset, len}, CopyMode::Sync);
  }
};

// ---- the guard ----------------------------------------------------------------

TEST_F(ViewGuardTest, RefuseIsTheDefaultAndNamesTheViewAndItsHolder) {
  const DeviceHandle h = bridge->alloc_device(float_spec(), 1024);
  upload(h, 1024, 1);
  const auto before = device_contents(h, 0, 1024);
  ViewLease lease = bridge->view(h, view_of(DType::Float32, {256}));
  HostRange r = filled_range(1024, 2);
  const std::string message =
      EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse,
                             bridge->host_to_device(r, DeviceRange{h, 0, 1024}, CopyMode::Async));
  EXPECT_NE(message.find("[offset 0, len 1024]"), std::string::npos) << message;
  EXPECT_NE(message.find("\"refuse\""), std::string::npos) << message;
  EXPECT_NE(message.find("1 live view held by the caller"), std::string::npos) << message;
  // Nothing changed: no copy submitted or pinned, the bytes as they were.
  EXPECT_EQ(bridge->stats().copies_in_flight, 0u);
  EXPECT_EQ(bridge->stats().copies_submitted, 1u);
  EXPECT_EQ(device_contents(h, 0, 1024), before);
  // A download from under the view reads, so it is fine.
  HostRange out = bridge->reserve(1024);
  bridge->device_to_host(DeviceRange{h, 0, 1024}, out, CopyMode::Sync);
  lease.reset();
  bridge->host_to_device(r, DeviceRange{h, 0, 1024}, CopyMode::Sync);
  EXPECT_NE(device_contents(h, 0, 1024), before);
}

TEST_F(ViewGuardTest, TheMessageSaysWhoHoldsEachView) {
  const DeviceHandle h = bridge->alloc_device(float_spec(), 1024);
  ViewLease mine = bridge->view(h, view_of(DType::Float32, {256}));
  ViewLease tinygrad = bridge->view(h, view_of(DType::Float32, {256}));
  ViewLease numpy = bridge->view(h, view_of(DType::Float32, {16, 16}));
  tinygrad.set_holder(ViewHolder::TinygradTensor);
  numpy.set_holder(ViewHolder::DLPackConsumer);
  EXPECT_EQ(tinygrad.holder(), ViewHolder::TinygradTensor);
  std::string message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(h));
  EXPECT_NE(message.find("3 live views: 1 held by a tinygrad tensor (a lazy graph or .grad may still read it; "
                         "opt.zero_grad() or del releases it), 1 held by a DLPack consumer"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("1 held by the caller"), std::string::npos) << message;
  // Handing a lease on, and ending leases, keeps the counts right.
  mine.set_holder(ViewHolder::TinygradTensor);
  numpy.reset();
  message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(h));
  EXPECT_NE(message.find("2 live views held by a tinygrad tensor"), std::string::npos) << message;
  ViewLease moved = std::move(tinygrad);
  EXPECT_EQ(moved.holder(), ViewHolder::TinygradTensor);
  moved.set_holder(ViewHolder::Caller);
  message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(h));
  EXPECT_NE(message.find("2 live views: 1 held by a tinygrad tensor"), std::string::npos) << message;
  mine.reset();
  moved.reset();
  bridge->free_device(h);
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(ViewGuardTest, HoldersOfLeasesFromAnOlderGenerationAreHarmless) {
  const DeviceHandle h = bridge->alloc_device(float_spec(), 1024);
  ViewLease lease = bridge->view(h, view_of(DType::Float32, {256}));
  bridge->restart(2);
  lease.set_holder(ViewHolder::DLPackConsumer);  // an orphan: nothing to report it in
  const DeviceHandle fresh = bridge->alloc_device(float_spec(), 1024);
  ViewLease other = bridge->view(fresh, view_of(DType::Float32, {256}));
  const std::string message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, bridge->free_device(fresh));
  EXPECT_NE(message.find("1 live view held by the caller"), std::string::npos) << message;
  lease.reset();
  other.reset();
  bridge->free_device(fresh);
  EXPECT_EQ(fake->live_allocations(), 0u);
  ViewLease ended;
  ended.set_holder(ViewHolder::TinygradTensor);  // an empty lease: no effect
  EXPECT_EQ(ended.holder(), ViewHolder::Caller);
}

TEST_F(ViewGuardTest, AllowCopiesUnderTheView) {
  with_policy(WritesUnderView::Allow);
  const DeviceHandle h = bridge->alloc_device(float_spec(), 1024);
  ViewLease lease = bridge->view(h, view_of(DType::Float32, {256}));
  std::vector<std::byte> data;
  HostRange r = filled_range(1024, 3, &data);
  bridge->host_to_device(r, DeviceRange{h, 0, 1024}, CopyMode::Sync);
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(lease->data), data.data(), 1024), 0);
}

TEST_F(ViewGuardTest, WaitGivesUpAfterItsTimeout) {
  with_policy(WritesUnderView::Wait, 20ms);
  const DeviceHandle h = bridge->alloc_device(float_spec(), 1024);
  ViewLease lease = bridge->view(h, view_of(DType::Float32, {256}));
  HostRange r = filled_range(1024, 4);
  const auto started = std::chrono::steady_clock::now();
  const std::string message = EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::AllocationStillInUse, bridge->host_to_device(r, DeviceRange{h, 0, 1024}, CopyMode::Async));
  EXPECT_GE(std::chrono::steady_clock::now() - started, 20ms);
  EXPECT_NE(message.find("\"wait\", and the wait timed out"), std::string::npos) << message;
  EXPECT_EQ(bridge->stats().copies_in_flight, 0u);
}

TEST_F(ViewGuardTest, WaitCopiesOnceTheLastViewEnds) {
  with_policy(WritesUnderView::Wait);
  const DeviceHandle h = bridge->alloc_device(float_spec(), 1024);
  ViewLease first = bridge->view(h, view_of(DType::Float32, {256}));
  ViewLease second = bridge->view(h, view_of(DType::Float32, {256}));
  std::vector<std::byte> data;
  HostRange r = filled_range(1024, 5, &data);
  std::atomic<bool> copied{false};
  std::thread writer([&] {
    bridge->host_to_device(r, DeviceRange{h, 0, 1024}, CopyMode::Sync);
    copied = true;
  });
  std::this_thread::sleep_for(30ms);
  EXPECT_FALSE(copied);
  first.reset();
  std::this_thread::sleep_for(30ms);
  EXPECT_FALSE(copied);  // one view still reads it
  second.reset();
  writer.join();
  EXPECT_TRUE(copied);
  EXPECT_EQ(device_contents(h, 0, 1024), data);
}

TEST_F(ViewGuardTest, CloseWakesAWriterWaitingForViews) {
  with_policy(WritesUnderView::Wait);
  const DeviceHandle h = bridge->alloc_device(float_spec(), 1024);
  ViewLease lease = bridge->view(h, view_of(DType::Float32, {256}));
  HostRange r = filled_range(1024, 6);
  std::thread writer([&] {
    EXPECT_DEVBRIDGE_ERROR(ErrorKind::Closed, bridge->host_to_device(r, DeviceRange{h, 0, 1024}, CopyMode::Async));
  });
  std::this_thread::sleep_for(30ms);
  bridge->close();
  writer.join();
  lease.reset();
  EXPECT_EQ(fake->live_allocations(), 0u);
}

TEST_F(ViewGuardTest, ANegativeWaitTimeoutIsRefusedAtConstruction) {
  BridgeOptions options = default_options();
  options.writes_under_view_timeout = -1ns;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, Bridge(std::make_unique<FakeBackend>(1 << 20), options));
}

// ---- untyped allocations --------------------------------------------------------

TEST_F(ViewGuardTest, AnUntypedAllocationTakesViewsOfAnyDTypeAtAlignedOffsets) {
  const DeviceHandle h = bridge->alloc_device(untyped_spec(), 4096);
  EXPECT_FALSE(bridge->spec(h).dtype.has_value());
  EXPECT_EQ(spec_dtype_name(bridge->spec(h)), "bytes");
  ViewLease images = bridge->view(h, view_of(DType::Float32, {8, 100}));
  ViewLease labels = bridge->view(h, view_of(DType::Int64, {8}, 3200));
  ViewLease bits = bridge->view(h, view_of(DType::BFloat16, {2048}));
  EXPECT_EQ(labels->dtype, DType::Int64);
  EXPECT_EQ(labels->byte_offset, 3200u);
  EXPECT_EQ(bridge->stats().live_views, 3u);
  std::string message =
      EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, bridge->view(h, view_of(DType::Int64, {1}, 4)));
  EXPECT_NE(message.find("byte offset 4 is not a multiple of 8"), std::string::npos) << message;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidTensorView, bridge->view(h, view_of(DType::Float64, {512}, 8)));
}

TEST_F(ViewGuardTest, UntypedCopiesTakeAnyByteRangeAndExtentsAnyAlignedSize) {
  const DeviceHandle h = bridge->alloc_device(ObjectSpec{1 << 20, 1, std::nullopt, ShapeKind::Vector}, 7);
  std::vector<std::byte> data;
  HostRange r = filled_range(3, 7, &data);
  bridge->host_to_device(r, DeviceRange{h, 3, 3}, CopyMode::Sync);
  EXPECT_EQ(device_contents(h, 3, 3), data);
  const std::string message = EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::InvalidRange, bridge->host_to_device(r, DeviceRange{h, 5, 3}, CopyMode::Sync));
  EXPECT_NE(message.find("outside its extent of 7 bytes"), std::string::npos) << message;
  const std::string extent_message = EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::InvalidExtent, bridge->alloc_device(untyped_spec(), 100));
  EXPECT_NE(extent_message.find("bytes size 1"), std::string::npos) << extent_message;
}

TEST_F(ViewGuardTest, AxpyReadsUntypedOperandsAsFloat32) {
  const DeviceHandle x = bridge->alloc_device(untyped_spec(), 256);
  const DeviceHandle y = bridge->alloc_device(float_spec(), 256);
  bridge->launch_axpy(DeviceRange{x, 0, 256}, DeviceRange{y, 0, 256}, 2.0f, 1.0f);
  const std::string message = EXPECT_DEVBRIDGE_ERROR(
      ErrorKind::InvalidRange, bridge->launch_axpy(DeviceRange{x, 2, 8}, DeviceRange{y, 0, 8}, 1.0f, 0.0f));
  EXPECT_NE(message.find("not aligned to float32"), std::string::npos) << message;
  const DeviceHandle ints = bridge->alloc_device(ObjectSpec{1 << 20, 64, DType::Int32, ShapeKind::Tensor}, 256);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidViewDType,
                         bridge->launch_axpy(DeviceRange{ints, 0, 256}, DeviceRange{y, 0, 256}, 1.0f, 0.0f));
}

}  // namespace
}  // namespace devbridge::testing
