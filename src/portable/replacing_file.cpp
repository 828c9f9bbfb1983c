#include "devbridge/replacing_file.hpp"

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "devbridge/error.hpp"

namespace devbridge {
namespace {

std::string directory_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

// A name of its own beside `target` (the process and a count: O_EXCL refuses
// any other file's), hidden, short enough for the file system even when the
// target's own name is near NAME_MAX.
std::string temporary_name(const std::string& target, std::uint64_t count) {
  const auto slash = target.rfind('/');
  const std::string directory = slash == std::string::npos ? "" : target.substr(0, slash + 1);
  std::string base = slash == std::string::npos ? target : target.substr(slash + 1);
  const std::string tail = fmt::format(".{}.{}.tmp", ::getpid(), count);
  constexpr std::size_t kNameMax = NAME_MAX;
  if (1 + base.size() + tail.size() > kNameMax) base.resize(kNameMax - 1 - tail.size());
  return directory + "." + base + tail;
}

}  // namespace

std::string ReplacingFile::written_through(const std::string& path) {
  constexpr int kMaxLinkHops = 40;  // as many as the kernel follows in one path (Linux's MAXSYMLINKS)
  const auto refuse = [&](int error) {
    throw Error(ErrorKind::Unavailable,
                fmt::format("cannot write '{}': resolving it: {}", path, std::strerror(error)));
  };
  std::string target = path;
  struct stat link {};
  for (int hops = 0; ::lstat(target.c_str(), &link) == 0 && S_ISLNK(link.st_mode); ++hops) {
    if (hops == kMaxLinkHops) refuse(ELOOP);
    std::error_code error;
    const std::filesystem::path at(target), to = std::filesystem::read_symlink(at, error);
    if (error) refuse(error.value());
    target = (to.is_absolute() ? to : at.parent_path() / to).lexically_normal().string();
  }
  return target;
}

int ReplacingFile::error_making_a_file_in(const std::string& directory) noexcept {
  static std::atomic<std::uint64_t> probes{0};
  try {
    const std::string probe =
        temporary_name(directory + "/devbridge-probe", probes.fetch_add(1, std::memory_order_relaxed));
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return errno == EEXIST ? 0 : errno;  // another file of that name: files can be made there
    ::close(fd);
    ::unlink(probe.c_str());
    return 0;
  } catch (...) {
    return ENOMEM;  // the name could not be made
  }
}

ReplacingFile::ReplacingFile(std::string path, NotRegular not_regular) : path_(std::move(path)) {
  if (path_.empty()) throw Error(ErrorKind::InvalidRange, "cannot write a file of no name");
  struct stat existing {};
  if (::stat(path_.c_str(), &existing) == 0) {
    if (S_ISDIR(existing.st_mode)) fail("", EISDIR);
    if (!S_ISREG(existing.st_mode)) {
      if (not_regular == NotRegular::Refuse)
        throw Error(ErrorKind::Unavailable,
                    fmt::format("cannot write '{}': it is not a regular file (a FIFO, a device)", path_));
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd_ < 0) fail("opening it", errno);
      return;  // written in place
    }
    std::error_code error;
    target_ = std::filesystem::canonical(path_, error).string();
    if (error) fail("resolving it", error.value());
    replaces_ = true;
    mode_ = existing.st_mode & 07777;
  } else if (errno == ENOENT) {
    target_ = written_through(path_);  // a dangling link is written through too: its target is made
  } else {
    fail("looking it up", errno);
  }
  static std::atomic<std::uint64_t> made{0};
  for (int attempt = 0; fd_ < 0; ++attempt) {
    temporary_ = temporary_name(target_, made.fetch_add(1, std::memory_order_relaxed));
    // 0666: open(2) applies the umask, as it does to a new file.
    fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ < 0 && (errno != EEXIST || attempt == 100)) {
      const int error = errno;
      const std::string tried = std::move(temporary_);
      temporary_.clear();
      fail(fmt::format("creating its temporary file '{}' in '{}'", tried, directory_of(tried)), error);
    }
  }
}

ReplacingFile::~ReplacingFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temporary_.empty()) ::unlink(temporary_.c_str());
}

void ReplacingFile::fail(std::string_view doing, int error) const {
  if (doing.empty()) throw Error(ErrorKind::Unavailable, fmt::format("cannot write '{}': {}", path_, std::strerror(error)));
  throw Error(ErrorKind::Unavailable, fmt::format("cannot write '{}': {}: {}", path_, doing, std::strerror(error)));
}

void ReplacingFile::write(std::span<const std::byte> bytes) {
  if (temporary_.empty()) {
    while (!bytes.empty()) {
      const ssize_t n = ::write(fd_, bytes.data(), bytes.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("writing it", n < 0 ? errno : EIO);
      bytes = bytes.subspan(static_cast<std::size_t>(n));
    }
    return;
  }
  write_at(appended_, bytes);
}

void ReplacingFile::write_at(std::uint64_t offset, std::span<const std::byte> bytes) {
  if (temporary_.empty())
    throw Error(ErrorKind::InvalidRange,
                fmt::format("cannot write '{}' at offset {}: it is written in place (not a regular file)", path_, offset));
  while (!bytes.empty()) {
    const ssize_t n = ::pwrite(fd_, bytes.data(), bytes.size(), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(fmt::format("writing '{}'", temporary_), n < 0 ? errno : EIO);
    bytes = bytes.subspan(static_cast<std::size_t>(n));
    offset += static_cast<std::uint64_t>(n);
    if (offset > appended_) appended_ = offset;
  }
}

void ReplacingFile::commit(Durability durability) {
  if (committed_) return;
  const auto close_file = [&](std::string_view doing) {
    const int closed = ::close(fd_);
    fd_ = -1;
    if (closed != 0) fail(doing, errno);
  };
  if (temporary_.empty()) {
    committed_ = true;
    close_file("closing it");
    return;
  }
  if (replaces_ && ::fchmod(fd_, static_cast<mode_t>(mode_)) != 0) fail("keeping its permissions", errno);
  if (durability == Durability::Synced && ::fsync(fd_) != 0) fail(fmt::format("fsync of '{}'", temporary_), errno);
  close_file(fmt::format("closing '{}'", temporary_));
  if (::rename(temporary_.c_str(), target_.c_str()) != 0) fail(fmt::format("renaming '{}' over it", temporary_), errno);
  committed_ = true;
  if (durability == Durability::Synced) {
    const int directory = ::open(directory_of(target_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (directory < 0) fail("opening its directory to fsync it", errno);
    const int synced = ::fsync(directory);
    const int error = errno;
    ::close(directory);
    if (synced != 0) fail("fsync of its directory", error);
  }
}

}  // namespace devbridge
