/* Faults injected on the fake backend, and restart, through the C ABI: each
 * failure arrives as its vocabulary kind with a message, loses nothing the
 * caller owns, and a restart refuses every handle of the old generation. */
#include <string.h>

#include "check.h"

enum { kBytes = 1024 };

static void check_message_present(void) { CHECK(strlen(devbridge_last_error_message()) > 0); }

static void allocation_failure(devbridge_bridge* bridge) {
  devbridge_object_spec spec = float_tensor_spec(4096);
  devbridge_handle handle;
  /* The bridge retries an allocation once after reclaiming what it can:
   * fail both tries. */
  CHECK_OK(devbridge_fake_inject(bridge, DEVBRIDGE_FAKE_CALL_ALLOCATE, DEVBRIDGE_FAKE_FAIL_ALLOCATION, 1));
  CHECK_OK(devbridge_fake_inject(bridge, DEVBRIDGE_FAKE_CALL_ALLOCATE, DEVBRIDGE_FAKE_FAIL_ALLOCATION, 2));
  CHECK_STATUS(DEVBRIDGE_ERROR_ALLOCATION_FAILED, devbridge_alloc_device(bridge, &spec, kBytes, &handle));
  check_message_present();
  CHECK_OK(devbridge_alloc_device(bridge, &spec, kBytes, &handle)); /* one-shot */
  CHECK_OK(devbridge_free_device(bridge, handle));
  /* A failure that cannot apply to the call is refused as a bad argument. */
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE,
               devbridge_fake_inject(bridge, DEVBRIDGE_FAKE_CALL_ALLOCATE, DEVBRIDGE_FAKE_FAIL_INVALID_VIEW, 1));
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE,
               devbridge_fake_inject(bridge, DEVBRIDGE_FAKE_CALL_ALLOCATE, DEVBRIDGE_FAKE_FAIL_ALLOCATION, 0));
}

static void copy_failures(devbridge_bridge* bridge) {
  devbridge_object_spec spec = float_tensor_spec(4096);
  devbridge_handle handle;
  CHECK_OK(devbridge_alloc_device(bridge, &spec, kBytes, &handle));
  devbridge_host_range range;
  CHECK_OK(devbridge_reserve_host(bridge, kBytes, 0, 0, &range));
  devbridge_event event;

  /* At submit: the sync call fails with the direction's kind. */
  CHECK_OK(devbridge_fake_inject(bridge, DEVBRIDGE_FAKE_CALL_COPY_HOST_TO_DEVICE, DEVBRIDGE_FAKE_FAIL_COPY_AT_SUBMIT, 1));
  CHECK_STATUS(DEVBRIDGE_ERROR_DEVICE_COPY_FAILED,
               devbridge_host_to_device(bridge, range, whole(handle, kBytes), DEVBRIDGE_COPY_SYNC, &event));
  check_message_present();
  CHECK_OK(devbridge_fake_inject(bridge, DEVBRIDGE_FAKE_CALL_COPY_DEVICE_TO_HOST, DEVBRIDGE_FAKE_FAIL_COPY_AT_SUBMIT, 1));
  CHECK_STATUS(DEVBRIDGE_ERROR_OUTPUT_COPY_FAILED,
               devbridge_device_to_host(bridge, whole(handle, kBytes), range, DEVBRIDGE_COPY_SYNC, &event));
  /* Nothing was lost: the same range copies now. */
  CHECK_OK(devbridge_host_to_device(bridge, range, whole(handle, kBytes), DEVBRIDGE_COPY_SYNC, &event));

  /* At completion: the async call succeeds, its event reads Failed with
   * the kind and the message, and the host range is the caller's again. */
  CHECK_OK(devbridge_fake_inject(bridge, DEVBRIDGE_FAKE_CALL_COPY_HOST_TO_DEVICE,
                                 DEVBRIDGE_FAKE_FAIL_COPY_AT_COMPLETION, 1));
  CHECK_OK(devbridge_host_to_device(bridge, range, whole(handle, kBytes), DEVBRIDGE_COPY_ASYNC, &event));
  uint64_t completed = 0;
  CHECK_OK(devbridge_fake_complete_all(bridge, 1, &completed));
  CHECK(completed == 1);
  int32_t flag = 1;
  CHECK_OK(devbridge_safe_to_release_host(bridge, event, &flag));
  CHECK(flag == 0);
  CHECK_OK(devbridge_copy_event_complete(bridge, event, &flag));
  CHECK(flag == 0);
  devbridge_copy_outcome outcome = {0};
  outcome.size = sizeof outcome;
  CHECK_OK(devbridge_wait(bridge, event, DEVBRIDGE_WAIT_FOREVER, &outcome));
  CHECK(outcome.state == DEVBRIDGE_COPY_FAILED);
  CHECK(outcome.error == DEVBRIDGE_ERROR_DEVICE_COPY_FAILED);
  check_message_present();
  CHECK_OK(devbridge_release_host(bridge, range));

  devbridge_stats stats = {0};
  stats.size = sizeof stats;
  CHECK_OK(devbridge_get_stats(bridge, &stats));
  CHECK(stats.copies_failed >= 1 && stats.ring_reservations == 0);
  CHECK_OK(devbridge_free_device(bridge, handle));
}

/* A fatal fault leaves the bridge Broken until a restart. */
static void fatal_fault(devbridge_bridge* bridge, uint64_t next_generation) {
  devbridge_object_spec spec = float_tensor_spec(4096);
  devbridge_handle handle;
  CHECK_OK(devbridge_fake_inject(bridge, DEVBRIDGE_FAKE_CALL_ALLOCATE, DEVBRIDGE_FAKE_FAIL_FATAL, 1));
  CHECK_STATUS(DEVBRIDGE_ERROR_ALLOCATION_FAILED, devbridge_alloc_device(bridge, &spec, kBytes, &handle));
  devbridge_stats stats = {0};
  stats.size = sizeof stats;
  CHECK_OK(devbridge_get_stats(bridge, &stats));
  CHECK(stats.broken == 1);
  CHECK_STATUS(DEVBRIDGE_ERROR_BROKEN, devbridge_alloc_device(bridge, &spec, kBytes, &handle));
  CHECK_OK(devbridge_restart(bridge, next_generation));
  CHECK_OK(devbridge_get_stats(bridge, &stats));
  CHECK(stats.broken == 0);
  CHECK_OK(devbridge_alloc_device(bridge, &spec, kBytes, &handle));
  CHECK_OK(devbridge_free_device(bridge, handle));
}

static void restart_refuses_old_generation(devbridge_bridge* bridge) {
  uint64_t generation = 0;
  CHECK_OK(devbridge_generation(bridge, &generation));
  devbridge_object_spec spec = float_tensor_spec(4096);
  devbridge_handle old_handle;
  CHECK_OK(devbridge_alloc_device(bridge, &spec, kBytes, &old_handle));
  CHECK(old_handle.generation == generation);
  devbridge_host_range range;
  CHECK_OK(devbridge_reserve_host(bridge, kBytes, 0, 0, &range));
  devbridge_event old_event;
  CHECK_OK(devbridge_host_to_device(bridge, range, whole(old_handle, kBytes), DEVBRIDGE_COPY_ASYNC, &old_event));
  /* A view taken before the restart outlives it; its memory waits for it. */
  const int64_t shape[1] = {kBytes / 4};
  devbridge_view_spec view_spec = {0};
  view_spec.size = sizeof view_spec;
  view_spec.dtype = DEVBRIDGE_DTYPE_FLOAT32;
  view_spec.ndim = 1;
  view_spec.shape = shape;
  view_spec.wait = DEVBRIDGE_VIEW_WAIT_IN_FLIGHT;
  CHECK_OK(devbridge_fake_complete_all(bridge, 1, NULL));
  devbridge_view view = {0};
  view.size = sizeof view;
  CHECK_OK(devbridge_view_open(bridge, old_handle, &view_spec, &view));

  CHECK_OK(devbridge_restart(bridge, generation + 1));
  CHECK_OK(devbridge_generation(bridge, &generation));
  CHECK(generation == old_handle.generation + 1);
  CHECK_STATUS(DEVBRIDGE_ERROR_OLD_GENERATION_HANDLE, devbridge_restart(bridge, generation));
  CHECK_STATUS(DEVBRIDGE_ERROR_OLD_GENERATION_HANDLE, devbridge_free_device(bridge, old_handle));
  CHECK_STATUS(DEVBRIDGE_ERROR_OLD_GENERATION_HANDLE, devbridge_release_device(bridge, old_handle));
  CHECK_STATUS(DEVBRIDGE_ERROR_OLD_GENERATION_HANDLE, devbridge_view_open(bridge, old_handle, &view_spec, &view));
  int32_t flag = 0;
  CHECK_STATUS(DEVBRIDGE_ERROR_OLD_GENERATION_HANDLE, devbridge_safe_to_release_host(bridge, old_event, &flag));
  devbridge_copy_outcome outcome = {0};
  outcome.size = sizeof outcome;
  CHECK_STATUS(DEVBRIDGE_ERROR_OLD_GENERATION_HANDLE, devbridge_wait(bridge, old_event, 0, &outcome));
  CHECK_STATUS(DEVBRIDGE_ERROR_OLD_GENERATION_HANDLE, devbridge_begin_step(bridge, 1, &old_handle, 1));

  devbridge_stats stats = {0};
  stats.size = sizeof stats;
  CHECK_OK(devbridge_get_stats(bridge, &stats));
  CHECK(stats.orphaned_allocations == 1 && stats.restarts >= 1);
  CHECK_OK(devbridge_view_end(&view));
  CHECK_OK(devbridge_get_stats(bridge, &stats));
  CHECK(stats.orphaned_allocations == 0);
  uint64_t live = 1;
  CHECK_OK(devbridge_test_live_allocations(bridge, &live));
  CHECK(live == 0);

  devbridge_handle fresh;
  CHECK_OK(devbridge_alloc_device(bridge, &spec, kBytes, &fresh));
  CHECK(fresh.generation == generation);
  CHECK_OK(devbridge_free_device(bridge, fresh));
}

/* A DLPack export keeps what it reads alive past the bridge object. */
static void export_outlives_bridge(void) {
  devbridge_bridge* bridge = open_bridge("fake", 1);
  devbridge_object_spec spec = float_tensor_spec(4096);
  devbridge_handle handle;
  CHECK_OK(devbridge_alloc_device(bridge, &spec, kBytes, &handle));
  const int64_t shape[1] = {kBytes / 4};
  devbridge_view_spec view_spec = {0};
  view_spec.size = sizeof view_spec;
  view_spec.dtype = DEVBRIDGE_DTYPE_FLOAT32;
  view_spec.ndim = 1;
  view_spec.shape = shape;
  devbridge_dlpack_tensor* exported = NULL;
  CHECK_OK(devbridge_export_dlpack(bridge, handle, &view_spec, &exported));
  devbridge_view view = {0};
  view.size = sizeof view;
  CHECK_OK(devbridge_view_open(bridge, handle, &view_spec, &view));
  devbridge_destroy(bridge);
  CHECK(exported->dl_tensor.shape[0] == kBytes / 4);
  exported->deleter(exported);
  CHECK_OK(devbridge_view_end(&view));
}

static void open_failures(void) {
  devbridge_open_options options = {0};
  options.size = sizeof options;
  devbridge_bridge* bridge = NULL;
  options.backend = "no-such-backend";
  CHECK_STATUS(DEVBRIDGE_ERROR_UNAVAILABLE, devbridge_open(&options, &bridge));
  check_message_present();
  options.backend = "fake";
  options.device = "7"; /* a device the fake does not have */
  CHECK_STATUS(DEVBRIDGE_ERROR_UNAVAILABLE, devbridge_open(&options, &bridge));
  CHECK(bridge == NULL);
  options.device = NULL;
  devbridge_backend_option unknown = {"no_such_option", "1"};
  options.backend_options = &unknown;
  options.backend_option_count = 1;
  CHECK_STATUS(DEVBRIDGE_ERROR_UNSUPPORTED, devbridge_open(&options, &bridge));
  CHECK(bridge == NULL);
  options.backend_option_count = 0;
  /* The device option, and the same option given twice. */
  options.device = "0";
  CHECK_OK(devbridge_open(&options, &bridge));
  devbridge_destroy(bridge);
  devbridge_backend_option device = {"device", "0"};
  options.backend_options = &device;
  options.backend_option_count = 1;
  CHECK_STATUS(DEVBRIDGE_ERROR_INVALID_RANGE, devbridge_open(&options, &bridge));
  /* The fake's own option: a device that holds float32 only. */
  devbridge_backend_option narrow = {"dtypes", "float32"};
  options.device = NULL;
  options.backend_options = &narrow;
  options.backend_option_count = 1;
  CHECK_OK(devbridge_open(&options, &bridge));
  devbridge_device_info info = {0};
  info.size = sizeof info;
  CHECK_OK(devbridge_backend_info(bridge, &info));
  CHECK(info.held_dtypes == (UINT64_C(1) << DEVBRIDGE_DTYPE_FLOAT32));
  devbridge_object_spec spec = float_tensor_spec(4096);
  spec.dtype = DEVBRIDGE_DTYPE_FLOAT64;
  devbridge_handle handle;
  CHECK_STATUS(DEVBRIDGE_ERROR_UNSUPPORTED_DTYPE, devbridge_alloc_device(bridge, &spec, kBytes, &handle));
  devbridge_destroy(bridge);
}

int main(void) {
  open_failures();
  devbridge_bridge* bridge = open_bridge("fake", 1);
  allocation_failure(bridge);
  copy_failures(bridge);
  fatal_fault(bridge, 2);
  restart_refuses_old_generation(bridge);
  uint64_t live = 1;
  CHECK_OK(devbridge_test_live_allocations(bridge, &live));
  CHECK(live == 0);
  devbridge_destroy(bridge);
  export_outlives_bridge();
  printf("c_api faults: ok\n");
  return 0;
}
