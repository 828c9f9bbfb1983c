// What the worker says on standard error. A write there that fails (a full
// disk, a terminal gone, a reader that left) is not the run's failure:
// fmt::print(stderr, ...) throws then, from inside the handlers that report
// the run's outcome and from the progress line, and the process would end in
// std::terminate with the report unwritten.
#pragma once

#include <cstdio>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace devbridge::cli {

template <class... Args>
void print_stderr(fmt::format_string<Args...> format, Args&&... args) {
  const std::string text = fmt::format(format, std::forward<Args>(args)...);
  (void)std::fwrite(text.data(), 1, text.size(), stderr);
}

}  // namespace devbridge::cli
