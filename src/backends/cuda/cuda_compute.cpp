// The CUDA backend: the compute role (the embedded PTX kernel, JIT-loaded)
// and its launch on the compute stream.
#include "backends/cuda/cuda_backend_impl.hpp"

namespace devbridge::cuda::detail {
namespace {

constexpr unsigned kAxpyBlockSize = 256;

}  // namespace

Fence CudaBackend::launch_axpy(const AxpyLaunch& launch) {
  if (launch.count == 0) return Fence{};  // nothing is queued: nothing to wait for
  check_axpy_range("x", launch.x, launch.x_offset, launch.count);
  check_axpy_range("y", launch.y, launch.y_offset, launch.count);
  // Both ranges lie inside their allocations (checked above): no wrap.
  CUdeviceptr x = launch.x.address + launch.x_offset;
  CUdeviceptr y = launch.y.address + launch.y_offset;
  unsigned long long count = launch.count;
  float a = launch.a;
  float b = launch.b;
  void* arguments[] = {&x, &y, &count, &a, &b};
  const unsigned long long wanted_blocks = count / kAxpyBlockSize + (count % kAxpyBlockSize != 0 ? 1 : 0);
  const unsigned blocks = static_cast<unsigned>(
      std::min<unsigned long long>(wanted_blocks, static_cast<unsigned long long>(multiprocessors_) * 16));

  ContextGuard guard(driver_, context_, Operation::Launch);
  FenceEvent fence(fences_, fences_.acquire(Operation::Launch, "cuEventCreate(launch fence)"));
  std::lock_guard compute_lock(compute_mutex_);
  // Wait (on the device) for everything already submitted on both lanes.
  record_marker(upload_, upload_marker_);
  record_marker(download_, download_marker_);
  check(driver_, driver_.cuStreamWaitEvent(compute_, upload_marker_, 0), "cuStreamWaitEvent(compute after uploads)",
        Operation::Launch);
  check(driver_, driver_.cuStreamWaitEvent(compute_, download_marker_, 0),
        "cuStreamWaitEvent(compute after downloads)", Operation::Launch);
  check(driver_,
        driver_.cuLaunchKernel(axpy_, blocks, 1, 1, kAxpyBlockSize, 1, 1, 0, compute_, arguments, nullptr),
        "cuLaunchKernel(" + std::string(detail::kAxpyKernelName) + ", " + std::to_string(count) + " elements)",
        Operation::Launch);
  for (auto [event, call] : {std::pair{kernel_done_, "cuEventRecord(after kernel)"},
                             std::pair{fence.get(), "cuEventRecord(launch fence)"}}) {
    CUresult recorded = driver_.cuEventRecord(event, compute_);
    if (recorded != CUDA_SUCCESS) {
      // Later copies could not be ordered after this kernel, or its end
      // could not be reported: finish it now.
      synchronize(compute_, "compute, after a failed cuEventRecord");
      throw make_error(driver_, recorded, call, Operation::Launch);
    }
  }
  launches_.fetch_add(1, std::memory_order_release);
  return Fence{reinterpret_cast<std::uintptr_t>(fence.release())};
}

std::string CudaBackend::load_kernel() {
  const detail::PtxImage* image = detail::select_ptx(compute_capability_);
  if (image == nullptr)
    throw Error(ErrorKind::Unsupported,
                device_string_ + " (" + device_name_ + ") has compute capability " +
                    std::to_string(compute_capability_ / 10) + "." + std::to_string(compute_capability_ % 10) +
                    "; this build's kernel needs " +
                    std::to_string(detail::embedded_ptx().front().compute_capability / 10) + "." +
                    std::to_string(detail::embedded_ptx().front().compute_capability % 10) + " or newer");
  std::string note = "kernel JIT from compute_" + std::to_string(image->compute_capability) + " PTX";
  std::string text(image->text);
  CUresult result = load_module(text);
  if (result == CUDA_ERROR_UNSUPPORTED_PTX_VERSION) {
    // The driver predates the toolkit that wrote the PTX. The kernel uses
    // nothing newer than its target's ISA, so declare the driver's newest.
    const int driver_isa = detail::max_ptx_isa_for_driver(driver_.driver_version);
    const int image_isa = detail::ptx_isa_version(text);
    if (driver_isa > 0 && driver_isa < image_isa) {
      text = detail::with_ptx_isa_version(text, driver_isa);
      result = load_module(text);
      note += " (ISA lowered to " + std::to_string(driver_isa / 10) + "." + std::to_string(driver_isa % 10) +
              " for this driver)";
    }
  }
  if (result != CUDA_SUCCESS)
    throw make_error(driver_, result, "cuModuleLoadDataEx(compute_" + std::to_string(image->compute_capability) +
                                          " PTX)",
                     Operation::Setup, jit_log_.empty() ? std::string() : "JIT log: " + jit_log_);
  check(driver_, driver_.cuModuleGetFunction(&axpy_, module_, detail::kAxpyKernelName), "cuModuleGetFunction",
        Operation::Setup);
  return note;
}

CUresult CudaBackend::load_module(const std::string& ptx) {
  char log[4096] = {};
  CUjit_option options[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[] = {log, reinterpret_cast<void*>(static_cast<std::uintptr_t>(sizeof log - 1))};
  CUresult result = driver_.cuModuleLoadDataEx(&module_, ptx.c_str(), 2, options, values);
  jit_log_ = log;
  if (result != CUDA_SUCCESS) module_ = nullptr;
  return result;
}

void CudaBackend::check_axpy_range(const char* name, const DeviceAllocation& allocation, std::uint64_t offset,
                      std::uint64_t count) const {
  // A misaligned or out-of-bounds access faults the whole context
  // (sticky), so refuse it here with an ordinary error. Bounds first: only
  // an offset inside the allocation gives an address that cannot wrap.
  const auto bytes = checked::mul(count, sizeof(float));
  if (!bytes || !checked::range_within(offset, *bytes, allocation.bytes))
    throw Error(ErrorKind::InvalidRange, std::string("axpy ") + name + ": " + std::to_string(count) +
                                             " float32 at offset " + std::to_string(offset) +
                                             " overrun allocation " + hex(allocation.address) + " of " +
                                             std::to_string(allocation.bytes) + " bytes");
  const std::uint64_t address = allocation.address + offset;
  if (address % alignof(float) != 0)
    throw Error(ErrorKind::InvalidRange, std::string("axpy ") + name + " at " + hex(address) +
                                             " is not aligned to float32");
}

}  // namespace devbridge::cuda::detail
