#include "devbridge/wait_check.hpp"

namespace devbridge {
namespace {
thread_local WaitCheck* t_wait_check = nullptr;
thread_local bool t_no_wait_for_restart = false;
}  // namespace

NoWaitForRestart::NoWaitForRestart() noexcept : outer_(t_no_wait_for_restart) { t_no_wait_for_restart = true; }
NoWaitForRestart::~NoWaitForRestart() { t_no_wait_for_restart = outer_; }
bool NoWaitForRestart::active() noexcept { return t_no_wait_for_restart; }

WaitCheck::WaitCheck(std::function<void()> check, std::chrono::nanoseconds every)
    : check_(std::move(check)), every_(every), next_(std::chrono::steady_clock::now() + every), outer_(t_wait_check) {
  t_wait_check = this;
}

WaitCheck::~WaitCheck() { t_wait_check = outer_; }

WaitCheck* WaitCheck::current() noexcept { return t_wait_check; }

void WaitCheck::look(std::chrono::steady_clock::time_point now) {
  if (now < next_) return;
  next_ = now + every_;
  check_();
}

}  // namespace devbridge
