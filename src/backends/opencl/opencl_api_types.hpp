// What devbridge uses of the OpenCL 1.2 C API, declared in-tree so that the
// backend builds with no OpenCL header anywhere: the ICD loader is dlopen'ed
// at run time, and these declarations are all the compiler needs of it.
//
// The types live in devbridge::opencl::abi, and the constants are only
// listed here (opencl_api.hpp defines them): cl.h makes them macros, so this
// header can share a translation unit with cl.h, which is how
// tests/opencl/opencl_api_check.cpp proves every entry below equal to the
// real headers' wherever they are installed.
//
// Linux only: CL_API_CALL and CL_CALLBACK are empty there, so entry points
// and callbacks are plain function pointers.
#pragma once

#include <cstddef>
#include <cstdint>

// X(name, underlying): a scalar typedef, in dependency order.
#define DEVBRIDGE_OPENCL_SCALAR_TYPES(X)        \
  X(cl_int, std::int32_t)                       \
  X(cl_uint, std::uint32_t)                     \
  X(cl_ulong, std::uint64_t)                    \
  X(cl_bool, cl_uint)                           \
  X(cl_bitfield, cl_ulong)                      \
  X(cl_device_type, cl_bitfield)                \
  X(cl_platform_info, cl_uint)                  \
  X(cl_device_info, cl_uint)                    \
  X(cl_context_properties, std::intptr_t)       \
  X(cl_context_info, cl_uint)                   \
  X(cl_command_queue_properties, cl_bitfield)   \
  X(cl_command_queue_info, cl_uint)             \
  X(cl_mem_flags, cl_bitfield)                  \
  X(cl_mem_info, cl_uint)                       \
  X(cl_buffer_create_type, cl_uint)             \
  X(cl_map_flags, cl_bitfield)                  \
  X(cl_event_info, cl_uint)                     \
  X(cl_program_build_info, cl_uint)

// X(name): an object the driver owns, known only by an opaque pointer.
#define DEVBRIDGE_OPENCL_HANDLE_TYPES(X) \
  X(cl_platform_id)                      \
  X(cl_device_id)                        \
  X(cl_context)                          \
  X(cl_command_queue)                    \
  X(cl_mem)                              \
  X(cl_event)                            \
  X(cl_program)                          \
  X(cl_kernel)

namespace devbridge::opencl::abi {

#define DEVBRIDGE_OPENCL_DECLARE_SCALAR(name, underlying) using name = underlying;
DEVBRIDGE_OPENCL_SCALAR_TYPES(DEVBRIDGE_OPENCL_DECLARE_SCALAR)
#undef DEVBRIDGE_OPENCL_DECLARE_SCALAR

#define DEVBRIDGE_OPENCL_DECLARE_HANDLE(name) \
  struct opaque_##name;                       \
  using name = opaque_##name*;
DEVBRIDGE_OPENCL_HANDLE_TYPES(DEVBRIDGE_OPENCL_DECLARE_HANDLE)
#undef DEVBRIDGE_OPENCL_DECLARE_HANDLE

// clCreateSubBuffer's CL_BUFFER_CREATE_TYPE_REGION argument.
struct cl_buffer_region {
  std::size_t origin;
  std::size_t size;
};

// CL_DEVICE_PCI_BUS_INFO_KHR's answer (cl_khr_pci_bus_info).
struct cl_device_pci_bus_info_khr {
  cl_uint pci_domain;
  cl_uint pci_bus;
  cl_uint pci_device;
  cl_uint pci_function;
};

using ContextErrorCallback = void (*)(const char* error_info, const void* private_info, std::size_t private_info_size,
                                      void* user_data);
using ProgramBuildCallback = void (*)(cl_program program, void* user_data);
using EventCallback = void (*)(cl_event event, cl_int execution_status, void* user_data);

}  // namespace devbridge::opencl::abi

// X(symbol, result, (parameters)): an entry point of the ICD loader, typed
// as PFN_<symbol> in devbridge::opencl::abi. Only OpenCL 1.2 entry points
// (the rect copies are 1.1), so any ICD serves.
#define DEVBRIDGE_OPENCL_ENTRY_POINTS(X)                                                                              \
  X(clGetPlatformIDs, cl_int, (cl_uint num_entries, cl_platform_id* platforms, cl_uint* num_platforms))               \
  X(clGetPlatformInfo, cl_int,                                                                                        \
    (cl_platform_id platform, cl_platform_info name, std::size_t size, void* value, std::size_t* size_ret))           \
  X(clGetDeviceIDs, cl_int,                                                                                           \
    (cl_platform_id platform, cl_device_type type, cl_uint num_entries, cl_device_id* devices, cl_uint* num_devices)) \
  X(clGetDeviceInfo, cl_int,                                                                                          \
    (cl_device_id device, cl_device_info name, std::size_t size, void* value, std::size_t* size_ret))                 \
  X(clCreateContext, cl_context,                                                                                      \
    (const cl_context_properties* properties, cl_uint num_devices, const cl_device_id* devices,                       \
     ContextErrorCallback notify, void* user_data, cl_int* result))                                                   \
  X(clReleaseContext, cl_int, (cl_context context))                                                                   \
  X(clGetContextInfo, cl_int,                                                                                         \
    (cl_context context, cl_context_info name, std::size_t size, void* value, std::size_t* size_ret))                 \
  X(clCreateCommandQueue, cl_command_queue,                                                                           \
    (cl_context context, cl_device_id device, cl_command_queue_properties properties, cl_int* result))                \
  X(clReleaseCommandQueue, cl_int, (cl_command_queue queue))                                                          \
  X(clGetCommandQueueInfo, cl_int,                                                                                    \
    (cl_command_queue queue, cl_command_queue_info name, std::size_t size, void* value, std::size_t* size_ret))       \
  X(clCreateBuffer, cl_mem, (cl_context context, cl_mem_flags flags, std::size_t size, void* host, cl_int* result))   \
  X(clReleaseMemObject, cl_int, (cl_mem buffer))                                                                      \
  X(clRetainMemObject, cl_int, (cl_mem buffer))                                                                       \
  X(clCreateSubBuffer, cl_mem,                                                                                        \
    (cl_mem buffer, cl_mem_flags flags, cl_buffer_create_type type, const void* info, cl_int* result))                \
  X(clGetMemObjectInfo, cl_int,                                                                                       \
    (cl_mem buffer, cl_mem_info name, std::size_t size, void* value, std::size_t* size_ret))                          \
  X(clEnqueueWriteBuffer, cl_int,                                                                                     \
    (cl_command_queue queue, cl_mem buffer, cl_bool blocking, std::size_t offset, std::size_t size, const void* host,  \
     cl_uint num_waits, const cl_event* waits, cl_event* done))                                                       \
  X(clEnqueueReadBuffer, cl_int,                                                                                      \
    (cl_command_queue queue, cl_mem buffer, cl_bool blocking, std::size_t offset, std::size_t size, void* host,        \
     cl_uint num_waits, const cl_event* waits, cl_event* done))                                                       \
  X(clEnqueueWriteBufferRect, cl_int,                                                                                 \
    (cl_command_queue queue, cl_mem buffer, cl_bool blocking, const std::size_t* buffer_origin,                       \
     const std::size_t* host_origin, const std::size_t* region, std::size_t buffer_row_pitch,                         \
     std::size_t buffer_slice_pitch, std::size_t host_row_pitch, std::size_t host_slice_pitch, const void* host,      \
     cl_uint num_waits, const cl_event* waits, cl_event* done))                                                       \
  X(clEnqueueReadBufferRect, cl_int,                                                                                  \
    (cl_command_queue queue, cl_mem buffer, cl_bool blocking, const std::size_t* buffer_origin,                       \
     const std::size_t* host_origin, const std::size_t* region, std::size_t buffer_row_pitch,                         \
     std::size_t buffer_slice_pitch, std::size_t host_row_pitch, std::size_t host_slice_pitch, void* host,            \
     cl_uint num_waits, const cl_event* waits, cl_event* done))                                                       \
  X(clEnqueueMapBuffer, void*,                                                                                        \
    (cl_command_queue queue, cl_mem buffer, cl_bool blocking, cl_map_flags flags, std::size_t offset,                 \
     std::size_t size, cl_uint num_waits, const cl_event* waits, cl_event* done, cl_int* result))                     \
  X(clEnqueueUnmapMemObject, cl_int,                                                                                  \
    (cl_command_queue queue, cl_mem buffer, void* mapped, cl_uint num_waits, const cl_event* waits, cl_event* done))  \
  X(clEnqueueNDRangeKernel, cl_int,                                                                                   \
    (cl_command_queue queue, cl_kernel kernel, cl_uint work_dim, const std::size_t* global_offset,                    \
     const std::size_t* global_size, const std::size_t* local_size, cl_uint num_waits, const cl_event* waits,         \
     cl_event* done))                                                                                                 \
  X(clEnqueueMarkerWithWaitList, cl_int,                                                                              \
    (cl_command_queue queue, cl_uint num_waits, const cl_event* waits, cl_event* done))                               \
  X(clEnqueueBarrierWithWaitList, cl_int,                                                                             \
    (cl_command_queue queue, cl_uint num_waits, const cl_event* waits, cl_event* done))                               \
  X(clCreateUserEvent, cl_event, (cl_context context, cl_int* result))                                                \
  X(clSetUserEventStatus, cl_int, (cl_event event, cl_int execution_status))                                          \
  X(clSetEventCallback, cl_int,                                                                                       \
    (cl_event event, cl_int callback_status, EventCallback notify, void* user_data))                                  \
  X(clRetainEvent, cl_int, (cl_event event))                                                                          \
  X(clReleaseEvent, cl_int, (cl_event event))                                                                         \
  X(clGetEventInfo, cl_int, (cl_event event, cl_event_info name, std::size_t size, void* value, std::size_t* size_ret)) \
  X(clWaitForEvents, cl_int, (cl_uint num_events, const cl_event* events))                                            \
  X(clFlush, cl_int, (cl_command_queue queue))                                                                        \
  X(clFinish, cl_int, (cl_command_queue queue))                                                                       \
  X(clCreateProgramWithSource, cl_program,                                                                            \
    (cl_context context, cl_uint count, const char** sources, const std::size_t* lengths, cl_int* result))            \
  X(clBuildProgram, cl_int,                                                                                           \
    (cl_program program, cl_uint num_devices, const cl_device_id* devices, const char* options,                       \
     ProgramBuildCallback notify, void* user_data))                                                                   \
  X(clGetProgramBuildInfo, cl_int,                                                                                    \
    (cl_program program, cl_device_id device, cl_program_build_info name, std::size_t size, void* value,              \
     std::size_t* size_ret))                                                                                          \
  X(clReleaseProgram, cl_int, (cl_program program))                                                                   \
  X(clCreateKernel, cl_kernel, (cl_program program, const char* name, cl_int* result))                                \
  X(clReleaseKernel, cl_int, (cl_kernel kernel))                                                                      \
  X(clSetKernelArg, cl_int, (cl_kernel kernel, cl_uint index, std::size_t size, const void* value))

namespace devbridge::opencl::abi {

#define DEVBRIDGE_OPENCL_DECLARE_ENTRY_TYPE(symbol, result, parameters) using PFN_##symbol = result(*) parameters;
DEVBRIDGE_OPENCL_ENTRY_POINTS(DEVBRIDGE_OPENCL_DECLARE_ENTRY_TYPE)
#undef DEVBRIDGE_OPENCL_DECLARE_ENTRY_TYPE

}  // namespace devbridge::opencl::abi

// X(type, name, value): the results an entry point or a command reports
// (opencl_errors.cpp names and classifies them). cl_ext.h's
// CL_PLATFORM_NOT_FOUND_KHR (cl_khr_icd) is what the ICD loader answers when
// no driver is registered.
#define DEVBRIDGE_OPENCL_RESULT_CODES(X)                        \
  X(cl_int, CL_SUCCESS, 0)                                      \
  X(cl_int, CL_DEVICE_NOT_FOUND, -1)                            \
  X(cl_int, CL_DEVICE_NOT_AVAILABLE, -2)                        \
  X(cl_int, CL_COMPILER_NOT_AVAILABLE, -3)                      \
  X(cl_int, CL_MEM_OBJECT_ALLOCATION_FAILURE, -4)               \
  X(cl_int, CL_OUT_OF_RESOURCES, -5)                            \
  X(cl_int, CL_OUT_OF_HOST_MEMORY, -6)                          \
  X(cl_int, CL_PROFILING_INFO_NOT_AVAILABLE, -7)                \
  X(cl_int, CL_MEM_COPY_OVERLAP, -8)                            \
  X(cl_int, CL_IMAGE_FORMAT_MISMATCH, -9)                       \
  X(cl_int, CL_IMAGE_FORMAT_NOT_SUPPORTED, -10)                 \
  X(cl_int, CL_BUILD_PROGRAM_FAILURE, -11)                      \
  X(cl_int, CL_MAP_FAILURE, -12)                                \
  X(cl_int, CL_MISALIGNED_SUB_BUFFER_OFFSET, -13)               \
  X(cl_int, CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST, -14)  \
  X(cl_int, CL_COMPILE_PROGRAM_FAILURE, -15)                    \
  X(cl_int, CL_LINKER_NOT_AVAILABLE, -16)                       \
  X(cl_int, CL_LINK_PROGRAM_FAILURE, -17)                       \
  X(cl_int, CL_DEVICE_PARTITION_FAILED, -18)                    \
  X(cl_int, CL_KERNEL_ARG_INFO_NOT_AVAILABLE, -19)              \
  X(cl_int, CL_INVALID_VALUE, -30)                              \
  X(cl_int, CL_INVALID_DEVICE_TYPE, -31)                        \
  X(cl_int, CL_INVALID_PLATFORM, -32)                           \
  X(cl_int, CL_INVALID_DEVICE, -33)                             \
  X(cl_int, CL_INVALID_CONTEXT, -34)                            \
  X(cl_int, CL_INVALID_QUEUE_PROPERTIES, -35)                   \
  X(cl_int, CL_INVALID_COMMAND_QUEUE, -36)                      \
  X(cl_int, CL_INVALID_HOST_PTR, -37)                           \
  X(cl_int, CL_INVALID_MEM_OBJECT, -38)                         \
  X(cl_int, CL_INVALID_IMAGE_FORMAT_DESCRIPTOR, -39)            \
  X(cl_int, CL_INVALID_IMAGE_SIZE, -40)                         \
  X(cl_int, CL_INVALID_SAMPLER, -41)                            \
  X(cl_int, CL_INVALID_BINARY, -42)                             \
  X(cl_int, CL_INVALID_BUILD_OPTIONS, -43)                      \
  X(cl_int, CL_INVALID_PROGRAM, -44)                            \
  X(cl_int, CL_INVALID_PROGRAM_EXECUTABLE, -45)                 \
  X(cl_int, CL_INVALID_KERNEL_NAME, -46)                        \
  X(cl_int, CL_INVALID_KERNEL_DEFINITION, -47)                  \
  X(cl_int, CL_INVALID_KERNEL, -48)                             \
  X(cl_int, CL_INVALID_ARG_INDEX, -49)                          \
  X(cl_int, CL_INVALID_ARG_VALUE, -50)                          \
  X(cl_int, CL_INVALID_ARG_SIZE, -51)                           \
  X(cl_int, CL_INVALID_KERNEL_ARGS, -52)                        \
  X(cl_int, CL_INVALID_WORK_DIMENSION, -53)                     \
  X(cl_int, CL_INVALID_WORK_GROUP_SIZE, -54)                    \
  X(cl_int, CL_INVALID_WORK_ITEM_SIZE, -55)                     \
  X(cl_int, CL_INVALID_GLOBAL_OFFSET, -56)                      \
  X(cl_int, CL_INVALID_EVENT_WAIT_LIST, -57)                    \
  X(cl_int, CL_INVALID_EVENT, -58)                              \
  X(cl_int, CL_INVALID_OPERATION, -59)                          \
  X(cl_int, CL_INVALID_GL_OBJECT, -60)                          \
  X(cl_int, CL_INVALID_BUFFER_SIZE, -61)                        \
  X(cl_int, CL_INVALID_MIP_LEVEL, -62)                          \
  X(cl_int, CL_INVALID_GLOBAL_WORK_SIZE, -63)                   \
  X(cl_int, CL_INVALID_PROPERTY, -64)                           \
  X(cl_int, CL_INVALID_IMAGE_DESCRIPTOR, -65)                   \
  X(cl_int, CL_INVALID_COMPILER_OPTIONS, -66)                   \
  X(cl_int, CL_INVALID_LINKER_OPTIONS, -67)                     \
  X(cl_int, CL_INVALID_DEVICE_PARTITION_COUNT, -68)             \
  X(cl_int, CL_PLATFORM_NOT_FOUND_KHR, -1001)

// X(type, name, value): every constant devbridge passes to or reads from
// OpenCL (the backend, its tests, the conformance suite's consumer queue and
// the bench), the result codes included. `type` is what the API takes it as:
// cl.h leaves its macros untyped.
#define DEVBRIDGE_OPENCL_CONSTANTS(X)                                 \
  DEVBRIDGE_OPENCL_RESULT_CODES(X)                                    \
  X(cl_bool, CL_FALSE, 0)                                             \
  X(cl_bool, CL_TRUE, 1)                                              \
  /* platform and device queries */                                   \
  X(cl_platform_info, CL_PLATFORM_NAME, 0x0902)                       \
  X(cl_device_type, CL_DEVICE_TYPE_GPU, 1 << 2)                       \
  X(cl_device_type, CL_DEVICE_TYPE_ACCELERATOR, 1 << 3)               \
  X(cl_device_type, CL_DEVICE_TYPE_ALL, 0xFFFFFFFF)                   \
  X(cl_device_info, CL_DEVICE_TYPE, 0x1000)                           \
  X(cl_device_info, CL_DEVICE_MAX_MEM_ALLOC_SIZE, 0x1010)             \
  X(cl_device_info, CL_DEVICE_MEM_BASE_ADDR_ALIGN, 0x1019)            \
  X(cl_device_info, CL_DEVICE_GLOBAL_MEM_SIZE, 0x101F)                \
  X(cl_device_info, CL_DEVICE_NAME, 0x102B)                           \
  X(cl_device_info, CL_DEVICE_VENDOR, 0x102C)                         \
  X(cl_device_info, CL_DEVICE_VERSION, 0x102F)                        \
  X(cl_device_info, CL_DEVICE_EXTENSIONS, 0x1030)                     \
  X(cl_device_info, CL_DEVICE_HOST_UNIFIED_MEMORY, 0x1035)            \
  X(cl_device_info, CL_DEVICE_PCI_BUS_INFO_KHR, 0x410F)               \
  /* contexts and queues */                                           \
  X(cl_context_info, CL_CONTEXT_DEVICES, 0x1081)                      \
  X(cl_context_info, CL_CONTEXT_NUM_DEVICES, 0x1083)                  \
  X(cl_command_queue_info, CL_QUEUE_CONTEXT, 0x1090)                  \
  /* buffers */                                                       \
  X(cl_mem_flags, CL_MEM_READ_WRITE, 1 << 0)                          \
  X(cl_mem_flags, CL_MEM_READ_ONLY, 1 << 2)                           \
  X(cl_mem_flags, CL_MEM_USE_HOST_PTR, 1 << 3)                        \
  X(cl_mem_flags, CL_MEM_ALLOC_HOST_PTR, 1 << 4)                      \
  X(cl_map_flags, CL_MAP_READ, 1 << 0)                                \
  X(cl_map_flags, CL_MAP_WRITE, 1 << 1)                               \
  X(cl_map_flags, CL_MAP_WRITE_INVALIDATE_REGION, 1 << 2)             \
  X(cl_mem_info, CL_MEM_FLAGS, 0x1101)                                \
  X(cl_mem_info, CL_MEM_SIZE, 0x1102)                                 \
  X(cl_mem_info, CL_MEM_HOST_PTR, 0x1103)                             \
  X(cl_mem_info, CL_MEM_REFERENCE_COUNT, 0x1105)                      \
  X(cl_buffer_create_type, CL_BUFFER_CREATE_TYPE_REGION, 0x1220)      \
  /* programs */                                                      \
  X(cl_program_build_info, CL_PROGRAM_BUILD_LOG, 0x1183)              \
  /* events; an execution status is a cl_int (negative: failed) */    \
  X(cl_event_info, CL_EVENT_COMMAND_QUEUE, 0x11D0)                    \
  X(cl_event_info, CL_EVENT_REFERENCE_COUNT, 0x11D2)                  \
  X(cl_event_info, CL_EVENT_COMMAND_EXECUTION_STATUS, 0x11D3)         \
  X(cl_int, CL_COMPLETE, 0x0)                                         \
  X(cl_int, CL_QUEUED, 0x3)
