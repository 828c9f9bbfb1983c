// `devbridge info`: the backends this build has, which can run here (and why
// not), and what each available one describes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "devbridge/backend.hpp"
#include "devbridge/backends.hpp"

namespace devbridge::cli {

// How a bridge over the backend manages device memory by default
// (BridgeOptions::caching_pool; Backend::part_alignment): per-bridge figures
// are in the stream report's memory object.
struct MemoryPolicy {
  bool caching_pool = false;    // on unless the bridge's options say otherwise
  std::uint64_t part_alignment = 0;  // the pool splits segments into parts aligned so; 0: whole blocks
};

struct BackendEntry {
  BackendAvailability availability;
  std::optional<MemoryPolicy> memory;
  std::optional<BackendInfo> info;  // the device the backend binds by default, when available and described
  std::vector<BackendInfo> devices;  // every device it can bind (list_devices)
  std::string describe_error;       // when available but describing it failed
};

struct InfoReport {
  std::vector<BackendEntry> backends;
  std::string auto_choice;  // what --backend auto picks here; empty when none
  std::string auto_error;   // why auto picks nothing
};

// Never throws for a backend that fails to open: that lands in its entry.
InfoReport collect_info();

std::string format_info(const InfoReport& report);

}  // namespace devbridge::cli
