// The fake backend: the caller's host memory, imported for staging
// (register_host) and adopted in place (adopt_host).
#include "backends/fake/fake_backend_impl.hpp"

namespace devbridge::fake {

HostImport FakeBackend::import_host(const ImportRequest& request) {
  if (request.use == ImportUse::Adopt)
    return HostImport{.device = adopt_host(request.region, request.offset, request.bytes), .adopted = true};
  return HostImport{.block = register_host(request.data, request.bytes)};
}

void FakeBackend::release_import(const HostImport& imported) noexcept {
  if (imported.adopted)
    release_adopted(imported.device);
  else
    unregister_host(imported.block);
}

HostBlock FakeBackend::register_host(std::byte* data, std::uint64_t bytes) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  s.record(Call::RegisterHost, bytes, reinterpret_cast<std::uintptr_t>(data));
  const Fired fired = s.fire(Call::RegisterHost);
  const std::string what = std::to_string(bytes) + " bytes at " + std::to_string(reinterpret_cast<std::uintptr_t>(data));
  if (fired.fatal) State::throw_fatal(Call::RegisterHost, "registering " + what);
  if (fired.allocation_failed)
    throw Error(ErrorKind::AllocationFailed, "fake register_host: injected failure registering " + what);
  // A driver refuses to pin the same pages twice (cuMemHostRegister); the
  // bridge must never ask.
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  for (const auto& [token, block] : s.host_blocks) {
    const auto other = reinterpret_cast<std::uintptr_t>(block.memory.get());
    if (begin < other + block.bytes && other < begin + bytes)
      throw Error(ErrorKind::InvalidRange, "fake register_host: " + what + " overlaps a host block the fake holds");
  }
  const std::uintptr_t token = s.next_token++;
  // The caller owns the bytes: the record aliases them without owning them.
  s.host_blocks.emplace(token, State::HostBlockRecord{SharedBytes(SharedBytes(), data), bytes, true});
  return HostBlock{data, bytes, /*page_locked=*/false, token};
}

void FakeBackend::unregister_host(const HostBlock& block) noexcept {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  s.record(Call::UnregisterHost, block.bytes, reinterpret_cast<std::uintptr_t>(block.data));
  auto it = s.host_blocks.find(block.token);
  if (it == s.host_blocks.end() || !it->second.registered || it->second.memory.get() != block.data) {
    std::fprintf(stderr, "FakeBackend: unregister_host of unknown or already unregistered memory (%p, token %llu)\n",
                 static_cast<void*>(block.data), static_cast<unsigned long long>(block.token));
    return;
  }
  if (it->second.adoptions != 0) {  // looked through only when there is something to find (O(log n) otherwise)
    for (const auto& [token, allocation] : s.allocations) {
      const auto* at = allocation.memory.get();
      if (allocation.adopted && at >= block.data && at < block.data + block.bytes)
        std::fprintf(stderr, "FakeBackend: unregister_host of memory (%p) an adopted allocation (%p) still uses\n",
                     static_cast<void*>(block.data), static_cast<const void*>(at));
    }
  }
  s.host_blocks.erase(it);
}

std::uint64_t FakeBackend::live_registrations() const {
  std::lock_guard lock(state_->mutex);
  return static_cast<std::uint64_t>(std::count_if(state_->host_blocks.begin(), state_->host_blocks.end(),
                                                  [](const auto& entry) { return entry.second.registered; }));
}

std::uint64_t FakeBackend::live_adoptions() const {
  std::lock_guard lock(state_->mutex);
  return static_cast<std::uint64_t>(
      std::count_if(state_->allocations.begin(), state_->allocations.end(), &State::is_adopted));
}

DeviceAllocation FakeBackend::adopt_host(const HostBlock& region, std::uint64_t offset, std::uint64_t bytes) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const auto block = s.host_blocks.find(region.token);
  if (block == s.host_blocks.end() || !block->second.registered || block->second.memory.get() != region.data ||
      !checked::range_within(offset, bytes, block->second.bytes))
    throw Error(ErrorKind::InvalidRange, fmt::format("fake adopt_host: [{}, +{}) is not inside memory registered "
                                                     "with the fake ({} bytes at {})",
                                                     offset, bytes, region.bytes, static_cast<void*>(region.data)));
  const std::uintptr_t token = s.next_token++;
  SharedBytes memory(SharedBytes(), region.data + offset);  // the caller's bytes, not owned
  const DeviceAllocation adopted{reinterpret_cast<std::uintptr_t>(memory.get()), bytes, token};
  State::Allocation record{std::move(memory), bytes, 0, true};
  record.region = region.token;
  s.allocations.emplace(token, std::move(record));
  ++block->second.adoptions;
  return adopted;
}

void FakeBackend::release_adopted(const DeviceAllocation& adopted) noexcept {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const auto it = s.allocations.find(adopted.token);
  if (it == s.allocations.end() || !it->second.adopted) {
    std::fprintf(stderr, "FakeBackend: release_adopted of unknown or already released memory (address 0x%llx, "
                         "token %llu)\n",
                 static_cast<unsigned long long>(adopted.address), static_cast<unsigned long long>(adopted.token));
    return;
  }
  if (const auto block = s.host_blocks.find(it->second.region); block != s.host_blocks.end())
    --block->second.adoptions;  // (a region unregistered under it is gone, warned about)
  s.allocations.erase(it);
}

}  // namespace devbridge::fake
