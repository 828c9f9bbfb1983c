// The one reader of a checkpoint's safetensors header, for every front end:
// `devbridge checkpoint inspect` (tools/devbridge/checkpoint.cpp) and
// Python's checkpoint_info / restore (python/src/checkpoint_file.cpp).
//
// A checkpoint is a safetensors file (docs/PORTABLE.md): an 8-byte
// little-endian header length, a JSON header, then the data section. Every
// byte of it is hostile until checked: the path may name a FIFO or a device
// (refused without blocking), the length may be absurd, the JSON may be deep,
// malformed, not UTF-8 or ambiguous (a duplicate key), and the data offsets
// may overlap, wrap or leave the file. What this accepts, restore can
// restore; what it refuses names the file, the tensor and what is wrong, in
// time linear in the header's size and memory bounded by it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "devbridge/types.hpp"

namespace devbridge::checkpoint {

// A file no front end may restore. Not a bridge ErrorKind: no bridge is
// involved; Python raises it as devbridge.CheckpointError (a ValueError).
// `os_error` is the errno when the system refused (the file cannot be
// opened, stat'ed or read), so Python raises OSError (FileNotFoundError, ...)
// for it, as open() would; 0 when the file itself is at fault.
class CheckpointError : public std::runtime_error {
 public:
  explicit CheckpointError(const std::string& message, int os_error = 0)
      : std::runtime_error(message), os_error_(os_error) {}
  int os_error() const noexcept { return os_error_; }

 private:
  int os_error_;
};

// The safetensors package refuses headers past 100 MB; so does devbridge (a
// corrupt length must not make it read gigabytes of "header").
inline constexpr std::uint64_t kHeaderLimit = 100'000'000;
// Nesting deeper than this is no safetensors header (theirs nests three levels).
inline constexpr int kMaxDepth = 64;
// metadata["format"] of a file devbridge's checkpoint wrote.
inline constexpr std::string_view kFormat = "devbridge-checkpoint";
// The one format_version written and read; a devbridge checkpoint of another is refused.
inline constexpr std::string_view kFormatVersion = "1";

struct TensorEntry {
  std::string name{};
  std::optional<DType> dtype{};       // empty exactly when the file's dtype is one devbridge lacks
  std::string safetensors_dtype;      // the file's spelling ("F32", or one devbridge lacks: "F8_E8M0")
  std::vector<std::uint64_t> shape;   // at most kMaxRank dimensions
  std::uint64_t begin = 0;            // data_offsets, relative to the data section
  std::uint64_t end = 0;
  // Why restore cannot take this tensor (naming the file and the tensor), or
  // empty when it can: an empty shape (no device allocation is empty) or a
  // dtype devbridge does not hold. Such an entry is kept, not refused, so the
  // file's other tensors can still be restored (names=, prefix=, sharded) and
  // inspected; a front end refuses it only when it is selected for restore.
  std::string unrestorable{};
  std::uint64_t nbytes() const { return end - begin; }
};

struct Header {
  std::uint64_t file_bytes = 0;
  std::uint64_t header_bytes = 0;  // the JSON's length (after the 8-byte length)
  std::vector<std::pair<std::string, std::string>> metadata;  // __metadata__, sorted by key
  std::vector<TensorEntry> tensors;  // in file order: they tile the data section exactly
  bool devbridge = false;            // metadata["format"] is kFormat
  std::string checksum;  // a devbridge file's recorded "crc32:<8 hex>" / "sha256:<64 hex>"; else empty

  std::uint64_t data_start() const { return 8 + header_bytes; }
  std::uint64_t data_bytes() const { return file_bytes - data_start(); }
  // The metadata value of `key`, or nullptr.
  const std::string* find_metadata(std::string_view key) const;
};

// Parses and checks the header of a whole file held in memory (`file` is
// every byte of it). Throws CheckpointError; `where` names the file in it.
Header parse_checkpoint(std::string_view file, const std::string& where);

// Parses and checks `json`, the header of a file of `file_bytes` bytes whose
// 8-byte length prefix said json.size().
Header parse_header(std::string_view json, std::uint64_t file_bytes, const std::string& where);

// Which tensors a restore takes, for every front end: Python's restore(names=,
// prefix=) and the C ABI's devbridge_restore_options. Each part that is set
// applies (a name must pass them all).
struct TensorSelection {
  // Only these names, each of which the file must hold; nullopt: any name.
  // An empty list chooses none (Python's names=[]).
  std::optional<std::vector<std::string>> names{};
  std::string prefix{};  // only names that start with it; "": any
  // Python's names= callable, asked only of the names the others pass; empty: any.
  std::function<bool(const std::string&)> wants{};
  // Names the file must hold, whether or not they are chosen (Python's rows=,
  // which cuts tensors the others choose): refused as `names` are.
  std::vector<std::string> required{};
};

// The one selection rule: the entries of `tensors` (a header's, in file
// order) that `selection` chooses, in file order. Before anything is
// allocated it throws CheckpointError when `where` (the file, quoted) holds
// no tensor of a name `selection.names` or `selection.required` asks for (the
// first five missing, by name), or when a chosen entry is unrestorable (its reason): the header
// reader keeps such an entry so the others stay restorable, and a front end
// refuses it only when it is chosen.
std::vector<const TensorEntry*> select_tensors(std::span<const TensorEntry> tensors, const TensorSelection& selection,
                                               std::string_view where);

// An open checkpoint: the descriptor the header was read through, so the
// data is read from the same file (no second open by path that could race
// with a rename). Closes it when destroyed unless released.
class CheckpointFile {
 public:
  // Opens `path` without blocking (O_NONBLOCK: a FIFO or a device would
  // block a plain open or read), refuses anything but a regular file after
  // fstat on the descriptor (no check-then-open race), then reads blocking.
  // `where` names the file in errors (empty: `path`, quoted).
  static CheckpointFile open(const std::string& path, std::string where = {});

  CheckpointFile(CheckpointFile&& other) noexcept;
  CheckpointFile& operator=(CheckpointFile&& other) noexcept;
  CheckpointFile(const CheckpointFile&) = delete;
  CheckpointFile& operator=(const CheckpointFile&) = delete;
  ~CheckpointFile();

  const Header& header() const { return header_; }
  const std::string& where() const { return where_; }
  int fd() const { return fd_; }
  // Hands the descriptor to the caller, who closes it.
  int release() noexcept;
  // Reads exactly `n` bytes at byte `offset` of the file (positional: the
  // descriptor's offset is untouched); CheckpointError when it ends first.
  void read_at(std::uint64_t offset, void* out, std::size_t n) const;

 private:
  CheckpointFile(int fd, std::string where) : fd_(fd), where_(std::move(where)) {}
  int fd_ = -1;
  std::string where_;
  Header header_;
};

// `text` quoted as Python's repr quotes a str, control characters escaped,
// so names and paths from a hostile file stay on one line.
std::string quoted(std::string_view text);

// The safetensors name of `dtype` ("F32"), and the dtype of a safetensors
// name (false when devbridge holds no such dtype).
std::string_view safetensors_name(DType dtype) noexcept;
bool from_safetensors_name(std::string_view name, DType& dtype) noexcept;

// True when `text` is valid UTF-8 (no surrogates, overlongs or code points
// past U+10FFFF): what the safetensors package requires of every string.
bool valid_utf8(std::string_view text) noexcept;

// The checksum every devbridge writer records by default: CRC-32 as zlib
// (and Python's zlib.crc32) computes it, "crc32:<8 hex digits>". The one
// implementation, for the CLI's inspect and the C ABI's checkpoint/restore.
class Crc32 {
 public:
  void update(const void* data, std::size_t n) noexcept;
  std::uint32_t value() const noexcept { return value_; }
  std::string hexdigest() const;                     // "1a2b3c4d"
  std::string text() const { return text_of(value_); }  // as the header records it
  // The CRC of bytes A then B, from A's CRC and B's (of `second_bytes` bytes):
  // parts read on several threads hashed apart, then joined.
  static std::uint32_t combine(std::uint32_t first, std::uint32_t second, std::uint64_t second_bytes) noexcept;
  static std::string text_of(std::uint32_t value);  // "crc32:1a2b3c4d"

 private:
  std::uint32_t value_ = 0;
};

}  // namespace devbridge::checkpoint
