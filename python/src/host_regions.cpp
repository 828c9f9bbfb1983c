// HostRegion and RegionRange: a caller's buffer (numpy array, bytearray,
// mmap) registered with the bridge as a staging source beside the ring
// (Bridge.register_host), and ranges of it that copies take where they take
// a ring range.
//
// The bindings hold the buffer export for as long as the C++ bridge may let
// the device touch the memory: the export keeps the object alive and stops
// its owner from moving or freeing the bytes (a bytearray cannot be resized,
// an mmap cannot be closed). It is let go only once the C++ region is gone:
// after an unregister, or a restart or close that succeeded (the C++ bridge
// unregistered everything then; a failed quiesce unpins nothing, so the
// export stays). A HostRegion dropped while a copy still uses it cannot be
// unregistered yet: its registration stays in the BridgeState and is retried
// at the next register_host / unregister, and at restart and close.
#include <bit>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <Python.h>
#include <nanobind/nanobind.h>

#include "devbridge/wait_check.hpp"
#include "devbridge/bridge.hpp"
#include "devbridge/types.hpp"
#include "arguments.hpp"
#include "bindings.hpp"
#include "state.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {

struct HostRegistration {
  HostRegion region;
  Py_buffer buffer{};  // the held export; buffer.obj is the registered object
  bool held = false;
  bool writable = true;
  // A Python HostRegion still owns it; false once that was dropped while a
  // copy used the region (then the state retries the unregister).
  bool owned = true;
  // Kept past a restart or close that unregistered everything else: an
  // allocation adopted from it lives on under a view.
  bool retained = false;
  // Set by the bridge's release callback (register_host's on_release) once
  // it has let go of the memory for good: from any thread, under the
  // bridge's lock, so it only records the fact; the export is ended later,
  // with the GIL (reap_dropped, and after a restart or close).
  std::shared_ptr<std::atomic<bool>> let_go = std::make_shared<std::atomic<bool>>(false);
  bool bridge_let_go() const noexcept { return let_go->load(std::memory_order_acquire); }
  std::uintptr_t address = 0;
  std::uint64_t nbytes = 0;
  std::string object_type;  // for messages once the export is gone

  // As the C++ bridge names regions, plus what was registered.
  std::string describe() const {
    char id[32];
    std::snprintf(id, sizeof id, "%#llx", static_cast<unsigned long long>(region.id));
    char where[32];
    std::snprintf(where, sizeof where, "%#llx", static_cast<unsigned long long>(address));
    return "host region {domain " + std::to_string(region.domain) + ", generation " +
           std::to_string(region.generation) + ", id " + id + "} (" + object_type + " of " + std::to_string(nbytes) +
           " bytes at " + where + (writable ? "" : ", read-only") + ")";
  }
};

namespace {

// ---- the state's registrations (all with the GIL) ----

// Ends the exports of the registrations `gone` picks and forgets them.
// PyBuffer_Release may run Python code (an exporter's release, a last
// reference's destructor) that registers or drops regions itself, so the
// list is settled before any export ends.
template <class Gone>
void release_if(BridgeState& state, Gone gone) {
  std::vector<std::shared_ptr<HostRegistration>> released, kept;
  for (auto& reg : state.registrations) (gone(*reg) ? released : kept).push_back(std::move(reg));
  state.registrations = std::move(kept);
  for (auto& reg : released) {
    if (reg->held) PyBuffer_Release(&reg->buffer);
    reg->held = false;
  }
}

void release_one(BridgeState& state, const HostRegistration& target) {
  release_if(state, [&](const HostRegistration& reg) { return &reg == &target; });
}

bool region_is_gone(const Error& error) {
  switch (error.kind()) {
    // The C++ bridge no longer knows the region: a restart (or a close
    // that succeeded) unregistered it, or another call did.
    case ErrorKind::OldGenerationHandle:
    case ErrorKind::UnknownDeviceHandle:
    case ErrorKind::ForeignDomain:
      return true;
    default:
      return false;
  }
}

enum class Unregistered { Now, AlreadyGone, AfterAdoptions, Kept };

// Unregisters without raising: for destructors and reaping. AfterAdoptions:
// allocations adopted from it still use it (read through views), and the
// bridge unregisters it after the last (its release callback says when).
// Kept: still registered (a copy uses it, the bridge is closed or broken).
Unregistered try_unregister(BridgeState& state, const HostRegistration& reg) noexcept {
  if (state.closed.load(std::memory_order_acquire) || state.inherited_by_fork()) return Unregistered::Kept;
  try {
    Bridge& bridge = *state.bridge;
    GilReleased no_gil;
    return bridge.unregister_host_after_adoptions(reg.region) ? Unregistered::Now : Unregistered::AfterAdoptions;
  } catch (const Error& error) {
    return region_is_gone(error) ? Unregistered::AlreadyGone : Unregistered::Kept;
  } catch (...) {
    return Unregistered::Kept;
  }
}

// The C++ bridge holds the region's memory no longer: retained past a
// restart or close only until the last adopted allocation in it went (its
// release callback said so).
bool retention_ended(const BridgeState&, const HostRegistration& reg) { return reg.retained && reg.bridge_let_go(); }

// Lets go of regions whose HostRegion was dropped while a copy used them,
// now that those copies may have ended, and of retained regions whose
// adoptions ended.
void reap_dropped(BridgeState& state) {
  release_if(state, [&](const HostRegistration& reg) { return retention_ended(state, reg); });
  // Owning references: the GIL is released around each unregister, and
  // another thread may settle the list meanwhile.
  std::vector<std::shared_ptr<HostRegistration>> dropped;
  for (const auto& reg : state.registrations)
    if (!reg->owned && reg->held && !reg->retained) dropped.push_back(reg);
  std::vector<const HostRegistration*> done;
  for (const auto& reg : dropped) {
    const Unregistered outcome = try_unregister(state, *reg);
    if (outcome == Unregistered::AfterAdoptions) reg->retained = true;  // let go once the callback says so
    else if (outcome != Unregistered::Kept) done.push_back(reg.get());
  }
  if (done.empty()) return;
  release_if(state, [&](const HostRegistration& reg) {
    for (const HostRegistration* d : done)
      if (d == &reg) return true;
    return false;
  });
}

// The bridge let go of a region (its release callback, on any thread, under
// the bridge's lock, perhaps without the GIL): the export is ended soon on
// the main thread, with the GIL, instead of at the next call that reaps (the
// owner may want to close its mmap meanwhile). Best effort: a full queue, or
// an interpreter shutting down, leaves it to those calls.
int run_scheduled_reap(void* scheduled) {
  const std::unique_ptr<std::weak_ptr<BridgeState>> weak(static_cast<std::weak_ptr<BridgeState>*>(scheduled));
  if (const std::shared_ptr<BridgeState> state = weak->lock()) reap_dropped(*state);
  return 0;
}

void schedule_reap(const std::weak_ptr<BridgeState>& state) noexcept {
  if (!Py_IsInitialized() || !nb::is_alive()) return;
  try {
    auto scheduled = std::make_unique<std::weak_ptr<BridgeState>>(state);
    if (Py_AddPendingCall(&run_scheduled_reap, scheduled.get()) == 0) (void)scheduled.release();
  } catch (...) {
  }
}

std::string object_type_name(nb::handle object) {
  return nb::cast<std::string>(nb::str(object.type().attr("__name__")));
}

std::string hex(std::uintptr_t value) {
  char text[32];
  std::snprintf(text, sizeof text, "%#llx", static_cast<unsigned long long>(value));
  return text;
}

std::string shape_text(const Py_buffer& view) {
  std::string text = "(";
  for (int i = 0; i < view.ndim; ++i) {
    if (i) text += ", ";
    text += std::to_string(view.shape != nullptr ? view.shape[i] : view.len / view.itemsize);
  }
  return text + (view.ndim == 1 ? ",)" : ")");
}

// ---- the Python objects ----

struct PyHostRegion {
  std::shared_ptr<BridgeState> state;
  std::shared_ptr<HostRegistration> reg;

  PyHostRegion(std::shared_ptr<BridgeState> s, std::shared_ptr<HostRegistration> r)
      : state(std::move(s)), reg(std::move(r)) {}
  PyHostRegion(PyHostRegion&&) noexcept = default;
  PyHostRegion& operator=(PyHostRegion&&) = delete;
  PyHostRegion(const PyHostRegion&) = delete;
  ~PyHostRegion() { drop(); }

  // The object goes: unregister now if no copy uses the region, else leave
  // it to the state (reap_dropped, restart, close).
  void drop() noexcept {
    if (!reg) return;
    const NoWaitForRestart finalizing;  // the collector may run this on a thread a restart waits for
    reg->owned = false;
    if (reg->held && try_unregister(*state, *reg) != Unregistered::Kept) release_one(*state, *reg);
  }

  // The region is registered in the bridge's current generation; else the
  // C++ bridge's error for it (Closed, OldGenerationHandle after a restart,
  // UnknownDeviceHandle after an unregister).
  void check_live() const {
    Bridge& bridge = state->open();
    if (!reg->held) {
      (void)bridge.region_bytes(reg->region);
      throw Error(ErrorKind::UnknownDeviceHandle, reg->describe() + " is no longer registered");
    }
  }

  void unregister() {
    if (!reg->held) {
      // Let the C++ bridge name why: its kinds are what a stale handle gets.
      state->open().unregister_host(reg->region);
      throw Error(ErrorKind::UnknownDeviceHandle, reg->describe() + " is already unregistered");
    }
    Bridge& bridge = state->open();
    try {
      GilReleased no_gil;
      bridge.unregister_host(reg->region);
    } catch (const Error& error) {
      if (region_is_gone(error)) release_one(*state, *reg);
      throw;
    }
    release_one(*state, *reg);
    reap_dropped(*state);
  }

  // `with`: ends a live registration; nothing to do once it already ended
  // (an unregister, a restart, close), as closing a view twice.
  // `propagating`: the block is ending with an exception of its own. A
  // refused unregister then must not replace it (a fatal DeviceCopyFailed
  // surfaced as the Broken that followed it); the region stays registered
  // until an unregister, a restart or close lets it go.
  void exit(bool propagating) {
    if (!reg->held || state->closed.load()) return;
    try {
      unregister();
    } catch (const Error& error) {
      if (!region_is_gone(error) && !propagating) throw;
    }
  }
};

struct PyRegionRange {
  nb::object region;  // the HostRegion
  std::shared_ptr<HostRegistration> reg;
  RegionRange range;
};

PyRegionRange make_range(nb::handle region_object, std::uint64_t offset, std::uint64_t len) {
  const PyHostRegion& region = nb::cast<const PyHostRegion&>(region_object);
  region.check_live();
  if (len == 0 || offset > region.reg->nbytes || len > region.reg->nbytes - offset)
    throw Error(ErrorKind::InvalidRange, "range [offset " + std::to_string(offset) + ", len " + std::to_string(len) +
                                             "] is outside the " + std::to_string(region.reg->nbytes) + " bytes of " +
                                             region.reg->describe() + " (or empty)");
  return PyRegionRange{nb::borrow(region_object), region.reg, RegionRange{region.reg->region, offset, len}};
}

// Registered memory moves as raw bytes: elements a buffer declares
// big-endian would reach the device byte-swapped (the contract: non-native
// byte order is converted or refused at every entry; nothing here copies).
void refuse_non_native_byte_order(const Py_buffer& view, const std::string& who, const std::string& what) {
  static_assert(std::endian::native == std::endian::little, "devbridge's devices read little-endian elements");
  if (view.format == nullptr) return;
  const std::string_view format(view.format);
  if (format.find_first_of(">!") == std::string_view::npos) return;
  args::raise(PyExc_ValueError, who + ": the " + what + "'s elements are big-endian (buffer format '" +
                                    std::string(format) +
                                    "'); copies move registered bytes as they are, so the device would read them "
                                    "byte-swapped: register a little-endian copy (a.astype(a.dtype.newbyteorder('<')))");
}

// The range (and, unless the array is one contiguous run, the layout) of a
// view into the registered object: numpy slices, memoryview slices.
nb::tuple range_of(nb::handle region_object, nb::handle array, nb::handle device_pitch_object) {
  const auto device_pitch = args::optional_integer<std::uint64_t>(device_pitch_object, "device_pitch");
  HeldBuffer buffer(array, PyBUF_RECORDS_RO, "HostRegion.range_of: array");
  const Py_buffer& view = buffer.view();
  const PyHostRegion& region = nb::cast<const PyHostRegion&>(region_object);
  region.check_live();
  const HostRegistration& reg = *region.reg;

  // The bytes the array's elements reach, whatever the signs of its strides
  // (128-bit: shapes and strides of any size cannot wrap).
  const auto start = static_cast<__int128>(reinterpret_cast<std::uintptr_t>(view.buf));
  __int128 lo = start, hi = start + view.itemsize;
  bool empty = false;
  if (view.strides == nullptr) {
    hi = start + view.len;
    empty = view.len == 0;
  } else {
    for (int i = 0; i < view.ndim; ++i) {
      if (view.shape[i] == 0) empty = true;
      const __int128 reach = static_cast<__int128>(view.shape[i] - 1) * view.strides[i];
      (reach < 0 ? lo : hi) += reach;
    }
  }
  const std::string what = object_type_name(array) + " of shape " + shape_text(view);
  refuse_non_native_byte_order(view, "HostRegion.range_of", what);
  if (empty) throw Error(ErrorKind::InvalidRange, "HostRegion.range_of: the " + what + " is empty; a copy moves at least one byte");
  const auto base = static_cast<__int128>(reg.address);
  if (lo < base || hi > base + static_cast<__int128>(reg.nbytes))
    throw Error(ErrorKind::InvalidRange,
                "HostRegion.range_of: the " + what + " at " + hex(static_cast<std::uintptr_t>(lo)) + " (" +
                    std::to_string(static_cast<long long>(hi - lo)) + " bytes) is not inside " + reg.describe() +
                    "; pass a view into the registered object");

  const auto offset = static_cast<std::uint64_t>(start - base);
  if (!device_pitch && PyBuffer_IsContiguous(&view, 'C')) {
    nb::object range = nb::cast(make_range(region_object, offset, static_cast<std::uint64_t>(view.len)));
    return nb::make_tuple(range, nb::none());
  }
  // Strided: the rows start at the first element (pitched_layout refuses
  // negative strides, so it is the lowest address) and reach the host span.
  const CopyLayout layout = buffer_layout(view, device_pitch.value_or(0));
  nb::object range = nb::cast(make_range(region_object, offset, layout_host_span(layout)));
  return nb::make_tuple(range, nb::cast(layout));
}

std::string region_repr(const PyHostRegion& r) {
  const HostRegistration& reg = *r.reg;
  return "HostRegion(domain=" + std::to_string(reg.region.domain) + ", generation=" +
         std::to_string(reg.region.generation) + ", id=" + std::to_string(reg.region.id) +
         ", nbytes=" + std::to_string(reg.nbytes) + ", obj=" + reg.object_type +
         (reg.writable ? "" : ", writable=False") + (reg.held ? "" : ", unregistered") + ")";
}

std::size_t hash_range(const RegionRange& r) {
  std::uint64_t h = r.region.domain * 0x9E3779B97F4A7C15ull;
  for (std::uint64_t v : {r.region.generation, r.region.id, r.offset, r.len})
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return static_cast<std::size_t>(h);
}

}  // namespace

BridgeState::~BridgeState() {
  if (inherited_by_fork()) {
    // The parent's bridge: its threads and device context are not here, and
    // tearing it down would join threads this process does not have.
    for (auto& reg : registrations) reg->held = false;
    (void)bridge.release();  // leaked on purpose: the process's memory, not the device's
    return;
  }
  if (!registrations.empty()) {
    // Only a close that succeeded unpins: then the exports may end. Without
    // the GIL (never expected) or after a failed close they are kept for
    // good: the device may still use the memory.
    bool closed_cleanly = false;
    if (bridge && PyGILState_Check()) {
      closed.store(true, std::memory_order_release);
      try {
        GilReleased no_gil;
        bridge->close();
        closed_cleanly = true;
      } catch (const std::exception& error) {
        std::fprintf(stderr, "devbridge: closing the bridge failed; %zu registered buffers stay held: %s\n",
                     registrations.size(), error.what());
      }
    }
    if (closed_cleanly) {
      release_regions_after_close(*this);
      // What is left is retained for an adopted allocation a DLPack consumer
      // still reads: its buffer stays exported for good (the bridge's last
      // lease cannot reach this state any more to let it go).
      for (auto& reg : registrations) reg->held = false;
      registrations.clear();
    } else {
      for (auto& reg : registrations) reg->held = false;  // leaked on purpose
      registrations.clear();
    }
  }
  // ~Bridge closes, quiescing the backend; nothing in it needs the GIL.
  bridge.reset();
}

// Whether the bridge let go of `reg` at a restart or close (`gone`: its
// generation ended): true, unless it is retained for an adoption, which is
// marked so for reap_dropped.
static bool outlived(const BridgeState&, HostRegistration& reg, bool gone) {
  if (!gone) return false;
  reg.retained = !reg.bridge_let_go();  // the release callback ran (or has yet to: retained)
  return !reg.retained;
}

void release_regions_after_restart(BridgeState& state) {
  Generation current = 0;
  try {
    current = state.bridge->generation();
  } catch (const Error&) {
    return;  // closed meanwhile: close releases them
  }
  release_if(state, [&](HostRegistration& reg) { return outlived(state, reg, reg.region.generation < current); });
}

void release_regions_after_close(BridgeState& state) {
  release_if(state, [&](HostRegistration& reg) { return outlived(state, reg, true); });
}

void reap_released_regions(BridgeState& state) {
  if (!state.registrations.empty()) reap_dropped(state);
}

DeviceHandle adopt_host(const std::shared_ptr<BridgeState>& state, nb::handle range, const ObjectSpec& spec) {
  if (!nb::isinstance<PyRegionRange>(range) && !nb::isinstance<PyHostRegion>(range))
    args::raise(PyExc_TypeError, "adopt_host: range must be a RegionRange (region.range(), region.range_of(array)) or "
                                 "a HostRegion of a region registered with writable=False, not " +
                                     object_type_name(range));
  const auto region = std::get<RegionRange>(parse_copy_host(range).range);
  Bridge& bridge = state->open();
  return bridge.adopt_host(region, spec);
}

CopyHost parse_copy_host(nb::handle range) {
  if (nb::isinstance<HostRange>(range)) return CopyHost{nb::cast<HostRange>(range)};
  if (nb::isinstance<PyRegionRange>(range)) {
    const auto& r = nb::cast<const PyRegionRange&>(range);
    return CopyHost{r.range};
  }
  if (nb::isinstance<PyHostRegion>(range)) {
    // The whole region.
    const auto& reg = *nb::cast<const PyHostRegion&>(range).reg;
    return CopyHost{RegionRange{reg.region, 0, reg.nbytes}};
  }
  args::raise(PyExc_TypeError, "range must be a HostRange (bridge.ring.reserve), a RegionRange (region.range(), "
                               "region.range_of(array)) or a HostRegion, not " + object_type_name(range));
}

nb::object register_host(const std::shared_ptr<BridgeState>& state, nb::handle object, bool writable) {
  reap_dropped(*state);  // a dropped region over the same memory may be let go by now
  const std::string what = object_type_name(object);
  std::optional<HeldBuffer> buffer;
  try {
    buffer.emplace(object, PyBUF_RECORDS_RO | (writable ? PyBUF_WRITABLE : 0), "register_host: obj");
  } catch (nb::python_error& refused) {
    // Refused a writable export (numpy: ValueError, others: BufferError):
    // say so plainly when the object is merely read-only.
    if (!writable || refused.matches(PyExc_TypeError)) throw;
    if (PyObject_CheckBuffer(object.ptr())) {
      Py_buffer probe;
      if (PyObject_GetBuffer(object.ptr(), &probe, PyBUF_RECORDS_RO) == 0) {
        const Py_ssize_t len = probe.len;
        PyBuffer_Release(&probe);
        args::raise(PyExc_ValueError,
                    "register_host: the " + what + " object (" + std::to_string(len) +
                        " bytes) is read-only; register it with writable=False (host_to_device only), or a writable "
                        "copy (bytearray(obj), numpy.array(obj))");
      }
      PyErr_Clear();
    }
    throw;
  }
  const Py_buffer& view = buffer->view();
  if (writable && view.readonly)
    args::raise(PyExc_ValueError, "register_host: the " + what + " object (" + std::to_string(view.len) +
                                      " bytes) is read-only; register it with writable=False (host_to_device only)");
  refuse_non_native_byte_order(view, "register_host", what);
  if (!PyBuffer_IsContiguous(&view, 'C'))
    args::raise(PyExc_ValueError,
                "register_host: the " + what + " of shape " + shape_text(view) +
                    " is not C-contiguous; registered memory is one run of bytes: register the array it views, or "
                    "numpy.ascontiguousarray(obj)");

  auto reg = std::make_shared<HostRegistration>();
  reg->writable = writable;
  reg->address = reinterpret_cast<std::uintptr_t>(view.buf);
  reg->nbytes = static_cast<std::uint64_t>(view.len);
  reg->object_type = what;
  Bridge& bridge = state->open();
  {
    // Pinning can take a while (page-locking every page); the export is held
    // meanwhile, so the bytes cannot move.
    const std::span<std::byte> bytes(static_cast<std::byte*>(view.buf), static_cast<std::size_t>(view.len));
    Bridge::RegionRelease on_release = [let_go = reg->let_go, weak = std::weak_ptr<BridgeState>(state)] {
      let_go->store(true, std::memory_order_release);
      schedule_reap(weak);
    };
    GilReleased no_gil;
    reg->region = writable ? bridge.register_host(bytes, std::move(on_release))
                           : bridge.register_host_read_only(bytes, std::move(on_release));
  }
  reg->buffer = buffer->take();
  reg->held = true;
  state->registrations.push_back(reg);
  return nb::cast(PyHostRegion(state, std::move(reg)));
}

void unregister_host(const std::shared_ptr<BridgeState>& state, nb::handle region) {
  if (!nb::isinstance<PyHostRegion>(region))
    args::raise(PyExc_TypeError, "unregister_host: region must be a HostRegion (bridge.register_host), not " +
                                     object_type_name(region));
  auto& r = nb::cast<PyHostRegion&>(region);
  if (r.state.get() != state.get())
    throw Error(ErrorKind::ForeignDomain, "unregister_host: " + r.reg->describe() + " belongs to another bridge");
  r.unregister();
}

void bind_host_regions(nb::module_& m) {
  nb::class_<PyHostRegion>(m, "HostRegion",
                           "A caller's buffer registered with the bridge (Bridge.register_host): a staging source\n"
                           "beside the ring that copies read from and write into in place. Holds the buffer (and\n"
                           "its export: a bytearray cannot be resized, an mmap not closed) until unregister(), the\n"
                           "end of a `with` block, or a restart or close of the bridge.")
      .def_prop_ro("domain", [](const PyHostRegion& r) { return r.reg->region.domain; })
      .def_prop_ro("generation", [](const PyHostRegion& r) { return r.reg->region.generation; })
      .def_prop_ro("id", [](const PyHostRegion& r) { return r.reg->region.id; })
      .def_prop_ro("nbytes", [](const PyHostRegion& r) { return r.reg->nbytes; }, "Bytes registered.")
      .def_prop_ro("bytes", [](const PyHostRegion& r) { return r.reg->nbytes; }, "Bytes registered (= nbytes).")
      .def("__len__", [](const PyHostRegion& r) { return r.reg->nbytes; })
      .def_prop_ro("address", [](const PyHostRegion& r) { return r.reg->address; },
                   "The host address of the registered bytes.")
      .def_prop_ro("writable", [](const PyHostRegion& r) { return r.reg->writable; },
                   "False for a region registered with writable=False: device_to_host refuses it.")
      .def_prop_ro("registered", [](const PyHostRegion& r) { return r.reg->held; },
                   "True until unregister(), the end of a `with` block, a restart or close.")
      .def_prop_ro(
          "obj",
          [](const PyHostRegion& r) -> nb::object {
            if (!r.reg->held || r.reg->buffer.obj == nullptr) return nb::none();
            return nb::borrow(r.reg->buffer.obj);
          },
          "The registered object (what exported the buffer); None once the region is unregistered.")
      .def(
          "range",
          [](nb::handle self, nb::handle offset_object, nb::handle length_object) {
            const auto offset = args::integer<std::uint64_t>(offset_object, "offset");
            const auto length = args::optional_integer<std::uint64_t>(length_object, "length");
            // self by hand (make_range keeps it): nanobind's own check of an instance never made is skipped.
            if (!nb::inst_ready(self)) throw nb::type_error("HostRegion.range: the HostRegion was never made");
            const std::uint64_t total = nb::cast<const PyHostRegion&>(self).reg->nbytes;
            return make_range(self, offset, length ? *length : total - std::min(offset, total));
          },
          "offset"_a.none() = 0, "length"_a.none() = nb::none(),
          "A RegionRange of bytes [offset, offset + length) (length None: to the end), for host_to_device /\n"
          "device_to_host. InvalidRange when it is empty or reaches past the region.")
      .def("range_of", &range_of, "array"_a, nb::kw_only(), "device_pitch"_a.none() = nb::none(),
           "(RegionRange, CopyLayout or None) for a view into the registered object (a numpy slice such as\n"
           "a[1:8, 1:6]): the range its elements span and, unless it is one contiguous run, the pitched layout\n"
           "its rows take (strides in bytes, as numpy gives them). device_pitch=p asks for a layout with that\n"
           "device pitch (0: packed rows) even for a contiguous view. InvalidRange when the view is not inside\n"
           "the region or not pitched row-major.")
      .def("unregister", &PyHostRegion::unregister,
           "Unregisters now and lets go of the buffer. AllocationStillInUse while a copy uses it (nothing\n"
           "changes); OldGenerationHandle after a restart, UnknownDeviceHandle once unregistered, Closed after\n"
           "close (the buffer was let go then).")
      // Self for type checkers: `with Bridge() as b` is the subclass, with its methods.
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); },
           nb::sig("def __enter__(self) -> typing_extensions.Self"))
      .def(
          "__exit__", [](PyHostRegion& r, nb::handle exc_type, nb::handle, nb::handle) { r.exit(!exc_type.is_none()); },
          "exc_type"_a.none(),
          "exc"_a.none(), "tb"_a.none())
      .def("__repr__", &region_repr);

  nb::class_<PyRegionRange>(m, "RegionRange",
                            "Bytes [offset, offset + len) of a HostRegion (region.range(), region.range_of(array)):\n"
                            "what host_to_device / device_to_host take in place of a ring range.")
      .def_prop_ro("region", [](const PyRegionRange& r) { return r.region; })
      .def_prop_ro("offset", [](const PyRegionRange& r) { return r.range.offset; })
      .def_prop_ro("len", [](const PyRegionRange& r) { return r.range.len; })
      .def("__len__", [](const PyRegionRange& r) { return r.range.len; })
      .def(
          "__eq__",
          [](const PyRegionRange& a, nb::handle b) {
            return nb::isinstance<PyRegionRange>(b) && a.range == nb::cast<const PyRegionRange&>(b).range;
          },
          "other"_a.none())
      .def("__hash__", [](const PyRegionRange& r) { return hash_range(r.range); })
      .def("__repr__", [](const PyRegionRange& r) {
        return "RegionRange(region_id=" + std::to_string(r.range.region.id) + ", offset=" + std::to_string(r.range.offset) +
               ", len=" + std::to_string(r.range.len) + ")";
      });
}

}  // namespace devbridge::python
