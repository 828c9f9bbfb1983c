// The CUDA backend. The driver API is loaded at run time (dlopen of
// libcuda.so.1, or the file named by $DEVBRIDGE_LIBCUDA), so a build with this
// backend runs on machines without a GPU or driver; there probe() says why
// CUDA is unavailable. docs/CUDA.md describes contexts, streams and ordering.
//
// Fences are CUevents recorded on a stream: the upload, download or compute
// stream, or a consumer's (QueueRef::consumer: a CUstream of the backend's
// context; 1 the legacy default stream, 2 the per-thread one; 0 is refused
// as ambiguous). A fence in a context that faulted for good (an illegal
// address, a failed launch, ...) counts as passed: nothing there runs any
// more. If a launch's fence cannot be recorded, the backend waits for the
// kernel to finish and throws.
//
// This header exists in every build; the functions are defined only when the
// library was built with the backend (DEVBRIDGE_HAS_CUDA is then defined for
// every user of the devbridge target).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "devbridge/backend.hpp"

namespace devbridge::cuda {

struct Probe {
  bool available = false;
  std::string reason;  // e.g. "no driver (libcuda.so.1: cannot open shared object file)"
  std::string remedy;  // what to install or set, e.g. "install the NVIDIA driver (it provides libcuda.so.1) ..."
  int device_count = 0;
};

Probe probe();

struct Options {
  int ordinal = 0;
  // A CUcontext the caller owns (e.g. tinygrad's); null means the device's
  // primary context. Pointers handed out are valid in that context. The
  // caller keeps the context alive for the backend's whole life; `ordinal`
  // is then ignored (the context's device is used).
  void* context = nullptr;
};

// Throws Error(Unavailable) with the probe's reason.
std::unique_ptr<Backend> make_cuda_backend(const Options& options = {});
// From text (the registry's form): device (the ordinal), context (a CUcontext
// as an integer).
std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options);
// Every device's id (its ordinal), for list_devices.
std::vector<std::string> device_ids();

// ---- hooks for bindings (DLPack, tinygrad) ---------------------------------
// The seam stays vendor-neutral; these reach the CUDA backend behind it
// (e.g. through Bridge::backend()).

// True when `backend` is a CUDA backend.
bool is_cuda_backend(const Backend& backend) noexcept;

// The CUcontext the backend's allocations live in. Throws Unsupported for a
// backend that is not CUDA.
void* context_of(const Backend& backend);

// Test controls (Backend::test_controls, devbridge/test_controls.hpp):
// live_allocations, live_registrations, and hold_copies: while held,
// asynchronous copies and launches submitted to the backend do not run (a
// host function blocks both copy streams and the compute stream), so copies
// do not complete and fences on the backend's own streams do not pass.
// quiesce() (and so Bridge::restart and close) lifts the hold and finishes
// the work. A sync copy that must order after held work waits until the
// hold is lifted.

// Makes `stream` (a CUstream of the backend's context; 1 and 2 name the
// legacy and per-thread default streams, exactly as DLPack's `stream`
// argument does) wait, on the device, for every copy and compute step
// submitted to the backend so far. The host does not wait. This is what
// `__dlpack__(stream=s)` needs. Throws Unsupported for a backend that is not
// CUDA.
void order_stream_after_submitted_work(Backend& backend, std::uintptr_t stream);

}  // namespace devbridge::cuda
