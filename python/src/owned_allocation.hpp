// devbridge._devbridge._OwnedAllocation: a device allocation a C++ call made
// for the Python layers, owned from the moment the call returns.
//
// A call that returns a bare DeviceHandle (a value that owns nothing) to
// Python code that then wraps it (a DeviceTensor) leaks the allocation when
// an exception lands between the two: CPython runs pending signal handlers
// (Ctrl-C's KeyboardInterrupt) and asynchronous exceptions at the bytecode
// boundary right after a C function returns, before its result is stored.
// So every binding that makes an allocation for the staging layer (an
// upload, submit_upload into a new allocation, import_tensor, transfer's and
// a file's destination, adopt) returns it inside one of these: whatever
// drops the object (an exception unwinding the frame that held it, a tensor
// collected) releases the allocation (Bridge::release: freed once nothing
// uses it), unless release() ran first.
#pragma once

#include <memory>
#include <utility>

#include <nanobind/nanobind.h>

#include "devbridge/types.hpp"
#include "state.hpp"

namespace devbridge::python {

struct OwnedAllocation {
  std::shared_ptr<BridgeState> state;
  DeviceHandle handle{};
  bool owned = false;  // read and changed with the GIL held

  OwnedAllocation(std::shared_ptr<BridgeState> s, DeviceHandle h) noexcept
      : state(std::move(s)), handle(h), owned(true) {}
  OwnedAllocation(OwnedAllocation&& other) noexcept
      : state(std::move(other.state)), handle(other.handle), owned(std::exchange(other.owned, false)) {}
  OwnedAllocation(const OwnedAllocation&) = delete;
  OwnedAllocation& operator=(const OwnedAllocation&) = delete;
  OwnedAllocation& operator=(OwnedAllocation&&) = delete;
  ~OwnedAllocation() { let_go(); }

  // Python's release(): the bridge's deferred free, once; the bridge's error
  // (Closed, OldGenerationHandle, ...) raised, the allocation no longer
  // owned either way. With the GIL.
  void release();
  // The destructor's: the same without raising, and nothing where the
  // bridge is closed (it freed everything), inherited by a fork or the
  // interpreter is exiting.
  void let_go() noexcept;
};

// `handle`, just made by `state`'s bridge, as an _OwnedAllocation. With the
// GIL, before anything else can run Python code: if the object cannot be
// made the allocation is released and the error raised.
nanobind::object owned_allocation(std::shared_ptr<BridgeState> state, DeviceHandle handle);

// _OwnedAllocation and the module functions that make one (_alloc_owned,
// _adopt_owned), or hand the allocation to a list that owns it (_alloc_into). Bound before TransferPlanner, whose _upload_owned /
// _submit_upload_owned return one.
void bind_owned_allocation(nanobind::module_& m);

}  // namespace devbridge::python
