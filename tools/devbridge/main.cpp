// devbridge: the command-line worker. `stream` moves data through the bridge
// and checks every element; `info` says which backends can run here;
// `checkpoint inspect` lists a checkpoint file and verifies its checksum.
//
// Exit codes: 0 success (stream: every element verified), 1 a runtime or
// verification failure (a report that could not be written, to a file or to
// stdout, among them), 2 a command line that cannot work, 128 + N a command
// that signal N (SIGINT, SIGTERM) stopped: a stream after draining what was
// in flight, any other command at once. Each failure is one line on stderr.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <system_error>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "devbridge/backends.hpp"
#include "devbridge/checkpoint_file.hpp"
#include "checkpoint.hpp"
#include "memory_reserve.hpp"
#include "stderr_print.hpp"
#include "devbridge/error.hpp"
#include "devbridge/replacing_file.hpp"
#include "info.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "output_file.hpp"
#include "sizes.hpp"
#include "stream.hpp"
#include "trace.hpp"
#include "trace_replay.hpp"
#include "trace_view.hpp"

#ifndef DEVBRIDGE_VERSION
#define DEVBRIDGE_VERSION "unknown"
#endif

namespace {

using devbridge::cli::print_stderr;
using devbridge::cli::UsageError;
using devbridge::Error;
using devbridge::ReplacingFile;

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// An option that takes one value given more than once: CLI11 says "--bytes:
// At Most 1 required but received 2", naming neither value. The values as
// typed, from the command line (`--bytes 4KiB`, `--bytes=4KiB`).
std::optional<std::string> repeated_option(const CLI::ParseError& error, int argc, const char* const* argv) {
  const std::string_view what = error.what();
  const auto colon = what.find(": At Most 1 required but received");
  if (colon == std::string_view::npos || !what.starts_with("--")) return std::nullopt;
  const std::string_view name = what.substr(0, colon);
  std::vector<std::string> values;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == name && i + 1 < argc)
      values.push_back(fmt::format("'{}'", argv[++i]));
    else if (arg.starts_with(name) && arg.size() > name.size() && arg[name.size()] == '=')
      values.push_back(fmt::format("'{}'", arg.substr(name.size() + 1)));
  }
  if (values.size() < 2) return std::nullopt;
  return fmt::format("{} given {} times ({}): give it once", name, values.size(), fmt::join(values, ", "));
}

// Arguments a command does not take: CLI11 lists them last first ("The
// following arguments were not expected: 16KiB --ring"). The first of them as
// typed: an unknown option, or an argument the command does not take.
std::optional<std::string> unexpected_argument(const CLI::ParseError& error, int argc, const char* const* argv) {
  std::string_view what = error.what();
  bool listed = false;
  for (const std::string_view prefix :
       {"The following arguments were not expected: ", "The following argument was not expected: "}) {
    if (what.starts_with(prefix)) {
      what.remove_prefix(prefix.size());
      listed = true;
    }
  }
  if (!listed) return std::nullopt;
  std::vector<std::string_view> extras;
  for (std::string_view rest = what; !rest.empty();) {
    const auto space = rest.find(' ');
    extras.push_back(rest.substr(0, space));
    rest = space == std::string_view::npos ? std::string_view() : rest.substr(space + 1);
  }
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (std::find(extras.begin(), extras.end(), arg) == extras.end()) continue;
    return arg.starts_with('-') ? fmt::format("unknown option '{}'", arg)
                                : fmt::format("unexpected argument '{}'", arg);
  }
  return std::nullopt;
}

// Messages from CLI11 or the library may span lines; the contract is one line.
std::string one_line(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '\n') {
      if (!out.empty() && out.back() != ' ') out += "; ";
    } else {
      out += c;
    }
  }
  while (!out.empty() && (out.back() == ' ' || out.back() == ';')) out.pop_back();
  return out;
}

// ---- what stdout took ------------------------------------------------------

// errno of the first write to stdout that failed (a full disk, /dev/full, a
// closed terminal); 0 while none did. Every text a command prints on stdout
// goes through write_stdout(), so a failure is reported once, at the end.
int g_stdout_errno = 0;

void note_stdout_failure(int error) {
  if (g_stdout_errno == 0) g_stdout_errno = error != 0 ? error : EIO;
}

// Never throws: a report that did not reach stdout must not stop the command
// before its --json file is written.
void write_stdout(std::string_view text) {
  if (std::fwrite(text.data(), 1, text.size(), stdout) != text.size()) note_stdout_failure(errno);
}

bool flush_stdout() {
  if (std::fflush(stdout) != 0) note_stdout_failure(errno);
  if (std::ferror(stdout)) note_stdout_failure(EIO);
  return g_stdout_errno == 0;
}

// Whether SIGPIPE had its default action when the command started (a shell's
// pipeline) rather than being ignored (a parent that set SIG_IGN).
bool g_sigpipe_ends_us = false;

// SIGPIPE and SIGXFSZ would end the process in the middle of a write, with
// an output's temporary file left behind and the --json report not written:
// both are ignored, so the write fails with EPIPE or EFBIG and is reported
// like any failed write, and a reader that went away still ends the command
// with SIGPIPE, at the end (finish_stdout), as for any other program.
void turn_write_signals_into_errors() {
  struct sigaction previous {};
  g_sigpipe_ends_us = ::sigaction(SIGPIPE, nullptr, &previous) == 0 && previous.sa_handler == SIG_DFL;
  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGXFSZ, SIG_IGN);
}

// The last word of every command: what it printed must have reached stdout,
// or the exit code says it did not (1, unless it already says a failure or a
// signal).
int finish_stdout(int exit_code) {
  if (flush_stdout()) return exit_code;
  if (g_stdout_errno == EPIPE && g_sigpipe_ends_us) {
    std::signal(SIGPIPE, SIG_DFL);
    std::raise(SIGPIPE);
  }
  print_stderr("devbridge: could not write the report to standard output: {}\n", std::strerror(g_stdout_errno));
  return exit_code == kExitOk ? kExitFailure : exit_code;
}

// ---- stop signals -------------------------------------------------------------

// The output file's temporary (a --json report's, a trace view page's), for
// the signal handler, which removes it when the signal ends the process
// (unlink is async-signal-safe; no destructor runs there). Published by
// `g_temp_path_set` after it is written.
char g_temp_path[4096];
std::atomic<bool> g_temp_path_set{false};

void publish_temporary(const ReplacingFile& file) {
  const std::string& temporary = file.temporary();
  if (temporary.empty() || temporary.size() >= sizeof g_temp_path) return;
  std::memcpy(g_temp_path, temporary.c_str(), temporary.size() + 1);
  g_temp_path_set.store(true, std::memory_order_release);
}

void withdraw_temporary() { g_temp_path_set.store(false, std::memory_order_release); }

// SIGINT and SIGTERM held back while it lives: a signal that landed between
// the temporary's creation and its publication would leave it behind.
class StopSignalsHeld {
 public:
  StopSignalsHeld() {
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    ::pthread_sigmask(SIG_BLOCK, &stop, &previous_);
  }
  ~StopSignalsHeld() { ::pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }
  StopSignalsHeld(const StopSignalsHeld&) = delete;
  StopSignalsHeld& operator=(const StopSignalsHeld&) = delete;

 private:
  sigset_t previous_{};
};

// A file written through ReplacingFile whose temporary the stop-signal
// handler removes for as long as it lives. A path that exists and is no
// regular file is opened in place with the signals free: there is no
// temporary to lose, and opening a FIFO waits for a reader, for as long as
// the user lets it.
class SignalSafeOutput {
 public:
  explicit SignalSafeOutput(const std::string& path) {
    struct stat st {};
    std::optional<StopSignalsHeld> held;
    if (::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) held.emplace();
    file_.emplace(path, ReplacingFile::NotRegular::WriteInPlace);
    publish_temporary(*file_);
  }
  ~SignalSafeOutput() {
    const StopSignalsHeld held;
    withdraw_temporary();
    file_.reset();  // removes the temporary when not committed
  }
  SignalSafeOutput(const SignalSafeOutput&) = delete;
  SignalSafeOutput& operator=(const SignalSafeOutput&) = delete;

  void write(std::string_view text) { file_->write(text); }
  void commit(ReplacingFile::Durability durability) {
    file_->commit(durability);
    withdraw_temporary();
  }

 private:
  std::optional<ReplacingFile> file_;
};

// Where --json goes. Checked before anything runs, so a path that cannot be
// written is a usage error rather than a lost report:
//  - "-": stdout.
//  - a regular file, or a name that does not exist yet: the report is written
//    to a temporary file created now in the same directory (proving the
//    directory writable), then renamed over the path at the end. The path
//    therefore holds either its old contents or a whole report, never a
//    truncated one, whatever happens to the run (a crash, a kill).
//  - anything else that exists and is not a directory (/dev/stdout, a FIFO):
//    opened for writing now, written at the end.
class JsonSink {
 public:
  // `path` is nullopt when --json was not given; `command` ("stream",
  // "checkpoint inspect") prefixes a failure to write at the end, a runtime
  // error and not a usage one.
  JsonSink(const std::optional<std::string>& path, std::string_view command) : command_(command) {
    if (!path) return;
    path_ = *path;
    if (path_.empty()) throw UsageError("--json: '' is not a path (give a file name, or '-' for stdout)");
    if (path_ == "-") return;  // stdout
    devbridge::cli::refuse_option_like_path("--json", path_);
    if (!std::filesystem::path(path_).has_filename())
      throw UsageError(fmt::format("--json: cannot write '{}': it names a directory", path_));
    // The rename would replace a file its owner made read-only.
    struct stat st {};
    if (::stat(path_.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path_.c_str(), W_OK) != 0)
      throw UsageError(fmt::format("--json: cannot write '{}': {}", path_, std::strerror(errno)));
    try {
      file_.emplace(path_);
    } catch (const Error& error) {
      throw UsageError(fmt::format("--json: {}", error.message()));
    }
  }
  JsonSink(const JsonSink&) = delete;
  JsonSink& operator=(const JsonSink&) = delete;

  bool to_stdout() const { return path_ == "-"; }

  // Returns false when the report could not be written: a file's failure is
  // said here (the path then keeps what it held before), stdout's by
  // finish_stdout() at the end.
  bool write(const nlohmann::json& document) {
    if (path_.empty()) return true;
    // Paths and messages may hold bytes that are not UTF-8 (a file name): written replaced, not lost.
    const std::string text = document.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    if (to_stdout()) {
      // finish_stdout() says why, once, at the end.
      write_stdout(text);
      return flush_stdout();
    }
    try {
      file_->write(text);
      file_->commit(ReplacingFile::Durability::Synced);
      return true;
    } catch (const Error& error) {
      print_stderr("devbridge {}: --json: {}\n", command_, error.message());
      return false;
    }
  }

 private:
  std::string command_;
  std::string path_;  // as given; empty: no --json
  std::optional<SignalSafeOutput> file_;
};

// How a stop signal ends a command. `stream` drains: the handler sets
// `g_stop_signal` to the signal's number, the stream looks at it between
// chunks and writes its report; a second signal while the first is being
// handled, half a second or more after it, ends the process the default way
// (the user insists). One sooner is the same stop delivered twice: `timeout
// -s INT` signals its child and then the child's whole process group. The
// other commands have nothing to drain and end at once, exit 128 + N, as a
// stream does. Either way the output's temporary file is removed first.
enum class OnStop : std::uint8_t { Drain, EndAtOnce };

std::atomic<int> g_stop_signal{0};
std::atomic<std::int64_t> g_stop_signal_ns{0};  // CLOCK_MONOTONIC when it came
std::atomic<bool> g_end_at_once{false};
static_assert(std::atomic<int>::is_always_lock_free);
static_assert(std::atomic<std::int64_t>::is_always_lock_free);
static_assert(std::atomic<bool>::is_always_lock_free);
constexpr std::int64_t kSameStopNs = 500'000'000;

// clock_gettime is async-signal-safe (POSIX.1-2008).
std::int64_t monotonic_ns() noexcept {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
}

extern "C" void on_stop_signal(int signal) {
  int none = 0;
  const bool end_at_once = g_end_at_once.load(std::memory_order_acquire);
  if (!end_at_once) {
    if (g_stop_signal.compare_exchange_strong(none, signal)) {
      g_stop_signal_ns.store(monotonic_ns(), std::memory_order_release);
      return;
    }
    const std::int64_t first = g_stop_signal_ns.load(std::memory_order_acquire);
    if (first == 0 || monotonic_ns() - first < kSameStopNs) return;
  }
  if (g_temp_path_set.load(std::memory_order_acquire)) ::unlink(g_temp_path);
  if (end_at_once) ::_exit(128 + signal);
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

// SIGINT and SIGTERM as the process started with them ignored (`nohup`, a
// background job's SIGINT): they stay ignored. Read once, at the start: a
// driver loaded since (PoCL's OpenCL) may have put a handler of its own there.
bool g_sigint_ignored = false, g_sigterm_ignored = false;

void note_ignored_stop_signals() {
  for (auto [signal, ignored] : {std::pair{SIGINT, &g_sigint_ignored}, std::pair{SIGTERM, &g_sigterm_ignored}}) {
    struct sigaction previous {};
    *ignored = ::sigaction(signal, nullptr, &previous) == 0 && previous.sa_handler == SIG_IGN;
  }
}

void catch_stop_signals(OnStop on_stop) {
  g_end_at_once.store(on_stop == OnStop::EndAtOnce, std::memory_order_release);
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  if (!g_sigint_ignored) ::sigaction(SIGINT, &action, nullptr);
  if (!g_sigterm_ignored) ::sigaction(SIGTERM, &action, nullptr);
}

std::string stream_summary(const devbridge::cli::StreamPlan& plan, const devbridge::cli::StreamReport& r) {
  using devbridge::cli::format_bytes;
  std::string text;
  if (!r.verified && !r.interrupted) {
    // The reasons are already on stderr; rates of a broken run mean nothing.
    return fmt::format("devbridge stream: FAILED ({} of {} chunks verified)\n", r.chunks_verified, r.chunks);
  }
  if (r.interrupted) {
    text += fmt::format("devbridge stream: interrupted by {}{} ({} of {} chunks verified{})\n",
                        devbridge::cli::signal_name(r.signal), r.errors.empty() ? "" : ", and FAILED",
                        r.chunks_verified, r.chunks, r.errors.empty() ? ", every one exact" : "");
    if (!r.errors.empty()) return text;
  } else {
    text += "devbridge stream: verified\n";
  }
  std::string device = r.device_name;
  if (!r.device_string.empty()) device += fmt::format(" ({})", r.device_string);
  text += fmt::format("  backend      {}{}\n", r.backend, device.empty() ? "" : ", " + device);
  const std::string data =
      r.interrupted ? fmt::format("{} of {}", format_bytes(r.bytes_verified), format_bytes(r.bytes)) : format_bytes(r.bytes);
  text += fmt::format("  data         {} in {} chunk{} of {}, {} in flight, ring {} (wrapped {} time{})\n", data,
                      r.chunks_verified, r.chunks_verified == 1 ? "" : "s", format_bytes(r.chunk_bytes), plan.slots,
                      format_bytes(r.ring_bytes), r.ring_wraps, r.ring_wraps == 1 ? "" : "s");
  text += fmt::format("  time         {:.3f} s\n", r.seconds);
  text += fmt::format("  upload       {:.2f} GB/s  (busy {:.3f} s)\n", r.upload_gbps, r.upload_busy_seconds);
  text += fmt::format("  download     {:.2f} GB/s  (busy {:.3f} s)\n", r.download_gbps, r.download_busy_seconds);
  text += fmt::format("  end to end   {:.2f} GB/s\n", r.end_to_end_gbps);
  text += fmt::format("  memory       peak {} bytes allocated, {} backend allocations, caching pool {}\n",
                      r.memory.peak_allocated_bytes, r.memory.backend_allocations,
                      r.memory.pool_enabled
                          ? fmt::format("on ({} hits, {} misses)", r.memory.cache_hits, r.memory.cache_misses)
                          : std::string("off"));
  text += fmt::format("  verified     {} of {} chunks, {} elements exact\n", r.chunks_verified, r.chunks,
                      r.bytes_verified / sizeof(float));
  return text;
}

// The library logs through spdlog's default logger, which writes to stdout;
// stdout belongs to the summary and to `--json -`, so its log goes to stderr.
void log_to_stderr(bool quiet) {
  auto logger = spdlog::stderr_color_mt("devbridge-cli");
  logger->set_level(quiet ? spdlog::level::err : spdlog::level::warn);
  spdlog::set_default_logger(std::move(logger));
}

int run_stream_command(const devbridge::cli::StreamArgs& args, const std::optional<std::string>& json_path,
                       bool quiet) {
  // The report, written last, would replace the trace.
  if (args.trace) devbridge::cli::refuse_output_over_input("--json", json_path, "the --trace file", *args.trace);
  devbridge::cli::StreamPlan plan = devbridge::cli::plan_stream(args);
  // Opened while a signal still ends the command at once: a --json FIFO
  // waits for its reader here, and a drained stop would only be noted while
  // the open went on waiting.
  JsonSink json(json_path, "stream");
  // From here a signal ends the stream cleanly instead of the process.
  catch_stop_signals(OnStop::Drain);

  devbridge::cli::Progress progress(plan.bytes, !quiet && devbridge::cli::Progress::stderr_is_terminal());
  const devbridge::cli::StreamReport report = devbridge::cli::run_stream(plan, progress, &g_stop_signal);

  for (const std::string& error : report.errors) print_stderr("devbridge stream: {}\n", one_line(error));
  if (!report.trace_file.empty())
    print_stderr("devbridge stream: the flight recorder's trace is in {} (devbridge trace view {} -o PAGE)\n",
               report.trace_file, report.trace_file);
  if (!quiet) {
    const std::string summary = stream_summary(plan, report);
    if (json.to_stdout()) {
      std::fputs(summary.c_str(), stderr);
    } else {
      write_stdout(summary);
    }
  }
  flush_stdout();
  const bool written = json.write(devbridge::cli::stream_report_json(report));
  if (report.interrupted) return 128 + report.signal;  // as a shell reports a job a signal ended
  return report.verified && written ? kExitOk : kExitFailure;
}

int run_info_command(const std::optional<std::string>& json_path) {
  JsonSink json(json_path, "info");
  const devbridge::cli::InfoReport report = devbridge::cli::collect_info();
  if (!json.to_stdout()) write_stdout(devbridge::cli::format_info(report));
  flush_stdout();
  return json.write(devbridge::cli::info_report_json(report)) ? kExitOk : kExitFailure;
}

// Exit 0: the file is whole (its checksum verified, or it records none); 1: it
// cannot be read or restore would refuse it (the reason on stderr, one line).
int run_checkpoint_inspect_command(const std::string& path, const std::optional<std::string>& json_path) {
  devbridge::cli::refuse_output_over_input("--json", json_path, "the checkpoint being inspected", path);
  JsonSink json(json_path, "checkpoint inspect");
  try {
    const devbridge::cli::CheckpointReport report = devbridge::cli::inspect_checkpoint(path);
    if (!json.to_stdout()) write_stdout(devbridge::cli::format_checkpoint(report));
    flush_stdout();
    if (!report.ok()) print_stderr("devbridge checkpoint inspect: {}\n", one_line(report.error));
    const bool written = json.write(devbridge::cli::checkpoint_report_json(report));
    return report.ok() && written ? kExitOk : kExitFailure;
  } catch (const std::bad_alloc&) {
    // A header of millions of tensors, read or reported, past this process's memory.
    print_stderr("devbridge checkpoint inspect: {}: there is not the memory to report on it\n",
                 devbridge::checkpoint::quoted(path));
    return kExitFailure;
  }
}

// The page is written as the --json reports are (ReplacingFile): PAGE holds
// its old contents or the whole new page, never a part of it.
int run_trace_view_command(const std::string& path, const std::string& page_path) {
  devbridge::cli::check_output_file("-o", page_path);
  devbridge::cli::refuse_output_over_input("-o", page_path, "the trace being read", path);
  std::optional<SignalSafeOutput> out;
  try {
    out.emplace(page_path);
  } catch (const Error& error) {
    throw UsageError(fmt::format("-o: {}", error.message()));
  }
  const std::string page = devbridge::cli::trace_page(devbridge::cli::load_trace(path));
  try {
    out->write(page);
    out->commit(ReplacingFile::Durability::Renamed);
  } catch (const Error& error) {
    print_stderr("devbridge trace view: -o: {}\n", error.message());
    return kExitFailure;
  }
  write_stdout(fmt::format("{}: {} bytes, open it in a browser\n", page_path, page.size()));
  return kExitOk;
}

int run_trace_replay_command(const std::string& path, const std::string& device_memory,
                             const std::vector<std::string>& pool_caps, const std::optional<std::string>& json_path) {
  const std::uint64_t memory = devbridge::cli::parse_size("--device-memory", device_memory);
  // The fake refuses a host block larger than its memory, and the replay's
  // bridge has a 64 KiB ring (host memory, not counted as device memory).
  if (memory < devbridge::cli::kReplayRingBytes) {
    std::string given = devbridge::cli::format_bytes(memory);
    std::string smallest = devbridge::cli::format_bytes(devbridge::cli::kReplayRingBytes);
    // 65535 bytes rounds to the minimum's "64.00 KiB": "64.00 KiB is less than 64.00 KiB" says nothing.
    if (given == smallest) {
      given = fmt::format("{} bytes", memory);
      smallest = fmt::format("{} bytes", devbridge::cli::kReplayRingBytes);
    }
    throw UsageError(fmt::format("--device-memory: {} is less than the smallest device a replay runs on ({})", given,
                                 smallest));
  }
  std::vector<std::uint64_t> caps;
  for (const auto& cap : pool_caps) caps.push_back(devbridge::cli::parse_size("--pool-cap", cap));
  devbridge::cli::refuse_output_over_input("--json", json_path, "the trace being replayed", path);
  JsonSink json(json_path, "trace replay");
  const auto report = devbridge::cli::replay_trace(devbridge::cli::load_trace(path), path, memory, caps);
  if (!json.to_stdout()) write_stdout(devbridge::cli::format_replay(report));
  flush_stdout();
  return json.write(devbridge::cli::replay_report_json(report)) ? kExitOk : kExitFailure;
}

// "--backend" help: every backend the registry knows, and which run here.
std::string backend_help() {
  std::string names = "auto (the best available: cuda, then an OpenCL GPU, then host)";
  for (const devbridge::BackendAvailability& b : devbridge::list_backends()) {
    names += ", " + b.name;
    if (!b.built) {
      names += " (not built)";
    } else if (!b.available) {
      names += " (unavailable here)";
    }
  }
  return "Backend: " + names + "; see devbridge info";
}

// An option given with an empty value is not the option left out.
std::optional<std::string> given(const CLI::Option* option, const std::string& value) {
  if (option->count() == 0) return std::nullopt;
  return value;
}

int run_command_line(int argc, char** argv) {
  CLI::App app{"devbridge: moves tensors between a host ring and device memory, and checks it did", "devbridge"};
  app.set_version_flag("--version", std::string("devbridge ") + DEVBRIDGE_VERSION);
  app.require_subcommand(1);

  devbridge::cli::StreamArgs stream_args;
  std::string stream_json;
  std::string fake_inject;
  std::string corrupt_element;
  bool quiet = false;
  CLI::App* stream = app.add_subcommand(
      "stream", "Stream data through the bridge: upload, compute y = 2x + 1, download, verify every element");
  // The description lists the registry's backends; it is filled in only when
  // help is printed, since finding out which can run probes the drivers.
  CLI::Option* backend_option =
      stream->add_option("--backend", stream_args.backend, "Backend (see devbridge info)")->capture_default_str();
  std::string device;
  CLI::Option* device_option =
      stream->add_option("--device", device, "Which device of the backend (a device id from devbridge info)");
  stream->add_option("--backend-option", stream_args.backend_options,
                     "KEY=VALUE, the backend's own options (repeatable; devbridge info and docs/BACKENDS.md list them)")
      ->allow_extra_args(false);
  stream->add_option("--bytes", stream_args.bytes, "Total bytes to stream (4096, 512MiB, 1GiB, 1.5GiB, 2GB)")
      ->capture_default_str();
  stream->add_option("--chunk", stream_args.chunk, "Bytes per chunk (a multiple of 4)")->capture_default_str();
  stream->add_option("--inflight", stream_args.inflight, "Chunks in flight at once (device buffer pairs)")
      ->capture_default_str();
  stream->add_option("--ring-bytes", stream_args.ring_bytes, "Size of the host ring (at least 2 x chunk)")
      ->capture_default_str();
  CLI::Option* stream_json_option =
      stream->add_option("--json", stream_json, "Write a JSON report to this file ('-' for stdout)");
  stream->add_flag("-q,--quiet", quiet, "No progress bar and no summary; errors still go to stderr");
  stream->add_option("--stall-timeout", stream_args.stall_timeout,
                     "Seconds to wait for a copy to complete before giving up")
      ->capture_default_str();
  CLI::Option* fake_inject_option =
      stream
          ->add_option("--fake-inject", fake_inject,
                       "Test hook, fake backend only: inject CALL:FAILURE[:N] (e.g. copy_d2h:copy_failed_at_completion:3)")
          ->group("Test hooks");
  CLI::Option* corrupt_option =
      stream
          ->add_option("--corrupt-element", corrupt_element,
                       "Test hook: damage this global element after download, to prove the check catches it")
          ->group("Test hooks");

  std::string info_json;
  CLI::App* info = app.add_subcommand("info", "List this build's backends, which can run here, and their devices");
  CLI::Option* info_json_option =
      info->add_option("--json", info_json, "Write the listing as JSON to this file ('-' for stdout)");

  std::string checkpoint_file;
  std::string checkpoint_json;
  CLI::App* checkpoint = app.add_subcommand("checkpoint", "Look into checkpoint (safetensors) files");
  checkpoint->require_subcommand(1);
  CLI::App* checkpoint_inspect = checkpoint->add_subcommand(
      "inspect", "List a checkpoint's tensors and metadata and verify its checksum (exit 1 when it is corrupt)");
  checkpoint_inspect->add_option("file", checkpoint_file, "The checkpoint (a safetensors file)")->required();
  CLI::Option* checkpoint_json_option = checkpoint_inspect->add_option(
      "--json", checkpoint_json, "Write the listing as JSON to this file ('-' for stdout)");

  std::string trace_file;
  std::string trace_page_path;
  std::string trace_device_memory = "16GiB";
  std::string trace_json;
  CLI::App* trace = app.add_subcommand("trace", "Look at a flight recorder trace (docs/TRACING.md)");
  trace->require_subcommand(1);
  CLI::App* trace_view = trace->add_subcommand(
      "view", "Write a self-contained HTML page of a trace: memory over time and the copy/compute timeline");
  trace_view->add_option("file", trace_file, "The trace (what Bridge::dump_trace or stream --trace wrote)")->required();
  trace_view->add_option("-o,--output", trace_page_path, "The page to write")->required();
  CLI::App* trace_replay = trace->add_subcommand(
      "replay", "Replay a trace's allocations against the caching pool's policies on the fake backend");
  trace_replay->add_option("file", trace_file, "The trace")->required();
  trace_replay->add_option("--device-memory", trace_device_memory, "The fake device's memory (e.g. 80GiB)")
      ->capture_default_str();
  std::vector<std::string> trace_pool_caps;
  trace_replay->add_option("--pool-cap", trace_pool_caps,
                           "Also replay with the caching pool capped at this size (may be given again)");
  CLI::Option* trace_json_option =
      trace_replay->add_option("--json", trace_json, "Write the results as JSON to this file ('-' for stdout)");
  stream->add_option("--trace", stream_args.trace,
                     "Record with the flight recorder and write its trace here at the end (docs/TRACING.md)");

  // CLI11 reports a mistyped command as "A subcommand is required"; say what was wrong.
  if (argc > 1 && argv[1][0] != '-' && std::string_view(argv[1]) != "stream" &&
      std::string_view(argv[1]) != "info" && std::string_view(argv[1]) != "checkpoint" &&
      std::string_view(argv[1]) != "trace") {
    print_stderr("devbridge: unknown command '{}' (commands: stream, info, checkpoint, trace; see devbridge --help)\n",
                 argv[1]);
    return kExitUsage;
  }
  if (argc > 2 && std::string_view(argv[1]) == "trace" && argv[2][0] != '-' &&
      std::string_view(argv[2]) != "view" && std::string_view(argv[2]) != "replay") {
    print_stderr("devbridge: unknown command 'trace {}' (trace commands: view, replay; see devbridge trace --help)\n",
                 argv[2]);
    return kExitUsage;
  }
  if (argc > 2 && std::string_view(argv[1]) == "checkpoint" && argv[2][0] != '-' &&
      std::string_view(argv[2]) != "inspect") {
    print_stderr("devbridge: unknown command 'checkpoint {}' (checkpoint commands: inspect; see devbridge checkpoint "
                 "--help)\n",
                 argv[2]);
    return kExitUsage;
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with exit code 0; CLI11 prints them.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      backend_option->description(backend_help());
      // CLI11 prints them through std::cout: the reason a write failed is errno when it failed, which
      // finish_stdout's flush (nothing left to write) no longer sees.
      errno = 0;
      const int code = app.exit(e);
      std::cout.flush();
      if (std::ferror(stdout) || !std::cout) note_stdout_failure(errno);
      return code;
    }
    // An unknown option before the command leaves the command missing, and
    // CLI11 then says only "A subcommand is required": the option is what was wrong.
    if (const std::vector<std::string> unknown = app.remaining(); !unknown.empty() && unknown.front().starts_with('-')) {
      print_stderr("devbridge: unknown option '{}' (see devbridge --help)\n", unknown.front());
      return kExitUsage;
    }
    auto said = repeated_option(e, argc, argv);
    if (!said) said = unexpected_argument(e, argc, argv);
    if (said) {
      print_stderr("devbridge: {} (see devbridge --help)\n", *said);
      return kExitUsage;
    }
    print_stderr("devbridge: {} (see devbridge --help)\n", one_line(e.what()));
    return kExitUsage;
  }

  try {
    log_to_stderr(quiet);
    // Every command ends at once on SIGINT/SIGTERM, its output's temporary
    // removed; a stream switches to draining once it runs.
    catch_stop_signals(OnStop::EndAtOnce);
    if (stream->parsed()) {
      stream_args.fake_inject = given(fake_inject_option, fake_inject);
      stream_args.device = given(device_option, device);
      stream_args.corrupt_element = given(corrupt_option, corrupt_element);
      return run_stream_command(stream_args, given(stream_json_option, stream_json), quiet);
    }
    if (info->parsed()) return run_info_command(given(info_json_option, info_json));
    if (checkpoint_inspect->parsed()) {
      return run_checkpoint_inspect_command(checkpoint_file, given(checkpoint_json_option, checkpoint_json));
    }
    if (trace_view->parsed()) return run_trace_view_command(trace_file, trace_page_path);
    if (trace_replay->parsed())
      return run_trace_replay_command(trace_file, trace_device_memory, trace_pool_caps,
                                      given(trace_json_option, trace_json));
    return kExitUsage;  // unreachable: require_subcommand(1)
  } catch (const UsageError& e) {
    print_stderr("devbridge: {}\n", one_line(e.what()));
    return kExitUsage;
  } catch (const devbridge::cli::TraceFileError& e) {
    print_stderr("devbridge trace: {}\n", one_line(e.what()));
    return kExitFailure;
  } catch (const devbridge::Error& e) {
    print_stderr("devbridge: {}\n", one_line(e.what()));
    return kExitFailure;
  } catch (const std::exception& e) {
    print_stderr("devbridge: {}\n", one_line(e.what()));
    return kExitFailure;
  }
}

}  // namespace

int main(int argc, char** argv) {
  note_ignored_stop_signals();
  turn_write_signals_into_errors();
  devbridge::cli::keep_memory_for_unwinding(std::size_t{64} << 20);
  return finish_stdout(run_command_line(argc, argv));
}
