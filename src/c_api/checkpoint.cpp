// Checkpoint and restore through the C ABI, in the file format of Python's
// devbridge.checkpoint / devbridge.restore (python/devbridge/_checkpoint.py,
// docs/PORTABLE.md): a safetensors file whose __metadata__ records the
// format, the generation, each tensor's devbridge dtype and the CRC-32 of
// the data section. Reading goes through the library's one header parser
// (devbridge/checkpoint_file.hpp); the bytes travel through the ring in
// chunks by the TransferPlanner, so no tensor is ever held whole.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <system_error>
#include <unordered_map>
#include <vector>

#include "boundary.hpp"
#include "devbridge/checkpoint_file.hpp"
#include "devbridge/checkpoint_restore.hpp"
#include "devbridge/replacing_file.hpp"
#include "devbridge/transfer.hpp"

using namespace devbridge;
using namespace devbridge::c_api;
namespace ckpt = devbridge::checkpoint;

namespace {

constexpr std::uint64_t kRestoreAlignment = 256;           // Python's restore default
constexpr std::string_view kChecksumPlaceholder = "crc32:00000000";

// A file the checkpoint refuses is InvalidRange, one the system refuses
// Unavailable (docs/C_API.md); the parser's message names the file already.
Error from_checkpoint_error(std::string_view operation, const ckpt::CheckpointError& error) {
  return Error(error.os_error() != 0 ? ErrorKind::Unavailable : ErrorKind::InvalidRange,
               std::string(operation) + ": " + error.what());
}

// Runs `body` for one tensor of `file` (quoted), naming the file and the
// tensor in whatever it throws and keeping the kind.
template <class Body>
void for_tensor(std::string_view operation, const std::string& file, std::string_view tensor, Body&& body) {
  const auto named = std::string(operation) + " " + file + ": tensor " + ckpt::quoted(tensor);
  try {
    body();
  } catch (const Error& error) {
    throw Error(error.kind(), named + ": " + std::string(error.message()), error.fatal());
  } catch (const ckpt::CheckpointError& error) {
    throw from_checkpoint_error(std::string(operation) + ": tensor " + ckpt::quoted(tensor), error);
  }
}

// ---- writing ----

struct PlannedTensor {
  std::string name;
  DeviceHandle handle;
  DType dtype;
  std::vector<std::int64_t> dims;
  std::uint64_t bytes = 0;
};

std::vector<PlannedTensor> planned_tensors(Bridge& bridge, std::span<const devbridge_checkpoint_entry> entries,
                                           const std::string& file) {
  const std::string where = "checkpoint " + ckpt::quoted(file);
  std::vector<PlannedTensor> tensors;
  tensors.reserve(entries.size());
  std::unordered_map<std::string, std::size_t> named;  // each name's entry
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const auto& entry = entries[i];
    const std::string which = "entries[" + std::to_string(i) + "]";
    PlannedTensor tensor;
    tensor.name = std::string(text(entry.name, which + ".name"));
    // "" is a name the safetensors package writes and restore reads; "__metadata__" is the header's own key.
    if (tensor.name == "__metadata__" || !ckpt::valid_utf8(tensor.name))
      invalid_argument(where + ": " + which + ".name " + ckpt::quoted(tensor.name) +
                       " cannot name a tensor (\"__metadata__\" is the header's metadata, and a name must be UTF-8)");
    if (const auto [first, fresh] = named.emplace(tensor.name, i); !fresh)
      invalid_argument(where + ": " + which + ".name " + ckpt::quoted(tensor.name) + " is entries[" +
                       std::to_string(first->second) + "]'s too: a tensor is named once");
    for_tensor("checkpoint", ckpt::quoted(file), tensor.name, [&] {
      tensor.dtype = dtype_from_c(entry.dtype, which + ".dtype");
      const auto dims = array_argument(entry.dims, entry.rank, which + ".dims");
      tensor.dims.assign(dims.begin(), dims.end());
      tensor.bytes = tensor_bytes(tensor.dtype, dims, which + ".dims");
      // Refused here, not at restore, which would refuse the whole file for it.
      if (tensor.bytes == 0)
        throw Error(ErrorKind::InvalidRange, which + ".dims has a zero dimension: an empty tensor cannot be "
                                                 "restored (no device allocation is empty)");
      tensor.handle = to_cpp(entry.handle);
      const auto extent = bridge.extent(tensor.handle);
      if (tensor.bytes > extent)
        throw Error(ErrorKind::InvalidRange, std::to_string(tensor.bytes) + " bytes of " +
                                                 std::string(dtype_info(tensor.dtype).name) +
                                                 " pass the allocation's extent of " + std::to_string(extent));
    });
    tensors.push_back(std::move(tensor));
  }
  // The safetensors package's order: widest dtype first, so every tensor starts aligned to its itemsize.
  std::sort(tensors.begin(), tensors.end(), [](const PlannedTensor& a, const PlannedTensor& b) {
    const auto wa = dtype_size(a.dtype), wb = dtype_size(b.dtype);
    return wa != wb ? wa > wb : a.name < b.name;
  });
  return tensors;
}

// The header as Python's json.dumps(header, separators=(",", ":")) writes it
// (ensure_ascii, insertion order), padded with spaces so the data starts
// 8-aligned, after its 8-byte little-endian length.
std::string encoded_header(const std::vector<PlannedTensor>& tensors, std::uint64_t generation,
                           std::string_view checksum) {
  // The dtypes entry is json.dumps(dtypes, sort_keys=True): default separators.
  std::vector<const PlannedTensor*> by_name;
  for (const auto& tensor : tensors) by_name.push_back(&tensor);
  std::sort(by_name.begin(), by_name.end(), [](auto* a, auto* b) { return a->name < b->name; });
  std::string dtypes = "{";
  for (const auto* tensor : by_name) {
    if (dtypes.size() > 1) dtypes += ", ";
    dtypes += nlohmann::json(tensor->name).dump(-1, ' ', true) + ": " +
              nlohmann::json(std::string(dtype_info(tensor->dtype).name)).dump(-1, ' ', true);
  }
  dtypes += "}";

  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", std::string(ckpt::kFormat)},
                            {"format_version", std::string(ckpt::kFormatVersion)},
                            {"generation", std::to_string(generation)},
                            {"checksum", std::string(checksum)},
                            {"dtypes", dtypes}};
  std::uint64_t begin = 0;
  for (const auto& tensor : tensors) {
    header[tensor.name] = {{"dtype", std::string(ckpt::safetensors_name(tensor.dtype))},
                           {"shape", tensor.dims},
                           {"data_offsets", {begin, begin + tensor.bytes}}};
    begin += tensor.bytes;
  }
  std::string text = header.dump(-1, ' ', true);
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string encoded(8, '\0');
  for (int i = 0; i < 8; ++i) encoded[i] = static_cast<char>((static_cast<std::uint64_t>(text.size()) >> (8 * i)) & 0xff);
  return encoded + text;
}

// ---- reading ----

struct Restored : devbridge_restored {
  std::vector<std::string> names;
  std::vector<std::vector<std::int64_t>> dims;
  std::vector<devbridge_restored_tensor> rows;
};

// The allocations of a restore, freed unless it succeeds.
class Allocations {
 public:
  explicit Allocations(Bridge& bridge) : bridge_(bridge) {}
  Allocations(const Allocations&) = delete;
  Allocations& operator=(const Allocations&) = delete;
  ~Allocations() {
    for (const auto& handle : handles_) {
      try {
        bridge_.release(handle);  // deferred: a copy may still use it
      } catch (...) {               // a closed bridge has freed it already
      }
    }
  }
  void add(DeviceHandle handle) { handles_.push_back(handle); }
  void keep() noexcept { handles_.clear(); }

 private:
  Bridge& bridge_;
  std::vector<DeviceHandle> handles_;
};

std::uint64_t recorded_generation(const ckpt::Header& header) {
  const std::string* text = header.find_metadata("generation");
  std::uint64_t generation = 0;
  if (text == nullptr || std::from_chars(text->data(), text->data() + text->size(), generation).ec != std::errc{})
    return 0;
  return generation;
}

// What a restore takes (devbridge_restore_options; Python's restore names=,
// prefix=, verify=): the tensors by the library's one selection rule.
struct Selection {
  ckpt::TensorSelection tensors;
  bool verify = true;
};

Selection selection_from_c(const devbridge_restore_options& given) {
  const auto& options = sized(&given, "options");
  require_reserved_zero(options.reserved, "options->reserved");
  Selection selection;
  const auto names = array_argument(options.names, options.name_count, "options->names");
  if (!names.empty()) {  // none: no name filter
    auto& chosen = selection.tensors.names.emplace();
    for (std::size_t i = 0; i < names.size(); ++i)
      chosen.emplace_back(text(names[i], "options->names[" + std::to_string(i) + "]"));
  }
  if (options.prefix) selection.tensors.prefix = text(options.prefix, "options->prefix");
  selection.verify = options.skip_checksum == 0;
  return selection;
}

}  // namespace

extern "C" {

devbridge_status devbridge_checkpoint(devbridge_bridge* bridge, const char* path,
                                      const devbridge_checkpoint_entry* entries, uint64_t count,
                                      uint64_t generation) {
  return guarded([&] {
    auto& source = bridge_of(bridge);
    const std::string file(text(path, "path"));
    if (file.empty()) invalid_argument("path is empty");
    const auto tensors = planned_tensors(source, array_argument(entries, count, "entries"), file);
    const auto recorded = generation != 0 ? generation : source.generation();

    // Written through a link, never over a FIFO or device (the data goes at offsets).
    ReplacingFile temporary(file, ReplacingFile::NotRegular::Refuse);
    const auto placeholder = encoded_header(tensors, recorded, kChecksumPlaceholder);
    temporary.write_at(0, std::as_bytes(std::span(placeholder)));
    std::uint64_t at = placeholder.size();
    ckpt::Crc32 crc;
    TransferPlanner planner(source);
    for (const auto& tensor : tensors) {
      for_tensor("checkpoint", ckpt::quoted(file), tensor.name, [&] {
        planner.run(DeviceSpan{tensor.handle, 0, tensor.bytes},
                    StreamDestination{tensor.bytes, [&](std::uint64_t, std::span<const std::byte> chunk) {
                                        temporary.write_at(at, chunk);
                                        crc.update(chunk.data(), chunk.size());
                                        at += chunk.size();
                                      }});
      });
    }
    // Same length as the placeholder: the data section stays where it is.
    const auto final_header = encoded_header(tensors, recorded, crc.text());
    temporary.write_at(0, std::as_bytes(std::span(final_header)));
    temporary.commit(ReplacingFile::Durability::Synced);
  });
}

devbridge_status devbridge_restore(devbridge_bridge* bridge, const char* path, devbridge_restored** out_restored) {
  return devbridge_restore_selected(bridge, path, nullptr, out_restored);
}

devbridge_status devbridge_restore_selected(devbridge_bridge* bridge, const char* path,
                                            const devbridge_restore_options* options,
                                            devbridge_restored** out_restored) {
  return guarded([&] {
    auto& out = required(out_restored, "out_restored");
    auto& target = bridge_of(bridge);
    const std::string file(text(path, "path"));
    const Selection selection = options ? selection_from_c(*options) : Selection{};
    const std::string where = "restore " + ckpt::quoted(file);
    std::optional<ckpt::CheckpointFile> opened;
    try {
      opened.emplace(ckpt::CheckpointFile::open(file));
    } catch (const ckpt::CheckpointError& error) {
      throw from_checkpoint_error("restore", error);
    }
    const auto& header = opened->header();
    std::vector<const ckpt::TensorEntry*> chosen;
    try {
      chosen = ckpt::select_tensors(header.tensors, selection.tensors, ckpt::quoted(file));
    } catch (const ckpt::CheckpointError& error) {
      throw from_checkpoint_error("restore", error);
    }
    for (const auto* entry : chosen)
      if (entry->name.find('\0') != std::string::npos)
        invalid_argument(where + ": tensor " + ckpt::quoted(entry->name) +
                         " has a NUL character in its name, which the C string it would come back as cannot carry "
                         "(other tensors' names would read the same); select the others (options->names) or restore "
                         "it from Python");
    // A selection of none restores none, as Python's restore gives {}: nothing read, nothing to check.
    const bool partial = chosen.size() != header.tensors.size();
    const bool check = header.devbridge && selection.verify && !chosen.empty();
    if (check && partial)
      invalid_argument(where + ": the file records a checksum of its whole data section, which a restore of " +
                       std::to_string(chosen.size()) + " of its " + std::to_string(header.tensors.size()) +
                       " tensors cannot check; set options->skip_checksum");
    if (check && header.checksum.rfind("crc32:", 0) != 0)
      throw Error(ErrorKind::Unsupported, where + ": its checksum is " + header.checksum +
                                              "; the C ABI checks crc32 only (Python's restore reads sha256; "
                                              "options->skip_checksum restores without checking)");

    std::vector<ckpt::RestoreTarget> targets;
    targets.reserve(chosen.size());
    for (const auto* entry : chosen) {
      ckpt::RestoreTarget t;
      t.name = entry->name;
      t.begin = entry->begin;
      t.end = entry->end;
      t.spec.alignment = kRestoreAlignment;
      t.spec.dtype = entry->dtype;
      t.spec.shape = ShapeKind::Tensor;
      for_tensor("restore", ckpt::quoted(file), entry->name, [&] {
        const auto rounded = checked::add_or_throw(entry->nbytes(), kRestoreAlignment - 1, ErrorKind::InvalidExtent,
                                                   "the tensor's bytes rounded up to the alignment");
        t.spec.max_extent = rounded - rounded % kRestoreAlignment;
      });
      t.extent = t.spec.max_extent;
      targets.push_back(std::move(t));
    }
    ckpt::RestoreOptions reading;
    if (check) reading.expected_crc32 = header.checksum;
    // The stream reads (and owns) the descriptor the header was read through.
    const auto stream = ckpt::RestoreStream::start(target, opened->release(), header.data_start(), std::move(targets),
                                                   std::move(reading), ckpt::quoted(file));
    Allocations allocations(target);
    for (const auto& handle : stream->handles()) allocations.add(handle);
    try {
      stream->finished(std::chrono::nanoseconds::max());
      for (std::size_t i = 0; i < chosen.size(); ++i)
        for (const PendingCopy& copy : stream->copies(i)) {
          const CopyStatus status = target.wait(copy.event);
          if (status.state == CopyState::Failed)
            throw Error(status.error.value_or(ErrorKind::DeviceCopyFailed),
                        where + ": tensor " + ckpt::quoted(chosen[i]->name) + ": " + status.message);
        }
    } catch (const ckpt::CheckpointError& error) {  // it names the file and the tensors already
      throw Error(error.os_error() != 0 ? ErrorKind::Unavailable : ErrorKind::InvalidRange, error.what());
    }
    auto result = std::make_unique<Restored>();
    for (std::size_t i = 0; i < chosen.size(); ++i) {
      const auto* entry = chosen[i];
      result->names.push_back(entry->name);
      result->dims.emplace_back(entry->shape.begin(), entry->shape.end());
      devbridge_restored_tensor row{};
      row.handle = to_c(stream->handles()[i]);
      row.dtype = static_cast<devbridge_dtype>(*entry->dtype);  // chosen, so restorable: its dtype is held
      row.rank = static_cast<std::uint32_t>(entry->shape.size());
      result->rows.push_back(row);
    }
    for (std::size_t i = 0; i < result->rows.size(); ++i) {
      result->rows[i].name = result->names[i].c_str();
      result->rows[i].dims = result->dims[i].empty() ? nullptr : result->dims[i].data();
    }
    result->count = result->rows.size();
    result->tensors = result->rows.empty() ? nullptr : result->rows.data();
    result->generation = header.devbridge ? recorded_generation(header) : 0;
    allocations.keep();
    out = result.release();
  });
}

void devbridge_restored_free(devbridge_restored* restored) { delete static_cast<Restored*>(restored); }

}  // extern "C"
