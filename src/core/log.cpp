#include "core/log.hpp"

#include <spdlog/spdlog.h>
#include <spdlog/sinks/stdout_color_sinks.h>

namespace devbridge::detail {

spdlog::logger& log() {
  // Registered with spdlog, so an application's spdlog::set_level() (a CLI's
  // --quiet, a fuzzer silencing logs) applies to it as to its own loggers.
  // An application that made a "devbridge" logger first gets its own.
  static const std::shared_ptr<spdlog::logger> logger = [] {
    if (auto existing = spdlog::get("devbridge")) return existing;
    auto made = std::make_shared<spdlog::logger>("devbridge", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    made->set_level(spdlog::get_level());
    try {
      spdlog::register_logger(made);
    } catch (const spdlog::spdlog_ex&) {
      if (auto raced = spdlog::get("devbridge")) return raced;
    }
    return made;
  }();
  return *logger;
}

}  // namespace devbridge::detail
