#include "backends/opencl/opencl_api.hpp"

#include "backends/dynamic_library.hpp"

namespace devbridge::opencl::detail {
namespace {

Api* open_api() {
  auto* loaded = new Api();  // never destroyed: see Api
  loaded->path = backends::library_path("DEVBRIDGE_LIBOPENCL", "libOpenCL.so.1");
  void* library = backends::open_library_for_good(loaded->path, loaded->load_error);
  if (library == nullptr) return loaded;
  loaded->opened = true;
  std::string missing;
#define DEVBRIDGE_OPENCL_LOAD_ENTRY(symbol, result, parameters) \
  loaded->symbol = reinterpret_cast<decltype(loaded->symbol)>(backends::find_symbol(library, #symbol, missing));
  DEVBRIDGE_OPENCL_ENTRY_POINTS(DEVBRIDGE_OPENCL_LOAD_ENTRY)
#undef DEVBRIDGE_OPENCL_LOAD_ENTRY
  if (!missing.empty()) loaded->load_error = loaded->path + " lacks " + missing + " (not an OpenCL 1.2 loader?)";
  return loaded;
}

}  // namespace

const Api& api() {
  static const Api* const loaded = open_api();  // thread-safe static initialization
  return *loaded;
}

}  // namespace devbridge::opencl::detail
