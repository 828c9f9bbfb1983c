// The OpenCL API, loaded at run time from the ICD loader (libOpenCL.so.1, or
// the file named by $DEVBRIDGE_LIBOPENCL), typed by the in-tree declarations
// of opencl_api_types.hpp: no OpenCL header is needed to build.
#pragma once

#include <string>

#include "backends/opencl/opencl_api_types.hpp"

namespace devbridge::opencl::abi {

// Braces: a value that does not fit its type fails the build.
#define DEVBRIDGE_OPENCL_DEFINE_CONSTANT(type, name, value) inline constexpr type name{value};
DEVBRIDGE_OPENCL_CONSTANTS(DEVBRIDGE_OPENCL_DEFINE_CONSTANT)
#undef DEVBRIDGE_OPENCL_DEFINE_CONSTANT

}  // namespace devbridge::opencl::abi

namespace devbridge::opencl::detail {

// The backend is written with cl.h's names, unqualified.
using namespace abi;

// One loaded copy of the ICD loader, never unloaded (see dynamic_library.hpp).
struct Api {
  std::string path;        // what was dlopen()ed
  std::string load_error;  // empty when every entry point was found
  bool opened = false;     // the library was there (load_error then names what it lacks)

#define DEVBRIDGE_OPENCL_DECLARE_ENTRY(symbol, result, parameters) PFN_##symbol symbol = nullptr;
  DEVBRIDGE_OPENCL_ENTRY_POINTS(DEVBRIDGE_OPENCL_DECLARE_ENTRY)
#undef DEVBRIDGE_OPENCL_DECLARE_ENTRY

  bool loaded() const noexcept { return load_error.empty(); }
};

// The process-wide API, loaded on first use; a failure is recorded in
// load_error, never thrown.
const Api& api();

}  // namespace devbridge::opencl::detail
