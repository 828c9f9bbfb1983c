// A file replaced whole or not at all. What is written goes to a temporary
// file beside the one it replaces and is renamed over it by commit(): until
// then, and if the writer is dropped without committing (an error, a signal
// that unwinds), the old file is untouched and the temporary is removed.
//
// The one writer of the project's own files: checkpoints (the C ABI), trace
// dumps and out-of-memory dumps, the command line's --json reports. So every
// one of them treats the paths users give alike:
// - a symlink is written through: its target is replaced, the link stays;
// - a replaced file keeps its permissions; a new one gets 0666 less the umask;
// - a path that exists and is no regular file (a FIFO, /dev/stdout, a
//   device) is written in place where the caller allows it, as a shell's
//   redirection would, and refused otherwise; it is never replaced (renaming
//   over /dev/full, as root, replaced the device).
// Failures are Error(Unavailable) naming the path, what was being done and
// the system's reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace devbridge {

class ReplacingFile {
 public:
  enum class NotRegular : std::uint8_t { WriteInPlace, Refuse };
  enum class Durability : std::uint8_t {
    Renamed,  // the rename only (a trace, a report: redone if lost)
    Synced,   // the file fsync'd before the rename, its directory after: the old or the new file survives a crash
  };

  explicit ReplacingFile(std::string path, NotRegular not_regular = NotRegular::WriteInPlace);
  ~ReplacingFile();
  ReplacingFile(const ReplacingFile&) = delete;
  ReplacingFile& operator=(const ReplacingFile&) = delete;

  // Appends.
  void write(std::span<const std::byte> bytes);
  void write(std::string_view text) { write(std::as_bytes(std::span(text.data(), text.size()))); }
  // At an offset of the new file; a file written in place takes appends only (InvalidRange).
  void write_at(std::uint64_t offset, std::span<const std::byte> bytes);
  void commit(Durability durability);

  // The file a write to `path` replaces or makes, as this class resolves
  // it: the end of `path`'s chain of symbolic links (walked even when that
  // end does not exist yet: a dangling link is written through), or `path`
  // itself. Error(Unavailable) naming `path` when the chain loops or cannot
  // be read.
  static std::string written_through(const std::string& path);

  // 0 when a file can be made in `directory` now (one is made there, as a
  // write's temporary is, and removed), else the system's reason (errno).
  // What a caller checks when it is handed a path, before the work whose
  // result goes there: access(2) says yes to root for every directory,
  // /proc and /sys included, which take no new file.
  static int error_making_a_file_in(const std::string& directory) noexcept;

  const std::string& path() const noexcept { return path_; }
  // The temporary file's path (empty when written in place): what a signal
  // handler removes, since no destructor runs there.
  const std::string& temporary() const noexcept { return temporary_; }

 private:
  [[noreturn]] void fail(std::string_view doing, int error) const;

  std::string path_;
  std::string target_;     // the file renamed over: path_, or a link's target
  std::string temporary_;  // empty: written in place
  int fd_ = -1;
  std::uint64_t appended_ = 0;
  bool replaces_ = false;  // a regular file was there: its permissions are kept
  unsigned mode_ = 0;
  bool committed_ = false;
};

}  // namespace devbridge
