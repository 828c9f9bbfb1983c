// libFuzzer target: the checkpoint header reader
// (include/devbridge/checkpoint_file.hpp) over whole files, as
// `devbridge checkpoint inspect`, checkpoint_info and restore hand it one.
// The input is the file: 8-byte little-endian header length, header, data.
//
// A finding is a crash, a sanitizer report, a hang, running out of memory,
// an exception other than CheckpointError, or an accepted header that breaks
// what the format and restore rely on (checked below).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "devbridge/checked.hpp"
#include "devbridge/checkpoint_file.hpp"
#include "devbridge/types.hpp"

namespace {

using devbridge::checkpoint::CheckpointError;
using devbridge::checkpoint::Header;

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "checkpoint fuzz invariant broken: %s\n", what);
  std::abort();
}

void require(bool ok, const char* what) {
  if (!ok) broken(what);
}

// What an accepted header promises its callers.
void check(const Header& h, std::size_t size) {
  require(h.file_bytes == size, "file_bytes is the file's size");
  require(h.header_bytes <= devbridge::checkpoint::kHeaderLimit, "the header is within the limit");
  require(devbridge::checked::range_within(8, h.header_bytes, size), "the header lies within the file");
  require(h.data_start() + h.data_bytes() == size, "the data section ends the file");
  // The data ranges are ordered, in bounds and tile the data section exactly;
  // a tensor restore can take (none kept as unrestorable: an empty one, a
  // dtype devbridge does not hold) is non-empty and its shape its bytes.
  std::uint64_t expected = 0;
  devbridge::DType held{};
  for (const auto& t : h.tensors) {
    require(t.begin == expected, "each tensor starts where the last ended");
    require(t.begin <= t.end, "a tensor's data_offsets are ordered");
    require(t.end <= h.data_bytes(), "each tensor lies within the data section");
    require(t.shape.size() <= static_cast<std::size_t>(devbridge::kMaxRank), "the rank is at most kMaxRank");
    require(devbridge::checkpoint::valid_utf8(t.name), "names are UTF-8");
    expected = t.end;
    require(t.dtype.has_value() == devbridge::checkpoint::from_safetensors_name(t.safetensors_dtype, held) &&
                (!t.dtype || *t.dtype == held),
            "the dtype is empty exactly when devbridge lacks the file's, else the one its spelling names");
    if (!t.unrestorable.empty()) {
      require(t.begin == t.end || !t.dtype, "only an empty tensor or a dtype devbridge does not hold is unrestorable");
      continue;
    }
    require(t.begin < t.end, "no restorable tensor is empty");
    require(!t.shape.empty() || t.nbytes() == devbridge::dtype_size(*t.dtype), "a scalar is one item");
    std::uint64_t n = devbridge::dtype_size(*t.dtype);
    for (std::uint64_t d : t.shape) {
      const auto product = devbridge::checked::mul(n, d);
      require(product.has_value(), "the shape's byte size fits in 64 bits");
      n = *product;
    }
    require(n == t.nbytes(), "the shape's byte size is the data range's");
  }
  require(expected == h.data_bytes(), "the tensors cover the data section");
  for (std::size_t i = 1; i < h.metadata.size(); ++i) {
    require(h.metadata[i - 1].first < h.metadata[i].first, "metadata keys are sorted and unique");
  }
  for (const auto& [key, value] : h.metadata) {
    require(devbridge::checkpoint::valid_utf8(key) && devbridge::checkpoint::valid_utf8(value), "metadata is UTF-8");
  }
  require(h.devbridge || h.checksum.empty(), "only a devbridge file records a checksum");
  require(!h.devbridge || h.checksum.size() == 6 + 8 || h.checksum.size() == 7 + 64, "a checksum has its digits");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view file(reinterpret_cast<const char*>(data), size);
  try {
    const Header h = devbridge::checkpoint::parse_checkpoint(file, "'fuzz'");
    check(h, size);
    // Accepted names are unique: restore's dict and the CLI's listing would disagree otherwise.
    std::vector<std::string_view> names;
    for (const auto& t : h.tensors) names.push_back(t.name);
    std::sort(names.begin(), names.end());
    require(std::adjacent_find(names.begin(), names.end()) == names.end(), "tensor names are unique");
  } catch (const CheckpointError& e) {
    // Every refusal names the file, and is one line.
    const std::string_view what = e.what();
    require(what.rfind("'fuzz'", 0) == 0, "a refusal names the file first");
    require(what.find('\n') == std::string_view::npos, "a refusal is one line");
  }
  return 0;
}
