// The library's logger. devbridge reports stale completions, broken bridges
// and failed quiesces on stderr under the name "devbridge", never through
// spdlog's default logger: that one writes to stdout, where a CLI's report or
// a Python program's output goes, and it belongs to the application.
#pragma once

#include <spdlog/logger.h>

namespace devbridge::detail {

spdlog::logger& log();

}  // namespace devbridge::detail
