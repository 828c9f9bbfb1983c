// `devbridge stream`'s plan: the command line checked against itself and
// against this build's backends (plan_stream, stream.hpp), before anything
// runs. The pipeline that runs it is stream.cpp.
#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "devbridge/backends.hpp"
#include "devbridge/backends/fake.hpp"
#include "devbridge/error.hpp"
#include "output_file.hpp"
#include "sizes.hpp"
#include "stream.hpp"

namespace devbridge::cli {
namespace {

std::uint64_t round_up(std::uint64_t value, std::uint64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// ---- validation of the test hooks -------------------------------------------

constexpr int kFakeCallCount = fake::kCallCount;
constexpr int kFakeFailureCount = static_cast<int>(fake::Failure::Fatal) + 1;

// The names of the fake's first `count` calls or failures, comma-separated.
template <class Enum, class Name>
std::string joined_names(int count, Name name) {
  std::string names;
  for (int i = 0; i < count; ++i) {
    if (i != 0) names += ", ";
    names += name(static_cast<Enum>(i));
  }
  return names;
}

std::string fake_call_names() { return joined_names<fake::Call>(kFakeCallCount, fake::call_name); }

std::string fake_failure_names() { return joined_names<fake::Failure>(kFakeFailureCount, fake::failure_name); }

// The calls on which `failure` can fire, as the fake backend defines it.
std::string calls_for(fake::Failure failure) {
  std::string names;
  for (int i = 0; i < kFakeCallCount; ++i) {
    const auto call = static_cast<fake::Call>(i);
    if (!fake::applies(call, failure)) continue;
    if (!names.empty()) names += ", ";
    names += fake::call_name(call);
  }
  return names;
}

StreamPlan::Injection parse_injection(std::string_view text) {
  const auto first = text.find(':');
  if (first == std::string_view::npos) {
    throw UsageError(fmt::format("--fake-inject: '{}' is not CALL:FAILURE[:N]", text));
  }
  const std::string_view call_text = text.substr(0, first);
  std::string_view rest = text.substr(first + 1);
  std::optional<std::string_view> nth_text;
  if (const auto second = rest.find(':'); second != std::string_view::npos) {
    nth_text = rest.substr(second + 1);
    rest = rest.substr(0, second);
  }
  StreamPlan::Injection injection;
  injection.call = -1;
  injection.failure = -1;
  for (int i = 0; i < kFakeCallCount; ++i) {
    if (fake::call_name(static_cast<fake::Call>(i)) == call_text) injection.call = i;
  }
  if (injection.call < 0) {
    throw UsageError(fmt::format("--fake-inject: '{}': unknown call '{}' (one of: {})", text, call_text,
                                 fake_call_names()));
  }
  for (int i = 0; i < kFakeFailureCount; ++i) {
    if (fake::failure_name(static_cast<fake::Failure>(i)) == rest) injection.failure = i;
  }
  if (injection.failure < 0) {
    throw UsageError(fmt::format("--fake-inject: '{}': unknown failure '{}' (one of: {})", text, rest,
                                 fake_failure_names()));
  }
  // A failure that cannot fire on that call would be refused by the backend
  // once the run had started; it is a command line that cannot work.
  const auto call = static_cast<fake::Call>(injection.call);
  const auto failure = static_cast<fake::Failure>(injection.failure);
  if (!fake::applies(call, failure)) {
    const std::string calls = calls_for(failure);
    throw UsageError(fmt::format("--fake-inject: '{}': failure {} cannot apply to call {} ({})", text,
                                 fake::failure_name(failure), fake::call_name(call),
                                 calls.empty() ? std::string("it applies to no call")
                                               : fmt::format("{} applies to: {}", fake::failure_name(failure), calls)));
  }
  if (nth_text) {
    constexpr std::uint64_t kMaxNth = 1'000'000'000;
    std::uint64_t nth = 0;
    try {
      nth = parse_count("--fake-inject N", *nth_text);
    } catch (const UsageError&) {
      throw UsageError(fmt::format("--fake-inject: '{}': N '{}' is not a whole number between 1 and {}", text,
                                   *nth_text, kMaxNth));
    }
    if (nth == 0 || nth > kMaxNth) {
      throw UsageError(fmt::format("--fake-inject: '{}': N must be between 1 and {}", text, kMaxNth));
    }
    injection.nth = static_cast<int>(nth);
  }
  return injection;
}

}  // namespace

StreamPlan plan_stream(const StreamArgs& args) {
  StreamPlan plan;

  // The backend: a name this build knows, available on this machine.
  const std::vector<BackendAvailability> backends = list_backends();
  std::string known = "auto";
  for (const BackendAvailability& b : backends) {
    if (b.built) known += ", " + b.name;
  }
  if (args.backend != "auto") {
    const auto it = std::find_if(backends.begin(), backends.end(),
                                 [&](const BackendAvailability& b) { return b.name == args.backend; });
    if (it == backends.end()) {
      throw UsageError(fmt::format("--backend: unknown backend '{}' (this build has: {})", args.backend, known));
    }
    if (!it->available && !(it->built && args.device))  // an explicit device is the backend's to refuse
      throw UsageError(fmt::format("--backend: {} is {}", it->name, describe_availability(*it)));
  }
  plan.backend = args.backend;
  for (const std::string& option : args.backend_options) {
    const auto equals = option.find('=');
    if (equals == std::string::npos || equals == 0)
      throw UsageError(fmt::format("--backend-option: '{}' is not KEY=VALUE", option));
    const auto key = option.substr(0, equals);
    if (key == "device") throw UsageError("--backend-option: give the device with --device");
    // A CUcontext is an address in the process that made it: a command line has none to give, and any
    // number would be read as a pointer.
    if (key == "context")
      throw UsageError("--backend-option: context is a CUcontext of the calling process, which a command line "
                       "cannot give (the worker makes its own; pick the device with --device)");
    if (!plan.backend_options.emplace(key, option.substr(equals + 1)).second)
      throw UsageError(fmt::format("--backend-option: {} given twice", key));
  }
  if (args.device) {
    if (args.device->empty()) throw UsageError("--device: empty (see devbridge info for the devices)");
    plan.backend_options["device"] = *args.device;
  }
  // A device that is not there, or an option the backend does not take, is
  // a usage error found before anything runs: open it to ask, once (the
  // stream runs on this instance). "auto" is opened the way the stream
  // opens it (make_backend picks the backend and hands it the options), so
  // what it picks is checked the same way.
  if (!plan.backend_options.empty()) {
    try {
      plan.opened_backend = make_backend(plan.backend, plan.backend_options);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::Unsupported || e.kind() == ErrorKind::Unavailable)
        throw UsageError(fmt::format("--device/--backend-option: {}", e.message()));
      throw;
    }
  }

  plan.bytes = parse_size("--bytes", args.bytes);
  const std::uint64_t chunk = parse_size("--chunk", args.chunk);
  plan.inflight = parse_count("--inflight", args.inflight);
  plan.ring_bytes = parse_size("--ring-bytes", args.ring_bytes);

  if (plan.bytes == 0) throw UsageError(fmt::format("--bytes: '{}': must be more than 0", args.bytes));
  if (plan.bytes % sizeof(float) != 0) {
    throw UsageError(fmt::format("--bytes: '{}' ({} bytes) is not a multiple of 4 (the stream moves float32 elements)",
                                 args.bytes, plan.bytes));
  }
  if (chunk == 0) throw UsageError(fmt::format("--chunk: '{}': must be more than 0", args.chunk));
  if (chunk % sizeof(float) != 0) {
    throw UsageError(fmt::format("--chunk: '{}' ({} bytes) is not a multiple of 4 (the stream moves float32 elements)",
                                 args.chunk, chunk));
  }
  if (plan.inflight == 0) throw UsageError(fmt::format("--inflight: '{}': must be at least 1", args.inflight));
  if (plan.ring_bytes == 0) throw UsageError(fmt::format("--ring-bytes: '{}': must be more than 0", args.ring_bytes));

  // A chunk larger than the whole stream is just the whole stream.
  plan.chunk_bytes = std::min(chunk, plan.bytes);
  // Far beyond any memory, and small enough that the ring arithmetic below
  // (twice the chunk, rounded up) cannot overflow.
  constexpr std::uint64_t kMaxChunk = 1ull << 60;
  if (plan.chunk_bytes > kMaxChunk) {
    throw UsageError(fmt::format("--chunk: '{}' ({} bytes) is too large (at most {} bytes)", args.chunk,
                                 plan.chunk_bytes, kMaxChunk));
  }
  // Not (bytes + chunk - 1) / chunk: that sum wraps for --bytes near 2^64.
  plan.chunks = plan.bytes / plan.chunk_bytes + (plan.bytes % plan.chunk_bytes != 0 ? 1 : 0);
  plan.slot_bytes = round_up(plan.chunk_bytes, kReservationAlignment);

  // Every chunk holds an input and an output reservation at once, each
  // aligned to 64 bytes. Reservations of one size laid end to end from the
  // ring's start always fit twice into twice their size, so that is enough.
  const std::uint64_t needed = 2 * plan.slot_bytes;
  if (plan.ring_bytes < needed) {
    const std::string rounded = plan.slot_bytes == plan.chunk_bytes
                                    ? std::string()
                                    : fmt::format(", each rounded up to {} bytes for 64-byte alignment", plan.slot_bytes);
    throw UsageError(fmt::format(
        "--ring-bytes: '{}' ({} bytes) cannot hold a chunk: each chunk holds an input and an output reservation of "
        "{} bytes at once{}, so the ring needs at least {} bytes ({})",
        args.ring_bytes, plan.ring_bytes, plan.chunk_bytes, rounded, needed, format_bytes(needed)));
  }

  // More chunks than the ring has room for can never be in flight (each
  // chunk's upload holds a ring range until its copy ends), so more device
  // buffers than that would only cost device memory.
  plan.slots = std::min({plan.inflight, plan.chunks, plan.ring_bytes / plan.slot_bytes});

  const double stall = [&] {
    const std::uint64_t seconds = parse_count("--stall-timeout", args.stall_timeout);
    if (seconds == 0 || seconds > 86'400) {
      throw UsageError(
          fmt::format("--stall-timeout: '{}': must be between 1 and 86400 seconds", args.stall_timeout));
    }
    return static_cast<double>(seconds);
  }();
  plan.stall_timeout_seconds = stall;

  if (args.fake_inject) {
    if (plan.backend != "fake") {
      throw UsageError(fmt::format("--fake-inject: '{}': only with --backend fake", *args.fake_inject));
    }
    plan.fake_injection = parse_injection(*args.fake_inject);
  }
  if (args.corrupt_element) {
    const std::uint64_t element = parse_count("--corrupt-element", *args.corrupt_element);
    if (element >= plan.bytes / sizeof(float)) {
      throw UsageError(fmt::format("--corrupt-element: '{}' is past the last element ({})", *args.corrupt_element,
                                   plan.bytes / sizeof(float) - 1));
    }
    plan.corrupt_element = element;
  }
  if (args.trace) {
    if (args.trace->empty()) throw UsageError("--trace: give the file to write the trace to");
    check_output_file("--trace", *args.trace);
    plan.trace_path = *args.trace;
  }
  return plan;
}

}  // namespace devbridge::cli
