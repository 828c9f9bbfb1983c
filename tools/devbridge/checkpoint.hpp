// `devbridge checkpoint inspect FILE`: what a checkpoint holds (tensor names,
// dtypes, shapes, the generation and the rest of devbridge's metadata), and
// whether its data still matches the checksum recorded in it.
//
// A checkpoint is a safetensors file (docs/PORTABLE.md): an 8-byte
// little-endian header length, a JSON header, then the data section. The
// header is read and checked by the library's one reader
// (include/devbridge/checkpoint_file.hpp), the one devbridge.restore and
// checkpoint_info use too, before any data is read: a file restore would
// refuse is refused here with the same words, and nothing in it can make the
// command block, crash or allocate more than the file's own header.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace devbridge::cli {

struct CheckpointTensor {
  std::string name;
  std::string dtype;              // devbridge's name ("float32")
  std::string safetensors_dtype;  // the file's ("F32")
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0;  // data_offsets, relative to the data section
  std::uint64_t end = 0;
  std::string unrestorable;  // why restore cannot take it (checkpoint::TensorEntry::unrestorable); empty: it can
};

enum class ChecksumStatus {
  None,      // the file records no checksum (a plain safetensors file)
  Verified,  // recorded and recomputed, equal
  Mismatch,  // recorded and recomputed, different: the data is corrupt
  NotChecked,  // the file was refused before its data could be read
};

struct CheckpointReport {
  std::string path;
  std::uint64_t file_bytes = 0;
  std::uint64_t header_bytes = 0;  // the JSON header's length (after the 8-byte length)
  std::uint64_t data_bytes = 0;
  bool header_ok = false;  // the header parsed and agrees with the file: the fields below hold
  std::vector<std::pair<std::string, std::string>> metadata;  // __metadata__, sorted by key
  bool devbridge = false;  // metadata format is "devbridge-checkpoint"
  std::vector<CheckpointTensor> tensors;  // in file order
  std::string recorded_checksum;  // "sha256:<hex>", or empty
  std::string computed_checksum;  // empty unless computed
  ChecksumStatus checksum = ChecksumStatus::NotChecked;
  std::string error;  // why the file is refused (one line, names the file); empty when it is good

  bool ok() const { return error.empty(); }
};

// Reads and checks `path`. Never throws for anything about the file (a
// missing, short, corrupt or hostile file lands in `error`); throws only
// std::bad_alloc.
CheckpointReport inspect_checkpoint(const std::string& path);

// The human-readable listing `inspect` prints (for a good or a corrupt file
// whose header parsed; a refused header is only the error line).
std::string format_checkpoint(const CheckpointReport& report);

// The document `inspect --json` writes (fields documented in docs/PORTABLE.md).
nlohmann::json checkpoint_report_json(const CheckpointReport& report);

// 'text' quoted as Python's repr quotes a str, control characters escaped:
// names and paths from a hostile file stay on one line.
std::string quoted(const std::string& text);

}  // namespace devbridge::cli
