// How the CUDA backend turns a CUresult into the contract's vocabulary.
//
// Pure functions over the numeric code, kept apart from the driver so the
// whole table is unit-tested on machines without a GPU. The numbers are the
// driver ABI's (cuda_driver_api.hpp); they never change meaning between
// driver versions.
#pragma once

#include <string>
#include <string_view>

#include "backends/vendor_errors.hpp"
#include "devbridge/error.hpp"

namespace devbridge::cuda::detail {

// Shared with the other vendor backends (backends/vendor_errors.hpp).
using backends::Operation;
using backends::ResultClass;

// The driver's own name for a code ("CUDA_ERROR_OUT_OF_MEMORY"), or
// "CUresult <n>" for a code this build does not know.
std::string result_name(int code);

// True for the errors after which the context can do no more work:
// illegal address, launch failure, uncorrectable ECC/NVLink, ...
bool is_sticky(int code) noexcept;

// The kind a failure maps to when it happens during `operation`.
// CUDA_SUCCESS and CUDA_ERROR_NOT_READY are not failures; asking about them
// is a programming error and answers {Broken, false}.
ResultClass classify(int code, Operation operation) noexcept;

// "PTX ISA 9.0" of a driver: the newest PTX version a driver of that CUDA
// version (cuDriverGetVersion, e.g. 12040) JIT-compiles. 0 for unknown/older.
int max_ptx_isa_for_driver(int driver_version) noexcept;

// The oldest CUDA version (e.g. 11080) whose driver JIT-compiles PTX ISA
// `isa` (e.g. 78); 0 when no known driver does.
int oldest_driver_for_ptx_isa(int isa) noexcept;

}  // namespace devbridge::cuda::detail
