#include "core/region_registry.hpp"

#include "core/describe.hpp"
#include "core/fail.hpp"
#include "devbridge/checked.hpp"

namespace devbridge::detail {

std::uint32_t RegionRegistry::begin_register(std::span<std::byte> bytes, bool read_only, Generation generation,
                                             std::function<void()> on_release) {
  const auto begin = reinterpret_cast<std::uintptr_t>(bytes.data());
  regions_.for_each_in_use([&](std::uint32_t index, Region& other) {
    if (overlaps(begin, bytes.size(), other.block))
      fail(ErrorKind::InvalidRange, "host memory [{:#x}, +{}) overlaps {} [{:#x}, +{}); unregister it first", begin,
           bytes.size(), describe(HostRegion{domain_, generation, make_id(index, other.version)}),
           reinterpret_cast<std::uintptr_t>(other.block.data), other.block.bytes);
  });
  const auto index = regions_.acquire();
  auto& region = regions_[index];
  region.in_use = true;
  region.phase = Region::Phase::Registering;
  region.generation = generation;
  region.block = HostBlock{bytes.data(), bytes.size(), false, 0};
  region.copies = 0;
  region.adoptions = 0;
  region.read_only = read_only;
  region.on_release = std::move(on_release);
  return index;
}

HostRegion RegionRegistry::finish_register(std::uint32_t index, const HostBlock& registered) noexcept {
  auto& region = regions_[index];
  region.block = registered;
  region.phase = Region::Phase::Live;
  bytes_ += registered.bytes;
  return HostRegion{domain_, region.generation, make_id(index, region.version)};
}

std::uint32_t RegionRegistry::range_index(const RegionRange& range) {
  const auto index = live_index(range.region);
  const auto bytes = regions_[index].block.bytes;
  if (range.len == 0 || !checked::range_within(range.offset, range.len, bytes))
    fail(ErrorKind::InvalidRange, "{} is outside the region's {} bytes (or empty)", describe(range), bytes);
  return index;
}

std::optional<HostBlock> RegionRegistry::begin_unregister(const HostRegion& r, AfterAdoptions adopted) {
  const auto index = live_index(r);
  auto& region = regions_[index];
  if (region.copies != 0)
    fail(ErrorKind::AllocationStillInUse, "{} is used by {} copies in flight; wait for them before unregistering",
         describe(r), region.copies);
  if (region.adoptions != 0 && adopted == AfterAdoptions::Wait) {
    region.phase = Region::Phase::Retained;
    return std::nullopt;
  }
  if (region.adoptions != 0)
    fail(ErrorKind::AllocationStillInUse,
         "{} holds {} allocation{} adopted from it (adopt_host); free or release {} before unregistering", describe(r),
         region.adoptions, region.adoptions == 1 ? "" : "s", region.adoptions == 1 ? "it" : "them");
  region.phase = Region::Phase::Unregistering;
  return region.block;
}

void RegionRegistry::finish_unregister(std::uint32_t index) noexcept {
  bytes_ -= regions_[index].block.bytes;
  auto on_release = std::move(regions_[index].on_release);
  regions_[index].on_release = nullptr;
  regions_.retire(index);
  if (on_release) {
    try {
      on_release();
    } catch (...) {
      // The owner's callback must not throw; nothing to undo here.
    }
  }
}

bool RegionRegistry::registered(const HostRegion& r, Generation current, bool released_at_close) const noexcept {
  if (r.domain != domain_) return false;
  const auto* region = regions_.find(r.id);
  // The id alone matches a retained record under a generation it never had.
  if (!region || region->generation != r.generation) return false;
  // A failed close unregisters nothing: held until unregistered.
  if (r.generation == current && !released_at_close) return region->phase != Region::Phase::Unregistering;
  return region->phase == Region::Phase::Retained;
}

void RegionRegistry::fail_unknown(const HostRegion& r) {
  fail(ErrorKind::UnknownDeviceHandle, "{} is unknown or already unregistered", describe(r));
}

}  // namespace devbridge::detail
