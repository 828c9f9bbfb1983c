#include "backends/cuda/cuda_driver.hpp"

#include <map>
#include <memory>
#include <mutex>

#include "backends/dynamic_library.hpp"

namespace devbridge::cuda::detail {
namespace {

std::unique_ptr<Driver> open_driver(const std::string& path) {
  auto driver = std::make_unique<Driver>();
  driver->path = path;
  void* library = backends::open_library_for_good(path, driver->load_error);
  if (library == nullptr) return driver;
  driver->opened = true;
  std::string missing;
#define DEVBRIDGE_CUDA_LOAD_ENTRY(symbol) \
  driver->symbol = reinterpret_cast<decltype(driver->symbol)>(backends::find_symbol(library, #symbol, missing));
  DEVBRIDGE_CUDA_DRIVER_ENTRY_POINTS(DEVBRIDGE_CUDA_LOAD_ENTRY)
#undef DEVBRIDGE_CUDA_LOAD_ENTRY
  if (!missing.empty()) {
    driver->load_error = path + " lacks " + missing + " (a driver older than CUDA 11.0)";
    return driver;
  }
  driver->init_result = driver->cuInit(0);
  if (driver->init_result == CUDA_SUCCESS) {
    if (driver->cuDriverGetVersion(&driver->driver_version) != CUDA_SUCCESS) driver->driver_version = 0;
  }
  return driver;
}

}  // namespace

std::string driver_library_path() { return backends::library_path("DEVBRIDGE_LIBCUDA", "libcuda.so.1"); }

const Driver& load_driver(const std::string& path) {
  // Keyed by path so a test can point at a missing or stub library without
  // disturbing the real driver; entries live for the whole process.
  static std::mutex mutex;
  static auto* drivers = new std::map<std::string, std::unique_ptr<Driver>>();  // never destroyed: see Driver
  std::lock_guard lock(mutex);
  auto& slot = (*drivers)[path];
  if (!slot) slot = open_driver(path);
  return *slot;
}

std::string Driver::error_name(CUresult result) const {
  const char* name = nullptr;
  if (cuGetErrorName != nullptr && cuGetErrorName(result, &name) == CUDA_SUCCESS && name != nullptr) return name;
  return result_name(static_cast<int>(result));
}

std::string Driver::describe_failure(std::string_view call, CUresult result) const {
  std::string text(call);
  text += ": ";
  text += error_name(result);
  const char* description = nullptr;
  if (cuGetErrorString != nullptr && cuGetErrorString(result, &description) == CUDA_SUCCESS &&
      description != nullptr) {
    text += " (";
    text += description;
    text += ")";
  }
  return text;
}

Error make_error(const Driver& driver, CUresult result, std::string_view call, Operation operation,
                 std::string_view detail) {
  ResultClass cls = classify(static_cast<int>(result), operation);
  std::string message = driver.describe_failure(call, result);
  if (!detail.empty()) {
    message += "; ";
    message += detail;
  }
  if (cls.fatal) message += "; the CUDA context is unusable until the process restarts";
  return Error(cls.kind, message, cls.fatal);
}

void check(const Driver& driver, CUresult result, std::string_view call, Operation operation) {
  if (result != CUDA_SUCCESS) throw make_error(driver, result, call, operation);
}

}  // namespace devbridge::cuda::detail
