// The bridge's recording sites (trace_sites.hpp).
#include "core/trace_sites.hpp"

#include <algorithm>

namespace devbridge::detail {

std::unique_ptr<FlightRecorder> TraceSites::start(std::unique_ptr<FlightRecorder> recorder) noexcept {
  auto previous = std::exchange(recorder_, std::move(recorder));
  recording_ = recorder_.get();
  records_stacks_.store(recording_ && recording_->options().stacks, std::memory_order_relaxed);
  return previous;
}

void TraceSites::stop() noexcept {
  recording_ = nullptr;
  records_stacks_.store(false, std::memory_order_relaxed);
}

void TraceSites::record(TraceRecord record) noexcept {
  if (!recording_) return;
  if (record.has_counters) record.counters = counters();
  recording_->record(record);
}

void TraceSites::memory(TraceKind kind, Generation generation, std::uint64_t id, std::uint64_t bytes,
                        std::uint64_t address) noexcept {
  if (!recording_) return;
  auto& record = recording_->append(kind, generation, id, counters());
  record.bytes = bytes;
  record.offset = address;
}

inline void TraceSites::freed(const FreedMemory& freed) noexcept {
  auto& record = recording_->append(TraceKind::Free, freed.generation, freed.id, counters());
  record.slice = freed.deferred ? 1u : 0u;  // Free's marker: the end of a deferred release
  record.bytes = freed.bytes;
  record.offset = freed.address;
}

TraceSites::FreedMemory TraceSites::freed_of(std::uint32_t index) const noexcept {
  const auto& slot = allocations_[index];
  return FreedMemory{generation_, make_id(index, slot.version), slot.extent, slot.device.address, slot.released};
}

void TraceSites::freed_slot(std::uint32_t index) noexcept {
  if (!recording_) return;
  // Recorded just after the slot retired, without a pool (the memory goes
  // straight back to the backend): the counters already say so.
  freed(freed_of(index));
}

void TraceSites::given_back(const FreedMemory* freed_memory, std::uint64_t part_bytes, bool coalesced,
                            const std::optional<DeviceAllocation>& whole) noexcept {
  if (!recording_) return;
  // The pool has taken the memory back (cached, or the segment out of it for
  // the backend): every sample below counts it where it went.
  if (freed_memory) freed(*freed_memory);
  if (coalesced) memory(TraceKind::PoolCoalesce, generation_, 0, part_bytes);
  if (whole && pool_) memory(TraceKind::PoolGiveBack, generation_, 0, whole->bytes);
}

void TraceSites::pool_take(TraceKind kind, std::uint64_t class_bytes, std::uint64_t part_bytes, bool split) noexcept {
  if (!recording_) return;
  // The part is the request's from here on (its allocate follows at once):
  // counted as allocated, so that allocated + cached is still reserved.
  auto sample = counters();
  sample.allocated += part_bytes;
  recording_->append(kind, generation_, 0, sample).bytes = class_bytes;
  if (split) recording_->append(TraceKind::PoolSplit, generation_, 0, sample).bytes = class_bytes;
}

void TraceSites::copy_begin(CopyDirection direction, const DeviceRange& device, std::uint64_t event_id,
                            std::uint64_t bytes) noexcept {
  if (!recording_) return;
  // An async copy adds to the bytes in flight.
  auto& record = recording_->append(TraceKind::CopyBegin, generation_, device.handle.id, counters());
  record.slice = event_id;
  record.offset = device.offset;
  record.bytes = bytes;
  record.track = direction == CopyDirection::HostToDevice ? TraceTrack::CopyUp : TraceTrack::CopyDown;
}

void TraceSites::whole_slice(TraceTrack track, const DeviceRange& range, std::uint64_t began, bool ok,
                             bool in_place) noexcept {
  if (!recording_) return;
  const TraceKind kind = in_place ? (ok ? TraceKind::InPlaceWrite : TraceKind::InPlaceWriteFailed)
                                  : (ok ? TraceKind::WholeSlice : TraceKind::WholeSliceFailed);
  auto& record = recording_->append(kind, generation_, range.handle.id);
  record.slice = began != 0 ? began : record.ticks;  // 0: recording began during the call
  record.offset = range.offset;
  record.bytes = range.len;
  record.track = track;
}

void TraceSites::completions(std::span<const Completion> drained, std::uint64_t domain) noexcept {
  // Recorded before they apply: each end's counters say what the bytes in
  // flight will be once it and those before it have.
  std::uint64_t ended = 0;
  for (const auto& c : drained) {
    if (c.event.domain != domain || c.event.generation != generation_) continue;  // stale: never applied
    const CopySlot* copy = copies_.pending(c.event.id);
    if (!copy) continue;
    ended += copy->bytes;
    auto sample = counters();
    sample.in_flight -= std::min(sample.in_flight, ended);
    auto& record =
        recording_->append(c.ok ? TraceKind::CopyCompleted : TraceKind::CopyFailed, c.event.generation, 0, sample);
    record.slice = c.event.id;
    record.track = copy->direction == CopyDirection::HostToDevice ? TraceTrack::CopyUp : TraceTrack::CopyDown;
  }
}

void TraceSites::view(TraceKind kind, const DeviceHandle& h, ViewHolder holder) noexcept {
  // Views of one allocation are told apart by nothing: their slices are
  // keyed by its id, and an end closes any one of them.
  if (!recording_) return;
  auto& record = recording_->append(kind, h.generation, h.id);
  record.slice = h.id;
  record.track = kind == TraceKind::ViewHandedOn ? TraceTrack::Calls : TraceTrack::Views;
  record.holder = static_cast<std::uint8_t>(holder);
}

void TraceSites::fence(TraceKind kind, const DropQueue::Entry& entry) noexcept {
  std::uint64_t bytes = 0;
  for (const auto id : entry.allocation_ids)
    if (const auto* slot = entry.generation == generation_ ? allocations_.find(id) : nullptr) bytes += slot->extent;
  auto fenced = trace_record(kind, entry.generation, entry.allocation_ids.empty() ? 0 : entry.allocation_ids.front());
  fenced.slice = entry.fence.token;  // pairs the fence's slice on its queue's track
  fenced.bytes = bytes;
  fenced.consumer = entry.where.queue == Queue::Consumer ? entry.where.consumer : 0;
  fenced.queue = static_cast<std::uint8_t>(entry.where.queue);
  record(fenced);
  // A launch's slice ends at its fence (bridge.cpp, launch_axpy).
  if (kind == TraceKind::FencePassed && entry.where.queue == Queue::Compute) {
    auto end = trace_record(TraceKind::LaunchEnd, entry.generation);
    end.slice = entry.fence.token;
    end.track = TraceTrack::Compute;
    record(end);
  }
}

}  // namespace devbridge::detail
