#include "output_file.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <system_error>

#include <sys/stat.h>
#include <unistd.h>

#include "sizes.hpp"

namespace devbridge::cli {

void check_output_file(std::string_view option, const std::string& path) {
  const auto refuse = [&](const std::string& why) {
    throw UsageError(fmt::format("{}: cannot write '{}': {}", option, path, why));
  };
  if (path.empty()) throw UsageError(fmt::format("{}: give the file to write", option));
  if (path == "-") refuse("this option writes a file, not stdout");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) refuse(std::strerror(EISDIR));
    if (::access(path.c_str(), W_OK) != 0) refuse(std::strerror(errno));
  } else if (errno != ENOENT) {
    refuse(std::strerror(errno));
  }
  // The file is written beside itself and renamed over: its directory must take a new file.
  const std::filesystem::path name(path);
  const std::string directory = name.has_parent_path() ? name.parent_path().string() : std::string(".");
  if (::stat(directory.c_str(), &st) != 0) refuse(fmt::format("{}: {}", directory, std::strerror(errno)));
  if (!S_ISDIR(st.st_mode)) refuse(fmt::format("{}: {}", directory, std::strerror(ENOTDIR)));
  if (::access(directory.c_str(), W_OK | X_OK) != 0) refuse(fmt::format("{}: {}", directory, std::strerror(errno)));
}

namespace {

// `path` absolute, with every symbolic link of the part that exists resolved
// and the rest folded lexically; nullopt when that fails.
std::optional<std::filesystem::path> resolved(const std::string& path) {
  std::error_code error;
  const std::filesystem::path absolute = std::filesystem::absolute(path, error);
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
  if (!output || *output == "-" || !same_file(*output, input)) return;
  throw UsageError(fmt::format("{}: '{}' is {} ('{}'): the {} file would replace it (give another file)", option,
                               *output, input_role, input, option));
}

}  // namespace devbridge::cli
