// The OpenCL API, loaded at run time from the ICD loader (libOpenCL.so.1, or
// the file named by $DEVBRIDGE_LIBOPENCL). CL/cl.h supplies only the types.
#pragma once

#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

// cl_khr_icd (CL/cl_ext.h): what the ICD loader answers when no driver is registered.
#ifndef CL_PLATFORM_NOT_FOUND_KHR
#define CL_PLATFORM_NOT_FOUND_KHR -1001
#endif

#include <string>

namespace devbridge::opencl::detail {

// X(symbol): a member declared with the type of cl.h's `symbol`, loaded from
// the symbol of that name. Only OpenCL 1.2 entry points (the rect copies are
// 1.1), so any ICD serves.
#define DEVBRIDGE_OPENCL_ENTRY_POINTS(X) \
  X(clGetPlatformIDs)                    \
  X(clGetPlatformInfo)                   \
  X(clGetDeviceIDs)                      \
  X(clGetDeviceInfo)                     \
  X(clCreateContext)                     \
  X(clReleaseContext)                    \
  X(clGetContextInfo)                    \
  X(clCreateCommandQueue)                \
  X(clReleaseCommandQueue)               \
  X(clGetCommandQueueInfo)               \
  X(clCreateBuffer)                      \
  X(clReleaseMemObject)                  \
  X(clRetainMemObject)                   \
  X(clCreateSubBuffer)                   \
  X(clGetMemObjectInfo)                  \
  X(clEnqueueWriteBuffer)                \
  X(clEnqueueReadBuffer)                 \
  X(clEnqueueWriteBufferRect)            \
  X(clEnqueueReadBufferRect)             \
  X(clEnqueueMapBuffer)                  \
  X(clEnqueueUnmapMemObject)             \
  X(clEnqueueNDRangeKernel)              \
  X(clEnqueueMarkerWithWaitList)         \
  X(clEnqueueBarrierWithWaitList)        \
  X(clCreateUserEvent)                   \
  X(clSetUserEventStatus)                \
  X(clSetEventCallback)                  \
  X(clRetainEvent)                       \
  X(clReleaseEvent)                      \
  X(clGetEventInfo)                      \
  X(clWaitForEvents)                     \
  X(clFlush)                             \
  X(clFinish)                            \
  X(clCreateProgramWithSource)           \
  X(clBuildProgram)                      \
  X(clGetProgramBuildInfo)               \
  X(clReleaseProgram)                    \
  X(clCreateKernel)                      \
  X(clReleaseKernel)                     \
  X(clSetKernelArg)

// One loaded copy of the ICD loader, never unloaded (see dynamic_library.hpp).
struct Api {
  std::string path;        // what was dlopen()ed
  std::string load_error;  // empty when every entry point was found

#define DEVBRIDGE_OPENCL_DECLARE_ENTRY(symbol) decltype(&::symbol) symbol = nullptr;
  DEVBRIDGE_OPENCL_ENTRY_POINTS(DEVBRIDGE_OPENCL_DECLARE_ENTRY)
#undef DEVBRIDGE_OPENCL_DECLARE_ENTRY

  bool loaded() const noexcept { return load_error.empty(); }
};

// The process-wide API, loaded on first use; a failure is recorded in
// load_error, never thrown.
const Api& api();

}  // namespace devbridge::opencl::detail
