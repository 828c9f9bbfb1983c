#include "devbridge/consumer_names.hpp"

namespace devbridge {

std::string tinygrad_device(DeviceKind kind, int ordinal) {
  switch (kind) {
    case DeviceKind::Cpu:
      return "CPU";  // tinygrad has one CPU device
    case DeviceKind::Cuda:
      return "CUDA:" + std::to_string(ordinal);
    case DeviceKind::OpenCL:
      // tinygrad's OpenCL device 0 is plain "CL".
      return ordinal == 0 ? std::string("CL") : "CL:" + std::to_string(ordinal);
  }
  return "CPU";
}

DLPackDevice dlpack_device(DeviceKind kind) noexcept {
  switch (kind) {
    case DeviceKind::Cpu: return DLPackDevice::CPU;
    case DeviceKind::Cuda: return DLPackDevice::CUDA;
    case DeviceKind::OpenCL: return DLPackDevice::OpenCL;
  }
  return DLPackDevice::CPU;
}

std::string_view dlpack_device_name(DLPackDevice device) noexcept {
  switch (device) {
    case DLPackDevice::CPU: return "cpu";
    case DLPackDevice::CUDA: return "cuda";
    case DLPackDevice::CUDAHost: return "cuda_host";
    case DLPackDevice::OpenCL: return "opencl";
  }
  return "unknown";
}

}  // namespace devbridge
