// The bridge core's registered host memory and host memory adopted in place
// (bridge_core.hpp): the backend calls around the region registry.
#include "core/bridge_core.hpp"

namespace devbridge::detail {

std::uint32_t BridgeCore::region_index(const HostRegion& r) {
  check_tag(r);
  return regions_.live_index(r);
}

std::uint32_t BridgeCore::region_range_index(const RegionRange& range) {
  check_tag(range.region);
  return regions_.range_index(range);
}

HostRegion BridgeCore::register_host(std::span<std::byte> bytes, bool read_only, Bridge::RegionRelease on_release) {
  if (bytes.empty()) fail(ErrorKind::InvalidExtent, "registering host memory of 0 bytes");
  const auto begin = reinterpret_cast<std::uintptr_t>(bytes.data());
  if (!bytes.data() || !checked::add(begin, bytes.size()))
    fail(ErrorKind::InvalidRange, "host memory at {:#x} of {} bytes is not an address range", begin, bytes.size());
  SpinLockHold lock(lock_);
  enter(lock);
  if (RegionRegistry::overlaps(begin, bytes.size(), ring_.block()))
    fail(ErrorKind::InvalidRange, "host memory [{:#x}, +{}) overlaps the bridge's own ring; stage through it instead",
         begin, bytes.size());
  const auto index = regions_.begin_register(bytes, read_only, generation_, std::move(on_release));
  HostBlock registered;
  auto failure = gate_.run_unlocked(lock, [&] {
    const ImportUse use = read_only ? ImportUse::StagingReadOnly : ImportUse::Staging;
    registered = backend_->import_host(ImportRequest{.use = use, .data = bytes.data(), .bytes = bytes.size()}).block;
  });
  if (failure) {
    regions_.cancel_register(index);
    if (failure->fatal()) mark_broken(*failure);
    throw *failure;
  }
  const HostRegion region = regions_.finish_register(index, registered);
  if (trace_.on()) [[unlikely]]
    trace_.memory(TraceKind::Register, region.generation, region.id, bytes.size());
  return region;
}

bool BridgeCore::unregister_host(const HostRegion& r, AfterAdoptions adopted) {
  SpinLockHold lock(lock_);
  enter(lock);
  check_tag(r);
  // As release_host and free_device: a copy that ended but that nobody polled
  // does not keep the region registered.
  const std::optional<HostBlock> block = [&] {
    try {
      return regions_.begin_unregister(r, adopted);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::AllocationStillInUse || regions_[regions_.live_index(r)].copies == 0 ||
          !apply_completions_before_refusing())
        throw;  // refused for its adoptions, or for copies still running
      return regions_.begin_unregister(r, adopted);
    }
  }();
  if (!block) return false;  // end_adoption unregisters it after the last
  gate_.run_unlocked(lock, [&] { backend_->release_import(HostImport{.block = *block}); });
  regions_.finish_unregister(id_slot(r.id));
  return true;
}

std::span<std::byte> BridgeCore::region_bytes(const HostRegion& r) {
  SpinLockHold lock(lock_);
  enter(lock);
  const auto& block = regions_[region_index(r)].block;
  return {block.data, block.bytes};
}

DeviceHandle BridgeCore::adopt_host(const RegionRange& range, const ObjectSpec& spec) {
  const auto [elem, view_dtype] = dtypes_.checked_allocation(spec, range.len);
  SpinLockHold lock(lock_);
  enter(lock);
  const auto index = region_range_index(range);
  auto& region = regions_[index];
  if (!region.read_only)
    fail(ErrorKind::InvalidRange,
         "adopting {}: only a region registered read-only (register_host_read_only) can be adopted; a writable one "
         "could be a copy's source and destination at once",
         describe(range));
  const auto address = reinterpret_cast<std::uintptr_t>(region.block.data) + range.offset;
  if (address & (spec.alignment - 1))
    fail(ErrorKind::InvalidAlignment, "adopting {}: its first byte at {:#x} is not aligned to the spec's {} bytes",
         describe(range), address, spec.alignment);
  const auto slot_index = allocations_.acquire();  // before the backend: it may throw
  DeviceAllocation device;
  try {
    device = call_backend([&] {
      return backend_->import_host(ImportRequest{
          .use = ImportUse::Adopt, .bytes = range.len, .region = region.block, .offset = range.offset}).device;
    });
  } catch (...) {
    allocations_.unissue(slot_index);
    throw;
  }
  const auto id = allocations_.start_adopted(slot_index, spec, elem, view_dtype, range.len, device, index);
  regions_.add_adoption(index);
  if (trace_.on()) [[unlikely]]
    trace_.memory(TraceKind::Adopt, generation_, id, range.len);
  return DeviceHandle{domain_, generation_, id};
}

bool BridgeCore::region_retained(const HostRegion& r) noexcept {
  std::lock_guard guard(lock_);
  return regions_.registered(r, generation_, released_at_close_);
}

[[gnu::noinline, gnu::cold]] void BridgeCore::end_adopted_slot(std::uint32_t index) noexcept {
  const DeviceAllocation device = allocations_[index].device;
  const std::uint32_t region = allocations_[index].adopted_region - 1;
  allocations_.retire(index);
  end_adoption(device, region);
}

void BridgeCore::end_adoption(const DeviceAllocation& device, std::uint32_t region) noexcept {
  backend_->release_import(HostImport{.device = device, .adopted = true});
  regions_.end_adoption(region, [&](const HostBlock& block) { backend_->release_import(HostImport{.block = block}); });
}

}  // namespace devbridge::detail
