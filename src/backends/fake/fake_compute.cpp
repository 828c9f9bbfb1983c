// The fake backend: the compute role (axpy), run at call time.
#include "backends/fake/fake_backend_impl.hpp"

namespace devbridge::fake {

Fence FakeBackend::launch_axpy(const AxpyLaunch& launch) {
  std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  // The byte count, or nothing when count * 4 does not fit (recorded as 2^64-1).
  const std::optional<std::uint64_t> bytes = checked::mul(launch.count, sizeof(float));
  {
    RecordedCall& call = s.calls[s.record(Call::Launch)];
    call.bytes = bytes.value_or(UINT64_MAX);
    call.address = launch.x.address;
    call.device_offset = launch.x_offset;
  }
  const Fired fired = s.fire(Call::Launch);
  if (fired.fatal) State::throw_fatal(Call::Launch, "launching axpy over " + std::to_string(launch.count) + " floats");
  auto inside = [&](const DeviceAllocation& a, std::uint64_t offset) {
    const State::Allocation* allocation = s.live(a);
    return allocation != nullptr && bytes && checked::range_within(offset, *bytes, allocation->bytes);
  };
  if (!inside(launch.x, launch.x_offset) || !inside(launch.y, launch.y_offset)) {
    throw Error(ErrorKind::InvalidRange, "fake launch: axpy over " + std::to_string(launch.count) +
                                             " floats outside its allocations reached the backend");
  }
  for (const auto* a : {&launch.x, &launch.y})
    if (s.live(*a)->unbacked) State::refuse_unbacked("launch", a->address);
  // Both ranges lie inside live allocations (inside() above): no sum wraps.
  const auto* x = reinterpret_cast<const std::byte*>(launch.x.address) + launch.x_offset;
  auto* y = reinterpret_cast<std::byte*>(launch.y.address) + launch.y_offset;
  for (std::uint64_t i = 0; i < launch.count; ++i) {
    float xi;
    std::memcpy(&xi, x + i * sizeof(float), sizeof(float));
    const float yi = launch.a * xi + launch.b;
    std::memcpy(y + i * sizeof(float), &yi, sizeof(float));
  }
  return s.new_fence(QueueRef{Queue::Compute}, s.launches_held);
}

}  // namespace devbridge::fake
