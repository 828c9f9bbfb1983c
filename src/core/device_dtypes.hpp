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

  // The element size and view dtype of an allocation of `spec`: byte
  // elements and uint8 views when untyped; the element size is 0 for a
  // dtype the device does not hold (checked_allocation refuses those).
  [[gnu::always_inline]] std::pair<std::uint32_t, DType> element_of(const ObjectSpec& spec) const noexcept {
    if (!spec.dtype) return {1, DType::UInt8};
    return {element_size(*spec.dtype), *spec.dtype};
  }

  // element_of(spec), once an allocation of `extent` bytes of it is valid:
  // its alignment a power of two, its dtype one the device holds, the
  // extent non-zero, within max_extent and whole elements and alignments.
  // One predicate (64-bit masks: an element size of 0, not held, leaves
  // every bit set, so no extent passes as a multiple of it); the cold path
  // says which rule failed. Read-only: runs before the bridge's lock.
  [[gnu::always_inline]] std::pair<std::uint32_t, DType> checked_allocation(const ObjectSpec& spec,
                                                                            std::uint64_t extent) const {
    const auto element = element_of(spec);
    if (!is_power_of_two(spec.alignment) || extent == 0 || extent > spec.max_extent ||
        (extent & ((spec.alignment - 1) | (std::uint64_t{element.first} - 1))))
      fail_allocation(spec, extent);
    return element;
  }
  [[noreturn, gnu::cold, gnu::noinline]] void fail_allocation(const ObjectSpec& spec, std::uint64_t extent) const;

 private:
  // Indexed by DType's value (all 256, so no bound check).
  std::array<std::uint8_t, 256> element_sizes_{};
  std::bitset<256> computed_;
  std::string device_text_;  // "opencl device 0:0 (pthread-...)", for errors
};

}  // namespace devbridge::detail
