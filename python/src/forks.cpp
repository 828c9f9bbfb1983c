#include "forks.hpp"

#include <pthread.h>

#include <atomic>

#include "gil.hpp"

namespace devbridge::python {

namespace {
std::atomic<std::uint64_t> forks{0};

void in_the_child() noexcept {
  forks.fetch_add(1, std::memory_order_relaxed);
  exit_gate_starts_afresh();
}
}  // namespace

std::uint64_t forks_so_far() noexcept { return forks.load(std::memory_order_relaxed); }

void watch_forks() {
  static const int registered = ::pthread_atfork(nullptr, nullptr, in_the_child);
  (void)registered;
}

}  // namespace devbridge::python
