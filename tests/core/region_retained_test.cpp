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

}  // namespace
}  // namespace devbridge
