// What every flight-recorder trace must be (docs/TRACING.md, "Trace format"),
// as one check with no test framework: the recorder's tests
// (tests/conformance/trace_checks.hpp) and the fuzzer's harness both use it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace devbridge::testing {

// Empty when `trace` is valid, else what is wrong: every begin has its end
// on the same tid, nested per tid; no end without a begin; timestamps never
// go back; counters are never negative.
inline std::string trace_problem(const nlohmann::json& trace) {
  try {
    if (trace.at("otherData").at("format") != "devbridge-trace") return "otherData.format is not devbridge-trace";
    if (trace.at("otherData").at("version") != 1) return "otherData.version is not 1";
    double last_ts = 0;
    std::map<std::uint64_t, std::vector<std::string>> open;  // by tid
    for (const auto& event : trace.at("traceEvents")) {
      const auto ph = event.at("ph").get<std::string>();
      if (ph == "M") continue;
      const double ts = event.at("ts").get<double>();
      if (ts < last_ts) return "ts goes back at " + event.dump();
      last_ts = ts;
      if (ph == "B") {
        open[event.at("tid").get<std::uint64_t>()].push_back(event.at("name").get<std::string>());
      } else if (ph == "E") {
        auto& names = open[event.at("tid").get<std::uint64_t>()];
        if (names.empty()) return "an end without a begin: " + event.dump();
        if (names.back() != event.at("name").get<std::string>()) return "an end that is not its begin's: " + event.dump();
        names.pop_back();
      } else if (ph == "C") {
        for (const auto& [key, value] : event.at("args").items())
          if (!(value.is_number_unsigned() || (value.is_number() && value.get<double>() >= 0)))
            return key + " is negative in " + event.dump();
      } else if (ph != "i") {
        return "an event of phase " + ph + ": " + event.dump();
      }
    }
    for (const auto& [tid, names] : open)
      if (!names.empty()) return "slices left open on tid " + std::to_string(tid);
    return {};
  } catch (const nlohmann::json::exception& e) {
    return std::string("not the trace format: ") + e.what();
  }
}

}  // namespace devbridge::testing
