// The bridge core's in-place access to device memory the CPU can reach
// (bridge_core.hpp): bytes written straight into allocations
// (write_in_place) and read straight out of them (read_in_place), no ring
// between, under the holds a copy takes.
#include "core/bridge_core.hpp"

namespace devbridge::detail {

namespace {

// Every range held as one side of a copy in `direction` for this object's
// life (BridgeCore::hold_for_peer_copy: validated, counted as a copy of the
// allocation, so free_device refuses and release defers, and as a call in
// progress, so a restart or close waits); each ended as `how` says when it
// goes.
class HeldRanges {
 public:
  HeldRanges(BridgeCore& core, std::span<const DeviceRange> ranges, CopyDirection direction)
      : core_(core), direction_(direction) {
    sides_.reserve(ranges.size());
    try {
      for (const DeviceRange& range : ranges) sides_.push_back(core_.hold_for_peer_copy(range, direction));
    } catch (...) {
      end();
      throw;
    }
  }
  HeldRanges(const HeldRanges&) = delete;
  HeldRanges& operator=(const HeldRanges&) = delete;
  ~HeldRanges() { end(); }

  const std::vector<BridgeCore::PeerSide>& sides() const noexcept { return sides_; }
  void ended(BridgeCore::HeldEnd how) noexcept { how_ = how; }

  // Host memory: an allocation's address is the CPU's.
  std::byte* address(std::size_t i) const noexcept {
    return reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(sides_[i].device.address)) +
           sides_[i].range.offset;
  }

 private:
  void end() noexcept {
    for (const auto& side : sides_) core_.end_peer_copy(side, direction_, how_);
    sides_.clear();
  }

  BridgeCore& core_;
  CopyDirection direction_;
  std::vector<BridgeCore::PeerSide> sides_;
  BridgeCore::HeldEnd how_ = BridgeCore::HeldEnd::Untouched;
};

// The in-place callbacks this thread runs, innermost first: a chain
// through the stack frames of the InCallback scopes that run them.
struct RunningCallback {
  const BridgeCore* core;
  CopyDirection direction;
  std::span<const BridgeCore::PeerSide> held;
  const RunningCallback* outer;
};
thread_local const RunningCallback* running_callbacks = nullptr;

// `held`'s callback marked as running on this thread for the scope.
class InCallback {
 public:
  InCallback(const BridgeCore& core, CopyDirection direction, const HeldRanges& held) noexcept
      : node_{&core, direction, held.sides(), running_callbacks} {
    running_callbacks = &node_;
  }
  InCallback(const InCallback&) = delete;
  InCallback& operator=(const InCallback&) = delete;
  ~InCallback() { running_callbacks = node_.outer; }

 private:
  RunningCallback node_;
};

}  // namespace

bool BridgeCore::inside_own_in_place_callback(std::optional<std::uint32_t> index, bool writes) const noexcept {
  for (const RunningCallback* c = running_callbacks; c != nullptr; c = c->outer) {
    if (c->core != this || (writes && c->direction != CopyDirection::HostToDevice)) continue;
    if (!index) return true;
    for (const PeerSide& side : c->held)
      if (side.index == *index) return true;
  }
  return false;
}

void BridgeCore::write_in_place(std::span<const DeviceRange> ranges,
                                const std::function<void(std::span<const std::span<std::byte>>)>& write) {
  if (!capabilities_.host_addressable && !capabilities_.maps_for_write)
    fail(ErrorKind::Unsupported,
         "write_in_place: device memory is not host memory on the {} backend, nor can it be mapped for writing "
         "(BackendInfo::host_addressable and maps_for_write are false); stage the bytes through the ring",
         backend_name_);
  // Held as a peer copy's destination is: a view's writes_under_view
  // honoured, a read-only adoption refused.
  HeldRanges held(*this, ranges, CopyDirection::HostToDevice);
  held.ended(HeldEnd::InPlaceFailed);  // until `write` returns
  if (capabilities_.host_addressable) {
    std::vector<std::span<std::byte>> bytes;
    bytes.reserve(ranges.size());
    for (std::size_t i = 0; i < ranges.size(); ++i)
      bytes.emplace_back(held.address(i), static_cast<std::size_t>(ranges[i].len));
    const InCallback running(*this, CopyDirection::HostToDevice, held);
    write(bytes);
  } else {
    std::vector<MappedWrite> mapped;
    mapped.reserve(ranges.size());
    for (std::size_t i = 0; i < ranges.size(); ++i)
      mapped.push_back(MappedWrite{held.sides()[i].device, ranges[i].offset, ranges[i].len});
    const InCallback running(*this, CopyDirection::HostToDevice, held);
    call_backend_unlocked([&] { backend_->write_mapped(mapped, write); });
  }
  held.ended(HeldEnd::InPlace);
}

void BridgeCore::read_in_place(std::span<const DeviceRange> ranges,
                               const std::function<void(std::span<const std::span<const std::byte>>)>& read) {
  if (!capabilities_.host_addressable)
    fail(ErrorKind::Unsupported,
         "read_in_place: device memory is not host memory on the {} backend (BackendInfo::host_addressable is "
         "false); stage the bytes through the ring",
         backend_name_);
  const bool launched = settle_writes_before_reading(ranges);
  HeldRanges held(*this, ranges, CopyDirection::DeviceToHost);
  if (launched) wait_for_launches();
  std::vector<std::span<const std::byte>> bytes;
  bytes.reserve(ranges.size());
  for (std::size_t i = 0; i < ranges.size(); ++i)
    bytes.emplace_back(held.address(i), static_cast<std::size_t>(ranges[i].len));
  held.ended(HeldEnd::InPlaceFailed);  // until `read` returns
  {
    const InCallback running(*this, CopyDirection::DeviceToHost, held);
    read(bytes);
  }
  held.ended(HeldEnd::InPlace);
}

bool BridgeCore::settle_writes_before_reading(std::span<const DeviceRange> ranges) {
  SpinLockHold lock(lock_);
  enter(lock);
  bool launched = false;
  // The lock is dropped while it waits: every handle is looked up again each time.
  wait_until(lock, std::chrono::steady_clock::time_point::max(), [&] {
    launched = false;
    for (const DeviceRange& range : ranges) {
      const AllocationSlot& slot = allocation(range.handle);
      if (slot.uploads != 0 && inside_own_in_place_callback(id_slot(range.handle.id), /*writes=*/true))
        fail(ErrorKind::AllocationStillInUse,
             "read_in_place of {}: called from inside this thread's own write_in_place into it (a fill handed "
             "its bytes), which it would wait for; read it after that returns",
             describe(range.handle));
      if (slot.uploads != 0) return false;
      launched = launched || slot.steps != 0;
    }
    return true;
  });
  return launched;
}

void BridgeCore::wait_for_launches() {
  // The seam's fence calls are safe from any thread; made without the lock,
  // as the wait may be long.
  const Fence fence = call_backend_unlocked([&] { return backend_->record_fence(QueueRef{Queue::Compute}); });
  if (!fence.pending()) return;
  try {
    call_backend_unlocked([&] { (void)backend_->wait_fence(fence, std::chrono::nanoseconds::max()); });
  } catch (...) {
    backend_->release_fence(fence);
    throw;
  }
  backend_->release_fence(fence);
}

}  // namespace devbridge::detail
