// Runs the built `devbridge` binary as a child process and captures what it
// printed and how it exited, so the tests see exactly what a user sees.
#pragma once

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

// Runs DEVBRIDGE_CLI_PATH with `args`. With Stderr::Terminal the child's
// stderr is a pseudo-terminal, as in an interactive shell.
CliRun run_cli(const std::vector<std::string>& args, Stderr stderr_kind = Stderr::File);

// A fresh directory for this test process's files.
std::string scratch_dir();

std::string read_file(const std::string& path);

}  // namespace devbridge::cli::testing
