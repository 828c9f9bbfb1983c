// Checks every flight-recorder trace must pass (docs/TRACING.md, "Trace
// format"), shared by the recorder's unit tests and its conformance tests.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace devbridge::testing {

// Every begin has its end on the same tid, nested per tid; no end without a
// begin; timestamps never go back; counters are never negative.
inline void expect_valid_trace(const nlohmann::json& trace) {
  ASSERT_EQ(trace.at("otherData").at("format"), "devbridge-trace");
  ASSERT_EQ(trace.at("otherData").at("version"), 1);
  double last_ts = 0;
  std::map<std::uint64_t, std::vector<std::string>> open;  // by tid
  for (const auto& event : trace.at("traceEvents")) {
    const auto ph = event.at("ph").get<std::string>();
    if (ph == "M") continue;
    const double ts = event.at("ts").get<double>();
    EXPECT_GE(ts, last_ts) << event.dump();
    last_ts = ts;
    if (ph == "B") {
      open[event.at("tid").get<std::uint64_t>()].push_back(event.at("name").get<std::string>());
    } else if (ph == "E") {
      auto& names = open[event.at("tid").get<std::uint64_t>()];
      ASSERT_FALSE(names.empty()) << "an end without a begin: " << event.dump();
      EXPECT_EQ(names.back(), event.at("name").get<std::string>()) << event.dump();
      names.pop_back();
    } else if (ph == "C") {
      for (const auto& [key, value] : event.at("args").items())
        EXPECT_TRUE(value.is_number_unsigned() || (value.is_number() && value.get<double>() >= 0))
            << key << " in " << event.dump();
    } else {
      EXPECT_EQ(ph, "i") << event.dump();
    }
  }
  for (const auto& [tid, names] : open) EXPECT_TRUE(names.empty()) << "slices left open on tid " << tid;
}

// The trace's events whose names are in `wanted`, in order, as "name" for
// instants and "name B" / "name E" for slices.
inline std::vector<std::string> event_names(const nlohmann::json& trace, const std::set<std::string>& wanted) {
  std::vector<std::string> names;
  for (const auto& event : trace.at("traceEvents")) {
    const auto ph = event.at("ph").get<std::string>();
    if (ph == "M" || ph == "C") continue;
    const auto name = event.at("name").get<std::string>();
    if (!wanted.contains(name)) continue;
    names.push_back(ph == "i" ? name : name + " " + ph);
  }
  return names;
}

}  // namespace devbridge::testing
