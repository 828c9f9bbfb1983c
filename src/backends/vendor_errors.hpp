// What every vendor backend (CUDA, OpenCL) needs to turn a driver's error code
// into the contract's vocabulary: what it was doing when the driver failed,
// and the class the failure falls in. Each backend keeps its own code table.
#pragma once

#include "devbridge/error.hpp"

namespace devbridge::backends {

// What the backend was doing when the driver failed; decides the kind a
// non-fatal failure maps to.
enum class Operation {
  Setup,     // loading the driver, creating the context, queues/streams, programs
  Allocate,  // device or page-locked host memory
  Upload,    // host -> device copy, submission or completion
  Download,  // device -> host copy, submission or completion
  Launch,    // the compute role
  Query,     // describe(), memory info
  Release,   // frees and teardown (never thrown, only logged)
};

struct ResultClass {
  ErrorKind kind = ErrorKind::Broken;
  // The device (context, queue) is unusable: later work in it fails or has
  // no defined result. The bridge turns Broken.
  bool fatal = false;
};

// The kind an ordinary failure (the device is fine, this operation failed)
// takes.
constexpr ErrorKind operation_kind(Operation operation) noexcept {
  switch (operation) {
    case Operation::Allocate:
      return ErrorKind::AllocationFailed;
    case Operation::Upload:
      return ErrorKind::DeviceCopyFailed;
    case Operation::Download:
      return ErrorKind::OutputCopyFailed;
    case Operation::Setup:
      return ErrorKind::Unavailable;
    case Operation::Launch:
      return ErrorKind::Unsupported;
    case Operation::Query:
      return ErrorKind::Unavailable;
    case Operation::Release:
      return ErrorKind::Broken;
  }
  return ErrorKind::Broken;
}

}  // namespace devbridge::backends
