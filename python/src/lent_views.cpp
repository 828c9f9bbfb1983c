// LentViews (lent_views.hpp): memoryviews of a buffer exporter that counts
// its exports, so that a chunk lent to a callback can be taken back when the
// call returns, or the call failed where something still holds its bytes.
#include "lent_views.hpp"

#include <memory>
#include <string>

#include "devbridge/transfer.hpp"
#include "gil.hpp"

namespace nb = nanobind;

namespace devbridge::python {

namespace {

// The exporter behind a lent memoryview: the bytes, and how many buffers over them are alive.
struct LentChunk {
  std::byte* data = nullptr;
  std::size_t size = 0;
  bool writable = false;
  bool lent = true;  // false once the call returned: no new export
  std::size_t exports = 0;
  // Where a buffer over the bytes outlived the call: what keeps their memory
  // allocated (keep_lent_chunk_memory) until the last such buffer, and with
  // it this exporter, is gone; let go without the GIL (it takes the bridge's
  // lock, which a thread waiting for the GIL may hold).
  std::shared_ptr<void> kept;

  LentChunk(std::byte* data, std::size_t size, bool writable) : data(data), size(size), writable(writable) {}
  LentChunk(LentChunk&&) = default;
  ~LentChunk() {
    if (kept) {
      GilReleased no_gil;
      kept.reset();
    }
  }
};

int lent_chunk_get(PyObject* self, Py_buffer* view, int flags) {
  LentChunk* chunk = nb::inst_ptr<LentChunk>(self);
  if (!chunk->lent) {
    view->obj = nullptr;
    PyErr_SetString(PyExc_BufferError, "a chunk lent to a callback cannot be viewed after its call returned");
    return -1;
  }
  if (PyBuffer_FillInfo(view, self, chunk->data, static_cast<Py_ssize_t>(chunk->size), chunk->writable ? 0 : 1,
                        flags) != 0)
    return -1;
  ++chunk->exports;
  return 0;
}

void lent_chunk_release(PyObject* self, Py_buffer*) { --nb::inst_ptr<LentChunk>(self)->exports; }

PyType_Slot lent_chunk_slots[] = {
    {Py_bf_getbuffer, reinterpret_cast<void*>(&lent_chunk_get)},
    {Py_bf_releasebuffer, reinterpret_cast<void*>(&lent_chunk_release)},
    {0, nullptr},
};

}  // namespace

nb::object LentViews::lend(std::span<const std::byte> bytes) {
  Loan loan;
  loan.chunk = nb::cast(LentChunk{const_cast<std::byte*>(bytes.data()), bytes.size(), writable_});
  PyObject* view = PyMemoryView_FromObject(loan.chunk.ptr());
  if (view == nullptr) throw nb::python_error();
  loan.view = nb::steal(view);
  loans_.push_back(loan);
  return loan.view;
}

bool LentViews::close(const Loan& loan) noexcept {
  // memoryview.release() refuses while something took a buffer from the view itself: that holder keeps
  // the chunk's export, as a slice or an array over a view of it does.
  static PyObject* const release = PyUnicode_InternFromString("release");
  if (PyObject* released = release ? PyObject_CallMethodNoArgs(loan.view.ptr(), release) : nullptr)
    Py_DECREF(released);
  else
    PyErr_Clear();
  LentChunk* chunk = nb::inst_ptr<LentChunk>(loan.chunk);
  chunk->lent = false;
  if (chunk->exports == 0) return true;
  if (!chunk->kept) chunk->kept = keep_lent_chunk_memory();  // what still holds them reads stale bytes, not freed memory
  return false;
}

void LentViews::end(const char* callback, std::optional<std::uint64_t> at) {
  std::optional<std::size_t> kept;  // the size of the first chunk something still holds
  for (const Loan& loan : loans_)
    if (!close(loan) && !kept) kept = nb::inst_ptr<LentChunk>(loan.chunk)->size;
  loans_.clear();
  if (!kept) return;
  const std::string where = at ? " from byte " + std::to_string(*at) + " of the stream" : std::string();
  PyErr_Format(PyExc_BufferError,
               "%s kept a buffer over a chunk it was lent (%zu bytes%s) past its call: numpy.frombuffer(chunk), or "
               "a slice or view of it, is still alive, over memory the bridge reuses next. A chunk is lent for the "
               "call only: copy what you keep (bytes(chunk), numpy.array(chunk))",
               callback, *kept, where.c_str());
  throw nb::python_error();
}

LentViews::~LentViews() {
  if (loans_.empty()) return;
  // Unwinding from the call's own error (held by the exception, or still set): kept as it is.
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  for (const Loan& loan : loans_) close(loan);
  PyErr_Restore(type, value, traceback);
}

void lend_for_call(nb::handle callback, const char* name, std::uint64_t at, std::span<const std::byte> chunk,
                   bool writable) {
  LentViews lent(writable);
  callback(at, lent.lend(chunk));
  lent.end(name, at);
}

void bind_lent_views(nb::module_& m) {
  nb::class_<LentChunk>(m, "LentChunk", nb::type_slots(lent_chunk_slots),
                        "Bytes lent to a sink or fill for one call (the memoryview it is handed views one).")
      .def("__len__", [](const LentChunk& c) { return c.size; });
}

}  // namespace devbridge::python
