// Whether the CUDA backend can run here and, when it cannot, why and what to
// install. Most machines that lack CUDA lack only the driver (the build
// needs no toolkit), so every refusal names the library it tried and the one
// thing to install or set.
#include <string>

#include <fmt/format.h>

#include "backends/cuda/cuda_driver.hpp"
#include "backends/cuda/cuda_ptx.hpp"
#include "devbridge/backends/cuda.hpp"

namespace devbridge::cuda {
namespace {

using detail::CUdevice;
using detail::CUresult;
using detail::Driver;

constexpr const char* kInstallTheDriver =
    "install the NVIDIA driver (it provides libcuda.so.1; the CUDA toolkit is not needed), or set DEVBRIDGE_LIBCUDA "
    "to the full path of the driver's libcuda.so.1";
// The oldest driver with every entry point cuda_driver_api.hpp lists (the
// newest of them, cuDevicePrimaryCtxRelease_v2, came with CUDA 11.0).
constexpr const char* kOldestDriver = "install an NVIDIA driver for CUDA 11.0 or newer (version 450 or later)";
constexpr const char* kNoGpuVisible =
    "make a GPU visible to this process: check that nvidia-smi lists one, the container's GPU access (e.g. docker "
    "--gpus all) and CUDA_VISIBLE_DEVICES";

std::string remedy_for_init(CUresult result) {
  switch (result) {
    case detail::CUDA_ERROR_STUB_LIBRARY:
      return "the libcuda.so.1 found is the CUDA toolkit's stub, for linking only: " + std::string(kInstallTheDriver);
    case detail::CUDA_ERROR_NO_DEVICE:
      return kNoGpuVisible;
    case detail::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
      return "libcuda.so.1 and the loaded NVIDIA kernel module are different driver versions: reboot after a driver "
             "upgrade, or reinstall one driver";
    case detail::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
      return "the CUDA forward-compatibility libcuda.so.1 does not serve this GPU: load the driver's own (take the "
             "compat folder out of LD_LIBRARY_PATH)";
    default:
      return "check that nvidia-smi lists the GPU; reinstall the NVIDIA driver if it does not";
  }
}

std::string version_text(int cuda_version) {
  return fmt::format("{}.{}", cuda_version / 1000, cuda_version % 1000 / 10);
}

// Why the kernel cannot run on device `ordinal` with this driver (its PTX is
// too new for the driver, or the GPU too old for every image); empty when it
// can. Sets `remedy` with the reason.
std::string kernel_refusal(const Driver& driver, int ordinal, std::string& remedy) {
  CUdevice device = 0;
  int major = 0;
  int minor = 0;
  if (CUresult got = driver.cuDeviceGet(&device, ordinal); got != detail::CUDA_SUCCESS) {
    remedy = kNoGpuVisible;
    return fmt::format("cuDeviceGet({}) failed: {}", ordinal, driver.error_name(got));
  }
  if (driver.cuDeviceGetAttribute(&major, detail::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device) !=
          detail::CUDA_SUCCESS ||
      driver.cuDeviceGetAttribute(&minor, detail::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device) !=
          detail::CUDA_SUCCESS)
    return {};  // the backend's own setup reports it, with the device's name
  const int capability = major * 10 + minor;
  const detail::PtxImage* image = detail::select_ptx(capability);
  if (image == nullptr) {
    const int oldest = detail::embedded_ptx().front().compute_capability;
    remedy = fmt::format("use a GPU of compute capability {}.{} or newer", oldest / 10, oldest % 10);
    return fmt::format("GPU {} has compute capability {}.{}; the kernel's PTX targets {}.{} and newer", ordinal, major,
                       minor, oldest / 10, oldest % 10);
  }
  const int needed_isa = detail::oldest_ptx_isa_for_target(image->compute_capability);
  const int driver_isa = detail::max_ptx_isa_for_driver(driver.driver_version);
  if (driver_isa == 0 || driver_isa >= needed_isa) return {};
  const int needed_driver = detail::oldest_driver_for_ptx_isa(needed_isa);
  remedy = fmt::format("install an NVIDIA driver for CUDA {} or newer", version_text(needed_driver));
  return fmt::format(
      "the driver (CUDA {}) is too old for the kernel's PTX on GPU {}: compute_{} needs PTX ISA {}.{} (CUDA {})",
      version_text(driver.driver_version), ordinal, image->compute_capability, needed_isa / 10, needed_isa % 10,
      version_text(needed_driver));
}

}  // namespace

Probe probe() {
  const Driver& driver = detail::driver();
  Probe result;
  if (!driver.loaded()) {
    result.reason = "no driver (" + driver.load_error + ")";
    result.remedy = driver.opened ? kOldestDriver : kInstallTheDriver;
    return result;
  }
  if (driver.init_result != detail::CUDA_SUCCESS) {
    result.reason = "cuInit failed: " + driver.error_name(driver.init_result);
    result.remedy = remedy_for_init(driver.init_result);
    return result;
  }
  int count = 0;
  if (CUresult counted = driver.cuDeviceGetCount(&count); counted != detail::CUDA_SUCCESS) {
    result.reason = "cuDeviceGetCount failed: " + driver.error_name(counted);
    result.remedy = remedy_for_init(counted);
    return result;
  }
  result.device_count = count;
  if (count <= 0) {
    result.reason = "no CUDA device";
    result.remedy = kNoGpuVisible;
    return result;
  }
  // Available when the kernel runs on at least one GPU; otherwise the first
  // GPU's refusal speaks for all (a machine's GPUs are usually alike).
  std::string first_reason;
  std::string first_remedy;
  for (int ordinal = 0; ordinal < count; ++ordinal) {
    std::string remedy;
    std::string reason = kernel_refusal(driver, ordinal, remedy);
    if (reason.empty()) {
      result.available = true;
      return result;
    }
    if (first_reason.empty()) {
      first_reason = std::move(reason);
      first_remedy = std::move(remedy);
    }
  }
  result.reason = std::move(first_reason);
  result.remedy = std::move(first_remedy);
  return result;
}

}  // namespace devbridge::cuda
