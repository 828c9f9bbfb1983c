// The JSON documents `--json` writes. Field names are documented in
// docs/CLI.md; scripts depend on them, so they only ever gain fields.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "info.hpp"
#include "stream.hpp"

namespace devbridge::cli {

// "SIGINT", "SIGTERM", or "signal N".
std::string signal_name(int signal);

nlohmann::json stream_report_json(const StreamReport& report);
nlohmann::json info_report_json(const InfoReport& report);

}  // namespace devbridge::cli
