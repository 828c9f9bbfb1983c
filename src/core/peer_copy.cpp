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
  const std::uint64_t began = trace_.on() ? trace_.ticks() : 0;
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
      trace_.whole_slice(TraceTrack::Peer, side.range, side.began, true);
    else
      trace_.whole_slice(direction == CopyDirection::HostToDevice ? TraceTrack::CopyUp : TraceTrack::CopyDown,
                        side.range, side.began, how == HeldEnd::InPlace, true);
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

}  // namespace devbridge::detail
