// The region registry on its own: overlaps, phases, refusals while copies or
// adoptions use a region, retention for orphaned adoptions.
#include "core/region_registry.hpp"

#include <gtest/gtest.h>

#include <array>
#include <vector>

#include "support.hpp"

namespace devbridge::detail {
namespace {

constexpr std::uint64_t kDomain = 9;

struct RegionRegistryTest : ::testing::Test {
  std::array<std::byte, 4096> memory{};
  RegionRegistry registry{kDomain};
  std::vector<const std::byte*> unregistered;

  HostRegion register_range(std::size_t offset, std::size_t bytes, bool read_only = false, Generation generation = 1) {
    const std::span<std::byte> span(memory.data() + offset, bytes);
    const auto index = registry.begin_register(span, read_only, generation);
    return registry.finish_register(index, HostBlock{span.data(), span.size(), false, 0});
  }
  auto unregister() {
    return [this](const HostBlock& block) { unregistered.push_back(block.data); };
  }
};

TEST_F(RegionRegistryTest, OverlappingRegistrationIsRefusedNamingTheRegion) {
  const auto first = register_range(0, 1024);
  const auto message = EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, registry.begin_register(
                                                                           {memory.data() + 1000, 100}, false, 1));
  EXPECT_NE(message.find("overlaps"), std::string::npos) << message;
  register_range(1024, 1024);  // adjacent is fine
  RegionRange range{first, 0, 1024};
  EXPECT_EQ(registry.range_index(range), id_slot(first.id));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, registry.range_index(RegionRange{first, 1, 1024}));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::InvalidRange, registry.range_index(RegionRange{first, 0, 0}));
}

TEST_F(RegionRegistryTest, RegisteringRegionIsNotUsableAndCancelLeavesItsIdUnknown) {
  const auto index = registry.begin_register({memory.data(), 64}, false, 1);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle,
                         registry.live_index(HostRegion{kDomain, 1, make_id(index, registry[index].version)}));
  registry.cancel_register(index);
  const auto again = register_range(0, 64);
  EXPECT_EQ(id_slot(again.id), index);
}

TEST_F(RegionRegistryTest, UnregisterIsRefusedWhileCopiesOrAdoptionsUseTheRegion) {
  const auto region = register_range(0, 1024, true);
  const auto index = registry.live_index(region);
  registry[index].copies = 1;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, registry.begin_unregister(region, AfterAdoptions::Refuse));
  registry[index].copies = 0;
  registry.add_adoption(index);
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, registry.begin_unregister(region, AfterAdoptions::Refuse));
  registry.end_adoption(index, unregister());
  EXPECT_TRUE(unregistered.empty());  // a live region stays registered when its adoption ends
  ASSERT_TRUE(registry.begin_unregister(region, AfterAdoptions::Refuse));
  registry.finish_unregister(index);
  EXPECT_FALSE(registry.registered(region, 1, false));
  BridgeStats s;
  registry.fill(s);
  EXPECT_EQ(s.host_regions, 0u);
  EXPECT_EQ(s.host_region_bytes, 0u);
}

TEST_F(RegionRegistryTest, UnregisterAfterAdoptionsRetainsTheRegionUntilTheLastEnds) {
  const auto region = register_range(0, 1024, true);
  const auto index = registry.live_index(region);
  registry[index].copies = 1;
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::AllocationStillInUse, registry.begin_unregister(region, AfterAdoptions::Wait));
  registry[index].copies = 0;
  registry.add_adoption(index);
  registry.add_adoption(index);
  EXPECT_FALSE(registry.begin_unregister(region, AfterAdoptions::Wait)) << "retained, nothing to unregister yet";
  EXPECT_TRUE(registry.registered(region, 1, false));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, registry.live_index(region));  // no new use
  registry.end_adoption(index, unregister());
  EXPECT_TRUE(unregistered.empty());
  registry.end_adoption(index, unregister());
  ASSERT_EQ(unregistered.size(), 1u);
  EXPECT_FALSE(registry.registered(region, 1, false));
}

TEST_F(RegionRegistryTest, RestartRetainsOnlyRegionsAnOrphanedAdoptionReads) {
  const auto adopted = register_range(0, 1024, true);
  const auto plain = register_range(1024, 1024);
  registry.add_adoption(registry.live_index(adopted));
  registry.unregister_all(unregister());
  ASSERT_EQ(unregistered.size(), 1u);
  EXPECT_EQ(unregistered[0], memory.data() + 1024);
  // At generation 2 the old region is retained, not live.
  EXPECT_TRUE(registry.registered(adopted, 2, false));
  EXPECT_FALSE(registry.registered(plain, 2, false));
  EXPECT_DEVBRIDGE_ERROR(ErrorKind::UnknownDeviceHandle, registry.live_index(adopted));
  // The same id under a generation it never had is not retained.
  EXPECT_FALSE(registry.registered(HostRegion{kDomain, 3, adopted.id}, 4, false));
  registry.end_adoption(id_slot(adopted.id), unregister());
  EXPECT_EQ(unregistered.size(), 2u);
  EXPECT_FALSE(registry.registered(adopted, 2, false));
}

TEST_F(RegionRegistryTest, RegionOfAnotherDomainIsNeverRegistered) {
  const auto region = register_range(0, 64);
  EXPECT_FALSE(registry.registered(HostRegion{kDomain + 1, region.generation, region.id}, 1, false));
}

}  // namespace
}  // namespace devbridge::detail
