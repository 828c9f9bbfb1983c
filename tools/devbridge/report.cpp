#include "report.hpp"

#include <csignal>
#include <string>

#include "devbridge/types.hpp"

namespace devbridge::cli {

std::string signal_name(int signal) {
  switch (signal) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    default: return "signal " + std::to_string(signal);
  }
}

nlohmann::json stream_report_json(const StreamReport& r) {
  return {
      {"command", "stream"},
      {"backend", r.backend},
      {"device_name", r.device_name},
      {"device_string", r.device_string},
      {"bytes", r.bytes},
      {"chunk_bytes", r.chunk_bytes},
      {"chunks", r.chunks},
      {"chunks_verified", r.chunks_verified},
      {"inflight", r.inflight},
      {"device_buffers", r.device_buffers},
      {"ring_bytes", r.ring_bytes},
      {"ring_wraps", r.ring_wraps},
      {"seconds", r.seconds},
      {"upload_busy_seconds", r.upload_busy_seconds},
      {"download_busy_seconds", r.download_busy_seconds},
      {"upload_gbps", r.upload_gbps},
      {"download_gbps", r.download_gbps},
      {"end_to_end_gbps", r.end_to_end_gbps},
      {"copies_submitted", r.copies_submitted},
      {"copies_failed", r.copies_failed},
      {"stale_completions", r.stale_completions},
      {"bytes_verified", r.bytes_verified},
      {"verified", r.verified},
      {"interrupted", r.interrupted},
      {"signal", r.interrupted ? nlohmann::json(signal_name(r.signal)) : nlohmann::json(nullptr)},
      {"errors", r.errors},
  };
}

nlohmann::json info_report_json(const InfoReport& report) {
  nlohmann::json backends = nlohmann::json::array();
  for (const BackendEntry& e : report.backends) {
    nlohmann::json entry = {
        {"name", e.availability.name},
        {"built", e.availability.built},
        {"available", e.availability.available},
        {"reason", e.availability.reason},
    };
    if (e.info) {
      nlohmann::json dtypes = nlohmann::json::array();
      for (DType dtype : e.info->dtypes) dtypes.push_back(std::string(dtype_info(dtype).name));
      entry["info"] = {
          {"vendor", e.info->vendor},
          {"device_name", e.info->device_name},
          {"device_string", e.info->device_string},
          {"dlpack_device", static_cast<int>(e.info->dlpack_device)},
          {"device_ordinal", e.info->device_ordinal},
          {"total_memory", e.info->total_memory},
          {"free_memory", e.info->free_memory},
          {"dtypes", dtypes},
          {"host_memory_page_locked", e.info->host_memory_page_locked},
          {"notes", e.info->notes},
      };
    } else if (!e.describe_error.empty()) {
      entry["error"] = e.describe_error;
    }
    backends.push_back(std::move(entry));
  }
  return {
      {"command", "info"},
      {"auto", report.auto_choice.empty() ? nlohmann::json(nullptr) : nlohmann::json(report.auto_choice)},
      {"backends", backends},
  };
}

}  // namespace devbridge::cli
