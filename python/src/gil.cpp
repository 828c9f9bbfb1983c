#include "gil.hpp"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <new>
#include <thread>

#include <nanobind/nanobind.h>

#include "devbridge/blocking_hooks.hpp"
#include "devbridge/error.hpp"

namespace nb = nanobind;

namespace devbridge::python {

std::atomic<bool> interpreter_exit_began{false};

namespace {

// No lock on the way in or out of a call: every blocking call passes here
// twice. The hook and a thread coming back to the GIL meet as in Dekker's
// algorithm: the thread counts itself as taking the GIL back and then looks
// at the flag; the hook sets the flag and then looks at the count (both
// sequentially consistent), so at least one of them sees the other: either
// the thread parks, or the hook waits for it to be done with the GIL.
std::atomic<std::size_t> threads_released{0};     // threads in a GilReleased
std::atomic<std::size_t> threads_taking_back{0};  // let through to take the GIL back, or in a GilTaken
thread_local bool this_thread_runs_the_exit = false;

bool exit_stops_this_thread() noexcept {
  return interpreter_exit_began.load(std::memory_order_seq_cst) && !this_thread_runs_the_exit;
}

// Whether this thread may take the GIL back; if so it is counted as on its
// way there until taken_back().
bool may_take_back() noexcept {
  threads_taking_back.fetch_add(1, std::memory_order_seq_cst);
  if (!exit_stops_this_thread()) return true;
  threads_taking_back.fetch_sub(1, std::memory_order_seq_cst);
  return false;
}
void taken_back() noexcept { threads_taking_back.fetch_sub(1, std::memory_order_release); }

// The atexit hook, with the GIL. Returns whether threads are still inside
// devbridge (they will be parked, holding what their calls hold).
bool hold_back() {
  this_thread_runs_the_exit = true;
  interpreter_exit_began.store(true, std::memory_order_seq_cst);
  // Let those already on their way to the GIL, or running a callback with
  // it, finish with it before the interpreter begins to finalize. Bounded:
  // the exit must not hang. Polled: this runs once, at exit, and a
  // condition variable would put a lock back on every call's way out.
  PyThreadState* state = PyEval_SaveThread();
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (threads_taking_back.load(std::memory_order_seq_cst) != 0 && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const bool inside = threads_released.load() != 0 || threads_taking_back.load() != 0;
  PyEval_RestoreThread(state);
  return inside;
}

[[noreturn]] void park_for_good() noexcept {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// What a parked thread's call, or a daemon thread's frames, hold stays alive
// to the end: held, not leaked, so nanobind's leak report at exit (which
// calls it a reference counting bug) would mislead.
void objects_stay_held() { nb::set_leak_warnings(false); }

}  // namespace

void exit_gate_starts_afresh() noexcept {
  threads_released.store(0, std::memory_order_relaxed);
  threads_taking_back.store(0, std::memory_order_relaxed);
}

void stop_at_exit_door() noexcept {
  if (!exit_stops_this_thread()) return;  // the thread that exits the interpreter goes on
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
  threads_released.fetch_add(1, std::memory_order_relaxed);
  state_ = PyEval_SaveThread();
}

GilReleased::~GilReleased() {
  if (!may_take_back()) park_for_good();  // still counted as released: its call holds what it holds
  PyEval_RestoreThread(state_);
  threads_released.fetch_sub(1, std::memory_order_relaxed);
  taken_back();
}

GilTaken::GilTaken() {
  if (!may_take_back())
    throw Error(ErrorKind::Unavailable, "the Python interpreter is exiting: the call ends without its callback");
  state_ = PyGILState_Ensure();
}

GilTaken::~GilTaken() {
  PyGILState_Release(state_);
  taken_back();
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

namespace {

// BlockingHooks: the GIL let go around every sleep inside the bridge. A call
// blocked there with it (an alloc waiting for a restart) held up the
// checkpoint writer the restart itself was waiting for, and the process
// stopped for good. Not once the interpreter is exiting: a parked thread
// must not be one that holds the bridge's lock (the bridge drops it only
// after this returns).
void* release_gil_for_a_sleep() noexcept {
  if (interpreter_exiting() || !PyGILState_Check()) return nullptr;
  return new (std::nothrow) GilReleased();
}

void take_gil_back_after_a_sleep(void* released) noexcept { delete static_cast<GilReleased*>(released); }

}  // namespace

void let_go_of_the_gil_while_the_bridge_sleeps() {
  set_blocking_hooks(BlockingHooks{&release_gil_for_a_sleep, &take_gil_back_after_a_sleep});
}

void hold_threads_back_at_exit() {
  nb::module_::import_("atexit").attr("register")(nb::cpp_function([] {
    if (hold_back() || daemon_threads_run()) objects_stay_held();
  }));
}

}  // namespace devbridge::python
