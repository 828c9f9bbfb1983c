// The one place the bindings turn a Python argument into a C++ number.
//
// Every integer and every timeout a Python caller gives goes through these
// helpers, so a value of the wrong type or range raises what a Python user
// expects, never a generic RuntimeError ("std::bad_cast") from a failed cast:
//
//   TypeError      the wrong type: a str, a float where an int is meant,
//                  None where None is not allowed
//   OverflowError  an int outside the range the parameter can hold
//                  (-1 or 2**64 for a byte count, 2**63 for a dimension)
//   ValueError     a value of the right type the parameter refuses
//                  (a negative or NaN timeout)
//
// Rules of the contract (alignment a power of two, a range inside the ring,
// a shape that fits the allocation) stay the bridge's and raise its
// exceptions (InvalidAlignment, InvalidRange, InvalidTensorView, ...).
// Inside the DLPack protocol the caller maps protocol refusals to BufferError.
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include <nanobind/nanobind.h>

namespace devbridge::python::args {

// Raises `type` (a Python exception class) with `message`.
[[noreturn]] void raise(PyObject* type, const std::string& message);

// An integer argument (an int, or any object with __index__: numpy integers)
// within [lo, hi]. TypeError when it is not an integer, OverflowError when it
// is outside [lo, hi]. `what` names the argument in the message.
std::int64_t to_int(nanobind::handle value, const char* what, std::int64_t lo, std::int64_t hi);
std::uint64_t to_uint(nanobind::handle value, const char* what,
                      std::uint64_t hi = std::numeric_limits<std::uint64_t>::max());

template <typename T>
T integer(nanobind::handle value, const char* what) {
  static_assert(std::is_integral_v<T> && sizeof(T) <= 8);
  if constexpr (std::is_unsigned_v<T>) {
    return static_cast<T>(to_uint(value, what, std::numeric_limits<T>::max()));
  } else {
    return static_cast<T>(to_int(value, what, std::numeric_limits<T>::min(), std::numeric_limits<T>::max()));
  }
}

// An instance of the bound class T (DeviceHandle, ObjectSpec...): TypeError
// naming `what`, the class and what was given otherwise (a cast would raise
// RuntimeError("std::bad_cast")).
template <typename T>
const T& bound(nanobind::handle value, const char* what) {
  if (!nanobind::isinstance<T>(value))
    raise(PyExc_TypeError, std::string(what) + " must be a " + nanobind::type_name(nanobind::type<T>()).c_str() +
                               ", not " + nanobind::type_name(value.type()).c_str());
  return nanobind::cast<const T&>(value);
}

// As integer<T>, with None allowed (then nothing).
template <typename T>
std::optional<T> optional_integer(nanobind::handle value, const char* what) {
  if (value.is_none()) return std::nullopt;
  return integer<T>(value, what);
}

// A duration in seconds (an int or a float, numpy's too). A huge or infinite
// one saturates to nanoseconds::max(), which the bridge reads as "until
// done". TypeError when it is not a number; ValueError when it is negative or
// NaN.
std::chrono::nanoseconds seconds(nanobind::handle value, const char* what);

// As seconds(), with None meaning no limit (nothing).
std::optional<std::chrono::nanoseconds> optional_seconds(nanobind::handle value, const char* what);

// A flag: True or False only (TypeError otherwise, numpy's bool included).
bool flag(nanobind::handle value, const char* what);

}  // namespace devbridge::python::args
