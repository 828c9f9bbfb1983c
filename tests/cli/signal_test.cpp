// `devbridge stream` stopped from outside: SIGINT or SIGTERM ends the run
// cleanly (drain, report, summary, exit 128 + N), and the JSON report is
// written whole or not at all: a killed run never leaves a truncated file.
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cli_process.hpp"

namespace devbridge::cli::testing {
namespace {

using ::testing::HasSubstr;

// A directory of its own for one test's report.
std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(scratch_dir()) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::size_t entries(const std::filesystem::path& dir) {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

// A stream that would run for a minute or more (64 GiB); the tests stop it
// well before. Its report goes to `report`.
std::vector<std::string> long_stream(const std::filesystem::path& report) {
  return {"stream",       "--backend", "host", "--bytes", "64GiB", "--chunk", "1MiB", "--ring-bytes", "16MiB",
          "--inflight", "4",         "--json", report.string()};
}

// Waits until `count` entries are in `dir` (the stream has made its report's
// file, after installing its signal handlers), then lets it run `run_for`.
void wait_until_running(const std::filesystem::path& dir, std::size_t count, std::chrono::milliseconds run_for) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (entries(dir) < count) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the stream never created its report file";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::this_thread::sleep_for(run_for);
}

struct SignalCase {
  const char* name;
  int signal;
  int exit_code;
  const char* signal_name;
};

void PrintTo(const SignalCase& c, std::ostream* os) { *os << c.name; }

class StreamStoppedBySignal : public ::testing::TestWithParam<SignalCase> {};

TEST_P(StreamStoppedBySignal, DrainsWritesAWholeReportAndExits128PlusTheSignal) {
  const SignalCase& c = GetParam();
  const std::filesystem::path dir = fresh_dir(std::string("signal-") + c.name);
  const std::filesystem::path path = dir / "report.json";
  CliProcess child(long_stream(path));
  wait_until_running(dir, 1, std::chrono::milliseconds(500));
  child.send(c.signal);
  ASSERT_TRUE(child.wait(30)) << "still running 30 s after " << c.signal_name;
  const CliRun& run = child.result();

  ASSERT_EQ(run.signal, 0) << describe(run);  // it did not die of the signal...
  EXPECT_EQ(run.exit_code, c.exit_code) << describe(run);  // ...but says it was stopped by it
  EXPECT_THAT(run.out, HasSubstr(std::string("devbridge stream: interrupted by ") + c.signal_name)) << describe(run);
  EXPECT_EQ(run.err, "") << describe(run);  // nothing failed

  // The report is whole JSON and says what was verified before the stop.
  const std::string text = read_file(path.string());
  ASSERT_FALSE(text.empty()) << describe(run);
  const nlohmann::json report = nlohmann::json::parse(text);
  EXPECT_EQ(report["interrupted"], true);
  EXPECT_EQ(report["signal"], c.signal_name);
  EXPECT_EQ(report["verified"], false);  // not the whole stream
  EXPECT_EQ(report["errors"], nlohmann::json::array());
  const auto chunks_verified = report["chunks_verified"].get<std::uint64_t>();
  EXPECT_LT(chunks_verified, report["chunks"].get<std::uint64_t>());
  EXPECT_EQ(report["bytes_verified"].get<std::uint64_t>(), chunks_verified * (1u << 20));
  // Every chunk submitted before the stop was drained and verified: two
  // copies each, none failed, none left over.
  EXPECT_EQ(report["copies_submitted"].get<std::uint64_t>(), 2 * chunks_verified);
  EXPECT_EQ(report["copies_failed"], 0);
  EXPECT_GT(chunks_verified, 0u) << "stopped before the first chunk: the machine is very slow";
  // The temporary file the report was written through is gone.
  EXPECT_EQ(entries(dir), 1u);
}

INSTANTIATE_TEST_SUITE_P(Stream, StreamStoppedBySignal,
                         ::testing::Values(SignalCase{"Sigint", SIGINT, 130, "SIGINT"},
                                           SignalCase{"Sigterm", SIGTERM, 143, "SIGTERM"}),
                         [](const ::testing::TestParamInfo<SignalCase>& info) { return std::string(info.param.name); });

// A second signal while the first one's drain is under way ends the process
// at once, the default way; it leaves neither a report nor its temporary file.
TEST(StreamSignals, ASecondSignalEndsItAtOnceLeavingNoFile) {
  const std::filesystem::path dir = fresh_dir("second-signal");
  // The first upload's completion is lost, so the drain the first signal
  // starts waits (up to the stall timeout) however fast the machine is: the
  // second signal surely lands during it. The first signal must come once
  // that upload is in flight, not while the bridge is still being made (the
  // report file appears before it; under ThreadSanitizer opening the bridge
  // took over 300 ms, the stream stopped before its first chunk and wrote a
  // report): the stream stalls on the lost completion for 60 s, so waiting
  // longer costs nothing but the wait.
  CliProcess child({"stream", "--backend", "fake", "--bytes", "1MiB", "--chunk", "64KiB", "--inflight", "1",
                    "--fake-inject", "copy_h2d:lost_completion:1", "--stall-timeout", "60", "--json",
                    (dir / "report.json").string()});
  wait_until_running(dir, 1, std::chrono::milliseconds(1500));
  child.send(SIGINT);
  // Past the half second within which a second signal is taken for the same stop delivered twice.
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  child.send(SIGINT);
  ASSERT_TRUE(child.wait(30));
  EXPECT_EQ(child.result().signal, SIGINT) << describe(child.result());
  EXPECT_EQ(entries(dir), 0u);
}

// `timeout -s INT` signals its child and then the child's process group: the
// same stop twice within microseconds. Taken for a user insisting, it ended
// the stream before its report (or --trace) was written, one run in three.
TEST(StreamSignals, TheSameStopDeliveredTwiceAtOnceStillDrainsAndReports) {
  const std::filesystem::path dir = fresh_dir("same-stop-twice");
  const std::filesystem::path path = dir / "report.json";
  CliProcess child(long_stream(path));
  wait_until_running(dir, 1, std::chrono::milliseconds(500));
  child.send(SIGINT);
  child.send(SIGINT);
  ASSERT_TRUE(child.wait(30));
  const CliRun& run = child.result();
  ASSERT_EQ(run.signal, 0) << describe(run);
  EXPECT_EQ(run.exit_code, 130) << describe(run);
  EXPECT_EQ(nlohmann::json::parse(read_file(path.string()))["interrupted"], true);
}

// A --json FIFO is opened before the stream starts: a stop while the open
// waits for a reader ends the command. (It was opened once stops only
// drained, so the first SIGTERM was noted and the open went on waiting.)
TEST(StreamSignals, AStopWhileTheJsonFifoWaitsForAReaderEndsTheCommand) {
  const std::filesystem::path dir = fresh_dir("fifo-stop");
  const std::filesystem::path fifo = dir / "report.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  CliProcess child({"stream", "--backend", "fake", "--bytes", "4096", "--json", fifo.string()});
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  child.send(SIGTERM);
  ASSERT_TRUE(child.wait(10)) << "the first SIGTERM did not end a stream waiting for its --json FIFO's reader";
  EXPECT_EQ(child.result().exit_code, 143) << describe(child.result());
}

// Killed outright (no handler runs), the stream leaves the report's path as
// it was: it writes to a temporary file and renames it over the path only
// when the report is complete.
TEST(StreamReport, AKilledRunLeavesThePreviousReportIntact) {
  const std::filesystem::path dir = fresh_dir("killed");
  const std::filesystem::path path = dir / "report.json";
  const std::string previous = "{\"previous\": true}\n";
  std::ofstream(path) << previous;
  {
    CliProcess child(long_stream(path));
    wait_until_running(dir, 2, std::chrono::milliseconds(200));
    child.send(SIGKILL);
    ASSERT_TRUE(child.wait(30));
    EXPECT_EQ(child.result().signal, SIGKILL);
  }
  EXPECT_EQ(read_file(path.string()), previous);
}

// The path is replaced only by a complete report: a run that ends (here in
// failure) replaces it whole, through a symbolic link too (the link stays).
TEST(StreamReport, ReplacesThePreviousReportWholeAndFollowsALink) {
  const std::filesystem::path dir = fresh_dir("replace");
  const std::filesystem::path target = dir / "target.json";
  const std::filesystem::path link = dir / "link.json";
  std::ofstream(target) << "not json, the previous contents\n";
  std::filesystem::create_symlink(target.filename(), link);
  const CliRun run = run_cli({"stream", "--backend", "fake", "--bytes", "64KiB", "--chunk", "16KiB", "--fake-inject",
                              "copy_d2h:copy_failed_at_completion:2", "--json", link.string()});
  EXPECT_EQ(run.exit_code, 1) << describe(run);
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  const nlohmann::json report = nlohmann::json::parse(read_file(target.string()));
  EXPECT_EQ(report["verified"], false);
  EXPECT_EQ(report["interrupted"], false);
  EXPECT_EQ(entries(dir), 2u);  // the link and its target, no temporary left
}

}  // namespace
}  // namespace devbridge::cli::testing
