// `devbridge stream`: the streaming worker, on the transfer planner
// (devbridge/transfer.hpp) so that it measures and checks the path every
// other transfer takes. Each chunk is uploaded by the planner's submit() from
// a source that writes a known pattern into the ring, into one of `inflight`
// device buffers; the backend runs y = 2x + 1 over it inside a compute step;
// the planner brings the result back into a sink that checks every element.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "devbridge/backend.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::cli {

class Progress;

// What the user typed, before validation.
struct StreamArgs {
  std::string backend = "auto";
  std::string bytes = "1GiB";
  std::string chunk = "4MiB";
  std::string inflight = "8";
  std::string ring_bytes = "64MiB";
  std::string stall_timeout = "60";  // seconds without a completion before giving up
  std::optional<std::string> device;         // a device_id from devbridge info; the backend's default when absent
  std::vector<std::string> backend_options;  // KEY=VALUE, the backend's own options
  // Test hooks; nullopt when not given (an empty text was given, and is refused).
  std::optional<std::string> fake_inject;      // "CALL:FAILURE[:N]", fake backend only
  std::optional<std::string> corrupt_element;  // a global element index to damage after download
  std::optional<std::string> trace;  // --trace FILE: record with the flight recorder, dump the trace there
};

// A validated plan; every field has been checked against the others.
struct StreamPlan {
  std::string backend;  // as asked: "host", "fake", "cuda", "auto"
  BackendOptions backend_options;  // --device and --backend-option, for make_backend
  std::uint64_t bytes = 0;
  std::uint64_t chunk_bytes = 0;    // at most `bytes`
  std::uint64_t slot_bytes = 0;     // chunk_bytes rounded up to the ring alignment
  std::uint64_t chunks = 0;
  std::uint64_t inflight = 0;       // as asked
  std::uint64_t slots = 0;          // device buffer pairs: min(inflight, chunks, ring_bytes / slot_bytes)
  std::uint64_t ring_bytes = 0;
  double stall_timeout_seconds = 60.0;
  // Fault injection on the fake backend (values of fake::Call / fake::Failure).
  struct Injection {
    int call = 0;
    int failure = 0;
    int nth = 1;
  };
  std::optional<Injection> fake_injection;
  std::optional<std::uint64_t> corrupt_element;
  std::optional<std::string> trace_path;  // the flight recorder's trace goes here at the end, failed or not
  // The backend plan_stream opened to check --device/--backend-option, for
  // run_stream to run on (so the device is opened once); null when there was
  // nothing to check, and run_stream opens it.
  std::unique_ptr<Backend> opened_backend;
};

// The ring alignment of every reservation the stream makes.
inline constexpr std::uint64_t kReservationAlignment = 64;

// Checks the arguments against each other and against this build's backends.
// Throws UsageError with a one-line reason.
StreamPlan plan_stream(const StreamArgs& args);

struct StreamReport {
  std::string backend;        // the backend that ran ("host" when "auto" chose it)
  std::string device_id;
  std::string device_name;
  std::string device_string;
  std::uint64_t bytes = 0;
  std::uint64_t chunk_bytes = 0;
  std::uint64_t chunks = 0;
  std::uint64_t chunks_verified = 0;
  std::uint64_t inflight = 0;        // as asked
  // Input/output pairs: the chunks in flight at once, as the ring allows.
  // Their uploads overlap; downloads go one chunk at a time.
  std::uint64_t device_buffers = 0;
  std::uint64_t ring_bytes = 0;
  // Times a reservation went on at the ring's offset 0 while the ring held
  // others (a new lap). A ring that drained completely starts over at offset
  // 0 without wrapping; that is not counted.
  std::uint64_t ring_wraps = 0;
  double seconds = 0.0;          // first fill to last verified chunk
  double upload_busy_seconds = 0.0;
  double download_busy_seconds = 0.0;
  double upload_gbps = 0.0;
  double download_gbps = 0.0;
  double end_to_end_gbps = 0.0;
  std::uint64_t copies_submitted = 0;
  std::uint64_t copies_failed = 0;
  std::uint64_t stale_completions = 0;
  MemoryStats memory;  // the bridge's device memory at the end (peak, pool)
  std::uint64_t bytes_verified = 0;  // bytes of the chunks verified
  bool verified = false;
  // Stopped by a signal: no chunk was submitted after it arrived, and every
  // chunk already submitted was drained and checked.
  bool interrupted = false;
  int signal = 0;  // the signal that stopped it, when interrupted
  std::vector<std::string> errors;
  std::string trace_file;  // where the trace was written (--trace), empty when none was
};

// The flight recorder's ring for --trace: a stream records about eight events
// a chunk, so this holds the whole of a 128 GiB stream in 4 MiB chunks.
inline constexpr std::size_t kStreamTraceEvents = 1u << 18;

// Runs the plan, on the plan's opened backend when it has one (it takes it).
// Runtime failures (devbridge::Error, a wrong element, a lost
// completion) do not throw: they end the stream and land in report.errors.
// The bridge is closed before it returns, however the stream ended, and a
// close that fails (the device lost while quiescing) is such a failure too;
// the trace (--trace) is dumped after the close.
// When `stop` is given and becomes non-zero (a signal number, set by a
// signal handler), the stream submits no further chunk, drains and verifies
// what is in flight, and returns a report with `interrupted` set.
StreamReport run_stream(StreamPlan& plan, Progress& progress, const std::atomic<int>* stop = nullptr);

}  // namespace devbridge::cli
