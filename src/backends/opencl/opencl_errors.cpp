// The cl_int table. Codes are written as numbers with cl.h's names beside
// them, so the mapping is one table and needs no OpenCL header.
#include "backends/opencl/opencl_errors.hpp"

#include <array>

namespace devbridge::opencl::detail {
namespace {

using backends::operation_kind;

struct KnownCode {
  int code;
  std::string_view name;
};

constexpr std::array kKnownCodes{
    KnownCode{0, "CL_SUCCESS"},
    KnownCode{-1, "CL_DEVICE_NOT_FOUND"},
    KnownCode{-2, "CL_DEVICE_NOT_AVAILABLE"},
    KnownCode{-3, "CL_COMPILER_NOT_AVAILABLE"},
    KnownCode{-4, "CL_MEM_OBJECT_ALLOCATION_FAILURE"},
    KnownCode{-5, "CL_OUT_OF_RESOURCES"},
    KnownCode{-6, "CL_OUT_OF_HOST_MEMORY"},
    KnownCode{-7, "CL_PROFILING_INFO_NOT_AVAILABLE"},
    KnownCode{-8, "CL_MEM_COPY_OVERLAP"},
    KnownCode{-9, "CL_IMAGE_FORMAT_MISMATCH"},
    KnownCode{-10, "CL_IMAGE_FORMAT_NOT_SUPPORTED"},
    KnownCode{-11, "CL_BUILD_PROGRAM_FAILURE"},
    KnownCode{-12, "CL_MAP_FAILURE"},
    KnownCode{-13, "CL_MISALIGNED_SUB_BUFFER_OFFSET"},
    KnownCode{-14, "CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST"},
    KnownCode{-15, "CL_COMPILE_PROGRAM_FAILURE"},
    KnownCode{-16, "CL_LINKER_NOT_AVAILABLE"},
    KnownCode{-17, "CL_LINK_PROGRAM_FAILURE"},
    KnownCode{-18, "CL_DEVICE_PARTITION_FAILED"},
    KnownCode{-19, "CL_KERNEL_ARG_INFO_NOT_AVAILABLE"},
    KnownCode{-30, "CL_INVALID_VALUE"},
    KnownCode{-31, "CL_INVALID_DEVICE_TYPE"},
    KnownCode{-32, "CL_INVALID_PLATFORM"},
    KnownCode{-33, "CL_INVALID_DEVICE"},
    KnownCode{-34, "CL_INVALID_CONTEXT"},
    KnownCode{-35, "CL_INVALID_QUEUE_PROPERTIES"},
    KnownCode{-36, "CL_INVALID_COMMAND_QUEUE"},
    KnownCode{-37, "CL_INVALID_HOST_PTR"},
    KnownCode{-38, "CL_INVALID_MEM_OBJECT"},
    KnownCode{-39, "CL_INVALID_IMAGE_FORMAT_DESCRIPTOR"},
    KnownCode{-40, "CL_INVALID_IMAGE_SIZE"},
    KnownCode{-41, "CL_INVALID_SAMPLER"},
    KnownCode{-42, "CL_INVALID_BINARY"},
    KnownCode{-43, "CL_INVALID_BUILD_OPTIONS"},
    KnownCode{-44, "CL_INVALID_PROGRAM"},
    KnownCode{-45, "CL_INVALID_PROGRAM_EXECUTABLE"},
    KnownCode{-46, "CL_INVALID_KERNEL_NAME"},
    KnownCode{-47, "CL_INVALID_KERNEL_DEFINITION"},
    KnownCode{-48, "CL_INVALID_KERNEL"},
    KnownCode{-49, "CL_INVALID_ARG_INDEX"},
    KnownCode{-50, "CL_INVALID_ARG_VALUE"},
    KnownCode{-51, "CL_INVALID_ARG_SIZE"},
    KnownCode{-52, "CL_INVALID_KERNEL_ARGS"},
    KnownCode{-53, "CL_INVALID_WORK_DIMENSION"},
    KnownCode{-54, "CL_INVALID_WORK_GROUP_SIZE"},
    KnownCode{-55, "CL_INVALID_WORK_ITEM_SIZE"},
    KnownCode{-56, "CL_INVALID_GLOBAL_OFFSET"},
    KnownCode{-57, "CL_INVALID_EVENT_WAIT_LIST"},
    KnownCode{-58, "CL_INVALID_EVENT"},
    KnownCode{-59, "CL_INVALID_OPERATION"},
    KnownCode{-60, "CL_INVALID_GL_OBJECT"},
    KnownCode{-61, "CL_INVALID_BUFFER_SIZE"},
    KnownCode{-62, "CL_INVALID_MIP_LEVEL"},
    KnownCode{-63, "CL_INVALID_GLOBAL_WORK_SIZE"},
    KnownCode{-64, "CL_INVALID_PROPERTY"},
    KnownCode{-65, "CL_INVALID_IMAGE_DESCRIPTOR"},
    KnownCode{-66, "CL_INVALID_COMPILER_OPTIONS"},
    KnownCode{-67, "CL_INVALID_LINKER_OPTIONS"},
    KnownCode{-68, "CL_INVALID_DEVICE_PARTITION_COUNT"},
    KnownCode{-1001, "CL_PLATFORM_NOT_FOUND_KHR"},
};

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
    case 0:
      return {ErrorKind::Broken, false};  // not a failure: asking is a programming error
    // No platform or device (or not for us): nothing could succeed.
    case -1:     // DEVICE_NOT_FOUND
    case -1001:  // PLATFORM_NOT_FOUND_KHR (the ICD loader found no driver)
      return {ErrorKind::Unavailable, false};
    // The device went away or ran out of what it needs to run commands; an
    // in-order queue after such a failure has no defined state.
    case -2:  // DEVICE_NOT_AVAILABLE
    case -5:  // OUT_OF_RESOURCES
      return {operation == Operation::Setup || operation == Operation::Query || operation == Operation::Launch
                  ? ErrorKind::Broken
                  : operation_kind(operation),
              true};
    // A command in the queue ended abnormally before this one: the queue is
    // poisoned for everything after it.
    case -14:  // EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST
      return {operation_kind(operation), true};
    // The device cannot build or run what this build carries.
    case -3:   // COMPILER_NOT_AVAILABLE
    case -11:  // BUILD_PROGRAM_FAILURE
    case -16:  // LINKER_NOT_AVAILABLE
      return {ErrorKind::Unsupported, false};
    case -4:   // MEM_OBJECT_ALLOCATION_FAILURE
    case -6:   // OUT_OF_HOST_MEMORY
    case -61:  // INVALID_BUFFER_SIZE
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
