// The `devbridge` binary end to end: streams that must verify, failures that
// must exit 1 saying what failed, bad command lines that must exit 2 with a
// one-line reason, and `info`.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli_process.hpp"
#include "devbridge/bridge.hpp"

namespace devbridge::cli::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::size_t line_count(const std::string& text) { return static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')); }

nlohmann::json stream_json(const std::vector<std::string>& args, CliRun& run) {
  const std::string path = scratch_dir() + "/report.json";
  std::vector<std::string> full{"stream"};
  full.insert(full.end(), args.begin(), args.end());
  full.insert(full.end(), {"--json", path});
  run = run_cli(full);
  return nlohmann::json::parse(read_file(path));
}

// ---- streams that verify ----------------------------------------------------

struct StreamCase {
  const char* name;
  std::string backend;
  std::string bytes;
  std::string chunk;
  std::string inflight;
  std::string ring;
  std::uint64_t expect_bytes;
  std::uint64_t expect_chunks;
  std::uint64_t expect_device_buffers;
  // Real wrap-arounds: reservations laid end to end reach the ring's end at
  // most once per lap, so at most (2 x chunks) / (reservations per lap); a
  // ring that drains starts over without wrapping.
  std::uint64_t min_ring_wraps;
  std::uint64_t max_ring_wraps;
};

// Test names carry the case's name; gtest prints it for the parameter too.
void PrintTo(const StreamCase& c, std::ostream* os) { *os << c.name; }

class StreamVerifies : public ::testing::TestWithParam<StreamCase> {};

TEST_P(StreamVerifies, ExitsZeroAndReportsEveryChunkVerified) {
  const StreamCase& c = GetParam();
  CliRun run;
  const nlohmann::json report = stream_json(
      {"--backend", c.backend, "--bytes", c.bytes, "--chunk", c.chunk, "--inflight", c.inflight, "--ring-bytes", c.ring},
      run);
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  EXPECT_EQ(report["verified"], true);
  EXPECT_EQ(report["errors"], nlohmann::json::array());
  EXPECT_EQ(report["backend"], c.backend);
  EXPECT_EQ(report["bytes"], c.expect_bytes);
  EXPECT_EQ(report["chunks"], c.expect_chunks);
  EXPECT_EQ(report["chunks_verified"], c.expect_chunks);
  EXPECT_EQ(report["device_buffers"], c.expect_device_buffers);
  const auto wraps = report["ring_wraps"].get<std::uint64_t>();
  EXPECT_GE(wraps, c.min_ring_wraps);
  EXPECT_LE(wraps, c.max_ring_wraps);
  EXPECT_THAT(run.out, HasSubstr("(wrapped " + std::to_string(wraps) + " time")) << describe(run);
  EXPECT_EQ(report["bytes_verified"], c.expect_bytes);
  EXPECT_EQ(report["interrupted"], false);
  // One upload and one download per chunk, none failed, no stray completion.
  EXPECT_EQ(report["copies_submitted"], 2 * c.expect_chunks);
  EXPECT_EQ(report["copies_failed"], 0);
  EXPECT_EQ(report["stale_completions"], 0);
  EXPECT_GT(report["seconds"].get<double>(), 0.0);
  EXPECT_THAT(run.out, HasSubstr("devbridge stream: verified")) << describe(run);
  // stderr is a file here: no progress bar, nothing else either.
  EXPECT_EQ(run.err, "") << describe(run);
}

INSTANTIATE_TEST_SUITE_P(
    Host, StreamVerifies,
    ::testing::Values(
        // The ring holds everything: no wrap.
        StreamCase{"RingLargerThanData", "host", "8MiB", "1MiB", "4", "64MiB", 8u << 20, 8, 4, 0, 0},
        // A ring a sixteenth of the data (8 reservations a lap, 256 in all).
        StreamCase{"RingWrapsManyTimes", "host", "16MiB", "128KiB", "8", "1MiB", 16u << 20, 128, 8, 0, 32},
        // One chunk at a time, in a ring of exactly one input and one output:
        // a chunk's input and output fill the ring and the next one wraps,
        // unless the input was released before the output was reserved (the
        // ring drained, and the output started over at 0).
        StreamCase{"InflightOne", "host", "4MiB", "64KiB", "1", "128KiB", 4u << 20, 64, 1, 0, 63},
        // One chunk at a time in a ring of sixteen: the ring drains after
        // every chunk and starts over at offset 0, never reaching its end.
        StreamCase{"RingDrainsAreNotWraps", "host", "4MiB", "64KiB", "1", "1MiB", 4u << 20, 64, 1, 0, 0},
        // Deeper than the ring allows: the ring bounds the device buffers.
        StreamCase{"InflightDeeperThanRing", "host", "8MiB", "128KiB", "64", "1MiB", 8u << 20, 64, 8, 0, 16},
        // A short last chunk (12 bytes).
        StreamCase{"ShortLastChunk", "host", "3145740", "1MiB", "3", "4MiB", 3145740, 4, 3, 0, 2},
        // Chunks that are not a multiple of the 64-byte ring alignment: 100
        // bytes at 0 and 128 fill a 256-byte ring.
        StreamCase{"UnalignedChunks", "host", "10000", "100", "2", "256", 10000, 100, 2, 0, 99},
        // A chunk larger than the data is the data.
        StreamCase{"ChunkLargerThanData", "host", "4096", "1MiB", "8", "8KiB", 4096, 1, 1, 0, 0},
        StreamCase{"FractionalSizes", "host", "1.5MiB", "0.25MiB", "2", "1MiB", 3u << 19, 6, 2, 0, 3},
        // The fake device completes each copy at submit; the data still moves.
        StreamCase{"FakeBackend", "fake", "8MiB", "256KiB", "4", "2MiB", 8u << 20, 32, 4, 0, 8},
        StreamCase{"FakeBackendInflightOne", "fake", "1MiB", "64KiB", "1", "128KiB", 1u << 20, 16, 1, 0, 15},
        StreamCase{"FakeRingDrainsAreNotWraps", "fake", "1MiB", "64KiB", "1", "1MiB", 1u << 20, 16, 1, 0, 0}),
    [](const ::testing::TestParamInfo<StreamCase>& info) { return std::string(info.param.name); });

TEST(Stream, AutoPicksAnAvailableBackendAndVerifies) {
  CliRun run;
  const nlohmann::json report = stream_json({"--backend", "auto", "--bytes", "2MiB", "--chunk", "256KiB"}, run);
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  EXPECT_EQ(report["verified"], true);
  EXPECT_NE(report["backend"], "auto");
}

// The same worker over the OpenCL backend (PoCL in CI): uploads, the compute
// role as an OpenCL kernel, downloads, all verified.
TEST(Stream, OpenCLStreamsAndVerifiesWhereADeviceIsThere) {
  if (const std::string why = backend_unavailable_reason("opencl"); !why.empty()) GTEST_SKIP() << why;

  CliRun run;
  const nlohmann::json report = stream_json(
      {"--backend", "opencl", "--bytes", "4MiB", "--chunk", "128KiB", "--inflight", "4", "--ring-bytes", "1MiB"}, run);
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  EXPECT_EQ(report["verified"], true);
  EXPECT_EQ(report["backend"], "opencl");
  EXPECT_EQ(report["chunks_verified"], 32);
  EXPECT_EQ(report["copies_failed"], 0);
  // Whether the ring laps depends on how long the device keeps each range:
  // the planner hands a range back as its copy ends, and a ring that drains
  // starts over without wrapping (the fake/host cases above count exactly).
  EXPECT_TRUE(report["ring_wraps"].is_number_unsigned());
}

TEST(Stream, TheDeviceAndTheBackendsOwnOptionsReachTheBackend) {
  const CliRun run = run_cli({"stream", "--backend", "host", "--device", "0", "--backend-option",
                              "inline_async_max_bytes=0", "--bytes", "1MiB", "--chunk", "64KiB", "--json", "-"});
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  const auto report = nlohmann::json::parse(run.out);
  EXPECT_EQ(report["device_id"], "0");
  EXPECT_EQ(report["verified"], true);
}

TEST(Stream, JsonReportHasEveryDocumentedField) {
  CliRun run;
  const nlohmann::json report =
      stream_json({"--backend", "host", "--bytes", "1MiB", "--chunk", "64KiB", "--ring-bytes", "256KiB"}, run);
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  for (const char* field :
       {"command", "backend", "device_id", "device_name", "device_string", "bytes", "chunk_bytes", "chunks", "chunks_verified",
        "inflight", "device_buffers", "ring_bytes", "ring_wraps", "seconds", "upload_busy_seconds",
        "download_busy_seconds", "upload_gbps", "download_gbps", "end_to_end_gbps", "copies_submitted",
        "copies_failed", "stale_completions", "bytes_verified", "verified", "interrupted", "signal", "errors"}) {
    EXPECT_TRUE(report.contains(field)) << field;
  }
  EXPECT_EQ(report["command"], "stream");
  EXPECT_EQ(report["device_string"], "CPU");
  EXPECT_EQ(report["chunk_bytes"], 64 * 1024);
  EXPECT_EQ(report["inflight"], 8);
  EXPECT_EQ(report["ring_bytes"], 256 * 1024);
  EXPECT_EQ(report["bytes_verified"], 1024 * 1024);
  EXPECT_EQ(report["interrupted"], false);
  EXPECT_TRUE(report["signal"].is_null());
  for (const char* rate : {"upload_gbps", "download_gbps", "end_to_end_gbps"}) {
    EXPECT_TRUE(report[rate].is_number()) << rate;
    EXPECT_GE(report[rate].get<double>(), 0.0) << rate;
  }
}

TEST(Stream, JsonToStdoutIsTheOnlyThingOnStdout) {
  const CliRun run = run_cli({"stream", "--backend", "host", "--bytes", "1MiB", "--chunk", "64KiB", "--json", "-"});
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  const nlohmann::json report = nlohmann::json::parse(run.out);  // throws if anything else is mixed in
  EXPECT_EQ(report["verified"], true);
  EXPECT_THAT(run.err, HasSubstr("devbridge stream: verified"));  // the summary moved to stderr
}

TEST(Stream, QuietPrintsNothingOnSuccess) {
  const CliRun run = run_cli({"stream", "--backend", "host", "--bytes", "1MiB", "--chunk", "64KiB", "--quiet"});
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  EXPECT_EQ(run.out, "");
  EXPECT_EQ(run.err, "");
}

TEST(Stream, DrawsAProgressBarOnATerminalOnly) {
  const std::vector<std::string> args{"stream", "--backend", "host", "--bytes", "2MiB", "--chunk", "64KiB"};
  const CliRun terminal = run_cli(args, Stderr::Terminal);
  ASSERT_EQ(terminal.exit_code, 0) << describe(terminal);
  EXPECT_THAT(terminal.err, HasSubstr("\r\x1b[K["));  // drawn in place...
  EXPECT_THAT(terminal.err, HasSubstr("100%"));
  EXPECT_THAT(terminal.err, ::testing::EndsWith("\r\x1b[K"));  // ...and erased at the end

  const CliRun quiet_terminal = run_cli({"stream", "--backend", "host", "--bytes", "1MiB", "--quiet"}, Stderr::Terminal);
  ASSERT_EQ(quiet_terminal.exit_code, 0) << describe(quiet_terminal);
  EXPECT_EQ(quiet_terminal.err, "");

  const CliRun file = run_cli(args);
  ASSERT_EQ(file.exit_code, 0) << describe(file);
  EXPECT_THAT(file.err, Not(HasSubstr("\r")));
}

// ---- runtime failures: exit 1, saying what failed ----------------------------

struct FailureCase {
  const char* name;
  std::vector<std::string> args;
  std::vector<std::string> stderr_mentions;
};

void PrintTo(const FailureCase& c, std::ostream* os) { *os << c.name; }

class StreamFails : public ::testing::TestWithParam<FailureCase> {};

TEST_P(StreamFails, ExitsOneAndSaysWhatFailed) {
  const FailureCase& c = GetParam();
  std::vector<std::string> args{"--bytes", "2MiB", "--chunk", "128KiB", "--inflight", "4", "--ring-bytes", "1MiB"};
  args.insert(args.end(), c.args.begin(), c.args.end());
  CliRun run;
  const nlohmann::json report = stream_json(args, run);
  EXPECT_EQ(run.exit_code, 1) << describe(run);
  EXPECT_EQ(run.signal, 0) << describe(run);
  for (const std::string& mention : c.stderr_mentions) EXPECT_THAT(run.err, HasSubstr(mention)) << describe(run);
  EXPECT_THAT(run.out, HasSubstr("FAILED"));
  // The report is still written, and says so.
  EXPECT_EQ(report["verified"], false);
  ASSERT_FALSE(report["errors"].empty());
  EXPECT_LT(report["chunks_verified"].get<std::uint64_t>(), report["chunks"].get<std::uint64_t>());
}

INSTANTIATE_TEST_SUITE_P(
    Injected, StreamFails,
    ::testing::Values(
        // 2MiB in 128KiB chunks of 32768 elements: element 300000 is element 5088 of chunk 9.
        FailureCase{"WrongElement",
                    {"--backend", "host", "--corrupt-element", "300000"},
                    {"chunk 9: element 5088", "global element 300000", "expected", "got", "1 of 32768 elements"}},
        FailureCase{"DownloadFailsAtCompletion",
                    {"--backend", "fake", "--fake-inject", "copy_d2h:copy_failed_at_completion:3"},
                    {"chunk 2", "device_to_host failed", "OutputCopyFailed"}},
        FailureCase{"UploadRefusedAtSubmit",
                    {"--backend", "fake", "--fake-inject", "copy_h2d:copy_failed_at_submit:2"},
                    {"chunk 1", "host_to_device", "DeviceCopyFailed"}},
        FailureCase{"UploadFailsAtCompletion",
                    {"--backend", "fake", "--fake-inject", "copy_h2d:copy_failed_at_completion:5"},
                    {"chunk 4", "host_to_device failed", "DeviceCopyFailed"}},
        FailureCase{"LostCompletion",
                    {"--backend", "fake", "--fake-inject", "copy_h2d:lost_completion:2", "--stall-timeout", "1"},
                    {"chunk 1", "never arrived"}},
        FailureCase{"DeviceLostInCompute",
                    {"--backend", "fake", "--fake-inject", "launch:fatal:3"},
                    {"chunk 2", "launch_axpy"}}),
    [](const ::testing::TestParamInfo<FailureCase>& info) { return std::string(info.param.name); });

// The planner's own waits end at the stall timeout too: a download's copy,
// and ring room (exactly two chunks) that a lost upload holds.
TEST(Stream, ALostCompletionTheTransferWaitsForEndsAtTheStallTimeout) {
  const std::vector<std::vector<std::string>> cases{
      {"--ring-bytes", "8192", "--fake-inject", "copy_d2h:lost_completion:1"},
      {"--ring-bytes", "2048", "--fake-inject", "copy_h2d:lost_completion:2"}};
  for (const auto& injected : cases) {
    std::vector<std::string> args{"--backend", "fake", "--bytes", "4096", "--chunk", "1024", "--stall-timeout", "1"};
    args.insert(args.end(), injected.begin(), injected.end());
    CliRun run;
    const nlohmann::json report = stream_json(args, run);
    EXPECT_EQ(run.exit_code, 1) << describe(run);
    EXPECT_THAT(run.err, HasSubstr("never arrived")) << describe(run);
    EXPECT_EQ(report["verified"], false);
  }
}

// Out of memory for real (one injected refusal would be retried away): 1 MiB
// of device memory for four buffers of 512 KiB.
TEST(Stream, ADeviceOutOfMemoryExitsOneNamingWhatTheBridgeHeld) {
  CliRun run;
  const nlohmann::json report =
      stream_json({"--backend", "fake", "--bytes", "2MiB", "--chunk", "512KiB", "--inflight", "4", "--ring-bytes",
                   "1MiB", "--backend-option", "memory_bytes=1048576"},
                  run);
  EXPECT_EQ(run.exit_code, 1) << describe(run);
  EXPECT_THAT(run.err, HasSubstr("AllocationFailed"));
  EXPECT_THAT(run.err, HasSubstr("retried once"));
  EXPECT_THAT(run.err, HasSubstr("1048576 bytes in live allocations"));
  EXPECT_EQ(report["verified"], false);
  EXPECT_EQ(report["memory"]["oom_retries"], 1);
}

TEST(Stream, TheReportSaysHowDeviceMemoryWent) {
  CliRun run;
  const nlohmann::json report = stream_json({"--backend", "host", "--bytes", "1MiB", "--chunk", "64KiB"}, run);
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  EXPECT_EQ(report["memory"]["pool_enabled"], true);  // the host backend's default
  EXPECT_GT(report["memory"]["peak_allocated_bytes"].get<std::uint64_t>(), 0u);
  EXPECT_GT(report["memory"]["backend_allocations"].get<std::uint64_t>(), 0u);
  // Every MemoryStats field, under the name bridge.hpp's for_each_field gives it.
  EXPECT_EQ(report["memory"].size(), devbridge::kMemoryStatsFields) << report["memory"].dump();
  devbridge::for_each_field(devbridge::MemoryStats{}, [&](const char* name, auto) {
    EXPECT_TRUE(report["memory"].contains(name)) << "the report's memory object lacks " << name;
  });
}

TEST(Stream, ADuplicatedCompletionIsIgnoredAndTheStreamStillVerifies) {
  CliRun run;
  const nlohmann::json report = stream_json({"--backend", "fake", "--bytes", "1MiB", "--chunk", "64KiB",
                                             "--fake-inject", "copy_d2h:duplicated_completion:2"},
                                            run);
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  EXPECT_EQ(report["verified"], true);
  EXPECT_EQ(report["stale_completions"], 1);
  EXPECT_THAT(run.err, HasSubstr("ignored a completion"));  // the bridge's log line, on stderr
  EXPECT_THAT(run.out, Not(HasSubstr("ignored")));
}

// A device lost when the stream closes its bridge at the end (its last
// quiesce) fails the run, though every chunk was verified: the close used
// to be left to the bridge's destructor, which only logs, and the run
// said "verified", exit 0.
TEST(Stream, ADeviceLostAtTheFinalCloseFailsTheRun) {
  const std::string trace = scratch_dir() + "/lost-at-close.trace.json";
  CliRun run;
  const nlohmann::json report = stream_json(
      {"--backend", "fake", "--bytes", "1MiB", "--chunk", "64KiB", "--fake-inject", "quiesce:fatal", "--trace", trace},
      run);
  EXPECT_EQ(run.exit_code, 1) << describe(run);
  EXPECT_EQ(run.signal, 0) << describe(run);
  EXPECT_THAT(run.err, HasSubstr("devbridge stream: closing the bridge failed: ")) << describe(run);
  EXPECT_THAT(run.err, HasSubstr("device lost")) << describe(run);
  EXPECT_THAT(run.out, HasSubstr("devbridge stream: FAILED (16 of 16 chunks verified)")) << describe(run);
  EXPECT_THAT(run.out, Not(HasSubstr("devbridge stream: verified"))) << describe(run);
  EXPECT_EQ(report["verified"], false);
  EXPECT_EQ(report["interrupted"], false);
  EXPECT_EQ(report["chunks_verified"], 16);
  ASSERT_EQ(report["errors"].size(), 1u) << report.dump();
  EXPECT_THAT(report["errors"][0].get<std::string>(), HasSubstr("closing the bridge failed"));
  // The trace is still written, after the failed close.
  EXPECT_EQ(report["trace"], trace);
  EXPECT_FALSE(read_file(trace).empty());
}

// The same file under two names (a hard link, a symbolic link) is one file.
TEST(Stream, TraceAndJsonNamingOneFileTwoWaysAreRefused) {
  const std::string dir = scratch_dir();
  const std::string file = dir + "/one.json";
  const std::string previous = "{\"previous\": true}\n";
  std::ofstream(file) << previous;
  ASSERT_EQ(::link(file.c_str(), (dir + "/hard.json").c_str()), 0);
  ASSERT_EQ(::symlink("one.json", (dir + "/soft.json").c_str()), 0);
  for (const std::string& other : {dir + "/hard.json", dir + "/soft.json", dir + "/./one.json"}) {
    const CliRun run = run_cli({"stream", "--backend", "fake", "--bytes", "4096", "--trace", file, "--json", other});
    EXPECT_EQ(run.exit_code, 2) << other << "\n" << describe(run);
    EXPECT_THAT(run.err, HasSubstr("is the --trace file")) << describe(run);
    EXPECT_EQ(line_count(run.err), 1u) << describe(run);
    EXPECT_EQ(run.out, "") << describe(run);
  }
  EXPECT_EQ(read_file(file), previous);
  // "-" is stdout, never a file: the trace goes to the file, the report to stdout.
  const std::string trace = dir + "/dash.trace.json";
  const CliRun run = run_cli({"stream", "--backend", "fake", "--bytes", "4096", "--trace", trace, "--json", "-"});
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  EXPECT_EQ(nlohmann::json::parse(run.out)["trace"], trace);
}

// An explicit --device wins over $DEVBRIDGE_OPENCL_DEVICE (OpenCL's default
// device), as in the backend: the command line's availability check used to
// refuse the backend ("opencl is unavailable", exit 2) for a bad default.
TEST(Stream, AnExplicitOpenCLDeviceWinsOverTheEnvironment) {
  if (const std::string why = backend_unavailable_reason("opencl"); !why.empty()) GTEST_SKIP() << why;
  const std::string listing_path = scratch_dir() + "/opencl-devices.json";
  ASSERT_EQ(run_cli({"info", "--json", listing_path}).exit_code, 0);
  std::string device;
  const nlohmann::json listing = nlohmann::json::parse(read_file(listing_path));
  for (const nlohmann::json& b : listing["backends"])
    if (b["name"] == "opencl") device = b["devices"].at(0)["device_id"].get<std::string>();
  ASSERT_FALSE(device.empty());

  struct RestoreEnvironment {
    ~RestoreEnvironment() { ::unsetenv("DEVBRIDGE_OPENCL_DEVICE"); }
  } restore;
  for (const char* value : {"abc", "99:99"}) {
    ASSERT_EQ(::setenv("DEVBRIDGE_OPENCL_DEVICE", value, 1), 0);
    const CliRun run =
        run_cli({"stream", "--backend", "opencl", "--device", device, "--bytes", "64KiB", "--chunk", "16KiB", "--json", "-"});
    ASSERT_EQ(run.exit_code, 0) << "DEVBRIDGE_OPENCL_DEVICE=" << value << "\n" << describe(run);
    const nlohmann::json report = nlohmann::json::parse(run.out);
    EXPECT_EQ(report["device_id"], device);
    EXPECT_EQ(report["verified"], true);
    // Without --device the variable is the default device, and names none.
    const CliRun by_default = run_cli({"stream", "--backend", "opencl", "--bytes", "4096"});
    EXPECT_EQ(by_default.exit_code, 2) << describe(by_default);
    EXPECT_THAT(by_default.err, HasSubstr("DEVBRIDGE_OPENCL_DEVICE")) << describe(by_default);
    // An explicit device that is not there is still a usage error.
    const CliRun absent = run_cli({"stream", "--backend", "opencl", "--device", "77:77", "--bytes", "4096"});
    EXPECT_EQ(absent.exit_code, 2) << describe(absent);
    EXPECT_THAT(absent.err, HasSubstr("no OpenCL device 77:77")) << describe(absent);
    EXPECT_EQ(line_count(absent.err), 1u) << describe(absent);
  }
}

// ---- the trace tools' input -------------------------------------------------

std::string small_trace(const std::string& name) {
  const std::string path = scratch_dir() + "/" + name;
  const CliRun run = run_cli({"stream", "--backend", "fake", "--bytes", "64KiB", "--chunk", "16KiB", "-q", "--trace", path});
  EXPECT_EQ(run.exit_code, 0) << describe(run);
  return path;
}

// A report written over the file the command reads: `checkpoint inspect F
// --json F` replaced the checkpoint with its report and exited 0, as did
// `trace replay T --json T` with the trace.
TEST(ReportOverInput, InspectAndReplayRefuseToWriteTheirJsonOverWhatTheyRead) {
  const std::string trace = small_trace("replay-self.trace.json");
  const std::string checkpoint = scratch_dir() + "/inspect-self.safetensors";
  std::ofstream(checkpoint) << "not even a header";
  for (const auto& [args, input] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"checkpoint", "inspect", checkpoint, "--json", checkpoint}, checkpoint},
           {{"checkpoint", "inspect", checkpoint, "--json", scratch_dir() + "/./inspect-self.safetensors"}, checkpoint},
           {{"trace", "replay", trace, "--json", trace}, trace}}) {
    const std::string before = read_file(input);
    const CliRun run = run_cli(args);
    EXPECT_EQ(run.exit_code, 2) << describe(run);
    EXPECT_THAT(run.err, ::testing::StartsWith("devbridge: --json: ")) << describe(run);
    EXPECT_THAT(run.err, HasSubstr("would replace it")) << describe(run);
    EXPECT_EQ(line_count(run.err), 1u) << describe(run);
    EXPECT_EQ(read_file(input), before) << describe(run);
  }
  // stdout is no file.
  EXPECT_EQ(run_cli({"trace", "replay", trace, "--json", "-"}).exit_code, 0);
}

// The page used to be written over the trace it was drawn from.
TEST(TraceView, RefusesToWriteThePageOverItsTrace) {
  const std::string trace = small_trace("view-self.trace.json");
  const std::string before = read_file(trace);
  ASSERT_FALSE(before.empty());
  const std::string link = scratch_dir() + "/view-self-link.json";
  ASSERT_EQ(::symlink(trace.c_str(), link.c_str()), 0);
  for (const std::string& page : {trace, link, scratch_dir() + "/../" +
                                                   std::filesystem::path(scratch_dir()).filename().string() +
                                                   "/view-self.trace.json"}) {
    const CliRun run = run_cli({"trace", "view", trace, "-o", page});
    EXPECT_EQ(run.exit_code, 2) << page << "\n" << describe(run);
    EXPECT_THAT(run.err, ::testing::StartsWith("devbridge: -o: ")) << describe(run);
    EXPECT_THAT(run.err, HasSubstr("is the trace being read")) << describe(run);
    EXPECT_EQ(line_count(run.err), 1u) << describe(run);
    EXPECT_EQ(run.out, "") << describe(run);
  }
  EXPECT_EQ(read_file(trace), before);
  // Another file is fine.
  const CliRun run = run_cli({"trace", "view", trace, "-o", scratch_dir() + "/view-self.html"});
  EXPECT_EQ(run.exit_code, 0) << describe(run);
}

// A FIFO (no writer) or a device is refused at once, as checkpoint inspect
// refuses one: trace view and replay used to open it blocking and wait forever.
TEST(TraceTools, RefuseAnythingButARegularFileAtOnce) {
  const std::string fifo = scratch_dir() + "/trace.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const std::string page = scratch_dir() + "/fifo.html";
  for (const std::string& input : {fifo, std::string("/dev/null")}) {
    for (const std::vector<std::string>& args :
         {std::vector<std::string>{"trace", "replay", input}, std::vector<std::string>{"trace", "view", input, "-o", page}}) {
      CliProcess child(args);
      ASSERT_TRUE(child.wait(20)) << args[1] << " " << input << ": still waiting after 20 s";
      const CliRun& run = child.result();
      EXPECT_EQ(run.exit_code, 1) << describe(run);
      EXPECT_EQ(run.err, "devbridge trace: " + input +
                             ": is not a regular file (a FIFO, device or socket is refused, never waited on)\n")
          << describe(run);
      EXPECT_EQ(run.out, "") << describe(run);
    }
  }
  EXPECT_FALSE(std::filesystem::exists(page));
}

// ---- bad command lines: exit 2, one line ------------------------------------

struct UsageCase {
  const char* name;
  std::vector<std::string> args;
  std::string reason;  // a piece of the one line
};

void PrintTo(const UsageCase& c, std::ostream* os) { *os << c.name; }

class BadUsage : public ::testing::TestWithParam<UsageCase> {};

TEST_P(BadUsage, ExitsTwoWithAOneLineReason) {
  const UsageCase& c = GetParam();
  const CliRun run = run_cli(c.args);
  EXPECT_EQ(run.exit_code, 2) << describe(run);
  EXPECT_EQ(run.signal, 0) << describe(run);
  EXPECT_EQ(line_count(run.err), 1u) << describe(run);
  EXPECT_THAT(run.err, ::testing::StartsWith("devbridge: ")) << describe(run);
  EXPECT_THAT(run.err, HasSubstr(c.reason)) << describe(run);
  EXPECT_EQ(run.out, "") << describe(run);
}

INSTANTIATE_TEST_SUITE_P(
    Cli, BadUsage,
    ::testing::Values(
        UsageCase{"NoCommand", {}, "subcommand is required"},
        // CLI11 said "A subcommand is required", naming nothing.
        UsageCase{"UnknownOptionBeforeTheCommand", {"-x"}, "unknown option '-x'"},
        // 65535 bytes and the minimum both round to "64.00 KiB": "64.00 KiB is less than ... (64.00 KiB)".
        UsageCase{"ReplayDeviceMemoryOneByteShort",
                  {"trace", "replay", "any.trace.json", "--device-memory", "65535"},
                  "--device-memory: 65535 bytes is less than the smallest device a replay runs on (65536 bytes)"},
        UsageCase{"UnknownCommand", {"strem"}, "unknown command 'strem'"},
        UsageCase{"UnknownOption", {"stream", "--bogus"}, "unknown option '--bogus'"},
        // CLI11 said "The following arguments were not expected: 16KiB --ring", last first.
        UsageCase{"UnknownOptionWithAValue", {"stream", "--ring", "16KiB"}, "unknown option '--ring'"},
        UsageCase{"ExtraArgument", {"stream", "extra"}, "unexpected argument 'extra'"},
        UsageCase{"MissingValue", {"stream", "--chunk"}, "--chunk"},
        UsageCase{"UnknownBackend", {"stream", "--backend", "tpu"}, "unknown backend 'tpu'"},
        UsageCase{"EmptyBackend", {"stream", "--backend", ""}, "unknown backend ''"},
        // A made-up CUcontext would be dereferenced by the driver (SIGSEGV).
        UsageCase{"ContextOption", {"stream", "--backend", "host", "--backend-option", "context=1"},
                  "context is a CUcontext of the calling process"},
        // CLI11 said "--bytes: At Most 1 required but received 2", naming neither value.
        UsageCase{"RepeatedOption", {"stream", "--bytes", "4KiB", "--bytes=8KiB"},
                  "--bytes given 2 times ('4KiB', '8KiB'): give it once"},
        UsageCase{"MalformedBytes", {"stream", "--bytes", "1GX"}, "--bytes: '1GX' is not a size"},
        UsageCase{"NegativeBytes", {"stream", "--bytes", "-1"}, "--bytes: '-1' is not a size"},
        UsageCase{"FractionOfAByte", {"stream", "--bytes", "1.5"}, "not a whole number of bytes"},
        UsageCase{"HugeBytes", {"stream", "--bytes", "20000000TiB"}, "too large"},
        UsageCase{"ZeroBytes", {"stream", "--bytes", "0"}, "--bytes: '0': must be more than 0"},
        UsageCase{"BytesNotFloats", {"stream", "--bytes", "4098"}, "--bytes: '4098' (4098 bytes) is not a multiple of 4"},
        UsageCase{"MalformedChunk", {"stream", "--chunk", "four"}, "--chunk: 'four' is not a size"},
        UsageCase{"ZeroChunk", {"stream", "--chunk", "0"}, "--chunk: '0': must be more than 0"},
        UsageCase{"ChunkNotFloats", {"stream", "--chunk", "1022"}, "--chunk: '1022' (1022 bytes) is not a multiple of 4"},
        UsageCase{"ChunkLargerThanRing",
                  {"stream", "--chunk", "4MiB", "--ring-bytes", "6MiB"},
                  "needs at least 8388608 bytes"},
        UsageCase{"RingHoldsOnlyTheInput",
                  {"stream", "--chunk", "100", "--ring-bytes", "255", "--bytes", "1000"},
                  "needs at least 256 bytes"},
        UsageCase{"HugeChunk",
                  {"stream", "--bytes", "16000000TiB", "--chunk", "16000000TiB"},
                  "--chunk: '16000000TiB' (17592186044416000000 bytes) is too large"},
        UsageCase{"ZeroRing", {"stream", "--ring-bytes", "0"}, "--ring-bytes: '0': must be more than 0"},
        UsageCase{"InflightZero", {"stream", "--inflight", "0"}, "--inflight: '0': must be at least 1"},
        UsageCase{"InflightNegative", {"stream", "--inflight", "-3"}, "--inflight: '-3' is not a whole number"},
        UsageCase{"InflightNotANumber", {"stream", "--inflight", "lots"}, "--inflight: 'lots' is not a whole number"},
        UsageCase{"StallTimeoutZero", {"stream", "--stall-timeout", "0"}, "--stall-timeout"},
        UsageCase{"JsonUnwritable", {"stream", "--json", "/nonexistent-dir/report.json"}, "--json: cannot write"},
        // An empty path used to be taken for no --json at all, and the run went ahead.
        UsageCase{"JsonEmpty", {"stream", "--json", ""}, "--json: '' is not a path"},
        UsageCase{"JsonIsADirectory", {"stream", "--json", "."}, "--json: cannot write '.': Is a directory"},
        // "--json --" wrote the report into a file named "--".
        UsageCase{"JsonEndOfOptions", {"stream", "--bytes", "4096", "--json", "--"},
                  "--json: '--' looks like an option, not a file name (for a file of that name give './--')"},
        UsageCase{"TraceEndOfOptions", {"stream", "--bytes", "4096", "--trace", "--"}, "--trace: '--' looks like an option"},
        UsageCase{"JsonEndsInASlash", {"stream", "--json", "reports/"}, "--json: cannot write 'reports/'"},
        // A directory that takes no new file, though access(2) says it does to root: refused before the run.
        UsageCase{"TraceInProc", {"stream", "--bytes", "4096", "--trace", "/proc/t.json"},
                  "--trace: cannot write '/proc/t.json': /proc: "},
        UsageCase{"DeviceNotThere", {"stream", "--backend", "host", "--device", "1"}, "this backend has one device"},
        // With the default --backend auto the device and the options are
        // checked on the backend auto picks, before anything runs (they used
        // to reach the run: exit 1, "FAILED (0 of 1 chunks verified)").
        UsageCase{"DeviceNotThereWithAuto", {"stream", "--device", "7", "--bytes", "4096"}, "--device/--backend-option: "},
        UsageCase{"BackendOptionUnknownWithAuto",
                  {"stream", "--backend-option", "nope=1", "--bytes", "4096"},
                  "no option 'nope'"},
        // The report, written last, replaced the trace (and stderr said the trace was there).
        UsageCase{"TraceAndJsonOneFile",
                  {"stream", "--bytes", "4096", "--trace", "one-file.json", "--json", "one-file.json"},
                  "--json: 'one-file.json' is the --trace file ('one-file.json'): the --json file would replace it"},
        UsageCase{"TraceAndJsonOneFileSpelledTwoWays",
                  {"stream", "--bytes", "4096", "--trace", "./sub/../one-file.json", "--json", "one-file.json"},
                  "is the --trace file"},
        UsageCase{"DeviceEmpty", {"stream", "--backend", "host", "--device", ""}, "--device: empty"},
        UsageCase{"BackendOptionUnknown",
                  {"stream", "--backend", "host", "--backend-option", "ordinal=1"},
                  "backend host has no option 'ordinal'"},
        UsageCase{"BackendOptionNotKeyValue", {"stream", "--backend-option", "fast"}, "'fast' is not KEY=VALUE"},
        UsageCase{"BackendOptionTwice",
                  {"stream", "--backend", "host", "--backend-option", "inline_async_max_bytes=1", "--backend-option",
                   "inline_async_max_bytes=2"},
                  "inline_async_max_bytes given twice"},
        UsageCase{"DeviceAsABackendOption",
                  {"stream", "--backend", "host", "--backend-option", "device=0"},
                  "give the device with --device"},
        UsageCase{"InjectWithoutFake",
                  {"stream", "--backend", "host", "--fake-inject", "copy_h2d:lost_completion"},
                  "only with --backend fake"},
        UsageCase{"InjectUnknownCall",
                  {"stream", "--backend", "fake", "--fake-inject", "teleport:fatal"},
                  "unknown call 'teleport'"},
        UsageCase{"InjectMalformed", {"stream", "--backend", "fake", "--fake-inject", "nonsense"}, "CALL:FAILURE"},
        UsageCase{"InjectEmpty", {"stream", "--backend", "fake", "--fake-inject", ""}, "--fake-inject: ''"},
        UsageCase{"InjectUnknownFailure",
                  {"stream", "--backend", "fake", "--fake-inject", "copy_h2d:melt"},
                  "unknown failure 'melt'"},
        // A failure that cannot fire on that call: refused before anything
        // runs (it used to start the run, which then failed with exit 1).
        UsageCase{"InjectFatalIntoFree",
                  {"stream", "--backend", "fake", "--fake-inject", "free:fatal"},
                  "failure fatal cannot apply to call free"},
        UsageCase{"InjectAllocationFailureIntoUpload",
                  {"stream", "--backend", "fake", "--fake-inject", "copy_h2d:allocation_failed"},
                  "failure allocation_failed cannot apply to call copy_h2d (allocation_failed applies to: allocate, "
                  "allocate_host, register_host)"},
        UsageCase{"InjectInvalidViewIntoAllocate",
                  {"stream", "--backend", "fake", "--fake-inject", "allocate:invalid_view:2"},
                  "failure invalid_view cannot apply to call allocate"},
        UsageCase{"InjectLostCompletionIntoLaunch",
                  {"stream", "--backend", "fake", "--fake-inject", "launch:lost_completion"},
                  "failure lost_completion cannot apply to call launch"},
        // "CALL:FAILURE:" used to be read as N = 1.
        UsageCase{"InjectEmptyN",
                  {"stream", "--backend", "fake", "--fake-inject", "copy_h2d:lost_completion:"},
                  "N '' is not a whole number"},
        UsageCase{"CorruptPastTheEnd",
                  {"stream", "--bytes", "4096", "--corrupt-element", "1024"},
                  "past the last element"},
        UsageCase{"CorruptEmpty", {"stream", "--corrupt-element", ""}, "--corrupt-element: '' is not a whole number"},
        UsageCase{"InfoUnknownOption", {"info", "--bogus"}, "--bogus"},
        UsageCase{"InfoJsonUnwritable", {"info", "--json", "/nonexistent-dir/info.json"}, "--json: cannot write"},
        UsageCase{"InfoJsonEmpty", {"info", "--json", ""}, "--json: '' is not a path"},
        UsageCase{"InfoJsonIsADirectory", {"info", "--json", "."}, "--json: cannot write '.': Is a directory"}),
    [](const ::testing::TestParamInfo<UsageCase>& info) { return std::string(info.param.name); });

// ---- help, version, info ---------------------------------------------------

TEST(Help, ExitsZeroAndNamesTheCommands) {
  const CliRun top = run_cli({"--help"});
  EXPECT_EQ(top.exit_code, 0) << describe(top);
  EXPECT_THAT(top.out, HasSubstr("stream"));
  EXPECT_THAT(top.out, HasSubstr("info"));

  const CliRun stream = run_cli({"stream", "--help"});
  EXPECT_EQ(stream.exit_code, 0) << describe(stream);
  for (const char* option : {"--backend", "--bytes", "--chunk", "--inflight", "--ring-bytes", "--json", "--quiet"}) {
    EXPECT_THAT(stream.out, HasSubstr(option));
  }

  // --backend lists every backend the registry knows, whether built here or not.
  const std::string path = scratch_dir() + "/help-backends.json";
  ASSERT_EQ(run_cli({"info", "--json", path}).exit_code, 0);
  const std::string::size_type at = stream.out.find("--backend");
  ASSERT_NE(at, std::string::npos);
  const std::string backend_help = stream.out.substr(at, stream.out.find("\n  -", at) - at);
  EXPECT_THAT(backend_help, HasSubstr("auto"));
  const nlohmann::json listing = nlohmann::json::parse(read_file(path));
  ASSERT_GE(listing["backends"].size(), 4u);  // fake, host, cuda, opencl
  for (const nlohmann::json& backend : listing["backends"]) {
    EXPECT_THAT(backend_help, HasSubstr(backend["name"].get<std::string>())) << backend_help;
  }

  const CliRun version = run_cli({"--version"});
  EXPECT_EQ(version.exit_code, 0) << describe(version);
  EXPECT_THAT(version.out, HasSubstr("devbridge "));
}

TEST(Info, ListsTheBackendsAndDescribesTheAvailableOnes) {
  const CliRun run = run_cli({"info"});
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  EXPECT_THAT(run.out, HasSubstr("host"));
  EXPECT_THAT(run.out, HasSubstr("fake"));
  EXPECT_THAT(run.out, HasSubstr("device string  CPU"));
  EXPECT_THAT(run.out, HasSubstr("(auto)"));
  EXPECT_THAT(run.out, HasSubstr("caching pool   off by default"));
  EXPECT_EQ(run.err, "");
}

TEST(Info, JsonMatchesTheListing) {
  const std::string path = scratch_dir() + "/info.json";
  const CliRun run = run_cli({"info", "--json", path});
  ASSERT_EQ(run.exit_code, 0) << describe(run);
  const nlohmann::json info = nlohmann::json::parse(read_file(path));
  EXPECT_EQ(info["command"], "info");
  ASSERT_TRUE(info["backends"].is_array());
  bool saw_host = false;
  for (const nlohmann::json& backend : info["backends"]) {
    ASSERT_TRUE(backend.contains("name"));
    ASSERT_TRUE(backend.contains("built"));
    ASSERT_TRUE(backend.contains("available"));
    ASSERT_TRUE(backend.contains("reason"));
    if (backend["available"] == true) {
      ASSERT_TRUE(backend.contains("info")) << backend.dump();
      for (const char* field : {"vendor", "device_name", "device_string", "total_memory", "free_memory", "dtypes",
                                "host_memory_page_locked", "notes"}) {
        EXPECT_TRUE(backend["info"].contains(field)) << field;
      }
      EXPECT_FALSE(backend["info"]["dtypes"].empty());
      // Every device it can bind, each with the id --device takes.
      ASSERT_TRUE(backend["devices"].is_array() && !backend["devices"].empty()) << backend.dump();
      for (const nlohmann::json& device : backend["devices"]) {
        EXPECT_FALSE(device["device_id"].get<std::string>().empty()) << device.dump();
        EXPECT_TRUE(device["capabilities"].is_array()) << device.dump();
        EXPECT_TRUE(device.contains("pci_bus_id")) << device.dump();
      }
    } else {
      EXPECT_NE(backend["reason"], "") << backend.dump();  // says why not
    }
    if (backend["name"] == "host") {
      saw_host = true;
      EXPECT_EQ(backend["available"], true);
      EXPECT_EQ(backend["info"]["vendor"], "cpu");
      EXPECT_EQ(backend["info"]["device_string"], "CPU");
      EXPECT_THAT(backend["info"]["dtypes"].get<std::vector<std::string>>(), ::testing::Contains("float32"));
      // The pool's policy: on by default on host memory (it keeps freed blocks warm), split.
      EXPECT_EQ(backend["memory"]["caching_pool_default"], true) << backend.dump();
      EXPECT_EQ(backend["memory"]["pool_splits"], true) << backend.dump();
    }
    if (backend["name"] == "opencl" && backend["available"] == true) {
      EXPECT_EQ(backend["memory"]["caching_pool_default"], true) << backend.dump();
      EXPECT_EQ(backend["memory"]["pool_splits"], false) << backend.dump();
    }
  }
  EXPECT_TRUE(saw_host);
  EXPECT_TRUE(info["auto"].is_string());
  // A file was asked for: the listing is still printed.
  EXPECT_THAT(run.out, HasSubstr("backends in this build"));

  // With "-" the JSON is all of stdout (free memory moves between runs; the rest must not).
  const CliRun to_stdout = run_cli({"info", "--json", "-"});
  ASSERT_EQ(to_stdout.exit_code, 0) << describe(to_stdout);
  nlohmann::json again = nlohmann::json::parse(to_stdout.out);
  ASSERT_EQ(again["backends"].size(), info["backends"].size());
  for (std::size_t i = 0; i < info["backends"].size(); ++i) {
    EXPECT_EQ(again["backends"][i]["name"], info["backends"][i]["name"]);
    EXPECT_EQ(again["backends"][i]["available"], info["backends"][i]["available"]);
  }
  EXPECT_EQ(again["auto"], info["auto"]);
}

}  // namespace
}  // namespace devbridge::cli::testing
