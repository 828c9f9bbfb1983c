// Files the command line writes (--trace, trace view -o): checked before
// anything runs, so a path that cannot be written is a usage error, not a
// failure after the work is done.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace devbridge::cli {

// Throws UsageError naming `option`, `path` and why (the system's reason)
// when `path` cannot be written at the end of a run: empty, "-", one that
// looks like an option (refuse_option_like_path), a directory,
// a FIFO (the run would block on it after finishing until a reader came), a
// file that is not writable, or, unless `path` is an existing character
// device (/dev/null, written in place), a directory that does not exist or
// cannot be written in. The directory is the one the file is really replaced
// in: a symbolic link's target's, as devbridge::ReplacingFile resolves it.
void check_output_file(std::string_view option, const std::string& path);

// Throws UsageError when `path` starts with '-' and is not "-" itself
// ("--", "-v"): an option or the end of options taken for a file name, which
// would be written as a file named so. "./--" still names that file.
void refuse_option_like_path(std::string_view option, const std::string& path);

// `path` with its last component's symbolic links followed as
// devbridge::ReplacingFile follows them (the chain walked even when its end
// does not exist yet): the file a write to `path` really replaces. `path`
// itself when it is no link; nullopt when the chain cannot be read (a loop).
std::optional<std::string> link_target(const std::string& path);

// Whether `a` and `b` name one file: the same path once made absolute and
// resolved (symbolic links followed, a dangling one to the file it would
// make, "." and ".." folded; a file need not exist), or the same existing
// file (st_dev and st_ino: a hard link, a bind mount). An empty path names no
// file. "-" is a path here like any other: a caller for which it means
// stdout leaves it out.
bool same_file(const std::string& a, const std::string& b);

// Throws UsageError when `option`'s file `output` is the `input` the command
// reads (same_file): writing it would replace what is being read. `output`
// "-" (stdout), an absent one and an existing character device (written in
// place, never replaced: /dev/null twice is fine) name no file to replace.
void refuse_output_over_input(std::string_view option, const std::optional<std::string>& output,
                              std::string_view input_role, const std::string& input);

}  // namespace devbridge::cli
