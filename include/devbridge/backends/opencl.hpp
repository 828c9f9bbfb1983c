// The OpenCL backend: a second vendor behind the same seam. Device memory is
// cl_mem buffers, the ring a mapped CL_MEM_ALLOC_HOST_PTR buffer, copies and
// the compute role run on one in-order command queue, and async completions
// arrive through event callbacks. Runs on any OpenCL 1.2 device; CI runs it on
// PoCL (the CPU). docs/OPENCL.md describes devices, ordering and views.
//
// This header exists in every build; the functions are defined only when the
// library was built with the backend (DEVBRIDGE_HAS_OPENCL is then defined for
// every user of the devbridge target).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "devbridge/backend.hpp"

namespace devbridge::opencl {

struct Probe {
  bool available = false;
  std::string reason;         // why not, when !available
  std::string remedy;         // what to install or set so that it runs, when !available
  int device_count = 0;       // over every platform
  bool has_gpu = false;       // a GPU or accelerator device: "auto" prefers such a device to the host backend
  std::string chosen_device;  // what make_opencl_backend() would open, e.g. "pocl: cpu-haswell-AMD EPYC"
};

Probe probe();

struct Options {
  // Which device: indexes into clGetPlatformIDs and that platform's
  // clGetDeviceIDs(CL_DEVICE_TYPE_ALL). -1 (default) picks the first GPU or
  // accelerator of any platform, else the first device. $DEVBRIDGE_OPENCL_DEVICE
  // ("<platform>:<device>", e.g. "0:1") overrides the default.
  int platform = -1;
  int device = -1;
};

// Throws Error(Unavailable) when there is no such device.
std::unique_ptr<Backend> make_opencl_backend(const Options& options = {});
// From text (the registry's form): device ("<platform>:<device>").
std::unique_ptr<Backend> make_opencl_backend(const BackendOptions& options);
// Every device's id ("<platform>:<device>"), for list_devices.
std::vector<std::string> device_ids();

bool is_opencl_backend(const Backend& backend) noexcept;

// Test controls (Backend::test_controls, devbridge/test_controls.hpp):
// live_allocations (device buffers only); live_registrations (host memory
// under a CL_MEM_USE_HOST_PTR buffer, kept apart: a registration is the
// caller's memory); live_fences (fences handed out and not yet released: each
// holds a cl_event, so anything left after the bridge closed is a leak); and
// hold_copies: while held, asynchronous copies and launches submitted from
// now on wait on the device for a user event (their fences stay pending). The
// queue is in order: later commands (sync copies, markers) wait too.
// quiesce() (and so Bridge::restart and close) lifts the hold.

}  // namespace devbridge::opencl
