#include "backends/dynamic_library.hpp"

#include <dlfcn.h>

#include <cstdlib>

namespace devbridge::backends {

void* open_library_for_good(const std::string& path, std::string& error) {
  dlerror();  // clear any stale message
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    error = why != nullptr ? why : path + ": cannot be loaded";
  }
  return library;
}

void* find_symbol(void* library, const char* symbol, std::string& missing) {
  void* address = dlsym(library, symbol);
  if (address == nullptr) {
    if (!missing.empty()) missing += ", ";
    missing += symbol;
  }
  return address;
}

std::string library_path(const char* variable, const char* fallback) {
  const char* override_path = std::getenv(variable);
  if (override_path != nullptr && *override_path != '\0') return override_path;
  return fallback;
}

}  // namespace devbridge::backends
