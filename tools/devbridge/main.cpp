// devbridge: the command-line worker. `stream` moves data through the bridge
// and checks every element; `info` says which backends can run here.
//
// Exit codes: 0 success (stream: every element verified), 1 a runtime or
// verification failure, 2 a command line that cannot work. Each failure is
// one line on stderr.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <string_view>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "devbridge/error.hpp"
#include "info.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "sizes.hpp"
#include "stream.hpp"

#ifndef DEVBRIDGE_VERSION
#define DEVBRIDGE_VERSION "unknown"
#endif

namespace {

using devbridge::cli::UsageError;

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

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

// Where --json goes: a file opened before the work starts (so an unwritable
// path is a usage error, not a lost report), or stdout for "-".
class JsonSink {
 public:
  explicit JsonSink(const std::string& path) : path_(path) {
    if (path_.empty()) return;
    if (path_ == "-") {
      file_ = stdout;
      return;
    }
    file_ = std::fopen(path_.c_str(), "w");
    if (file_ == nullptr) {
      throw UsageError(fmt::format("--json: cannot write '{}': {}", path_, std::strerror(errno)));
    }
  }
  ~JsonSink() {
    if (file_ != nullptr && file_ != stdout) std::fclose(file_);
  }
  JsonSink(const JsonSink&) = delete;
  JsonSink& operator=(const JsonSink&) = delete;

  bool enabled() const { return file_ != nullptr; }
  bool to_stdout() const { return file_ == stdout; }

  // Returns false (after saying why) when the report could not be written.
  bool write(const nlohmann::json& document) {
    if (file_ == nullptr) return true;
    const std::string text = document.dump(2) + "\n";
    const bool ok = std::fwrite(text.data(), 1, text.size(), file_) == text.size() && std::fflush(file_) == 0;
    if (!ok) fmt::print(stderr, "devbridge: --json: writing '{}' failed: {}\n", path_, std::strerror(errno));
    return ok;
  }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

void print_stream_summary(std::FILE* out, const devbridge::cli::StreamPlan& plan,
                          const devbridge::cli::StreamReport& r) {
  using devbridge::cli::format_bytes;
  if (!r.verified) {
    // The reasons are already on stderr; rates of a broken run mean nothing.
    fmt::print(out, "devbridge stream: FAILED ({} of {} chunks verified)\n", r.chunks_verified, r.chunks);
    return;
  }
  std::string device = r.device_name;
  if (!r.device_string.empty()) device += fmt::format(" ({})", r.device_string);
  fmt::print(out, "devbridge stream: verified\n");
  fmt::print(out, "  backend      {}{}\n", r.backend, device.empty() ? "" : ", " + device);
  fmt::print(out, "  data         {} in {} chunk{} of {}, {} in flight, ring {} (wrapped {} time{})\n",
             format_bytes(r.bytes), r.chunks, r.chunks == 1 ? "" : "s", format_bytes(r.chunk_bytes), plan.slots,
             format_bytes(r.ring_bytes), r.ring_wraps, r.ring_wraps == 1 ? "" : "s");
  fmt::print(out, "  time         {:.3f} s\n", r.seconds);
  fmt::print(out, "  upload       {:.2f} GB/s  (busy {:.3f} s)\n", r.upload_gbps, r.upload_busy_seconds);
  fmt::print(out, "  download     {:.2f} GB/s  (busy {:.3f} s)\n", r.download_gbps, r.download_busy_seconds);
  fmt::print(out, "  end to end   {:.2f} GB/s\n", r.end_to_end_gbps);
  fmt::print(out, "  verified     {} of {} chunks, {} elements exact\n", r.chunks_verified, r.chunks,
             r.bytes / sizeof(float));
}

// The library logs through spdlog's default logger, which writes to stdout;
// stdout belongs to the summary and to `--json -`, so its log goes to stderr.
void log_to_stderr(bool quiet) {
  auto logger = spdlog::stderr_color_mt("devbridge-cli");
  logger->set_level(quiet ? spdlog::level::err : spdlog::level::warn);
  spdlog::set_default_logger(std::move(logger));
}

int run_stream_command(const devbridge::cli::StreamArgs& args, const std::string& json_path, bool quiet) {
  const devbridge::cli::StreamPlan plan = devbridge::cli::plan_stream(args);
  JsonSink json(json_path);

  devbridge::cli::Progress progress(plan.bytes, !quiet && devbridge::cli::Progress::stderr_is_terminal());
  const devbridge::cli::StreamReport report = devbridge::cli::run_stream(plan, progress);

  for (const std::string& error : report.errors) fmt::print(stderr, "devbridge stream: {}\n", one_line(error));
  if (!quiet) print_stream_summary(json.to_stdout() ? stderr : stdout, plan, report);
  const bool written = json.write(devbridge::cli::stream_report_json(report));
  return report.verified && written ? kExitOk : kExitFailure;
}

int run_info_command(const std::string& json_path) {
  JsonSink json(json_path);
  const devbridge::cli::InfoReport report = devbridge::cli::collect_info();
  if (!json.to_stdout()) fmt::print("{}", devbridge::cli::format_info(report));
  return json.write(devbridge::cli::info_report_json(report)) ? kExitOk : kExitFailure;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"devbridge: moves tensors between a host ring and device memory, and checks it did", "devbridge"};
  app.set_version_flag("--version", std::string("devbridge ") + DEVBRIDGE_VERSION);
  app.require_subcommand(1);

  devbridge::cli::StreamArgs stream_args;
  std::string stream_json;
  bool quiet = false;
  CLI::App* stream = app.add_subcommand(
      "stream", "Stream data through the bridge: upload, compute y = 2x + 1, download, verify every element");
  stream->add_option("--backend", stream_args.backend, "host, fake, cuda (when built) or auto (the best available)")
      ->capture_default_str();
  stream->add_option("--bytes", stream_args.bytes, "Total bytes to stream (4096, 512MiB, 1GiB, 1.5GiB, 2GB)")
      ->capture_default_str();
  stream->add_option("--chunk", stream_args.chunk, "Bytes per chunk (a multiple of 4)")->capture_default_str();
  stream->add_option("--inflight", stream_args.inflight, "Chunks in flight at once (device buffer pairs)")
      ->capture_default_str();
  stream->add_option("--ring-bytes", stream_args.ring_bytes, "Size of the host ring (at least 2 x chunk)")
      ->capture_default_str();
  stream->add_option("--json", stream_json, "Write a JSON report to this file ('-' for stdout)");
  stream->add_flag("-q,--quiet", quiet, "No progress bar and no summary; errors still go to stderr");
  stream->add_option("--stall-timeout", stream_args.stall_timeout,
                     "Seconds to wait for a copy to complete before giving up")
      ->capture_default_str();
  stream
      ->add_option("--fake-inject", stream_args.fake_inject,
                   "Test hook, fake backend only: inject CALL:FAILURE[:N] (e.g. copy_d2h:copy_failed_at_completion:3)")
      ->group("Test hooks");
  stream
      ->add_option("--corrupt-element", stream_args.corrupt_element,
                   "Test hook: damage this global element after download, to prove the check catches it")
      ->group("Test hooks");

  std::string info_json;
  CLI::App* info = app.add_subcommand("info", "List this build's backends, which can run here, and their devices");
  info->add_option("--json", info_json, "Write the listing as JSON to this file ('-' for stdout)");

  // CLI11 reports a mistyped command as "A subcommand is required"; say what was wrong.
  if (argc > 1 && argv[1][0] != '-' && std::string_view(argv[1]) != "stream" &&
      std::string_view(argv[1]) != "info") {
    fmt::print(stderr, "devbridge: unknown command '{}' (commands: stream, info; see devbridge --help)\n", argv[1]);
    return kExitUsage;
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with exit code 0; CLI11 prints them.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    fmt::print(stderr, "devbridge: {} (see devbridge --help)\n", one_line(e.what()));
    return kExitUsage;
  }

  try {
    log_to_stderr(quiet);
    if (stream->parsed()) return run_stream_command(stream_args, stream_json, quiet);
    if (info->parsed()) return run_info_command(info_json);
    return kExitUsage;  // unreachable: require_subcommand(1)
  } catch (const UsageError& e) {
    fmt::print(stderr, "devbridge: {}\n", one_line(e.what()));
    return kExitUsage;
  } catch (const devbridge::Error& e) {
    fmt::print(stderr, "devbridge: {}\n", one_line(e.what()));
    return kExitFailure;
  } catch (const std::exception& e) {
    fmt::print(stderr, "devbridge: {}\n", one_line(e.what()));
    return kExitFailure;
  }
}
