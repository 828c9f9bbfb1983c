// Reading a flight recorder trace (docs/TRACING.md, "Trace format") for
// `devbridge trace view` (trace_view.hpp) and `devbridge trace replay`
// (trace_replay.hpp): the one check that a file is a trace this build reads.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

namespace devbridge::cli {

// A file that is not a devbridge trace this build reads; the message names
// the file and what is wrong with it.
class TraceFileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The largest trace file read: a recorder's ring holds at most 2^24 events,
// about 250 bytes each without stacks, so about 4 GiB of JSON; the parsed
// tree takes several times the file's size in memory.
inline constexpr std::uint64_t kMaxTraceFileBytes = std::uint64_t{4} << 30;

// Reads and checks `path`: a regular file (opened without blocking, so a
// FIFO or device is refused at once, never waited on) of at most
// kMaxTraceFileBytes, JSON,
// "otherData.format" "devbridge-trace", a version this build reads,
// "traceEvents" an array.
nlohmann::json load_trace(const std::string& path);

}  // namespace devbridge::cli
