// Proves devbridge's in-tree OpenCL declarations (opencl_api_types.hpp)
// equal to the real headers' wherever CL/cl.h is installed. Nothing runs:
// every comparison is a static_assert, so a mismatch fails the build.
//
// cl.h's types are global and ours live in devbridge::opencl::abi, so both
// sets coexist here. cl.h's constants are macros, which our definitions
// (opencl_api.hpp) would collide with: they are compared through the lists
// instead, where each `name` expands to cl.h's value.
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <CL/cl_ext.h>

#include <cstddef>
#include <type_traits>
#include <utility>

#include "backends/opencl/opencl_api_types.hpp"

namespace {

namespace abi = devbridge::opencl::abi;

// ---- constants ----

#define DEVBRIDGE_CHECK_CONSTANT(type, name, value)                                       \
  static_assert(std::cmp_equal(name, value), #name " is not " #value " in CL/cl.h"); \
  static_assert(std::in_range<abi::type>(name), "CL/cl.h's " #name " does not fit " #type);
DEVBRIDGE_OPENCL_CONSTANTS(DEVBRIDGE_CHECK_CONSTANT)
#undef DEVBRIDGE_CHECK_CONSTANT

// ---- scalar types: the very same types, so the same size and signedness ----

#define DEVBRIDGE_CHECK_SCALAR(name, underlying) \
  static_assert(std::is_same_v<abi::name, ::name>, "abi::" #name " is not CL/cl.h's " #name);
DEVBRIDGE_OPENCL_SCALAR_TYPES(DEVBRIDGE_CHECK_SCALAR)
#undef DEVBRIDGE_CHECK_SCALAR

// ---- handles and structs: distinct types, each with one counterpart ----

template <class Ours>
struct Counterpart {
  static constexpr bool known = false;
};

#define DEVBRIDGE_MAP_COUNTERPART(name) \
  template <>                           \
  struct Counterpart<abi::name> {       \
    static constexpr bool known = true; \
    using type = ::name;                \
  };
DEVBRIDGE_OPENCL_HANDLE_TYPES(DEVBRIDGE_MAP_COUNTERPART)
DEVBRIDGE_MAP_COUNTERPART(cl_buffer_region)
DEVBRIDGE_MAP_COUNTERPART(cl_device_pci_bus_info_khr)
#undef DEVBRIDGE_MAP_COUNTERPART

// True when a value of type Ours passes through the ABI exactly as one of
// Theirs: the same type, or each other's counterparts, or pointers to such
// with the same qualifiers, or functions whose result and parameters (as
// many) all are.
template <class Ours, class Theirs>
consteval bool same_shape();

template <class Ours, class Theirs>
struct SameSignature : std::false_type {};

template <class OursResult, class... OursParameters, class TheirsResult, class... TheirsParameters>
struct SameSignature<OursResult(OursParameters...), TheirsResult(TheirsParameters...)> {
  static constexpr bool value = [] {
    if constexpr (sizeof...(OursParameters) != sizeof...(TheirsParameters)) {
      return false;
    } else {
      return same_shape<OursResult, TheirsResult>() && (same_shape<OursParameters, TheirsParameters>() && ...);
    }
  }();
};

template <class Ours, class Theirs>
consteval bool same_shape() {
  using OursBare = std::remove_cv_t<Ours>;
  using TheirsBare = std::remove_cv_t<Theirs>;
  if constexpr (std::is_const_v<Ours> != std::is_const_v<Theirs> ||
                std::is_volatile_v<Ours> != std::is_volatile_v<Theirs>) {
    return false;
  } else if constexpr (Counterpart<OursBare>::known) {
    return std::is_same_v<typename Counterpart<OursBare>::type, TheirsBare>;
  } else if constexpr (std::is_pointer_v<OursBare> && std::is_pointer_v<TheirsBare>) {
    return same_shape<std::remove_pointer_t<OursBare>, std::remove_pointer_t<TheirsBare>>();
  } else if constexpr (std::is_function_v<OursBare> && std::is_function_v<TheirsBare>) {
    return SameSignature<OursBare, TheirsBare>::value;
  } else {
    return std::is_same_v<OursBare, TheirsBare>;
  }
}

// The comparison can fail: a handle for another, a lost const, an argument
// too few (else every check below could pass vacuously).
static_assert(!same_shape<abi::PFN_clReleaseEvent, decltype(&::clReleaseMemObject)>());
static_assert(!same_shape<const abi::cl_event*, ::cl_event*>());
static_assert(!same_shape<void (*)(abi::cl_event), void (*)(::cl_event, ::cl_int)>());

#define DEVBRIDGE_CHECK_STRUCT_FIELD(type, field)                                                           \
  static_assert(offsetof(abi::type, field) == offsetof(::type, field) &&                                  \
                    same_shape<decltype(abi::type::field), decltype(::type::field)>(),                    \
                "abi::" #type "::" #field " differs from the OpenCL headers'");
#define DEVBRIDGE_CHECK_STRUCT_SIZE(type)                                                                      \
  static_assert(sizeof(abi::type) == sizeof(::type) && alignof(abi::type) == alignof(::type), \
                "abi::" #type " differs in size or alignment from the OpenCL headers'");

DEVBRIDGE_CHECK_STRUCT_SIZE(cl_buffer_region)
DEVBRIDGE_CHECK_STRUCT_FIELD(cl_buffer_region, origin)
DEVBRIDGE_CHECK_STRUCT_FIELD(cl_buffer_region, size)

DEVBRIDGE_CHECK_STRUCT_SIZE(cl_device_pci_bus_info_khr)
DEVBRIDGE_CHECK_STRUCT_FIELD(cl_device_pci_bus_info_khr, pci_domain)
DEVBRIDGE_CHECK_STRUCT_FIELD(cl_device_pci_bus_info_khr, pci_bus)
DEVBRIDGE_CHECK_STRUCT_FIELD(cl_device_pci_bus_info_khr, pci_device)
DEVBRIDGE_CHECK_STRUCT_FIELD(cl_device_pci_bus_info_khr, pci_function)

#undef DEVBRIDGE_CHECK_STRUCT_SIZE
#undef DEVBRIDGE_CHECK_STRUCT_FIELD

// ---- entry points (and through them, the callbacks they take) ----

#define DEVBRIDGE_CHECK_ENTRY_POINT(symbol, result, parameters)           \
  static_assert(same_shape<abi::PFN_##symbol, decltype(&::symbol)>(), \
                "abi::PFN_" #symbol " differs from CL/cl.h's " #symbol);
DEVBRIDGE_OPENCL_ENTRY_POINTS(DEVBRIDGE_CHECK_ENTRY_POINT)
#undef DEVBRIDGE_CHECK_ENTRY_POINT

}  // namespace
