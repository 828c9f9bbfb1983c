// Files the command line writes (--trace, trace view -o): checked before
// anything runs, so a path that cannot be written is a usage error, not a
// failure after the work is done.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace devbridge::cli {

// Throws UsageError naming `option`, `path` and why (the system's reason)
// when `path` cannot be created or replaced: empty, "-", a directory, a file
// that is not writable, or a directory that does not exist or cannot be
// written in.
void check_output_file(std::string_view option, const std::string& path);

// Whether `a` and `b` name one file: the same path once made absolute and
// resolved (symbolic links followed, "." and ".." folded; a file need not
// exist), or the same existing file (st_dev and st_ino: a hard link, a bind
// mount). An empty path names no file. "-" is a path here like any other: a
// caller for which it means stdout leaves it out.
bool same_file(const std::string& a, const std::string& b);

// Throws UsageError when `option`'s file `output` is the `input` the command
// reads (same_file): writing it would replace what is being read. `output`
// "-" (stdout) and an absent one name no file.
void refuse_output_over_input(std::string_view option, const std::optional<std::string>& output,
                              std::string_view input_role, const std::string& input);

}  // namespace devbridge::cli
