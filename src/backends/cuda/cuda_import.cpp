// The CUDA backend: the caller's host memory, pinned as a staging source
// (cuMemHostRegister).
#include "backends/cuda/cuda_backend_impl.hpp"

namespace devbridge::cuda::detail {

HostImport CudaBackend::import_host(const ImportRequest& request) {
  switch (request.use) {
    case ImportUse::Staging:
      return HostImport{.block = register_pages(request.data, request.bytes, kMemHostRegisterPortable)};
    case ImportUse::StagingReadOnly: {
      constexpr unsigned int kFlags = kMemHostRegisterPortable | kMemHostRegisterReadOnly;
      return HostImport{.block = register_pages(request.data, request.bytes, kFlags)};
    }
    case ImportUse::Adopt: break;
  }
  return Backend::import_host(request);  // Unsupported: device memory is not host memory here
}

HostBlock CudaBackend::register_pages(std::byte* data, std::uint64_t bytes, unsigned int flags) {
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  if (data == nullptr)
    throw Error(ErrorKind::InvalidRange, "cuMemHostRegister: null host pointer (" + std::to_string(bytes) + " bytes)");
  if (bytes == 0) throw Error(ErrorKind::InvalidExtent, "cuMemHostRegister: 0 bytes at " + hex(begin));
  const auto end = checked::add(begin, bytes);
  if (!end)
    throw Error(ErrorKind::InvalidRange, "cuMemHostRegister: " + std::to_string(bytes) + " bytes at " + hex(begin) +
                                             " reach past the end of the address space");
  ContextGuard guard(driver_, context_, Operation::Allocate);
  CUresult result = driver_.cuMemHostRegister_v2(data, bytes, flags);
  if (result != CUDA_SUCCESS)
    throw make_error(driver_, result, "cuMemHostRegister", Operation::Allocate,
                     "host range [" + hex(begin) + ", " + hex(*end) + ") of " + std::to_string(bytes) + " bytes on " +
                         device_string_);
  live_registrations_.fetch_add(1, std::memory_order_relaxed);
  return HostBlock{data, bytes, true, begin};
}

void CudaBackend::release_import(const HostImport& imported) noexcept {
  const HostBlock& block = imported.block;
  if (imported.adopted || block.data == nullptr) return;
  const auto begin = reinterpret_cast<std::uintptr_t>(block.data);
  try {
    ContextGuard guard(driver_, context_, Operation::Release);
    CUresult result = driver_.cuMemHostUnregister(block.data);
    // Counted as gone even if the driver refuses otherwise (the bridge
    // never hands this block back again), but not when the driver says it
    // was never registered: then it was never counted either.
    if (result != CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
      live_registrations_.fetch_sub(1, std::memory_order_relaxed);
    if (result != CUDA_SUCCESS)
      devbridge::detail::log().warn("devbridge cuda: {} (host range {} of {} bytes)",
                                    driver_.describe_failure("cuMemHostUnregister", result), hex(begin), block.bytes);
  } catch (const std::exception& error) {
    live_registrations_.fetch_sub(1, std::memory_order_relaxed);
    devbridge::detail::log().warn("devbridge cuda: cannot unregister host range {} of {} bytes: {}", hex(begin),
                                  block.bytes, error.what());
  }
}

}  // namespace devbridge::cuda::detail
