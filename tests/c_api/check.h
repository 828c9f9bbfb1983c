/* The C suites' checks: each failure names the call, the status it gave and
 * the library's message, and ends the test (what follows depends on it). */
#ifndef DEVBRIDGE_TESTS_C_API_CHECK_H
#define DEVBRIDGE_TESTS_C_API_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "devbridge/c/devbridge.h"

static inline const char* check_status_text(devbridge_status status) {
  const char* name = devbridge_status_name(status);
  return name ? name : "(no such status)";
}

static inline void check_status_at(const char* file, int line, const char* call, devbridge_status expected,
                                   devbridge_status got) {
  if (got == expected) return;
  fprintf(stderr, "%s:%d: %s\n  returned %s (%d), expected %s (%d)\n  last error message: %s\n", file, line, call,
          check_status_text(got), (int)got, check_status_text(expected), (int)expected,
          devbridge_last_error_message());
  exit(1);
}

static inline void check_true_at(const char* file, int line, const char* condition, int value) {
  if (value) return;
  fprintf(stderr, "%s:%d: CHECK(%s) failed\n", file, line, condition);
  exit(1);
}

#define CHECK_STATUS(expected, call) check_status_at(__FILE__, __LINE__, #call, (expected), (call))
#define CHECK_OK(call) CHECK_STATUS(DEVBRIDGE_OK, call)
#define CHECK(condition) check_true_at(__FILE__, __LINE__, #condition, (condition) ? 1 : 0)

/* A bridge over `backend` with a small ring. */
static inline devbridge_bridge* open_bridge(const char* backend, uint64_t generation) {
  devbridge_open_options options = {0};
  options.size = sizeof options;
  options.backend = backend;
  options.generation = generation;
  options.ring_bytes = 1u << 20;
  devbridge_bridge* bridge = NULL;
  CHECK_OK(devbridge_open(&options, &bridge));
  CHECK(bridge != NULL);
  return bridge;
}

static inline devbridge_object_spec float_tensor_spec(uint64_t max_extent) {
  devbridge_object_spec spec = {0};
  spec.size = sizeof spec;
  spec.max_extent = max_extent;
  spec.alignment = 64;
  spec.dtype = DEVBRIDGE_DTYPE_FLOAT32;
  spec.shape = DEVBRIDGE_SHAPE_TENSOR;
  return spec;
}

/* A portable tensor's description over caller-owned bytes. */
static inline devbridge_portable_view view_of(devbridge_dtype dtype, const int64_t* dims, uint32_t rank, const void* data,
                                       uint64_t len) {
  devbridge_portable_view view = {0};
  view.size = sizeof view;
  view.dtype = dtype;
  view.rank = rank;
  view.dims = dims;
  view.data = data;
  view.len = len;
  return view;
}

/* What the backend holds once the caching pool gives back what it keeps. */
static inline uint64_t live_allocations(devbridge_bridge* bridge) {
  uint64_t count = 0;
  CHECK_OK(devbridge_empty_cache(bridge));
  CHECK_OK(devbridge_test_live_allocations(bridge, &count));
  return count;
}

static inline devbridge_device_range whole(devbridge_handle handle, uint64_t len) {
  devbridge_device_range range = {handle, 0, len};
  return range;
}

#endif
