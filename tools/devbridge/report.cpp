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
      {"memory",
       {
           {"pool_enabled", r.memory.pool_enabled},
           {"pool_splits", r.memory.pool_splits},
           {"allocated_bytes", r.memory.allocated_bytes},
           {"peak_allocated_bytes", r.memory.peak_allocated_bytes},
           {"total_allocated_bytes", r.memory.total_allocated_bytes},
           {"reserved_bytes", r.memory.reserved_bytes},
           {"peak_reserved_bytes", r.memory.peak_reserved_bytes},
           {"total_reserved_bytes", r.memory.total_reserved_bytes},
           {"total_allocations", r.memory.total_allocations},
           {"backend_allocations", r.memory.backend_allocations},
           {"backend_frees", r.memory.backend_frees},
           {"segments", r.memory.segments},
           {"cached_bytes", r.memory.cached_bytes},
           {"cache_hits", r.memory.cache_hits},
           {"cache_misses", r.memory.cache_misses},
           {"oom_retries", r.memory.oom_retries},
           {"oom_failures", r.memory.oom_failures},
           {"fragmentation_bytes", r.memory.fragmentation_bytes},
       }},
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
