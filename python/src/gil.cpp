#include "gil.hpp"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>

#include <nanobind/nanobind.h>

#include "devbridge/error.hpp"

namespace nb = nanobind;

namespace devbridge::python {

std::atomic<bool> interpreter_exit_began{false};

namespace {

class ExitGate {
 public:
  void count_released() {
    std::lock_guard guard(mutex_);
    ++released_;
  }
  // Whether this thread may take the GIL back; if so it is counted as on its
  // way there until taken_back().
  bool may_take_back(bool was_released) {
    std::lock_guard guard(mutex_);
    if (was_released) --released_;
    if (exiting_ && std::this_thread::get_id() != exiting_thread_) return false;
    ++taking_back_;
    return true;
  }
  void taken_back() {
    std::lock_guard guard(mutex_);
    if (--taking_back_ == 0) none_taking_back_.notify_all();
  }
  bool exiting() {
    std::lock_guard guard(mutex_);
    return exiting_ && std::this_thread::get_id() != exiting_thread_;
  }

  // The atexit hook, with the GIL. Returns whether threads are still inside
  // devbridge (they will be parked, holding what their calls hold).
  bool hold_back() {
    std::unique_lock lock(mutex_);
    exiting_ = true;
    exiting_thread_ = std::this_thread::get_id();
    interpreter_exit_began.store(true, std::memory_order_relaxed);
    // Let those already on their way to the GIL, or running a callback with
    // it, finish with it before the interpreter begins to finalize. Bounded:
    // the exit must not hang.
    PyThreadState* state = PyEval_SaveThread();
    none_taking_back_.wait_for(lock, std::chrono::seconds(10), [&] { return taking_back_ == 0; });
    const bool inside = released_ != 0 || taking_back_ != 0;
    lock.unlock();
    PyEval_RestoreThread(state);
    return inside;
  }

 private:
  std::mutex mutex_;
  std::condition_variable none_taking_back_;
  bool exiting_ = false;
  std::thread::id exiting_thread_;
  std::size_t released_ = 0;     // threads in a GilReleased
  std::size_t taking_back_ = 0;  // threads let through to take the GIL back, or in a GilTaken
};

// Never destroyed: threads parked or still working outlive static destruction.
// A forked child gets a fresh one: the parent's threads, their counts, and
// a mutex one of them may have held at the fork, stay in the parent.
std::atomic<ExitGate*> g_exit_gate{new ExitGate};
ExitGate& exit_gate() { return *g_exit_gate.load(std::memory_order_acquire); }

[[noreturn]] void park_for_good() noexcept {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// What a parked thread's call, or a daemon thread's frames, hold stays alive
// to the end: held, not leaked, so nanobind's leak report at exit (which
// calls it a reference counting bug) would mislead.
void objects_stay_held() { nb::set_leak_warnings(false); }

}  // namespace

void stop_at_exit_door() noexcept {
  if (!exit_gate().exiting()) return;  // the thread that exits the interpreter goes on
  // Without the GIL (a door inside a call that let it go) nanobind may not
  // be touched; the hook has turned its leak report off by then.
  if (PyGILState_Check()) {
    objects_stay_held();
    PyEval_SaveThread();
  }
  park_for_good();
}

GilReleased::GilReleased() noexcept {
  if (interpreter_exiting()) stop_at_exit_door();
  exit_gate().count_released();
  state_ = PyEval_SaveThread();
}

GilReleased::~GilReleased() {
  if (!exit_gate().may_take_back(true)) park_for_good();
  PyEval_RestoreThread(state_);
  exit_gate().taken_back();
}

GilTaken::GilTaken() {
  if (!exit_gate().may_take_back(false))
    throw Error(ErrorKind::Unavailable, "the Python interpreter is exiting: the call ends without its callback");
  state_ = PyGILState_Ensure();
}

GilTaken::~GilTaken() {
  PyGILState_Release(state_);
  exit_gate().taken_back();
}

// A daemon thread still running holds what its frames hold to the end (the
// interpreter never unwinds it), whether or not it is inside devbridge.
bool daemon_threads_run() {
  const nb::object threading = nb::module_::import_("threading");
  const nb::object current = threading.attr("current_thread")();
  for (nb::handle thread : threading.attr("enumerate")())
    if (!thread.is(current) && nb::cast<bool>(thread.attr("daemon")) && nb::cast<bool>(thread.attr("is_alive")()))
      return true;
  return false;
}

void hold_threads_back_at_exit() {
  static const int registered =
      ::pthread_atfork(nullptr, nullptr, [] { g_exit_gate.store(new ExitGate, std::memory_order_release); });
  (void)registered;
  nb::module_::import_("atexit").attr("register")(nb::cpp_function([] {
    if (exit_gate().hold_back() || daemon_threads_run()) objects_stay_held();
  }));
}

}  // namespace devbridge::python
