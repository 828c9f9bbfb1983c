// How messages name handles, events and ranges: one spelling everywhere the
// library reports them (the bridge, the Stager), so a user can grep a log.
#pragma once

#include <string>

#include <fmt/format.h>

#include "devbridge/types.hpp"

namespace devbridge::detail {

// The public spelling (types.hpp), which the C ABI's messages use too.
inline std::string describe(const DeviceHandle& h) { return to_string(h); }
inline std::string describe(const CopyEvent& e) {
  return fmt::format("copy event {{domain {}, generation {}, id {:#x}}}", e.domain, e.generation, e.id);
}
inline std::string describe(const HostRange& r) {
  return fmt::format("host range [offset {}, len {}]", r.offset, r.len);
}
inline std::string describe(const HostRegion& r) {
  return fmt::format("host region {{domain {}, generation {}, id {:#x}}}", r.domain, r.generation, r.id);
}
inline std::string describe(const RegionRange& r) {
  return fmt::format("range [offset {}, len {}] of {}", r.offset, r.len, describe(r.region));
}

}  // namespace devbridge::detail
