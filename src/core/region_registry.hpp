// The region registry: host memory of the caller's registered as a staging
// source (Bridge::register_host), and the allocations adopted from it in
// place (Bridge::adopt_host). It owns the regions' records, their phases and
// the rules between them (no overlaps, no unregistering under a copy or an
// adoption, a region retained past its generation while an orphaned adoption
// still reads it); the bridge calls the backend to register and unregister.
//
// Registering and unregistering call the backend without the bridge's lock
// (cuMemHostRegister can take milliseconds): meanwhile the record is in use
// but not Live, so it counts for overlap checks and no copy can use it.
//
// Not thread-safe: the bridge calls it under its lock.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>

#include "core/slot_table.hpp"
#include "devbridge/backend.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::detail {

// What unregistering a region that adopted allocations still use does.
enum class AfterAdoptions : std::uint8_t { Refuse, Wait };

class RegionRegistry {
 public:
  struct Region {
    // Retained: of an older generation (or a closed bridge), kept registered
    // because an allocation adopted from it is an orphan a view still reads;
    // or let go by its owner while adopted allocations still use it
    // (AfterAdoptions::Wait).
    enum class Phase : std::uint8_t { Registering, Live, Unregistering, Retained };
    std::uint32_t version = 0;
    bool in_use = false;
    Phase phase = Phase::Registering;
    Generation generation = 0;  // registered in; a Retained region outlives it
    HostBlock block;
    std::uint32_t copies = 0;     // in flight, sync ones too
    std::uint32_t adoptions = 0;  // allocations adopted from it, orphans too
    bool read_only = false;       // uploads only (register_host_read_only)
    // Called once when the region is unregistered for good (finish_unregister).
    std::function<void()> on_release;
  };

  explicit RegionRegistry(std::uint64_t domain) : domain_(domain) {}

  // A record for `bytes`, Registering, once they overlap no region; the
  // caller registers them with the backend, then finish_register or
  // cancel_register.
  std::uint32_t begin_register(std::span<std::byte> bytes, bool read_only, Generation generation,
                               std::function<void()> on_release = {});
  void cancel_register(std::uint32_t index) noexcept {
    regions_[index].on_release = nullptr;  // never registered: nothing to tell
    regions_.unissue(index);
  }
  HostRegion finish_register(std::uint32_t index, const HostBlock& registered) noexcept;

  // The live region `r` names (its tag checked by the caller), or UnknownDeviceHandle.
  std::uint32_t live_index(const HostRegion& r) {
    const auto* region = regions_.find(r.id);
    if (!region || region->phase != Region::Phase::Live) fail_unknown(r);
    return id_slot(r.id);
  }
  // The live region a non-empty range lies in, or InvalidRange naming it.
  std::uint32_t range_index(const RegionRange& range);
  Region& operator[](std::uint32_t index) noexcept { return regions_[index]; }

  // Unregistering `r`: refused (AllocationStillInUse) while copies use it,
  // and while adoptions do unless `adopted` says Wait: then it is Retained
  // (nothing returned) and end_adoption unregisters it after the last.
  // Otherwise Unregistering, and the block to hand back to the backend,
  // after which finish_unregister (which calls the region's on_release: the
  // bridge has let go of its memory).
  std::optional<HostBlock> begin_unregister(const HostRegion& r, AfterAdoptions adopted);
  void finish_unregister(std::uint32_t index) noexcept;

  // Restart and close, with the device idle: every region goes back through
  // `unregister(block)`, but one an orphaned adoption lies in, which is
  // retained until that orphan goes (end_adoption).
  template <class Unregister>
  void unregister_all(Unregister&& unregister) noexcept {
    regions_.for_each_in_use([&](std::uint32_t index, Region& region) {
      if (region.adoptions != 0) {
        region.phase = Region::Phase::Retained;
        return;
      }
      unregister(region.block);
      finish_unregister(index);
    });
  }

  void add_adoption(std::uint32_t index) noexcept { ++regions_[index].adoptions; }
  // An adoption from region `index` ended: a region retained only for it
  // goes back through `unregister(block)`.
  template <class Unregister>
  void end_adoption(std::uint32_t index, Unregister&& unregister) noexcept {
    auto& region = regions_[index];
    if (--region.adoptions == 0 && region.phase == Region::Phase::Retained) {
      unregister(region.block);
      finish_unregister(index);
    }
  }

  // Whether the memory `r` named is still registered with the backend (the
  // caller's buffer must stay valid): a region of the current generation
  // until unregistered, unless a close already released everything; an
  // older one only while retained for an adoption.
  bool registered(const HostRegion& r, Generation current, bool released_at_close) const noexcept;

  // Whether [begin, begin + bytes) overlaps `block`.
  static bool overlaps(std::uintptr_t begin, std::uint64_t bytes, const HostBlock& block) noexcept {
    const auto other = reinterpret_cast<std::uintptr_t>(block.data);
    return block.bytes != 0 && begin < other + block.bytes && other < begin + bytes;
  }

  void fill(BridgeStats& s) const noexcept {
    s.host_regions = regions_.live();
    s.host_region_bytes = bytes_;
  }

 private:
  [[noreturn, gnu::cold, gnu::noinline]] static void fail_unknown(const HostRegion& r);

  const std::uint64_t domain_;
  SlotTable<Region> regions_;
  std::uint64_t bytes_ = 0;  // of the registered regions
};

}  // namespace devbridge::detail
