// The CUresult table. Codes are written as numbers with the driver's names
// beside them, so this file needs no cuda.h and the mapping stays one table.
#include "backends/cuda/cuda_errors.hpp"

#include <array>

namespace devbridge::cuda::detail {
namespace {

using backends::operation_kind;

struct KnownResult {
  int code;
  std::string_view name;
  bool sticky;
};

// Sticky errors are those the CUDA documentation says leave the process in
// an inconsistent state, with every later call in the context returning the
// same error; the only cure is a new process (or destroying the context).
constexpr std::array kKnownResults{
    KnownResult{0, "CUDA_SUCCESS", false},
    KnownResult{1, "CUDA_ERROR_INVALID_VALUE", false},
    KnownResult{2, "CUDA_ERROR_OUT_OF_MEMORY", false},
    KnownResult{3, "CUDA_ERROR_NOT_INITIALIZED", false},
    KnownResult{4, "CUDA_ERROR_DEINITIALIZED", true},
    KnownResult{34, "CUDA_ERROR_STUB_LIBRARY", false},
    KnownResult{36, "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER", false},
    KnownResult{46, "CUDA_ERROR_DEVICE_UNAVAILABLE", false},
    KnownResult{100, "CUDA_ERROR_NO_DEVICE", false},
    KnownResult{101, "CUDA_ERROR_INVALID_DEVICE", false},
    KnownResult{102, "CUDA_ERROR_DEVICE_NOT_LICENSED", false},
    KnownResult{200, "CUDA_ERROR_INVALID_IMAGE", false},
    KnownResult{201, "CUDA_ERROR_INVALID_CONTEXT", false},
    KnownResult{209, "CUDA_ERROR_NO_BINARY_FOR_GPU", false},
    KnownResult{214, "CUDA_ERROR_ECC_UNCORRECTABLE", true},
    KnownResult{216, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE", false},
    KnownResult{218, "CUDA_ERROR_INVALID_PTX", false},
    KnownResult{220, "CUDA_ERROR_NVLINK_UNCORRECTABLE", true},
    KnownResult{221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND", false},
    KnownResult{222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", false},
    KnownResult{223, "CUDA_ERROR_JIT_COMPILATION_DISABLED", false},
    KnownResult{226, "CUDA_ERROR_CONTAINED", true},
    KnownResult{302, "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND", false},
    KnownResult{303, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED", false},
    KnownResult{304, "CUDA_ERROR_OPERATING_SYSTEM", false},
    KnownResult{400, "CUDA_ERROR_INVALID_HANDLE", false},
    KnownResult{401, "CUDA_ERROR_ILLEGAL_STATE", false},
    KnownResult{500, "CUDA_ERROR_NOT_FOUND", false},
    KnownResult{600, "CUDA_ERROR_NOT_READY", false},
    KnownResult{700, "CUDA_ERROR_ILLEGAL_ADDRESS", true},
    KnownResult{701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", false},
    KnownResult{702, "CUDA_ERROR_LAUNCH_TIMEOUT", true},
    KnownResult{703, "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING", true},
    KnownResult{709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", true},
    KnownResult{710, "CUDA_ERROR_ASSERT", true},
    KnownResult{712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", false},
    KnownResult{713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", false},
    KnownResult{714, "CUDA_ERROR_HARDWARE_STACK_ERROR", true},
    KnownResult{715, "CUDA_ERROR_ILLEGAL_INSTRUCTION", true},
    KnownResult{716, "CUDA_ERROR_MISALIGNED_ADDRESS", true},
    KnownResult{717, "CUDA_ERROR_INVALID_ADDRESS_SPACE", true},
    KnownResult{718, "CUDA_ERROR_INVALID_PC", true},
    KnownResult{719, "CUDA_ERROR_LAUNCH_FAILED", true},
    KnownResult{720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", false},
    KnownResult{721, "CUDA_ERROR_TENSOR_MEMORY_LEAK", true},
    KnownResult{800, "CUDA_ERROR_NOT_PERMITTED", false},
    KnownResult{801, "CUDA_ERROR_NOT_SUPPORTED", false},
    KnownResult{802, "CUDA_ERROR_SYSTEM_NOT_READY", false},
    KnownResult{803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", false},
    KnownResult{804, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", false},
    KnownResult{805, "CUDA_ERROR_MPS_CONNECTION_FAILED", false},
    KnownResult{909, "CUDA_ERROR_TIMEOUT", false},
    KnownResult{911, "CUDA_ERROR_EXTERNAL_DEVICE", true},
    KnownResult{999, "CUDA_ERROR_UNKNOWN", true},
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
  const KnownResult* known = find_known(code);
  return known != nullptr && known->sticky;
}

ResultClass classify(int code, Operation operation) noexcept {
  if (code == 0 || code == 600) return {ErrorKind::Broken, false};
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
    case 3:    // NOT_INITIALIZED
    case 34:   // STUB_LIBRARY
    case 46:   // DEVICE_UNAVAILABLE
    case 100:  // NO_DEVICE
    case 101:  // INVALID_DEVICE
    case 102:  // DEVICE_NOT_LICENSED
    case 802:  // SYSTEM_NOT_READY
    case 803:  // SYSTEM_DRIVER_MISMATCH
    case 804:  // COMPAT_NOT_SUPPORTED_ON_DEVICE
    case 805:  // MPS_CONNECTION_FAILED
      return {ErrorKind::Unavailable, false};
    // The device cannot run what this build carries, or the driver refuses
    // an operation it does not support.
    case 36:   // CALL_REQUIRES_NEWER_DRIVER
    case 200:  // INVALID_IMAGE
    case 209:  // NO_BINARY_FOR_GPU
    case 218:  // INVALID_PTX
    case 221:  // JIT_COMPILER_NOT_FOUND
    case 222:  // UNSUPPORTED_PTX_VERSION
    case 223:  // JIT_COMPILATION_DISABLED
    case 801:  // NOT_SUPPORTED
      return {ErrorKind::Unsupported, false};
    // Host memory registration: the caller named a range that is already
    // page-locked (overlapping another registration or a cuMemHostAlloc
    // block), or one that never was. The range is at fault, not the device.
    case 712:  // HOST_MEMORY_ALREADY_REGISTERED
    case 713:  // HOST_MEMORY_NOT_REGISTERED
      return {ErrorKind::InvalidRange, false};
    default:  // OUT_OF_MEMORY, INVALID_VALUE, ...: this operation failed, the device is fine
      return {operation_kind(operation), false};
  }
}

int max_ptx_isa_for_driver(int driver_version) noexcept {
  // PTX ISA versions by CUDA release, from the PTX ISA release notes.
  struct Row {
    int driver;
    int isa;
  };
  constexpr std::array kRows{
      Row{11000, 70}, Row{11010, 71}, Row{11020, 72}, Row{11030, 73}, Row{11040, 74},
      Row{11050, 75}, Row{11060, 76}, Row{11070, 77}, Row{11080, 78}, Row{12000, 80},
      Row{12010, 81}, Row{12020, 82}, Row{12030, 83}, Row{12040, 84}, Row{12050, 85},
      Row{12060, 85}, Row{12070, 86}, Row{12080, 87}, Row{12090, 88}, Row{13000, 90},
  };
  int best = 0;
  for (const Row& row : kRows) {
    if (driver_version >= row.driver) best = row.isa;
  }
  return best;
}

}  // namespace devbridge::cuda::detail
