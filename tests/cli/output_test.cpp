// The files and the stdout the commands write: a page or report replaced
// whole or not at all, outputs checked (and refused) before anything runs
// where they cannot work at the end, a stdout that took nothing reported, a
// stop signal leaving no temporary file, and traces too large to read.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
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
using ::testing::Not;
using ::testing::StartsWith;

std::size_t line_count(const std::string& text) {
  return static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n'));
}

// A directory of its own for one test's files.
std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(scratch_dir()) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::vector<std::string> entries(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A trace of a small stream, written by `stream --trace`.
std::string small_trace(const std::filesystem::path& path) {
  const CliRun run =
      run_cli({"stream", "--backend", "fake", "--bytes", "64KiB", "--chunk", "16KiB", "-q", "--trace", path.string()});
  EXPECT_EQ(run.exit_code, 0) << describe(run);
  return path.string();
}

// ---- trace view -o: the page replaced whole or not at all --------------------

// The page used to be written in place (truncated, then written): a write that
// failed part way (a full disk; here the file size limit) destroyed the old
// page and left a part of the new one, exit 1.
TEST(TraceViewPage, AFailedWriteKeepsTheOldPageAndLeavesNoPartialFile) {
  const std::filesystem::path dir = fresh_dir("page-write-fails");
  const std::string trace = small_trace(std::filesystem::path(scratch_dir()) / "page-write-fails.trace.json");
  const std::filesystem::path page = dir / "page.html";
  const std::string previous = "<html>the previous page</html>\n";
  std::ofstream(page) << previous;

  // The page is the trace (tens of KiB) and the template: more than 16 KiB.
  // With SIGXFSZ ignored (`trap '' XFSZ; ulimit -f`), and at its default (a
  // plain `ulimit -f`), which killed the command with the temporary left.
  for (const bool default_sigxfsz : {false, true}) {
    ChildSetup limited;
    limited.file_size_limit = 16 << 10;
    limited.default_sigxfsz = default_sigxfsz;
    const CliRun run = run_cli_with({"trace", "view", trace, "-o", page.string()}, limited);
    EXPECT_EQ(run.exit_code, 1) << describe(run);
    EXPECT_EQ(run.signal, 0) << describe(run);
    EXPECT_THAT(run.err, StartsWith("devbridge trace view: -o: cannot write '" + page.string() + "': "))
        << describe(run);
    EXPECT_THAT(run.err, HasSubstr(std::strerror(EFBIG))) << describe(run);
    EXPECT_EQ(line_count(run.err), 1u) << describe(run);
    EXPECT_EQ(run.out, "") << describe(run);
    EXPECT_EQ(read_file(page.string()), previous);
    EXPECT_EQ(entries(dir), std::vector<std::string>{"page.html"});  // no temporary left
  }

  // Written whole, it replaces the old page.
  const CliRun whole = run_cli({"trace", "view", trace, "-o", page.string()});
  ASSERT_EQ(whole.exit_code, 0) << describe(whole);
  EXPECT_THAT(read_file(page.string()), StartsWith("<!DOCTYPE html>"));
  EXPECT_EQ(entries(dir), std::vector<std::string>{"page.html"});
}

// ---- one file under two names ---------------------------------------------------

// A link whose target does not exist yet names the file it would make:
// `--json link --trace target` was accepted, the report replaced the trace, exit 0.
TEST(OutputsNamingOneFile, ADanglingLinkToTheOtherOutputIsRefused) {
  const std::filesystem::path dir = fresh_dir("dangling-link");
  const std::filesystem::path target = dir / "target.json";
  const std::filesystem::path link = dir / "link.json";
  std::filesystem::create_symlink(target.filename(), link);
  for (const auto& [json, trace] : {std::pair{link, target}, std::pair{target, link}}) {
    const CliRun run = run_cli(
        {"stream", "--backend", "fake", "--bytes", "4096", "--json", json.string(), "--trace", trace.string()});
    EXPECT_EQ(run.exit_code, 2) << json << " " << trace << "\n" << describe(run);
    EXPECT_THAT(run.err, StartsWith("devbridge: --json: '" + json.string() + "' is the --trace file")) << describe(run);
    EXPECT_EQ(line_count(run.err), 1u) << describe(run);
    EXPECT_EQ(run.out, "") << describe(run);
    EXPECT_FALSE(std::filesystem::exists(target));  // nothing ran
  }
}

// ---- outputs written at the end of a run -----------------------------------------

// A FIFO opened when the run ends blocks until a reader comes: with none the
// finished command hung, and SIGINT/SIGTERM could not stop it. Refused up front.
TEST(EndOfRunOutputs, AFifoIsRefusedBeforeAnythingRuns) {
  const std::filesystem::path dir = fresh_dir("fifo-output");
  const std::string fifo = (dir / "out.fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const std::string trace = small_trace(dir / "input.trace.json");
  for (const auto& [option, args] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"--trace", {"stream", "--backend", "fake", "--bytes", "4096", "--trace", fifo}},
           {"-o", {"trace", "view", trace, "-o", fifo}}}) {
    CliProcess child(args);
    ASSERT_TRUE(child.wait(20)) << option << ": still running after 20 s, waiting for a reader of the FIFO";
    const CliRun& run = child.result();
    EXPECT_EQ(run.exit_code, 2) << describe(run);
    EXPECT_THAT(run.err, StartsWith("devbridge: " + option + ": cannot write '" + fifo + "': it is a FIFO"))
        << describe(run);
    EXPECT_THAT(run.err, HasSubstr("block after finishing")) << describe(run);
    EXPECT_EQ(line_count(run.err), 1u) << describe(run);
    EXPECT_EQ(run.out, "") << describe(run);
  }
}

// The check looked at the link's directory, not the target's, where the file
// is really replaced: the trace failed only once the whole run was done.
TEST(EndOfRunOutputs, ALinkIntoADirectoryThatCannotTakeTheFileIsRefusedBeforeAnythingRuns) {
  const std::filesystem::path dir = fresh_dir("link-into-missing-dir");
  const std::filesystem::path missing = dir / "missing-dir";
  const std::filesystem::path link = dir / "out.json";
  std::filesystem::create_symlink(missing / "out.json", link);
  const std::string trace = small_trace(dir / "input.trace.json");
  for (const auto& [option, args] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"--trace", {"stream", "--backend", "fake", "--bytes", "4096", "--trace", link.string()}},
           {"-o", {"trace", "view", trace, "-o", link.string()}}}) {
    const CliRun run = run_cli(args);
    EXPECT_EQ(run.exit_code, 2) << describe(run);
    EXPECT_EQ(run.err, "devbridge: " + option + ": cannot write '" + link.string() + "': " + missing.string() + ": " +
                           std::strerror(ENOENT) + "\n")
        << describe(run);
    EXPECT_EQ(run.out, "") << describe(run);
  }
}

// A device is written in place and needs no directory: a user who cannot
// write in /dev was refused `--trace /dev/null` ("/dev: Permission denied").
TEST(EndOfRunOutputs, DevNullTakesTheOutputOfAUserWhoCannotWriteInDev) {
  const std::string trace = small_trace(std::filesystem::path(scratch_dir()) / "dev-null-input.trace.json");
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"stream", "--backend", "fake", "--bytes", "4096", "-q", "--trace", "/dev/null"},
        std::vector<std::string>{"trace", "view", trace, "-o", "/dev/null"},
        // One device named twice: written in place, it replaces nothing.
        std::vector<std::string>{"stream", "--backend", "fake", "--bytes", "4096", "-q", "--trace", "/dev/null",
                                 "--json", "/dev/null"}}) {
    ChildSetup unprivileged;
    unprivileged.unprivileged = true;
    const CliRun run = run_cli_with(args, unprivileged);
    EXPECT_EQ(run.exit_code, 0) << args[0] << " " << args[1] << "\n" << describe(run);
    EXPECT_THAT(run.err, Not(HasSubstr("cannot write"))) << describe(run);
  }
}

// ---- a stdout that takes nothing --------------------------------------------------

// Text to a full or broken stdout used to exit 0.
TEST(Stdout, AReportThatCouldNotBeWrittenToStdoutExitsOne) {
  const std::filesystem::path dir = fresh_dir("stdout-full");
  const std::string trace = small_trace(dir / "input.trace.json");
  const std::string checkpoint = (dir / "plain.safetensors").string();
  std::ofstream(checkpoint, std::ios::binary) << std::string("\x02\0\0\0\0\0\0\0{}", 10);
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"stream", "--backend", "fake", "--bytes", "4096"},
        std::vector<std::string>{"stream", "--backend", "fake", "--bytes", "4096", "-q", "--json", "-"},
        std::vector<std::string>{"info"}, std::vector<std::string>{"info", "--json", "-"},
        std::vector<std::string>{"checkpoint", "inspect", checkpoint},
        std::vector<std::string>{"trace", "replay", trace},
        std::vector<std::string>{"trace", "view", trace, "-o", (dir / "page.html").string()},
        std::vector<std::string>{"--help"}, std::vector<std::string>{"--version"}}) {
    ChildSetup full_stdout;
    full_stdout.stdout_path = "/dev/full";
    const CliRun run = run_cli_with(args, full_stdout);
    EXPECT_EQ(run.exit_code, 1) << args[0] << "\n" << describe(run);
    EXPECT_EQ(run.signal, 0) << describe(run);
    EXPECT_EQ(run.err, std::string("devbridge: could not write the report to standard output: ") +
                           std::strerror(ENOSPC) + "\n")
        << args[0] << "\n" << describe(run);
  }
}

// A standard error that cannot be written (a full disk, a terminal gone, a
// reader that left) changes nothing but what is said there: fmt::print threw
// from the handlers that report the outcome, and the process ended in
// std::terminate (SIGABRT) with its --json report unwritten.
TEST(Stderr, AnUnwritableStandardErrorLeavesTheExitCodeAndTheReportAsTheyWere) {
  const std::filesystem::path dir = fresh_dir("stderr-full");
  const std::string report = (dir / "report.json").string();
  const std::string trace = (dir / "run.trace.json").string();
  struct Case {
    std::vector<std::string> args;
    int exit_code;
  };
  for (const Case& c : {Case{{"stream", "--backend", "fake", "--bytes", "4096", "--chunk", "1024", "-q", "--json",
                              report, "--trace", trace},
                             0},
                        Case{{"stream", "--backend", "fake", "--bytes", "3"}, 2},
                        Case{{"stream", "--backend", "fake", "--bytes", "4096", "--chunk", "1024", "--fake-inject",
                              "copy_h2d:copy_failed_at_submit:2"},
                             1},
                        Case{{"checkpoint", "inspect", (dir / "missing.safetensors").string()}, 1},
                        Case{{"trace", "view", (dir / "missing.json").string(), "-o", (dir / "p.html").string()}, 1},
                        Case{{"strem"}, 2}}) {
    ChildSetup full_stderr;
    full_stderr.stderr_path = "/dev/full";
    const CliRun run = run_cli_with(c.args, full_stderr);
    EXPECT_EQ(run.signal, 0) << c.args[0] << " " << c.args[1] << "\n" << describe(run);
    EXPECT_EQ(run.exit_code, c.exit_code) << c.args[0] << " " << c.args[1] << "\n" << describe(run);
  }
  EXPECT_EQ(nlohmann::json::parse(read_file(report))["verified"], true);
  EXPECT_TRUE(std::filesystem::exists(trace));
}

// A reader that went away (`devbridge ... --json R | head -c0`): SIGPIPE
// killed the command at its first write to stdout, before the --json report
// was written, its temporary left behind. The report is written, then the
// command ends by SIGPIPE as any other program in a pipeline would.
TEST(Stdout, AReaderThatWentAwayEndsTheCommandBySigpipeAfterItsReportIsWritten) {
  const std::filesystem::path dir = fresh_dir("stdout-reader-gone");
  const std::string checkpoint = (dir / "plain.safetensors").string();
  std::ofstream(checkpoint, std::ios::binary) << std::string("\x02\0\0\0\0\0\0\0{}", 10);
  const std::string report = (dir / "report.json").string();
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"stream", "--backend", "fake", "--bytes", "64KiB", "--chunk", "16KiB", "--json", report},
        std::vector<std::string>{"checkpoint", "inspect", checkpoint, "--json", report}}) {
    std::filesystem::remove(report);
    ChildSetup gone;
    gone.stdout_reader_gone = true;
    const CliRun run = run_cli_with(args, gone);
    EXPECT_EQ(run.signal, SIGPIPE) << args[0] << "\n" << describe(run);
    EXPECT_EQ(run.err.find("could not write"), std::string::npos) << describe(run);
    EXPECT_THAT(read_file(report), StartsWith("{")) << args[0] << ": the report is written";
    EXPECT_EQ(entries(dir), (std::vector<std::string>{"plain.safetensors", "report.json"})) << "no temporary left";
  }
}

// ---- traces too large to read ------------------------------------------------------

// A sparse 100 GiB file: the reader reserved its whole size and died of
// "std::bad_alloc".
TEST(TraceTools, RefuseATraceLargerThanTheLimitNamingItsSize) {
  const std::filesystem::path dir = fresh_dir("huge-trace");
  const std::string huge = (dir / "huge.trace.json").string();
  std::ofstream(huge).close();
  std::filesystem::resize_file(huge, std::uint64_t{100} << 30);
  for (const std::vector<std::string>& args : {std::vector<std::string>{"trace", "replay", huge},
                                               std::vector<std::string>{"trace", "view", huge, "-o",
                                                                        (dir / "page.html").string()}}) {
    const CliRun run = run_cli(args);
    EXPECT_EQ(run.exit_code, 1) << describe(run);
    EXPECT_EQ(run.err, "devbridge trace: " + huge +
                           ": is 107374182400 bytes (100.00 GiB), larger than the 4.00 GiB a trace may be\n")
        << describe(run);
    EXPECT_EQ(run.out, "") << describe(run);
  }
  EXPECT_EQ(entries(dir), std::vector<std::string>{"huge.trace.json"});
  std::filesystem::remove(huge);  // sparse, but 100 GiB to anything that reads it
}

// Whole numbers from 2^63 up are stored unsigned: 2^64 - 1 was read as -1,
// "has no valid otherData.version".
TEST(TraceTools, AVersionOfTwoToTheSixtyFourMinusOneIsNewerThanThisDevbridgeReads) {
  const std::string path = scratch_dir() + "/version-max.trace.json";
  std::ofstream(path) << R"({"otherData": {"format": "devbridge-trace", "version": 18446744073709551615},)"
                      << R"( "traceEvents": []})";
  const CliRun run = run_cli({"trace", "replay", path});
  EXPECT_EQ(run.exit_code, 1) << describe(run);
  EXPECT_EQ(run.err, "devbridge trace: " + path +
                         ": is a version 18446744073709551615 trace; this devbridge reads version 1 and older\n")
      << describe(run);
}

// ---- stop signals leave no temporary file ------------------------------------------

// A checkpoint whose sha256 is checked over 64 GiB of data (a sparse file):
// inspecting it takes far longer than the test waits.
std::string slow_checkpoint(const std::filesystem::path& path) {
  constexpr std::uint64_t kDataBytes = std::uint64_t{64} << 30;
  const std::string header =
      R"({"__metadata__":{"format":"devbridge-checkpoint","format_version":"1","generation":"1",)"
      R"("checksum":"sha256:)" + std::string(64, '0') + R"(","dtypes":"{\"t\": \"uint8\"}"},)"
      R"("t":{"dtype":"U8","shape":[)" + std::to_string(kDataBytes) + R"(],"data_offsets":[0,)" +
      std::to_string(kDataBytes) + "]}}";
  std::string length(8, '\0');
  for (std::size_t i = 0; i < 8; ++i) length[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  std::ofstream(path, std::ios::binary) << length << header;
  std::filesystem::resize_file(path, 8 + header.size() + kDataBytes);
  return path.string();
}

struct SignalCase {
  const char* name;
  int signal;
  int exit_code;
};

void PrintTo(const SignalCase& c, std::ostream* os) { *os << c.name; }

class InspectStoppedBySignal : public ::testing::TestWithParam<SignalCase> {};

// Only `stream` removed its report's temporary file on a stop signal: the
// other commands died of it and left `.F.<pid>.<n>.tmp` behind.
TEST_P(InspectStoppedBySignal, RemovesTheReportsTemporaryFileAndExits128PlusTheSignal) {
  const SignalCase& c = GetParam();
  const std::filesystem::path dir = fresh_dir(std::string("inspect-signal-") + c.name);
  const std::filesystem::path reports = dir / "reports";
  std::filesystem::create_directories(reports);
  const std::string checkpoint = slow_checkpoint(dir / "slow.safetensors");
  CliProcess child({"checkpoint", "inspect", checkpoint, "--json", (reports / "report.json").string()});
  // The temporary file is made once the handlers are in place.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (entries(reports).empty()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the report's temporary file never appeared";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  child.send(c.signal);
  ASSERT_TRUE(child.wait(30)) << "still running 30 s after the signal";
  const CliRun& run = child.result();
  EXPECT_EQ(run.signal, 0) << describe(run);
  EXPECT_EQ(run.exit_code, c.exit_code) << describe(run);
  EXPECT_EQ(entries(reports), std::vector<std::string>{}) << describe(run);
  std::filesystem::remove(checkpoint);  // sparse, but 64 GiB to anything that reads it
}

INSTANTIATE_TEST_SUITE_P(Checkpoint, InspectStoppedBySignal,
                         ::testing::Values(SignalCase{"Sigint", SIGINT, 130}, SignalCase{"Sigterm", SIGTERM, 143}),
                         [](const ::testing::TestParamInfo<SignalCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace devbridge::cli::testing
