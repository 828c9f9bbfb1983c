// The C ABI's boundary rules, in one place: how a C++ failure becomes a
// status and a message, how a caller's pointers and sized structs are
// checked, and how the C handle triples become the C++ ones. Every entry
// point is `return guarded([&] { ... });`, so no exception ever reaches C.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <span>
#include <type_traits>

#include "devbridge/bridge.hpp"
#include "devbridge/c/devbridge.h"
#include "devbridge/checked.hpp"
#include "devbridge/error.hpp"

struct devbridge_bridge {
  devbridge::Bridge bridge;
};

namespace devbridge::c_api {

// The one translation of a failure into a status: the message is kept for
// devbridge_last_error_message() on this thread. Never throws.
devbridge_status fail(ErrorKind kind, std::string_view message) noexcept;
// The exception in flight as a status (devbridge::Error keeps its kind;
// std::bad_alloc is AllocationFailed; boundary.cpp says the rest). Only
// inside a catch block.
devbridge_status translate_current_exception() noexcept;

// Runs an entry point's body: DEVBRIDGE_OK, or whatever it threw, translated.

template <class Body>
devbridge_status guarded(Body&& body) noexcept {
  try {
    body();
    return DEVBRIDGE_OK;
  } catch (...) {
    return translate_current_exception();
  }
}

constexpr devbridge_status status_of(ErrorKind kind) noexcept { return static_cast<devbridge_status>(kind) + 1; }

// A failure of the caller's arguments (a NULL pointer, a short struct, a
// reserved field set): the vocabulary has no InvalidArgument, and InvalidRange
// ("a range the caller gave is not valid") is the kind that fits.
[[noreturn]] void invalid_argument(std::string_view message);

// A pointer the call needs. `what` names the parameter.
template <class T>
T& required(T* pointer, std::string_view what) {
  if (pointer == nullptr) invalid_argument(std::string(what) + " is NULL");
  return *pointer;
}

inline devbridge::Bridge& bridge_of(devbridge_bridge* bridge) { return required(bridge, "bridge").bridge; }

// An array the caller gives as a pointer and a count: NULL only when empty,
// and no more bytes than an address space holds (checked before anything
// is read or allocated for it).
template <class T>
std::span<const T> array_argument(const T* pointer, std::uint64_t count, std::string_view what) {
  if (count == 0) return {};
  required(pointer, what);
  const auto bytes = checked::mul_or_throw(count, sizeof(T), ErrorKind::InvalidRange, what);
  if (bytes > static_cast<std::uint64_t>(PTRDIFF_MAX))
    invalid_argument(std::string(what) + ": " + std::to_string(count) + " elements are more than memory holds");
  return {pointer, static_cast<std::size_t>(count)};
}

// An option or result struct: present, and at least as large as this ABI
// version's (a caller built against a newer header may pass a larger one;
// the library reads and writes only the part it knows).
template <class Sized>
Sized& sized(Sized* pointer, std::string_view what) {
  static_assert(std::is_standard_layout_v<Sized> && offsetof(Sized, size) == 0, "size comes first");
  auto& value = required(pointer, what);
  if (value.size < sizeof(Sized))
    invalid_argument(std::string(what) + "->size is " + std::to_string(value.size) + ", less than the " +
                     std::to_string(sizeof(Sized)) + " bytes of this ABI version's struct (set it to sizeof)");
  return value;
}

// Writes a result struct whole, keeping the caller's `size`.
template <class Sized>
void write_result(Sized& destination, Sized result) noexcept {
  result.size = destination.size;
  destination = result;
}

// A reserved field must stay zero, so a later ABI version can give it a meaning.
void require_reserved_zero(std::int64_t value, std::string_view what);

// NULL-terminated text the caller gives.
std::string_view text(const char* value, std::string_view what);

// A caller's timeout: negative is refused; DEVBRIDGE_WAIT_FOREVER (INT64_MAX)
// is nanoseconds::max(), which the bridge reads as "until done".
std::chrono::nanoseconds timeout(std::int64_t nanoseconds, std::string_view what);

// The C and C++ identity triples have the same members; these are the only
// conversions between them.
template <class Cpp, class C>
constexpr Cpp tagged(const C& value) noexcept {
  return Cpp{value.domain, value.generation, value.id};
}
constexpr DeviceHandle to_cpp(devbridge_handle handle) noexcept { return tagged<DeviceHandle>(handle); }
constexpr CopyEvent to_cpp(devbridge_event event) noexcept { return tagged<CopyEvent>(event); }
constexpr HostRegion to_cpp(devbridge_region region) noexcept { return tagged<HostRegion>(region); }
constexpr devbridge_handle to_c(const DeviceHandle& handle) noexcept { return tagged<devbridge_handle>(handle); }
constexpr devbridge_event to_c(const CopyEvent& event) noexcept { return tagged<devbridge_event>(event); }
constexpr devbridge_region to_c(const HostRegion& region) noexcept { return tagged<devbridge_region>(region); }
constexpr HostRange to_cpp(devbridge_host_range range) noexcept { return HostRange{range.offset, range.len}; }
constexpr devbridge_host_range to_c(const HostRange& range) noexcept { return {range.offset, range.len}; }
constexpr DeviceRange to_cpp(devbridge_device_range range) noexcept {
  return DeviceRange{to_cpp(range.handle), range.offset, range.len};
}
constexpr RegionRange to_cpp(devbridge_region_range range) noexcept {
  return RegionRange{to_cpp(range.region), range.offset, range.len};
}

// A C dtype value: UnsupportedDType when it names none (`what` names the field).
DType dtype_from_c(devbridge_dtype dtype, std::string_view what);
ObjectSpec object_spec_from_c(const devbridge_object_spec* spec);
// The byte size of a row-major tensor of `dims` (at most kMaxRank, none
// negative) of `dtype`, every product checked: InvalidRange naming `what`.
std::uint64_t tensor_bytes(DType dtype, std::span<const std::int64_t> dims, std::string_view what);

// Writes a bool to a C int32 out-parameter.
inline void write_flag(int32_t* out, bool value, std::string_view what) { required(out, what) = value ? 1 : 0; }

}  // namespace devbridge::c_api
