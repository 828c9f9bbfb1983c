#include "cli_process.hpp"

#include <fcntl.h>
#include <pty.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace devbridge::cli::testing {
namespace {

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

// Reads the master side of a pty until the child's side is closed (EIO).
std::string drain_terminal(int master) {
  std::string text;
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(master, buffer, sizeof buffer);
    if (n > 0) {
      text.append(buffer, static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return text;
    }
  }
}

}  // namespace

std::string scratch_dir() {
  static const std::string dir = [] {
    const auto path = std::filesystem::temp_directory_path() /
                      ("devbridge-cli-test-" + std::to_string(::getpid()));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
    return path.string();
  }();
  return dir;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

CliRun run_cli(const std::vector<std::string>& args, Stderr stderr_kind) {
  static int run_number = 0;
  const std::string base = scratch_dir() + "/run" + std::to_string(++run_number);
  const std::string out_path = base + ".out";
  const std::string err_path = base + ".err";

  std::vector<std::string> argv_text{DEVBRIDGE_CLI_PATH};
  argv_text.insert(argv_text.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_text) argv.push_back(a.data());
  argv.push_back(nullptr);

  int master = -1;
  int slave = -1;
  if (stderr_kind == Stderr::Terminal && ::openpty(&master, &slave, nullptr, nullptr, nullptr) != 0) {
    throw std::runtime_error(errno_text("openpty"));
  }

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (stderr_kind == Stderr::Terminal) {
    posix_spawn_file_actions_adddup2(&actions, slave, STDERR_FILENO);
    posix_spawn_file_actions_addclose(&actions, master);
  } else {
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  pid_t pid = 0;
  const int spawned = ::posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (slave >= 0) ::close(slave);  // only the child holds the terminal now
  if (spawned != 0) {
    if (master >= 0) ::close(master);
    errno = spawned;
    throw std::runtime_error(errno_text("posix_spawn " DEVBRIDGE_CLI_PATH));
  }

  CliRun run;
  if (master >= 0) {
    run.err = drain_terminal(master);
    ::close(master);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw std::runtime_error(errno_text("waitpid"));
  }
  if (WIFEXITED(status)) run.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) run.signal = WTERMSIG(status);
  run.out = read_file(out_path);
  if (stderr_kind == Stderr::File) run.err = read_file(err_path);
  return run;
}

}  // namespace devbridge::cli::testing
