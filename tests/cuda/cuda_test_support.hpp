// Shared helpers for the CUDA tests.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace devbridge::cuda::testing {

// Sets an environment variable for one scope and restores it afterwards.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

inline constexpr const char* kMissingDriver = "/nonexistent/devbridge-test/libcuda.so.1";

}  // namespace devbridge::cuda::testing
