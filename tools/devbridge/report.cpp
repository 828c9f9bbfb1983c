#include "report.hpp"

#include <csignal>
#include <string>

#include "devbridge/consumer_names.hpp"
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

namespace {

// Every MemoryStats field, under the names Python's memory_stats() gives them.
nlohmann::json memory_json(const MemoryStats& m) {
  nlohmann::json memory = nlohmann::json::object();
  for_each_field(m, [&](const char* name, auto value) { memory[name] = value; });
  return memory;
}

}  // namespace

nlohmann::json stream_report_json(const StreamReport& r) {
  return {
      {"command", "stream"},
      {"backend", r.backend},
      {"device_id", r.device_id},
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
      {"memory", memory_json(r.memory)},
      {"bytes_verified", r.bytes_verified},
      {"verified", r.verified},
      {"interrupted", r.interrupted},
      {"signal", r.interrupted ? nlohmann::json(signal_name(r.signal)) : nlohmann::json(nullptr)},
      {"errors", r.errors},
      {"trace", r.trace_file.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.trace_file)},
  };
}

namespace {

nlohmann::json device_json(const BackendInfo& info) {
  nlohmann::json dtypes = nlohmann::json::array();
  for (DType dtype : info.dtypes) dtypes.push_back(std::string(dtype_info(dtype).name));
  return {
      {"vendor", info.vendor},
      {"device_id", info.device_id},
      {"device_name", info.device_name},
      {"pci_bus_id", info.pci_bus_id.empty() ? nlohmann::json(nullptr) : nlohmann::json(info.pci_bus_id)},
      {"capabilities", info.capabilities},
      {"device_string", tinygrad_device(info.device_kind, info.device_ordinal)},
      {"dlpack_device", static_cast<int>(dlpack_device(info.device_kind))},
      {"device_ordinal", info.device_ordinal},
      {"total_memory", info.total_memory},
      {"free_memory", info.free_memory},
      {"dtypes", dtypes},
      {"host_memory_page_locked", info.host_memory_page_locked},
      {"host_addressable", info.host_addressable},
      {"cheap_registration", info.cheap_registration},
      {"notes", info.notes},
  };
}

}  // namespace

nlohmann::json info_report_json(const InfoReport& report) {
  nlohmann::json backends = nlohmann::json::array();
  for (const BackendEntry& e : report.backends) {
    nlohmann::json entry = {
        {"name", e.availability.name},
        {"built", e.availability.built},
        {"available", e.availability.available},
        {"reason", e.availability.reason},
        {"remedy", e.availability.remedy},
    };
    if (e.memory) {
      entry["memory"] = {
          {"caching_pool_default", e.memory->caching_pool},
          {"pool_splits", e.memory->part_alignment != 0},
          {"part_alignment", e.memory->part_alignment},
      };
    }
    if (e.info) {
      entry["info"] = device_json(*e.info);
      nlohmann::json devices = nlohmann::json::array();
      for (const BackendInfo& device : e.devices) devices.push_back(device_json(device));
      entry["devices"] = devices;
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
