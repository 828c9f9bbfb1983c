// `devbridge trace replay TRACE`: a trace's allocations and frees run again
// against the caching pool's policies, on the fake backend, saying what each
// would have held.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace devbridge::cli {

// The host ring of the replay's bridge; --device-memory is at least this
// (the fake refuses a host block larger than its memory).
inline constexpr std::uint64_t kReplayRingBytes = 64 * 1024;

// One policy's replay.
struct ReplayResult {
  std::string policy;
  std::uint64_t peak_reserved = 0, peak_allocated = 0;
  std::uint64_t backend_allocations = 0, cache_hits = 0;
  std::uint64_t out_of_memory = 0;  // allocations the device could not hold
  std::string first_out_of_memory;  // the first of them: its event and size
};

struct ReplayReport {
  std::string path;
  std::uint64_t allocations = 0, frees = 0;
  std::uint64_t device_memory = 0;
  std::vector<std::string> skipped;  // events replay could not apply, each naming its index
  std::vector<ReplayResult> results;
};

// The trace's "allocate" and "free" instants in order, against each policy
// on a fake device of `device_memory` bytes: no caching pool, the pool with
// the backend's default cap, capped at 0, then capped at each of `pool_caps`.
// Deterministic: the same trace gives the same report.
ReplayReport replay_trace(const nlohmann::json& trace, const std::string& path, std::uint64_t device_memory,
                          const std::vector<std::uint64_t>& pool_caps = {});

std::string format_replay(const ReplayReport& report);
nlohmann::json replay_report_json(const ReplayReport& report);

}  // namespace devbridge::cli
