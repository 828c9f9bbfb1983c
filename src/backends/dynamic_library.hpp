// Vendor drivers (libcuda, libOpenCL) are loaded at run time, never linked:
// a build with a vendor backend then runs on machines without that driver,
// and probe() says why the backend is unavailable there.
#pragma once

#include <string>

namespace devbridge::backends {

// dlopen()s `path` for the rest of the process: it is never closed, because
// other libraries in the process (torch, tinygrad) may share the handle and
// drivers do not support being unloaded while contexts exist. Null, with
// `error` set to the loader's reason, when it cannot be loaded.
void* open_library_for_good(const std::string& path, std::string& error);

// The address of `symbol` in `library`, or null after appending the name to
// `missing` (comma-separated).
void* find_symbol(void* library, const char* symbol, std::string& missing);

// $`variable` when set and non-empty, else `fallback`.
std::string library_path(const char* variable, const char* fallback);

}  // namespace devbridge::backends
