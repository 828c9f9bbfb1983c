// The C entry points over devbridge::Bridge: lifetime, devices, memory,
// copies, events, steps and statistics. Each is a thin translation; every
// rule of the contract is the C++ bridge's.
#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "boundary.hpp"
#include "devbridge/backends.hpp"
#include "devbridge/consumer_names.hpp"

using namespace devbridge;
using namespace devbridge::c_api;

namespace {

// "0: default" for the options whose C++ default is not zero.
template <class T>
T or_default(T given, T fallback) {
  return given == 0 ? fallback : given;
}

BridgeOptions bridge_options_from_c(const devbridge_open_options& given) {
  const BridgeOptions defaults;
  BridgeOptions options;
  options.generation = or_default<Generation>(given.generation, defaults.generation);
  options.ring_bytes = or_default(given.ring_bytes, defaults.ring_bytes);
  options.inflight_budget_bytes = given.inflight_budget_bytes;
  if (given.failed_record_limit > std::numeric_limits<std::uint32_t>::max())
    invalid_argument("options->failed_record_limit of " + std::to_string(given.failed_record_limit) +
                     " is more than UINT32_MAX");
  options.failed_record_limit =
      or_default(static_cast<std::uint32_t>(given.failed_record_limit), defaults.failed_record_limit);
  if (given.pool_cap_bytes != 0) options.pool_cap_bytes = given.pool_cap_bytes;
  const auto under_view = timeout(given.writes_under_view_timeout_ns, "options->writes_under_view_timeout_ns");
  if (under_view.count() != 0) options.writes_under_view_timeout = under_view;
  const auto close_fence = timeout(given.close_fence_timeout_ns, "options->close_fence_timeout_ns");
  if (close_fence.count() != 0) options.close_fence_timeout = close_fence;
  switch (given.writes_under_view) {
    case DEVBRIDGE_WRITES_UNDER_VIEW_REFUSE: options.writes_under_view = WritesUnderView::Refuse; break;
    case DEVBRIDGE_WRITES_UNDER_VIEW_WAIT: options.writes_under_view = WritesUnderView::Wait; break;
    case DEVBRIDGE_WRITES_UNDER_VIEW_ALLOW: options.writes_under_view = WritesUnderView::Allow; break;
    default:
      invalid_argument("options->writes_under_view is " + std::to_string(given.writes_under_view) +
                       ", not a DEVBRIDGE_WRITES_UNDER_VIEW_ constant");
  }
  switch (given.caching_pool) {
    case DEVBRIDGE_CACHING_POOL_BACKEND_DEFAULT: options.caching_pool = CachingPool::BackendDefault; break;
    case DEVBRIDGE_CACHING_POOL_ON: options.caching_pool = CachingPool::On; break;
    case DEVBRIDGE_CACHING_POOL_OFF: options.caching_pool = CachingPool::Off; break;
    default:
      invalid_argument("options->caching_pool is " + std::to_string(given.caching_pool) +
                       ", not a DEVBRIDGE_CACHING_POOL_ constant");
  }
  return options;
}

BackendOptions backend_options_from_c(const devbridge_open_options& given) {
  BackendOptions options;
  const auto entries =
      array_argument(given.backend_options, given.backend_option_count, "options->backend_options");
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::string which = "options->backend_options[" + std::to_string(i) + "]";
    auto key = std::string(text(entries[i].key, which + ".key"));
    if (!options.emplace(key, std::string(text(entries[i].value, which + ".value"))).second)
      invalid_argument(which + ": option \"" + key + "\" given twice");
  }
  if (given.device != nullptr && !options.emplace("device", std::string(given.device)).second)
    invalid_argument("options->device and a backend option \"device\" both name the device; give one");
  return options;
}

// Copies text into a fixed C array, cut short and always NUL-terminated.
template <std::size_t N>
void copy_text(char (&destination)[N], std::string_view source) noexcept {
  const auto n = std::min(source.size(), N - 1);
  std::memcpy(destination, source.data(), n);
  destination[n] = '\0';
}

std::uint64_t dtype_mask(const std::vector<DType>& dtypes) noexcept {
  std::uint64_t mask = 0;
  for (const DType dtype : dtypes) mask |= std::uint64_t{1} << static_cast<unsigned>(dtype);
  return mask;
}

devbridge_device_info device_info_to_c(const BackendInfo& info) {
  static_assert(static_cast<int>(DeviceKind::OpenCL) == DEVBRIDGE_DEVICE_OPENCL);
  devbridge_device_info result{};
  copy_text(result.backend, info.name);
  copy_text(result.vendor, info.vendor);
  copy_text(result.device_id, info.device_id);
  copy_text(result.device_name, info.device_name);
  copy_text(result.pci_bus_id, info.pci_bus_id);
  copy_text(result.tinygrad_device, tinygrad_device(info.device_kind, info.device_ordinal));
  result.device_kind = static_cast<devbridge_device_kind>(info.device_kind);
  result.device_ordinal = info.device_ordinal;
  result.dlpack_device_type = static_cast<int32_t>(dlpack_device(info.device_kind));
  result.host_addressable = info.host_addressable ? 1 : 0;
  result.total_memory = info.total_memory;
  result.free_memory = info.free_memory;
  result.held_dtypes = dtype_mask(info.dtypes);
  result.compute_dtypes = dtype_mask(info.computed_dtypes());
  return result;
}

[[noreturn, gnu::cold]] void refuse_copy_mode(devbridge_copy_mode mode) {
  invalid_argument("copy mode is " + std::to_string(mode) + ", not DEVBRIDGE_COPY_SYNC or DEVBRIDGE_COPY_ASYNC");
}

// Inline, the refusal out of line: every copy entry point converts a mode,
// and a call here was a measurable part of a 4 KiB sync copy's C overhead.
inline CopyMode copy_mode_from_c(devbridge_copy_mode mode) {
  if (mode == DEVBRIDGE_COPY_SYNC) [[likely]] return CopyMode::Sync;
  if (mode == DEVBRIDGE_COPY_ASYNC) return CopyMode::Async;
  refuse_copy_mode(mode);
}

HostCopy host_copy_from_c(const devbridge_copy_request& given) {
  require_reserved_zero(given.reserved, "request->reserved");
  HostCopy copy;
  switch (given.direction) {
    case DEVBRIDGE_HOST_TO_DEVICE: copy.direction = CopyDirection::HostToDevice; break;
    case DEVBRIDGE_DEVICE_TO_HOST: copy.direction = CopyDirection::DeviceToHost; break;
    default:
      invalid_argument("request->direction is " + std::to_string(given.direction) +
                       ", not DEVBRIDGE_HOST_TO_DEVICE or DEVBRIDGE_DEVICE_TO_HOST");
  }
  switch (given.host_kind) {
    case DEVBRIDGE_HOST_RING: copy.host = to_cpp(given.ring); break;
    case DEVBRIDGE_HOST_REGION: copy.host = to_cpp(given.region); break;
    default:
      invalid_argument("request->host_kind is " + std::to_string(given.host_kind) +
                       ", not DEVBRIDGE_HOST_RING or DEVBRIDGE_HOST_REGION");
  }
  copy.device = to_cpp(given.device);
  if (given.layout.rows != 0)
    copy.layout = CopyLayout{given.layout.rows, given.layout.row_bytes, given.layout.host_pitch,
                             given.layout.device_pitch};
  copy.mode = copy_mode_from_c(given.mode);
  copy.admission.wait_for_room = timeout(given.wait_for_room_ns, "request->wait_for_room_ns");
  return copy;
}

devbridge_copy_outcome outcome_to_c(const CopyStatus& status) {
  static_assert(static_cast<int>(CopyState::Failed) == DEVBRIDGE_COPY_FAILED);
  devbridge_copy_outcome outcome{};
  outcome.state = static_cast<devbridge_copy_state>(status.state);
  outcome.error = status.error ? status_of(*status.error) : DEVBRIDGE_OK;
  // The copy's own words go where a caller looks for them after a failure.
  if (status.error) fail(*status.error, status.message);
  return outcome;
}

// The three completion queries differ only in which bridge call answers.
template <class Query>
devbridge_status event_query(devbridge_bridge* bridge, devbridge_event event, int32_t* out, const char* what,
                             Query query) {
  return guarded([&] {
    auto& answer = required(out, what);
    answer = query(bridge_of(bridge), to_cpp(event)) ? 1 : 0;
  });
}

}  // namespace

extern "C" {

// ---- lifetime ----

devbridge_status devbridge_open(const devbridge_open_options* options, devbridge_bridge** out_bridge) {
  return guarded([&] {
    const auto& given = sized(options, "options");
    auto& out = required(out_bridge, "out_bridge");
    const std::string_view backend_name = given.backend ? std::string_view(given.backend) : "auto";
    auto bridge_options = bridge_options_from_c(given);
    auto backend = make_backend(backend_name, backend_options_from_c(given));
    auto opened = std::unique_ptr<devbridge_bridge>(new devbridge_bridge{Bridge(std::move(backend), bridge_options)});
    out = opened.release();
  });
}

devbridge_status devbridge_close(devbridge_bridge* bridge) {
  return guarded([&] { bridge_of(bridge).close(); });
}

void devbridge_destroy(devbridge_bridge* bridge) {
  // ~Bridge closes and reports a failed quiesce in the log: a destructor
  // has no one to tell, and the memory stays allocated rather than freed
  // under the device.
  delete bridge;
}

devbridge_status devbridge_restart(devbridge_bridge* bridge, uint64_t generation) {
  return guarded([&] { bridge_of(bridge).restart(generation); });
}

devbridge_status devbridge_generation(devbridge_bridge* bridge, uint64_t* out_generation) {
  return guarded([&] {
    auto& out = required(out_generation, "out_generation");
    out = bridge_of(bridge).generation();
  });
}

devbridge_status devbridge_domain(devbridge_bridge* bridge, uint64_t* out_domain) {
  return guarded([&] {
    auto& out = required(out_domain, "out_domain");
    out = bridge_of(bridge).domain();
  });
}

// ---- devices ----

devbridge_status devbridge_backend_info(devbridge_bridge* bridge, devbridge_device_info* out_info) {
  return guarded([&] {
    auto& out = sized(out_info, "out_info");
    write_result(out, device_info_to_c(bridge_of(bridge).backend_info()));
  });
}

devbridge_status devbridge_device_count(const char* backend, uint64_t* out_count) {
  return guarded([&] {
    const auto name = text(backend, "backend");
    auto& out = required(out_count, "out_count");
    out = list_devices(name).size();
  });
}

devbridge_status devbridge_device_at(const char* backend, uint64_t index, devbridge_device_info* out_info) {
  return guarded([&] {
    const auto name = text(backend, "backend");
    auto& out = sized(out_info, "out_info");
    const auto devices = list_devices(name);
    if (index >= devices.size())
      invalid_argument("device index " + std::to_string(index) + " is past the " + std::to_string(devices.size()) +
                       " devices of backend " + std::string(name));
    write_result(out, device_info_to_c(devices[index]));
  });
}

// ---- allocation ----

devbridge_status devbridge_alloc_device(devbridge_bridge* bridge, const devbridge_object_spec* spec,
                                        uint64_t extent, devbridge_handle* out_handle) {
  return guarded([&] {
    auto& out = required(out_handle, "out_handle");
    out = to_c(bridge_of(bridge).alloc_device(object_spec_from_c(spec), extent));
  });
}

devbridge_status devbridge_free_device(devbridge_bridge* bridge, devbridge_handle handle) {
  return guarded([&] { bridge_of(bridge).free_device(to_cpp(handle)); });
}

devbridge_status devbridge_release_device(devbridge_bridge* bridge, devbridge_handle handle) {
  return guarded([&] { bridge_of(bridge).release(to_cpp(handle)); });
}

devbridge_status devbridge_extent(devbridge_bridge* bridge, devbridge_handle handle, uint64_t* out_extent) {
  return guarded([&] {
    auto& out = required(out_extent, "out_extent");
    out = bridge_of(bridge).extent(to_cpp(handle));
  });
}

// ---- host ring ----

devbridge_status devbridge_reserve_host(devbridge_bridge* bridge, uint64_t bytes, uint64_t alignment,
                                        int64_t timeout_ns, devbridge_host_range* out_range) {
  return guarded([&] {
    auto& out = required(out_range, "out_range");
    const auto wait = timeout(timeout_ns, "timeout_ns");
    out = to_c(bridge_of(bridge).reserve(bytes, or_default(alignment, kRingAlignment), wait));
  });
}

devbridge_status devbridge_release_host(devbridge_bridge* bridge, devbridge_host_range range) {
  return guarded([&] { bridge_of(bridge).release_host(to_cpp(range)); });
}

devbridge_status devbridge_release_host_after(devbridge_bridge* bridge, devbridge_host_range range,
                                              devbridge_event event) {
  return guarded([&] { bridge_of(bridge).release_host_after(to_cpp(range), to_cpp(event)); });
}

devbridge_status devbridge_wait_for_release_after(devbridge_bridge* bridge, int64_t timeout_ns,
                                                  int32_t* out_released) {
  return guarded([&] {
    auto& out = required(out_released, "out_released");
    const auto wait = timeout(timeout_ns, "timeout_ns");
    out = bridge_of(bridge).wait_for_release_after(wait) ? 1 : 0;
  });
}

devbridge_status devbridge_host_bytes(devbridge_bridge* bridge, devbridge_host_range range, uint8_t** out_data) {
  return guarded([&] {
    auto& out = required(out_data, "out_data");
    out = reinterpret_cast<uint8_t*>(bridge_of(bridge).host_bytes(to_cpp(range)).data());
  });
}

// ---- registered host memory ----

devbridge_status devbridge_register_host(devbridge_bridge* bridge, const devbridge_host_registration* registration,
                                         devbridge_region* out_region) {
  return guarded([&] {
    const auto& given = sized(registration, "registration");
    auto& out = required(out_region, "out_region");
    require_reserved_zero(given.reserved, "registration->reserved");
    if (given.len != 0 && given.data == nullptr) invalid_argument("registration->data is NULL");
    Bridge::RegionRelease on_release;
    if (given.on_release != nullptr)
      on_release = [callback = given.on_release, user_data = given.user_data] { callback(user_data); };
    auto* data = static_cast<std::byte*>(given.data);
    auto& target = bridge_of(bridge);
    out = to_c(given.read_only ? target.register_host_read_only({data, given.len}, std::move(on_release))
                               : target.register_host({data, given.len}, std::move(on_release)));
  });
}

devbridge_status devbridge_unregister_host(devbridge_bridge* bridge, devbridge_region region) {
  return guarded([&] { bridge_of(bridge).unregister_host(to_cpp(region)); });
}

devbridge_status devbridge_region_retained(devbridge_bridge* bridge, devbridge_region region, int32_t* out_retained) {
  return guarded([&] { write_flag(out_retained, bridge_of(bridge).region_retained(to_cpp(region)), "out_retained"); });
}

devbridge_status devbridge_adopt_host(devbridge_bridge* bridge, devbridge_region_range range,
                                      const devbridge_object_spec* spec, devbridge_handle* out_handle) {
  return guarded([&] {
    auto& out = required(out_handle, "out_handle");
    out = to_c(bridge_of(bridge).adopt_host(to_cpp(range), object_spec_from_c(spec)));
  });
}

// ---- copies ----

devbridge_status devbridge_copy(devbridge_bridge* bridge, const devbridge_copy_request* request,
                                devbridge_event* out_event) {
  return guarded([&] {
    const auto& given = sized(request, "request");
    auto& out = required(out_event, "out_event");
    out = to_c(bridge_of(bridge).copy(host_copy_from_c(given)));
  });
}

devbridge_status devbridge_host_to_device(devbridge_bridge* bridge, devbridge_host_range host,
                                          devbridge_device_range device, devbridge_copy_mode mode,
                                          devbridge_event* out_event) {
  return guarded([&] {
    auto& out = required(out_event, "out_event");
    out = to_c(bridge_of(bridge).host_to_device(to_cpp(host), to_cpp(device), copy_mode_from_c(mode)));
  });
}

devbridge_status devbridge_device_to_host(devbridge_bridge* bridge, devbridge_device_range device,
                                          devbridge_host_range host, devbridge_copy_mode mode,
                                          devbridge_event* out_event) {
  return guarded([&] {
    auto& out = required(out_event, "out_event");
    out = to_c(bridge_of(bridge).device_to_host(to_cpp(device), to_cpp(host), copy_mode_from_c(mode)));
  });
}

// ---- copy events ----

devbridge_status devbridge_wait(devbridge_bridge* bridge, devbridge_event event, int64_t timeout_ns,
                                devbridge_copy_outcome* out_outcome) {
  return guarded([&] {
    auto& out = sized(out_outcome, "out_outcome");
    const auto wait = timeout(timeout_ns, "timeout_ns");
    write_result(out, outcome_to_c(bridge_of(bridge).wait(to_cpp(event), wait)));
  });
}

devbridge_status devbridge_copy_status(devbridge_bridge* bridge, devbridge_event event,
                                       devbridge_copy_outcome* out_outcome) {
  return guarded([&] {
    auto& out = sized(out_outcome, "out_outcome");
    write_result(out, outcome_to_c(bridge_of(bridge).copy_status(to_cpp(event))));
  });
}

devbridge_status devbridge_poll(devbridge_bridge* bridge, uint64_t* out_applied) {
  return guarded([&] {
    const auto applied = bridge_of(bridge).poll();
    if (out_applied != nullptr) *out_applied = applied;
  });
}

devbridge_status devbridge_safe_to_release_host(devbridge_bridge* bridge, devbridge_event event, int32_t* out_safe) {
  return event_query(bridge, event, out_safe, "out_safe",
                     [](Bridge& b, CopyEvent e) { return b.safe_to_release_host(e); });
}

devbridge_status devbridge_host_bytes_valid(devbridge_bridge* bridge, devbridge_event event, int32_t* out_valid) {
  return event_query(bridge, event, out_valid, "out_valid",
                     [](Bridge& b, CopyEvent e) { return b.host_bytes_valid(e); });
}

devbridge_status devbridge_copy_event_complete(devbridge_bridge* bridge, devbridge_event event,
                                               int32_t* out_complete) {
  // The bridge has one notion of completion for both directions (the two
  // queries above are it); copy_status would also answer, but reading a
  // failure there observes it (copy_records stops counting it), and a query
  // must not change what the statistics say.
  return event_query(bridge, event, out_complete, "out_complete",
                     [](Bridge& b, CopyEvent e) { return b.safe_to_release_host(e); });
}

// ---- compute ----

devbridge_status devbridge_begin_step(devbridge_bridge* bridge, uint64_t step, const devbridge_handle* handles,
                                      uint64_t handle_count) {
  return guarded([&] {
    auto& target = bridge_of(bridge);
    const auto given = array_argument(handles, handle_count, "handles");
    std::vector<DeviceHandle> converted;
    converted.reserve(given.size());
    for (const auto& handle : given) converted.push_back(to_cpp(handle));
    target.begin_step(step, converted);
  });
}

devbridge_status devbridge_end_step(devbridge_bridge* bridge, uint64_t step) {
  return guarded([&] { bridge_of(bridge).end_step(step); });
}

devbridge_status devbridge_end_step_after(devbridge_bridge* bridge, uint64_t step, uintptr_t consumer_queue) {
  return guarded([&] { bridge_of(bridge).end_step(step, ConsumerQueue{consumer_queue}); });
}

devbridge_status devbridge_launch_axpy(devbridge_bridge* bridge, devbridge_device_range x, devbridge_device_range y,
                                       float a, float b) {
  return guarded([&] { bridge_of(bridge).launch_axpy(to_cpp(x), to_cpp(y), a, b); });
}

// ---- statistics ----

devbridge_status devbridge_get_stats(devbridge_bridge* bridge, devbridge_stats* out_stats) {
  return guarded([&] {
    auto& out = sized(out_stats, "out_stats");
    const BridgeStats s = bridge_of(bridge).stats();
    write_result(out, devbridge_stats{
                          0,
                          s.generation,
                          s.domain,
                          s.broken,
                          s.closed,
                          s.live_allocations,
                          s.allocated_bytes,
                          s.copies_submitted,
                          s.copies_completed,
                          s.copies_failed,
                          s.copies_in_flight,
                          s.inflight_bytes,
                          s.inflight_budget_bytes,
                          s.copy_records,
                          s.failed_records,
                          s.failed_records_evicted,
                          s.stale_completions,
                          s.live_views,
                          s.orphaned_allocations,
                          s.pending_fences,
                          s.abandoned_fences,
                          s.active_steps,
                          s.restarts,
                          s.host_regions,
                          s.host_region_bytes,
                          s.adopted_allocations,
                          s.adopted_bytes,
                          s.ring_capacity,
                          s.ring_used,
                          s.ring_reservations,
                          s.ring_releases_pending,
                          s.ring_wraps,
                      });
  });
}

// devbridge_memory_stats is `size` and then one uint64_t per MemoryStats
// field (bridge.hpp's for_each_field lists them): a field added there fails
// this until the C struct has it too (appended: the struct is size-first),
// and an initializer left out below fails the build
// (-Wmissing-field-initializers, an error here).
static_assert(sizeof(devbridge_memory_stats) == sizeof(std::uint64_t) * (1 + kMemoryStatsFields),
              "devbridge_memory_stats needs one uint64_t per MemoryStats field");
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wmissing-field-initializers"
devbridge_status devbridge_get_memory_stats(devbridge_bridge* bridge, devbridge_memory_stats* out_stats) {
  return guarded([&] {
    auto& out = sized(out_stats, "out_stats");
    const MemoryStats m = bridge_of(bridge).memory_stats();
    write_result(out, devbridge_memory_stats{
                          0,
                          m.pool_enabled,
                          m.pool_cap_bytes,
                          m.allocated_bytes,
                          m.peak_allocated_bytes,
                          m.total_allocated_bytes,
                          m.reserved_bytes,
                          m.peak_reserved_bytes,
                          m.total_reserved_bytes,
                          m.allocations,
                          m.total_allocations,
                          m.backend_allocations,
                          m.backend_frees,
                          m.segments,
                          m.free_segments,
                          m.pool_splits,
                          m.cached_bytes,
                          m.cached_blocks,
                          m.free_segment_bytes,
                          m.cache_hits,
                          m.cache_misses,
                          m.oom_retries,
                          m.oom_failures,
                          m.largest_request_bytes,
                          m.fragmentation_bytes,
                      });
  });
}
#pragma GCC diagnostic pop

devbridge_status devbridge_reset_peak_memory(devbridge_bridge* bridge) {
  return guarded([&] { bridge_of(bridge).reset_peak_memory(); });
}

devbridge_status devbridge_empty_cache(devbridge_bridge* bridge) {
  return guarded([&] { bridge_of(bridge).empty_cache(); });
}

}  // extern "C"
