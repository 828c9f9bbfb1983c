// Why a handle, copy event or region is not this bridge's: another domain
// (another bridge), an older generation (from before a restart), or a newer
// one (never issued). The check itself is the bridge's, inlined on every call.
#pragma once

#include "core/describe.hpp"
#include "core/fail.hpp"
#include "devbridge/types.hpp"

namespace devbridge::detail {

template <class Tagged>
[[noreturn, gnu::cold, gnu::noinline]] void fail_tag(const Tagged& tagged, std::uint64_t domain, Generation generation) {
  if (tagged.domain != domain)
    fail(ErrorKind::ForeignDomain, "{} belongs to domain {}, this bridge is domain {}", describe(tagged), tagged.domain,
         domain);
  if (tagged.generation < generation)
    fail(ErrorKind::OldGenerationHandle, "{} is from generation {}, the bridge is at generation {}", describe(tagged),
         tagged.generation, generation);
  fail(ErrorKind::UnknownDeviceHandle, "{} names generation {}, newer than the bridge's {}", describe(tagged),
       tagged.generation, generation);
}

}  // namespace devbridge::detail
