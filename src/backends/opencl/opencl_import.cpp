// The OpenCL backend: the caller's host memory, registered (a
// CL_MEM_USE_HOST_PTR buffer) and adopted in place (that buffer, or a
// sub-buffer of it).
#include "backends/opencl/opencl_backend_impl.hpp"

namespace devbridge::opencl::detail {

HostImport OpenCLBackend::import_host(const ImportRequest& request) {
  switch (request.use) {
    case ImportUse::Staging:
      return HostImport{.block = register_pages(request.data, request.bytes, CL_MEM_READ_WRITE)};
    case ImportUse::StagingReadOnly:
      return HostImport{.block = register_pages(request.data, request.bytes, CL_MEM_READ_ONLY)};
    case ImportUse::Adopt: break;
  }
  return HostImport{.device = adopt_host(request.region, request.offset, request.bytes), .adopted = true};
}

HostBlock OpenCLBackend::register_pages(std::byte* data, std::uint64_t bytes, cl_mem_flags access) {
  const auto where = [&] {
    return fmt::format("registering {} bytes of host memory at {}", bytes, static_cast<const void*>(data));
  };
  // Refused before the driver sees it, in the words it would use: OpenCL
  // has no empty buffer and none past the device's per-buffer limit.
  if (bytes == 0 || (max_buffer_bytes_ != 0 && bytes > max_buffer_bytes_))
    throw Error(ErrorKind::InvalidExtent,
                fmt::format("opencl: {}: {} holds buffers of 1 to {} bytes (CL_DEVICE_MAX_MEM_ALLOC_SIZE)", where(),
                            device_name_, max_buffer_bytes_));
  cl_int result = CL_SUCCESS;
  cl_mem buffer = cl_.clCreateBuffer(context_.get(), access | CL_MEM_USE_HOST_PTR, bytes, data, &result);
  if (result != CL_SUCCESS) {
    const std::string failure = fmt::format("clCreateBuffer(CL_MEM_USE_HOST_PTR): {} ({}); {}",
                                            detail::error_name(result), result, where());
    switch (result) {
      case CL_INVALID_BUFFER_SIZE:
        throw Error(ErrorKind::InvalidExtent,
                    fmt::format("{} ({} holds buffers of at most {} bytes, CL_DEVICE_MAX_MEM_ALLOC_SIZE)", failure,
                                device_name_, max_buffer_bytes_));
      // The driver could not pin or track this much: the registration
      // fails, the device does not (unlike a queue's CL_OUT_OF_RESOURCES,
      // nothing was enqueued that could be left half done).
      case CL_MEM_OBJECT_ALLOCATION_FAILURE:
      case CL_OUT_OF_RESOURCES:
      case CL_OUT_OF_HOST_MEMORY:
        throw Error(ErrorKind::AllocationFailed, failure);
      default:
        throw make_error(result, "clCreateBuffer(CL_MEM_USE_HOST_PTR)", Operation::Allocate, where());
    }
  }
  live_registrations_.fetch_add(1, std::memory_order_relaxed);
  return HostBlock{data, bytes, false, reinterpret_cast<std::uintptr_t>(buffer)};
}

void OpenCLBackend::release_import(const HostImport& imported) noexcept {
  if (imported.adopted) {
    if (const cl_int result = cl_.clReleaseMemObject(as_buffer(imported.device)); result != CL_SUCCESS)
      log_failure(result, "clReleaseMemObject(adopted host memory)", Operation::Release);
    return;
  }
  const HostBlock& block = imported.block;
  if (block.token == 0) return;
  if (const cl_int result = cl_.clReleaseMemObject(reinterpret_cast<cl_mem>(block.token)); result != CL_SUCCESS)
    log_failure(result, "clReleaseMemObject(registered host memory)", Operation::Release);
  live_registrations_.fetch_sub(1, std::memory_order_relaxed);
}

DeviceAllocation OpenCLBackend::adopt_host(const HostBlock& region, std::uint64_t offset, std::uint64_t bytes) {
  const auto whole = reinterpret_cast<cl_mem>(region.token);
  const auto where = [&] {
    return fmt::format("adopting bytes [{}, +{}) of host memory registered at {}", offset, bytes,
                       static_cast<const void*>(region.data));
  };
  cl_mem buffer = whole;
  if (offset == 0 && bytes == region.bytes) {
    check(cl_.clRetainMemObject(whole), "clRetainMemObject", Operation::Allocate);
  } else {
    const auto align_bits = device_value<cl_uint>(cl_, choice_.device, CL_DEVICE_MEM_BASE_ADDR_ALIGN);
    const std::uint64_t align = std::max<std::uint64_t>(align_bits / 8, 1);
    if (offset % align != 0)
      throw Error(ErrorKind::InvalidAlignment,
                  fmt::format("opencl: {}: a part of a buffer must start at a multiple of {} bytes on {} "
                              "(CL_DEVICE_MEM_BASE_ADDR_ALIGN)",
                              where(), align, device_name_));
    const cl_buffer_region part{offset, bytes};
    cl_int result = CL_SUCCESS;
    buffer = cl_.clCreateSubBuffer(whole, CL_MEM_READ_ONLY, CL_BUFFER_CREATE_TYPE_REGION, &part, &result);
    if (result != CL_SUCCESS) throw make_error(result, "clCreateSubBuffer", Operation::Allocate, where());
  }
  const auto handle = reinterpret_cast<std::uintptr_t>(buffer);
  return DeviceAllocation{handle, bytes, handle};
}

}  // namespace devbridge::opencl::detail
