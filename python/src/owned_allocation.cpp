// _OwnedAllocation (owned_allocation.hpp): an allocation the staging layer
// gets from C++ already owned, so no exception between the call's return and
// the DeviceTensor that keeps it can leak it.
#include "owned_allocation.hpp"

#include <string>

#include <nanobind/nanobind.h>

#include "devbridge/wait_check.hpp"
#include "arguments.hpp"
#include "bindings.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {

void OwnedAllocation::release() {
  if (!std::exchange(owned, false) || !state) return;
  state->open().release(handle);
  reap_released_regions(*state);  // an adopted allocation may have held the last use of a region
}

void OwnedAllocation::let_go() noexcept {
  if (!std::exchange(owned, false) || !state) return;
  BridgeState& s = *state;
  if (s.closed.load(std::memory_order_acquire) || s.inherited_by_fork() || interpreter_exiting()) return;
  const NoWaitForRestart finalizing;  // the collector may run this on a thread a restart waits for
  try {
    s.bridge->release(handle);
  } catch (...) {
    return;  // a restart retired it already (OldGenerationHandle), the bridge closed meanwhile, ...
  }
  if (PyGILState_Check() != 0) {
    try {
      reap_released_regions(s);
    } catch (...) {
    }
  }
}

nb::object owned_allocation(std::shared_ptr<BridgeState> state, DeviceHandle handle) {
  OwnedAllocation owner(std::move(state), handle);  // releases it if the object below cannot be made
  return nb::cast(std::move(owner), nb::rv_policy::move);
}

void bind_owned_allocation(nb::module_& m) {
  nb::class_<OwnedAllocation>(
      m, "_OwnedAllocation",
      "A device allocation a call made for the staging layer, owned from the moment the call returns: dropping\n"
      "this object releases it (Bridge.release: freed once no copy, step or view uses it) unless release() ran\n"
      "first. What a DeviceTensor keeps, so that an exception (Ctrl-C) between the call and the tensor leaks\n"
      "nothing.")
      .def_prop_ro("handle", [](const OwnedAllocation& o) { return o.handle; })
      .def_prop_ro("owned", [](const OwnedAllocation& o) { return o.owned; },
                   "False once release() ran (or the object was dropped).")
      .def("release", &OwnedAllocation::release,
           "Releases the allocation (Bridge.release) once; later calls do nothing. Raises the bridge's error "
           "(Closed, OldGenerationHandle); the allocation is no longer owned either way.")
      .def("__repr__", [](const OwnedAllocation& o) {
        return "_OwnedAllocation(" + handle_repr(o.handle) + (o.owned ? ")" : ", released)");
      });

  m.def(
      "_alloc_owned",
      [](nb::handle bridge, const ObjectSpec& spec, nb::handle extent) {
        auto state = state_of(bridge, "bridge");
        const DeviceHandle handle = state->open().alloc_device(spec, args::integer<std::uint64_t>(extent, "extent"));
        return owned_allocation(std::move(state), handle);
      },
      "bridge"_a, "spec"_a, "extent"_a, "Bridge.alloc, the allocation returned as an _OwnedAllocation.");
  m.def(
      "_alloc_into",
      [](nb::handle bridge, const ObjectSpec& spec, nb::handle extent, nb::list into) {
        auto state = state_of(bridge, "bridge");
        const DeviceHandle handle = state->open().alloc_device(spec, args::integer<std::uint64_t>(extent, "extent"));
        OwnedAllocation owner(std::move(state), handle);  // until the list holds it
        into.append(nb::cast(handle));
        owner.owned = false;
      },
      "bridge"_a, "spec"_a, "extent"_a, "into"_a,
      "Bridge.alloc, the handle appended to `into` in the same call (a list that owns what it holds, as a\n"
      "Prefetcher slot's): no exception between the allocation and the list can leak it.");
  m.def(
      "_adopt_owned",
      [](nb::handle bridge, nb::handle range, const ObjectSpec& spec) {
        auto state = state_of(bridge, "bridge");
        const DeviceHandle handle = adopt_host(state, range, spec);
        return owned_allocation(std::move(state), handle);
      },
      "bridge"_a, "range"_a, "spec"_a, "Bridge.adopt_host, the allocation returned as an _OwnedAllocation.");
  m.def(
      "_without_waiting_for_a_restart",
      [](nb::callable call) {
        const NoWaitForRestart finalizing;
        return call();
      },
      "call"_a,
      "call() with every bridge call it makes that would wait for a restart in progress refused at once\n"
      "(OldGenerationHandle) instead: for finalizers, which the collector runs on whatever thread allocates,\n"
      "a thread the restart waits for included.");
}

}  // namespace devbridge::python
