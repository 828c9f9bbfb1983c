// devbridge._devbridge._checkpoint_open: the checkpoint header reader
// (include/devbridge/checkpoint_file.hpp, the one `devbridge checkpoint
// inspect` uses) for checkpoint_info and restore (python/devbridge/_checkpoint.py).
//
// It hands back the descriptor the header was read through, as an
// io.FileIO, so restore reads the data from the file it checked: a second
// open by path could find another file renamed into its place.
#include <cstring>
#include <optional>
#include <string>

#include <Python.h>
#include <nanobind/nanobind.h>

#include "devbridge/checkpoint_file.hpp"
#include "devbridge/types.hpp"
#include "bindings.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace devbridge::python {
namespace {

nb::tuple checkpoint_open(nb::bytes path, const std::string& where) {
  const std::string file_path(path.c_str(), path.size());
  std::optional<checkpoint::CheckpointFile> file;
  try {
    nb::gil_scoped_release no_gil;  // a 100 MB header takes a while to read and check
    file.emplace(checkpoint::CheckpointFile::open(file_path, where));
  } catch (const checkpoint::CheckpointError& error) {
    if (error.os_error() != 0) {  // OSError(errno, strerror, filename) is its errno's subclass, as open() raises
      nb::object name = nb::steal(PyUnicode_DecodeFSDefaultAndSize(path.c_str(), static_cast<Py_ssize_t>(path.size())));
      nb::object os_error = nb::handle(PyExc_OSError)(error.os_error(), std::strerror(error.os_error()), name);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(os_error.ptr())), os_error.ptr());
      throw nb::python_error();
    }
    // devbridge.CheckpointError is defined in Python (a ValueError); it is
    // looked up only when a file is refused.
    nb::object cls = nb::module_::import_("devbridge._portable").attr("CheckpointError");
    PyErr_SetString(cls.ptr(), error.what());
    throw nb::python_error();
  }
  const checkpoint::Header& header = file->header();
  nb::dict metadata;
  for (const auto& [key, value] : header.metadata) metadata[nb::str(key.data(), key.size())] = nb::str(value.data(), value.size());
  nb::list tensors;
  for (const checkpoint::TensorEntry& t : header.tensors) {
    nb::list shape;
    for (std::uint64_t dim : t.shape) shape.append(dim);
    tensors.append(nb::make_tuple(nb::str(t.name.data(), t.name.size()), std::string(dtype_info(t.dtype).name),
                                  nb::tuple(shape), t.begin, t.end));
  }
  nb::object fileio = nb::module_::import_("io").attr("FileIO")(file->fd(), "rb", "closefd"_a = true);
  file->release();  // the FileIO closes it now
  return nb::make_tuple(fileio, metadata, tensors, header.data_start());
}

}  // namespace

void bind_checkpoint_file(nb::module_& m) {
  m.def("_checkpoint_open", &checkpoint_open, "path"_a, "where"_a,
        "Opens a checkpoint (path as bytes; where names it in errors) and checks its header: (io.FileIO, "
        "metadata, [(name, dtype, shape, begin, end)] in file order, data_start). CheckpointError when refused.");
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
