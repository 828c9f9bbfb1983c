/* The worker's round trip through the C ABI, on the backend named by argv[1]
 * (fake or host): open, reserve ring bytes, fill, upload async, wait, the
 * safe-to-release query, release host, view -> DLTensor, DLPack export,
 * download, verify; a pitched copy from a registered region; a step; free,
 * close. */
#include <string.h>

#include "check.h"

enum { kRows = 16, kCols = 16, kElements = kRows * kCols, kBytes = kElements * 4 };

static void check_abi(void) {
  CHECK(devbridge_abi_version() == DEVBRIDGE_ABI_VERSION);
  CHECK(devbridge_abi_version() >> 16 == DEVBRIDGE_ABI_VERSION_MAJOR);
  CHECK(strcmp(devbridge_status_name(DEVBRIDGE_ERROR_INVALID_RANGE), "InvalidRange") == 0);
  CHECK(strcmp(devbridge_dtype_name(DEVBRIDGE_DTYPE_FLOAT32), "float32") == 0);
  CHECK(devbridge_dtype_size(DEVBRIDGE_DTYPE_BFLOAT16) == 2);
  CHECK(devbridge_dtype_name(DEVBRIDGE_DTYPE_COUNT) == NULL);
}

static void check_view(devbridge_bridge* bridge, devbridge_handle handle, const devbridge_device_info* info,
                       const float* expected) {
  const int64_t shape[2] = {kRows, kCols};
  devbridge_view_spec spec = {0};
  spec.size = sizeof spec;
  spec.dtype = DEVBRIDGE_DTYPE_FLOAT32;
  spec.ndim = 2;
  spec.shape = shape;
  devbridge_view view = {0};
  view.size = sizeof view;
  CHECK_OK(devbridge_view_open(bridge, handle, &spec, &view));
  CHECK(view.lease != NULL);
  CHECK(view.dl_tensor.ndim == 2);
  CHECK(view.dl_tensor.shape[0] == kRows && view.dl_tensor.shape[1] == kCols);
  CHECK(view.dl_tensor.strides[0] == kCols && view.dl_tensor.strides[1] == 1);
  CHECK(view.dl_tensor.dtype.code == kDLFloat && view.dl_tensor.dtype.bits == 32 && view.dl_tensor.dtype.lanes == 1);
  CHECK((int32_t)view.dl_tensor.device.device_type == info->dlpack_device_type);
  CHECK(view.dl_tensor.device.device_id == info->device_ordinal);
  CHECK(view.dl_tensor.data != NULL && view.dl_tensor.byte_offset == 0);
  CHECK(view.handle.id == handle.id && view.handle.generation == handle.generation);
  CHECK(view.dtype == DEVBRIDGE_DTYPE_FLOAT32 && view.read_only == 0);
  CHECK(strcmp(view.tinygrad_device, info->tinygrad_device) == 0);
  /* Where device memory is host memory, the view reads the uploaded values. */
  if (info->host_addressable) CHECK(memcmp(view.dl_tensor.data, expected, kBytes) == 0);

  /* While the view lives, the allocation cannot be freed. */
  CHECK_STATUS(DEVBRIDGE_ERROR_ALLOCATION_STILL_IN_USE, devbridge_free_device(bridge, handle));
  devbridge_stats stats = {0};
  stats.size = sizeof stats;
  CHECK_OK(devbridge_get_stats(bridge, &stats));
  CHECK(stats.live_views == 1);
  CHECK_OK(devbridge_view_end(&view));
  CHECK(view.lease == NULL);
  CHECK_OK(devbridge_view_end(&view)); /* ending twice is harmless */

  /* The DLPack 1.0 export owns its own lease until its deleter runs. */
  devbridge_dlpack_tensor* exported = NULL;
  CHECK_OK(devbridge_export_dlpack(bridge, handle, &spec, &exported));
  CHECK(exported != NULL && exported->deleter != NULL);
  CHECK(exported->version.major == 1 && exported->version.minor == 0);
  CHECK(exported->flags == 0);
  CHECK(exported->dl_tensor.ndim == 2 && exported->dl_tensor.shape[1] == kCols);
  if (info->host_addressable) CHECK(memcmp(exported->dl_tensor.data, expected, kBytes) == 0);
  CHECK_OK(devbridge_get_stats(bridge, &stats));
  CHECK(stats.live_views == 1);
  exported->deleter(exported);
  CHECK_OK(devbridge_get_stats(bridge, &stats));
  CHECK(stats.live_views == 0);
}

/* Four rows of 16 bytes, 32 bytes apart in a registered buffer, land 64
 * bytes apart on the device; a pitched download brings them back packed. */
static void check_pitched_region_copy(devbridge_bridge* bridge) {
  static uint8_t source[4 * 32];
  for (size_t i = 0; i < sizeof source; ++i) source[i] = (uint8_t)(i * 7 + 1);
  devbridge_host_registration registration = {0};
  registration.size = sizeof registration;
  registration.data = source;
  registration.len = sizeof source;
  devbridge_region region;
  CHECK_OK(devbridge_register_host(bridge, &registration, &region));

  devbridge_object_spec spec = {0};
  spec.size = sizeof spec;
  spec.max_extent = 256;
  spec.alignment = 64;
  spec.dtype = DEVBRIDGE_DTYPE_BYTES;
  spec.shape = DEVBRIDGE_SHAPE_MATRIX;
  devbridge_handle handle;
  CHECK_OK(devbridge_alloc_device(bridge, &spec, 256, &handle));

  devbridge_copy_request up = {0};
  up.size = sizeof up;
  up.direction = DEVBRIDGE_HOST_TO_DEVICE;
  up.mode = DEVBRIDGE_COPY_SYNC;
  up.host_kind = DEVBRIDGE_HOST_REGION;
  up.region.region = region;
  up.region.len = sizeof source;
  up.device = whole(handle, 256);
  up.layout.rows = 4;
  up.layout.row_bytes = 16;
  up.layout.host_pitch = 32;
  up.layout.device_pitch = 64;
  devbridge_event event;
  CHECK_OK(devbridge_copy(bridge, &up, &event));

  devbridge_host_range packed;
  CHECK_OK(devbridge_reserve_host(bridge, 64, 0, 0, &packed));
  devbridge_copy_request down = up;
  down.direction = DEVBRIDGE_DEVICE_TO_HOST;
  down.mode = DEVBRIDGE_COPY_ASYNC;
  down.host_kind = DEVBRIDGE_HOST_RING;
  down.ring = packed;
  down.layout.host_pitch = 16;
  down.wait_for_room_ns = DEVBRIDGE_WAIT_FOREVER;
  CHECK_OK(devbridge_copy(bridge, &down, &event));
  devbridge_copy_outcome outcome = {0};
  outcome.size = sizeof outcome;
  CHECK_OK(devbridge_wait(bridge, event, DEVBRIDGE_WAIT_FOREVER, &outcome));
  CHECK(outcome.state == DEVBRIDGE_COPY_COMPLETED && outcome.error == DEVBRIDGE_OK);
  uint8_t* bytes = NULL;
  CHECK_OK(devbridge_host_bytes(bridge, packed, &bytes));
  for (int row = 0; row < 4; ++row) CHECK(memcmp(bytes + row * 16, source + row * 32, 16) == 0);

  CHECK_OK(devbridge_release_host(bridge, packed));
  CHECK_OK(devbridge_free_device(bridge, handle));
  CHECK_OK(devbridge_unregister_host(bridge, region));
  int32_t retained = 1;
  CHECK_OK(devbridge_region_retained(bridge, region, &retained));
  CHECK(retained == 0);
}

int main(int argc, char** argv) {
  const char* backend = argc > 1 ? argv[1] : "fake";
  check_abi();
  devbridge_bridge* bridge = open_bridge(backend, 1);

  devbridge_device_info info = {0};
  info.size = sizeof info;
  CHECK_OK(devbridge_backend_info(bridge, &info));
  CHECK(strcmp(info.backend, backend) == 0);
  CHECK(info.held_dtypes & (UINT64_C(1) << DEVBRIDGE_DTYPE_FLOAT32));
  uint64_t device_count = 0;
  CHECK_OK(devbridge_device_count(backend, &device_count));
  CHECK(device_count >= 1);
  devbridge_device_info first = {0};
  first.size = sizeof first;
  CHECK_OK(devbridge_device_at(backend, 0, &first));
  CHECK(strcmp(first.device_id, info.device_id) == 0);

  devbridge_object_spec spec = float_tensor_spec(4096);
  devbridge_handle handle;
  CHECK_OK(devbridge_alloc_device(bridge, &spec, kBytes, &handle));
  uint64_t extent = 0;
  CHECK_OK(devbridge_extent(bridge, handle, &extent));
  CHECK(extent == kBytes);

  /* Reserve and fill ring bytes. */
  devbridge_host_range upload_range;
  CHECK_OK(devbridge_reserve_host(bridge, kBytes, 0, 0, &upload_range));
  CHECK(upload_range.len == kBytes && upload_range.offset % 64 == 0);
  uint8_t* ring = NULL;
  CHECK_OK(devbridge_host_bytes(bridge, upload_range, &ring));
  float values[kElements];
  for (int i = 0; i < kElements; ++i) values[i] = (float)i * 0.5f - 3.0f;
  memcpy(ring, values, kBytes);

  /* Upload asynchronously while the device holds copies: the host range is
   * not yet safe to release, and the bridge refuses to release it. */
  CHECK_OK(devbridge_test_hold_copies(bridge, 1));
  devbridge_event upload;
  CHECK_OK(devbridge_host_to_device(bridge, upload_range, whole(handle, kBytes), DEVBRIDGE_COPY_ASYNC, &upload));
  int32_t flag = 1;
  CHECK_OK(devbridge_safe_to_release_host(bridge, upload, &flag));
  CHECK(flag == 0);
  CHECK_OK(devbridge_copy_event_complete(bridge, upload, &flag));
  CHECK(flag == 0);
  CHECK_STATUS(DEVBRIDGE_ERROR_ALLOCATION_STILL_IN_USE, devbridge_release_host(bridge, upload_range));
  devbridge_copy_outcome outcome = {0};
  outcome.size = sizeof outcome;
  CHECK_OK(devbridge_wait(bridge, upload, 0, &outcome));
  CHECK(outcome.state == DEVBRIDGE_COPY_PENDING);
  CHECK_OK(devbridge_test_hold_copies(bridge, 0));
  CHECK_OK(devbridge_wait(bridge, upload, DEVBRIDGE_WAIT_FOREVER, &outcome));
  CHECK(outcome.state == DEVBRIDGE_COPY_COMPLETED);
  CHECK_OK(devbridge_safe_to_release_host(bridge, upload, &flag));
  CHECK(flag == 1);
  CHECK_OK(devbridge_copy_event_complete(bridge, upload, &flag));
  CHECK(flag == 1);
  CHECK_OK(devbridge_release_host(bridge, upload_range));

  check_view(bridge, handle, &info, values);

  /* Download into fresh ring bytes and verify. */
  devbridge_host_range download_range;
  CHECK_OK(devbridge_reserve_host(bridge, kBytes, 0, 0, &download_range));
  CHECK_OK(devbridge_host_bytes(bridge, download_range, &ring));
  memset(ring, 0, kBytes);
  devbridge_event download;
  CHECK_OK(devbridge_device_to_host(bridge, whole(handle, kBytes), download_range, DEVBRIDGE_COPY_ASYNC, &download));
  CHECK_OK(devbridge_wait(bridge, download, DEVBRIDGE_WAIT_FOREVER, &outcome));
  CHECK(outcome.state == DEVBRIDGE_COPY_COMPLETED);
  CHECK_OK(devbridge_host_bytes_valid(bridge, download, &flag));
  CHECK(flag == 1);
  CHECK(memcmp(ring, values, kBytes) == 0);
  /* The release waits on the event, which has already passed. */
  CHECK_OK(devbridge_release_host_after(bridge, download_range, download));
  uint64_t applied = 0;
  CHECK_OK(devbridge_poll(bridge, &applied));
  CHECK_OK(devbridge_poll(bridge, NULL));

  check_pitched_region_copy(bridge);

  /* A step holds its allocations: free is refused until it ends. */
  CHECK_OK(devbridge_begin_step(bridge, 7, &handle, 1));
  CHECK_STATUS(DEVBRIDGE_ERROR_ALLOCATION_STILL_IN_USE, devbridge_free_device(bridge, handle));
  CHECK_OK(devbridge_end_step(bridge, 7));

  CHECK_OK(devbridge_free_device(bridge, handle));
  devbridge_stats stats = {0};
  stats.size = sizeof stats;
  CHECK_OK(devbridge_get_stats(bridge, &stats));
  CHECK(stats.live_allocations == 0 && stats.ring_reservations == 0 && stats.copies_in_flight == 0);
  CHECK(stats.copies_completed >= 2 && stats.generation == 1);
  devbridge_memory_stats memory = {0};
  memory.size = sizeof memory;
  CHECK_OK(devbridge_get_memory_stats(bridge, &memory));
  CHECK(memory.allocated_bytes == 0 && memory.total_allocations == 2);
  CHECK_OK(devbridge_empty_cache(bridge));
  CHECK_OK(devbridge_reset_peak_memory(bridge));
  uint64_t live = 1;
  CHECK_OK(devbridge_test_live_allocations(bridge, &live));
  CHECK(live == 0);

  CHECK_OK(devbridge_close(bridge));
  CHECK_STATUS(DEVBRIDGE_ERROR_CLOSED, devbridge_alloc_device(bridge, &spec, kBytes, &handle));
  devbridge_destroy(bridge);
  devbridge_destroy(NULL);
  printf("c_api round trip on %s: ok\n", backend);
  return 0;
}
