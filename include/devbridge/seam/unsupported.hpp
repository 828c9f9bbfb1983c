// What an optional hook answers on a backend that lacks it.
#pragma once

#include <string>
#include <string_view>

#include "devbridge/error.hpp"

namespace devbridge::seam {

// Error(Unsupported) naming what the backend does not have, so code above the
// seam (the Python module, the CLI, the conformance suite) can tell "not here"
// from a failure.
[[noreturn]] inline void unsupported(std::string_view what) {
  throw Error(ErrorKind::Unsupported,
              std::string("this backend has no ") + std::string(what) + " (an optional capability)");
}

}  // namespace devbridge::seam
