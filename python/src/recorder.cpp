// The flight recorder's Python entry points (Bridge.record, stop_recording,
// dump_trace, trace, memory_snapshot; docs/TRACING.md), and the Python stack
// each call attaches to the events it records when recording with stacks.
#include <Python.h>
#include <frameobject.h>

#include <optional>
#include <string>

#include <nanobind/nanobind.h>

#include "arguments.hpp"
#include "bindings.hpp"
#include "devbridge/error.hpp"
#include "devbridge/recorder.hpp"

namespace nb = nanobind;

namespace devbridge::python {
namespace {

constexpr int kStackFrames = 8;  // innermost first: enough to find the caller's line

// A path argument: str or os.PathLike (TypeError otherwise).
std::string path_text(nb::handle value, const char* what) {
  PyObject* path = PyOS_FSPath(value.ptr());
  if (path == nullptr) {
    PyErr_Clear();
    args::raise(PyExc_TypeError,
                std::string(what) + " must be a str or os.PathLike, not " + nb::type_name(value.type()).c_str());
  }
  nb::object owned = nb::steal(path);
  if (!PyUnicode_Check(path))
    args::raise(PyExc_TypeError, std::string(what) + " must be a str path (bytes paths are not taken)");
  // The file system's bytes for the name, as open() would use them: a name
  // that is not UTF-8 (a surrogate-escaped str from os.listdir) keeps its bytes.
  nb::object encoded = nb::steal(PyUnicode_EncodeFSDefault(path));
  if (!encoded.is_valid()) {
    PyErr_Clear();
    args::raise(PyExc_ValueError, std::string(what) + " cannot be encoded as a file name");
  }
  std::string text(PyBytes_AS_STRING(encoded.ptr()), static_cast<std::size_t>(PyBytes_GET_SIZE(encoded.ptr())));
  if (text.empty()) args::raise(PyExc_ValueError, std::string(what) + " is empty: give a file name");
  if (text.find('\0') != std::string::npos) args::raise(PyExc_ValueError, std::string(what) + " holds a NUL character");
  return text;
}

// A code object's name or file name as one line of UTF-8: characters UTF-8
// cannot hold (lone surrogates) and line breaks, which separate the frames,
// written as escapes.
std::string frame_text(nb::handle text) {
  nb::object encoded = nb::steal(PyUnicode_AsEncodedString(text.ptr(), "utf-8", "backslashreplace"));
  if (!encoded.is_valid()) {
    PyErr_Clear();
    return "?";
  }
  std::string_view bytes(PyBytes_AS_STRING(encoded.ptr()), static_cast<std::size_t>(PyBytes_GET_SIZE(encoded.ptr())));
  std::string line;
  line.reserve(bytes.size());
  for (const char c : bytes) {
    if (c == '\n')
      line += "\\n";
    else if (c == '\r')
      line += "\\r";
    else
      line += c;
  }
  return line;
}

// The interpreter's current stack, "file:line function" a line, innermost first.
std::string python_stack() {
  std::string text;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  for (int depth = 0; frame != nullptr && depth < kStackFrames; ++depth) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    const int line = PyFrame_GetLineNumber(frame);
    nb::object filename = nb::steal(PyObject_GetAttrString(reinterpret_cast<PyObject*>(code), "co_filename"));
    nb::object name = nb::steal(PyObject_GetAttrString(reinterpret_cast<PyObject*>(code), "co_name"));
    Py_DECREF(code);
    if (!filename.is_valid() || !name.is_valid() || !PyUnicode_Check(filename.ptr()) ||
        !PyUnicode_Check(name.ptr())) {
      PyErr_Clear();
      break;
    }
    if (!text.empty()) text += '\n';
    text += frame_text(filename);
    text += ':' + std::to_string(line) + ' ';
    text += frame_text(name);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return text;
}

// The stack of the last call that entered a recording bridge on this thread:
// replaced by each such call (BridgeState::open), so the events a call
// records, under the bridge's lock and without the GIL, carry its stack.
thread_local std::optional<TraceStack> t_call_stack;

}  // namespace

void annotate_call_stack() noexcept {
  t_call_stack.reset();
  // Only with the interpreter's lock (never from inside the bridge). Without
  // it the events go without a stack rather than with the last call's.
  if (!PyGILState_Check()) return;
  try {
    t_call_stack.emplace(python_stack());
  } catch (...) {
    PyErr_Clear();  // the events go without a stack
  }
}

void note_lease_end_stack() noexcept {
  // A lease ends outside any call that passed through BridgeState::open (a
  // DLPack consumer's deleter, which knows no bridge state): the stack in
  // effect is the thread's last annotated call, maybe on another bridge. A
  // thread has one only once a bridge recording stacks annotated a call on
  // it, so a thread that never did pays one test here.
  if (t_call_stack) annotate_call_stack();
}

namespace {

// The ring's size a caller asked for. None: the default, as the signature
// shows (it was a TypeError); not an int (a bool, a float, a str):
// TypeError. Out of [1, 2^24]: the core's InvalidRange, as in C++
// (TRACING.md), naming the value, and so also for an int no uint64 holds
// (-1, 2**64), which the other integer arguments refuse with OverflowError:
// one exception for every size the ring cannot have.
std::size_t max_events_of(nb::handle value) {
  if (value.is_none()) return RecordOptions{}.max_events;
  try {
    return static_cast<std::size_t>(args::integer<std::uint64_t>(value, "max_events"));
  } catch (nb::python_error& error) {
    if (!error.matches(PyExc_OverflowError)) throw;
  }
  nb::object index = nb::steal(PyNumber_Index(value.ptr()));  // an int: args::integer took it as one
  if (!index.is_valid()) throw nb::python_error();
  // As Bridge::record words it.
  throw Error(ErrorKind::InvalidRange, "record: " + max_events_refusal(nb::cast<std::string>(nb::str(index))));
}

}  // namespace

void record(BridgeState& state, nb::handle max_events_object, nb::handle stacks, nb::handle oom_dump_dir) {
  RecordOptions options;
  options.max_events = max_events_of(max_events_object);
  options.stacks = args::flag(stacks, "stacks");
  if (!oom_dump_dir.is_none()) options.oom_dump_dir = path_text(oom_dump_dir, "oom_dump_dir");
  Bridge& bridge = state.open();
  GilReleased no_gil;  // a large ring takes a while to allocate
  bridge.record(options);
}

void dump_trace(BridgeState& state, nb::handle path) {
  const std::string text = path_text(path, "path");
  const Bridge& bridge = *state.bridge;  // a closed bridge's trace is still there to dump
  GilReleased no_gil;
  bridge.dump_trace(text);
}

namespace {
nb::object parse_json(std::string&& text) {
  nb::object loads = nb::module_::import_("json").attr("loads");
  return loads(nb::str(text.data(), text.size()));
}
}  // namespace

nb::object trace(BridgeState& state) {
  std::string text;
  {
    GilReleased no_gil;
    text = state.bridge->trace_json();
  }
  return parse_json(std::move(text));
}

nb::object memory_snapshot(BridgeState& state, nb::handle layout_object) {
  const nb::object layout = layout_object.is_none() ? nb::object(nb::str("devbridge")) : nb::borrow(layout_object);
  if (!nb::isinstance<nb::str>(layout))
    throw nb::type_error(("layout must be \"devbridge\" or \"torch\", not " +
                          nb::cast<std::string>(nb::str(layout.type().attr("__name__"))))
                             .c_str());
  const std::string name = nb::cast<std::string>(layout);
  const bool torch = name == "torch";
  if (!torch && name != "devbridge")
    throw nb::value_error(("layout must be \"devbridge\" or \"torch\", not \"" + name + "\"").c_str());
  const Bridge& bridge = *state.bridge;  // after close() too: what views and consumers still hold is there
  std::string snapshot, trace;
  {
    GilReleased no_gil;
    // Under one call each; a call between them may change memory, which the
    // history then shows and the segments not yet.
    snapshot = bridge.memory_snapshot_json();
    if (torch) trace = bridge.trace_json();
  }
  if (!torch) return parse_json(std::move(snapshot));
  return nb::module_::import_("devbridge._memory_viz")
      .attr("torch_layout")(parse_json(std::move(snapshot)), parse_json(std::move(trace)));
}

}  // namespace devbridge::python
