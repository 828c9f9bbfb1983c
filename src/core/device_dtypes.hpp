// What the bridge's device holds and computes in, fixed at construction from
// the backend's BackendInfo: each dtype's element size where the device
// holds it, the dtypes it computes in (holding is not computing:
// docs/DECISIONS.md), and the refusals that name both.
//
// Read without the bridge's lock: it never changes after construction.
#pragma once

#include <array>
#include <bitset>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "core/fail.hpp"
#include "devbridge/backend.hpp"

namespace devbridge::detail {

class DeviceDtypes {
 public:
  DeviceDtypes() = default;
  explicit DeviceDtypes(const BackendInfo& info);

  // The size of `dtype`'s elements where the device holds it, else 0 (also
  // for a value that is no dtype).
  std::uint32_t element_size(DType dtype) const noexcept { return element_sizes_[static_cast<std::uint8_t>(dtype)]; }
  bool computes(DType dtype) const noexcept { return computed_.test(static_cast<std::uint8_t>(dtype)); }

  // UnsupportedDType unless the device computes in `dtype`; `what` names the call.
  void require_compute(DType dtype, std::string_view what) const {
    if (__builtin_expect(!computes(dtype), 0)) fail_not_computed(dtype, what);
  }
  // A call that computes in a dtype the device holds but does not compute
  // in: names the dtype, the device, and what it does compute in.
  [[noreturn, gnu::cold, gnu::noinline]] void fail_not_computed(DType dtype, std::string_view what) const;
  // `what` (an allocation, a view) of a dtype the device does not hold:
  // names the dtype, the device, and what it does hold.
  [[noreturn, gnu::cold, gnu::noinline]] void fail_not_held(DType dtype, std::string_view what) const;

  // The element size and view dtype of an allocation of `extent` bytes of
  // `spec`, once both are valid. Read-only: runs before the bridge's lock.
  [[gnu::always_inline]] std::pair<std::uint32_t, DType> checked_allocation(const ObjectSpec& spec,
                                                                            std::uint64_t extent) const {
    if (!is_power_of_two(spec.alignment))
      fail(ErrorKind::InvalidAlignment, "alignment {} is not a non-zero power of two", spec.alignment);
    // 0 for a dtype the device does not hold (or no dtype at all): the
    // extent check below then fails, and its cold path tells which.
    const std::uint32_t elem = spec.dtype ? element_size(*spec.dtype) : 1;
    const DType view_dtype = spec.dtype.value_or(DType::UInt8);
    if (extent == 0 || extent > spec.max_extent || (extent & (spec.alignment - 1)) || (extent & (elem - 1))) {
      if (elem == 0 && dtype_size(*spec.dtype) != 0) fail_not_held(*spec.dtype, "an allocation");
      fail(ErrorKind::InvalidExtent,
           "extent {} must be non-zero, at most max_extent {}, and a multiple of the alignment {} "
           "and of the {} size {}",
           extent, spec.max_extent, spec.alignment, spec_dtype_name(spec), elem);
    }
    return {elem, view_dtype};
  }

 private:
  // Indexed by DType's value (all 256, so no bound check).
  std::array<std::uint8_t, 256> element_sizes_{};
  std::bitset<256> computed_;
  std::string device_text_;  // "opencl device 0:0 (pthread-...)", for errors
};

}  // namespace devbridge::detail
