#include "progress.hpp"

#include <unistd.h>

#include <cstdio>
#include <string>

#include <fmt/format.h>

#include "sizes.hpp"
#include "stderr_print.hpp"

namespace devbridge::cli {

Progress::Progress(std::uint64_t total_bytes, bool enabled) : enabled_(enabled), total_bytes_(total_bytes) {}

bool Progress::stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

void Progress::start(std::uint64_t total_bytes) {
  std::lock_guard lock(mutex_);
  total_bytes_ = total_bytes;
  started_ = std::chrono::steady_clock::now();
  last_draw_ = {};
}

void Progress::update(std::uint64_t done_bytes) {
  if (!enabled_) return;
  std::lock_guard lock(mutex_);
  const auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < std::chrono::milliseconds(100) && done_bytes < total_bytes_) return;
  draw(done_bytes, now);
}

void Progress::draw(std::uint64_t done_bytes, std::chrono::steady_clock::time_point now) {
  last_draw_ = now;
  constexpr int kWidth = 30;
  const double fraction =
      total_bytes_ == 0 ? 1.0 : static_cast<double>(done_bytes) / static_cast<double>(total_bytes_);
  const int filled = static_cast<int>(fraction * kWidth);
  const double seconds = std::chrono::duration<double>(now - started_).count();
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.append(static_cast<std::size_t>(kWidth - filled), '.');
  // \r and erase-to-end-of-line: the bar overwrites itself in place.
  print_stderr("\r\x1b[K[{}] {:3.0f}%  {} / {}  {:.2f} GB/s", bar, fraction * 100.0, format_bytes(done_bytes),
             format_bytes(total_bytes_), gigabytes_per_second(done_bytes, seconds));
  std::fflush(stderr);
  drawn_ = true;
}

void Progress::finish() {
  if (!enabled_) return;
  std::lock_guard lock(mutex_);
  if (drawn_) {
    print_stderr("\r\x1b[K");
    std::fflush(stderr);
  }
  drawn_ = false;
}

}  // namespace devbridge::cli
