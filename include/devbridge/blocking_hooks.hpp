// What a host runtime that holds a lock of its own while calling into the
// bridge (Python's GIL) has the bridge do around its sleeps.
//
// A call that sleeps inside the bridge (waiting for a restart to finish, for
// ring room, for a copy) while holding such a lock can deadlock the process:
// the restart it waits for may itself wait for a callback (a checkpoint's
// writer) that needs that lock. With hooks set, the bridge calls `release`
// before every sleep and `reacquire` after it, its own lock dropped first, so
// no thread ever sleeps in the bridge holding the runtime's lock.
#pragma once

namespace devbridge {

struct BlockingHooks {
  // Lets the runtime's lock go if this thread holds it; returns what
  // `reacquire` needs, or nullptr when there was nothing to let go.
  void* (*release)() = nullptr;
  // Takes it back (called only with what `release` returned, never nullptr).
  void (*reacquire)(void* released) = nullptr;
};

// Process-wide; set once, before any bridge sleeps (a module's init).
void set_blocking_hooks(BlockingHooks hooks) noexcept;

}  // namespace devbridge
