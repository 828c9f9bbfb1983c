#include "cli_process.hpp"

#include <fcntl.h>
#include <grp.h>
#include <pty.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <thread>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <map>
#include <stdexcept>

#include <nlohmann/json.hpp>

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

std::string next_output_base() {
  static int run_number = 0;
  return scratch_dir() + "/run" + std::to_string(++run_number);
}

// Waits for `pid` and records how it ended.
void reap(pid_t pid, CliRun& run) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw std::runtime_error(errno_text("waitpid"));
  }
  if (WIFEXITED(status)) run.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) run.signal = WTERMSIG(status);
}

// The child's argv: the binary under test, then `args`. The strings live in `text`.
std::vector<char*> child_argv(const std::vector<std::string>& args, std::vector<std::string>& text) {
  text = {cli_path()};
  text.insert(text.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : text) argv.push_back(a.data());
  argv.push_back(nullptr);
  return argv;
}

constexpr uid_t kNobody = 65534;
constexpr int kChildSetupFailed = 127;  // as a shell's "command not found or not run"

}  // namespace

std::string cli_path() {
  const char* override_path = std::getenv("DEVBRIDGE_CLI_UNDER_TEST");
  return override_path != nullptr && *override_path != '\0' ? override_path : DEVBRIDGE_CLI_PATH;
}

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

std::string backend_unavailable_reason(const std::string& backend) {
  static std::map<std::string, std::string> reasons;  // asked once per test process
  static bool listed = false;
  if (!listed) {
    const std::string path = scratch_dir() + "/backends.json";
    const CliRun info = run_cli({"info", "--json", path});
    if (info.exit_code != 0) throw std::runtime_error("devbridge info failed: " + info.err);
    const nlohmann::json listing = nlohmann::json::parse(read_file(path));
    for (const nlohmann::json& b : listing["backends"]) {
      reasons[b["name"].get<std::string>()] = b["available"] == true ? "" : b["reason"].get<std::string>();
    }
    listed = true;
  }
  const auto it = reasons.find(backend);
  if (it == reasons.end()) return "this build does not know the backend " + backend;
  return it->second;
}

CliRun run_cli(const std::vector<std::string>& args, Stderr stderr_kind) {
  const std::string base = next_output_base();
  const std::string out_path = base + ".out";
  const std::string err_path = base + ".err";

  std::vector<std::string> argv_text;
  std::vector<char*> argv = child_argv(args, argv_text);

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
    throw std::runtime_error(errno_text(("posix_spawn " + cli_path()).c_str()));
  }

  CliRun run;
  if (master >= 0) {
    run.err = drain_terminal(master);
    ::close(master);
  }
  reap(pid, run);
  run.out = read_file(out_path);
  if (stderr_kind == Stderr::File) run.err = read_file(err_path);
  return run;
}

// fork and exec rather than posix_spawn, which can neither change the user
// nor set a resource limit. Between the two only async-signal-safe calls.
CliRun run_cli_with(const std::vector<std::string>& args, const ChildSetup& setup) {
  const std::string base = next_output_base();
  const std::string out_path = setup.stdout_path.empty() ? base + ".out" : setup.stdout_path;
  const std::string err_path = setup.stderr_path.empty() ? base + ".err" : setup.stderr_path;
  std::vector<std::string> argv_text;
  std::vector<char*> argv = child_argv(args, argv_text);
  const bool drop_root = setup.unprivileged && ::geteuid() == 0;

  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(errno_text("fork"));
  if (pid == 0) {
    const auto redirect = [](int fd, const char* path, int flags) {
      const int opened = ::open(path, flags, 0644);
      if (opened < 0 || ::dup2(opened, fd) < 0) ::_exit(kChildSetupFailed);
      if (opened != fd) ::close(opened);
    };
    redirect(STDIN_FILENO, "/dev/null", O_RDONLY);
    if (setup.stdout_reader_gone) {
      int ends[2];
      if (::pipe(ends) != 0 || ::close(ends[0]) != 0 || ::dup2(ends[1], STDOUT_FILENO) < 0) ::_exit(kChildSetupFailed);
      ::close(ends[1]);
      ::signal(SIGPIPE, SIG_DFL);
    } else {
      redirect(STDOUT_FILENO, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC);
    }
    redirect(STDERR_FILENO, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC);
    if (setup.file_size_limit != 0) {
      ::signal(SIGXFSZ, setup.default_sigxfsz ? SIG_DFL : SIG_IGN);  // as set, it stays across exec
      const rlimit limit{setup.file_size_limit, setup.file_size_limit};
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(kChildSetupFailed);
    }
    if (drop_root && (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 || ::setuid(kNobody) != 0))
      ::_exit(kChildSetupFailed);
    ::execve(argv[0], argv.data(), environ);
    ::_exit(kChildSetupFailed);
  }
  CliRun run;
  reap(pid, run);
  if (setup.stdout_path.empty() && !setup.stdout_reader_gone) run.out = read_file(out_path);
  if (setup.stderr_path.empty()) run.err = read_file(err_path);
  return run;
}

CliProcess::CliProcess(const std::vector<std::string>& args) {
  const std::string base = next_output_base();
  out_path_ = base + ".out";
  err_path_ = base + ".err";
  std::vector<std::string> argv_text;
  std::vector<char*> argv = child_argv(args, argv_text);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  // The child starts with default signal dispositions, whatever this process has.
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGTERM);
  posix_spawnattr_setsigdefault(&attributes, &defaults);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attributes, &none);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
  pid_t pid = 0;
  const int spawned = ::posix_spawn(&pid, argv[0], &actions, &attributes, argv.data(), environ);
  posix_spawnattr_destroy(&attributes);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    errno = spawned;
    throw std::runtime_error(errno_text(("posix_spawn " + cli_path()).c_str()));
  }
  pid_ = pid;
}

CliProcess::~CliProcess() {
  if (pid_ > 0 && !reaped_) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
}

void CliProcess::send(int signal) {
  if (pid_ > 0 && !reaped_) ::kill(pid_, signal);
}

bool CliProcess::wait(double timeout_seconds) {
  if (reaped_) return true;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  int status = 0;
  for (;;) {
    const pid_t done = ::waitpid(pid_, &status, WNOHANG);
    if (done == pid_) break;
    if (done < 0 && errno != EINTR) throw std::runtime_error(errno_text("waitpid"));
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  reaped_ = true;
  if (WIFEXITED(status)) run_.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) run_.signal = WTERMSIG(status);
  run_.out = read_file(out_path_);
  run_.err = read_file(err_path_);
  return true;
}

}  // namespace devbridge::cli::testing
