#include "arguments.hpp"

#include <cmath>

#include <Python.h>

#include "devbridge/checked.hpp"

namespace nb = nanobind;

namespace devbridge::python::args {
namespace {

std::string python_type_name(nb::handle value) {
  PyTypeObject* type = Py_TYPE(value.ptr());
  return type->tp_name != nullptr ? type->tp_name : "object";
}

std::string short_repr(nb::handle value) {
  PyObject* text = PyObject_Repr(value.ptr());
  if (text == nullptr) {
    PyErr_Clear();
    return "<" + python_type_name(value) + ">";
  }
  const char* utf8 = PyUnicode_AsUTF8(text);
  std::string out = utf8 != nullptr ? utf8 : "<" + python_type_name(value) + ">";
  if (utf8 == nullptr) PyErr_Clear();
  Py_DECREF(text);
  if (out.size() > 80) out = out.substr(0, 77) + "...";
  return out;
}

// The argument as a Python int (its __index__), or TypeError.
nb::object as_index(nb::handle value, const char* what) {
  // A bool is an int to Python, but True as a size or an offset is a slip
  // (the Python layer refuses it for shapes and depths too).
  if (!PyFloat_Check(value.ptr()) && !PyBool_Check(value.ptr()) && PyIndex_Check(value.ptr())) {
    PyObject* index = PyNumber_Index(value.ptr());
    if (index != nullptr) return nb::steal(index);
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw nb::python_error();
    PyErr_Clear();
  }
  raise(PyExc_TypeError, std::string(what) + " must be an int, not " + python_type_name(value) + " (" + short_repr(value) + ")");
}

[[noreturn]] void out_of_range(const char* what, nb::handle index, const std::string& lo, const std::string& hi) {
  raise(PyExc_OverflowError,
        std::string(what) + " must be an int from " + lo + " to " + hi + ", not " + short_repr(index));
}

}  // namespace

void raise(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw nb::python_error();
}

std::int64_t to_int(nb::handle value, const char* what, std::int64_t lo, std::int64_t hi) {
  nb::object index = as_index(value, what);
  int overflow = 0;
  long long result = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (result == -1 && PyErr_Occurred()) throw nb::python_error();
  if (overflow != 0 || result < lo || result > hi) out_of_range(what, index, std::to_string(lo), std::to_string(hi));
  return result;
}

std::uint64_t to_uint(nb::handle value, const char* what, std::uint64_t hi) {
  nb::object index = as_index(value, what);
  const int negative = PyObject_RichCompareBool(index.ptr(), nb::int_(0).ptr(), Py_LT);
  if (negative < 0) throw nb::python_error();
  unsigned long long result = 0;
  if (negative == 0) {
    result = PyLong_AsUnsignedLongLong(index.ptr());
    if (result == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw nb::python_error();
      PyErr_Clear();
      out_of_range(what, index, "0", std::to_string(hi));
    }
  }
  if (negative != 0 || result > hi) out_of_range(what, index, "0", std::to_string(hi));
  return result;
}

std::chrono::nanoseconds seconds(nb::handle value, const char* what) {
  double s = 0.0;
  if (PyFloat_Check(value.ptr())) {
    s = PyFloat_AS_DOUBLE(value.ptr());
  } else if (PyIndex_Check(value.ptr()) || PyNumber_Check(value.ptr())) {
    // An int (any size: 10**400 is "until done" too) or a float-like
    // (numpy.float32, decimal). PyNumber_Check is true for str subclasses
    // of nothing: a str has no nb_float/nb_index.
    PyObject* as_float = PyNumber_Float(value.ptr());
    if (as_float == nullptr) {
      if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
        // An int too large for a double: its sign decides.
        PyErr_Clear();
        const int negative = PyObject_RichCompareBool(value.ptr(), nb::int_(0).ptr(), Py_LT);
        if (negative < 0) throw nb::python_error();
        s = negative ? -HUGE_VAL : HUGE_VAL;
      } else if (PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        raise(PyExc_TypeError, std::string(what) + " must be a number of seconds, not " + python_type_name(value));
      } else {
        throw nb::python_error();
      }
    } else {
      s = PyFloat_AS_DOUBLE(as_float);
      Py_DECREF(as_float);
    }
  } else {
    raise(PyExc_TypeError, std::string(what) + " must be a number of seconds, not " + python_type_name(value) + " (" +
                               short_repr(value) + ")");
  }
  if (std::isnan(s) || s < 0.0)
    raise(PyExc_ValueError, std::string(what) + " must be seconds >= 0 (a huge or infinite one waits until done), not " +
                                short_repr(value));
  return checked::seconds_to_nanoseconds(s, what);
}

std::optional<std::chrono::nanoseconds> optional_seconds(nb::handle value, const char* what) {
  if (value.is_none()) return std::nullopt;
  return seconds(value, what);
}

bool flag(nb::handle value, const char* what) {
  if (value.ptr() == Py_True) return true;
  if (value.ptr() == Py_False) return false;
  raise(PyExc_TypeError, std::string(what) + " must be True or False, not " + python_type_name(value) + " (" + short_repr(value) + ")");
}

}  // namespace devbridge::python::args
