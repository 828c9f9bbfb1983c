// The CUresult -> ErrorKind table. Its names and numbers come from
// cuda_driver_api.hpp, which the build compares with cuda.h wherever the
// toolkit is installed (cuda_driver_api_check.cpp); these tests pin the
// names the backend reports and the mapping itself.
#include <gtest/gtest.h>

#include <string>

#include "backends/cuda/cuda_driver.hpp"
#include "backends/cuda/cuda_errors.hpp"

namespace devbridge::cuda::detail {
namespace {

#define NAMED(code) code, #code

struct NameCase {
  CUresult code;
  const char* name;
};

TEST(CudaResultNames, AreTheDriversOwn) {
  const NameCase cases[] = {
      {NAMED(CUDA_SUCCESS)},
      {NAMED(CUDA_ERROR_INVALID_VALUE)},
      {NAMED(CUDA_ERROR_OUT_OF_MEMORY)},
      {NAMED(CUDA_ERROR_NOT_INITIALIZED)},
      {NAMED(CUDA_ERROR_DEINITIALIZED)},
      {NAMED(CUDA_ERROR_STUB_LIBRARY)},
      {NAMED(CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER)},
      {NAMED(CUDA_ERROR_DEVICE_UNAVAILABLE)},
      {NAMED(CUDA_ERROR_NO_DEVICE)},
      {NAMED(CUDA_ERROR_INVALID_DEVICE)},
      {NAMED(CUDA_ERROR_DEVICE_NOT_LICENSED)},
      {NAMED(CUDA_ERROR_INVALID_IMAGE)},
      {NAMED(CUDA_ERROR_INVALID_CONTEXT)},
      {NAMED(CUDA_ERROR_NO_BINARY_FOR_GPU)},
      {NAMED(CUDA_ERROR_ECC_UNCORRECTABLE)},
      {NAMED(CUDA_ERROR_CONTEXT_ALREADY_IN_USE)},
      {NAMED(CUDA_ERROR_INVALID_PTX)},
      {NAMED(CUDA_ERROR_NVLINK_UNCORRECTABLE)},
      {NAMED(CUDA_ERROR_JIT_COMPILER_NOT_FOUND)},
      {NAMED(CUDA_ERROR_UNSUPPORTED_PTX_VERSION)},
      {NAMED(CUDA_ERROR_JIT_COMPILATION_DISABLED)},
      {NAMED(CUDA_ERROR_CONTAINED)},
      {NAMED(CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND)},
      {NAMED(CUDA_ERROR_SHARED_OBJECT_INIT_FAILED)},
      {NAMED(CUDA_ERROR_OPERATING_SYSTEM)},
      {NAMED(CUDA_ERROR_INVALID_HANDLE)},
      {NAMED(CUDA_ERROR_ILLEGAL_STATE)},
      {NAMED(CUDA_ERROR_NOT_FOUND)},
      {NAMED(CUDA_ERROR_NOT_READY)},
      {NAMED(CUDA_ERROR_ILLEGAL_ADDRESS)},
      {NAMED(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)},
      {NAMED(CUDA_ERROR_LAUNCH_TIMEOUT)},
      {NAMED(CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING)},
      {NAMED(CUDA_ERROR_CONTEXT_IS_DESTROYED)},
      {NAMED(CUDA_ERROR_ASSERT)},
      {NAMED(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)},
      {NAMED(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)},
      {NAMED(CUDA_ERROR_HARDWARE_STACK_ERROR)},
      {NAMED(CUDA_ERROR_ILLEGAL_INSTRUCTION)},
      {NAMED(CUDA_ERROR_MISALIGNED_ADDRESS)},
      {NAMED(CUDA_ERROR_INVALID_ADDRESS_SPACE)},
      {NAMED(CUDA_ERROR_INVALID_PC)},
      {NAMED(CUDA_ERROR_LAUNCH_FAILED)},
      {NAMED(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE)},
      {NAMED(CUDA_ERROR_TENSOR_MEMORY_LEAK)},
      {NAMED(CUDA_ERROR_NOT_PERMITTED)},
      {NAMED(CUDA_ERROR_NOT_SUPPORTED)},
      {NAMED(CUDA_ERROR_SYSTEM_NOT_READY)},
      {NAMED(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH)},
      {NAMED(CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE)},
      {NAMED(CUDA_ERROR_MPS_CONNECTION_FAILED)},
      {NAMED(CUDA_ERROR_TIMEOUT)},
      {NAMED(CUDA_ERROR_EXTERNAL_DEVICE)},
      {NAMED(CUDA_ERROR_UNKNOWN)},
  };
  for (const NameCase& c : cases) EXPECT_EQ(result_name(c.code), c.name) << "code " << c.code;
}

TEST(CudaResultNames, UnknownCodeIsNamedByNumber) { EXPECT_EQ(result_name(12345), "CUresult 12345"); }

struct MappingCase {
  CUresult code;
  Operation operation;
  ErrorKind kind;
  bool fatal;
};

TEST(CudaResultMapping, Table) {
  const MappingCase cases[] = {
      // Ordinary failures take the operation's kind; the device is fine.
      {CUDA_ERROR_OUT_OF_MEMORY, Operation::Allocate, ErrorKind::AllocationFailed, false},
      {CUDA_ERROR_OUT_OF_MEMORY, Operation::Upload, ErrorKind::DeviceCopyFailed, false},
      {CUDA_ERROR_INVALID_VALUE, Operation::Upload, ErrorKind::DeviceCopyFailed, false},
      {CUDA_ERROR_INVALID_VALUE, Operation::Download, ErrorKind::OutputCopyFailed, false},
      {CUDA_ERROR_INVALID_VALUE, Operation::Allocate, ErrorKind::AllocationFailed, false},
      {CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, Operation::Launch, ErrorKind::Unsupported, false},
      {CUDA_ERROR_INVALID_HANDLE, Operation::Setup, ErrorKind::Unavailable, false},
      // Sticky device faults: fatal, the copy still named by its direction.
      {CUDA_ERROR_ILLEGAL_ADDRESS, Operation::Upload, ErrorKind::DeviceCopyFailed, true},
      {CUDA_ERROR_ILLEGAL_ADDRESS, Operation::Download, ErrorKind::OutputCopyFailed, true},
      {CUDA_ERROR_ILLEGAL_ADDRESS, Operation::Allocate, ErrorKind::AllocationFailed, true},
      {CUDA_ERROR_LAUNCH_FAILED, Operation::Launch, ErrorKind::Broken, true},
      {CUDA_ERROR_MISALIGNED_ADDRESS, Operation::Launch, ErrorKind::Broken, true},
      {CUDA_ERROR_ECC_UNCORRECTABLE, Operation::Download, ErrorKind::OutputCopyFailed, true},
      {CUDA_ERROR_NVLINK_UNCORRECTABLE, Operation::Upload, ErrorKind::DeviceCopyFailed, true},
      {CUDA_ERROR_HARDWARE_STACK_ERROR, Operation::Query, ErrorKind::Broken, true},
      {CUDA_ERROR_ILLEGAL_INSTRUCTION, Operation::Setup, ErrorKind::Broken, true},
      {CUDA_ERROR_CONTEXT_IS_DESTROYED, Operation::Upload, ErrorKind::DeviceCopyFailed, true},
      {CUDA_ERROR_DEINITIALIZED, Operation::Allocate, ErrorKind::AllocationFailed, true},
      {CUDA_ERROR_UNKNOWN, Operation::Launch, ErrorKind::Broken, true},
      // No usable driver or device, whatever the operation.
      {CUDA_ERROR_NO_DEVICE, Operation::Setup, ErrorKind::Unavailable, false},
      {CUDA_ERROR_NO_DEVICE, Operation::Upload, ErrorKind::Unavailable, false},
      {CUDA_ERROR_NOT_INITIALIZED, Operation::Allocate, ErrorKind::Unavailable, false},
      {CUDA_ERROR_STUB_LIBRARY, Operation::Setup, ErrorKind::Unavailable, false},
      {CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, Operation::Setup, ErrorKind::Unavailable, false},
      {CUDA_ERROR_DEVICE_UNAVAILABLE, Operation::Setup, ErrorKind::Unavailable, false},
      // The device cannot run what the build carries.
      {CUDA_ERROR_UNSUPPORTED_PTX_VERSION, Operation::Setup, ErrorKind::Unsupported, false},
      {CUDA_ERROR_NO_BINARY_FOR_GPU, Operation::Setup, ErrorKind::Unsupported, false},
      {CUDA_ERROR_INVALID_PTX, Operation::Setup, ErrorKind::Unsupported, false},
      {CUDA_ERROR_NOT_SUPPORTED, Operation::Allocate, ErrorKind::Unsupported, false},
      // Host registration names a range that is (or is not) page-locked already.
      {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, Operation::Allocate, ErrorKind::InvalidRange, false},
      {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, Operation::Release, ErrorKind::InvalidRange, false},
  };
  for (const MappingCase& c : cases) {
    const ResultClass cls = classify(c.code, c.operation);
    EXPECT_EQ(cls.kind, c.kind) << result_name(c.code) << " during operation " << static_cast<int>(c.operation)
                                << " maps to " << kind_name(cls.kind);
    EXPECT_EQ(cls.fatal, c.fatal) << result_name(c.code) << " during operation " << static_cast<int>(c.operation);
  }
}

TEST(CudaResultMapping, EveryStickyErrorIsFatalWhateverTheOperation) {
  const CUresult sticky[] = {CUDA_ERROR_ILLEGAL_ADDRESS,        CUDA_ERROR_LAUNCH_TIMEOUT,
                             CUDA_ERROR_HARDWARE_STACK_ERROR,   CUDA_ERROR_ILLEGAL_INSTRUCTION,
                             CUDA_ERROR_MISALIGNED_ADDRESS,     CUDA_ERROR_INVALID_ADDRESS_SPACE,
                             CUDA_ERROR_INVALID_PC,             CUDA_ERROR_LAUNCH_FAILED,
                             CUDA_ERROR_ECC_UNCORRECTABLE,      CUDA_ERROR_ASSERT,
                             CUDA_ERROR_CONTAINED,              CUDA_ERROR_UNKNOWN};
  const Operation operations[] = {Operation::Setup,    Operation::Allocate, Operation::Upload, Operation::Download,
                                  Operation::Launch,   Operation::Query,    Operation::Release};
  for (CUresult code : sticky) {
    EXPECT_TRUE(is_sticky(code)) << result_name(code);
    for (Operation operation : operations) EXPECT_TRUE(classify(code, operation).fatal) << result_name(code);
  }
  for (CUresult code : {CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NO_DEVICE,
                        CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, CUDA_ERROR_NOT_READY}) {
    EXPECT_FALSE(is_sticky(code)) << result_name(code);
  }
}

TEST(CudaResultMapping, UnknownCodeIsAnOrdinaryFailureOfTheOperation) {
  EXPECT_EQ(classify(12345, Operation::Download).kind, ErrorKind::OutputCopyFailed);
  EXPECT_FALSE(classify(12345, Operation::Download).fatal);
}

TEST(CudaResultMapping, ErrorMessageNamesCallAndDriverError) {
  // A driver that never loaded still names errors from this build's table.
  const Driver& missing = load_driver("/nonexistent/devbridge-test/libcuda.so.1");
  const Error error = make_error(missing, CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc", Operation::Allocate,
                                 "asked 4096 bytes");
  EXPECT_EQ(error.kind(), ErrorKind::AllocationFailed);
  EXPECT_FALSE(error.fatal());
  EXPECT_EQ(std::string(error.message()), "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY; asked 4096 bytes");

  const Error fatal = make_error(missing, CUDA_ERROR_ILLEGAL_ADDRESS, "cuEventQuery", Operation::Download);
  EXPECT_EQ(fatal.kind(), ErrorKind::OutputCopyFailed);
  EXPECT_TRUE(fatal.fatal());
  EXPECT_NE(std::string(fatal.message()).find("cuEventQuery: CUDA_ERROR_ILLEGAL_ADDRESS"), std::string::npos);

  EXPECT_NO_THROW(check(missing, CUDA_SUCCESS, "cuInit", Operation::Setup));
  try {
    check(missing, CUDA_ERROR_NO_DEVICE, "cuInit", Operation::Setup);
    FAIL() << "check did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Unavailable);
    EXPECT_NE(std::string(e.what()).find("CUDA_ERROR_NO_DEVICE"), std::string::npos);
  }
}

TEST(CudaPtxIsa, DriverVersionsMapToTheirPtxIsa) {
  EXPECT_EQ(max_ptx_isa_for_driver(0), 0);
  EXPECT_EQ(max_ptx_isa_for_driver(10020), 0);
  EXPECT_EQ(max_ptx_isa_for_driver(11080), 78);
  EXPECT_EQ(max_ptx_isa_for_driver(12000), 80);
  EXPECT_EQ(max_ptx_isa_for_driver(12040), 84);
  EXPECT_EQ(max_ptx_isa_for_driver(12060), 85);
  EXPECT_EQ(max_ptx_isa_for_driver(12080), 87);
  EXPECT_EQ(max_ptx_isa_for_driver(13000), 90);
  EXPECT_GE(max_ptx_isa_for_driver(13020), 90);
}

}  // namespace
}  // namespace devbridge::cuda::detail
