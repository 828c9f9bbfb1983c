// Files the command line writes (--trace, trace view -o): checked before
// anything runs, so a path that cannot be written is a usage error, not a
// failure after the work is done.
#pragma once

#include <string>
#include <string_view>

namespace devbridge::cli {

// Throws UsageError naming `option`, `path` and why (the system's reason)
// when `path` cannot be created or replaced: empty, "-", a directory, a file
// that is not writable, or a directory that does not exist or cannot be
// written in.
void check_output_file(std::string_view option, const std::string& path);

}  // namespace devbridge::cli
