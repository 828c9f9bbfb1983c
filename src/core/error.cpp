#include "devbridge/error.hpp"

#include <array>
#include <string>

namespace devbridge {

namespace {
constexpr std::array<std::string_view, kErrorKindCount> kKindNames = {
    "AllocationFailed",    "DeviceCopyFailed",     "OutputCopyFailed", "InvalidExtent",
    "InvalidAlignment",    "InvalidRange",         "UnknownDeviceHandle", "OldGenerationHandle",
    "ForeignDomain",       "InvalidViewDType",     "InvalidTensorView", "UnsupportedDType",
    "AllocationStillInUse",
    "Backpressure",        "Unavailable",          "Unsupported",      "Closed",
    "Broken",
};

std::string compose(ErrorKind kind, std::string_view message) {
  std::string text(kind_name(kind));
  text += ": ";
  text += message;
  return text;
}
}  // namespace

std::string_view kind_name(ErrorKind kind) noexcept {
  const auto index = static_cast<std::size_t>(kind);
  return index < kKindNames.size() ? kKindNames[index] : std::string_view("Unknown");
}

Error::Error(ErrorKind kind, std::string_view message, bool fatal)
    : std::runtime_error(compose(kind, message)), kind_(kind), fatal_(fatal) {}

std::string_view Error::message() const noexcept {
  std::string_view all(what());
  const auto prefix = kind_name(kind_).size() + 2;
  return all.size() >= prefix ? all.substr(prefix) : all;
}

}  // namespace devbridge
