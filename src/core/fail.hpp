// Throwing with a formatted message, kept out of line: the hot paths that
// validate stay small, and their error text costs nothing until it is needed.
#pragma once

#include <utility>

#include <fmt/format.h>

#include "devbridge/error.hpp"

namespace devbridge::detail {

template <class... Args>
[[noreturn, gnu::cold, gnu::noinline]] void fail(ErrorKind kind, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(kind, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace devbridge::detail
