// The GIL, let go around blocking work and taken back after it, in a way that
// survives the interpreter's exit.
//
// Why not nanobind's guards: before Python 3.14, a thread that takes the GIL
// back once the interpreter has begun to finalize is ended with
// pthread_exit. Its forced unwind meets a frame that may not throw (the
// guard's destructor, nanobind's dispatch) and std::terminate aborts the
// process: a daemon thread inside any devbridge call at exit turned a clean
// exit into exit code 134. So the module registers an atexit hook
// (hold_threads_back_at_exit) that runs before finalization; from then on a
// thread other than the exiting one never takes the GIL back: GilReleased
// parks it for good (its call has finished; the process is ending), and
// GilTaken, used in callbacks from the middle of a call, throws instead so
// the call unwinds first. Threads already on their way back to the GIL, or
// in a callback, when the hook runs are let through before it returns.
// Not covered: a thread inside a call's own Python code at the moment the
// interpreter begins to finalize (a window of microseconds, not the blocking
// waits where busy threads spend their time).
#pragma once

#include <Python.h>

#include <atomic>

namespace devbridge::python {

// Alone, for work that runs to its end (close, restart, a register, a read).
// A bridge call that may wait for another party (room, views to end, uploads
// to land) uses InterruptibleCall (state.hpp) instead, so Ctrl-C ends it.
class GilReleased {
 public:
  GilReleased() noexcept;
  ~GilReleased();
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

// The GIL taken by a thread that may not hold it (a callback run in the
// middle of a call that released it, or on a thread of the bridge's own).
// Throws Error(Unavailable) once the interpreter is exiting.
class GilTaken {
 public:
  GilTaken();
  ~GilTaken();
  GilTaken(const GilTaken&) = delete;
  GilTaken& operator=(const GilTaken&) = delete;

 private:
  PyGILState_STATE state_;
};

// Registers the atexit hook; called once by the module.
void hold_threads_back_at_exit();

// Has the bridge let the GIL go around its sleeps (BlockingHooks); called
// once by the module.
void let_go_of_the_gil_while_the_bridge_sleeps();

// Set by the hook. A thread other than the exiting one that enters devbridge
// from then on is parked at the door (stop_at_exit_door: the GIL let go,
// never taken back), before any of the call's work: a call's own Python
// calls (a FileIO, a numpy conversion) could take the GIL back in the middle
// of C++ frames as finalization begins.
extern std::atomic<bool> interpreter_exit_began;
inline bool interpreter_exiting() noexcept { return interpreter_exit_began.load(std::memory_order_relaxed); }
void stop_at_exit_door() noexcept;

// In a forked child (forks.cpp): the parent's threads, and what the gate
// counted of them, stayed in the parent.
void exit_gate_starts_afresh() noexcept;

}  // namespace devbridge::python
