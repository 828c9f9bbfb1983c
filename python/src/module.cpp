// devbridge._devbridge: the nanobind bindings of the C++ bridge.
//
// The public Python API lives in python/devbridge/__init__.py, which
// re-exports these classes and defines the exception classes (BridgeError and
// one subclass per ErrorKind, registered back here so every devbridge::Error
// surfaces as the subclass named after its kind).
//
// One file per Python class or area, each with its bind_* function
// (bindings.hpp), so a class's binding, its argument parsing and its helpers
// read together; this file holds the module-level functions and the entry
// point.
//
// GIL: calls that can block (waits, sync copies, views that wait for copies,
// restart, close, bridge construction) release it; nothing below the
// bindings ever calls back into Python, so that is always safe (except a
// TransferPlanner's progress callback, which takes the GIL back: transfer.cpp).
// They let it go and take it back through gil.hpp's guards, never nanobind's:
// a daemon thread taking the GIL back during the interpreter's exit aborted it.
#include <string>
#include <vector>

#include <nanobind/nanobind.h>

#include "devbridge/backend.hpp"
#include "devbridge/backends.hpp"
#include "devbridge/consumer_names.hpp"
#include "devbridge/types.hpp"
#include "bindings.hpp"
#include "forks.hpp"
#include "owned_allocation.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {

nb::dict backend_info_dict(const BackendInfo& info) {
  nb::dict d;
  d["name"] = info.name;
  d["vendor"] = info.vendor;
  d["device_id"] = info.device_id;
  d["device_name"] = info.device_name;
  d["pci_bus_id"] = info.pci_bus_id;
  d["device_string"] = tinygrad_device(info.device_kind, info.device_ordinal);
  const DLPackDevice dlpack = dlpack_device(info.device_kind);
  d["dlpack_device"] = nb::make_tuple(static_cast<int>(dlpack), info.device_ordinal);
  d["dlpack_device_name"] = std::string(dlpack_device_name(dlpack));
  d["device_ordinal"] = info.device_ordinal;
  d["total_memory"] = info.total_memory;
  d["free_memory"] = info.free_memory;
  nb::list dtypes;
  for (DType dtype : info.dtypes) dtypes.append(std::string(dtype_info(dtype).name));
  d["dtypes"] = dtypes;  // held: stored, moved, checkpointed
  nb::list compute_dtypes;
  for (DType dtype : info.computed_dtypes()) compute_dtypes.append(std::string(dtype_info(dtype).name));
  d["compute_dtypes"] = compute_dtypes;
  nb::list capabilities;
  for (const std::string& capability : info.capabilities) capabilities.append(capability);
  d["capabilities"] = capabilities;
  d["host_memory_page_locked"] = info.host_memory_page_locked;
  d["host_addressable"] = info.host_addressable;
  d["cheap_registration"] = info.cheap_registration;
  d["maps_for_write"] = info.maps_for_write;
  d["notes"] = info.notes;
  return d;
}

void bind_module_functions(nb::module_& m) {
  m.def(
      "dtypes",
      [] {
        nb::list names;
        for (const DTypeInfo& info : all_dtypes()) names.append(std::string(info.name));
        return names;
      },
      "The dtype names devbridge knows, as numpy and tinygrad spell them.");
  m.def(
      "dtype_info",
      [](nb::handle dtype) {
        const DTypeInfo& info = dtype_info(parse_dtype(dtype));
        nb::dict d;
        d["name"] = std::string(info.name);
        d["tinygrad_name"] = std::string(info.tinygrad_name);
        d["itemsize"] = info.size;
        d["dlpack_code"] = static_cast<int>(info.dlpack_code);
        d["dlpack_bits"] = static_cast<int>(info.dlpack_bits);
        return d;
      },
      "dtype"_a);
  m.def(
      "list_backends",
      [] {
        nb::list out;
        for (const BackendAvailability& b : list_backends()) {
          nb::dict d;
          d["name"] = b.name;
          d["built"] = b.built;
          d["available"] = b.available;
          d["reason"] = b.reason;
          d["remedy"] = b.remedy;
          d["summary"] = describe_availability(b);
          out.append(d);
        }
        return out;
      },
      "The backends of this build: name, built, available here, why not, what to install or set so it runs "
      "(remedy), and all of that as one line (summary).");
  m.def(
      "devices",
      [](const std::string& backend) {
        std::vector<BackendInfo> found;
        {
          GilReleased no_gil;
          found = list_devices(backend);
        }
        nb::list out;
        for (const BackendInfo& info : found) out.append(backend_info_dict(info));
        return out;
      },
      "backend"_a,
      "The devices `backend` can bind, as Bridge.backend_info() describes each; its device_id is what\n"
      "Bridge(backend, device=...) takes. Empty when the backend is unavailable here.");
}

}  // namespace devbridge::python

// nanobind looks types up at call time, so no order is required; this is the
// order the module always defined its names in, kept so that nothing a caller
// sees changes; names added later come after those.
NB_MODULE(_devbridge, m) {
  using namespace devbridge::python;
  m.doc() = "devbridge: host ring <-> device memory bridge with zero-copy tensor views (C++ core bindings)";
  watch_forks();
  hold_threads_back_at_exit();
  let_go_of_the_gil_while_the_bridge_sleeps();
  bind_errors(m);
  bind_module_functions(m);
  bind_value_types(m);
  bind_ring(m);
  bind_views(m);
  bind_fake_controls(m);
  bind_copy_layout(m);
  bind_host_regions(m);
  bind_bridge(m);
  bind_checkpoint_file(m);
  bind_owned_allocation(m);  // before TransferPlanner, whose _upload_owned returns one
  bind_transfer(m);
  bind_lent_views(m);
}
