// The cl_int table: the result codes of opencl_api_types.hpp, named and
// classified.
#include "backends/opencl/opencl_errors.hpp"

#include <array>

#include "backends/opencl/opencl_api.hpp"

namespace devbridge::opencl::detail {
namespace {

using backends::operation_kind;

struct KnownCode {
  int code;
  std::string_view name;
};

#define DEVBRIDGE_OPENCL_KNOWN_CODE(type, name, value) KnownCode{name, #name},
constexpr std::array kKnownCodes{DEVBRIDGE_OPENCL_RESULT_CODES(DEVBRIDGE_OPENCL_KNOWN_CODE)};
#undef DEVBRIDGE_OPENCL_KNOWN_CODE

const KnownCode* find_known(int code) noexcept {
  for (const auto& known : kKnownCodes) {
    if (known.code == code) return &known;
  }
  return nullptr;
}

}  // namespace

std::string error_name(int code) {
  if (const KnownCode* known = find_known(code)) return std::string(known->name);
  return "cl_int " + std::to_string(code);
}

ResultClass classify(int code, Operation operation) noexcept {
  switch (code) {
    case CL_SUCCESS:
      return {ErrorKind::Broken, false};  // not a failure: asking is a programming error
    // No platform or device (or not for us): nothing could succeed.
    case CL_DEVICE_NOT_FOUND:
    case CL_PLATFORM_NOT_FOUND_KHR:  // the ICD loader found no driver
      return {ErrorKind::Unavailable, false};
    // The device went away or ran out of what it needs to run commands; an
    // in-order queue after such a failure has no defined state.
    case CL_DEVICE_NOT_AVAILABLE:
    case CL_OUT_OF_RESOURCES:
      return {operation == Operation::Setup || operation == Operation::Query || operation == Operation::Launch
                  ? ErrorKind::Broken
                  : operation_kind(operation),
              true};
    // A command in the queue ended abnormally before this one: the queue is
    // poisoned for everything after it.
    case CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST:
      return {operation_kind(operation), true};
    // The device cannot build or run what this build carries.
    case CL_COMPILER_NOT_AVAILABLE:
    case CL_BUILD_PROGRAM_FAILURE:
    case CL_LINKER_NOT_AVAILABLE:
      return {ErrorKind::Unsupported, false};
    case CL_MEM_OBJECT_ALLOCATION_FAILURE:
    case CL_OUT_OF_HOST_MEMORY:
    case CL_INVALID_BUFFER_SIZE:
      return {operation == Operation::Allocate ? ErrorKind::AllocationFailed : operation_kind(operation), false};
    default:
      // Any other negative code is this call's failure. An async command's
      // negative execution status that is not a cl_int error (drivers use
      // their own) means the command was terminated abnormally: fatal.
      if (code < 0 && find_known(code) == nullptr) return {operation_kind(operation), true};
      return {operation_kind(operation), false};
  }
}

Error make_error(int code, std::string_view call, Operation operation, std::string_view detail) {
  const ResultClass cls = classify(code, operation);
  std::string message = std::string(call) + ": " + error_name(code) + " (" + std::to_string(code) + ")";
  if (!detail.empty()) {
    message += "; ";
    message += detail;
  }
  if (cls.fatal) message += "; the OpenCL queue is unusable until the bridge restarts";
  return Error(cls.kind, message, cls.fatal);
}

}  // namespace devbridge::opencl::detail
