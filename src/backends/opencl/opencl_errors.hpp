// How the OpenCL backend turns a cl_int into the contract's vocabulary.
// Pure functions over the numeric code (cl.h's values, which never change
// meaning), so the whole table is unit-tested without a device.
#pragma once

#include <string>
#include <string_view>

#include "backends/vendor_errors.hpp"
#include "devbridge/error.hpp"

namespace devbridge::opencl::detail {

using backends::Operation;
using backends::ResultClass;

// cl.h's name for a code ("CL_MEM_OBJECT_ALLOCATION_FAILURE"), or
// "cl_int <n>" for one this build does not know (a vendor extension's).
std::string error_name(int code);

// The kind a failure maps to when it happens during `operation`. A command
// that ends with a negative execution status (the event of an async copy)
// is classified with the status as its code.
ResultClass classify(int code, Operation operation) noexcept;

// "<call>: <NAME> (<code>)" plus `detail`, as an Error of classify()'s kind.
Error make_error(int code, std::string_view call, Operation operation, std::string_view detail = {});

// Throws make_error(...) unless code is CL_SUCCESS (0).
inline void check(int code, std::string_view call, Operation operation) {
  if (code != 0) throw make_error(code, call, operation);
}

}  // namespace devbridge::opencl::detail
