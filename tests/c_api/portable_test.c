/* Portable tensors through the C ABI: a tensor four times the ring goes
 * fake -> portable -> host -> portable bit-exact (chunks through both rings),
 * an export from an offset, the spec rules of an import, a dtype the device
 * does not hold, a copy failing mid-import, and no allocation left behind. */
#include <string.h>

#include "check.h"

enum { kRing = 1 << 16, kRows = 256, kCols = 256, kElements = kRows * kCols, kBytes = kElements * 4 };

static devbridge_bridge* open_with_ring(const char* backend, const devbridge_backend_option* option) {
  devbridge_open_options options = {0};
  options.size = sizeof options;
  options.backend = backend;
  options.ring_bytes = kRing;
  options.backend_options = option;
  options.backend_option_count = option ? 1 : 0;
  devbridge_bridge* bridge = NULL;
  CHECK_OK(devbridge_open(&options, &bridge));
  return bridge;
}

static devbridge_portable_view describe(const devbridge_portable* tensor) {
  devbridge_portable_view view = {0};
  view.size = sizeof view;
  CHECK_OK(devbridge_portable_describe(tensor, &view));
  return view;
}

static void round_trip_larger_than_the_ring(devbridge_bridge* fake, devbridge_bridge* host, const uint32_t* values) {
  const int64_t dims[2] = {kRows, kCols};
  const devbridge_portable_view source = view_of(DEVBRIDGE_DTYPE_FLOAT32, dims, 2, values, kBytes);
  devbridge_handle on_fake, on_host;
  CHECK_OK(devbridge_import_tensor(fake, &source, NULL, &on_fake));
  uint64_t extent = 0;
  CHECK_OK(devbridge_extent(fake, on_fake, &extent));
  CHECK(extent == kBytes); /* already a multiple of the default alignment, 256 */

  devbridge_portable* exported = NULL;
  CHECK_OK(devbridge_export_tensor(fake, on_fake, DEVBRIDGE_DTYPE_FLOAT32, dims, 2, 0, &exported));
  const devbridge_portable_view out = describe(exported);
  CHECK(out.dtype == DEVBRIDGE_DTYPE_FLOAT32 && out.rank == 2 && out.dims[0] == kRows && out.dims[1] == kCols);
  CHECK(out.len == kBytes && memcmp(out.data, values, kBytes) == 0);

  /* The library-owned value imports as a caller's would. */
  CHECK_OK(devbridge_import_tensor(host, &out, NULL, &on_host));
  devbridge_portable_free(exported);
  devbridge_portable* back = NULL;
  CHECK_OK(devbridge_export_tensor(host, on_host, DEVBRIDGE_DTYPE_FLOAT32, dims, 2, 0, &back));
  CHECK(memcmp(describe(back).data, values, kBytes) == 0);
  devbridge_portable_free(back);

  /* Row 3 alone, as uint8 bytes from its offset. */
  const int64_t row[1] = {kCols * 4};
  devbridge_portable* third = NULL;
  CHECK_OK(devbridge_export_tensor(host, on_host, DEVBRIDGE_DTYPE_UINT8, row, 1, 3 * kCols * 4, &third));
  CHECK(describe(third).len == kCols * 4 && memcmp(describe(third).data, values + 3 * kCols, kCols * 4) == 0);
  devbridge_portable_free(third);
  /* Items at an offset of another size are refused: float32 bytes as float64 from byte 4. */
  const int64_t one[1] = {1};
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE,
               devbridge_export_tensor(host, on_host, DEVBRIDGE_DTYPE_FLOAT64, one, 1, 4, &third));
  CHECK(strstr(devbridge_last_error_message(), "not a multiple of its 8-byte items") != NULL);
  /* One byte past the extent is refused, naming the handle as the bridge does. */
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE,
               devbridge_export_tensor(host, on_host, DEVBRIDGE_DTYPE_UINT8, row, 1, kBytes - kCols * 4 + 1, &third));
  CHECK(strstr(devbridge_last_error_message(), "of handle {domain ") != NULL);
  /* Bytes of a float32 allocation are read whole elements at a time (as every copy out of it). */
  const int64_t three[1] = {3}, four[1] = {4};
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE,
               devbridge_export_tensor(host, on_host, DEVBRIDGE_DTYPE_UINT8, three, 1, 0, &third));
  CHECK(strstr(devbridge_last_error_message(), "multiples of its element size 4") != NULL);
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE,
               devbridge_export_tensor(host, on_host, DEVBRIDGE_DTYPE_UINT8, four, 1, 1, &third));
  CHECK_OK(devbridge_export_tensor(host, on_host, DEVBRIDGE_DTYPE_UINT8, four, 1, 4, &third));
  CHECK(describe(third).len == 4 && memcmp(describe(third).data, values + 1, 4) == 0);
  devbridge_portable_free(third);

  CHECK_OK(devbridge_free_device(fake, on_fake));
  CHECK_OK(devbridge_free_device(host, on_host));
}

static void spec_rules(devbridge_bridge* host, const uint32_t* values) {
  const int64_t dims[1] = {100};
  const devbridge_portable_view source = view_of(DEVBRIDGE_DTYPE_FLOAT32, dims, 1, values, 400);
  devbridge_object_spec spec = float_tensor_spec(448);
  devbridge_handle handle;
  CHECK_OK(devbridge_import_tensor(host, &source, &spec, &handle)); /* 400 rounds up to 448 at 64 */
  uint64_t extent = 0;
  CHECK_OK(devbridge_extent(host, handle, &extent));
  CHECK(extent == 448);
  CHECK_OK(devbridge_free_device(host, handle));
  spec.dtype = DEVBRIDGE_DTYPE_BYTES;
  CHECK_OK(devbridge_import_tensor(host, &source, &spec, &handle));
  CHECK_OK(devbridge_free_device(host, handle));

  spec.max_extent = 384;
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_EXTENT, devbridge_import_tensor(host, &source, &spec, &handle));
  spec = float_tensor_spec(4096);
  spec.dtype = DEVBRIDGE_DTYPE_INT32;
  CHECK_STATUS(DEVBRIDGE_ERROR_UNSUPPORTED_DTYPE, devbridge_import_tensor(host, &source, &spec, &handle));
  CHECK(live_allocations(host) == 0);
}

static void unheld_dtype(void) {
  const devbridge_backend_option only_float32 = {"dtypes", "float32"};
  devbridge_bridge* narrow = open_with_ring("fake", &only_float32);
  CHECK_OK(devbridge_fake_set_auto_complete(narrow, 1));
  const int64_t dims[1] = {8};
  const double values[8] = {0};
  const devbridge_portable_view source = view_of(DEVBRIDGE_DTYPE_FLOAT64, dims, 1, values, sizeof values);
  devbridge_handle handle;
  CHECK_STATUS(DEVBRIDGE_ERROR_UNSUPPORTED_DTYPE, devbridge_import_tensor(narrow, &source, NULL, &handle));
  devbridge_object_spec spec = float_tensor_spec(64);
  CHECK_OK(devbridge_alloc_device(narrow, &spec, 64, &handle));
  devbridge_portable* exported = NULL;
  CHECK_STATUS(DEVBRIDGE_ERROR_UNSUPPORTED_DTYPE,
               devbridge_export_tensor(narrow, handle, DEVBRIDGE_DTYPE_FLOAT64, dims, 1, 0, &exported));
  CHECK(exported == NULL);
  CHECK_OK(devbridge_free_device(narrow, handle));
  CHECK(live_allocations(narrow) == 0);
  devbridge_destroy(narrow);
}

static void copy_failing_mid_import(devbridge_bridge* fake, const uint32_t* values) {
  const int64_t dims[2] = {kRows, kCols};
  const devbridge_portable_view source = view_of(DEVBRIDGE_DTYPE_FLOAT32, dims, 2, values, kBytes);
  const uint64_t before = live_allocations(fake);
  /* The third chunk's upload fails when it completes. */
  CHECK_OK(devbridge_fake_inject(fake, DEVBRIDGE_FAKE_CALL_COPY_HOST_TO_DEVICE, DEVBRIDGE_FAKE_FAIL_COPY_AT_COMPLETION,
                                 3));
  devbridge_handle handle;
  CHECK_STATUS(DEVBRIDGE_ERROR_DEVICE_COPY_FAILED, devbridge_import_tensor(fake, &source, NULL, &handle));
  CHECK(strstr(devbridge_last_error_message(), "chunk") != NULL);
  CHECK(live_allocations(fake) == before);
}

int main(void) {
  static uint32_t values[kElements];
  for (uint32_t i = 0; i < kElements; ++i) values[i] = i * 2654435761u; /* every byte varies */
  devbridge_bridge* fake = open_with_ring("fake", NULL);
  devbridge_bridge* host = open_with_ring("host", NULL);
  CHECK_OK(devbridge_fake_set_auto_complete(fake, 1));

  round_trip_larger_than_the_ring(fake, host, values);
  spec_rules(host, values);
  unheld_dtype();
  copy_failing_mid_import(fake, values);

  CHECK(live_allocations(fake) == 0 && live_allocations(host) == 0);
  devbridge_portable_free(NULL);
  devbridge_destroy(fake);
  devbridge_destroy(host);
  printf("c_api portable: ok\n");
  return 0;
}
