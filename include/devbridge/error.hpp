// The one error vocabulary of devbridge. Every backend maps its own failures
// into these kinds, so code above the seam never sees a vendor error type.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace devbridge {

enum class ErrorKind : std::uint8_t {
  AllocationFailed,
  DeviceCopyFailed,
  OutputCopyFailed,
  InvalidExtent,
  InvalidAlignment,
  InvalidRange,
  UnknownDeviceHandle,
  OldGenerationHandle,
  ForeignDomain,
  InvalidViewDType,
  InvalidTensorView,
  UnsupportedDType,  // a dtype the bridge's device does not hold (its BackendInfo::dtypes)
  AllocationStillInUse,
  Backpressure,
  Unavailable,
  Unsupported,
  Closed,
  Broken,
};

inline constexpr int kErrorKindCount = static_cast<int>(ErrorKind::Broken) + 1;

// The contract's name for a kind ("InvalidRange", ...). Python exposes the same
// names as exception classes, so they are part of the API.
std::string_view kind_name(ErrorKind kind) noexcept;

// what() is "<KindName>: <message>"; the message names the handle, range or
// size at fault. `fatal` marks a backend failure that leaves the bridge Broken.
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string_view message, bool fatal = false);

  ErrorKind kind() const noexcept { return kind_; }
  bool fatal() const noexcept { return fatal_; }
  // The message without the kind prefix.
  std::string_view message() const noexcept;

 private:
  ErrorKind kind_;
  bool fatal_;
};

}  // namespace devbridge
