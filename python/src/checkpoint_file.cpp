// devbridge._devbridge._checkpoint_open: the checkpoint header reader
// (include/devbridge/checkpoint_file.hpp, the one `devbridge checkpoint
// inspect` uses) for checkpoint_info and restore (python/devbridge/_checkpoint.py);
// _checkpoint_select: the selection of the tensors a restore takes.
//
// It hands back the descriptor the header was read through, as an
// io.FileIO, so restore reads the data from the file it checked: a second
// open by path could find another file renamed into its place.
#include <chrono>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include <Python.h>
#include <nanobind/nanobind.h>

#include "devbridge/checkpoint_file.hpp"
#include "devbridge/checkpoint_restore.hpp"
#include "devbridge/types.hpp"
#include "arguments.hpp"
#include "bindings.hpp"
#include "owned_allocation.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {
namespace {

// A refused file as Python raises it: OSError(errno, strerror, filename) (its
// errno's subclass, as open() raises) when the system refused, else
// devbridge.CheckpointError (a ValueError, defined in Python: looked up only
// when a file is refused).
[[noreturn]] void raise_checkpoint_error(const checkpoint::CheckpointError& error, nb::object filename) {
  if (error.os_error() != 0) {
    nb::object os_error = nb::handle(PyExc_OSError)(error.os_error(), std::strerror(error.os_error()), filename);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(os_error.ptr())), os_error.ptr());
    throw nb::python_error();
  }
  nb::object cls = nb::module_::import_("devbridge._portable").attr("CheckpointError");
  PyErr_SetString(cls.ptr(), error.what());
  throw nb::python_error();
}

nb::tuple checkpoint_open(nb::bytes path, const std::string& where) {
  const std::string file_path(path.c_str(), path.size());
  std::optional<checkpoint::CheckpointFile> file;
  try {
    GilReleased no_gil;  // a 100 MB header takes a while to read and check
    file.emplace(checkpoint::CheckpointFile::open(file_path, where));
  } catch (const checkpoint::CheckpointError& error) {
    raise_checkpoint_error(error, nb::steal(PyUnicode_DecodeFSDefaultAndSize(path.c_str(), static_cast<Py_ssize_t>(path.size()))));
  }
  const checkpoint::Header& header = file->header();
  nb::dict metadata;
  for (const auto& [key, value] : header.metadata) metadata[nb::str(key.data(), key.size())] = nb::str(value.data(), value.size());
  // A model's thousands of tensors share a few dtypes and shapes: one str per
  // dtype and one tuple per shape, built once.
  std::map<DType, nb::str> dtype_names;
  std::map<std::vector<std::uint64_t>, nb::tuple> shapes;
  nb::list tensors;
  for (const checkpoint::TensorEntry& t : header.tensors) {
    auto shape = shapes.find(t.shape);
    if (shape == shapes.end()) {
      nb::list dims;
      for (std::uint64_t dim : t.shape) dims.append(dim);
      shape = shapes.emplace(t.shape, nb::tuple(dims)).first;
    }
    nb::str name = nb::str(t.name.data(), t.name.size());
    if (!t.unrestorable.empty()) {
      // Kept for checkpoint_info and refused by restore only when selected: a
      // dtype devbridge lacks has no devbridge name, so the file's spelling.
      const std::string_view dtype = t.dtype ? dtype_info(*t.dtype).name : std::string_view(t.safetensors_dtype);
      tensors.append(nb::make_tuple(name, nb::str(dtype.data(), dtype.size()), shape->second, t.begin, t.end,
                                    nb::str(t.unrestorable.data(), t.unrestorable.size())));
      continue;
    }
    const DType held = *t.dtype;  // a restorable entry's dtype is one devbridge holds
    auto dtype = dtype_names.find(held);
    if (dtype == dtype_names.end()) dtype = dtype_names.emplace(held, nb::str(dtype_info(held).name.data(), dtype_info(held).name.size())).first;
    tensors.append(nb::make_tuple(name, dtype->second, shape->second, t.begin, t.end));
  }
  // The descriptor, not an io.FileIO made here: making one lets the GIL go
  // (an fstat), and taking it back inside this C++ frame as the interpreter
  // finalizes crashed an exiting process (gil.hpp). The caller wraps it.
  const int fd = file->fd();
  file->release();
  return nb::make_tuple(fd, metadata, tensors, header.data_start());
}

// restore's choice of tensors by the library's one selection rule
// (checkpoint::select_tensors, the C ABI's too): those of `entries` that
// `names` (None or a list of str), `wants` (None or a callable) and `prefix`
// (None or a str) choose, the same objects in order (`entries` itself when it
// is every one). An entry is an _Entry tuple of _checkpoint_open's (a file's
// tensors, in file order) or a bare name (a sharded index's weight_map).
// `required` (a list of str: rows= names) must be there too. CheckpointError
// for a name missing or an unrestorable tensor chosen; what `wants` raises, as
// it is.
nb::list checkpoint_select(nb::list entries, nb::object names, nb::object wants, nb::object prefix, nb::list required,
                           const std::string& where) {
  checkpoint::TensorSelection selection;
  if (!names.is_none()) {
    auto& asked = selection.names.emplace();
    for (nb::handle name : names) asked.push_back(nb::cast<std::string>(name));
  }
  if (!prefix.is_none()) selection.prefix = nb::cast<std::string>(prefix);
  if (!wants.is_none()) {
    selection.wants = [&wants](const std::string& name) {
      const nb::object said = wants(nb::str(name.data(), name.size()));
      const int truth = PyObject_IsTrue(said.ptr());  // bool(said), as an if would read it
      if (truth < 0) throw nb::python_error();
      return truth == 1;
    };
  }
  for (nb::handle name : required) selection.required.push_back(nb::cast<std::string>(name));
  // A whole restore (no name asked for, none required) reads no name: a 50,000-tensor header's names are not
  // copied only to be passed over.
  const bool by_name = selection.names || !selection.prefix.empty() || selection.wants || !selection.required.empty();
  std::vector<checkpoint::TensorEntry> tensors(entries.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    nb::handle item = entries[i];
    if (PyUnicode_Check(item.ptr())) {
      if (by_name) tensors[i].name = nb::cast<std::string>(item);
      continue;
    }
    if (!PyTuple_Check(item.ptr()) || PyTuple_GET_SIZE(item.ptr()) != 6)
      throw nb::type_error("entries must hold str names or _Entry tuples (name, dtype, shape, begin, end, unrestorable)");
    const nb::tuple entry = nb::borrow<nb::tuple>(item);
    if (by_name) tensors[i].name = nb::cast<std::string>(entry[0]);
    if (!entry[5].is_none()) tensors[i].unrestorable = nb::cast<std::string>(entry[5]);
  }
  std::vector<const checkpoint::TensorEntry*> chosen;
  try {
    chosen = checkpoint::select_tensors(tensors, selection, where);
  } catch (const checkpoint::CheckpointError& error) {
    raise_checkpoint_error(error, nb::none());
  }
  if (chosen.size() == tensors.size()) return entries;  // every one, in order: the list itself
  nb::list out;
  for (const checkpoint::TensorEntry* entry : chosen) out.append(entries[static_cast<std::size_t>(entry - tensors.data())]);
  return out;
}

// What a Python callback of the stream raised: the exception is kept (as a
// Python object) by the stream's owner, and raised again each time the
// stream's error is asked for. A python_error itself can be raised only once.
struct CallbackFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct PyRestoreStream;

// A stream whose owner was dropped while its reader still read, after an
// interrupt asked it to stop without waiting (stop(wait=False): Ctrl-C must
// not wait for slow storage, neither in the wait nor where the PendingRestore
// is dropped). Kept, with the bridge it reads into, until the reader ends on
// its own; then joined (at once: it has ended) and destroyed with the GIL, by
// reap_orphans. The list is leaked on purpose: at exit a reader may still be
// reading, and its thread must not be destroyed unjoined (std::terminate).
struct Orphan {
  std::shared_ptr<BridgeState> state;  // declared first: outlives the stream
  std::unique_ptr<checkpoint::RestoreStream> stream;
  bool owners_taken = false;
};

std::vector<Orphan>& orphans() {
  static auto* list = new std::vector<Orphan>();
  return *list;
}

// With the GIL: destroys the orphans whose reader has ended.
void reap_orphans() {
  auto& list = orphans();
  for (auto it = list.begin(); it != list.end();) {
    if (!it->stream->done()) {
      ++it;
      continue;
    }
    {
      GilReleased no_gil;
      it->stream->stop();  // its reader has ended: the join is at once
    }
    if (!it->owners_taken)
      for (const DeviceHandle handle : it->stream->handles()) OwnedAllocation(it->state, handle).let_go();
    it = list.erase(it);
  }
}

// A restore's reading (checkpoint::RestoreStream) for Python's restore: the
// bridge's state held for as long as the stream reads into it.
struct PyRestoreStream {
  std::shared_ptr<BridgeState> state;  // declared first: outlives the stream
  std::unique_ptr<checkpoint::RestoreStream> stream;
  nb::object filename;  // OSError's filename
  // The stream's callbacks hold these by handle: they outlive its thread.
  nb::object digest, before_read;
  nb::object callback_error;  // what a callback raised (set with the GIL, on the reading thread)
  // The allocations were handed to Python as owners (take_owners): until
  // then they are the stream's, released with it, so an exception between
  // _restore_start and the tensors (Ctrl-C) leaks none of them.
  bool owners_taken = false;
  // The stream's callbacks reach this object through `link` (read with the
  // GIL): null once it is gone while its reader still reads (an Orphan).
  std::shared_ptr<PyRestoreStream*> link;
  bool stop_requested = false;  // stop(wait=False) asked the reader to stop, without waiting

  ~PyRestoreStream() {
    reap_orphans();
    if (!stream) return;
    if (stop_requested && !stream->done()) {
      if (link) *link = nullptr;  // with the GIL, which every callback takes before it reads the link
      orphans().push_back(Orphan{state, std::move(stream), owners_taken});
      return;
    }
    {
      // The reading thread takes the GIL for the callbacks: stop it without.
      GilReleased no_gil;
      stream->stop();
    }
    if (!owners_taken)
      for (const DeviceHandle handle : stream->handles()) OwnedAllocation(state, handle).let_go();
    stream.reset();  // with the GIL: a Python error it kept is released here
  }

  checkpoint::RestoreStream& open() const {
    if (!stream) throw Error(ErrorKind::Closed, "the restore stream has ended");
    return *stream;
  }

  // Runs `work` without the GIL; a CheckpointError raised as Python raises it.
  template <class Work>
  auto unlocked(Work work) {
    return translated([&](checkpoint::RestoreStream& s) {
      GilReleased no_gil;
      return work(s);
    });
  }

  // Waits through `attempt(stream, slice)` (true: done) for up to `limit`
  // (nothing: no limit) in slices, Ctrl-C ending it (wait_interruptibly).
  template <class Attempt>
  bool waited(std::optional<std::chrono::nanoseconds> limit, Attempt attempt) {
    return translated([&](checkpoint::RestoreStream& s) {
      return wait_interruptibly(limit, [&](std::chrono::nanoseconds slice, bool last) -> std::optional<bool> {
        if (attempt(s, slice)) return true;
        if (last) return false;
        return std::nullopt;
      });
    });
  }

  // A CheckpointError `work` raises raised as Python raises it; what a callback raised, raised again.
  template <class Work>
  auto translated(Work work) {
    auto& s = open();
    try {
      return work(s);
    } catch (const checkpoint::CheckpointError& error) {
      raise_checkpoint_error(error, filename);
    } catch (const CallbackFailed&) {
      if (!callback_error) throw Error(ErrorKind::Broken, "the restore's callback failed");  // cleared by the collector
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(callback_error.ptr())), callback_error.ptr());
      throw nb::python_error();
    }
  }

};

// `call(callable)` on the reading thread, with the GIL, for the callback
// `pick` chooses of the stream's owner; what it raises is kept by the owner.
// The callable is held for the call: a callback that lets the GIL go
// (hashlib's update, a sleep) may see its owner dropped meanwhile (an
// interrupted restore's stream orphaned), so the owner is read again after.
template <class Pick, class Call>
void call_back(const std::shared_ptr<PyRestoreStream*>& link, Pick pick, Call call) {
  GilTaken gil;
  if (*link == nullptr) throw checkpoint::CheckpointError("the restore was abandoned: its reader stops");
  const nb::object callable = pick(**link);
  try {
    call(callable);
  } catch (nb::python_error& error) {
    if (*link != nullptr) (*link)->callback_error = nb::borrow(error.value());
    throw CallbackFailed(error.what());
  }
}

// The kept exception's traceback holds the frames that waited on the stream,
// and so the stream; a callback may reach it too: the collector must see
// those references to free the cycle.
int restore_stream_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  const PyRestoreStream& stream = *nb::inst_ptr<PyRestoreStream>(self);
  Py_VISIT(stream.callback_error.ptr());
  Py_VISIT(stream.digest.ptr());
  Py_VISIT(stream.before_read.ptr());
  return 0;
}

int restore_stream_clear(PyObject* self) {
  nb::inst_ptr<PyRestoreStream>(self)->callback_error.reset();
  return 0;
}

PyType_Slot restore_stream_slots[] = {
    {Py_tp_traverse, reinterpret_cast<void*>(&restore_stream_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(&restore_stream_clear)},
    {0, nullptr},
};

void bind_restore_stream(nb::module_& m) {
  nb::class_<PyRestoreStream>(m, "_RestoreStream",
                              "A checkpoint's data section read into new allocations on a thread of its own "
                              "(checkpoint::RestoreStream): restore's reader.",
                              nb::type_slots(restore_stream_slots))
      .def(
          "take_owners",
          [](PyRestoreStream& self) {
            auto& s = self.open();
            if (self.owners_taken) throw Error(ErrorKind::InvalidRange, "the restore's allocations were taken already");
            // Made whole before any is handed out: the list, dropped, releases every one.
            nb::list owners;
            for (const DeviceHandle handle : s.handles()) owners.append(owned_allocation(self.state, handle));
            self.owners_taken = true;
            return owners;
          },
          "The allocations, one per target in order, as _OwnedAllocation (once): from then on the caller's.")
      .def(
          "landed",
          [](PyRestoreStream& self, nb::handle index, nb::handle timeout) {
            const auto i = args::integer<std::size_t>(index, "index");
            if (i >= self.open().handles().size()) throw nb::index_error("no such tensor in this restore");
            return self.waited(args::optional_seconds(timeout, "timeout"),
                               [&](checkpoint::RestoreStream& s, std::chrono::nanoseconds slice) { return s.landed(i, slice); });
          },
          "index"_a, "timeout"_a.none() = nb::none(),
          "Waits up to timeout seconds (None: no limit) for tensor `index`'s bytes to be written or their copies "
          "submitted; raises the error that stopped the reading before it.")
      .def(
          "copies",
          [](PyRestoreStream& self, nb::handle index) {
            const auto i = args::integer<std::size_t>(index, "index");
            auto& s = self.open();
            if (i >= s.handles().size() || !s.landed(i, std::chrono::nanoseconds(0)))
              throw nb::index_error("tensor not landed yet");
            nb::list pending;
            for (const PendingCopy& copy : s.copies(i)) pending.append(nb::make_tuple(copy.event, copy.offset, copy.bytes));
            return pending;
          },
          "index"_a, "A landed tensor's copies still in flight: [(CopyEvent, offset, nbytes)].")
      .def(
          "release_when_landed",
          [](PyRestoreStream& self, nb::handle index, OwnedAllocation& owner) {
            const auto i = args::integer<std::size_t>(index, "index");
            auto& s = self.open();
            if (i >= s.handles().size() || s.handles()[i] != owner.handle)
              throw nb::index_error("the owner is not that tensor's");
            if (!std::exchange(owner.owned, false)) return;  // released already
            GilReleased no_gil;  // the bridge's lock may be held by a thread waiting for the GIL
            s.release_when_landed(i);
          },
          "index"_a, "owner"_a,
          "Tensor `index`'s allocation, owned by `owner` (its _OwnedAllocation, which owns it no longer), let go "
          "once its bytes have landed, or the reading has ended: at once when either is so.")
      .def(
          "finished",
          [](PyRestoreStream& self, nb::handle timeout) {
            return self.waited(args::optional_seconds(timeout, "timeout"),
                               [](checkpoint::RestoreStream& s, std::chrono::nanoseconds slice) { return s.finished(slice); });
          },
          "timeout"_a.none() = nb::none(), "Waits for the whole file and the checksum's verdict; raises the error.")
      .def("done", [](PyRestoreStream& self) { return self.open().done(); })
      .def(
          "stop",
          [](PyRestoreStream& self, bool wait) {
            if (wait) {
              self.unlocked([](checkpoint::RestoreStream& s) { s.stop(); });
            } else {
              self.open().request_stop();
              self.stop_requested = true;  // dropped before the reader ends, it is orphaned, not joined
            }
          },
          "wait"_a = true,
          "Stops the reading before its next read and waits for it (idempotent); wait=False only asks, without "
          "waiting for the read in progress (an interrupt's cleanup): the stream is joined when it is dropped.");

  m.def(
      "_restore_start",
      [](nb::handle bridge, nb::handle fd, nb::handle data_start, nb::list targets, nb::object expected_crc32,
         nb::object digest, nb::object before_read, nb::handle wait_for_room, const std::string& where,
         nb::object filename) {
        reap_orphans();
        auto state = state_of(bridge, "bridge");
        std::vector<checkpoint::RestoreTarget> chosen;
        chosen.reserve(targets.size());
        for (nb::handle item : targets) {
          const auto t = nb::cast<nb::tuple>(item);
          if (t.size() != 5) args::raise(PyExc_ValueError, "a restore target is (name, begin, end, spec, extent)");
          chosen.push_back(checkpoint::RestoreTarget{nb::cast<std::string>(t[0]), args::integer<std::uint64_t>(t[1], "begin"),
                                                     args::integer<std::uint64_t>(t[2], "end"), nb::cast<ObjectSpec>(t[3]),
                                                     args::integer<std::uint64_t>(t[4], "extent")});
        }
        auto self = std::make_unique<PyRestoreStream>();
        self->filename = filename;
        self->digest = digest;
        self->before_read = before_read;
        checkpoint::RestoreOptions options;
        if (!expected_crc32.is_none()) options.expected_crc32 = nb::cast<std::string>(expected_crc32);
        options.wait_for_room = args::seconds(wait_for_room, "wait_for_room");
        // The callbacks run on the reading thread, which holds no GIL; each takes it.
        // The stream is stopped before `self` goes, or `self` unlinked (an Orphan).
        self->link = std::make_shared<PyRestoreStream*>(self.get());
        if (!digest.is_none())
          options.digest = [link = self->link](std::span<const std::byte> bytes) {
            call_back(
                link, [](PyRestoreStream& owner) { return owner.digest; },
                [&](const nb::object& callable) {
                  LentViews lent(false);
                  callable(lent.lend(bytes));
                  lent.end("digest");
                });
          };
        if (!before_read.is_none())
          options.before_read = [link = self->link](std::uint64_t at, std::uint64_t n) {
            call_back(
                link, [](PyRestoreStream& owner) { return owner.before_read; },
                [&](const nb::object& callable) { callable(at, n); });
          };
        const auto start = args::integer<std::uint64_t>(data_start, "data_start");
        Bridge& target = state->open();
        self->state = std::move(state);
        const int borrowed_fd = args::integer<int>(fd, "fd");
        try {
          GilReleased no_gil;
          const int owned_fd = ::dup(borrowed_fd);  // the stream's, closed by it: the caller closes its own
          if (owned_fd < 0) throw checkpoint::CheckpointError("cannot duplicate the file's descriptor", errno);
          self->stream = checkpoint::RestoreStream::start(target, owned_fd, start, std::move(chosen), std::move(options), where);
        } catch (const checkpoint::CheckpointError& error) {
          raise_checkpoint_error(error, filename);
        }
        return self.release();
      },
      "bridge"_a, "fd"_a, "data_start"_a, "targets"_a, "expected_crc32"_a.none(), "digest"_a.none(), "before_read"_a.none(),
      "wait_for_room"_a, "where"_a, "filename"_a, nb::rv_policy::take_ownership,
      "Allocates every target [(name, begin, end, spec, extent)] and starts reading the data section of `fd` (a "
      "duplicate of it: the caller keeps and closes its own) into them; an allocation that fails frees the others and raises.");
}

}  // namespace

void bind_checkpoint_file(nb::module_& m) {
  bind_restore_stream(m);
  m.def("_checkpoint_open", &checkpoint_open, "path"_a, "where"_a,
        "Opens a checkpoint (path as bytes; where names it in errors) and checks its header: (file descriptor, "
        "metadata, [(name, dtype, shape, begin, end)] in file order, data_start). CheckpointError when refused.");
  m.def("_checkpoint_select", &checkpoint_select, "entries"_a, "names"_a.none(), "wants"_a.none(), "prefix"_a.none(),
        "required"_a, "where"_a,
        "The entries (_Entry tuples in file order, or bare names) a restore chooses by names (None or a list of str), "
        "wants (None or a callable) and prefix (None or a str), each of names and required (a list of str) held: "
        "the library's one selection rule, the C ABI's too. CheckpointError for a name missing (where names the "
        "file) or an unrestorable tensor chosen.");
  // The writer names dtypes as the reader reads them: one table, the C++ reader's.
  m.def(
      "_safetensors_name",
      [](nb::handle dtype) {
        const DType parsed = parse_dtype(dtype);
        const std::string_view name = checkpoint::safetensors_name(parsed);
        if (name.empty()) throw nb::value_error(("no safetensors name for " + std::string(dtype_info(parsed).name)).c_str());
        return std::string(name);
      },
      "dtype"_a,
      "The safetensors name of a devbridge dtype (\"bfloat16\" -> \"BF16\").");
}

}  // namespace devbridge::python
