#include "checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string_view>

#include <fmt/format.h>
#include <openssl/evp.h>

#include "devbridge/checked.hpp"
#include "sizes.hpp"

namespace devbridge::cli {

namespace {

// What python/devbridge/_portable.py writes and checks.
constexpr std::string_view kFormat = "devbridge-checkpoint";
// The safetensors package refuses headers past 100 MB; so do restore and inspect
// (a corrupt length must not make either read gigabytes of "header").
constexpr std::uint64_t kHeaderLimit = 100'000'000;
// Nesting deeper than this is no safetensors header (theirs nests three levels).
constexpr int kMaxDepth = 64;
constexpr std::size_t kReadChunk = 4 << 20;

struct DTypeName {
  std::string_view safetensors;
  std::string_view devbridge;
  std::uint64_t itemsize;
};

// Every devbridge dtype (include/devbridge/types.hpp), as _portable.py names them.
constexpr std::array<DTypeName, 15> kDTypes{{
    {"BF16", "bfloat16", 2},
    {"BOOL", "bool", 1},
    {"F16", "float16", 2},
    {"F32", "float32", 4},
    {"F64", "float64", 8},
    {"F8_E4M3", "float8_e4m3fn", 1},
    {"F8_E5M2", "float8_e5m2", 1},
    {"I16", "int16", 2},
    {"I32", "int32", 4},
    {"I64", "int64", 8},
    {"I8", "int8", 1},
    {"U16", "uint16", 2},
    {"U32", "uint32", 4},
    {"U64", "uint64", 8},
    {"U8", "uint8", 1},
}};

const DTypeName* find_dtype(std::string_view safetensors) {
  for (const DTypeName& d : kDTypes) {
    if (d.safetensors == safetensors) return &d;
  }
  return nullptr;
}

std::string known_dtypes() {
  std::string names;
  for (const DTypeName& d : kDTypes) {
    if (!names.empty()) names += ", ";
    names += d.safetensors;
  }
  return names;
}

// A refusal: the message becomes the report's error.
class Refused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Reads exactly `n` bytes at `offset`; false when the file ends first.
bool read_at(int fd, std::uint64_t offset, unsigned char* out, std::size_t n, const std::string& where) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd, out + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw Refused(fmt::format("{}: reading failed: {}", where, std::strerror(errno)));
    }
    if (got == 0) return false;
    done += static_cast<std::size_t>(got);
  }
  return true;
}

std::string shape_text(const std::vector<std::uint64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

std::string json_text(const nlohmann::json& value) {
  if (value.is_string() && value.get_ref<const std::string&>().size() <= 78) return quoted(value.get<std::string>());
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

// A non-negative JSON integer that fits in 64 bits.
std::optional<std::uint64_t> as_u64(const nlohmann::json& value) {
  if (value.is_number_unsigned()) return value.get<std::uint64_t>();
  if (value.is_number_integer() && value.get<std::int64_t>() >= 0) return static_cast<std::uint64_t>(value.get<std::int64_t>());
  return std::nullopt;
}

bool is_hex_digest(std::string_view digits, std::size_t length) {
  return digits.size() == length &&
         std::all_of(digits.begin(), digits.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string hex(const unsigned char* bytes, std::size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    out += kDigits[bytes[i] >> 4];
    out += kDigits[bytes[i] & 15];
  }
  return out;
}

// The checksums a checkpoint may record (python/devbridge/_portable.py's
// _CHECKSUM_DIGITS): "crc32:<8 hex digits>" (zlib's CRC-32, what checkpoint
// writes by default) and "sha256:<64 hex digits>" (checkpoint(checksum="sha256"),
// and every file written before crc32 was the default).
struct ChecksumKind {
  std::string_view algorithm;
  std::size_t digits;
};
constexpr std::array<ChecksumKind, 2> kChecksums{{{"crc32", 8}, {"sha256", 64}}};

bool valid_checksum(std::string_view checksum) {
  const std::size_t colon = checksum.find(':');
  if (colon == std::string_view::npos) return false;
  for (const ChecksumKind& kind : kChecksums) {
    if (checksum.substr(0, colon) == kind.algorithm) return is_hex_digest(checksum.substr(colon + 1), kind.digits);
  }
  return false;
}

// CRC-32 (the IEEE polynomial, reflected: zlib.crc32), eight bytes at a time.
class Crc32 {
 public:
  void update(const unsigned char* data, std::size_t n) {
    static const Tables tables;
    std::uint32_t crc = ~value_;
    while (n >= 8) {
      std::uint32_t low = 0;
      std::uint32_t high = 0;
      std::memcpy(&low, data, 4);
      std::memcpy(&high, data + 4, 4);
      if constexpr (std::endian::native == std::endian::big) {
        low = __builtin_bswap32(low);
        high = __builtin_bswap32(high);
      }
      low ^= crc;
      crc = tables.t[7][low & 0xff] ^ tables.t[6][(low >> 8) & 0xff] ^ tables.t[5][(low >> 16) & 0xff] ^
            tables.t[4][low >> 24] ^ tables.t[3][high & 0xff] ^ tables.t[2][(high >> 8) & 0xff] ^
            tables.t[1][(high >> 16) & 0xff] ^ tables.t[0][high >> 24];
      data += 8;
      n -= 8;
    }
    while (n-- > 0) crc = tables.t[0][(crc ^ *data++) & 0xff] ^ (crc >> 8);
    value_ = ~crc;
  }
  std::string hexdigest() const { return fmt::format("{:08x}", value_); }

 private:
  struct Tables {
    std::uint32_t t[8][256];
    Tables() {
      for (std::uint32_t i = 0; i < 256; ++i) {
        std::uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        t[0][i] = c;
      }
      for (std::uint32_t i = 0; i < 256; ++i) {
        for (int s = 1; s < 8; ++s) t[s][i] = t[0][t[s - 1][i] & 0xff] ^ (t[s - 1][i] >> 8);
      }
    }
  };
  std::uint32_t value_ = 0;
};

struct DigestDeleter {
  void operator()(EVP_MD_CTX* context) const { EVP_MD_CTX_free(context); }
};

class Sha256 {
 public:
  Sha256() : context_(EVP_MD_CTX_new()) {
    if (!context_ || EVP_DigestInit_ex(context_.get(), EVP_sha256(), nullptr) != 1) {
      throw std::runtime_error("OpenSSL could not start a sha256 digest");
    }
  }
  void update(const unsigned char* data, std::size_t n) {
    if (EVP_DigestUpdate(context_.get(), data, n) != 1) throw std::runtime_error("OpenSSL sha256 failed");
  }
  std::string hexdigest() {
    std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
    unsigned int length = 0;
    if (EVP_DigestFinal_ex(context_.get(), digest.data(), &length) != 1) throw std::runtime_error("OpenSSL sha256 failed");
    return hex(digest.data(), length);
  }

 private:
  std::unique_ptr<EVP_MD_CTX, DigestDeleter> context_;
};

// "<algorithm>:<hex>" of the file's bytes [begin, end), read in chunks.
template <class Digest>
std::string checksum_of(int fd, std::uint64_t begin, std::uint64_t end, const std::string& where,
                        std::string_view algorithm) {
  Digest digest;
  std::vector<unsigned char> buffer(static_cast<std::size_t>(std::min<std::uint64_t>(kReadChunk, end - begin)));
  for (std::uint64_t at = begin; at < end;) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size(), end - at));
    if (!read_at(fd, at, buffer.data(), n, where)) {
      throw Refused(fmt::format("{} is truncated: the file ended at byte {} while its data was read (it shrank?)",
                                where, at));
    }
    digest.update(buffer.data(), n);
    at += n;
  }
  return fmt::format("{}:{}", algorithm, digest.hexdigest());
}

// Parses the header and checks it against the file: the same checks, in the
// same order, as _portable.py's _read_header.
void read_header(int fd, CheckpointReport& report, const std::string& where) {
  if (report.file_bytes < 8) {
    throw Refused(fmt::format("{} is not a safetensors file: {} bytes, shorter than the 8-byte header length", where,
                              report.file_bytes));
  }
  unsigned char prefix[8];
  if (!read_at(fd, 0, prefix, sizeof prefix, where)) {
    throw Refused(fmt::format("{} is truncated: 8 bytes expected at its start", where));
  }
  std::uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | prefix[i];
  if (length > kHeaderLimit) {
    throw Refused(fmt::format("{} is not a safetensors file: a header length of {} bytes (past {})", where, length,
                              kHeaderLimit));
  }
  if (!checked::range_within(8, length, report.file_bytes)) {
    throw Refused(fmt::format("{} is truncated (or not a safetensors file): its header is {} bytes, the file {}", where,
                              length, report.file_bytes));
  }
  report.header_bytes = length;
  report.data_bytes = report.file_bytes - 8 - length;

  std::string text(static_cast<std::size_t>(length), '\0');
  if (!read_at(fd, 8, reinterpret_cast<unsigned char*>(text.data()), text.size(), where)) {
    throw Refused(fmt::format("{} is truncated: {} bytes of header expected", where, length));
  }
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (depth > kMaxDepth) throw Refused(fmt::format("nested deeper than {} levels", kMaxDepth));
      return true;
    });
  } catch (const Refused& e) {
    throw Refused(fmt::format("{} is not a safetensors file: its header is not JSON ({})", where, e.what()));
  } catch (const nlohmann::json::exception& e) {
    throw Refused(fmt::format("{} is not a safetensors file: its header is not JSON ({})", where, e.what()));
  }
  text.clear();
  text.shrink_to_fit();
  if (!header.is_object()) throw Refused(fmt::format("{} is not a safetensors file: its header is not a JSON object", where));

  nlohmann::json metadata = nlohmann::json::object();
  if (auto it = header.find("__metadata__"); it != header.end()) {
    if (!it->is_null()) metadata = std::move(*it);
    header.erase(it);
  }
  if (!metadata.is_object() ||
      !std::all_of(metadata.begin(), metadata.end(), [](const nlohmann::json& v) { return v.is_string(); })) {
    throw Refused(fmt::format("{}: __metadata__ is not a map of strings to strings", where));
  }
  for (auto it = metadata.begin(); it != metadata.end(); ++it) report.metadata.emplace_back(it.key(), it.value());

  // devbridge's own dtype names, recorded by checkpoint (a plain safetensors file has none).
  nlohmann::json recorded = nlohmann::json::object();
  if (auto it = metadata.find("dtypes"); it != metadata.end()) {
    try {
      recorded = nlohmann::json::parse(it->get<std::string>(), [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth > kMaxDepth) throw Refused("too deep");
        return true;
      });
    } catch (const std::exception&) {
      recorded = nullptr;
    }
    if (!recorded.is_object() ||
        !std::all_of(recorded.begin(), recorded.end(), [](const nlohmann::json& v) { return v.is_string(); })) {
      throw Refused(fmt::format("{}: the metadata's dtypes entry is not a JSON map of names to dtypes", where));
    }
  }

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& info = it.value();
    const std::string at = fmt::format("{}: tensor {}", where, quoted(name));
    if (!info.is_object()) throw Refused(fmt::format("{}: its header entry is not an object", at));
    const nlohmann::json none;
    const nlohmann::json& dtype = info.contains("dtype") ? info["dtype"] : none;
    const nlohmann::json& shape = info.contains("shape") ? info["shape"] : none;
    const nlohmann::json& offsets = info.contains("data_offsets") ? info["data_offsets"] : none;
    const DTypeName* known = dtype.is_string() ? find_dtype(dtype.get<std::string>()) : nullptr;
    if (known == nullptr) {
      throw Refused(fmt::format("{}: dtype {} is not one devbridge holds (it knows {})", at, json_text(dtype),
                                known_dtypes()));
    }
    if (auto r = recorded.find(name); r != recorded.end() && r->get<std::string>() != known->devbridge) {
      throw Refused(fmt::format("{}: the metadata records dtype {}, the header {}", at, quoted(r->get<std::string>()),
                                quoted(std::string(known->safetensors))));
    }
    CheckpointTensor tensor{name, std::string(known->devbridge), std::string(known->safetensors), {}, 0, 0};
    if (!shape.is_array()) throw Refused(fmt::format("{}: shape {} is not a list of non-negative integers", at, json_text(shape)));
    for (const nlohmann::json& d : shape) {
      const auto dim = as_u64(d);
      if (!dim) throw Refused(fmt::format("{}: shape {} is not a list of non-negative integers", at, json_text(shape)));
      tensor.shape.push_back(*dim);
    }
    bool offsets_ok = false;
    if (offsets.is_array() && offsets.size() == 2) {
      const std::optional<std::uint64_t> begin = as_u64(offsets[0]);
      const std::optional<std::uint64_t> end = as_u64(offsets[1]);
      if (begin && end && *begin <= *end) {
        tensor.begin = *begin;
        tensor.end = *end;
        offsets_ok = true;
      }
    }
    if (!offsets_ok) {
      throw Refused(fmt::format("{}: data_offsets {} are not [begin, end] byte offsets", at, json_text(offsets)));
    }
    const std::uint64_t span = tensor.end - tensor.begin;
    std::optional<std::uint64_t> nbytes = known->itemsize;
    for (std::uint64_t dim : tensor.shape) {
      if (nbytes) nbytes = checked::mul(*nbytes, dim);
    }
    // A product past 2^64 can only be 0 bytes when a later dimension is 0.
    if (!nbytes && std::find(tensor.shape.begin(), tensor.shape.end(), 0) != tensor.shape.end()) nbytes = 0;
    if (!nbytes) {
      throw Refused(fmt::format("{}: shape {} of {} is more than 2^64 bytes (its data_offsets span {})", at,
                                shape_text(tensor.shape), tensor.dtype, span));
    }
    if (*nbytes != span) {
      throw Refused(fmt::format("{}: shape {} of {} is {} bytes, its data_offsets span {}", at, shape_text(tensor.shape),
                                tensor.dtype, *nbytes, span));
    }
    if (*nbytes == 0) {
      throw Refused(fmt::format("{}: shape {} is empty, and a device allocation cannot be (devbridge cannot restore it)",
                                at, shape_text(tensor.shape)));
    }
    report.tensors.push_back(std::move(tensor));
  }
  std::sort(report.tensors.begin(), report.tensors.end(), [](const CheckpointTensor& a, const CheckpointTensor& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t expected = 0;
  for (const CheckpointTensor& t : report.tensors) {
    if (t.begin != expected) {
      throw Refused(fmt::format("{}: tensor {} starts at data byte {}, expected {} (tensors overlap or leave a gap)",
                                where, quoted(t.name), t.begin, expected));
    }
    expected = t.end;
  }
  if (expected > report.data_bytes) {
    throw Refused(fmt::format("{} is truncated: its tensors need {} bytes of data, the file holds {}", where, expected,
                              report.data_bytes));
  }
  if (expected < report.data_bytes) {
    throw Refused(fmt::format("{}: {} bytes follow the last tensor's data (corrupt, or not a safetensors file)", where,
                              report.data_bytes - expected));
  }
  for (const auto& [key, value] : report.metadata) {
    if (key == "format") report.devbridge = value == kFormat;
    if (key == "checksum") report.recorded_checksum = value;
  }
  if (report.devbridge) {
    const std::string& checksum = report.recorded_checksum;
    if (!valid_checksum(checksum)) {
      throw Refused(fmt::format(
          "{}: a devbridge checkpoint without a valid checksum (got {}; crc32:<8 hex digits> or sha256:<64 hex digits>)",
          where, quoted(checksum)));
    }
  } else {
    report.recorded_checksum.clear();  // only devbridge's own checksum is devbridge's to verify
  }
  report.header_ok = true;
}

std::string metadata_value(const CheckpointReport& report, std::string_view key) {
  for (const auto& [k, v] : report.metadata) {
    if (k == key) return v;
  }
  return {};
}

// `text` with any invalid UTF-8 replaced (a path from argv need not be UTF-8; JSON must be).
std::string valid_utf8(const std::string& text) {
  return nlohmann::json::parse(nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace))
      .get<std::string>();
}

}  // namespace

std::string quoted(const std::string& text) {
  std::string out = "'";
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\\' || c == '\'') {
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

CheckpointReport inspect_checkpoint(const std::string& path) {
  CheckpointReport report;
  report.path = path;
  const std::string where = quoted(path);
  try {
    Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) throw Refused(fmt::format("{}: cannot open it: {}", where, std::strerror(errno)));
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) throw Refused(fmt::format("{}: cannot stat it: {}", where, std::strerror(errno)));
    if (!S_ISREG(st.st_mode)) throw Refused(fmt::format("{} is not a regular file", where));
    report.file_bytes = static_cast<std::uint64_t>(st.st_size);
    read_header(fd.get(), report, where);
    if (report.recorded_checksum.empty()) {
      report.checksum = ChecksumStatus::None;
      return report;
    }
    const std::uint64_t data_start = 8 + report.header_bytes;
    report.computed_checksum =
        report.recorded_checksum.rfind("sha256:", 0) == 0
            ? checksum_of<Sha256>(fd.get(), data_start, report.file_bytes, where, "sha256")
            : checksum_of<Crc32>(fd.get(), data_start, report.file_bytes, where, "crc32");
    if (report.computed_checksum == report.recorded_checksum) {
      report.checksum = ChecksumStatus::Verified;
    } else {
      report.checksum = ChecksumStatus::Mismatch;
      report.error = fmt::format("{} is corrupt: the data's checksum is {}, the file records {}", where,
                                 report.computed_checksum, report.recorded_checksum);
    }
  } catch (const Refused& e) {
    report.error = e.what();
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception& e) {
    report.error = fmt::format("{}: {}", where, e.what());
  }
  return report;
}

std::string format_checkpoint(const CheckpointReport& report) {
  std::string out;
  if (!report.header_ok) return out;
  const std::string generation = metadata_value(report, "generation");
  if (report.devbridge) {
    out += fmt::format("{}: devbridge checkpoint, format version {}, generation {}\n", quoted(report.path),
                       metadata_value(report, "format_version"), generation.empty() ? "?" : generation);
  } else {
    out += fmt::format("{}: safetensors file without devbridge metadata\n", quoted(report.path));
  }
  out += fmt::format("  file       {} bytes: 8 + {} of header + {} of data ({})\n", report.file_bytes,
                     report.header_bytes, report.data_bytes, format_bytes(report.data_bytes));
  out += fmt::format("tensors ({}, in file order):\n", report.tensors.size());
  std::size_t name_width = 4;
  std::size_t dtype_width = 5;
  for (const CheckpointTensor& t : report.tensors) {
    name_width = std::max(name_width, quoted(t.name).size());
    dtype_width = std::max(dtype_width, t.dtype.size());
  }
  for (const CheckpointTensor& t : report.tensors) {
    out += fmt::format("  {:<{}}  {:<{}}  {:<16}  {} bytes at {}\n", quoted(t.name), name_width, t.dtype, dtype_width,
                       shape_text(t.shape), t.end - t.begin, t.begin);
  }
  if (!report.metadata.empty()) {
    out += "metadata:\n";
    std::size_t key_width = 0;
    for (const auto& [key, value] : report.metadata) key_width = std::max(key_width, quoted(key).size());
    for (const auto& [key, value] : report.metadata) {
      out += fmt::format("  {:<{}}  {}\n", quoted(key), key_width, quoted(value));
    }
  }
  switch (report.checksum) {
    case ChecksumStatus::None:
      out += "checksum: none recorded (no checksum to verify)\n";
      break;
    case ChecksumStatus::Verified:
      out += fmt::format("checksum: {} verified\n", report.computed_checksum);
      break;
    case ChecksumStatus::Mismatch:
      out += fmt::format("checksum: MISMATCH: the data hashes to {}, the file records {}\n", report.computed_checksum,
                         report.recorded_checksum);
      break;
    case ChecksumStatus::NotChecked:
      out += "checksum: not checked (the data could not be read)\n";
      break;
  }
  return out;
}

nlohmann::json checkpoint_report_json(const CheckpointReport& report) {
  static constexpr std::array<std::string_view, 4> kStatus{"none", "verified", "mismatch", "not_checked"};
  nlohmann::json document = {
      {"command", "checkpoint inspect"},
      {"file", valid_utf8(report.path)},
      {"ok", report.ok()},
      {"error", report.ok() ? nlohmann::json(nullptr) : nlohmann::json(valid_utf8(report.error))},
  };
  if (!report.header_ok) return document;
  nlohmann::json metadata = nlohmann::json::object();
  for (const auto& [key, value] : report.metadata) metadata[key] = value;
  nlohmann::json tensors = nlohmann::json::array();
  for (const CheckpointTensor& t : report.tensors) {
    tensors.push_back({
        {"name", t.name},
        {"dtype", t.dtype},
        {"safetensors_dtype", t.safetensors_dtype},
        {"shape", t.shape},
        {"data_offsets", {t.begin, t.end}},
        {"nbytes", t.end - t.begin},
    });
  }
  const std::string generation = metadata_value(report, "generation");
  nlohmann::json generation_value = nullptr;
  if (report.devbridge && !generation.empty() &&
      std::all_of(generation.begin(), generation.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
      generation.size() <= 19) {
    generation_value = std::stoull(generation);
  }
  document["devbridge"] = report.devbridge;
  document["format_version"] =
      report.devbridge ? nlohmann::json(metadata_value(report, "format_version")) : nlohmann::json(nullptr);
  document["generation"] = generation_value;
  document["file_bytes"] = report.file_bytes;
  document["header_bytes"] = report.header_bytes;
  document["data_bytes"] = report.data_bytes;
  document["tensors"] = std::move(tensors);
  document["metadata"] = std::move(metadata);
  document["checksum"] = {
      {"status", kStatus[static_cast<std::size_t>(report.checksum)]},
      {"recorded", report.recorded_checksum.empty() ? nlohmann::json(nullptr) : nlohmann::json(report.recorded_checksum)},
      {"computed", report.computed_checksum.empty() ? nlohmann::json(nullptr) : nlohmann::json(report.computed_checksum)},
  };
  return document;
}

}  // namespace devbridge::cli
