// Errors: every devbridge::Error surfaces in Python as the exception class
// named after its kind. The classes are defined in Python
// (devbridge/__init__.py, BridgeError and one subclass per ErrorKind) and
// registered back here at import, so Python owns their hierarchy.
#include <exception>
#include <new>
#include <string>
#include <string_view>

#include <Python.h>
#include <nanobind/nanobind.h>

#include "devbridge/error.hpp"
#include "bindings.hpp"
#include "state.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {
namespace {

// devbridge.<Kind> exception classes, indexed by ErrorKind; set by
// devbridge/__init__.py at import. Strong references kept for the life of
// the process (module teardown order is not ours to rely on).
PyObject* g_error_classes[kErrorKindCount] = {};

PyObject* utf8(std::string_view text) {
  return PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace");
}

void raise_bridge_error(const Error& error) {
  PyObject* cls = g_error_classes[static_cast<int>(error.kind())];
  if (cls == nullptr) {  // the extension imported without its package
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return;
  }
  PyObject* what = utf8(error.what());
  if (what == nullptr) return;
  PyObject* instance = PyObject_CallOneArg(cls, what);
  Py_DECREF(what);
  if (instance == nullptr) return;
  PyObject* message = utf8(error.message());
  if (message == nullptr || PyObject_SetAttrString(instance, "message", message) != 0 ||
      PyObject_SetAttrString(instance, "fatal", error.fatal() ? Py_True : Py_False) != 0) {
    Py_XDECREF(message);
    Py_DECREF(instance);
    return;
  }
  Py_DECREF(message);
  PyErr_SetObject(cls, instance);
  Py_DECREF(instance);
}

}  // namespace

void set_python_error(const std::exception& error) noexcept {
  if (const auto* bridge_error = dynamic_cast<const Error*>(&error)) {
    raise_bridge_error(*bridge_error);
  } else if (dynamic_cast<const std::bad_alloc*>(&error) != nullptr) {
    PyErr_NoMemory();
  } else if (auto* python_error = dynamic_cast<nb::python_error*>(const_cast<std::exception*>(&error))) {
    python_error->restore();  // restore() hands the Python error back; it is not const
  } else if (const auto* builtin = dynamic_cast<const nb::builtin_exception*>(&error)) {
    PyErr_SetString(builtin->type() == nb::exception_type::value_error ? PyExc_ValueError : PyExc_TypeError,
                    builtin->what());
  } else {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
}

void bind_errors(nb::module_& m) {
  nb::register_exception_translator(
      [](const std::exception_ptr& pointer, void*) {
        try {
          std::rethrow_exception(pointer);
        } catch (const Error& error) {
          raise_bridge_error(error);
        }
      },
      nullptr);

  m.def("_error_kinds", [] {
    nb::list kinds;
    for (int i = 0; i < kErrorKindCount; ++i) kinds.append(std::string(kind_name(static_cast<ErrorKind>(i))));
    return kinds;
  });
  m.def(
      "_register_errors",
      [](nb::list classes) {
        if (nb::len(classes) != static_cast<std::size_t>(kErrorKindCount))
          throw nb::value_error("_register_errors: one class per error kind, in ErrorKind order");
        for (int i = 0; i < kErrorKindCount; ++i) {
          PyObject* cls = classes[i].ptr();
          Py_INCREF(cls);
          Py_XDECREF(g_error_classes[i]);
          g_error_classes[i] = cls;
        }
      },
      "classes"_a);
  m.def("_raise_for_test", [](const std::string& kind, const std::string& message) {
    for (int i = 0; i < kErrorKindCount; ++i)
      if (kind_name(static_cast<ErrorKind>(i)) == kind) throw Error(static_cast<ErrorKind>(i), message);
    throw nb::value_error("unknown kind");
  });
}

}  // namespace devbridge::python
