/* Hostile input at every entry point of the C ABI, one row each: NULL
 * pointers, sizes and offsets near 2^64, handles of another bridge or of an
 * old generation, structs whose `size` is too small, reserved fields and
 * enumerations out of range. Every row names the exact kind it must get,
 * and every failure must leave a message. */
#define _POSIX_C_SOURCE 200809L /* getpid */
#include <string.h>
#include <unistd.h>

#include "check.h"

/* ---- fixture: built once, never changed by a row (every row fails) ---- */

static devbridge_bridge* A;      /* fake, at generation 2 */
static devbridge_bridge* B;      /* another fake */
static devbridge_bridge* H;      /* host: no fake controls */
static devbridge_bridge* closed; /* closed, not destroyed */
static devbridge_handle live, old_handle, foreign, unknown;
static devbridge_event live_event, old_event, foreign_event, unknown_event;
static devbridge_host_range ring;
static devbridge_region region, old_region, foreign_region;
static uint8_t region_bytes[256], old_region_bytes[256], foreign_region_bytes[256];
static devbridge_open_options options;
static devbridge_backend_option an_option = {"dtypes", "float32"};
static devbridge_object_spec spec;
static devbridge_view_spec view_spec;
static devbridge_copy_request copy_request;
static devbridge_host_registration registration;
static const int64_t view_shape[1] = {64};
static const int64_t huge_shape[2] = {INT64_MAX, INT64_MAX};

/* Scratch the rows edit (a copy of a fixture struct) and write to. */
static devbridge_open_options o;
static devbridge_object_spec s;
static devbridge_view_spec vs;
static devbridge_copy_request c;
static devbridge_host_registration r;
static devbridge_view view_out;
static devbridge_copy_outcome outcome;
static devbridge_stats stats;
static devbridge_memory_stats memory;
static devbridge_device_info info;
static devbridge_bridge* out_bridge;
static devbridge_handle out_handle;
static devbridge_event out_event;
static devbridge_host_range out_range;
static devbridge_region out_region;
static devbridge_dlpack_tensor* out_tensor;
static uint8_t* out_bytes;
static devbridge_portable* out_portable;
static devbridge_portable_view pv;
static devbridge_portable_view portable;
static const int64_t portable_dims[1] = {16};
static const int64_t negative_dims[1] = {-1};
static const int64_t nine_dims[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
static const int64_t zero_dims[1] = {0};
static float portable_bytes[16];
static const devbridge_portable* no_portable;
static devbridge_checkpoint_entry entry;
static devbridge_checkpoint_entry e;
static devbridge_checkpoint_entry two_entries[2];
static devbridge_restored* out_restored;
static devbridge_restore_options restore_options;
static devbridge_restore_options ro;
static const char* const no_such_names[1] = {"no-such-tensor"};
static const char* const null_names[1] = {NULL};
static char fixture_file[64]; /* a checkpoint of `entry` (one tensor, "x"), written by build_fixture */
static uint64_t out_u64;
static int32_t out_i32;

#define SHORT(object) (object.size = sizeof(object) - 8, &object)
#define NEAR_2_64 (UINT64_MAX - 8)

static devbridge_device_range range_of(devbridge_handle handle, uint64_t offset, uint64_t len) {
  devbridge_device_range range = {handle, offset, len};
  return range;
}
static devbridge_host_range host(uint64_t offset, uint64_t len) {
  devbridge_host_range range = {offset, len};
  return range;
}
static devbridge_region_range region_range(devbridge_region which, uint64_t offset, uint64_t len) {
  devbridge_region_range range = {which, offset, len};
  return range;
}

/* X(row name, expected kind without the DEVBRIDGE_ERROR_ prefix, call) */
#define BOUNDARY_ROWS(X) \
  /* open */ \
  X(open_null_options, INVALID_RANGE, devbridge_open(NULL, &out_bridge)) \
  X(open_null_out, INVALID_RANGE, devbridge_open(&options, NULL)) \
  X(open_short_options, INVALID_RANGE, (o = options, devbridge_open(SHORT(o), &out_bridge))) \
  X(open_zero_size, INVALID_RANGE, (o = options, o.size = 0, devbridge_open(&o, &out_bridge))) \
  X(open_null_option_array, INVALID_RANGE, (o = options, o.backend_option_count = 1, devbridge_open(&o, &out_bridge))) \
  X(open_option_count_near_2_64, INVALID_RANGE, \
    (o = options, o.backend_options = &an_option, o.backend_option_count = UINT64_MAX, devbridge_open(&o, &out_bridge))) \
  X(open_negative_timeout, INVALID_RANGE, (o = options, o.close_fence_timeout_ns = -1, devbridge_open(&o, &out_bridge))) \
  X(open_bad_writes_under_view, INVALID_RANGE, (o = options, o.writes_under_view = 9, devbridge_open(&o, &out_bridge))) \
  X(open_bad_caching_pool, INVALID_RANGE, (o = options, o.caching_pool = -1, devbridge_open(&o, &out_bridge))) \
  X(open_failed_record_limit_near_2_64, INVALID_RANGE, \
    (o = options, o.failed_record_limit = UINT64_MAX, devbridge_open(&o, &out_bridge))) \
  X(open_ring_near_2_64, ALLOCATION_FAILED, (o = options, o.ring_bytes = UINT64_MAX, devbridge_open(&o, &out_bridge))) \
  X(open_unknown_backend, UNAVAILABLE, (o = options, o.backend = "nonesuch", devbridge_open(&o, &out_bridge))) \
  /* devices */ \
  X(device_count_null_backend, INVALID_RANGE, devbridge_device_count(NULL, &out_u64)) \
  X(device_count_null_out, INVALID_RANGE, devbridge_device_count("fake", NULL)) \
  X(device_count_unknown_backend, UNAVAILABLE, devbridge_device_count("nonesuch", &out_u64)) \
  X(device_at_null_out, INVALID_RANGE, devbridge_device_at("fake", 0, NULL)) \
  X(device_at_short_out, INVALID_RANGE, devbridge_device_at("fake", 0, SHORT(info))) \
  X(device_at_near_2_64, INVALID_RANGE, (info.size = sizeof info, devbridge_device_at("fake", UINT64_MAX, &info))) \
  X(backend_info_null_bridge, INVALID_RANGE, (info.size = sizeof info, devbridge_backend_info(NULL, &info))) \
  X(backend_info_short_out, INVALID_RANGE, devbridge_backend_info(A, SHORT(info))) \
  /* lifetime */ \
  X(close_null_bridge, INVALID_RANGE, devbridge_close(NULL)) \
  X(restart_null_bridge, INVALID_RANGE, devbridge_restart(NULL, 9)) \
  X(restart_to_current_generation, OLD_GENERATION_HANDLE, devbridge_restart(A, 2)) \
  X(restart_to_older_generation, OLD_GENERATION_HANDLE, devbridge_restart(A, 1)) \
  X(generation_null_bridge, INVALID_RANGE, devbridge_generation(NULL, &out_u64)) \
  X(generation_null_out, INVALID_RANGE, devbridge_generation(A, NULL)) \
  X(domain_null_bridge, INVALID_RANGE, devbridge_domain(NULL, &out_u64)) \
  X(domain_null_out, INVALID_RANGE, devbridge_domain(A, NULL)) \
  X(closed_alloc, CLOSED, devbridge_alloc_device(closed, &spec, 256, &out_handle)) \
  X(closed_reserve, CLOSED, devbridge_reserve_host(closed, 64, 0, 0, &out_range)) \
  X(closed_restart, CLOSED, devbridge_restart(closed, 9)) \
  /* allocation */ \
  X(alloc_null_bridge, INVALID_RANGE, devbridge_alloc_device(NULL, &spec, 256, &out_handle)) \
  X(alloc_null_spec, INVALID_RANGE, devbridge_alloc_device(A, NULL, 256, &out_handle)) \
  X(alloc_short_spec, INVALID_RANGE, (s = spec, devbridge_alloc_device(A, SHORT(s), 256, &out_handle))) \
  X(alloc_null_out, INVALID_RANGE, devbridge_alloc_device(A, &spec, 256, NULL)) \
  X(alloc_bad_dtype, UNSUPPORTED_DTYPE, (s = spec, s.dtype = 99, devbridge_alloc_device(A, &s, 256, &out_handle))) \
  X(alloc_bad_shape, INVALID_RANGE, (s = spec, s.shape = 4, devbridge_alloc_device(A, &s, 256, &out_handle))) \
  X(alloc_extent_past_max, INVALID_EXTENT, devbridge_alloc_device(A, &spec, 8192, &out_handle)) \
  X(alloc_extent_near_2_64, INVALID_EXTENT, \
    (s = spec, s.max_extent = UINT64_MAX, devbridge_alloc_device(A, &s, UINT64_MAX - 3, &out_handle))) \
  X(alloc_alignment_not_power_of_two, INVALID_ALIGNMENT, \
    (s = spec, s.alignment = 3, devbridge_alloc_device(A, &s, 256, &out_handle))) \
  X(free_null_bridge, INVALID_RANGE, devbridge_free_device(NULL, live)) \
  X(free_old_generation, OLD_GENERATION_HANDLE, devbridge_free_device(A, old_handle)) \
  X(free_foreign, FOREIGN_DOMAIN, devbridge_free_device(A, foreign)) \
  X(free_unknown, UNKNOWN_DEVICE_HANDLE, devbridge_free_device(A, unknown)) \
  X(release_null_bridge, INVALID_RANGE, devbridge_release_device(NULL, live)) \
  X(release_old_generation, OLD_GENERATION_HANDLE, devbridge_release_device(A, old_handle)) \
  X(release_foreign, FOREIGN_DOMAIN, devbridge_release_device(A, foreign)) \
  X(release_unknown, UNKNOWN_DEVICE_HANDLE, devbridge_release_device(A, unknown)) \
  X(extent_null_bridge, INVALID_RANGE, devbridge_extent(NULL, live, &out_u64)) \
  X(extent_null_out, INVALID_RANGE, devbridge_extent(A, live, NULL)) \
  X(extent_foreign, FOREIGN_DOMAIN, devbridge_extent(A, foreign, &out_u64)) \
  /* host ring */ \
  X(reserve_null_bridge, INVALID_RANGE, devbridge_reserve_host(NULL, 64, 0, 0, &out_range)) \
  X(reserve_null_out, INVALID_RANGE, devbridge_reserve_host(A, 64, 0, 0, NULL)) \
  X(reserve_near_2_64, INVALID_RANGE, devbridge_reserve_host(A, UINT64_MAX, 0, 0, &out_range)) \
  X(reserve_alignment_near_2_64, INVALID_ALIGNMENT, devbridge_reserve_host(A, 64, UINT64_C(1) << 63, 0, &out_range)) \
  X(reserve_alignment_not_power_of_two, INVALID_ALIGNMENT, devbridge_reserve_host(A, 64, 48, 0, &out_range)) \
  X(reserve_negative_timeout, INVALID_RANGE, devbridge_reserve_host(A, 64, 0, -5, &out_range)) \
  X(release_host_null_bridge, INVALID_RANGE, devbridge_release_host(NULL, ring)) \
  X(release_host_near_2_64, INVALID_RANGE, devbridge_release_host(A, host(NEAR_2_64, 16))) \
  X(release_host_not_reserved, INVALID_RANGE, devbridge_release_host(A, host(ring.offset + 64, 64))) \
  X(release_host_after_null_bridge, INVALID_RANGE, devbridge_release_host_after(NULL, ring, live_event)) \
  X(release_host_after_foreign_event, FOREIGN_DOMAIN, devbridge_release_host_after(A, ring, foreign_event)) \
  X(release_host_after_old_event, OLD_GENERATION_HANDLE, devbridge_release_host_after(A, ring, old_event)) \
  X(release_host_after_near_2_64, INVALID_RANGE, devbridge_release_host_after(A, host(NEAR_2_64, 16), live_event)) \
  X(wait_for_release_null_bridge, INVALID_RANGE, devbridge_wait_for_release_after(NULL, 0, &out_i32)) \
  X(wait_for_release_null_out, INVALID_RANGE, devbridge_wait_for_release_after(A, 0, NULL)) \
  X(wait_for_release_negative, INVALID_RANGE, devbridge_wait_for_release_after(A, -1, &out_i32)) \
  X(host_bytes_null_bridge, INVALID_RANGE, devbridge_host_bytes(NULL, ring, &out_bytes)) \
  X(host_bytes_null_out, INVALID_RANGE, devbridge_host_bytes(A, ring, NULL)) \
  X(host_bytes_near_2_64, INVALID_RANGE, devbridge_host_bytes(A, host(NEAR_2_64, 16), &out_bytes)) \
  /* registered host memory */ \
  X(register_null_bridge, INVALID_RANGE, devbridge_register_host(NULL, &registration, &out_region)) \
  X(register_null_registration, INVALID_RANGE, devbridge_register_host(A, NULL, &out_region)) \
  X(register_short_registration, INVALID_RANGE, (r = registration, devbridge_register_host(A, SHORT(r), &out_region))) \
  X(register_null_out, INVALID_RANGE, devbridge_register_host(A, &registration, NULL)) \
  X(register_null_data, INVALID_RANGE, (r = registration, r.data = NULL, devbridge_register_host(A, &r, &out_region))) \
  X(register_reserved, INVALID_RANGE, (r = registration, r.reserved = 1, devbridge_register_host(A, &r, &out_region))) \
  X(register_empty, INVALID_EXTENT, (r = registration, r.len = 0, devbridge_register_host(A, &r, &out_region))) \
  X(register_overlapping, INVALID_RANGE, devbridge_register_host(A, &registration, &out_region)) \
  X(unregister_null_bridge, INVALID_RANGE, devbridge_unregister_host(NULL, region)) \
  X(unregister_foreign, FOREIGN_DOMAIN, devbridge_unregister_host(A, foreign_region)) \
  X(unregister_old_generation, OLD_GENERATION_HANDLE, devbridge_unregister_host(A, old_region)) \
  X(region_retained_null_bridge, INVALID_RANGE, devbridge_region_retained(NULL, region, &out_i32)) \
  X(region_retained_null_out, INVALID_RANGE, devbridge_region_retained(A, region, NULL)) \
  X(adopt_null_bridge, INVALID_RANGE, devbridge_adopt_host(NULL, region_range(region, 0, 256), &spec, &out_handle)) \
  X(adopt_null_spec, INVALID_RANGE, devbridge_adopt_host(A, region_range(region, 0, 256), NULL, &out_handle)) \
  X(adopt_null_out, INVALID_RANGE, devbridge_adopt_host(A, region_range(region, 0, 256), &spec, NULL)) \
  X(adopt_foreign, FOREIGN_DOMAIN, devbridge_adopt_host(A, region_range(foreign_region, 0, 256), &spec, &out_handle)) \
  X(adopt_near_2_64, INVALID_RANGE, devbridge_adopt_host(A, region_range(region, NEAR_2_64, 256), &spec, &out_handle)) \
  /* copies */ \
  X(copy_null_bridge, INVALID_RANGE, devbridge_copy(NULL, &copy_request, &out_event)) \
  X(copy_null_request, INVALID_RANGE, devbridge_copy(A, NULL, &out_event)) \
  X(copy_short_request, INVALID_RANGE, (c = copy_request, devbridge_copy(A, SHORT(c), &out_event))) \
  X(copy_null_out, INVALID_RANGE, devbridge_copy(A, &copy_request, NULL)) \
  X(copy_reserved, INVALID_RANGE, (c = copy_request, c.reserved = 2, devbridge_copy(A, &c, &out_event))) \
  X(copy_bad_direction, INVALID_RANGE, (c = copy_request, c.direction = 2, devbridge_copy(A, &c, &out_event))) \
  X(copy_bad_mode, INVALID_RANGE, (c = copy_request, c.mode = -1, devbridge_copy(A, &c, &out_event))) \
  X(copy_bad_host_kind, INVALID_RANGE, (c = copy_request, c.host_kind = 5, devbridge_copy(A, &c, &out_event))) \
  X(copy_negative_wait, INVALID_RANGE, (c = copy_request, c.wait_for_room_ns = -1, devbridge_copy(A, &c, &out_event))) \
  X(copy_ring_near_2_64, INVALID_RANGE, (c = copy_request, c.ring.offset = NEAR_2_64, devbridge_copy(A, &c, &out_event))) \
  X(copy_device_near_2_64, INVALID_RANGE, \
    (c = copy_request, c.device.offset = NEAR_2_64, devbridge_copy(A, &c, &out_event))) \
  X(copy_lengths_differ, INVALID_RANGE, (c = copy_request, c.device.len = 128, devbridge_copy(A, &c, &out_event))) \
  X(copy_layout_rows_near_2_64, INVALID_RANGE, \
    (c = copy_request, c.layout.rows = UINT64_MAX, c.layout.row_bytes = 16, c.layout.host_pitch = 16, \
     c.layout.device_pitch = 16, devbridge_copy(A, &c, &out_event))) \
  X(copy_layout_pitch_near_2_64, INVALID_RANGE, \
    (c = copy_request, c.layout.rows = 2, c.layout.row_bytes = 16, c.layout.host_pitch = NEAR_2_64, \
     c.layout.device_pitch = 16, devbridge_copy(A, &c, &out_event))) \
  X(copy_old_handle, OLD_GENERATION_HANDLE, \
    (c = copy_request, c.device.handle = old_handle, devbridge_copy(A, &c, &out_event))) \
  X(copy_foreign_handle, FOREIGN_DOMAIN, (c = copy_request, c.device.handle = foreign, devbridge_copy(A, &c, &out_event))) \
  X(copy_foreign_region, FOREIGN_DOMAIN, \
    (c = copy_request, c.host_kind = DEVBRIDGE_HOST_REGION, c.region = region_range(foreign_region, 0, 256), \
     devbridge_copy(A, &c, &out_event))) \
  X(copy_region_near_2_64, INVALID_RANGE, \
    (c = copy_request, c.host_kind = DEVBRIDGE_HOST_REGION, c.region = region_range(region, NEAR_2_64, 256), \
     devbridge_copy(A, &c, &out_event))) \
  X(h2d_null_bridge, INVALID_RANGE, devbridge_host_to_device(NULL, ring, range_of(live, 0, 256), 0, &out_event)) \
  X(h2d_null_out, INVALID_RANGE, devbridge_host_to_device(A, ring, range_of(live, 0, 256), 0, NULL)) \
  X(h2d_bad_mode, INVALID_RANGE, devbridge_host_to_device(A, ring, range_of(live, 0, 256), 2, &out_event)) \
  X(h2d_host_near_2_64, INVALID_RANGE, \
    devbridge_host_to_device(A, host(NEAR_2_64, 256), range_of(live, 0, 256), 0, &out_event)) \
  X(h2d_device_len_near_2_64, INVALID_RANGE, \
    devbridge_host_to_device(A, host(ring.offset, NEAR_2_64), range_of(live, 0, NEAR_2_64), 0, &out_event)) \
  X(h2d_old_handle, OLD_GENERATION_HANDLE, devbridge_host_to_device(A, ring, range_of(old_handle, 0, 256), 0, &out_event)) \
  X(h2d_foreign_handle, FOREIGN_DOMAIN, devbridge_host_to_device(A, ring, range_of(foreign, 0, 256), 0, &out_event)) \
  X(d2h_null_bridge, INVALID_RANGE, devbridge_device_to_host(NULL, range_of(live, 0, 256), ring, 0, &out_event)) \
  X(d2h_null_out, INVALID_RANGE, devbridge_device_to_host(A, range_of(live, 0, 256), ring, 0, NULL)) \
  X(d2h_unknown_handle, UNKNOWN_DEVICE_HANDLE, devbridge_device_to_host(A, range_of(unknown, 0, 256), ring, 0, &out_event)) \
  X(d2h_device_near_2_64, INVALID_RANGE, \
    devbridge_device_to_host(A, range_of(live, NEAR_2_64, 256), ring, 0, &out_event)) \
  /* copy events */ \
  X(wait_null_bridge, INVALID_RANGE, (outcome.size = sizeof outcome, devbridge_wait(NULL, live_event, 0, &outcome))) \
  X(wait_null_out, INVALID_RANGE, devbridge_wait(A, live_event, 0, NULL)) \
  X(wait_short_out, INVALID_RANGE, devbridge_wait(A, live_event, 0, SHORT(outcome))) \
  X(wait_negative_timeout, INVALID_RANGE, (outcome.size = sizeof outcome, devbridge_wait(A, live_event, -1, &outcome))) \
  X(wait_foreign_event, FOREIGN_DOMAIN, (outcome.size = sizeof outcome, devbridge_wait(A, foreign_event, 0, &outcome))) \
  X(wait_old_event, OLD_GENERATION_HANDLE, (outcome.size = sizeof outcome, devbridge_wait(A, old_event, 0, &outcome))) \
  X(copy_status_null_bridge, INVALID_RANGE, (outcome.size = sizeof outcome, devbridge_copy_status(NULL, live_event, &outcome))) \
  X(copy_status_null_out, INVALID_RANGE, devbridge_copy_status(A, live_event, NULL)) \
  X(copy_status_short_out, INVALID_RANGE, devbridge_copy_status(A, live_event, SHORT(outcome))) \
  X(copy_status_foreign, FOREIGN_DOMAIN, (outcome.size = sizeof outcome, devbridge_copy_status(A, foreign_event, &outcome))) \
  X(poll_null_bridge, INVALID_RANGE, devbridge_poll(NULL, &out_u64)) \
  X(safe_null_bridge, INVALID_RANGE, devbridge_safe_to_release_host(NULL, live_event, &out_i32)) \
  X(safe_null_out, INVALID_RANGE, devbridge_safe_to_release_host(A, live_event, NULL)) \
  X(safe_foreign, FOREIGN_DOMAIN, devbridge_safe_to_release_host(A, foreign_event, &out_i32)) \
  X(safe_old, OLD_GENERATION_HANDLE, devbridge_safe_to_release_host(A, old_event, &out_i32)) \
  X(valid_null_bridge, INVALID_RANGE, devbridge_host_bytes_valid(NULL, live_event, &out_i32)) \
  X(valid_null_out, INVALID_RANGE, devbridge_host_bytes_valid(A, live_event, NULL)) \
  X(valid_foreign, FOREIGN_DOMAIN, devbridge_host_bytes_valid(A, foreign_event, &out_i32)) \
  X(valid_old, OLD_GENERATION_HANDLE, devbridge_host_bytes_valid(A, old_event, &out_i32)) \
  X(complete_null_bridge, INVALID_RANGE, devbridge_copy_event_complete(NULL, live_event, &out_i32)) \
  X(complete_null_out, INVALID_RANGE, devbridge_copy_event_complete(A, live_event, NULL)) \
  X(complete_foreign, FOREIGN_DOMAIN, devbridge_copy_event_complete(A, foreign_event, &out_i32)) \
  X(complete_old, OLD_GENERATION_HANDLE, devbridge_copy_event_complete(A, old_event, &out_i32)) \
  /* compute */ \
  X(begin_step_null_bridge, INVALID_RANGE, devbridge_begin_step(NULL, 1, &live, 1)) \
  X(begin_step_null_handles, INVALID_RANGE, devbridge_begin_step(A, 1, NULL, 1)) \
  X(begin_step_count_near_2_64, INVALID_RANGE, devbridge_begin_step(A, 1, &live, UINT64_MAX)) \
  X(begin_step_old_handle, OLD_GENERATION_HANDLE, devbridge_begin_step(A, 1, &old_handle, 1)) \
  X(begin_step_foreign_handle, FOREIGN_DOMAIN, devbridge_begin_step(A, 1, &foreign, 1)) \
  X(end_step_null_bridge, INVALID_RANGE, devbridge_end_step(NULL, 1)) \
  X(end_step_after_null_bridge, INVALID_RANGE, devbridge_end_step_after(NULL, 1, 1)) \
  X(axpy_null_bridge, INVALID_RANGE, devbridge_launch_axpy(NULL, range_of(live, 0, 256), range_of(live, 0, 256), 1, 0)) \
  X(axpy_foreign, FOREIGN_DOMAIN, devbridge_launch_axpy(A, range_of(foreign, 0, 256), range_of(live, 0, 256), 1, 0)) \
  X(axpy_near_2_64, INVALID_RANGE, \
    devbridge_launch_axpy(A, range_of(live, NEAR_2_64, 256), range_of(live, 0, 256), 1, 0)) \
  /* views */ \
  X(view_null_bridge, INVALID_RANGE, (view_out.size = sizeof view_out, devbridge_view_open(NULL, live, &view_spec, &view_out))) \
  X(view_null_spec, INVALID_RANGE, (view_out.size = sizeof view_out, devbridge_view_open(A, live, NULL, &view_out))) \
  X(view_short_spec, INVALID_RANGE, \
    (vs = view_spec, view_out.size = sizeof view_out, devbridge_view_open(A, live, SHORT(vs), &view_out))) \
  X(view_null_out, INVALID_RANGE, devbridge_view_open(A, live, &view_spec, NULL)) \
  X(view_short_out, INVALID_RANGE, devbridge_view_open(A, live, &view_spec, SHORT(view_out))) \
  X(view_rank_9, INVALID_TENSOR_VIEW, \
    (vs = view_spec, vs.ndim = 9, view_out.size = sizeof view_out, devbridge_view_open(A, live, &vs, &view_out))) \
  X(view_negative_rank, INVALID_TENSOR_VIEW, \
    (vs = view_spec, vs.ndim = -1, view_out.size = sizeof view_out, devbridge_view_open(A, live, &vs, &view_out))) \
  X(view_null_shape, INVALID_RANGE, \
    (vs = view_spec, vs.shape = NULL, view_out.size = sizeof view_out, devbridge_view_open(A, live, &vs, &view_out))) \
  X(view_bad_dtype, UNSUPPORTED_DTYPE, \
    (vs = view_spec, vs.dtype = -2, view_out.size = sizeof view_out, devbridge_view_open(A, live, &vs, &view_out))) \
  X(view_wrong_dtype, INVALID_VIEW_DTYPE, \
    (vs = view_spec, vs.dtype = DEVBRIDGE_DTYPE_INT32, view_out.size = sizeof view_out, \
     devbridge_view_open(A, live, &vs, &view_out))) \
  X(view_shape_near_2_63, INVALID_TENSOR_VIEW, \
    (vs = view_spec, vs.ndim = 2, vs.shape = huge_shape, view_out.size = sizeof view_out, \
     devbridge_view_open(A, live, &vs, &view_out))) \
  X(view_offset_near_2_64, INVALID_TENSOR_VIEW, \
    (vs = view_spec, vs.byte_offset = NEAR_2_64 - 3, view_out.size = sizeof view_out, \
     devbridge_view_open(A, live, &vs, &view_out))) \
  X(view_reserved, INVALID_RANGE, \
    (vs = view_spec, vs.reserved = 1, view_out.size = sizeof view_out, devbridge_view_open(A, live, &vs, &view_out))) \
  X(view_bad_wait, INVALID_RANGE, \
    (vs = view_spec, vs.wait = 3, view_out.size = sizeof view_out, devbridge_view_open(A, live, &vs, &view_out))) \
  X(view_old_handle, OLD_GENERATION_HANDLE, \
    (view_out.size = sizeof view_out, devbridge_view_open(A, old_handle, &view_spec, &view_out))) \
  X(view_foreign_handle, FOREIGN_DOMAIN, \
    (view_out.size = sizeof view_out, devbridge_view_open(A, foreign, &view_spec, &view_out))) \
  X(view_end_null, INVALID_RANGE, devbridge_view_end(NULL)) \
  X(view_end_short, INVALID_RANGE, devbridge_view_end(SHORT(view_out))) \
  X(view_end_after_null, INVALID_RANGE, devbridge_view_end_after(NULL, 1)) \
  X(view_end_after_short, INVALID_RANGE, devbridge_view_end_after(SHORT(view_out), 1)) \
  X(export_null_bridge, INVALID_RANGE, devbridge_export_dlpack(NULL, live, &view_spec, &out_tensor)) \
  X(export_null_spec, INVALID_RANGE, devbridge_export_dlpack(A, live, NULL, &out_tensor)) \
  X(export_null_out, INVALID_RANGE, devbridge_export_dlpack(A, live, &view_spec, NULL)) \
  X(export_old_handle, OLD_GENERATION_HANDLE, devbridge_export_dlpack(A, old_handle, &view_spec, &out_tensor)) \
  X(export_foreign_handle, FOREIGN_DOMAIN, devbridge_export_dlpack(A, foreign, &view_spec, &out_tensor)) \
  /* statistics */ \
  X(stats_null_bridge, INVALID_RANGE, (stats.size = sizeof stats, devbridge_get_stats(NULL, &stats))) \
  X(stats_null_out, INVALID_RANGE, devbridge_get_stats(A, NULL)) \
  X(stats_short_out, INVALID_RANGE, devbridge_get_stats(A, SHORT(stats))) \
  X(memory_stats_null_bridge, INVALID_RANGE, (memory.size = sizeof memory, devbridge_get_memory_stats(NULL, &memory))) \
  X(memory_stats_null_out, INVALID_RANGE, devbridge_get_memory_stats(A, NULL)) \
  X(memory_stats_short_out, INVALID_RANGE, devbridge_get_memory_stats(A, SHORT(memory))) \
  X(reset_peak_null_bridge, INVALID_RANGE, devbridge_reset_peak_memory(NULL)) \
  X(empty_cache_null_bridge, INVALID_RANGE, devbridge_empty_cache(NULL)) \
  /* portable tensors */ \
  X(export_tensor_null_bridge, INVALID_RANGE, devbridge_export_tensor(NULL, live, DEVBRIDGE_DTYPE_FLOAT32, portable_dims, 1, 0, &out_portable)) \
  X(export_tensor_null_out, INVALID_RANGE, devbridge_export_tensor(A, live, DEVBRIDGE_DTYPE_FLOAT32, portable_dims, 1, 0, NULL)) \
  X(export_tensor_bad_dtype, UNSUPPORTED_DTYPE, devbridge_export_tensor(A, live, 99, portable_dims, 1, 0, &out_portable)) \
  X(export_tensor_bytes_dtype, UNSUPPORTED_DTYPE, devbridge_export_tensor(A, live, DEVBRIDGE_DTYPE_BYTES, portable_dims, 1, 0, &out_portable)) \
  X(export_tensor_null_dims, INVALID_RANGE, devbridge_export_tensor(A, live, DEVBRIDGE_DTYPE_FLOAT32, NULL, 1, 0, &out_portable)) \
  X(export_tensor_rank_9, INVALID_RANGE, devbridge_export_tensor(A, live, DEVBRIDGE_DTYPE_FLOAT32, nine_dims, 9, 0, &out_portable)) \
  X(export_tensor_negative_dim, INVALID_RANGE, devbridge_export_tensor(A, live, DEVBRIDGE_DTYPE_FLOAT32, negative_dims, 1, 0, &out_portable)) \
  X(export_tensor_dims_overflow, INVALID_RANGE, devbridge_export_tensor(A, live, DEVBRIDGE_DTYPE_FLOAT32, huge_shape, 2, 0, &out_portable)) \
  X(export_tensor_offset_near_2_64, INVALID_RANGE, devbridge_export_tensor(A, live, DEVBRIDGE_DTYPE_FLOAT32, portable_dims, 1, NEAR_2_64, &out_portable)) \
  X(export_tensor_past_extent, INVALID_RANGE, devbridge_export_tensor(A, live, DEVBRIDGE_DTYPE_FLOAT32, portable_dims, 1, 200, &out_portable)) \
  X(export_tensor_unknown_handle, UNKNOWN_DEVICE_HANDLE, devbridge_export_tensor(A, unknown, DEVBRIDGE_DTYPE_FLOAT32, portable_dims, 1, 0, &out_portable)) \
  X(export_tensor_old_handle, OLD_GENERATION_HANDLE, devbridge_export_tensor(A, old_handle, DEVBRIDGE_DTYPE_FLOAT32, portable_dims, 1, 0, &out_portable)) \
  X(export_tensor_foreign_handle, FOREIGN_DOMAIN, devbridge_export_tensor(A, foreign, DEVBRIDGE_DTYPE_FLOAT32, portable_dims, 1, 0, &out_portable)) \
  X(export_tensor_closed, CLOSED, devbridge_export_tensor(closed, live, DEVBRIDGE_DTYPE_FLOAT32, portable_dims, 1, 0, &out_portable)) \
  X(describe_null_tensor, INVALID_RANGE, (pv.size = sizeof pv, devbridge_portable_describe(no_portable, &pv))) \
  X(import_tensor_null_bridge, INVALID_RANGE, devbridge_import_tensor(NULL, &portable, NULL, &out_handle)) \
  X(import_tensor_null_tensor, INVALID_RANGE, devbridge_import_tensor(A, NULL, NULL, &out_handle)) \
  X(import_tensor_null_out, INVALID_RANGE, devbridge_import_tensor(A, &portable, NULL, NULL)) \
  X(import_tensor_short_tensor, INVALID_RANGE, (pv = portable, devbridge_import_tensor(A, SHORT(pv), NULL, &out_handle))) \
  X(import_tensor_bad_dtype, UNSUPPORTED_DTYPE, (pv = portable, pv.dtype = 99, devbridge_import_tensor(A, &pv, NULL, &out_handle))) \
  X(import_tensor_bytes_dtype, UNSUPPORTED_DTYPE, (pv = portable, pv.dtype = DEVBRIDGE_DTYPE_BYTES, devbridge_import_tensor(A, &pv, NULL, &out_handle))) \
  X(import_tensor_len_short, INVALID_RANGE, (pv = portable, pv.len = 63, devbridge_import_tensor(A, &pv, NULL, &out_handle))) \
  X(import_tensor_len_near_2_64, INVALID_RANGE, (pv = portable, pv.len = NEAR_2_64, devbridge_import_tensor(A, &pv, NULL, &out_handle))) \
  X(import_tensor_null_data, INVALID_RANGE, (pv = portable, pv.data = NULL, devbridge_import_tensor(A, &pv, NULL, &out_handle))) \
  X(import_tensor_null_dims, INVALID_RANGE, (pv = portable, pv.dims = NULL, devbridge_import_tensor(A, &pv, NULL, &out_handle))) \
  X(import_tensor_rank_9, INVALID_RANGE, (pv = portable, pv.dims = nine_dims, pv.rank = 9, devbridge_import_tensor(A, &pv, NULL, &out_handle))) \
  X(import_tensor_negative_dim, INVALID_RANGE, (pv = portable, pv.dims = negative_dims, devbridge_import_tensor(A, &pv, NULL, &out_handle))) \
  X(import_tensor_dims_overflow, INVALID_RANGE, (pv = portable, pv.dims = huge_shape, pv.rank = 2, devbridge_import_tensor(A, &pv, NULL, &out_handle))) \
  X(import_tensor_empty, INVALID_EXTENT, (pv = portable, pv.dims = zero_dims, pv.len = 0, devbridge_import_tensor(A, &pv, NULL, &out_handle))) \
  X(import_tensor_short_spec, INVALID_RANGE, (s = spec, devbridge_import_tensor(A, &portable, SHORT(s), &out_handle))) \
  X(import_tensor_spec_too_small, INVALID_EXTENT, (s = spec, s.max_extent = 32, devbridge_import_tensor(A, &portable, &s, &out_handle))) \
  X(import_tensor_spec_other_dtype, UNSUPPORTED_DTYPE, (s = spec, s.dtype = DEVBRIDGE_DTYPE_INT8, devbridge_import_tensor(A, &portable, &s, &out_handle))) \
  X(import_tensor_spec_alignment, INVALID_ALIGNMENT, (s = spec, s.alignment = 48, devbridge_import_tensor(A, &portable, &s, &out_handle))) \
  X(import_tensor_closed, CLOSED, devbridge_import_tensor(closed, &portable, NULL, &out_handle)) \
  /* checkpoints (each refused before a file is made) */ \
  X(checkpoint_null_bridge, INVALID_RANGE, devbridge_checkpoint(NULL, "/tmp/devbridge-boundary.safetensors", &entry, 1, 0)) \
  X(checkpoint_null_path, INVALID_RANGE, devbridge_checkpoint(A, NULL, &entry, 1, 0)) \
  X(checkpoint_empty_path, INVALID_RANGE, devbridge_checkpoint(A, "", &entry, 1, 0)) \
  X(checkpoint_null_entries, INVALID_RANGE, devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", NULL, 1, 0)) \
  X(checkpoint_count_near_2_64, INVALID_RANGE, devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", &entry, NEAR_2_64, 0)) \
  X(checkpoint_null_name, INVALID_RANGE, (e = entry, e.name = NULL, devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", &e, 1, 0))) \
  X(checkpoint_metadata_name, INVALID_RANGE, (e = entry, e.name = "__metadata__", devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", &e, 1, 0))) \
  X(checkpoint_name_not_utf8, INVALID_RANGE, (e = entry, e.name = "\xff", devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", &e, 1, 0))) \
  X(checkpoint_name_twice, INVALID_RANGE, devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", two_entries, 2, 0)) \
  X(checkpoint_bad_dtype, UNSUPPORTED_DTYPE, (e = entry, e.dtype = 99, devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", &e, 1, 0))) \
  X(checkpoint_null_dims, INVALID_RANGE, (e = entry, e.dims = NULL, devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", &e, 1, 0))) \
  X(checkpoint_dims_overflow, INVALID_RANGE, (e = entry, e.dims = huge_shape, e.rank = 2, devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", &e, 1, 0))) \
  X(checkpoint_past_extent, INVALID_RANGE, (e = entry, e.dtype = DEVBRIDGE_DTYPE_FLOAT64, devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", &e, 1, 0))) \
  X(checkpoint_old_handle, OLD_GENERATION_HANDLE, (e = entry, e.handle = old_handle, devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", &e, 1, 0))) \
  X(checkpoint_foreign_handle, FOREIGN_DOMAIN, (e = entry, e.handle = foreign, devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", &e, 1, 0))) \
  X(checkpoint_unknown_handle, UNKNOWN_DEVICE_HANDLE, (e = entry, e.handle = unknown, devbridge_checkpoint(A, "/tmp/devbridge-boundary.safetensors", &e, 1, 0))) \
  X(checkpoint_no_directory, UNAVAILABLE, devbridge_checkpoint(A, "/nonexistent-devbridge-dir/x.safetensors", &entry, 1, 0)) \
  X(checkpoint_closed, CLOSED, devbridge_checkpoint(closed, "/tmp/devbridge-boundary.safetensors", &entry, 1, 0)) \
  X(restore_null_bridge, INVALID_RANGE, devbridge_restore(NULL, "/tmp/devbridge-boundary.safetensors", &out_restored)) \
  X(restore_null_path, INVALID_RANGE, devbridge_restore(A, NULL, &out_restored)) \
  X(restore_null_out, INVALID_RANGE, devbridge_restore(A, "/tmp/devbridge-boundary.safetensors", NULL)) \
  X(restore_missing_file, UNAVAILABLE, devbridge_restore(A, "/nonexistent-devbridge-dir/x.safetensors", &out_restored)) \
  X(restore_a_directory, INVALID_RANGE, devbridge_restore(A, "/tmp", &out_restored)) \
  X(restore_not_safetensors, INVALID_RANGE, devbridge_restore(A, "/proc/self/cmdline", &out_restored)) \
  X(restore_selected_null_bridge, INVALID_RANGE, devbridge_restore_selected(NULL, fixture_file, &restore_options, &out_restored)) \
  X(restore_selected_null_path, INVALID_RANGE, devbridge_restore_selected(A, NULL, &restore_options, &out_restored)) \
  X(restore_selected_null_out, INVALID_RANGE, devbridge_restore_selected(A, fixture_file, &restore_options, NULL)) \
  X(restore_selected_short_options, INVALID_RANGE, (ro = restore_options, devbridge_restore_selected(A, fixture_file, SHORT(ro), &out_restored))) \
  X(restore_selected_reserved_set, INVALID_RANGE, (ro = restore_options, ro.reserved = 1, devbridge_restore_selected(A, fixture_file, &ro, &out_restored))) \
  X(restore_selected_null_names, INVALID_RANGE, (ro = restore_options, ro.name_count = 1, devbridge_restore_selected(A, fixture_file, &ro, &out_restored))) \
  X(restore_selected_null_name, INVALID_RANGE, (ro = restore_options, ro.names = null_names, ro.name_count = 1, ro.skip_checksum = 1, devbridge_restore_selected(A, fixture_file, &ro, &out_restored))) \
  X(restore_selected_huge_count, INVALID_RANGE, (ro = restore_options, ro.names = no_such_names, ro.name_count = NEAR_2_64, devbridge_restore_selected(A, fixture_file, &ro, &out_restored))) \
  X(restore_selected_missing_name, INVALID_RANGE, (ro = restore_options, ro.names = no_such_names, ro.name_count = 1, ro.skip_checksum = 1, devbridge_restore_selected(A, fixture_file, &ro, &out_restored))) \
  X(restore_selected_missing_file, UNAVAILABLE, devbridge_restore_selected(A, "/nonexistent-devbridge-dir/x.safetensors", &restore_options, &out_restored)) \
  X(restore_selected_closed, CLOSED, devbridge_restore_selected(closed, fixture_file, &restore_options, &out_restored)) \
  /* test controls */ \
  X(inject_null_bridge, INVALID_RANGE, devbridge_fake_inject(NULL, 0, 0, 1)) \
  X(inject_bad_call, INVALID_RANGE, devbridge_fake_inject(A, 11, 0, 1)) \
  X(inject_bad_failure, INVALID_RANGE, devbridge_fake_inject(A, 0, -1, 1)) \
  X(inject_on_host, UNSUPPORTED, devbridge_fake_inject(H, 0, 0, 1)) \
  X(auto_complete_null_bridge, INVALID_RANGE, devbridge_fake_set_auto_complete(NULL, 1)) \
  X(auto_complete_on_host, UNSUPPORTED, devbridge_fake_set_auto_complete(H, 1)) \
  X(complete_all_null_bridge, INVALID_RANGE, devbridge_fake_complete_all(NULL, 1, &out_u64)) \
  X(complete_all_on_host, UNSUPPORTED, devbridge_fake_complete_all(H, 1, &out_u64)) \
  X(live_allocations_null_bridge, INVALID_RANGE, devbridge_test_live_allocations(NULL, &out_u64)) \
  X(live_allocations_null_out, INVALID_RANGE, devbridge_test_live_allocations(A, NULL)) \
  X(hold_copies_null_bridge, INVALID_RANGE, devbridge_test_hold_copies(NULL, 1))

#define DEFINE_ROW(name, expected, call) \
  static devbridge_status row_##name(void) { return (call); }
BOUNDARY_ROWS(DEFINE_ROW)

typedef struct boundary_row {
  const char* name;
  devbridge_status expected;
  devbridge_status (*run)(void);
} boundary_row;

#define TABLE_ROW(name, expected, call) {#name, DEVBRIDGE_ERROR_##expected, row_##name},
static const boundary_row rows[] = {BOUNDARY_ROWS(TABLE_ROW)};

static void build_fixture(void) {
  options.size = sizeof options;
  options.backend = "fake";
  options.ring_bytes = 1u << 16;
  spec = float_tensor_spec(4096);
  registration.size = sizeof registration;
  registration.len = 256;

  A = open_bridge("fake", 1);
  B = open_bridge("fake", 1);
  H = open_bridge("host", 1);
  closed = open_bridge("fake", 1);
  CHECK_OK(devbridge_close(closed));
  CHECK_OK(devbridge_fake_set_auto_complete(A, 1));
  CHECK_OK(devbridge_fake_set_auto_complete(B, 1));

  /* Generation 1 of A: a handle, an event and a region that go stale. */
  CHECK_OK(devbridge_alloc_device(A, &spec, 256, &old_handle));
  CHECK_OK(devbridge_reserve_host(A, 256, 0, 0, &ring));
  CHECK_OK(devbridge_host_to_device(A, ring, range_of(old_handle, 0, 256), DEVBRIDGE_COPY_ASYNC, &old_event));
  registration.data = old_region_bytes;
  CHECK_OK(devbridge_register_host(A, &registration, &old_region));
  CHECK_OK(devbridge_restart(A, 2));

  CHECK_OK(devbridge_alloc_device(A, &spec, 256, &live));
  CHECK_OK(devbridge_reserve_host(A, 256, 0, 0, &ring));
  CHECK_OK(devbridge_host_to_device(A, ring, range_of(live, 0, 256), DEVBRIDGE_COPY_ASYNC, &live_event));
  registration.data = region_bytes;
  CHECK_OK(devbridge_register_host(A, &registration, &region));
  unknown = live;
  unknown.id += 1000;
  unknown_event = live_event;
  unknown_event.id += 1000;

  devbridge_host_range foreign_ring;
  CHECK_OK(devbridge_alloc_device(B, &spec, 256, &foreign));
  CHECK_OK(devbridge_reserve_host(B, 256, 0, 0, &foreign_ring));
  CHECK_OK(devbridge_host_to_device(B, foreign_ring, range_of(foreign, 0, 256), DEVBRIDGE_COPY_ASYNC, &foreign_event));
  registration.data = foreign_region_bytes;
  CHECK_OK(devbridge_register_host(B, &registration, &foreign_region));
  registration.data = region_bytes; /* registering it again overlaps */

  view_spec.size = sizeof view_spec;
  view_spec.dtype = DEVBRIDGE_DTYPE_FLOAT32;
  view_spec.ndim = 1;
  view_spec.shape = view_shape;

  portable.size = sizeof portable;
  portable.dtype = DEVBRIDGE_DTYPE_FLOAT32;
  portable.rank = 1;
  portable.dims = portable_dims;
  portable.data = portable_bytes;
  portable.len = sizeof portable_bytes;

  entry.name = "x";
  entry.handle = live;
  entry.dtype = DEVBRIDGE_DTYPE_FLOAT32;
  entry.rank = 1;
  entry.dims = view_shape; /* 64 float32: all 256 bytes of `live` */
  two_entries[0] = entry;
  two_entries[1] = entry;

  copy_request.size = sizeof copy_request;
  copy_request.direction = DEVBRIDGE_HOST_TO_DEVICE;
  copy_request.mode = DEVBRIDGE_COPY_SYNC;
  copy_request.host_kind = DEVBRIDGE_HOST_RING;
  copy_request.ring = ring;
  copy_request.device = range_of(live, 0, 256);

  restore_options.size = sizeof restore_options;
  snprintf(fixture_file, sizeof fixture_file, "/tmp/devbridge-boundary-%d.safetensors", (int)getpid());
  CHECK_OK(devbridge_checkpoint(A, fixture_file, &entry, 1, 0));
}

/* The rows changed nothing: the fixture's state reads as it was built. */
static void check_fixture_unchanged(void) {
  devbridge_stats after = {0};
  after.size = sizeof after;
  CHECK_OK(devbridge_get_stats(A, &after));
  /* Ring reservations are not tied to a generation: generation 1's is still held. */
  CHECK(after.generation == 2 && after.live_allocations == 1 && after.ring_reservations == 2);
  CHECK(after.host_regions == 1 && after.live_views == 0 && after.active_steps == 0 && after.broken == 0);
  /* The fixture's own calls still work. */
  CHECK_OK(devbridge_host_to_device(A, ring, range_of(live, 0, 256), DEVBRIDGE_COPY_SYNC, &out_event));
  view_out.size = sizeof view_out;
  CHECK_OK(devbridge_view_open(A, live, &view_spec, &view_out));
  CHECK_OK(devbridge_view_end(&view_out));
}

int main(void) {
  build_fixture();
  const size_t count = sizeof rows / sizeof rows[0];
  size_t failed = 0;
  for (size_t i = 0; i < count; ++i) {
    /* A known message first, so a row that leaves none is caught. */
    devbridge_open(NULL, NULL);
    char before[128];
    snprintf(before, sizeof before, "%s", devbridge_last_error_message());
    const devbridge_status got = rows[i].run();
    const char* message = devbridge_last_error_message();
    if (got != rows[i].expected) {
      fprintf(stderr, "row %s: got %s (%d), expected %s (%d): %s\n", rows[i].name, check_status_text(got), (int)got,
              check_status_text(rows[i].expected), (int)rows[i].expected, got == DEVBRIDGE_OK ? "" : message);
      ++failed;
    } else if (message[0] == '\0' || (strcmp(message, before) == 0 && rows[i].run != row_open_null_options)) {
      fprintf(stderr, "row %s: %s with no message\n", rows[i].name, check_status_text(got));
      ++failed;
    }
  }
  if (failed != 0) {
    fprintf(stderr, "%zu of %zu boundary rows failed\n", failed, count);
    return 1;
  }
  check_fixture_unchanged();
  remove(fixture_file);
  devbridge_destroy(A);
  devbridge_destroy(B);
  devbridge_destroy(H);
  devbridge_destroy(closed);
  printf("c_api boundary: %zu rows ok\n", count);
  return 0;
}
