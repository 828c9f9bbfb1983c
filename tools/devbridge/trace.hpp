// Reading a flight recorder trace (docs/TRACING.md, "Trace format") for
// `devbridge trace view` (trace_view.hpp) and `devbridge trace replay`
// (trace_replay.hpp): the one check that a file is a trace this build reads.
#pragma once

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

// Reads and checks `path`: a regular file (opened without blocking, so a
// FIFO or device is refused at once, never waited on), JSON,
// "otherData.format" "devbridge-trace", a version this build reads,
// "traceEvents" an array.
nlohmann::json load_trace(const std::string& path);

}  // namespace devbridge::cli
