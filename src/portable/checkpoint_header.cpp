#include "devbridge/checkpoint_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "devbridge/checked.hpp"
#include "portable/json_scanner.hpp"

namespace devbridge::checkpoint {

namespace {

struct DTypeName {
  std::string_view safetensors;
  DType dtype;
};

// Every devbridge dtype, as the safetensors package names it (sorted by that name).
constexpr std::array<DTypeName, kDTypeCount> kDTypes{{
    {"BF16", DType::BFloat16},
    {"BOOL", DType::Bool},
    {"F16", DType::Float16},
    {"F32", DType::Float32},
    {"F64", DType::Float64},
    {"F8_E4M3", DType::Fp8E4M3},
    {"F8_E5M2", DType::Fp8E5M2},
    {"I16", DType::Int16},
    {"I32", DType::Int32},
    {"I64", DType::Int64},
    {"I8", DType::Int8},
    {"U16", DType::UInt16},
    {"U32", DType::UInt32},
    {"U64", DType::UInt64},
    {"U8", DType::UInt8},
}};

std::string known_dtypes() {
  std::string names;
  for (const DTypeName& d : kDTypes) {
    if (!names.empty()) names += ", ";
    names += d.safetensors;
  }
  return names;
}

// The checksums a devbridge checkpoint may record (python/devbridge/_portable.py's
// _CHECKSUM_DIGITS): "crc32:<8 hex digits>" (the default) and "sha256:<64 hex digits>".
bool valid_checksum(std::string_view checksum) {
  static constexpr std::array<std::pair<std::string_view, std::size_t>, 2> kKinds{{{"crc32", 8}, {"sha256", 64}}};
  const std::size_t colon = checksum.find(':');
  if (colon == std::string_view::npos) return false;
  const std::string_view digits = checksum.substr(colon + 1);
  for (const auto& [algorithm, length] : kKinds) {
    if (checksum.substr(0, colon) == algorithm) {
      return digits.size() == length && std::all_of(digits.begin(), digits.end(), [](char c) {
               return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
             });
    }
  }
  return false;
}

// A shape as Python prints the tuple restore would allocate: (4,), (2, 3).
std::string shape_text(const std::vector<std::uint64_t>& shape) {
  if (shape.size() == 1) return fmt::format("({},)", shape[0]);
  return fmt::format("({})", fmt::join(shape, ", "));
}

// One JSON value as the header held it, for messages: a string quoted as
// Python does, anything else its JSON text on one line, at most 80 characters.
std::string value_text(std::string_view raw, const std::optional<std::string>& decoded) {
  if (decoded) return quoted(*decoded);
  std::string text(raw);
  std::replace_if(text.begin(), text.end(), [](char c) { return c == '\n' || c == '\r' || c == '\t'; }, ' ');
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

struct RawEntry {
  std::string name;
  bool object = false;
  bool duplicate_field = false;
  std::string_view dtype_raw;  // empty: absent
  std::optional<std::string> dtype;  // set when the dtype is a string
  Integers shape;
  Integers offsets;
};

// A JSON object of strings to strings ({"a": "b"}), sorted by key; false
// when the value is anything else (consumed, checked as JSON). A duplicate
// key is "anything else": which value would count is a parser's guess.
bool string_map(Scanner& scan, int depth, std::vector<std::pair<std::string, std::string>>& out) {
  if (scan.peek() != '{') {
    scan.skip_value(depth);
    return false;
  }
  bool ok = true;
  scan.expect('{');
  if (!scan.accept('}')) {
    do {
      std::string key = scan.string();
      scan.expect(':');
      if (scan.peek() == '"') {
        out.emplace_back(std::move(key), scan.string());
      } else {
        scan.skip_value(depth + 1);
        ok = false;
      }
    } while (scan.accept(','));
    scan.expect('}');
  }
  std::sort(out.begin(), out.end());
  for (std::size_t i = 1; i < out.size(); ++i) {
    if (out[i].first == out[i - 1].first) ok = false;
  }
  return ok;
}

RawEntry tensor_entry(Scanner& scan, std::string name) {
  RawEntry entry;
  entry.name = std::move(name);
  if (scan.peek() != '{') {
    scan.skip_value(1);
    return entry;
  }
  entry.object = true;
  bool seen_dtype = false;
  bool seen_shape = false;
  bool seen_offsets = false;
  scan.expect('{');
  if (scan.accept('}')) return entry;
  do {
    const std::string key = scan.string();
    scan.expect(':');
    bool* seen = nullptr;
    if (key == "dtype") {
      seen = &seen_dtype;
      const std::size_t start = (scan.skip_space(), scan.at());
      if (scan.peek() == '"') {
        entry.dtype = scan.string();
      } else {
        entry.dtype.reset();
        scan.skip_value(2);
      }
      entry.dtype_raw = scan.since(start);
    } else if (key == "shape") {
      seen = &seen_shape;
      entry.shape = scan.integers(2);
    } else if (key == "data_offsets") {
      seen = &seen_offsets;
      entry.offsets = scan.integers(2);
    } else {
      scan.skip_value(2);  // a field safetensors ignores too
    }
    if (seen != nullptr) {
      if (*seen) entry.duplicate_field = true;
      *seen = true;
    }
  } while (scan.accept(','));
  scan.expect('}');
  return entry;
}

const DTypeName* find_dtype(std::string_view name) {
  const auto* it = std::lower_bound(kDTypes.begin(), kDTypes.end(), name,
                                    [](const DTypeName& d, std::string_view n) { return d.safetensors < n; });
  return it != kDTypes.end() && it->safetensors == name ? &*it : nullptr;
}

// The metadata's "dtypes" entry (devbridge's own names, JSON in a string),
// sorted by tensor name.
std::vector<std::pair<std::string, std::string>> recorded_dtypes(const Header& header, const std::string& where) {
  std::vector<std::pair<std::string, std::string>> recorded;
  const std::string* text = header.find_metadata("dtypes");
  if (text == nullptr) return recorded;
  bool ok = false;
  try {
    Scanner scan(*text);
    ok = string_map(scan, 0, recorded);
    scan.skip_space();
    ok = ok && scan.done();
  } catch (const Malformed&) {
    ok = false;
  }
  if (!ok) throw CheckpointError(fmt::format("{}: the metadata's dtypes entry is not a JSON map of names to dtypes", where));
  return recorded;
}

// Checks one tensor's entry, as restore would allocate it.
TensorEntry check_entry(RawEntry& raw, const std::vector<std::pair<std::string, std::string>>& recorded,
                        const std::string& where) {
  // Formatted only for an error: a header of thousands of tensors is checked per restore.
  const std::string* tensor_name = &raw.name;  // the entry's own once it takes the name
  const auto at = [&] { return fmt::format("{}: tensor {}", where, quoted(*tensor_name)); };
  if (!raw.object) throw CheckpointError(fmt::format("{}: its header entry is not an object", at()));
  if (raw.duplicate_field) {
    throw CheckpointError(fmt::format("{}: its header entry names dtype, shape or data_offsets twice", at()));
  }
  // A dtype that is no string is a malformed header; a string devbridge does
  // not hold (safetensors' F8_E8M0, C64, ...) only makes that tensor unrestorable.
  if (!raw.dtype) {
    throw CheckpointError(fmt::format("{}: dtype {} is not one devbridge holds (it knows {})", at(),
                                      raw.dtype_raw.empty() ? "null" : value_text(raw.dtype_raw, raw.dtype),
                                      known_dtypes()));
  }
  const DTypeName* known = find_dtype(*raw.dtype);
  if (known != nullptr) {
    const std::string_view name = dtype_info(known->dtype).name;
    const auto r = std::lower_bound(recorded.begin(), recorded.end(), raw.name,
                                    [](const auto& entry, const std::string& n) { return entry.first < n; });
    if (r != recorded.end() && r->first == raw.name && r->second != name) {
      throw CheckpointError(fmt::format("{}: the metadata records dtype {}, the header {}", at(), quoted(r->second),
                                        quoted(known->safetensors)));
    }
  }
  const auto text = [](const Integers& v) { return v.raw.empty() ? std::string("null") : value_text(v.raw, v.string); };
  if (!raw.shape.ok) {
    throw CheckpointError(fmt::format("{}: shape {} is not a list of non-negative integers", at(), text(raw.shape)));
  }
  TensorEntry tensor{std::move(raw.name), known != nullptr ? std::optional(known->dtype) : std::nullopt,
                     known != nullptr ? std::string(known->safetensors) : std::move(*raw.dtype),
                     std::move(raw.shape.values), 0, 0};
  tensor_name = &tensor.name;
  if (tensor.shape.size() > static_cast<std::size_t>(kMaxRank)) {
    throw CheckpointError(fmt::format("{}: shape {} has {} dimensions, more than devbridge's {}", at(),
                                      shape_text(tensor.shape), tensor.shape.size(), kMaxRank));
  }
  if (!raw.offsets.ok || raw.offsets.values.size() != 2 || raw.offsets.values[0] > raw.offsets.values[1]) {
    throw CheckpointError(fmt::format("{}: data_offsets {} are not [begin, end] byte offsets", at(), text(raw.offsets)));
  }
  tensor.begin = raw.offsets.values[0];
  tensor.end = raw.offsets.values[1];
  if (known == nullptr) {
    // Its size per element is unknown, so its span is taken as the file gives
    // it (the data section's tiling is still checked).
    tensor.unrestorable = fmt::format("{}: dtype {} is not one devbridge holds (it knows {})", at(),
                                      quoted(tensor.safetensors_dtype), known_dtypes());
    return tensor;
  }
  const std::string_view name = dtype_info(known->dtype).name;
  const std::uint64_t span = tensor.end - tensor.begin;
  std::optional<std::uint64_t> nbytes = dtype_size(known->dtype);
  for (std::uint64_t dim : tensor.shape) {
    if (nbytes) nbytes = checked::mul(*nbytes, dim);
  }
  // A product past 2^64 can only be 0 bytes when a later dimension is 0.
  if (!nbytes && std::find(tensor.shape.begin(), tensor.shape.end(), 0) != tensor.shape.end()) nbytes = 0;
  if (!nbytes) {
    throw CheckpointError(fmt::format("{}: shape {} of {} is more than 2^64 bytes (its data_offsets span {})", at(),
                                      shape_text(tensor.shape), name, span));
  }
  if (*nbytes != span) {
    throw CheckpointError(fmt::format("{}: shape {} of {} is {} bytes, its data_offsets span {}", at(),
                                      shape_text(tensor.shape), name, *nbytes, span));
  }
  if (*nbytes == 0) {
    tensor.unrestorable = fmt::format(
        "{}: shape {} is empty, and a device allocation cannot be (devbridge cannot restore it)", at(),
        shape_text(tensor.shape));
  }
  return tensor;
}

// The header length the first 8 bytes give, checked against the file's size.
std::uint64_t header_length(const unsigned char (&prefix)[8], std::uint64_t file_bytes, const std::string& where) {
  std::uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | prefix[i];
  if (length > kHeaderLimit) {
    // A JSON document (a sharded checkpoint's index, model.safetensors.index.json) starts with '{'.
    const bool json = prefix[0] == '{' || prefix[0] == '[';
    throw CheckpointError(fmt::format("{} is not a safetensors file: a header length of {} bytes (past {}){}", where,
                                      length, kHeaderLimit,
                                      json ? "; it starts as JSON does: a sharded checkpoint's index "
                                             "(*.index.json)? Its weight_map names the safetensors files"
                                           : ""));
  }
  if (!checked::range_within(8, length, file_bytes)) {
    throw CheckpointError(fmt::format("{} is truncated (or not a safetensors file): its header is {} bytes, the file {}",
                                      where, length, file_bytes));
  }
  return length;
}

void check_file_length(std::uint64_t file_bytes, const std::string& where) {
  if (file_bytes < 8) {
    throw CheckpointError(fmt::format(
        "{} is not a safetensors file: {} bytes, shorter than the 8-byte header length", where, file_bytes));
  }
}

}  // namespace

const std::string* Header::find_metadata(std::string_view key) const {
  const auto it = std::lower_bound(metadata.begin(), metadata.end(), key,
                                   [](const auto& entry, std::string_view k) { return entry.first < k; });
  return it != metadata.end() && it->first == key ? &it->second : nullptr;
}

Header parse_header(std::string_view json, std::uint64_t file_bytes, const std::string& where) {
  Header header;
  header.file_bytes = file_bytes;
  header.header_bytes = json.size();
  if (!checked::range_within(8, json.size(), file_bytes)) {
    throw CheckpointError(fmt::format("{} is truncated (or not a safetensors file): its header is {} bytes, the file {}",
                                      where, json.size(), file_bytes));
  }
  std::vector<RawEntry> raw;
  std::optional<std::string> duplicate;
  bool metadata_ok = true;
  bool seen_metadata = false;
  try {
    Scanner scan(json);
    if (json.substr(0, 3) == "\xEF\xBB\xBF") {
      throw Malformed{"it starts with a UTF-8 byte order mark, which JSON may not (nor the safetensors package)"};
    }
    if (scan.peek() != '{') {
      scan.skip_value(0);
      scan.skip_space();
      if (!scan.done()) scan.fail("trailing characters after the JSON");
      throw CheckpointError(fmt::format("{} is not a safetensors file: its header is not a JSON object", where));
    }
    scan.expect('{');
    if (!scan.accept('}')) {
      do {
        std::string key = scan.string();
        scan.expect(':');
        if (key == "__metadata__") {
          if (seen_metadata && !duplicate) duplicate = key;
          seen_metadata = true;
          if (scan.peek() == 'n') {
            scan.literal("null");  // safetensors' Option: no metadata
          } else {
            header.metadata.clear();
            metadata_ok = string_map(scan, 1, header.metadata) && metadata_ok;
          }
        } else {
          raw.push_back(tensor_entry(scan, std::move(key)));
        }
      } while (scan.accept(','));
      scan.expect('}');
    }
    // Whitespace may pad the header (the safetensors package pads with spaces
    // to align the data); anything else after the object is refused, as the
    // package refuses it: a NUL and garbage, a second value.
    scan.skip_space();
    if (!scan.done()) scan.fail("trailing characters after the JSON");
  } catch (const Malformed& e) {
    throw CheckpointError(fmt::format("{} is not a safetensors file: its header is not JSON ({})", where, e.what));
  }
  if (!metadata_ok || duplicate) {
    throw CheckpointError(fmt::format("{}: __metadata__ is not a map of strings to strings{}", where,
                                      duplicate ? " (it appears twice)" : ", each key once"));
  }
  const std::vector<std::pair<std::string, std::string>> recorded = recorded_dtypes(header, where);

  // A name twice: which entry counts would be a parser's guess, so neither does.
  std::vector<const std::string*> names;
  names.reserve(raw.size());
  for (const RawEntry& e : raw) names.push_back(&e.name);
  std::sort(names.begin(), names.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
  for (std::size_t i = 1; i < names.size(); ++i) {
    if (*names[i] == *names[i - 1]) {
      throw CheckpointError(fmt::format("{}: tensor {} appears twice in the header", where, quoted(*names[i])));
    }
  }

  header.tensors.reserve(raw.size());
  for (RawEntry& e : raw) header.tensors.push_back(check_entry(e, recorded, where));
  raw.clear();
  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t expected = 0;
  for (const TensorEntry& t : header.tensors) {
    if (t.begin != expected) {
      throw CheckpointError(fmt::format("{}: tensor {} starts at data byte {}, expected {} (tensors overlap or leave a gap)",
                                        where, quoted(t.name), t.begin, expected));
    }
    expected = t.end;
  }
  const std::uint64_t data = header.data_bytes();
  if (expected > data) {
    throw CheckpointError(
        fmt::format("{} is truncated: its tensors need {} bytes of data, the file holds {}", where, expected, data));
  }
  if (expected < data) {
    throw CheckpointError(fmt::format("{}: {} bytes follow the last tensor's data (corrupt, or not a safetensors file)",
                                      where, data - expected));
  }
  const std::string* format = header.find_metadata("format");
  header.devbridge = format != nullptr && *format == kFormat;
  if (header.devbridge) {
    // A later format may mean what this reader would misread: refused, not guessed at.
    const std::string* version = header.find_metadata("format_version");
    if (version != nullptr && *version != kFormatVersion) {
      throw CheckpointError(fmt::format("{}: a devbridge checkpoint of format_version {}, which this devbridge does not "
                                        "read (it reads format_version {}): written by a newer devbridge?",
                                        where, quoted(*version), kFormatVersion));
    }
    const std::string* checksum = header.find_metadata("checksum");
    header.checksum = checksum != nullptr ? *checksum : std::string();
    if (valid_checksum(header.checksum)) {
      // Hex digits in either case are the same checksum (a hand-edited or
      // another tool's file); every writer and comparer uses lowercase.
      std::transform(header.checksum.begin(), header.checksum.end(), header.checksum.begin(),
                     [](char c) { return c >= 'A' && c <= 'F' ? static_cast<char>(c - 'A' + 'a') : c; });
    } else {
      throw CheckpointError(fmt::format(
          "{}: a devbridge checkpoint without a valid checksum (got {}; crc32:<8 hex digits> or sha256:<64 hex digits>)",
          where, quoted(header.checksum)));
    }
  }
  return header;
}

Header parse_checkpoint(std::string_view file, const std::string& where) {
  check_file_length(file.size(), where);
  unsigned char prefix[8];
  std::memcpy(prefix, file.data(), sizeof prefix);
  const std::uint64_t length = header_length(prefix, file.size(), where);
  return parse_header(file.substr(8, static_cast<std::size_t>(length)), file.size(), where);
}

CheckpointFile CheckpointFile::open(const std::string& path, std::string where) {
  if (where.empty()) where = quoted(path);
  // O_NONBLOCK: opening a FIFO for reading blocks until a writer comes, and
  // reading one blocks until it writes; the type is known only once open.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw CheckpointError(fmt::format("{}: cannot open it: {}", where, std::strerror(errno)), errno);
  CheckpointFile file(fd, std::move(where));  // closes it on every error below
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    throw CheckpointError(fmt::format("{}: cannot stat it: {}", file.where_, std::strerror(errno)), errno);
  }
  if (!S_ISREG(st.st_mode)) throw CheckpointError(fmt::format("{} is not a regular file", file.where_));
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    throw CheckpointError(fmt::format("{}: cannot make its reads blocking: {}", file.where_, std::strerror(errno)),
                          errno);
  }
  const auto file_bytes = static_cast<std::uint64_t>(st.st_size);
  check_file_length(file_bytes, file.where_);
  unsigned char prefix[8];
  file.read_at(0, prefix, sizeof prefix);
  const std::uint64_t length = header_length(prefix, file_bytes, file.where_);
  std::string json(static_cast<std::size_t>(length), '\0');
  file.read_at(8, json.data(), json.size());
  file.header_ = parse_header(json, file_bytes, file.where_);
  return file;
}

CheckpointFile::CheckpointFile(CheckpointFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), where_(std::move(other.where_)), header_(std::move(other.header_)) {}

CheckpointFile& CheckpointFile::operator=(CheckpointFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    where_ = std::move(other.where_);
    header_ = std::move(other.header_);
  }
  return *this;
}

CheckpointFile::~CheckpointFile() {
  if (fd_ >= 0) ::close(fd_);
}

int CheckpointFile::release() noexcept { return std::exchange(fd_, -1); }

void CheckpointFile::read_at(std::uint64_t offset, void* out, std::size_t n) const {
  auto* bytes = static_cast<unsigned char*>(out);
  std::size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd_, bytes + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw CheckpointError(fmt::format("{}: reading failed: {}", where_, std::strerror(errno)), errno);
    }
    if (got == 0) {
      throw CheckpointError(fmt::format("{} is truncated: the file ended at byte {}, {} bytes were expected there "
                                        "(it shrank?)",
                                        where_, offset + done, n - done));
    }
    done += static_cast<std::size_t>(got);
  }
}

std::string quoted(std::string_view text) {
  std::string out = "'";
  for (std::size_t at = 0; at < text.size(); ++at) {
    const char c = text[at];
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x80) {
      // A whole UTF-8 sequence as it is; a byte of none escaped, so that the message stays UTF-8.
      if (const std::size_t n = Scanner::utf8_sequence(text.substr(at)); n != 0) {
        out += text.substr(at, n);
        at += n - 1;
      } else {
        out += fmt::format("\\x{:02x}", byte);
      }
    } else if (c == '\\' || c == '\'') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (byte < 0x20 || byte == 0x7f) {
      out += fmt::format("\\x{:02x}", byte);
    } else {
      out += c;
    }
  }
  return out + "'";
}

std::string_view safetensors_name(DType dtype) noexcept {
  for (const DTypeName& d : kDTypes) {
    if (d.dtype == dtype) return d.safetensors;
  }
  return {};
}

bool from_safetensors_name(std::string_view name, DType& dtype) noexcept {
  const DTypeName* found = find_dtype(name);
  if (found != nullptr) dtype = found->dtype;
  return found != nullptr;
}

bool valid_utf8(std::string_view text) noexcept {
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t n = Scanner::utf8_sequence(text.substr(at));
    if (n == 0) return false;
    at += n;
  }
  return true;
}

}  // namespace devbridge::checkpoint
