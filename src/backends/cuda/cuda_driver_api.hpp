// The part of the CUDA driver API that devbridge calls, declared in-tree.
//
// Everything here is a fact of the driver's binary interface (type layouts,
// enumerator values, the signatures of exported symbols), so the backend and
// the emulated driver build without the CUDA toolkit. Nothing is linked
// against: the driver is dlopen()ed (cuda_driver.hpp). Where cuda.h is
// present, tests/cuda/cuda_driver_api_check.cpp compares every list below
// with it and fails the build on any difference.
//
// The lists are X-macros so that the check walks exactly what is declared:
// adding an enumerator, a constant, a member or an entry point here puts it
// under the check without touching the check.
//
// Linux, 64-bit only (the driver is libcuda.so.1): CUDAAPI and CUDA_CB are
// empty there, and CUdeviceptr is 64 bits wide.
#pragma once

#include <cstddef>
#include <cstdint>

static_assert(sizeof(void*) == 8, "devbridge declares the 64-bit CUDA driver ABI only");

namespace devbridge::cuda::detail {

// ---- enumerations: X(name, value) -------------------------------------------

// Every CUresult the backend names (its error table is built from this list).
#define DEVBRIDGE_CUDA_RESULTS(X)                  \
  X(CUDA_SUCCESS, 0)                               \
  X(CUDA_ERROR_INVALID_VALUE, 1)                   \
  X(CUDA_ERROR_OUT_OF_MEMORY, 2)                   \
  X(CUDA_ERROR_NOT_INITIALIZED, 3)                 \
  X(CUDA_ERROR_DEINITIALIZED, 4)                   \
  X(CUDA_ERROR_STUB_LIBRARY, 34)                   \
  X(CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER, 36)     \
  X(CUDA_ERROR_DEVICE_UNAVAILABLE, 46)             \
  X(CUDA_ERROR_NO_DEVICE, 100)                     \
  X(CUDA_ERROR_INVALID_DEVICE, 101)                \
  X(CUDA_ERROR_DEVICE_NOT_LICENSED, 102)           \
  X(CUDA_ERROR_INVALID_IMAGE, 200)                 \
  X(CUDA_ERROR_INVALID_CONTEXT, 201)               \
  X(CUDA_ERROR_NO_BINARY_FOR_GPU, 209)             \
  X(CUDA_ERROR_ECC_UNCORRECTABLE, 214)             \
  X(CUDA_ERROR_CONTEXT_ALREADY_IN_USE, 216)        \
  X(CUDA_ERROR_INVALID_PTX, 218)                   \
  X(CUDA_ERROR_NVLINK_UNCORRECTABLE, 220)          \
  X(CUDA_ERROR_JIT_COMPILER_NOT_FOUND, 221)        \
  X(CUDA_ERROR_UNSUPPORTED_PTX_VERSION, 222)       \
  X(CUDA_ERROR_JIT_COMPILATION_DISABLED, 223)      \
  X(CUDA_ERROR_CONTAINED, 226)                     \
  X(CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND, 302) \
  X(CUDA_ERROR_SHARED_OBJECT_INIT_FAILED, 303)     \
  X(CUDA_ERROR_OPERATING_SYSTEM, 304)              \
  X(CUDA_ERROR_INVALID_HANDLE, 400)                \
  X(CUDA_ERROR_ILLEGAL_STATE, 401)                 \
  X(CUDA_ERROR_NOT_FOUND, 500)                     \
  X(CUDA_ERROR_NOT_READY, 600)                     \
  X(CUDA_ERROR_ILLEGAL_ADDRESS, 700)               \
  X(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, 701)       \
  X(CUDA_ERROR_LAUNCH_TIMEOUT, 702)                \
  X(CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING, 703) \
  X(CUDA_ERROR_CONTEXT_IS_DESTROYED, 709)          \
  X(CUDA_ERROR_ASSERT, 710)                        \
  X(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, 712) \
  X(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, 713)    \
  X(CUDA_ERROR_HARDWARE_STACK_ERROR, 714)          \
  X(CUDA_ERROR_ILLEGAL_INSTRUCTION, 715)           \
  X(CUDA_ERROR_MISALIGNED_ADDRESS, 716)            \
  X(CUDA_ERROR_INVALID_ADDRESS_SPACE, 717)         \
  X(CUDA_ERROR_INVALID_PC, 718)                    \
  X(CUDA_ERROR_LAUNCH_FAILED, 719)                 \
  X(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, 720)  \
  X(CUDA_ERROR_TENSOR_MEMORY_LEAK, 721)            \
  X(CUDA_ERROR_NOT_PERMITTED, 800)                 \
  X(CUDA_ERROR_NOT_SUPPORTED, 801)                 \
  X(CUDA_ERROR_SYSTEM_NOT_READY, 802)              \
  X(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, 803)        \
  X(CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE, 804) \
  X(CUDA_ERROR_MPS_CONNECTION_FAILED, 805)         \
  X(CUDA_ERROR_TIMEOUT, 909)                       \
  X(CUDA_ERROR_EXTERNAL_DEVICE, 911)               \
  X(CUDA_ERROR_UNKNOWN, 999)

#define DEVBRIDGE_CUDA_DEVICE_ATTRIBUTES(X)           \
  X(CU_DEVICE_ATTRIBUTE_MAX_PITCH, 11)                \
  X(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 16)     \
  X(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 33)               \
  X(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, 34)            \
  X(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, 50)            \
  X(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 75) \
  X(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 76)

#define DEVBRIDGE_CUDA_MEMORY_TYPES(X) \
  X(CU_MEMORYTYPE_HOST, 1)             \
  X(CU_MEMORYTYPE_DEVICE, 2)           \
  X(CU_MEMORYTYPE_ARRAY, 3)            \
  X(CU_MEMORYTYPE_UNIFIED, 4)

#define DEVBRIDGE_CUDA_JIT_OPTIONS(X) \
  X(CU_JIT_ERROR_LOG_BUFFER, 5)       \
  X(CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, 6)

#define DEVBRIDGE_CUDA_STREAM_FLAGS(X) \
  X(CU_STREAM_DEFAULT, 0)              \
  X(CU_STREAM_NON_BLOCKING, 1)

#define DEVBRIDGE_CUDA_EVENT_FLAGS(X) \
  X(CU_EVENT_DEFAULT, 0)              \
  X(CU_EVENT_DISABLE_TIMING, 2)

// X(type, enumerators): each enumeration with the list of its enumerators.
#define DEVBRIDGE_CUDA_ENUMS(X)                              \
  X(CUresult, DEVBRIDGE_CUDA_RESULTS)                        \
  X(CUdevice_attribute, DEVBRIDGE_CUDA_DEVICE_ATTRIBUTES)    \
  X(CUmemorytype, DEVBRIDGE_CUDA_MEMORY_TYPES)               \
  X(CUjit_option, DEVBRIDGE_CUDA_JIT_OPTIONS)                \
  X(CUstream_flags, DEVBRIDGE_CUDA_STREAM_FLAGS)             \
  X(CUevent_flags, DEVBRIDGE_CUDA_EVENT_FLAGS)

// A fixed underlying type, so any code a newer driver returns is a valid
// CUresult here (cuda.h's enums are 4 bytes wide too; the check compares).
#define DEVBRIDGE_CUDA_ENUMERATOR(name, value) name = value,
#define DEVBRIDGE_CUDA_DECLARE_ENUM(type, enumerators) \
  enum type : int { enumerators(DEVBRIDGE_CUDA_ENUMERATOR) };
DEVBRIDGE_CUDA_ENUMS(DEVBRIDGE_CUDA_DECLARE_ENUM)
#undef DEVBRIDGE_CUDA_DECLARE_ENUM
#undef DEVBRIDGE_CUDA_ENUMERATOR

// ---- constants that cuda.h defines as macros --------------------------------
// Named differently here: cuda.h's macros would otherwise rewrite these
// names wherever both headers are seen. X(name, cuda_h_macro, value).

#define DEVBRIDGE_CUDA_FLAG_CONSTANTS(X)                              \
  X(kMemHostAllocPortable, CU_MEMHOSTALLOC_PORTABLE, 0x01)            \
  X(kMemHostRegisterPortable, CU_MEMHOSTREGISTER_PORTABLE, 0x01)      \
  X(kMemHostRegisterReadOnly, CU_MEMHOSTREGISTER_READ_ONLY, 0x08)

#define DEVBRIDGE_CUDA_DECLARE_FLAG(name, cuda_h_macro, value) inline constexpr unsigned int name = value;
DEVBRIDGE_CUDA_FLAG_CONSTANTS(DEVBRIDGE_CUDA_DECLARE_FLAG)
#undef DEVBRIDGE_CUDA_DECLARE_FLAG

// ---- handles ------------------------------------------------------------------
// X(handle, tag): an opaque pointer to an incomplete struct, as in cuda.h.

#define DEVBRIDGE_CUDA_HANDLES(X) \
  X(CUcontext, CUctx_st)          \
  X(CUmodule, CUmod_st)           \
  X(CUfunction, CUfunc_st)        \
  X(CUarray, CUarray_st)          \
  X(CUevent, CUevent_st)          \
  X(CUstream, CUstream_st)

#define DEVBRIDGE_CUDA_DECLARE_HANDLE(handle, tag) \
  struct tag;                                      \
  using handle = tag*;
DEVBRIDGE_CUDA_HANDLES(DEVBRIDGE_CUDA_DECLARE_HANDLE)
#undef DEVBRIDGE_CUDA_DECLARE_HANDLE

using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUhostFn = void (*)(void* user_data);

// The default streams are handles with reserved values; cuda.h spells them
// as macros casting an integer to CUstream. X(function, cuda_h_macro, value).
#define DEVBRIDGE_CUDA_STREAM_HANDLE_CONSTANTS(X)         \
  X(legacy_default_stream, CU_STREAM_LEGACY, 0x1)         \
  X(per_thread_default_stream, CU_STREAM_PER_THREAD, 0x2)

// Functions, not constants: an integer-to-pointer cast is no constant
// expression, and a function needs no dynamic initialisation.
#define DEVBRIDGE_CUDA_DECLARE_STREAM_HANDLE(function, cuda_h_macro, value) \
  inline CUstream function() noexcept { return reinterpret_cast<CUstream>(std::uintptr_t{value}); }
DEVBRIDGE_CUDA_STREAM_HANDLE_CONSTANTS(DEVBRIDGE_CUDA_DECLARE_STREAM_HANDLE)
#undef DEVBRIDGE_CUDA_DECLARE_STREAM_HANDLE

// ---- structures: X(type, member) ---------------------------------------------

#define DEVBRIDGE_CUDA_MEMCPY2D_MEMBERS(X) \
  X(std::size_t, srcXInBytes)              \
  X(std::size_t, srcY)                     \
  X(CUmemorytype, srcMemoryType)           \
  X(const void*, srcHost)                  \
  X(CUdeviceptr, srcDevice)                \
  X(CUarray, srcArray)                     \
  X(std::size_t, srcPitch)                 \
  X(std::size_t, dstXInBytes)              \
  X(std::size_t, dstY)                     \
  X(CUmemorytype, dstMemoryType)           \
  X(void*, dstHost)                        \
  X(CUdeviceptr, dstDevice)                \
  X(CUarray, dstArray)                     \
  X(std::size_t, dstPitch)                 \
  X(std::size_t, WidthInBytes)             \
  X(std::size_t, Height)

// X(type, members)
#define DEVBRIDGE_CUDA_STRUCTS(X) X(CUDA_MEMCPY2D, DEVBRIDGE_CUDA_MEMCPY2D_MEMBERS)

#define DEVBRIDGE_CUDA_MEMBER(type, member) type member;
#define DEVBRIDGE_CUDA_DECLARE_STRUCT(type, members) \
  struct type {                                      \
    members(DEVBRIDGE_CUDA_MEMBER)                   \
  };
DEVBRIDGE_CUDA_STRUCTS(DEVBRIDGE_CUDA_DECLARE_STRUCT)
#undef DEVBRIDGE_CUDA_DECLARE_STRUCT
#undef DEVBRIDGE_CUDA_MEMBER

// ---- entry points -------------------------------------------------------------
// Versioned entry points go by their versioned symbol (cuMemAlloc_v2, ...),
// the one cuda.h's macros make a linked program call; the un-suffixed
// symbols are the old 32-bit-era ABI and must never be used.

using PFN_cuInit = CUresult (*)(unsigned int flags);
using PFN_cuDriverGetVersion = CUresult (*)(int* version);
using PFN_cuGetErrorName = CUresult (*)(CUresult error, const char** name);
using PFN_cuGetErrorString = CUresult (*)(CUresult error, const char** description);
using PFN_cuDeviceGetCount = CUresult (*)(int* count);
using PFN_cuDeviceGet = CUresult (*)(CUdevice* device, int ordinal);
using PFN_cuDeviceGetName = CUresult (*)(char* name, int length, CUdevice device);
using PFN_cuDeviceGetAttribute = CUresult (*)(int* value, CUdevice_attribute attribute, CUdevice device);
using PFN_cuDeviceTotalMem_v2 = CUresult (*)(std::size_t* bytes, CUdevice device);
using PFN_cuDevicePrimaryCtxRetain = CUresult (*)(CUcontext* context, CUdevice device);
using PFN_cuDevicePrimaryCtxRelease_v2 = CUresult (*)(CUdevice device);
using PFN_cuCtxPushCurrent_v2 = CUresult (*)(CUcontext context);
using PFN_cuCtxPopCurrent_v2 = CUresult (*)(CUcontext* context);
using PFN_cuCtxGetCurrent = CUresult (*)(CUcontext* context);
using PFN_cuCtxGetDevice = CUresult (*)(CUdevice* device);
using PFN_cuMemGetInfo_v2 = CUresult (*)(std::size_t* free_bytes, std::size_t* total_bytes);
using PFN_cuMemAlloc_v2 = CUresult (*)(CUdeviceptr* pointer, std::size_t bytes);
using PFN_cuMemFree_v2 = CUresult (*)(CUdeviceptr pointer);
using PFN_cuMemHostAlloc = CUresult (*)(void** pointer, std::size_t bytes, unsigned int flags);
using PFN_cuMemFreeHost = CUresult (*)(void* pointer);
using PFN_cuMemHostRegister_v2 = CUresult (*)(void* pointer, std::size_t bytes, unsigned int flags);
using PFN_cuMemHostUnregister = CUresult (*)(void* pointer);
using PFN_cuMemcpyHtoDAsync_v2 = CUresult (*)(CUdeviceptr destination, const void* source, std::size_t bytes,
                                              CUstream stream);
using PFN_cuMemcpyDtoHAsync_v2 = CUresult (*)(void* destination, CUdeviceptr source, std::size_t bytes,
                                              CUstream stream);
using PFN_cuMemcpy2DAsync_v2 = CUresult (*)(const CUDA_MEMCPY2D* copy, CUstream stream);
using PFN_cuMemcpyDtoDAsync_v2 = CUresult (*)(CUdeviceptr destination, CUdeviceptr source, std::size_t bytes,
                                              CUstream stream);
using PFN_cuMemcpyPeerAsync = CUresult (*)(CUdeviceptr destination, CUcontext destination_context,
                                           CUdeviceptr source, CUcontext source_context, std::size_t bytes,
                                           CUstream stream);
using PFN_cuStreamCreate = CUresult (*)(CUstream* stream, unsigned int flags);
using PFN_cuStreamDestroy_v2 = CUresult (*)(CUstream stream);
using PFN_cuStreamSynchronize = CUresult (*)(CUstream stream);
using PFN_cuStreamWaitEvent = CUresult (*)(CUstream stream, CUevent event, unsigned int flags);
using PFN_cuEventCreate = CUresult (*)(CUevent* event, unsigned int flags);
using PFN_cuEventDestroy_v2 = CUresult (*)(CUevent event);
using PFN_cuEventRecord = CUresult (*)(CUevent event, CUstream stream);
using PFN_cuEventQuery = CUresult (*)(CUevent event);
using PFN_cuEventSynchronize = CUresult (*)(CUevent event);
using PFN_cuModuleLoadDataEx = CUresult (*)(CUmodule* module, const void* image, unsigned int option_count,
                                            CUjit_option* options, void** option_values);
using PFN_cuModuleUnload = CUresult (*)(CUmodule module);
using PFN_cuModuleGetFunction = CUresult (*)(CUfunction* function, CUmodule module, const char* name);
using PFN_cuLaunchKernel = CUresult (*)(CUfunction function, unsigned int grid_x, unsigned int grid_y,
                                        unsigned int grid_z, unsigned int block_x, unsigned int block_y,
                                        unsigned int block_z, unsigned int shared_memory_bytes, CUstream stream,
                                        void** kernel_parameters, void** extra);
using PFN_cuLaunchHostFunc = CUresult (*)(CUstream stream, CUhostFn function, void* user_data);

// X(symbol): every entry point the backend loads, each typed PFN_<symbol>.
#define DEVBRIDGE_CUDA_DRIVER_ENTRY_POINTS(X) \
  X(cuInit)                                   \
  X(cuDriverGetVersion)                       \
  X(cuGetErrorName)                           \
  X(cuGetErrorString)                         \
  X(cuDeviceGetCount)                         \
  X(cuDeviceGet)                              \
  X(cuDeviceGetName)                          \
  X(cuDeviceGetAttribute)                     \
  X(cuDeviceTotalMem_v2)                      \
  X(cuDevicePrimaryCtxRetain)                 \
  X(cuDevicePrimaryCtxRelease_v2)             \
  X(cuCtxPushCurrent_v2)                      \
  X(cuCtxPopCurrent_v2)                       \
  X(cuCtxGetCurrent)                          \
  X(cuCtxGetDevice)                           \
  X(cuMemGetInfo_v2)                          \
  X(cuMemAlloc_v2)                            \
  X(cuMemFree_v2)                             \
  X(cuMemHostAlloc)                           \
  X(cuMemFreeHost)                            \
  X(cuMemHostRegister_v2)                     \
  X(cuMemHostUnregister)                      \
  X(cuMemcpyHtoDAsync_v2)                     \
  X(cuMemcpyDtoHAsync_v2)                     \
  X(cuMemcpy2DAsync_v2)                       \
  X(cuMemcpyDtoDAsync_v2)                     \
  X(cuMemcpyPeerAsync)                        \
  X(cuStreamCreate)                           \
  X(cuStreamDestroy_v2)                       \
  X(cuStreamSynchronize)                      \
  X(cuStreamWaitEvent)                        \
  X(cuEventCreate)                            \
  X(cuEventDestroy_v2)                        \
  X(cuEventRecord)                            \
  X(cuEventQuery)                             \
  X(cuEventSynchronize)                       \
  X(cuModuleLoadDataEx)                       \
  X(cuModuleUnload)                           \
  X(cuModuleGetFunction)                      \
  X(cuLaunchKernel)                           \
  X(cuLaunchHostFunc)

}  // namespace devbridge::cuda::detail
