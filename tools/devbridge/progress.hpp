// A one-line progress bar on stderr, drawn only when stderr is a terminal, so
// logs and pipes never receive carriage returns.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>

namespace devbridge::cli {

class Progress {
 public:
  // Disabled: every call is a no-op.
  Progress() = default;
  Progress(std::uint64_t total_bytes, bool enabled);

  // True when stderr is a terminal (and so a bar may be drawn).
  static bool stderr_is_terminal();

  void start(std::uint64_t total_bytes);
  // `done_bytes` verified so far; redrawn at most ten times a second.
  void update(std::uint64_t done_bytes);
  // Erases the bar.
  void finish();

 private:
  void draw(std::uint64_t done_bytes, std::chrono::steady_clock::time_point now);

  std::mutex mutex_;
  bool enabled_ = false;
  bool drawn_ = false;
  std::uint64_t total_bytes_ = 0;
  std::chrono::steady_clock::time_point started_{};
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace devbridge::cli
