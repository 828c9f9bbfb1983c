// The OpenCL backend: the compute role (axpy), built on first use.
#include "backends/opencl/opencl_backend_impl.hpp"

namespace devbridge::opencl::detail {
namespace {

// The multiply and the add are rounded separately (no contraction into a
// fused multiply-add, which PoCL does by default), so every element is
// bit-identical to the host and CUDA backends' and the worker can verify
// results exactly. x and y may be the same buffer, hence no restrict.
constexpr char kAxpySource[] = R"CLC(
#pragma OPENCL FP_CONTRACT OFF
kernel void devbridge_axpy(global const float* x, ulong x_offset, global float* y, ulong y_offset,
                           float a, float b, ulong count) {
  const size_t i = get_global_id(0);
  if (i < count) y[y_offset + i] = a * x[x_offset + i] + b;
}
)CLC";

}  // namespace

Fence OpenCLBackend::launch_axpy(const AxpyLaunch& launch) {
  // Whole float32 elements inside each buffer (the kernel indexes by element).
  const auto bytes = checked::mul(launch.count, sizeof(float));
  for (const auto& [buffer, offset] : {std::pair{launch.x, launch.x_offset}, std::pair{launch.y, launch.y_offset}}) {
    if (!bytes || offset % sizeof(float) != 0 || !checked::range_within(offset, *bytes, buffer.bytes))
      throw Error(ErrorKind::InvalidRange,
                  fmt::format("opencl axpy: {} float32 at byte offset {} do not fit a buffer of {} bytes",
                              launch.count, offset, buffer.bytes));
  }
  if (launch.count == 0) return Fence{};  // nothing runs; OpenCL refuses an empty NDRange anyway
  Owned<cl_event> gate = hold_gate();
  cl_event gate_event = gate.get();
  std::lock_guard guard(launch_mutex_);  // clSetKernelArg is not thread-safe on one kernel
  cl_kernel kernel = axpy_kernel();
  cl_mem x = as_buffer(launch.x);
  cl_mem y = as_buffer(launch.y);
  const cl_ulong x_offset = launch.x_offset / sizeof(float);
  const cl_ulong y_offset = launch.y_offset / sizeof(float);
  const cl_ulong count = launch.count;
  const auto set = [&](cl_uint index, std::size_t size, const void* value) {
    check(cl_.clSetKernelArg(kernel, index, size, value), "clSetKernelArg", Operation::Launch);
  };
  set(0, sizeof x, &x);
  set(1, sizeof x_offset, &x_offset);
  set(2, sizeof y, &y);
  set(3, sizeof y_offset, &y_offset);
  set(4, sizeof launch.a, &launch.a);
  set(5, sizeof launch.b, &launch.b);
  set(6, sizeof count, &count);
  const std::size_t global = static_cast<std::size_t>(launch.count);
  // The kernel's own event is the fence: it is created by the enqueue
  // itself, so there is no moment where the kernel runs untracked.
  cl_event done = nullptr;
  if (const cl_int result = cl_.clEnqueueNDRangeKernel(queue_.get(), kernel, 1, nullptr, &global, nullptr,
                                                       gate_event != nullptr ? 1 : 0,
                                                       gate_event != nullptr ? &gate_event : nullptr, &done);
      result != CL_SUCCESS) {
    Error error = make_error(result, "clEnqueueNDRangeKernel", Operation::Launch,
                             fmt::format("axpy over {} elements", launch.count));
    if (error.fatal()) mark_queue_unusable();
    throw error;
  }
  const Fence fence = adopt_fence(done);
  // The launch is queued whatever happens now, and its fence must reach the
  // bridge: a failed flush is logged, not thrown (the next flush or
  // quiesce's clFinish submits it).
  if (const cl_int result = cl_.clFlush(queue_.get()); result != CL_SUCCESS)
    log_failure(result, "clFlush", Operation::Launch);
  return fence;
}

cl_kernel OpenCLBackend::axpy_kernel() {
  if (axpy_) return axpy_.get();
  cl_int result = CL_SUCCESS;
  const char* source = kAxpySource;
  const std::size_t length = sizeof kAxpySource - 1;
  Owned<cl_program> program(cl_.clCreateProgramWithSource(context_.get(), 1, &source, &length, &result),
                            {cl_.clReleaseProgram});
  check(result, "clCreateProgramWithSource", Operation::Launch);
  if (const cl_int built = cl_.clBuildProgram(program.get(), 1, &choice_.device, "", nullptr, nullptr);
      built != CL_SUCCESS) {
    std::string log(4096, '\0');
    std::size_t log_size = 0;
    cl_.clGetProgramBuildInfo(program.get(), choice_.device, CL_PROGRAM_BUILD_LOG, log.size(), log.data(), &log_size);
    throw make_error(built, "clBuildProgram", Operation::Launch, "axpy kernel: " + trimmed(std::move(log)));
  }
  Owned<cl_kernel> kernel(cl_.clCreateKernel(program.get(), "devbridge_axpy", &result), {cl_.clReleaseKernel});
  check(result, "clCreateKernel", Operation::Launch);
  program_ = std::move(program);
  axpy_ = std::move(kernel);
  return axpy_.get();
}

}  // namespace devbridge::opencl::detail
