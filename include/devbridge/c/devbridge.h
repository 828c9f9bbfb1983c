/*
 * devbridge's C ABI: the bridge for callers that are not C++ (a C or Rust
 * worker). C11; nothing of C++ crosses it. docs/C_API.md says how to build,
 * link and own things; this header is the reference for each call.
 *
 * Shape of every call:
 *   - It returns a devbridge_status: DEVBRIDGE_OK, or the error kind (the
 *     vocabulary of include/devbridge/error.hpp, one constant per kind). On
 *     failure devbridge_last_error_message() says what was at fault, and
 *     nothing the call would have written through an out-pointer is written.
 *   - No exception, signal or longjmp leaves it.
 *   - A pointer argument the call needs that is NULL, and an option or result
 *     struct whose `size` is below the size this ABI version knows, are
 *     DEVBRIDGE_ERROR_INVALID_RANGE (the vocabulary has no "invalid
 *     argument"; a bad pointer or struct is a bad range of caller memory).
 *   - Option and result structs carry their own `size` (set it to
 *     sizeof(the struct)) as their first field, so later ABI versions can
 *     grow them at the end; the library reads and writes only the fields it
 *     knows. Fields documented "0: default" make a zero-initialised struct
 *     with only `size` set a sensible one.
 *   - Enumerations are int32_t typedefs with #define constants of fixed
 *     values; there are no unions, bitfields or variadic functions.
 *   - Timeouts are int64_t nanoseconds: 0 means "at once", DEVBRIDGE_WAIT_FOREVER
 *     (or anything too large to add to the clock) means "until done", and a
 *     negative one is DEVBRIDGE_ERROR_INVALID_RANGE.
 *
 * Every call on a bridge is safe from many threads at once, as the C++
 * bridge's are, except devbridge_destroy, which must be the last.
 */
#ifndef DEVBRIDGE_C_DEVBRIDGE_H
#define DEVBRIDGE_C_DEVBRIDGE_H

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- ABI version --------------------------------------------------------- */

/* (major << 16) | minor. The major changes when a struct, a signature or a
 * constant changes incompatibly; the minor when calls or trailing struct
 * fields are added. A caller built against major M runs against a library
 * whose devbridge_abi_version() >> 16 is M and whose minor is at least its own. */
#define DEVBRIDGE_ABI_VERSION_MAJOR 1
#define DEVBRIDGE_ABI_VERSION_MINOR 1
#define DEVBRIDGE_ABI_VERSION ((DEVBRIDGE_ABI_VERSION_MAJOR << 16) | DEVBRIDGE_ABI_VERSION_MINOR)

uint32_t devbridge_abi_version(void);

/* ---- errors --------------------------------------------------------------- */

typedef int32_t devbridge_status;
#define DEVBRIDGE_OK 0
#define DEVBRIDGE_ERROR_ALLOCATION_FAILED 1
#define DEVBRIDGE_ERROR_DEVICE_COPY_FAILED 2
#define DEVBRIDGE_ERROR_OUTPUT_COPY_FAILED 3
#define DEVBRIDGE_ERROR_INVALID_EXTENT 4
#define DEVBRIDGE_ERROR_INVALID_ALIGNMENT 5
#define DEVBRIDGE_ERROR_INVALID_RANGE 6
#define DEVBRIDGE_ERROR_UNKNOWN_DEVICE_HANDLE 7
#define DEVBRIDGE_ERROR_OLD_GENERATION_HANDLE 8
#define DEVBRIDGE_ERROR_FOREIGN_DOMAIN 9
#define DEVBRIDGE_ERROR_INVALID_VIEW_DTYPE 10
#define DEVBRIDGE_ERROR_INVALID_TENSOR_VIEW 11
#define DEVBRIDGE_ERROR_UNSUPPORTED_DTYPE 12
#define DEVBRIDGE_ERROR_ALLOCATION_STILL_IN_USE 13
#define DEVBRIDGE_ERROR_BACKPRESSURE 14
#define DEVBRIDGE_ERROR_UNAVAILABLE 15
#define DEVBRIDGE_ERROR_UNSUPPORTED 16
#define DEVBRIDGE_ERROR_CLOSED 17
#define DEVBRIDGE_ERROR_BROKEN 18

/* What the latest failed call on this thread said ("" before any). The text
 * stays valid until the next failing call on this thread. A copy outcome
 * read as failed (devbridge_wait, devbridge_copy_status) also leaves the
 * copy's own message here. */
const char* devbridge_last_error_message(void);
/* The contract's name of a status ("InvalidRange", "OK"); NULL for a value
 * that is none. Static storage. */
const char* devbridge_status_name(devbridge_status status);

/* ---- identity -------------------------------------------------------------- */

/* Each is {domain, generation, id}: the domain names the bridge, so a
 * handle of another bridge is refused (FOREIGN_DOMAIN) and one from before a
 * restart too (OLD_GENERATION_HANDLE). Plain values: copy them freely. */
typedef struct devbridge_handle {
  uint64_t domain;
  uint64_t generation;
  uint64_t id;
} devbridge_handle;

typedef struct devbridge_event {
  uint64_t domain;
  uint64_t generation;
  uint64_t id;
} devbridge_event;

typedef struct devbridge_region {
  uint64_t domain;
  uint64_t generation;
  uint64_t id;
} devbridge_region;

/* Bytes [offset, offset + len) of the bridge's host ring. */
typedef struct devbridge_host_range {
  uint64_t offset;
  uint64_t len;
} devbridge_host_range;

/* Bytes [offset, offset + len) of a registered host region. */
typedef struct devbridge_region_range {
  devbridge_region region;
  uint64_t offset;
  uint64_t len;
} devbridge_region_range;

/* Bytes [offset, offset + len) of a device allocation. */
typedef struct devbridge_device_range {
  devbridge_handle handle;
  uint64_t offset;
  uint64_t len;
} devbridge_device_range;

/* ---- dtypes and enumerations ----------------------------------------------- */

typedef int32_t devbridge_dtype;
#define DEVBRIDGE_DTYPE_BYTES (-1) /* untyped allocation (object specs only) */
#define DEVBRIDGE_DTYPE_BOOL 0
#define DEVBRIDGE_DTYPE_INT8 1
#define DEVBRIDGE_DTYPE_INT16 2
#define DEVBRIDGE_DTYPE_INT32 3
#define DEVBRIDGE_DTYPE_INT64 4
#define DEVBRIDGE_DTYPE_UINT8 5
#define DEVBRIDGE_DTYPE_UINT16 6
#define DEVBRIDGE_DTYPE_UINT32 7
#define DEVBRIDGE_DTYPE_UINT64 8
#define DEVBRIDGE_DTYPE_FLOAT16 9
#define DEVBRIDGE_DTYPE_BFLOAT16 10
#define DEVBRIDGE_DTYPE_FLOAT32 11
#define DEVBRIDGE_DTYPE_FLOAT64 12
#define DEVBRIDGE_DTYPE_FP8E4M3 13
#define DEVBRIDGE_DTYPE_FP8E5M2 14
#define DEVBRIDGE_DTYPE_COUNT 15

/* The numpy/tinygrad name ("float32"), or NULL for no dtype. Static storage. */
const char* devbridge_dtype_name(devbridge_dtype dtype);
/* Bytes per element, 0 for no dtype. */
uint32_t devbridge_dtype_size(devbridge_dtype dtype);

typedef int32_t devbridge_shape_kind;
#define DEVBRIDGE_SHAPE_SCALAR 0
#define DEVBRIDGE_SHAPE_VECTOR 1
#define DEVBRIDGE_SHAPE_MATRIX 2
#define DEVBRIDGE_SHAPE_TENSOR 3

typedef int32_t devbridge_copy_direction;
#define DEVBRIDGE_HOST_TO_DEVICE 0
#define DEVBRIDGE_DEVICE_TO_HOST 1

typedef int32_t devbridge_copy_mode;
#define DEVBRIDGE_COPY_SYNC 0
#define DEVBRIDGE_COPY_ASYNC 1

typedef int32_t devbridge_host_kind;
#define DEVBRIDGE_HOST_RING 0   /* the copy's host side is a ring range */
#define DEVBRIDGE_HOST_REGION 1 /* ... a range of a registered region */

typedef int32_t devbridge_copy_state;
#define DEVBRIDGE_COPY_PENDING 0
#define DEVBRIDGE_COPY_COMPLETED 1
#define DEVBRIDGE_COPY_FAILED 2

typedef int32_t devbridge_writes_under_view;
#define DEVBRIDGE_WRITES_UNDER_VIEW_REFUSE 0 /* ALLOCATION_STILL_IN_USE (the default) */
#define DEVBRIDGE_WRITES_UNDER_VIEW_WAIT 1   /* wait for the views to end */
#define DEVBRIDGE_WRITES_UNDER_VIEW_ALLOW 2  /* copy anyway */

typedef int32_t devbridge_caching_pool;
#define DEVBRIDGE_CACHING_POOL_BACKEND_DEFAULT 0
#define DEVBRIDGE_CACHING_POOL_ON 1
#define DEVBRIDGE_CACHING_POOL_OFF 2

typedef int32_t devbridge_view_wait;
#define DEVBRIDGE_VIEW_REFUSE_IN_FLIGHT 0 /* ALLOCATION_STILL_IN_USE while a copy into it is in flight */
#define DEVBRIDGE_VIEW_WAIT_IN_FLIGHT 1   /* wait for those copies first */

typedef int32_t devbridge_device_kind;
#define DEVBRIDGE_DEVICE_CPU 0
#define DEVBRIDGE_DEVICE_CUDA 1
#define DEVBRIDGE_DEVICE_OPENCL 2

#define DEVBRIDGE_WAIT_FOREVER INT64_MAX

/* ---- opening a bridge -------------------------------------------------------- */

typedef struct devbridge_bridge devbridge_bridge; /* opaque */

/* One backend option as text (docs/BACKENDS.md lists each backend's). */
typedef struct devbridge_backend_option {
  const char* key;
  const char* value;
} devbridge_backend_option;

typedef struct devbridge_open_options {
  uint64_t size;                   /* sizeof(devbridge_open_options) */
  const char* backend;             /* "fake", "host", "cuda", "opencl", "auto"; NULL: "auto" */
  const char* device;              /* a device_id (devbridge_device_at); NULL: the backend's first */
  const devbridge_backend_option* backend_options; /* may be NULL when the count is 0 */
  uint64_t backend_option_count;
  uint64_t generation;             /* 0: 1 */
  uint64_t ring_bytes;             /* 0: 64 MiB */
  uint64_t inflight_budget_bytes;  /* async bytes admitted at once; 0: the ring's size */
  uint64_t failed_record_limit;    /* failed copies remembered; 0: 1024; at most UINT32_MAX */
  uint64_t pool_cap_bytes;         /* bytes of free segments the pool keeps; 0: the backend's default */
  int64_t writes_under_view_timeout_ns; /* for WRITES_UNDER_VIEW_WAIT; 0: forever */
  int64_t close_fence_timeout_ns;  /* how long close waits for consumers' fences; 0: 10 s */
  devbridge_writes_under_view writes_under_view;
  devbridge_caching_pool caching_pool;
} devbridge_open_options;

/* Opens a backend on a device and a bridge over it. UNAVAILABLE for a
 * backend or device that cannot run here (the message says why and what to
 * install), UNSUPPORTED for an option the backend does not take. */
devbridge_status devbridge_open(const devbridge_open_options* options, devbridge_bridge** out_bridge);
/* Fails every blocked and later call with CLOSED, quiesces the device and
 * frees everything (memory under live views when they end). May be retried
 * if it fails. The object stays valid until devbridge_destroy. */
devbridge_status devbridge_close(devbridge_bridge* bridge);
/* Closes (if not yet) and frees the bridge object; NULL is ignored. Views
 * and DLPack exports still live keep what they read alive until they end. */
void devbridge_destroy(devbridge_bridge* bridge);
/* Frees every old-generation allocation, retires its events, steps and
 * regions, and moves to `generation` (greater than the current one, else
 * OLD_GENERATION_HANDLE). Clears BROKEN. */
devbridge_status devbridge_restart(devbridge_bridge* bridge, uint64_t generation);
devbridge_status devbridge_generation(devbridge_bridge* bridge, uint64_t* out_generation);
devbridge_status devbridge_domain(devbridge_bridge* bridge, uint64_t* out_domain);

/* ---- devices ------------------------------------------------------------------ */

typedef struct devbridge_device_info {
  uint64_t size; /* sizeof(devbridge_device_info) */
  /* NUL-terminated, cut short (still terminated) when longer. */
  char backend[32];      /* "host", "fake", "cuda", ... */
  char vendor[64];
  char device_id[64];    /* what devbridge_open_options.device takes */
  char device_name[256];
  char pci_bus_id[32];   /* "" where the driver reports none */
  char tinygrad_device[32]; /* "CPU", "CUDA:0", "CL", ... */
  devbridge_device_kind device_kind;
  int32_t device_ordinal;
  int32_t dlpack_device_type; /* a DLDeviceType */
  int32_t host_addressable;   /* device memory is host memory the CPU reads at a view's address */
  uint64_t total_memory; /* bytes, 0 where unknown */
  uint64_t free_memory;
  uint64_t held_dtypes;    /* bit d set: the device holds dtype d (DEVBRIDGE_DTYPE_*) */
  uint64_t compute_dtypes; /* bit d set: kernels on it compute in dtype d */
} devbridge_device_info;

/* The bridge's device. */
devbridge_status devbridge_backend_info(devbridge_bridge* bridge, devbridge_device_info* out_info);
/* How many devices `backend` can bind here ("auto": the backend devbridge_open
 * would pick for "auto"; 0 when it cannot run here;
 * UNAVAILABLE for a name this build does not know). */
devbridge_status devbridge_device_count(const char* backend, uint64_t* out_count);
/* The index'th of them (INVALID_RANGE past the count). */
devbridge_status devbridge_device_at(const char* backend, uint64_t index, devbridge_device_info* out_info);

/* ---- allocation ------------------------------------------------------------------ */

typedef struct devbridge_object_spec {
  uint64_t size;        /* sizeof(devbridge_object_spec) */
  uint64_t max_extent;
  uint64_t alignment;
  devbridge_dtype dtype; /* DEVBRIDGE_DTYPE_BYTES for untyped bytes */
  devbridge_shape_kind shape;
} devbridge_object_spec;

devbridge_status devbridge_alloc_device(devbridge_bridge* bridge, const devbridge_object_spec* spec,
                                        uint64_t extent, devbridge_handle* out_handle);
/* Frees now, or ALLOCATION_STILL_IN_USE (a copy, step, view or fence uses
 * it) changing nothing. */
devbridge_status devbridge_free_device(devbridge_bridge* bridge, devbridge_handle handle);
/* Deferred free: the handle is dead at once; the memory goes back once its
 * last copy, step, view and fence are done. */
devbridge_status devbridge_release_device(devbridge_bridge* bridge, devbridge_handle handle);
devbridge_status devbridge_extent(devbridge_bridge* bridge, devbridge_handle handle, uint64_t* out_extent);

/* ---- host ring ---------------------------------------------------------------------- */

/* A range of `bytes` aligned to `alignment` (a power of two up to 4096; 0:
 * 64, a cache line). BACKPRESSURE when the ring has no room after `timeout_ns`. */
devbridge_status devbridge_reserve_host(devbridge_bridge* bridge, uint64_t bytes, uint64_t alignment,
                                        int64_t timeout_ns, devbridge_host_range* out_range);
/* Ends a reservation (exactly as reserved). ALLOCATION_STILL_IN_USE while an
 * async copy uses it. */
devbridge_status devbridge_release_host(devbridge_bridge* bridge, devbridge_host_range range);
/* Ends it once `event` allows (nothing to poll). */
devbridge_status devbridge_release_host_after(devbridge_bridge* bridge, devbridge_host_range range,
                                              devbridge_event event);
/* Waits until a range given to release_host_after goes back: *out_released 1,
 * or 0 when none waits or the timeout passed first. */
devbridge_status devbridge_wait_for_release_after(devbridge_bridge* bridge, int64_t timeout_ns,
                                                  int32_t* out_released);
/* The address of a reserved range's bytes; valid until the bridge closes. */
devbridge_status devbridge_host_bytes(devbridge_bridge* bridge, devbridge_host_range range, uint8_t** out_data);

/* ---- registered host memory ---------------------------------------------------------- */

/* Called once the bridge has let go of a region's memory for good; runs on
 * whichever thread made it let go, under the bridge's lock: it must be quick
 * and must not call into devbridge. */
typedef void (*devbridge_region_released_fn)(void* user_data);

typedef struct devbridge_host_registration {
  uint64_t size;   /* sizeof(devbridge_host_registration) */
  void* data;      /* the caller's memory: alive and unmoved until released */
  uint64_t len;
  int32_t read_only; /* nonzero: uploads only (a download into it is INVALID_RANGE) */
  int32_t reserved;  /* must be 0 */
  devbridge_region_released_fn on_release; /* may be NULL */
  void* user_data;
} devbridge_host_registration;

devbridge_status devbridge_register_host(devbridge_bridge* bridge, const devbridge_host_registration* registration,
                                         devbridge_region* out_region);
devbridge_status devbridge_unregister_host(devbridge_bridge* bridge, devbridge_region region);
/* *out_retained 1 while the bridge still holds the region's memory. */
devbridge_status devbridge_region_retained(devbridge_bridge* bridge, devbridge_region region, int32_t* out_retained);
/* A read-only region's bytes used in place as an allocation (host-addressable
 * devices and the fake; UNSUPPORTED elsewhere). */
devbridge_status devbridge_adopt_host(devbridge_bridge* bridge, devbridge_region_range range,
                                      const devbridge_object_spec* spec, devbridge_handle* out_handle);

/* ---- copies ------------------------------------------------------------------------------- */

/* A pitched 2-D copy: `rows` rows of `row_bytes`, row i at i * host_pitch on
 * the host side and i * device_pitch on the device side. rows 0: none (one
 * contiguous run). */
typedef struct devbridge_layout {
  uint64_t rows;
  uint64_t row_bytes;
  uint64_t host_pitch;
  uint64_t device_pitch;
} devbridge_layout;

typedef struct devbridge_copy_request {
  uint64_t size; /* sizeof(devbridge_copy_request) */
  devbridge_copy_direction direction;
  devbridge_copy_mode mode;
  devbridge_host_kind host_kind;
  int32_t reserved;               /* must be 0 */
  devbridge_host_range ring;      /* when host_kind is DEVBRIDGE_HOST_RING */
  devbridge_region_range region;  /* when host_kind is DEVBRIDGE_HOST_REGION */
  devbridge_device_range device;
  devbridge_layout layout;        /* rows 0: no layout, the two ranges of equal length */
  int64_t wait_for_room_ns;       /* async: how long to wait for in-flight budget; 0: BACKPRESSURE at once */
} devbridge_copy_request;

/* Any copy between host memory and an allocation. A sync copy has finished
 * when it returns; an async one when its event says so. */
devbridge_status devbridge_copy(devbridge_bridge* bridge, const devbridge_copy_request* request,
                                devbridge_event* out_event);
/* The everyday copies: one contiguous run between a ring range and an
 * allocation, BACKPRESSURE at once when the in-flight budget is spent. */
devbridge_status devbridge_host_to_device(devbridge_bridge* bridge, devbridge_host_range host,
                                          devbridge_device_range device, devbridge_copy_mode mode,
                                          devbridge_event* out_event);
devbridge_status devbridge_device_to_host(devbridge_bridge* bridge, devbridge_device_range device,
                                          devbridge_host_range host, devbridge_copy_mode mode,
                                          devbridge_event* out_event);

/* ---- copy events ---------------------------------------------------------------------------- */

typedef struct devbridge_copy_outcome {
  uint64_t size; /* sizeof(devbridge_copy_outcome) */
  devbridge_copy_state state;
  devbridge_status error; /* the failure's kind when state is FAILED, else DEVBRIDGE_OK */
} devbridge_copy_outcome;

/* Blocks until the copy completes or fails, or `timeout_ns` passes (then
 * PENDING). A failure read here stays readable (copy_status keeps answering
 * FAILED) until the bridge's failure log evicts its record
 * (failed_record_limit). */
devbridge_status devbridge_wait(devbridge_bridge* bridge, devbridge_event event, int64_t timeout_ns,
                                devbridge_copy_outcome* out_outcome);
devbridge_status devbridge_copy_status(devbridge_bridge* bridge, devbridge_event event,
                                       devbridge_copy_outcome* out_outcome);
/* Applies every completion the backend has; *out_applied (may be NULL) how many. */
devbridge_status devbridge_poll(devbridge_bridge* bridge, uint64_t* out_applied);
/* The three queries answer the same fact, the copy completed, whatever its
 * direction: the bridge has one notion of completion. They are named for
 * the question a caller asks of an upload (may the host range go?) and of a
 * download (are the host bytes there?); an upload asked host_bytes_valid
 * answers as it would to safe_to_release_host.
 * 1 once an upload's host range may be released or reused. */
devbridge_status devbridge_safe_to_release_host(devbridge_bridge* bridge, devbridge_event event, int32_t* out_safe);
/* 1 once a download's host bytes are valid. */
devbridge_status devbridge_host_bytes_valid(devbridge_bridge* bridge, devbridge_event event, int32_t* out_valid);
/* 1 once the copy completed (either direction). A failed copy answers 0 to
 * all three queries; devbridge_wait / devbridge_copy_status say it failed. */
devbridge_status devbridge_copy_event_complete(devbridge_bridge* bridge, devbridge_event event,
                                               int32_t* out_complete);

/* ---- compute ------------------------------------------------------------------------------- */

devbridge_status devbridge_begin_step(devbridge_bridge* bridge, uint64_t step, const devbridge_handle* handles,
                                      uint64_t handle_count);
devbridge_status devbridge_end_step(devbridge_bridge* bridge, uint64_t step);
/* Ends the step once the work enqueued so far on a consumer's queue (a
 * CUstream, a cl_command_queue) has finished. */
devbridge_status devbridge_end_step_after(devbridge_bridge* bridge, uint64_t step, uintptr_t consumer_queue);
/* y = a*x + b over float32 ranges of equal length, in order with copies. */
devbridge_status devbridge_launch_axpy(devbridge_bridge* bridge, devbridge_device_range x, devbridge_device_range y,
                                       float a, float b);

/* ---- views ---------------------------------------------------------------------------------- */

typedef struct devbridge_view_spec {
  uint64_t size; /* sizeof(devbridge_view_spec) */
  devbridge_dtype dtype;
  int32_t ndim;           /* 0 to 8 */
  const int64_t* shape;   /* ndim sizes; may be NULL when ndim is 0 */
  const int64_t* strides; /* ndim strides in elements; NULL: row-major contiguous */
  uint64_t byte_offset;
  devbridge_view_wait wait;
  int32_t reserved;       /* must be 0 */
} devbridge_view_spec;

struct devbridge_view_lease; /* opaque */

/* A zero-copy view: a DLTensor over the allocation and the lease that keeps
 * it allocated. dl_tensor.data points at the first element (byte_offset 0),
 * except on OpenCL, where data is the cl_mem and byte_offset the offset.
 * Every pointer in it stays valid until devbridge_view_end. */
typedef struct devbridge_view {
  uint64_t size; /* sizeof(devbridge_view) */
  DLTensor dl_tensor;
  devbridge_handle handle;
  devbridge_dtype dtype;
  int32_t read_only;           /* adopted read-only memory: do not write through it */
  const char* tinygrad_device; /* "CPU", "CUDA:0", "CL", ... */
  struct devbridge_view_lease* lease; /* NULL once ended */
} devbridge_view;

devbridge_status devbridge_view_open(devbridge_bridge* bridge, devbridge_handle handle,
                                     const devbridge_view_spec* spec, devbridge_view* out_view);
/* Ends the lease now; the view's pointers die. A view already ended is OK. */
devbridge_status devbridge_view_end(devbridge_view* view);
/* Ends the lease once the work enqueued so far on `consumer_queue` has
 * finished (UNSUPPORTED where the backend's consumers have no queues; the
 * view then stays live). */
devbridge_status devbridge_view_end_after(devbridge_view* view, uintptr_t consumer_queue);

/* DLPack 1.0's DLManagedTensorVersioned, exactly (the installed dlpack.h may
 * predate it, so it is spelled out here with the same layout). */
#define DEVBRIDGE_DLPACK_FLAG_READ_ONLY ((uint64_t)1)
#if defined(DLPACK_MAJOR_VERSION) && DLPACK_MAJOR_VERSION >= 1
typedef DLManagedTensorVersioned devbridge_dlpack_tensor;
#else
typedef struct devbridge_dlpack_version {
  uint32_t major;
  uint32_t minor;
} devbridge_dlpack_version;
typedef struct devbridge_dlpack_tensor {
  devbridge_dlpack_version version;
  void* manager_ctx;
  void (*deleter)(struct devbridge_dlpack_tensor* self);
  uint64_t flags;
  DLTensor dl_tensor;
} devbridge_dlpack_tensor;
#endif

/* A view handed on as a DLPack 1.0 managed tensor that owns its own lease:
 * whoever ends up holding it calls (*out_tensor)->deleter(*out_tensor) once
 * (from any thread, even after devbridge_destroy). */
devbridge_status devbridge_export_dlpack(devbridge_bridge* bridge, devbridge_handle handle,
                                         const devbridge_view_spec* spec, devbridge_dlpack_tensor** out_tensor);

/* ---- statistics ---------------------------------------------------------------------------- */

/* The bridge's counters (include/devbridge/bridge.hpp BridgeStats says what
 * each counts); booleans are 0 or 1. */
typedef struct devbridge_stats {
  uint64_t size; /* sizeof(devbridge_stats) */
  uint64_t generation;
  uint64_t domain;
  uint64_t broken;
  uint64_t closed;
  uint64_t live_allocations;
  uint64_t allocated_bytes;
  uint64_t copies_submitted;
  uint64_t copies_completed;
  uint64_t copies_failed;
  uint64_t copies_in_flight;
  uint64_t inflight_bytes;
  uint64_t inflight_budget_bytes;
  uint64_t copy_records;
  uint64_t failed_records;
  uint64_t failed_records_evicted;
  uint64_t stale_completions;
  uint64_t live_views;
  uint64_t orphaned_allocations;
  uint64_t pending_fences;
  uint64_t abandoned_fences;
  uint64_t active_steps;
  uint64_t restarts;
  uint64_t host_regions;
  uint64_t host_region_bytes;
  uint64_t adopted_allocations;
  uint64_t adopted_bytes;
  uint64_t ring_capacity;
  uint64_t ring_used;
  uint64_t ring_reservations;
  uint64_t ring_releases_pending;
  uint64_t ring_wraps;
} devbridge_stats;

/* Device memory as the bridge sees it (bridge.hpp MemoryStats). */
typedef struct devbridge_memory_stats {
  uint64_t size; /* sizeof(devbridge_memory_stats) */
  uint64_t pool_enabled;
  uint64_t pool_cap_bytes;
  uint64_t allocated_bytes;
  uint64_t peak_allocated_bytes;
  uint64_t total_allocated_bytes;
  uint64_t reserved_bytes;
  uint64_t peak_reserved_bytes;
  uint64_t total_reserved_bytes;
  uint64_t allocations;
  uint64_t total_allocations;
  uint64_t backend_allocations;
  uint64_t backend_frees;
  uint64_t segments;
  uint64_t free_segments;
  uint64_t pool_splits;
  uint64_t cached_bytes;
  uint64_t cached_blocks;
  uint64_t free_segment_bytes;
  uint64_t cache_hits;
  uint64_t cache_misses;
  uint64_t oom_retries;
  uint64_t oom_failures;
  uint64_t largest_request_bytes;
  uint64_t fragmentation_bytes;
} devbridge_memory_stats;

devbridge_status devbridge_get_stats(devbridge_bridge* bridge, devbridge_stats* out_stats);
devbridge_status devbridge_get_memory_stats(devbridge_bridge* bridge, devbridge_memory_stats* out_stats);
devbridge_status devbridge_reset_peak_memory(devbridge_bridge* bridge);
devbridge_status devbridge_empty_cache(devbridge_bridge* bridge);

/* ---- TEST ONLY -------------------------------------------------------------------------------
 * Controls behind the backend seam for test suites (include/devbridge/
 * test_controls.hpp). Production code never calls them. On a backend that
 * lacks the control: UNSUPPORTED. */

/* fake backend calls and failures (include/devbridge/backends/fake.hpp). */
typedef int32_t devbridge_fake_call;
#define DEVBRIDGE_FAKE_CALL_ALLOCATE 0
#define DEVBRIDGE_FAKE_CALL_FREE 1
#define DEVBRIDGE_FAKE_CALL_ALLOCATE_HOST 2
#define DEVBRIDGE_FAKE_CALL_FREE_HOST 3
#define DEVBRIDGE_FAKE_CALL_COPY_HOST_TO_DEVICE 4
#define DEVBRIDGE_FAKE_CALL_COPY_DEVICE_TO_HOST 5
#define DEVBRIDGE_FAKE_CALL_LAUNCH 6
#define DEVBRIDGE_FAKE_CALL_VALIDATE_VIEW 7
#define DEVBRIDGE_FAKE_CALL_QUIESCE 8
#define DEVBRIDGE_FAKE_CALL_REGISTER_HOST 9
#define DEVBRIDGE_FAKE_CALL_UNREGISTER_HOST 10

typedef int32_t devbridge_fake_failure;
#define DEVBRIDGE_FAKE_FAIL_ALLOCATION 0          /* the call throws ALLOCATION_FAILED */
#define DEVBRIDGE_FAKE_FAIL_COPY_AT_SUBMIT 1      /* DEVICE_COPY_FAILED / OUTPUT_COPY_FAILED at once */
#define DEVBRIDGE_FAKE_FAIL_COPY_AT_COMPLETION 2  /* the copy completes failed, bytes unmoved */
#define DEVBRIDGE_FAKE_FAIL_INVALID_VIEW 3
#define DEVBRIDGE_FAKE_FAIL_LOST_COMPLETION 4
#define DEVBRIDGE_FAKE_FAIL_DUPLICATED_COMPLETION 5
#define DEVBRIDGE_FAKE_FAIL_LATE_COMPLETION 6
#define DEVBRIDGE_FAKE_FAIL_FATAL 7               /* device lost: the bridge turns BROKEN */

/* Fails the nth (from 1) next call of kind `call` of the bridge's fake
 * backend, once. INVALID_RANGE for a failure that cannot apply to the call. */
devbridge_status devbridge_fake_inject(devbridge_bridge* bridge, devbridge_fake_call call,
                                       devbridge_fake_failure failure, int32_t nth);
/* Whether the fake completes async copies as they are submitted (it does
 * not by default: they stay pending until devbridge_fake_complete_all). */
devbridge_status devbridge_fake_set_auto_complete(devbridge_bridge* bridge, int32_t on);
/* Completes every pending copy (ok nonzero: successfully); *out_completed
 * (may be NULL) how many. */
devbridge_status devbridge_fake_complete_all(devbridge_bridge* bridge, int32_t ok, uint64_t* out_completed);
/* Any backend with test controls: device allocations its backend holds. */
devbridge_status devbridge_test_live_allocations(devbridge_bridge* bridge, uint64_t* out_count);
/* Holds asynchronous copies pending (fake and host). */
devbridge_status devbridge_test_hold_copies(devbridge_bridge* bridge, int32_t hold);

/* ---- portable tensors (docs/PORTABLE.md) -------------------------------------------- */

/* A tensor outside any bridge: row-major, little-endian bytes with a dtype and
 * a shape (Python's PortableTensor). A view describes one without owning it:
 * the caller's own bytes, or those of a library-owned devbridge_portable. */
typedef struct devbridge_portable_view {
  uint64_t size;          /* sizeof(devbridge_portable_view) */
  devbridge_dtype dtype;  /* a DEVBRIDGE_DTYPE_* (not BYTES) */
  uint32_t rank;          /* at most 8 */
  const int64_t* dims;    /* rank extents, none negative (NULL when rank is 0) */
  const void* data;       /* len bytes (NULL only when len is 0) */
  uint64_t len;           /* product of dims times the dtype's size */
} devbridge_portable_view;

typedef struct devbridge_portable devbridge_portable; /* opaque, library-owned */

/* Copies `rank` dims of `dtype`, row-major from byte `offset` of `handle`,
 * out of the bridge into a new portable tensor, through the ring in chunks
 * (so it may be larger than the ring). The bytes are read as `dtype`, which
 * need not be the allocation's (a float32 row as uint8 bytes). INVALID_RANGE
 * when it passes the allocation's extent, when `offset` is not a multiple of
 * `dtype`'s item size, or when the bytes read are not whole elements of a
 * typed allocation's own dtype (as any copy out of it: a float32 allocation
 * is read 4 bytes at a time); UNSUPPORTED_DTYPE for a dtype the device does
 * not hold. */
devbridge_status devbridge_export_tensor(devbridge_bridge* bridge, devbridge_handle handle, devbridge_dtype dtype,
                                         const int64_t* dims, uint32_t rank, uint64_t offset,
                                         devbridge_portable** out_tensor);
/* Describes `tensor`; the pointers live until devbridge_portable_free. */
devbridge_status devbridge_portable_describe(const devbridge_portable* tensor, devbridge_portable_view* out_view);
/* Frees a portable tensor (NULL is fine). */
void devbridge_portable_free(devbridge_portable* tensor);
/* Allocates in the bridge's current generation and copies `tensor` in
 * through the ring in chunks. `spec` NULL: a tensor spec of the dtype,
 * alignment 256, max_extent the byte size rounded up to it; a given spec's
 * dtype must be the tensor's or BYTES (else UNSUPPORTED_DTYPE) and its
 * max_extent hold the rounded size (else INVALID_EXTENT). An empty tensor is
 * INVALID_EXTENT (no allocation is empty). On failure nothing stays allocated. */
devbridge_status devbridge_import_tensor(devbridge_bridge* bridge, const devbridge_portable_view* tensor,
                                         const devbridge_object_spec* spec, devbridge_handle* out_handle);

/* ---- checkpoints (docs/PORTABLE.md) ------------------------------------------------ */

/* The format Python's devbridge.checkpoint writes and devbridge.restore reads:
 * a safetensors file whose __metadata__ holds the format, its version, the
 * generation, each tensor's dtype and the CRC-32 (zlib's) of the data section.
 * A file the checkpoint cannot take (corrupt, truncated, a checksum that
 * differs, a name twice) is INVALID_RANGE; one the system refuses to open,
 * read or write is UNAVAILABLE; both messages name the file and the tensor. */
typedef struct devbridge_checkpoint_entry {
  const char* name;        /* UTF-8, unique and not "__metadata__" ("" is a name) */
  devbridge_handle handle; /* the tensor's bytes are its first ones */
  devbridge_dtype dtype;
  uint32_t rank;           /* at most 8 */
  const int64_t* dims;
} devbridge_checkpoint_entry;

/* Writes `count` entries of the bridge to `path`, streamed through the ring
 * chunk by chunk into a temporary file beside it that is fsynced, renamed
 * over `path` and its directory fsynced: a crash leaves the old file or the
 * new one. `generation` is the one recorded (0: the bridge's current one). */
devbridge_status devbridge_checkpoint(devbridge_bridge* bridge, const char* path,
                                      const devbridge_checkpoint_entry* entries, uint64_t count,
                                      uint64_t generation);

typedef struct devbridge_restored_tensor {
  const char* name;
  devbridge_handle handle; /* a new allocation of the bridge, the caller's to free */
  devbridge_dtype dtype;
  uint32_t rank;
  const int64_t* dims;
} devbridge_restored_tensor;

typedef struct devbridge_restored {
  uint64_t count;
  const devbridge_restored_tensor* tensors; /* in the file's order */
  uint64_t generation;                      /* recorded in the file (0: none: not a devbridge file, or not a decimal below 2^64) */
} devbridge_restored;

/* Restores every tensor of the safetensors file at `path` (devbridge's, with
 * its checksum verified, or any other) into new allocations of the bridge's
 * current generation. On failure nothing stays allocated. */
devbridge_status devbridge_restore(devbridge_bridge* bridge, const char* path, devbridge_restored** out_restored);

/* Which tensors devbridge_restore_selected restores, as Python's restore
 * (names=, prefix=, verify=). Zero-initialize it, set size, then what applies. */
typedef struct devbridge_restore_options {
  uint64_t size;             /* sizeof(devbridge_restore_options) */
  const char* const* names;  /* name_count tensor names, each of which must be in the file (else INVALID_RANGE) */
  uint64_t name_count;       /* 0: no name filter */
  const char* prefix;        /* NULL or "": no prefix filter; both filters apply when both are given */
  int32_t skip_checksum;     /* 0: a devbridge file's CRC-32 is checked, so every tensor must be chosen (the
                              * checksum covers the whole data section: a partial restore of a file that
                              * records one is INVALID_RANGE); nonzero: not checked */
  int32_t reserved;          /* must be 0 */
} devbridge_restore_options;

/* devbridge_restore of the tensors `options` chooses, reading only their
 * bytes, in the file's order; NULL options: every tensor, checked (as
 * devbridge_restore). Choosing none is fine (an empty result). */
devbridge_status devbridge_restore_selected(devbridge_bridge* bridge, const char* path,
                                            const devbridge_restore_options* options,
                                            devbridge_restored** out_restored);
/* Frees the description (NULL is fine); the allocations stay the caller's. */
void devbridge_restored_free(devbridge_restored* restored);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DEVBRIDGE_C_DEVBRIDGE_H */
