// The fake backend: device memory (allocate/free, parts) and host blocks for the ring.
#include "backends/fake/fake_backend_impl.hpp"

namespace devbridge::fake {

std::uint64_t FakeBackend::live_allocations() const {
  std::lock_guard lock(state_->mutex);
  return static_cast<std::uint64_t>(
      std::count_if(state_->allocations.begin(), state_->allocations.end(), &State::is_whole));
}

std::uint64_t FakeBackend::live_host_blocks() const {
  std::lock_guard lock(state_->mutex);
  return static_cast<std::uint64_t>(std::count_if(state_->host_blocks.begin(), state_->host_blocks.end(),
                                                  [](const auto& entry) { return !entry.second.registered; }));
}

DeviceAllocation FakeBackend::allocate(std::uint64_t bytes, std::uint64_t alignment) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const std::size_t record = s.record(Call::Allocate, bytes);
  s.calls[record].alignment = alignment;
  const Fired fired = s.fire(Call::Allocate);
  const std::uint64_t free_bytes = s.memory_bytes - s.used_bytes;
  if (fired.fatal) State::throw_fatal(Call::Allocate, "allocating " + std::to_string(bytes) + " bytes");
  if (fired.allocation_failed) {
    throw Error(ErrorKind::AllocationFailed, "fake allocate: injected failure: " + std::to_string(bytes) +
                                                 " bytes asked, " + std::to_string(free_bytes) + " bytes free");
  }
  if (!is_power_of_two(alignment)) {
    throw Error(ErrorKind::InvalidAlignment,
                "fake allocate: alignment " + std::to_string(alignment) + " is not a power of two");
  }
  const auto out_of_memory = [&] {
    return Error(ErrorKind::AllocationFailed, "fake allocate: out of memory: " + std::to_string(bytes) +
                                                  " bytes asked, " + std::to_string(free_bytes) + " bytes free of " +
                                                  std::to_string(s.memory_bytes));
  };
  if (bytes > free_bytes) throw out_of_memory();
  State::Allocation allocation;
  if (s.backing == Backing::None) {
    // An address range only: nothing is allocated or filled.
    const auto address = s.unbacked_range(bytes, std::max(alignment, kMinDeviceAlignment));
    if (!address)
      throw Error(ErrorKind::AllocationFailed,
                  fmt::format("fake allocate: {} bytes at an alignment of {}: the address space of memory without "
                              "backing is used up",
                              bytes, alignment));
    allocation.memory = SharedBytes(SharedBytes(), reinterpret_cast<std::byte*>(*address));  // not owned: no memory
    allocation.bytes = bytes;
    allocation.unbacked = true;
  } else {
    try {
      allocation.memory =
          allocate_bytes(bytes, std::max(alignment, kMinDeviceAlignment), "fake allocate");
      allocation.bytes = bytes;
    } catch (const std::bad_alloc&) {
      throw out_of_memory();
    }
  }
  const std::uintptr_t token = s.next_token++;
  const DeviceAllocation result{reinterpret_cast<std::uintptr_t>(allocation.memory.get()), bytes, token};
  s.allocations.emplace(token, std::move(allocation));
  s.used_bytes += bytes;
  s.calls[record].address = result.address;
  return result;
}

void FakeBackend::free(const DeviceAllocation& allocation) noexcept {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  s.record(Call::Free, allocation.bytes, allocation.address);
  auto it = s.allocations.find(allocation.token);
  if (it == s.allocations.end() || reinterpret_cast<std::uintptr_t>(it->second.memory.get()) != allocation.address) {
    std::fprintf(stderr, "FakeBackend: free of unknown or already freed allocation (address 0x%llx, token %llu)\n",
                 static_cast<unsigned long long>(allocation.address),
                 static_cast<unsigned long long>(allocation.token));
    return;
  }
  if (it->second.adopted) {
    std::fprintf(stderr, "FakeBackend: free of adopted host memory (address 0x%llx), which is released, never freed\n",
                 static_cast<unsigned long long>(allocation.address));
    return;
  }
  // The counts say whether there is anything to warn about: only then are
  // the parts and the pending copies looked through (a free stays O(log n)).
  if (it->second.live_parts != 0) {
    for (const auto& [token, other] : s.allocations) {
      if (other.whole == allocation.token) {
        std::fprintf(stderr, "FakeBackend: allocation 0x%llx freed while its part 0x%llx is live\n",
                     static_cast<unsigned long long>(allocation.address),
                     static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(other.memory.get())));
      }
    }
  }
  if (it->second.pending_copies != 0) {
    for (const auto& p : s.pending) {
      if (p.request.device.token == allocation.token) {
        std::fprintf(stderr, "FakeBackend: allocation 0x%llx freed while %s is in flight\n",
                     static_cast<unsigned long long>(allocation.address), event_text(p.request.event).c_str());
      }
    }
  }
  s.used_bytes -= it->second.bytes;
  s.allocations.erase(it);
}

HostBlock FakeBackend::allocate_host(std::uint64_t bytes) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const std::size_t record = s.record(Call::AllocateHost, bytes);
  const Fired fired = s.fire(Call::AllocateHost);
  if (fired.fatal) State::throw_fatal(Call::AllocateHost, "allocating " + std::to_string(bytes) + " host bytes");
  if (fired.allocation_failed) {
    throw Error(ErrorKind::AllocationFailed,
                "fake allocate_host: injected failure: " + std::to_string(bytes) + " host bytes asked");
  }
  // The fake's memory bounds its host blocks too: a ring near 2^64 bytes is
  // refused as a driver would refuse it, not left to the allocator.
  if (bytes > s.memory_bytes)
    throw Error(ErrorKind::AllocationFailed, "fake allocate_host: " + std::to_string(bytes) +
                                                 " host bytes asked, more than the fake's memory of " +
                                                 std::to_string(s.memory_bytes));
  State::HostBlockRecord block;
  try {
    block = {allocate_bytes(bytes, kHostBlockAlignment, "fake allocate_host"), bytes};
  } catch (const std::bad_alloc&) {
    throw Error(ErrorKind::AllocationFailed,
                "fake allocate_host: out of host memory: " + std::to_string(bytes) + " host bytes asked");
  }
  const std::uintptr_t token = s.next_token++;
  const HostBlock result{block.memory.get(), bytes, /*page_locked=*/false, token};
  s.host_blocks.emplace(token, std::move(block));
  s.calls[record].address = reinterpret_cast<std::uintptr_t>(result.data);
  return result;
}

void FakeBackend::free_host(const HostBlock& block) noexcept {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  s.record(Call::FreeHost, block.bytes, reinterpret_cast<std::uintptr_t>(block.data));
  auto it = s.host_blocks.find(block.token);
  if (it == s.host_blocks.end() || it->second.memory.get() != block.data) {
    std::fprintf(stderr, "FakeBackend: free_host of unknown or already freed block (%p, token %llu)\n",
                 static_cast<void*>(block.data), static_cast<unsigned long long>(block.token));
    return;
  }
  s.host_blocks.erase(it);
}

void FakeBackend::set_parts(bool on) {
  std::lock_guard lock(state_->mutex);
  state_->parts = on;
}

std::uint64_t FakeBackend::live_parts() const {
  std::lock_guard lock(state_->mutex);
  return static_cast<std::uint64_t>(std::count_if(state_->allocations.begin(), state_->allocations.end(),
                                                  [](const auto& entry) { return entry.second.whole != 0; }));
}

DeviceAllocation FakeBackend::make_part(const DeviceAllocation& whole, std::uint64_t offset, std::uint64_t bytes) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  State::Allocation* const parent = s.live(whole);
  if (parent == nullptr || parent->whole != 0 || !checked::range_within(offset, bytes, parent->bytes) ||
      offset % kPartAlignment != 0)
    throw Error(ErrorKind::InvalidRange, fmt::format("fake make_part: [{}, +{}) is not a part of a live allocation "
                                                     "(address {:#x}, {} bytes) at a multiple of {} bytes",
                                                     offset, bytes, whole.address, whole.bytes, kPartAlignment));
  const std::uintptr_t token = s.next_token++;
  // Shares the whole's bytes (an address inside its range, without backing).
  std::byte* const at =
      parent->unbacked ? reinterpret_cast<std::byte*>(whole.address + offset) : parent->memory.get() + offset;
  SharedBytes memory(parent->memory, at);
  const DeviceAllocation part{reinterpret_cast<std::uintptr_t>(memory.get()), bytes, token};
  State::Allocation record{std::move(memory), bytes, whole.token};
  record.unbacked = parent->unbacked;
  s.allocations.emplace(token, std::move(record));
  ++parent->live_parts;
  return part;
}

void FakeBackend::release_part(const DeviceAllocation& part) noexcept {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  const auto it = s.allocations.find(part.token);
  if (it == s.allocations.end() || it->second.whole == 0) {
    std::fprintf(stderr, "FakeBackend: release_part of unknown or already released part (address 0x%llx, token %llu)\n",
                 static_cast<unsigned long long>(part.address), static_cast<unsigned long long>(part.token));
    return;
  }
  if (const auto whole = s.allocations.find(it->second.whole); whole != s.allocations.end())
    --whole->second.live_parts;  // (a whole freed under its part is gone, warned about)
  s.allocations.erase(it);
}

}  // namespace devbridge::fake
