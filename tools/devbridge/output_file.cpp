#include "output_file.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <system_error>

#include <sys/stat.h>
#include <unistd.h>

#include "devbridge/error.hpp"
#include "devbridge/replacing_file.hpp"
#include "sizes.hpp"

namespace devbridge::cli {

namespace {

bool is_character_device(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISCHR(st.st_mode);
}

}  // namespace

std::optional<std::string> link_target(const std::string& path) {
  try {
    return ReplacingFile::written_through(path);
  } catch (const Error&) {
    return std::nullopt;
  }
}

void refuse_option_like_path(std::string_view option, const std::string& path) {
  if (path.size() > 1 && path.front() == '-')
    throw UsageError(fmt::format("{}: '{}' looks like an option, not a file name (for a file of that name give './{}')",
                                 option, path, path));
}

void check_output_file(std::string_view option, const std::string& path) {
  const auto refuse = [&](const std::string& why) {
    throw UsageError(fmt::format("{}: cannot write '{}': {}", option, path, why));
  };
  if (path.empty()) throw UsageError(fmt::format("{}: give the file to write", option));
  if (path == "-") refuse("this option writes a file, not stdout");
  refuse_option_like_path(option, path);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) refuse(std::strerror(EISDIR));
    // Opening a FIFO waits for a reader; done when the run ends, it would
    // hang the finished command where no signal stops it.
    if (S_ISFIFO(st.st_mode))
      refuse("it is a FIFO: the file is written when the run ends, and with no reader there the command would "
             "block after finishing (give a regular file)");
    if (::access(path.c_str(), W_OK) != 0) refuse(std::strerror(errno));
    // A device is written in place (ReplacingFile): no file is made beside it.
    if (S_ISCHR(st.st_mode)) return;
  } else if (errno != ENOENT) {
    refuse(std::strerror(errno));
  }
  // The file is written beside the file it replaces and renamed over it: that
  // directory (a link's target's, not the link's) must take a new file.
  const std::optional<std::string> target = link_target(path);
  if (!target) refuse(fmt::format("resolving its symbolic links: {}", std::strerror(ELOOP)));
  const std::filesystem::path name(*target);
  const std::string directory = name.has_parent_path() ? name.parent_path().string() : std::string(".");
  if (::stat(directory.c_str(), &st) != 0) refuse(fmt::format("{}: {}", directory, std::strerror(errno)));
  if (!S_ISDIR(st.st_mode)) refuse(fmt::format("{}: {}", directory, std::strerror(ENOTDIR)));
  if (const int error = ReplacingFile::error_making_a_file_in(directory); error != 0)
    refuse(fmt::format("{}: {}", directory, std::strerror(error)));
}

namespace {

// `path` absolute, its links followed as a write would follow them (a
// dangling one to the file it would make), every symbolic link of the part
// that exists resolved and the rest folded lexically; nullopt when that fails.
std::optional<std::filesystem::path> resolved(const std::string& path) {
  const std::optional<std::string> target = link_target(path);
  if (!target) return std::nullopt;
  std::error_code error;
  const std::filesystem::path absolute = std::filesystem::absolute(*target, error);
  if (error) return std::nullopt;
  std::filesystem::path canonical = std::filesystem::weakly_canonical(absolute, error);
  if (error) return std::nullopt;
  return canonical.lexically_normal();
}

}  // namespace

bool same_file(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  if (a == b) return true;
  struct stat sa {}, sb {};
  if (::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0)
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  const auto ra = resolved(a);
  const auto rb = resolved(b);
  return ra && rb && *ra == *rb;
}

void refuse_output_over_input(std::string_view option, const std::optional<std::string>& output,
                              std::string_view input_role, const std::string& input) {
  if (!output || *output == "-" || is_character_device(*output) || !same_file(*output, input)) return;
  throw UsageError(fmt::format("{}: '{}' is {} ('{}'): the {} file would replace it (give another file)", option,
                               *output, input_role, input, option));
}

}  // namespace devbridge::cli
