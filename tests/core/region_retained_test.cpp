// Bridge::region_retained, which tells whoever keeps a registered buffer
// alive for the bridge (the Python bindings) when it may let go: true for
// exactly the handles of regions whose memory the bridge still holds. Both
// rows are fuzzer findings (tests/fuzz/corpus/finding_retained_*).
#include <gtest/gtest.h>

#include <memory>
#include <span>

#include "devbridge/backends/fake.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge {
namespace {

// A close whose quiesce failed unregisters nothing (the device may still copy
// into the region): the memory is still the bridge's until a close succeeds.
TEST(RegionRetained, AfterACloseWhoseQuiesceFailedTheRegionIsStillHeld) {
  auto owned = std::make_unique<fake::FakeBackend>();
  fake::FakeBackend* fake = owned.get();
  Bridge b(std::move(owned), BridgeOptions{});
  alignas(4096) static std::byte memory[4096];
  const HostRegion r = b.register_host(std::span<std::byte>(memory, sizeof memory));
  fake->inject(fake::Call::Quiesce, fake::Failure::Fatal);
  EXPECT_THROW(b.close(), Error);
  EXPECT_EQ(fake->live_registrations(), 1u);
  EXPECT_TRUE(b.region_retained(r));
  b.close();
  EXPECT_EQ(fake->live_registrations(), 0u);
  EXPECT_FALSE(b.region_retained(r));
}

// A region retained past a restart for an adopted allocation a view reads is
// found by its id; the id under the new generation is a handle never issued.
TEST(RegionRetained, ARetainedRegionsIdUnderAnotherGenerationNamesNothing) {
  Bridge b(std::make_unique<fake::FakeBackend>(), BridgeOptions{});
  alignas(4096) static std::byte memory[4096];
  const HostRegion r = b.register_host_read_only(std::span<const std::byte>(memory, sizeof memory));
  const DeviceHandle h = b.adopt_host(RegionRange{r, 0, 4096}, ObjectSpec{4096, 64, DType::UInt8, ShapeKind::Vector});
  ViewLease view = b.view(h, ViewSpec{DType::UInt8, Dims{4096}, std::nullopt, 0});
  b.restart(r.generation + 1);
  EXPECT_TRUE(b.region_retained(r));
  EXPECT_FALSE(b.region_retained(HostRegion{r.domain, r.generation + 1, r.id}));
  view.reset();
  EXPECT_FALSE(b.region_retained(r));
}

// The release callback (register_host's on_release): the owner is told once,
// when the bridge really lets go of the memory, instead of polling
// region_retained.
TEST(RegionRelease, UnregisterTellsTheOwnerOnce) {
  Bridge b(std::make_unique<fake::FakeBackend>(), BridgeOptions{});
  alignas(4096) static std::byte memory[4096];
  int released = 0;
  const HostRegion r = b.register_host(std::span<std::byte>(memory, sizeof memory), [&] { ++released; });
  EXPECT_EQ(released, 0);
  b.unregister_host(r);
  EXPECT_EQ(released, 1);
  EXPECT_FALSE(b.region_retained(r));
  b.close();
  EXPECT_EQ(released, 1);
}

// An owner letting go of a region an adopted allocation still uses (read
// through a view after its handle was freed) is told when the last use ends.
TEST(RegionRelease, UnregisterAfterAdoptionsTellsTheOwnerWhenTheLastAdoptionEnds) {
  auto owned = std::make_unique<fake::FakeBackend>();
  fake::FakeBackend* fake = owned.get();
  Bridge b(std::move(owned), BridgeOptions{});
  alignas(4096) static std::byte memory[4096];
  int released = 0;
  const HostRegion r = b.register_host_read_only(std::span<const std::byte>(memory, sizeof memory),
                                                 [&] { ++released; });
  const DeviceHandle h = b.adopt_host(RegionRange{r, 0, 4096}, ObjectSpec{4096, 64, DType::UInt8, ShapeKind::Vector});
  ViewLease view = b.view(h, ViewSpec{DType::UInt8, Dims{4096}, std::nullopt, 0});
  b.release(h);
  EXPECT_THROW(b.unregister_host(r), Error);
  EXPECT_FALSE(b.unregister_host_after_adoptions(r));
  EXPECT_EQ(released, 0);
  EXPECT_TRUE(b.region_retained(r));
  EXPECT_EQ(fake->live_registrations(), 1u);
  view.reset();
  EXPECT_EQ(released, 1);
  EXPECT_FALSE(b.region_retained(r));
  EXPECT_EQ(fake->live_registrations(), 0u);
  EXPECT_EQ(b.stats().host_regions, 0u);
  // With no adoption left it is unregistering at once.
  const HostRegion again = b.register_host_read_only(std::span<const std::byte>(memory, sizeof memory));
  EXPECT_TRUE(b.unregister_host_after_adoptions(again));
  EXPECT_EQ(fake->live_registrations(), 0u);
}

TEST(RegionRelease, AnUnregisterRefusedUnderACopyTellsNothing) {
  auto owned = std::make_unique<fake::FakeBackend>();
  fake::FakeBackend* fake = owned.get();
  Bridge b(std::move(owned), BridgeOptions{});
  alignas(4096) static std::byte memory[4096];
  int released = 0;
  const HostRegion r = b.register_host(std::span<std::byte>(memory, sizeof memory), [&] { ++released; });
  const DeviceHandle h = b.alloc_device(ObjectSpec{4096, 64, DType::UInt8, ShapeKind::Vector}, 4096);
  const CopyEvent e = b.host_to_device(RegionRange{r, 0, 4096}, DeviceRange{h, 0, 4096}, CopyMode::Async);
  EXPECT_THROW(b.unregister_host(r), Error);
  EXPECT_EQ(released, 0);
  fake->complete(e);
  b.wait(e);
  b.unregister_host(r);
  EXPECT_EQ(released, 1);
}

TEST(RegionRelease, RestartTellsAtOnceUnlessAnAdoptionRetainsTheRegion) {
  Bridge b(std::make_unique<fake::FakeBackend>(), BridgeOptions{});
  alignas(4096) static std::byte plain[4096];
  alignas(4096) static std::byte adopted[4096];
  int plain_released = 0, adopted_released = 0;
  b.register_host(std::span<std::byte>(plain, sizeof plain), [&] { ++plain_released; });
  const HostRegion r = b.register_host_read_only(std::span<const std::byte>(adopted, sizeof adopted),
                                                 [&] { ++adopted_released; });
  const DeviceHandle h = b.adopt_host(RegionRange{r, 0, 4096}, ObjectSpec{4096, 64, DType::UInt8, ShapeKind::Vector});
  ViewLease view = b.view(h, ViewSpec{DType::UInt8, Dims{4096}, std::nullopt, 0});
  b.restart(r.generation + 1);
  EXPECT_EQ(plain_released, 1);
  EXPECT_EQ(adopted_released, 0);  // a view still reads it in place
  EXPECT_TRUE(b.region_retained(r));
  view.reset();  // the last use ends: the bridge lets go now
  EXPECT_EQ(adopted_released, 1);
  EXPECT_FALSE(b.region_retained(r));
  b.close();
  EXPECT_EQ(plain_released, 1);
  EXPECT_EQ(adopted_released, 1);
}

TEST(RegionRelease, ACloseWhoseQuiesceFailedTellsNothingUntilACloseSucceeds) {
  auto owned = std::make_unique<fake::FakeBackend>();
  fake::FakeBackend* fake = owned.get();
  Bridge b(std::move(owned), BridgeOptions{});
  alignas(4096) static std::byte memory[4096];
  int released = 0;
  b.register_host(std::span<std::byte>(memory, sizeof memory), [&] { ++released; });
  fake->inject(fake::Call::Quiesce, fake::Failure::Fatal);
  EXPECT_THROW(b.close(), Error);
  EXPECT_EQ(released, 0);  // the device may still copy into it
  b.close();
  EXPECT_EQ(released, 1);
}

TEST(RegionRelease, AFailedRegistrationTellsNothing) {
  auto owned = std::make_unique<fake::FakeBackend>();
  fake::FakeBackend* fake = owned.get();
  Bridge b(std::move(owned), BridgeOptions{});
  alignas(4096) static std::byte memory[4096];
  int released = 0;
  fake->inject(fake::Call::RegisterHost, fake::Failure::AllocationFailed);
  EXPECT_THROW(b.register_host(std::span<std::byte>(memory, sizeof memory), [&] { ++released; }), Error);
  b.close();
  EXPECT_EQ(released, 0);
}

}  // namespace
}  // namespace devbridge
