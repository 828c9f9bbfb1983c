// How consumers name a backend's device. A backend says what kind of device
// it is and its ordinal (BackendInfo::device_kind, device_ordinal); tinygrad
// and DLPack each spell that their own way, and this is the one place that
// knows their spellings, so a backend, and the seam, never follows them.
// The bridge names its views with it (TensorView::device,
// dlpack_device_type); the Python module and the CLI name devices with it.
#pragma once

#include <string>
#include <string_view>

#include "devbridge/types.hpp"

namespace devbridge {

// DLPack device types (dlpack.h DLDeviceType), kept here so no DLPack header
// is needed above the bindings (as DLPackTypeCode in types.hpp).
enum class DLPackDevice : int { CPU = 1, CUDA = 2, CUDAHost = 3, OpenCL = 4 };

// tinygrad's device name: "CPU"; "CUDA:<ordinal>"; "CL" for OpenCL device 0
// and "CL:<ordinal>" past it.
std::string tinygrad_device(DeviceKind kind, int ordinal);

// The DLPack device type; DLPack's device id is the ordinal.
DLPackDevice dlpack_device(DeviceKind kind) noexcept;

// The lower-case name of a DLPack device type: "cpu", "cuda", "cuda_host",
// "opencl".
std::string_view dlpack_device_name(DLPackDevice device) noexcept;

}  // namespace devbridge
