#include "info.hpp"

#include <algorithm>
#include <exception>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "devbridge/consumer_names.hpp"
#include "devbridge/types.hpp"
#include "sizes.hpp"

namespace devbridge::cli {

InfoReport collect_info() {
  InfoReport report;
  for (BackendAvailability& availability : list_backends()) {
    BackendEntry entry;
    entry.availability = std::move(availability);
    if (entry.availability.available) {
      const std::string& name = entry.availability.name;
      try {
        entry.devices = list_devices(name);
      } catch (const std::exception& e) {
        entry.describe_error = e.what();  // the default device may still open
      }
      try {
        const auto backend = make_backend(name);
        // Which of several devices the backend binds by default only the backend knows.
        entry.info = entry.devices.size() == 1 ? entry.devices.front() : backend->describe();
        entry.memory = MemoryPolicy{entry.info->caches_allocations, entry.info->part_alignment};
      } catch (const std::exception& e) {
        if (entry.devices.size() == 1) entry.info = entry.devices.front();
        entry.describe_error = e.what();
      }
    }
    report.backends.push_back(std::move(entry));
  }
  try {
    report.auto_choice = make_backend("auto")->describe().name;
  } catch (const std::exception& e) {
    report.auto_error = e.what();
  }
  return report;
}

namespace {

std::string memory_line(const BackendInfo& info) {
  if (info.total_memory == 0 && info.free_memory == 0) return "unknown";
  if (info.free_memory == 0) return fmt::format("{} total", format_bytes(info.total_memory));
  if (info.total_memory == 0) return fmt::format("{} free", format_bytes(info.free_memory));
  return fmt::format("{} free of {}", format_bytes(info.free_memory), format_bytes(info.total_memory));
}

std::string dtype_list(const std::vector<DType>& dtypes) {
  std::string names;
  for (DType dtype : dtypes) {
    if (!names.empty()) names += ' ';
    names += dtype_info(dtype).name;
  }
  return names.empty() ? "none" : names;
}

// What the device computes in, where it differs from what it holds (OpenCL
// without cl_khr_fp16 holds float16 but computes in no half).
std::string computed_list(const BackendInfo& info) {
  const auto& computed = info.computed_dtypes();
  return computed == info.dtypes ? "every dtype it holds" : dtype_list(computed);
}

}  // namespace

std::string format_info(const InfoReport& report) {
  std::string out = "backends in this build:\n";
  std::size_t width = 4;
  for (const BackendEntry& e : report.backends) width = std::max(width, e.availability.name.size());
  for (const BackendEntry& e : report.backends) {
    const BackendAvailability& a = e.availability;
    out += fmt::format("  {:<{}}  {}", a.name, width, describe_availability(a));
    if (a.name == report.auto_choice) out += "  (auto)";
    out += '\n';
  }
  if (report.auto_choice.empty()) out += fmt::format("--backend auto picks nothing here: {}\n", report.auto_error);

  for (const BackendEntry& e : report.backends) {
    if (!e.availability.available) continue;
    out += fmt::format("\n{}\n", e.availability.name);
    if (!e.info) {
      out += fmt::format("  error          {}\n", e.describe_error);
      continue;
    }
    const BackendInfo& info = *e.info;
    out += fmt::format("  vendor         {}\n", info.vendor);
    out += fmt::format("  device         {} (--device {}, the default)\n", info.device_name, info.device_id);
    if (!info.pci_bus_id.empty()) out += fmt::format("  pci bus id     {}\n", info.pci_bus_id);
    if (!info.capabilities.empty()) out += fmt::format("  capabilities   {}\n", fmt::join(info.capabilities, ", "));
    out += fmt::format("  device string  {}\n", tinygrad_device(info.device_kind, info.device_ordinal));
    out += fmt::format("  memory         {}\n", memory_line(info));
    out += fmt::format("  holds          {}\n", dtype_list(info.dtypes));
    out += fmt::format("  computes in    {}\n", computed_list(info));
    out += fmt::format("  page-locked    {}\n", info.host_memory_page_locked ? "yes" : "no");
    out += fmt::format("  registration   {}\n", info.cheap_registration
                                                   ? "cheap (a large import copies straight from the buffer)"
                                                   : "not cheap (imports stage through the ring)");
    out += fmt::format("  streams        {}\n",
                       info.host_addressable ? "written and read in place (device memory is host memory)"
                       : info.maps_for_write ? "written in place (device memory mapped for writing), read through the ring"
                                             : "through the ring");
    if (e.memory) {
      out += fmt::format("  caching pool   {}\n",
                         !e.memory->caching_pool ? "off by default (Bridge option caching_pool)"
                         : e.memory->part_alignment
                             ? fmt::format("on; packs and splits segments into {}-byte aligned parts",
                                           std::max<std::uint64_t>(e.memory->part_alignment, 512))
                             : std::string("on; whole blocks, reused by size class"));
    }
    if (!info.notes.empty()) out += fmt::format("  notes          {}\n", info.notes);
    if (e.devices.size() > 1) {
      out += "  devices\n";
      for (const BackendInfo& device : e.devices)
        out += fmt::format("    --device {:<6} {}, {}, holds: {}; computes in: {}\n", device.device_id,
                           device.device_name, memory_line(device), dtype_list(device.dtypes), computed_list(device));
    }
  }
  return out;
}

}  // namespace devbridge::cli
