#include "checkpoint.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <openssl/evp.h>

#include "devbridge/checkpoint_file.hpp"
#include "devbridge/types.hpp"
#include "sizes.hpp"

namespace devbridge::cli {

namespace {

constexpr std::size_t kReadChunk = 4 << 20;

std::string shape_text(const std::vector<std::uint64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
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

// "<algorithm>:<hex>" of the file's bytes [begin, end), read in chunks through
// the descriptor the header was read from.
template <class Digest>
std::string checksum_of(const checkpoint::CheckpointFile& file, std::uint64_t begin, std::uint64_t end,
                        std::string_view algorithm) {
  Digest digest;
  std::vector<unsigned char> buffer(static_cast<std::size_t>(std::min<std::uint64_t>(kReadChunk, end - begin)));
  for (std::uint64_t at = begin; at < end;) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size(), end - at));
    file.read_at(at, buffer.data(), n);
    digest.update(buffer.data(), n);
    at += n;
  }
  return fmt::format("{}:{}", algorithm, digest.hexdigest());
}

std::string metadata_value(const CheckpointReport& report, std::string_view key) {
  for (const auto& [k, v] : report.metadata) {
    if (k == key) return v;
  }
  return {};
}

// The format version of a devbridge checkpoint the header check accepted: the one this reader knows, which
// a file without the key is read as (PORTABLE.md).
std::string format_version(const CheckpointReport& report) {
  const std::string recorded = metadata_value(report, "format_version");
  return recorded.empty() ? std::string(checkpoint::kFormatVersion) : recorded;
}

// `text` with any invalid UTF-8 replaced (a path from argv need not be UTF-8; JSON must be).
std::string valid_utf8(const std::string& text) {
  return nlohmann::json::parse(nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace))
      .get<std::string>();
}

}  // namespace

std::string quoted(const std::string& text) { return checkpoint::quoted(text); }

CheckpointReport inspect_checkpoint(const std::string& path) {
  CheckpointReport report;
  report.path = path;
  const std::string where = quoted(path);
  try {
    const checkpoint::CheckpointFile file = checkpoint::CheckpointFile::open(path, where);
    const checkpoint::Header& header = file.header();
    report.file_bytes = header.file_bytes;
    report.header_bytes = header.header_bytes;
    report.data_bytes = header.data_bytes();
    report.metadata = header.metadata;
    report.devbridge = header.devbridge;
    report.recorded_checksum = header.checksum;  // only devbridge's own checksum is devbridge's to verify
    for (const checkpoint::TensorEntry& t : header.tensors) {
      // A dtype devbridge does not hold has no devbridge name: its dtype stays empty (null in --json).
      report.tensors.push_back({t.name, t.dtype ? std::string(dtype_info(*t.dtype).name) : std::string(),
                                t.safetensors_dtype, t.shape, t.begin, t.end, t.unrestorable});
    }
    report.header_ok = true;
    if (report.recorded_checksum.empty()) {
      report.checksum = ChecksumStatus::None;
      return report;
    }
    report.computed_checksum =
        report.recorded_checksum.rfind("sha256:", 0) == 0
            ? checksum_of<Sha256>(file, header.data_start(), header.file_bytes, "sha256")
            : checksum_of<checkpoint::Crc32>(file, header.data_start(), header.file_bytes, "crc32");
    if (report.computed_checksum == report.recorded_checksum) {
      report.checksum = ChecksumStatus::Verified;
    } else {
      report.checksum = ChecksumStatus::Mismatch;
      report.error = fmt::format("{} is corrupt: the data's checksum is {}, the file records {}", where,
                                 report.computed_checksum, report.recorded_checksum);
    }
  } catch (const checkpoint::CheckpointError& e) {
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
                       format_version(report), generation.empty() ? "?" : generation);
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
    dtype_width = std::max(dtype_width, (t.dtype.empty() ? t.safetensors_dtype : t.dtype).size());
  }
  for (const CheckpointTensor& t : report.tensors) {
    out += fmt::format("  {:<{}}  {:<{}}  {:<16}  {} bytes at {}{}\n", quoted(t.name), name_width,
                       t.dtype.empty() ? t.safetensors_dtype : t.dtype, dtype_width, shape_text(t.shape),
                       t.end - t.begin, t.begin, t.unrestorable.empty() ? "" : "  (not restorable)");
  }
  for (const CheckpointTensor& t : report.tensors) {
    if (!t.unrestorable.empty()) out += fmt::format("not restorable: {}\n", t.unrestorable);
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
        {"dtype", t.dtype.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.dtype)},
        {"safetensors_dtype", t.safetensors_dtype},
        {"shape", t.shape},
        {"data_offsets", {t.begin, t.end}},
        {"nbytes", t.end - t.begin},
        {"unrestorable", t.unrestorable.empty() ? nlohmann::json(nullptr) : nlohmann::json(valid_utf8(t.unrestorable))},
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
      report.devbridge ? nlohmann::json(format_version(report)) : nlohmann::json(nullptr);
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
