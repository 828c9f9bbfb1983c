#include "trace.hpp"

#include <fmt/format.h>

#include <fstream>
#include <string_view>

namespace devbridge::cli {

namespace {

constexpr std::string_view kFormat = "devbridge-trace";
constexpr int kNewestVersion = 1;

[[noreturn]] void refuse(const std::string& path, const std::string& why) {
  throw TraceFileError(fmt::format("{}: {}", path, why));
}

}  // namespace

nlohmann::json load_trace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) refuse(path, "cannot be opened");
  nlohmann::json trace;
  try {
    trace = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    refuse(path, fmt::format("is not JSON ({})", e.what()));
  }
  const auto other = trace.is_object() ? trace.find("otherData") : trace.end();
  if (!trace.is_object() || other == trace.end() || !other->is_object() || !other->contains("format") ||
      (*other)["format"] != kFormat)
    refuse(path, fmt::format("is not a devbridge trace (no otherData.format \"{}\"; devbridge record / dump_trace "
                             "writes one)",
                             kFormat));
  const auto& version = (*other)["version"];
  if (!version.is_number_integer() || version.get<std::int64_t>() < 1)
    refuse(path, "has no valid otherData.version");
  if (version.get<std::int64_t>() > kNewestVersion)
    refuse(path, fmt::format("is a version {} trace; this devbridge reads version {} and older",
                             version.get<std::int64_t>(), kNewestVersion));
  if (!trace.contains("traceEvents") || !trace["traceEvents"].is_array()) refuse(path, "has no traceEvents array");
  return trace;
}

}  // namespace devbridge::cli
