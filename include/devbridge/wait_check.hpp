// A look outside for the bridge's open-ended waits on this thread.
//
// Some calls wait with no end of their own: a view waiting for the uploads
// into its allocation, a write waiting for views of its range to end
// (writes_under_view "wait"), room for a copy in flight. While a WaitCheck
// lives on the calling thread, those waits call `check` about every `every`,
// with the bridge's lock dropped; what `check` throws ends the wait and the
// call fails with it, having taken nothing. A binding sets one around such
// calls so an interrupt (Python's Ctrl-C) ends them, as a transfer's waits
// end through TransferOptions::while_waiting.
#pragma once

#include <chrono>
#include <functional>

namespace devbridge {

class WaitCheck {
 public:
  WaitCheck(std::function<void()> check, std::chrono::nanoseconds every);
  ~WaitCheck();
  WaitCheck(const WaitCheck&) = delete;
  WaitCheck& operator=(const WaitCheck&) = delete;

  // The innermost one on this thread, or null.
  static WaitCheck* current() noexcept;
  // Calls check when `every` has passed since it was set or last called.
  void look(std::chrono::steady_clock::time_point now);

 private:
  std::function<void()> check_;
  std::chrono::nanoseconds every_;
  std::chrono::steady_clock::time_point next_;
  WaitCheck* outer_;
};

// While one lives on this thread, a call that would wait for a restart in
// progress fails at once instead, with OldGenerationHandle: the restart
// retires the generation and frees what the call would have let go. For
// code that must never block: finalizers (Python's __del__, a binding
// object's destructor), which the collector runs on whatever thread
// allocates, a thread the restart itself waits for included.
class NoWaitForRestart {
 public:
  NoWaitForRestart() noexcept;
  ~NoWaitForRestart();
  NoWaitForRestart(const NoWaitForRestart&) = delete;
  NoWaitForRestart& operator=(const NoWaitForRestart&) = delete;

  static bool active() noexcept;

 private:
  bool outer_;
};

}  // namespace devbridge
