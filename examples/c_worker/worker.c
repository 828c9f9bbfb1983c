/* The smallest C worker, built against an installed devbridge through
 * pkg-config (scripts/check-install.sh): bytes to the host backend and back. */
#include <devbridge/c/devbridge.h>

#include <stdio.h>
#include <string.h>

static int failed(devbridge_status status, const char* call) {
  if (status == DEVBRIDGE_OK) return 0;
  fprintf(stderr, "%s: %s: %s\n", call, devbridge_status_name(status), devbridge_last_error_message());
  return 1;
}

int main(void) {
  enum { kBytes = 4096 };
  devbridge_open_options options = {0};
  options.size = sizeof options;
  options.backend = "host";
  devbridge_bridge* bridge = NULL;
  if (failed(devbridge_open(&options, &bridge), "devbridge_open")) return 1;

  devbridge_object_spec spec = {0};
  spec.size = sizeof spec;
  spec.max_extent = kBytes;
  spec.alignment = 64;
  spec.dtype = DEVBRIDGE_DTYPE_BYTES;
  devbridge_handle handle;
  devbridge_host_range up, down;
  uint8_t* up_bytes = NULL;
  uint8_t* down_bytes = NULL;
  devbridge_event event;
  int bad = failed(devbridge_alloc_device(bridge, &spec, kBytes, &handle), "devbridge_alloc_device") ||
            failed(devbridge_reserve_host(bridge, kBytes, 0, 0, &up), "devbridge_reserve_host") ||
            failed(devbridge_reserve_host(bridge, kBytes, 0, 0, &down), "devbridge_reserve_host") ||
            failed(devbridge_host_bytes(bridge, up, &up_bytes), "devbridge_host_bytes") ||
            failed(devbridge_host_bytes(bridge, down, &down_bytes), "devbridge_host_bytes");
  if (!bad) {
    for (int i = 0; i < kBytes; ++i) up_bytes[i] = (uint8_t)(i * 7);
    devbridge_device_range whole = {handle, 0, kBytes};
    bad = failed(devbridge_host_to_device(bridge, up, whole, DEVBRIDGE_COPY_SYNC, &event), "host_to_device") ||
          failed(devbridge_device_to_host(bridge, whole, down, DEVBRIDGE_COPY_SYNC, &event), "device_to_host");
  }
  if (!bad && memcmp(up_bytes, down_bytes, kBytes) != 0) {
    fprintf(stderr, "the bytes that came back differ\n");
    bad = 1;
  }
  bad |= failed(devbridge_close(bridge), "devbridge_close");
  devbridge_destroy(bridge);
  if (!bad) printf("c worker: %d bytes to the host backend and back, exact (ABI %u)\n", kBytes, devbridge_abi_version());
  return bad;
}
