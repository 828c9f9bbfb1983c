// Runs the built `devbridge` binary as a child process and captures what it
// printed and how it exited, so the tests see exactly what a user sees.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace devbridge::cli::testing {

struct CliRun {
  int exit_code = -1;  // -1 when the child did not exit normally
  int signal = 0;      // the signal that ended it, if one did
  std::string out;     // stdout
  std::string err;     // stderr
};

enum class Stderr { File, Terminal };

// The binary under test: DEVBRIDGE_CLI_PATH (the one this build made), or the
// environment's DEVBRIDGE_CLI_UNDER_TEST when set (to run the suite against
// another build, e.g. an older commit's, and see which tests it fails).
std::string cli_path();

// Runs the binary under test with `args`. With Stderr::Terminal the child's
// stderr is a pseudo-terminal, as in an interactive shell.
CliRun run_cli(const std::vector<std::string>& args, Stderr stderr_kind = Stderr::File);

// How run_cli_with() sets the child up, beyond what run_cli() does.
struct ChildSetup {
  // Where its stdout goes (e.g. /dev/full); empty: a file of the run's own,
  // read back into CliRun::out (which is otherwise empty).
  std::string stdout_path;
  // Where its stderr goes (e.g. /dev/full); empty: a file read back into
  // CliRun::err.
  std::string stderr_path;
  // As a user who cannot write in /dev: "nobody" (uid and gid 65534) when
  // the tests run as root, else the tests' own user.
  bool unprivileged = false;
  // RLIMIT_FSIZE in bytes (0: none), with SIGXFSZ ignored, as after
  // `trap '' XFSZ; ulimit -f`: a write past it fails with EFBIG. It bounds
  // the child's stdout and stderr files too.
  std::uint64_t file_size_limit = 0;
  // With file_size_limit: SIGXFSZ at its default action, as after a plain
  // `ulimit -f` (the write past the limit would end a process that keeps it).
  bool default_sigxfsz = false;
  // Its stdout a pipe whose reader is gone, SIGPIPE at its default action
  // (`devbridge ... | head -c0`); stdout_path is then not used.
  bool stdout_reader_gone = false;
};

CliRun run_cli_with(const std::vector<std::string>& args, const ChildSetup& setup);

// A child started without waiting for it, so a test can signal it mid-run.
// stdout and stderr go to files; the destructor kills (SIGKILL) and reaps a
// child still running.
class CliProcess {
 public:
  explicit CliProcess(const std::vector<std::string>& args);
  ~CliProcess();
  CliProcess(const CliProcess&) = delete;
  CliProcess& operator=(const CliProcess&) = delete;

  // Sends `signal` to the child.
  void send(int signal);
  // Waits up to `timeout_seconds` for the child to end. Returns false (and
  // leaves it running) when it did not.
  bool wait(double timeout_seconds);
  // Once wait() returned true: how it ended and what it printed.
  const CliRun& result() const { return run_; }

 private:
  int pid_ = -1;
  bool reaped_ = false;
  std::string out_path_;
  std::string err_path_;
  CliRun run_;
};

// A fresh directory for this test process's files.
std::string scratch_dir();

std::string read_file(const std::string& path);

// Why `backend` cannot run here, from `devbridge info --json` (empty when it
// can): tests of a backend that may be missing skip with this reason.
std::string backend_unavailable_reason(const std::string& backend);

// Everything a test needs to explain a failure.
inline std::string describe(const CliRun& run) {
  return "exit " + std::to_string(run.exit_code) + " signal " + std::to_string(run.signal) + "\n--- stdout\n" +
         run.out + "--- stderr\n" + run.err;
}

}  // namespace devbridge::cli::testing
