// The CUDA driver API, loaded at run time.
//
// The library is never linked against libcuda: it dlopen()s libcuda.so.1 (or
// the file named by DEVBRIDGE_LIBCUDA) and looks up exactly the entry points
// of DEVBRIDGE_CUDA_DRIVER_ENTRY_POINTS, declared in cuda_driver_api.hpp
// (no toolkit is needed to build).
#pragma once

#include "backends/cuda/cuda_driver_api.hpp"

#include <string>
#include <string_view>

#include "backends/cuda/cuda_errors.hpp"

namespace devbridge::cuda::detail {

// One loaded copy of the driver library. Never unloaded: other libraries in
// the process (torch, tinygrad) may share the same handle, and the driver
// does not support being unloaded while contexts exist.
struct Driver {
  std::string path;        // what was dlopen()ed
  std::string load_error;  // empty when every entry point was found
  bool opened = false;     // the library was there (load_error then names what it lacks)
  CUresult init_result = CUDA_ERROR_NOT_INITIALIZED;
  int driver_version = 0;  // cuDriverGetVersion, e.g. 13000

#define DEVBRIDGE_CUDA_DECLARE_ENTRY(symbol) PFN_##symbol symbol = nullptr;
  DEVBRIDGE_CUDA_DRIVER_ENTRY_POINTS(DEVBRIDGE_CUDA_DECLARE_ENTRY)
#undef DEVBRIDGE_CUDA_DECLARE_ENTRY

  bool loaded() const noexcept { return load_error.empty(); }
  bool usable() const noexcept { return loaded() && init_result == CUDA_SUCCESS; }

  // The driver's name for `result`, falling back to this build's table (a
  // stub library answers cuGetErrorName with an error of its own).
  std::string error_name(CUresult result) const;
  // "<call>: <NAME> (<driver's description>)".
  std::string describe_failure(std::string_view call, CUresult result) const;
};

// The library to load: $DEVBRIDGE_LIBCUDA when set, else "libcuda.so.1".
std::string driver_library_path();

// The process-wide driver for `path`, loaded (and cuInit'ed) on first use.
// Loading failures are recorded in the result, never thrown.
const Driver& load_driver(const std::string& path);
inline const Driver& driver() { return load_driver(driver_library_path()); }

// Throws Error(classify(result, operation)) naming `call` and the driver's
// error name, unless result is CUDA_SUCCESS.
void check(const Driver& driver, CUresult result, std::string_view call, Operation operation);

// The Error a failure maps to (for callers that want to add detail first).
Error make_error(const Driver& driver, CUresult result, std::string_view call, Operation operation,
                 std::string_view detail = {});

}  // namespace devbridge::cuda::detail
