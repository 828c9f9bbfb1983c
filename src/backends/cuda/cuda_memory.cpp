// The CUDA backend: device memory (cuMemAlloc, aligned as asked) and the
// host ring (cuMemHostAlloc).
#include "backends/cuda/cuda_backend_impl.hpp"

namespace devbridge::cuda::detail {
namespace {

// cuMemAlloc returns addresses aligned to at least this (CUDA guarantees 256).
constexpr std::uint64_t kDriverAlignment = 256;

}  // namespace

DeviceAllocation CudaBackend::allocate(std::uint64_t bytes, std::uint64_t alignment) {
  if (bytes == 0) throw Error(ErrorKind::InvalidExtent, "CUDA allocation of 0 bytes on " + device_string_);
  if (!is_power_of_two(alignment))
    throw Error(ErrorKind::InvalidAlignment,
                "CUDA allocation alignment " + std::to_string(alignment) + " is not a power of two");
  // Alignments above the driver's are met by over-allocating and rounding
  // the address up; the base stays in the token for cuMemFree.
  std::uint64_t slack = alignment > kDriverAlignment ? alignment - kDriverAlignment : 0;
  ContextGuard guard(driver_, context_, Operation::Allocate);
  for (int attempt = 0; attempt < 2; ++attempt) {
    const auto padded = checked::add(bytes, slack);
    if (!padded)
      throw Error(ErrorKind::AllocationFailed, "CUDA allocation of " + std::to_string(bytes) +
                                                   " bytes aligned to " + std::to_string(alignment) +
                                                   " overflows");
    CUdeviceptr base = 0;
    CUresult result = driver_.cuMemAlloc_v2(&base, *padded);
    if (result != CUDA_SUCCESS) throw allocation_error(result, "cuMemAlloc", bytes, *padded, alignment);
    // The aligned address must leave `bytes` inside the block: it may move
    // at most `slack` past the base (an address that does not even fit in
    // 64 bits when rounded up does not).
    const auto address = checked::align_up(base, alignment);
    if (address && *address - base <= slack) {
      live_allocations_.fetch_add(1, std::memory_order_relaxed);
      return DeviceAllocation{*address, bytes, base};
    }
    // The driver aligned less than it promises: retry with full slack.
    driver_.cuMemFree_v2(base);
    slack = alignment - 1;
  }
  throw Error(ErrorKind::AllocationFailed,
              "cuMemAlloc could not return " + std::to_string(alignment) + "-byte aligned memory");
}

void CudaBackend::free(const DeviceAllocation& allocation) noexcept {
  // Counted as gone even if the driver refuses: the bridge never hands this
  // allocation back again.
  live_allocations_.fetch_sub(1, std::memory_order_relaxed);
  try {
    ContextGuard guard(driver_, context_, Operation::Release);
    CUresult result = driver_.cuMemFree_v2(static_cast<CUdeviceptr>(allocation.token));
    if (result != CUDA_SUCCESS)
      devbridge::detail::log().warn("devbridge cuda: {} (allocation {}, {} bytes)", driver_.describe_failure("cuMemFree", result),
                   hex(allocation.address), allocation.bytes);
  } catch (const std::exception& error) {
    devbridge::detail::log().warn("devbridge cuda: cannot free allocation {}: {}", hex(allocation.address), error.what());
  }
}

HostBlock CudaBackend::allocate_host(std::uint64_t bytes) {
  if (bytes == 0) throw Error(ErrorKind::InvalidExtent, "page-locked host block of 0 bytes");
  ContextGuard guard(driver_, context_, Operation::Allocate);
  void* data = nullptr;
  // PORTABLE: the ring stays page-locked for every context in the process
  // (tinygrad's, torch's), not only ours.
  CUresult result = driver_.cuMemHostAlloc(&data, bytes, kMemHostAllocPortable);
  if (result != CUDA_SUCCESS)
    throw make_error(driver_, result, "cuMemHostAlloc", Operation::Allocate,
                     "asked " + std::to_string(bytes) + " bytes of page-locked host memory");
  return HostBlock{static_cast<std::byte*>(data), bytes, true, reinterpret_cast<std::uintptr_t>(data)};
}

void CudaBackend::free_host(const HostBlock& block) noexcept {
  if (block.data == nullptr) return;
  try {
    ContextGuard guard(driver_, context_, Operation::Release);
    CUresult result = driver_.cuMemFreeHost(block.data);
    if (result != CUDA_SUCCESS)
      devbridge::detail::log().warn("devbridge cuda: {} ({} bytes)", driver_.describe_failure("cuMemFreeHost", result), block.bytes);
  } catch (const std::exception& error) {
    devbridge::detail::log().warn("devbridge cuda: cannot free the page-locked block: {}", error.what());
  }
}

Error CudaBackend::allocation_error(CUresult result, std::string_view call, std::uint64_t bytes, std::uint64_t padded,
                       std::uint64_t alignment) {
  std::string detail = "asked " + std::to_string(bytes) + " bytes (alignment " + std::to_string(alignment) +
                       (padded != bytes ? ", " + std::to_string(padded) + " bytes with the slack to align" : "") +
                       ") on " + device_string_;
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  if (driver_.cuMemGetInfo_v2(&free_bytes, &total_bytes) == CUDA_SUCCESS)
    detail += "; " + std::to_string(free_bytes) + " bytes free of " + std::to_string(total_bytes);
  return make_error(driver_, result, call, Operation::Allocate, detail);
}

}  // namespace devbridge::cuda::detail
