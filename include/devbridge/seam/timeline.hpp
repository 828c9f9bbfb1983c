// The seam's timeline group: queues, the fences that mark points on them, a
// consumer's queue made to wait, and quiesce, which finishes everything.
//
// A backend runs work on queues; each runs its work in order. The bridge
// never frees memory on the word of a host call alone: a use that ends on a
// queue (a launch, a consumer's step, a consumer reading a view) ends at a
// fence recorded on that queue, and the memory waits in the bridge's drop
// queue until the fence passes (docs/ARCHITECTURE.md, "Lifetimes on the
// device").
//
// Threading: record_fence, fence_passed, wait_fence and release_fence come
// from many client threads at once, never for the same fence concurrently
// with its release; quiesce from restart and close. A backend must be safe
// under that.
//
// Errors: devbridge::Error naming the vendor error; fatal() when the device
// is unusable (the bridge turns Broken until restart, and keeps the memory a
// fence it cannot answer for guarded). release_fence is noexcept.
#pragma once

#include <chrono>
#include <cstdint>

#include "devbridge/seam/unsupported.hpp"

namespace devbridge {

enum class Queue : std::uint8_t {
  CopyUp,    // host ring -> device copies
  CopyDown,  // device -> host ring copies
  Compute,   // the built-in compute role (launch_axpy)
  Consumer,  // a queue of someone else's, handed in (QueueRef::consumer)
};

// Where a fence goes: one of the backend's own queues, or a consumer's queue
// in the backend's numbering (CUDA: a CUstream, 1 the legacy default stream,
// 2 the per-thread one; OpenCL: a cl_command_queue).
struct QueueRef {
  Queue queue = Queue::Compute;
  std::uintptr_t consumer = 0;  // Queue::Consumer only
  bool operator==(const QueueRef&) const = default;
};

// A point on a queue, owned by the backend: it passes once everything
// enqueued there before it has finished. The bridge tests it, may wait on
// it, and gives it back exactly once (release_fence). The zero fence has
// already passed: work that finished before its call returned gets it, and
// the backend is never asked about it.
struct Fence {
  std::uintptr_t token = 0;
  bool pending() const noexcept { return token != 0; }
};

class Timeline {
 public:
  // Records a fence after everything enqueued on `where` so far.
  // Queue::Consumer is optional (BackendCapabilities::consumer_queues):
  // Error(Unsupported) from a backend whose consumers have no queues (host
  // memory: a CPU consumer is done when its call returns).
  virtual Fence record_fence(const QueueRef& where) = 0;
  // True once the fence passed; also true when the work before it failed
  // and nothing of it runs any more. Never blocks. A fault that leaves the
  // device's state unknown throws (fatal); the bridge then keeps the memory.
  virtual bool fence_passed(Fence fence) = 0;
  // Blocks until the fence passed (true) or `timeout` went by (false).
  virtual bool wait_fence(Fence fence, std::chrono::nanoseconds timeout) = 0;
  // The bridge will not ask about the fence again.
  virtual void release_fence(Fence fence) noexcept = 0;

  // Makes a consumer's queue wait, on the device and without blocking the
  // host, for everything submitted so far (DLPack's `stream` argument).
  // `queue` in the backend's numbering (CUDA: a CUstream; 1 the legacy
  // default stream, 2 the per-thread one). Optional: Error(Unsupported)
  // unless the backend overrides it (CUDA, OpenCL).
  virtual void order_consumer_queue(std::uintptr_t /*queue*/) { seam::unsupported("consumer queues"); }

  // Finish or cancel everything in flight on the backend's own queues
  // (copies and launches). Afterwards nothing the backend was given touches
  // memory and every fence on its own queues has passed; completions of that
  // work may still be drained. A consumer's queue is not the backend's to
  // finish: its fences pass when the consumer's work does.
  virtual void quiesce() = 0;

  // The bridge closed (after a quiesce() that succeeded): its own queues get
  // nothing more. A backend lets go of what runs them (the host backend's
  // copy threads), so a closed bridge holds no thread while its object
  // lives on. Fences recorded so far still answer; memory, imports and
  // consumer queues stay until the bridge frees or releases them (a view
  // may outlive the close).
  virtual void stop_queues() noexcept {}

 protected:
  ~Timeline() = default;  // a backend is deleted through Backend
};

}  // namespace devbridge
