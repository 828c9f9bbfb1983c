// Bridge, ViewLease and HostLease: thin handles over the bridge core.
#include "core/bridge_core.hpp"

namespace devbridge {

// ---- ViewLease ----

// The view is built in place (core->view returns it as a prvalue); a refusal
// throws before the lease exists, so nothing ends it.
[[gnu::always_inline]] inline ViewLease::ViewLease(detail::BridgeCore* core, const DeviceHandle& handle, const ViewSpec& spec,
                            ViewWait wait)
    : core_(core), view_(core->view(handle, spec, wait)) {}

ViewLease::ViewLease(ViewLease&& other) noexcept
    : core_(std::exchange(other.core_, nullptr)),
      handed_on_core_(std::exchange(other.handed_on_core_, nullptr)),
      view_(other.view_),
      holder_(other.holder_) {}

ViewLease& ViewLease::operator=(ViewLease&& other) noexcept {
  if (this != &other) {
    reset();
    core_ = std::exchange(other.core_, nullptr);
    handed_on_core_ = std::exchange(other.handed_on_core_, nullptr);
    view_ = other.view_;
    holder_ = other.holder_;
  }
  return *this;
}

ViewLease::~ViewLease() { reset(); }

void ViewLease::reset() noexcept {
  if (auto* core = std::exchange(core_, nullptr))
    core->end_view(view_.handle);
  else if (auto* handed_on = std::exchange(handed_on_core_, nullptr)) [[unlikely]]
    handed_on->end_handed_on_view(view_.handle, holder_);
}

void ViewLease::end_after(ConsumerQueue queue) {
  auto* core = core_ ? core_ : handed_on_core_;
  if (!core) return;
  core->hold_view_until_fence(view_.handle, queue);
  reset();
}

ViewLease ViewLease::share() const {
  ViewLease shared;
  auto* core = core_ ? core_ : handed_on_core_;
  if (core == nullptr || !core->share_view(view_.handle)) return shared;
  shared.core_ = core;
  shared.view_ = view_;
  return shared;
}

void ViewLease::set_holder(ViewHolder holder) noexcept {
  auto* core = core_ ? core_ : handed_on_core_;
  if (!core) return;
  core->set_view_holder(view_.handle, holder_, holder);
  holder_ = holder;
  core_ = holder == ViewHolder::Caller ? core : nullptr;
  handed_on_core_ = holder == ViewHolder::Caller ? nullptr : core;
}

// ---- HostLease ----

HostLease::HostLease(HostLease&& other) noexcept
    : core_(std::exchange(other.core_, nullptr)), bytes_(std::exchange(other.bytes_, {})) {}

HostLease& HostLease::operator=(HostLease&& other) noexcept {
  if (this != &other) {
    reset();
    core_ = std::exchange(other.core_, nullptr);
    bytes_ = std::exchange(other.bytes_, {});
  }
  return *this;
}

HostLease::~HostLease() { reset(); }

void HostLease::reset() noexcept {
  bytes_ = {};
  if (auto* core = std::exchange(core_, nullptr)) core->end_host_lease();
}

// ---- Bridge ----

void Bridge::Detach::operator()(detail::BridgeCore* core) const noexcept { core->detach_owner(); }

Bridge::Bridge(std::unique_ptr<Backend> backend, BridgeOptions options)
    : core_(new detail::BridgeCore(std::move(backend), options)) {}

Bridge::~Bridge() = default;

std::uint64_t Bridge::domain() const noexcept { return core_->domain(); }
Generation Bridge::generation() const { return core_->generation(); }
BackendInfo Bridge::backend_info() const { return core_->backend().describe(); }
const BackendCapabilities& Bridge::capabilities() const noexcept { return core_->capabilities(); }
void Bridge::require_compute(DType dtype, std::string_view what) const { core_->require_compute(dtype, what); }
BridgeStats Bridge::stats() const { return core_->stats(); }
MemoryStats Bridge::memory_stats() const { return core_->memory_stats(); }
void Bridge::reset_peak_memory() { core_->reset_peak_memory(); }
void Bridge::empty_cache() { core_->empty_cache(); }
void Bridge::record(const RecordOptions& options) { core_->record(options); }
void Bridge::stop_recording() { core_->stop_recording(); }
bool Bridge::records_stacks() const noexcept { return core_->records_stacks(); }
std::string Bridge::trace_json() const { return detail::trace_json(core_->trace_dump()); }
void Bridge::dump_trace(const std::filesystem::path& path) const {
  detail::write_file_atomically(path.string(), trace_json());
}
std::string Bridge::memory_snapshot_json() const { return core_->memory_snapshot_json(); }

DeviceHandle Bridge::alloc_device(const ObjectSpec& spec, std::uint64_t extent) {
  return core_->alloc_device(spec, extent);
}
void Bridge::free_device(DeviceHandle handle) {
  // The core in a local: the handler then needs nothing the inlined free
  // does not keep anyway (with this->core_, `this` took a register of its own).
  detail::BridgeCore* const core = core_.get();
  try {
    core->free_device(handle);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::AllocationStillInUse) throw;
    core->free_once_copies_applied(handle);
  }
}
void Bridge::release(DeviceHandle handle) { core_->release(handle); }
std::uint64_t Bridge::extent(DeviceHandle handle) const { return core_->spec_of(handle).second; }
ObjectSpec Bridge::spec(DeviceHandle handle) const { return core_->spec_of(handle).first; }
void Bridge::check_allocation(const ObjectSpec& spec, std::uint64_t extent) const {
  core_->check_allocation(spec, extent);
}

HostRange Bridge::reserve(std::uint64_t bytes, std::uint64_t alignment, std::chrono::nanoseconds timeout) {
  return core_->reserve(bytes, alignment, timeout);
}
void Bridge::release_host(HostRange range) { core_->release_host(range); }
void Bridge::release_host_after(HostRange range, CopyEvent event) { core_->release_host_after(range, event); }
bool Bridge::wait_for_release_after(std::chrono::nanoseconds timeout) { return core_->wait_for_release_after(timeout); }
std::span<std::byte> Bridge::host_bytes(HostRange range) const { return core_->host_bytes(range); }
HostLease Bridge::lease_host(HostRange range) {
  HostLease lease;
  lease.bytes_ = core_->lease_host(range);
  lease.core_ = core_.get();
  return lease;
}
std::uint64_t Bridge::ring_capacity() const noexcept { return core_->ring_capacity(); }
std::uint64_t Bridge::ring_free_bytes() const { return core_->ring_free_bytes(); }

template <HostRangeType H>
CopyEvent Bridge::host_to_device(H host, DeviceRange device, CopyMode mode, Admission admission) {
  return core_->copy(CopyDirection::HostToDevice, host, device, mode, admission);
}
template <HostRangeType H>
CopyEvent Bridge::device_to_host(DeviceRange device, H host, CopyMode mode, Admission admission) {
  return core_->copy(CopyDirection::DeviceToHost, host, device, mode, admission);
}
template CopyEvent Bridge::host_to_device(HostRange, DeviceRange, CopyMode, Admission);
template CopyEvent Bridge::host_to_device(RegionRange, DeviceRange, CopyMode, Admission);
template CopyEvent Bridge::device_to_host(DeviceRange, HostRange, CopyMode, Admission);
template CopyEvent Bridge::device_to_host(DeviceRange, RegionRange, CopyMode, Admission);

CopyEvent Bridge::copy(const HostCopy& request) {
  return std::visit(
      [&](const auto& host) {
        if (request.layout)
          return core_->copy<true>(request.direction, host, request.device, request.mode, request.admission,
                                   *request.layout);
        return core_->copy(request.direction, host, request.device, request.mode, request.admission);
      },
      request.host);
}
bool Bridge::copy_to_peer(DeviceRange source, Bridge& destination, DeviceRange destination_range) {
  return core_->copy_to_peer(source, *destination.core_, destination_range);
}
void Bridge::write_in_place(std::span<const DeviceRange> ranges,
                            const std::function<void(std::span<const std::span<std::byte>>)>& write) {
  core_->write_in_place(ranges, write);
}
void Bridge::read_in_place(std::span<const DeviceRange> ranges,
                           const std::function<void(std::span<const std::span<const std::byte>>)>& read) {
  core_->read_in_place(ranges, read);
}
HostRegion Bridge::register_host(std::span<std::byte> bytes, RegionRelease on_release) {
  return core_->register_host(bytes, false, std::move(on_release));
}
HostRegion Bridge::register_host_read_only(std::span<const std::byte> bytes, RegionRelease on_release) {
  // Never written through: a download into a read-only region is refused.
  return core_->register_host({const_cast<std::byte*>(bytes.data()), bytes.size()}, true, std::move(on_release));
}
void Bridge::unregister_host(HostRegion region) { core_->unregister_host(region); }
bool Bridge::unregister_host_after_adoptions(HostRegion region) {
  return core_->unregister_host(region, detail::AfterAdoptions::Wait);
}
std::span<std::byte> Bridge::region_bytes(HostRegion region) const { return core_->region_bytes(region); }
bool Bridge::region_retained(HostRegion region) const noexcept { return core_->region_retained(region); }
DeviceHandle Bridge::adopt_host(RegionRange range, const ObjectSpec& spec) { return core_->adopt_host(range, spec); }
CopyStatus Bridge::copy_status(CopyEvent event) { return core_->copy_status(event); }
bool Bridge::safe_to_release_host(CopyEvent event) { return core_->is_completed(event); }
bool Bridge::host_bytes_valid(CopyEvent event) { return core_->is_completed(event); }
CopyStatus Bridge::wait(CopyEvent event, std::optional<std::chrono::nanoseconds> timeout) {
  return core_->wait(event, timeout);
}
std::size_t Bridge::poll() { return core_->poll(); }

void Bridge::begin_step(StepId step, std::span<const DeviceHandle> handles) { core_->begin_step(step, handles); }
void Bridge::end_step(StepId step) { core_->end_step(step, std::nullopt); }
void Bridge::end_step(StepId step, ConsumerQueue after) { core_->end_step(step, after); }
void Bridge::launch_axpy(DeviceRange x, DeviceRange y, float a, float b) { core_->launch_axpy(x, y, a, b); }

ViewLease Bridge::view(DeviceHandle handle, const ViewSpec& spec, ViewWait wait) {
  return ViewLease(core_.get(), handle, spec, wait);
}

void Bridge::restart(Generation generation) { core_->restart(generation); }
void Bridge::close() { core_->close(); }
Backend& Bridge::backend() noexcept { return core_->backend(); }

}  // namespace devbridge
