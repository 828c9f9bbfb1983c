// The one selection of a restore's tensors (checkpoint_file.hpp), for
// Python's restore and the C ABI's devbridge_restore_selected.
#include <algorithm>
#include <set>
#include <unordered_set>

#include <fmt/format.h>

#include "devbridge/checkpoint_file.hpp"

namespace devbridge::checkpoint {

std::vector<const TensorEntry*> select_tensors(std::span<const TensorEntry> tensors, const TensorSelection& selection,
                                               std::string_view where) {
  std::unordered_set<std::string_view> asked;
  if (selection.names) asked.insert(selection.names->begin(), selection.names->end());
  if (!asked.empty() || !selection.required.empty()) {
    std::unordered_set<std::string_view> present;
    for (const TensorEntry& entry : tensors) present.insert(entry.name);
    std::set<std::string_view> missing;  // by name (bytes: UTF-8's code point order), each once
    for (std::string_view name : asked)
      if (!present.contains(name)) missing.insert(name);
    for (std::string_view name : selection.required)
      if (!present.contains(name)) missing.insert(name);
    if (!missing.empty()) {
      std::string listed;
      std::size_t count = 0;
      for (std::string_view name : missing) {
        if (count++ == 5) break;
        listed += (listed.empty() ? "" : ", ") + quoted(name);
      }
      throw CheckpointError(fmt::format("{} holds no tensor named {}{}; nothing was restored", where, listed,
                                        missing.size() > 5 ? " and more" : ""));
    }
  }
  std::vector<const TensorEntry*> chosen;
  for (const TensorEntry& entry : tensors) {
    if (selection.names && !asked.contains(entry.name)) continue;
    if (!entry.name.starts_with(selection.prefix)) continue;
    if (selection.wants && !selection.wants(entry.name)) continue;
    chosen.push_back(&entry);
  }
  for (const TensorEntry* entry : chosen) {
    if (!entry->unrestorable.empty()) {
      throw CheckpointError(entry->unrestorable + "; select the others by name or prefix; nothing was restored");
    }
  }
  return chosen;
}

}  // namespace devbridge::checkpoint
