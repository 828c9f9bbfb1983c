// Small helpers shared by the benchmark programs: /proc/self/status readings,
// environment overrides, and order statistics. Nothing here is timed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace devbridge::bench {

// A "Key:   1234 kB" line of /proc/self/status, in KiB; 0 where absent.
inline std::uint64_t proc_status_kib(std::string_view key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.size() > key.size() && line.compare(0, key.size(), key) == 0 && line[key.size()] == ':') {
      return std::strtoull(line.c_str() + key.size() + 1, nullptr, 10);
    }
  }
  return 0;
}

// Integer from the environment ("1_000_000" allowed, as the reference allows).
inline std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return fallback;
  std::string digits;
  for (const char* p = raw; *p != '\0'; ++p) {
    if (*p != '_') digits.push_back(*p);
  }
  char* end = nullptr;
  const std::uint64_t value = std::strtoull(digits.c_str(), &end, 10);
  return (digits.empty() || *end != '\0') ? fallback : value;
}

// The median as the reference computes it (mean of the middle two when even).
inline double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2.0;
}

// Nearest-rank percentile, p in (0, 100].
inline double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  std::size_t rank = static_cast<std::size_t>(p / 100.0 * static_cast<double>(values.size()) + 0.999999);
  rank = std::clamp<std::size_t>(rank, 1, values.size());
  return values[rank - 1];
}

inline double min_of(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end()); }
inline double max_of(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); }

}  // namespace devbridge::bench
