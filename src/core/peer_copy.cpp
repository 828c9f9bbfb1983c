// The bridge core's device-to-device copies between two bridges (bridge_core.hpp).
#include "core/bridge_core.hpp"

namespace devbridge::detail {

BridgeCore::PeerSide BridgeCore::hold_for_peer_copy(const DeviceRange& range, CopyDirection direction) {
  SpinLockHold lock(lock_);
  enter(lock);
  auto* slot = &allocation(range.handle);
  validate_device_range(range, *slot);
  if (direction == CopyDirection::HostToDevice && slot->read_only()) fail_read_only(range, "a peer copy into");
  if (guarded_write(*slot, direction)) {
    std::optional<checked::Clock::time_point> deadline;
    wait_out_views_or_fail(lock, range, deadline);
    slot = &allocation(range.handle);  // the lock was dropped: check again
    validate_device_range(range, *slot);
  }
  ++slot->copies;
  if (direction == CopyDirection::HostToDevice) ++slot->uploads;
  gate_.call_started();
  // Each bridge records its side on its peer track once the copy is done
  // (bridges without a direct path copy nothing here): the slice starts now.
  const std::uint64_t began = recording_ ? recording_->ticks() : 0;
  return {slot->device, id_slot(range.handle.id), began, range};
}

void BridgeCore::end_peer_copy(const PeerSide& side, CopyDirection direction, HeldEnd how) noexcept {
  SpinLockHold lock(lock_);
  auto& slot = allocations_[side.index];
  --slot.copies;
  if (direction == CopyDirection::HostToDevice) --slot.uploads;
  if (how == HeldEnd::PeerCopied) copies_.count_direct();
  if (how != HeldEnd::Untouched && side.began) [[unlikely]] {
    if (how == HeldEnd::PeerCopied)
      trace_whole_slice(TraceTrack::Peer, side.range, side.began, true);
    else
      trace_whole_slice(TraceTrack::CopyUp, side.range, side.began, how == HeldEnd::WrittenInPlace, true);
  }
  maybe_finish_release(side.index);
  gate_.call_ended();
}

bool BridgeCore::copy_to_peer(const DeviceRange& source, BridgeCore& destination, const DeviceRange& destination_range) {
  if (source.len != destination_range.len)
    fail(ErrorKind::InvalidRange, "device range of {} bytes of {} and device range of {} bytes of {} differ in "
         "length", source.len, describe(source.handle), destination_range.len, describe(destination_range.handle));
  if (&destination == this)
    fail(ErrorKind::Unsupported, "a peer copy goes to another bridge; within one bridge stage through the ring");
  const auto from = hold_for_peer_copy(source, CopyDirection::DeviceToHost);
  PeerSide to;
  try {
    to = destination.hold_for_peer_copy(destination_range, CopyDirection::HostToDevice);
  } catch (...) {
    end_peer_copy(from, CopyDirection::DeviceToHost, HeldEnd::Untouched);
    throw;
  }
  bool copied = false;
  std::optional<Error> failure;
  try {
    copied = backend_->copy_to_peer(from.device, source.offset, *destination.backend_, to.device,
                                    destination_range.offset, source.len);
  } catch (const Error& e) {
    failure.emplace(directed_kind(CopyDirection::HostToDevice, e.kind()), e.message(), e.fatal());
  } catch (const std::exception& e) {
    failure.emplace(ErrorKind::DeviceCopyFailed, fmt::format("the backend threw: {}", e.what()));
  }
  const HeldEnd how = copied ? HeldEnd::PeerCopied : HeldEnd::Untouched;
  end_peer_copy(from, CopyDirection::DeviceToHost, how);
  destination.end_peer_copy(to, CopyDirection::HostToDevice, how);
  if (failure) {
    if (failure->fatal()) {
      // The device state is unknown on both sides: both bridges turn Broken.
      {
        SpinLockHold lock(lock_);
        mark_broken(*failure);
      }
      SpinLockHold lock(destination.lock_);
      destination.mark_broken(*failure);
    }
    throw *failure;
  }
  return copied;
}

void BridgeCore::write_in_place(std::span<const DeviceRange> ranges,
                                const std::function<void(std::span<const std::span<std::byte>>)>& write) {
  if (!host_addressable_ && !maps_for_write_)
    fail(ErrorKind::Unsupported,
         "write_in_place: device memory is not host memory on the {} backend, nor can it be mapped for writing "
         "(BackendInfo::host_addressable and maps_for_write are false); stage the bytes through the ring",
         backend_name_);
  // Each range held as a peer copy's destination: validated, a view's
  // writes_under_view honoured, a read-only adoption refused; counted as a
  // copy into the allocation (free_device refuses, release defers) and as a
  // call in progress (a restart or close waits for the write).
  std::vector<PeerSide> held;
  held.reserve(ranges.size());
  auto end_all = [&](HeldEnd how) {
    for (const PeerSide& side : held) end_peer_copy(side, CopyDirection::HostToDevice, how);
  };
  try {
    for (const DeviceRange& range : ranges) held.push_back(hold_for_peer_copy(range, CopyDirection::HostToDevice));
  } catch (...) {
    end_all(HeldEnd::Untouched);
    throw;
  }
  try {
    if (host_addressable_) {
      // Host memory: the allocation's address is the CPU's.
      std::vector<std::span<std::byte>> bytes;
      bytes.reserve(ranges.size());
      for (std::size_t i = 0; i < ranges.size(); ++i)
        bytes.emplace_back(reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(held[i].device.address)) +
                               ranges[i].offset,
                           static_cast<std::size_t>(ranges[i].len));
      write(bytes);
    } else {
      std::vector<MappedWrite> mapped;
      mapped.reserve(ranges.size());
      for (std::size_t i = 0; i < ranges.size(); ++i)
        mapped.push_back(MappedWrite{held[i].device, ranges[i].offset, ranges[i].len});
      try {
        backend_->write_mapped(mapped, write);
      } catch (const Error& e) {
        if (e.fatal()) {  // the device is gone: the bridge turns Broken until a restart
          SpinLockHold lock(lock_);
          mark_broken(e);
        }
        throw;
      }
    }
  } catch (...) {
    end_all(HeldEnd::WriteInPlaceFailed);
    throw;
  }
  end_all(HeldEnd::WrittenInPlace);
}

}  // namespace devbridge::detail
