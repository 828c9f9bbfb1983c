// The CUresult table: names from the declared results (so a code's name and
// number are written once, in cuda_driver_api.hpp), and which of them are
// sticky.
#include "backends/cuda/cuda_errors.hpp"

#include <algorithm>
#include <array>

#include "backends/cuda/cuda_driver_api.hpp"

namespace devbridge::cuda::detail {
namespace {

using backends::operation_kind;

struct KnownResult {
  int code;
  std::string_view name;
};

constexpr std::array kKnownResults{
#define DEVBRIDGE_CUDA_KNOWN_RESULT(name, value) KnownResult{name, #name},
    DEVBRIDGE_CUDA_RESULTS(DEVBRIDGE_CUDA_KNOWN_RESULT)
#undef DEVBRIDGE_CUDA_KNOWN_RESULT
};

// Sticky errors are those the CUDA documentation says leave the process in
// an inconsistent state, with every later call in the context returning the
// same error; the only cure is a new process (or destroying the context).
constexpr std::array kStickyResults{
    CUDA_ERROR_DEINITIALIZED,
    CUDA_ERROR_ECC_UNCORRECTABLE,
    CUDA_ERROR_NVLINK_UNCORRECTABLE,
    CUDA_ERROR_CONTAINED,
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_LAUNCH_TIMEOUT,
    CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING,
    CUDA_ERROR_CONTEXT_IS_DESTROYED,
    CUDA_ERROR_ASSERT,
    CUDA_ERROR_HARDWARE_STACK_ERROR,
    CUDA_ERROR_ILLEGAL_INSTRUCTION,
    CUDA_ERROR_MISALIGNED_ADDRESS,
    CUDA_ERROR_INVALID_ADDRESS_SPACE,
    CUDA_ERROR_INVALID_PC,
    CUDA_ERROR_LAUNCH_FAILED,
    CUDA_ERROR_TENSOR_MEMORY_LEAK,
    CUDA_ERROR_EXTERNAL_DEVICE,
    CUDA_ERROR_UNKNOWN,
};

const KnownResult* find_known(int code) noexcept {
  for (const auto& known : kKnownResults) {
    if (known.code == code) return &known;
  }
  return nullptr;
}

}  // namespace

std::string result_name(int code) {
  if (const KnownResult* known = find_known(code)) return std::string(known->name);
  return "CUresult " + std::to_string(code);
}

bool is_sticky(int code) noexcept {
  return std::find(kStickyResults.begin(), kStickyResults.end(), code) != kStickyResults.end();
}

ResultClass classify(int code, Operation operation) noexcept {
  if (code == CUDA_SUCCESS || code == CUDA_ERROR_NOT_READY) return {ErrorKind::Broken, false};
  // A sticky error keeps the operation's kind (a failed upload is still a
  // DeviceCopyFailed for the copy that saw it) and marks the device gone.
  if (is_sticky(code)) {
    ErrorKind kind = operation_kind(operation);
    if (operation == Operation::Setup || operation == Operation::Query || operation == Operation::Launch)
      kind = ErrorKind::Broken;
    return {kind, true};
  }
  switch (code) {
    // The driver or device is not there (or not for us): nothing about this
    // call could succeed, whatever it was.
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_STUB_LIBRARY:
    case CUDA_ERROR_DEVICE_UNAVAILABLE:
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_DEVICE_NOT_LICENSED:
    case CUDA_ERROR_SYSTEM_NOT_READY:
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
    case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
    case CUDA_ERROR_MPS_CONNECTION_FAILED:
      return {ErrorKind::Unavailable, false};
    // The device cannot run what this build carries, or the driver refuses
    // an operation it does not support.
    case CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER:
    case CUDA_ERROR_INVALID_IMAGE:
    case CUDA_ERROR_NO_BINARY_FOR_GPU:
    case CUDA_ERROR_INVALID_PTX:
    case CUDA_ERROR_JIT_COMPILER_NOT_FOUND:
    case CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
    case CUDA_ERROR_JIT_COMPILATION_DISABLED:
    case CUDA_ERROR_NOT_SUPPORTED:
      return {ErrorKind::Unsupported, false};
    // Host memory registration: the caller named a range that is already
    // page-locked (overlapping another registration or a cuMemHostAlloc
    // block), or one that never was. The range is at fault, not the device.
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
      return {ErrorKind::InvalidRange, false};
    default:  // OUT_OF_MEMORY, INVALID_VALUE, ...: this operation failed, the device is fine
      return {operation_kind(operation), false};
  }
}

namespace {

// PTX ISA versions by CUDA release, from the PTX ISA release notes.
struct IsaRow {
  int driver;
  int isa;
};
constexpr std::array kIsaByDriver{
    IsaRow{11000, 70}, IsaRow{11010, 71}, IsaRow{11020, 72}, IsaRow{11030, 73}, IsaRow{11040, 74},
    IsaRow{11050, 75}, IsaRow{11060, 76}, IsaRow{11070, 77}, IsaRow{11080, 78}, IsaRow{12000, 80},
    IsaRow{12010, 81}, IsaRow{12020, 82}, IsaRow{12030, 83}, IsaRow{12040, 84}, IsaRow{12050, 85},
    IsaRow{12060, 85}, IsaRow{12070, 86}, IsaRow{12080, 87}, IsaRow{12090, 88}, IsaRow{13000, 90},
};

}  // namespace

int max_ptx_isa_for_driver(int driver_version) noexcept {
  int best = 0;
  for (const IsaRow& row : kIsaByDriver) {
    if (driver_version >= row.driver) best = row.isa;
  }
  return best;
}

int oldest_driver_for_ptx_isa(int isa) noexcept {
  for (const IsaRow& row : kIsaByDriver) {
    if (row.isa >= isa) return row.driver;
  }
  return 0;
}

}  // namespace devbridge::cuda::detail
