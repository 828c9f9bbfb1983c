// The OpenCL backend: device memory (cl_mem buffers) and the host ring (a
// mapped CL_MEM_ALLOC_HOST_PTR buffer).
#include "backends/opencl/opencl_backend_impl.hpp"

namespace devbridge::opencl::detail {

DeviceAllocation OpenCLBackend::allocate(std::uint64_t bytes, std::uint64_t /*alignment*/) {
  if (bytes > max_buffer_bytes_) {
    throw Error(ErrorKind::AllocationFailed,
                fmt::format("opencl: {} bytes asked; {} holds at most {} bytes per buffer "
                            "(CL_DEVICE_MAX_MEM_ALLOC_SIZE) of {} bytes of memory",
                            bytes, device_name_, max_buffer_bytes_, total_memory_));
  }
  cl_int result = CL_SUCCESS;
  cl_mem buffer = cl_.clCreateBuffer(context_.get(), CL_MEM_READ_WRITE, bytes, nullptr, &result);
  if (result != CL_SUCCESS) {
    throw make_error(result, "clCreateBuffer", Operation::Allocate,
                     fmt::format("{} bytes asked of {} bytes of device memory (OpenCL reports no free figure)", bytes,
                                 total_memory_));
  }
  live_allocations_.fetch_add(1, std::memory_order_relaxed);
  const auto handle = reinterpret_cast<std::uintptr_t>(buffer);
  return DeviceAllocation{handle, bytes, handle};
}

void OpenCLBackend::free(const DeviceAllocation& allocation) noexcept {
  // The driver keeps the buffer until queued commands that use it finish.
  if (const cl_int result = cl_.clReleaseMemObject(as_buffer(allocation)); result != CL_SUCCESS)
    devbridge::detail::log().warn("devbridge opencl: {}", make_error(result, "clReleaseMemObject", Operation::Release).what());
  live_allocations_.fetch_sub(1, std::memory_order_relaxed);
}

HostBlock OpenCLBackend::allocate_host(std::uint64_t bytes) {
  // One page more than asked, so the block can start on a page boundary
  // (the ring hands out reservations aligned up to 4096). A size within a
  // page of 2^64 would wrap into a tiny buffer the ring then overruns.
  const auto padded = checked::add(bytes, page_size_);
  if (!padded || (max_buffer_bytes_ != 0 && *padded > max_buffer_bytes_)) {
    throw Error(ErrorKind::AllocationFailed,
                fmt::format("opencl: a host ring of {} bytes (one {}-byte page more, for alignment) is more than {} "
                            "holds in one buffer ({} bytes, CL_DEVICE_MAX_MEM_ALLOC_SIZE)",
                            bytes, page_size_, device_name_, max_buffer_bytes_));
  }
  const std::uint64_t mapped_bytes = *padded;
  cl_int result = CL_SUCCESS;
  Owned<cl_mem> buffer(
      cl_.clCreateBuffer(context_.get(), CL_MEM_READ_WRITE | CL_MEM_ALLOC_HOST_PTR, mapped_bytes, nullptr, &result),
      {cl_.clReleaseMemObject});
  if (result != CL_SUCCESS)
    throw make_error(result, "clCreateBuffer(CL_MEM_ALLOC_HOST_PTR)", Operation::Allocate,
                     fmt::format("{} bytes for a host ring of {} bytes", mapped_bytes, bytes));
  void* mapped = cl_.clEnqueueMapBuffer(queue_.get(), buffer.get(), CL_TRUE, CL_MAP_READ | CL_MAP_WRITE, 0,
                                        mapped_bytes, 0, nullptr, nullptr, &result);
  if (result != CL_SUCCESS)
    throw make_error(result, "clEnqueueMapBuffer", Operation::Allocate,
                     fmt::format("{} bytes for a host ring of {} bytes", mapped_bytes, bytes));
  auto mapping = std::make_unique<HostMapping>(HostMapping{buffer.release(), mapped});
  // Cannot wrap: the mapping is at least a page long, so the next page
  // boundary at or after it lies inside it.
  const auto start = (reinterpret_cast<std::uintptr_t>(mapped) + page_size_ - 1) & ~(page_size_ - 1);
  return HostBlock{reinterpret_cast<std::byte*>(start), bytes, false,
                   reinterpret_cast<std::uintptr_t>(mapping.release())};
}

void OpenCLBackend::free_host(const HostBlock& block) noexcept {
  std::unique_ptr<HostMapping> mapping(reinterpret_cast<HostMapping*>(block.token));
  if (!mapping) return;
  if (const cl_int result =
          cl_.clEnqueueUnmapMemObject(queue_.get(), mapping->buffer, mapping->mapped, 0, nullptr, nullptr);
      result != CL_SUCCESS)
    devbridge::detail::log().warn("devbridge opencl: {}", make_error(result, "clEnqueueUnmapMemObject", Operation::Release).what());
  cl_.clReleaseMemObject(mapping->buffer);
}

}  // namespace devbridge::opencl::detail
