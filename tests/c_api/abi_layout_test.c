/* The sizes and a few offsets of ABI version 1's structs, checked at
 * compile time. A hand-written Rust declaration must match them; a change
 * here is an ABI break (a new major version), or, for a struct that grew at
 * its end, a new minor version with this table updated. The totals also
 * prove that no struct has hidden padding: each is the sum of its fields. */
#include <stddef.h>

#include "devbridge/c/devbridge.h"

_Static_assert(sizeof(devbridge_handle) == 24 && sizeof(devbridge_event) == 24 && sizeof(devbridge_region) == 24,
               "identity triples");
_Static_assert(sizeof(devbridge_host_range) == 16, "host range");
_Static_assert(sizeof(devbridge_region_range) == 40 && sizeof(devbridge_device_range) == 40, "ranges");
_Static_assert(sizeof(devbridge_backend_option) == 16, "backend option");
_Static_assert(sizeof(devbridge_open_options) == 104, "open options");
_Static_assert(offsetof(devbridge_open_options, writes_under_view) == 96, "open options enums last");
_Static_assert(sizeof(devbridge_object_spec) == 32, "object spec");
_Static_assert(sizeof(devbridge_host_registration) == 48, "host registration");
_Static_assert(sizeof(devbridge_layout) == 32, "layout");
_Static_assert(sizeof(devbridge_copy_request) == 160, "copy request");
_Static_assert(offsetof(devbridge_copy_request, ring) == 24, "copy request ring");
_Static_assert(offsetof(devbridge_copy_request, wait_for_room_ns) == 152, "copy request wait");
_Static_assert(sizeof(devbridge_copy_outcome) == 16, "copy outcome");
_Static_assert(sizeof(devbridge_view_spec) == 48, "view spec");
_Static_assert(sizeof(DLTensor) == 48, "DLPack's DLTensor");
_Static_assert(sizeof(devbridge_view) == 104, "view");
_Static_assert(offsetof(devbridge_view, dl_tensor) == 8, "view tensor");
_Static_assert(sizeof(devbridge_dlpack_tensor) == 80, "DLPack 1.0 DLManagedTensorVersioned");
_Static_assert(offsetof(devbridge_dlpack_tensor, dl_tensor) == 32, "DLPack 1.0 tensor offset");
_Static_assert(sizeof(devbridge_stats) == 32 * 8, "stats: size and 31 counters");
_Static_assert(sizeof(devbridge_memory_stats) == 25 * 8, "memory stats: size and 24 counters");
_Static_assert(sizeof(devbridge_device_info) == 536, "device info");
_Static_assert(offsetof(devbridge_device_info, device_kind) == 488, "device info numbers after the text");
_Static_assert(sizeof(devbridge_portable_view) == 40, "portable view");
_Static_assert(offsetof(devbridge_portable_view, dims) == 16, "portable view dims after dtype and rank");
_Static_assert(sizeof(devbridge_checkpoint_entry) == 48 && offsetof(devbridge_checkpoint_entry, dims) == 40,
               "checkpoint entry");
_Static_assert(sizeof(devbridge_restored_tensor) == 48, "restored tensor");
_Static_assert(sizeof(devbridge_restored) == 24, "restored");

int main(void) { return devbridge_abi_version() == DEVBRIDGE_ABI_VERSION ? 0 : 1; }
