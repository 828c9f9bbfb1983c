// The compute role's kernel as PTX text: checked in (ptx/, written by
// scripts/regenerate-ptx.sh) and embedded in the library at build time
// (generated cuda_axpy_ptx.cpp). The driver JIT-
// compiles the image that matches the device when the backend is created.
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace devbridge::cuda::detail {

struct PtxImage {
  int compute_capability;  // the image's target, e.g. 90 for compute_90
  std::string_view text;
};

// The kernel's entry point in every image.
inline constexpr const char* kAxpyKernelName = "devbridge_axpy_f32";

// Every image, ordered by ascending compute capability.
std::span<const PtxImage> embedded_ptx() noexcept;

// The newest image whose target the device can run (target <= the device's
// capability, major*10+minor). Null when the device is older than all of them.
const PtxImage* select_ptx(int device_compute_capability) noexcept;

// The oldest PTX ISA that can target compute_<compute_capability> (75 ->
// 63): how far an image's ISA can be lowered for an older driver.
int oldest_ptx_isa_for_target(int compute_capability) noexcept;

// The PTX ISA version an image declares (".version 9.0" -> 90); 0 if absent.
int ptx_isa_version(std::string_view ptx) noexcept;

// The same PTX declaring ISA `isa` (e.g. 84) instead: lets an older driver
// JIT a kernel this simple, which uses nothing newer than the ISA of its
// target architecture. Returns the text unchanged when there is no .version.
std::string with_ptx_isa_version(std::string_view ptx, int isa);

}  // namespace devbridge::cuda::detail
