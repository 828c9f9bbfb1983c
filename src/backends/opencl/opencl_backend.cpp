// The OpenCL backend: device memory from clCreateBuffer, the ring from a
// mapped CL_MEM_ALLOC_HOST_PTR buffer (the portable way to ask a driver for
// page-locked memory), and every copy and launch on one in-order command
// queue. A pitched copy is one rect command (clEnqueue*BufferRect), so it
// shares the 1-D copy's event, hold and completion path; registered host
// memory is a CL_MEM_USE_HOST_PTR buffer no command ever names, there only
// so a driver that can pin the pages does.
//
// Ordering: the queue runs commands in submission order, so an upload lands
// before a later launch reads it, a launch finishes before a later download
// reads its output, and copies of the same bytes in either direction keep
// their order. (One queue means no duplex overlap of uploads and downloads;
// on PoCL's CPU device there would be none to gain.)
//
// Completions: an async copy keeps its cl_event in `pending_`, in submission
// order. Draining reports the leading run of finished commands, oldest
// first, reading each event's execution status, so completions arrive in the
// queue's order whatever order the driver's callback threads run in. The
// event callback only wakes waiters; it takes no lock that is held around an
// OpenCL call, so a driver that runs callbacks while holding its own locks
// cannot deadlock with a drain.
//
// Fences: a fence is a cl_event we hold one reference to: a launch's own
// event, or a marker (clEnqueueMarkerWithWaitList) on our queue or on a
// consumer's. Copy up, copy down and compute are all this one queue, so a
// fence on any of them waits for everything submitted before it. OpenCL
// can wait on an event only without a timeout, so wait_fence polls its
// status. A consumer's queue must live in our context: an event of one
// context means nothing to a queue of another.
//
// Views: an OpenCL buffer has no device address. A view's `data` is the
// cl_mem handle and its byte_offset stays separate, as DLPack's kDLOpenCL
// asks.
#include "backends/opencl/opencl_backend_impl.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <system_error>

#include <fmt/ranges.h>

namespace devbridge::opencl {
namespace detail {
namespace {

struct Devices {
  std::vector<DeviceChoice> all;  // platform by platform, device by device
  std::string unavailable;        // why there are none
  std::string remedy;             // what to install so that there are
};

// What a user installs: the ICD loader finds drivers through files in
// /etc/OpenCL/vendors, which each driver package installs.
constexpr const char* kInstallADriver =
    "install an OpenCL driver that registers itself in /etc/OpenCL/vendors (Debian: pocl-opencl-icd for the CPU; "
    "mesa-opencl-icd, intel-opencl-icd or nvidia-opencl-icd for a GPU)";

// The .icd files in the ICD loader's vendors directory, or why it could not
// be read (a directory that does not exist has none).
struct Registered {
  std::vector<std::string> names;
  std::error_code unreadable;
};
Registered registered_drivers(const std::string& directory) {
  Registered found;
  std::error_code error;
  for (std::filesystem::directory_iterator it(directory, error), end; !error && it != end; it.increment(error))
    if (it->path().extension() == ".icd") found.names.push_back(it->path().filename().string());
  if (error && error != std::errc::no_such_file_or_directory) found.unreadable = error;
  std::sort(found.names.begin(), found.names.end());
  return found;
}

Devices enumerate_devices() {
  Devices found;
  const Api& cl = detail::api();
  if (!cl.loaded()) {
    found.unavailable = "no OpenCL ICD loader (" + cl.load_error + ")";
    found.remedy = cl.opened ? "install an OpenCL 1.2 ICD loader (Debian: ocl-icd-libopencl1), or point "
                               "DEVBRIDGE_LIBOPENCL at one"
                             : std::string("install the OpenCL ICD loader (Debian: ocl-icd-libopencl1) or set "
                                           "DEVBRIDGE_LIBOPENCL to its path, and ") +
                                   kInstallADriver;
    return found;
  }
  cl_uint platform_count = 0;
  const cl_int listed = cl.clGetPlatformIDs(0, nullptr, &platform_count);
  if (listed == CL_PLATFORM_NOT_FOUND_KHR || (listed == CL_SUCCESS && platform_count == 0)) {
    // ocl-icd reads $OCL_ICD_VENDORS instead of /etc/OpenCL/vendors when it is set.
    const char* vendors = std::getenv("OCL_ICD_VENDORS");
    const std::string where = vendors != nullptr && *vendors != '\0' ? vendors : "/etc/OpenCL/vendors";
    const Registered registered = registered_drivers(where);
    if (registered.names.empty() && !registered.unreadable) {
      found.unavailable = fmt::format("no OpenCL platform ({} found no driver registered in {})", cl.path, where);
      found.remedy = kInstallADriver;
      return found;
    }
    // Registered, yet none answered: the loader skips a driver it cannot
    // open or whose platform fails, and says nothing.
    rlimit files{};
    const std::string file_limit =
        ::getrlimit(RLIMIT_NOFILE, &files) == 0 ? fmt::format("{}", files.rlim_cur) : std::string("unknown");
    const std::string drivers = registered.unreadable
                                    ? fmt::format("which could not be read either: {}", registered.unreadable.message())
                                    : fmt::format("{}", fmt::join(registered.names, ", "));
    found.unavailable = fmt::format(
        "no OpenCL platform: {} loaded none of the drivers registered in {} ({}); a driver is skipped when its "
        "library or one it needs cannot be loaded, or the process has no file descriptor left (RLIMIT_NOFILE {})",
        cl.path, where, drivers, file_limit);
    found.remedy = "check that the driver's library loads (ldd on the library its .icd file names), raise the open "
                   "file limit (ulimit -n), or reinstall the driver";
    return found;
  }
  if (listed != CL_SUCCESS) {
    found.unavailable = make_error(listed, "clGetPlatformIDs", Operation::Setup).what();
    found.remedy = std::string("check the OpenCL driver's installation, or ") + kInstallADriver;
    return found;
  }
  std::vector<cl_platform_id> platforms(platform_count);
  cl.clGetPlatformIDs(platform_count, platforms.data(), nullptr);
  for (cl_uint p = 0; p < platform_count; ++p) {
    cl_uint device_count = 0;
    if (cl.clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, 0, nullptr, &device_count) != CL_SUCCESS) continue;
    std::vector<cl_device_id> devices(device_count);
    cl.clGetDeviceIDs(platforms[p], CL_DEVICE_TYPE_ALL, device_count, devices.data(), nullptr);
    for (cl_uint d = 0; d < device_count; ++d) {
      const auto type = device_value<cl_device_type>(cl, devices[d], CL_DEVICE_TYPE);
      found.all.push_back(DeviceChoice{platforms[p], devices[d], static_cast<int>(p), static_cast<int>(d),
                                       (type & (CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR)) != 0});
    }
  }
  if (found.all.empty()) {
    found.unavailable = fmt::format("{} OpenCL platform(s), but no device", platform_count);
    found.remedy = "check that the registered drivers' devices are present and enabled (a GPU driver without its "
                   "GPU lists none), or " + std::string(kInstallADriver);
  }
  return found;
}

// Enumerated once per process, for probe() and the factory alike: the
// handles stay valid for the process's whole life.
const Devices& devices() {
  static const Devices found = enumerate_devices();
  return found;
}

// "<platform>:<device>" (e.g. "0:1"), as BackendInfo::device_id gives it.
bool parse_device_id(const std::string& text, Options& options) {
  // Two decimal indexes and nothing else: no sign, space or overflow (sscanf's %d took all three, and an
  // index past int's range wrapped round to another device).
  const auto colon = text.find(':');
  if (colon == std::string::npos) return false;
  const auto index = [](std::string_view digits, int& out) {
    if (digits.empty() || digits.front() < '0' || digits.front() > '9') return false;
    const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), out);
    return error == std::errc{} && end == digits.data() + digits.size();
  };
  int platform = -1, device = -1;
  if (!index(std::string_view(text).substr(0, colon), platform) || !index(std::string_view(text).substr(colon + 1), device))
    return false;
  options.platform = platform;
  options.device = device;
  return true;
}

// The device Options (or $DEVBRIDGE_OPENCL_DEVICE) name, else the first GPU
// or accelerator, else the first device. Null with `why` set when none fits.
const DeviceChoice* choose_device(const Devices& devices, Options options, std::string& why) {
  if (devices.all.empty()) {
    why = devices.unavailable;
    return nullptr;
  }
  if (options.platform < 0 && options.device < 0) {
    if (const char* env = std::getenv("DEVBRIDGE_OPENCL_DEVICE"); env != nullptr && *env != '\0') {
      if (!parse_device_id(env, options)) {
        why = fmt::format("DEVBRIDGE_OPENCL_DEVICE='{}' is not <platform>:<device> (e.g. 0:1)", env);
        return nullptr;
      }
    }
  }
  if (options.platform >= 0 || options.device >= 0) {
    const int platform = options.platform < 0 ? 0 : options.platform;
    const int device = options.device < 0 ? 0 : options.device;
    for (const auto& choice : devices.all) {
      if (choice.platform_index == platform && choice.device_index == device) return &choice;
    }
    why = fmt::format("no OpenCL device {}:{} (platform:device); this machine has {} device(s)", platform, device,
                      devices.all.size());
    return nullptr;
  }
  for (const auto& choice : devices.all) {
    if (choice.gpu) return &choice;
  }
  return &devices.all.front();
}

std::string describe_device(const Api& cl, const DeviceChoice& choice) {
  return fmt::format("{}: {}", platform_text(cl, choice.platform, CL_PLATFORM_NAME),
                     device_text(cl, choice.device, CL_DEVICE_NAME));
}

}  // namespace

OpenCLBackend::OpenCLBackend(const DeviceChoice& choice)
    : cl_(detail::api()), choice_(choice), device_name_(device_text(cl_, choice.device, CL_DEVICE_NAME)) {
  cl_int result = CL_SUCCESS;
  context_ = Owned<cl_context>(cl_.clCreateContext(nullptr, 1, &choice_.device, nullptr, nullptr, &result),
                               {cl_.clReleaseContext});
  check(result, "clCreateContext", Operation::Setup);
  queue_ = make_queue();
  max_buffer_bytes_ = device_value<cl_ulong>(cl_, choice_.device, CL_DEVICE_MAX_MEM_ALLOC_SIZE);
  total_memory_ = device_value<cl_ulong>(cl_, choice_.device, CL_DEVICE_GLOBAL_MEM_SIZE);
  if (const long page = sysconf(_SC_PAGESIZE); page > 0 && is_power_of_two(static_cast<std::uint64_t>(page)))
    page_size_ = static_cast<std::uint64_t>(page);
}

OpenCLBackend::~OpenCLBackend() {
  quiesce();
  std::lock_guard lock(mutex_);
  for (auto& copy : pending_) cl_.clReleaseEvent(copy.done);
  // Not fatal (each event keeps the context alive), but a fence nobody
  // gave back is a leak in the caller's bookkeeping.
  if (const auto left = live_fences_.load(std::memory_order_relaxed); left != 0)
    devbridge::detail::log().warn("devbridge opencl: {} fence(s) never released when the backend closed", left);
}

BackendInfo OpenCLBackend::describe() {
  BackendInfo info;
  info.name = "opencl";
  info.vendor = device_text(cl_, choice_.device, CL_DEVICE_VENDOR);
  info.device_name = device_name_;
  info.device_kind = DeviceKind::OpenCL;
  info.device_ordinal = choice_.device_index;
  info.device_id = fmt::format("{}:{}", choice_.platform_index, choice_.device_index);
  info.pci_bus_id = pci_bus_id();
  info.total_memory = total_memory_;
  info.free_memory = 0;  // OpenCL has no query for it
  // Buffers hold any bytes: every dtype is stored, moved and checkpointed.
  // OpenCL C computes in half and double only with their extensions, and in
  // bfloat16 and the float8s not at all: those are held, never computed in.
  const auto extensions = " " + device_text(cl_, choice_.device, CL_DEVICE_EXTENSIONS) + " ";
  const auto has = [&](std::string_view name) { return extensions.find(fmt::format(" {} ", name)) != std::string::npos; };
  for (const auto& d : all_dtypes()) {
    info.dtypes.push_back(d.dtype);
    const bool computes = d.dtype == DType::Float16   ? has("cl_khr_fp16")
                          : d.dtype == DType::Float64 ? has("cl_khr_fp64")
                                                      : d.dtype != DType::BFloat16 && d.dtype != DType::Fp8E4M3 &&
                                                            d.dtype != DType::Fp8E5M2;
    if (computes) info.compute_dtypes.push_back(d.dtype);
  }
  const auto type = device_value<cl_device_type>(cl_, choice_.device, CL_DEVICE_TYPE);
  info.capabilities.push_back((type & CL_DEVICE_TYPE_GPU)           ? "gpu"
                              : (type & CL_DEVICE_TYPE_ACCELERATOR) ? "accelerator"
                                                                    : "cpu");
  info.capabilities.push_back(device_text(cl_, choice_.device, CL_DEVICE_VERSION));
  for (std::string_view name : {"cl_khr_fp16", "cl_khr_fp64", "cl_khr_pci_bus_info"})
    if (has(name)) info.capabilities.emplace_back(name);
  // The bridge caches freed buffers: clCreateBuffer and clReleaseMemObject
  // cost a driver round trip each. A buffer has no address of its own to
  // split (part_alignment 0: the pool keeps whole blocks).
  info.caches_allocations = true;
  // A CL_MEM_USE_HOST_PTR buffer over memory the device shares is the
  // memory itself: registering costs next to nothing.
  info.cheap_registration = device_value<cl_bool>(cl_, choice_.device, CL_DEVICE_HOST_UNIFIED_MEMORY) == CL_TRUE;
  // The same: mapping a buffer for writing is the buffer's own memory, so a
  // stream (a restore) is written into it once. Not on a device with memory
  // of its own, where a map may stage the whole range in host memory.
  info.maps_for_write = info.cheap_registration;
  info.adopt = true;
  info.consumer_queues = true;
  // A consumer (pyopencl, tinygrad) needs the context to make a queue that
  // may wait on our events and read our buffers.
  info.native_context = reinterpret_cast<std::uintptr_t>(context_.get());
  info.notes = fmt::format(
      "platform {} ({}), device {}:{}; buffers at most {} bytes each; one in-order queue; the ring is a mapped "
      "CL_MEM_ALLOC_HOST_PTR buffer (OpenCL does not say whether it is page-locked)",
      platform_text(cl_, choice_.platform, CL_PLATFORM_NAME), device_text(cl_, choice_.device, CL_DEVICE_VERSION),
      choice_.platform_index, choice_.device_index, max_buffer_bytes_);
  return info;
}

std::string OpenCLBackend::pci_bus_id() const {
  cl_device_pci_bus_info_khr bus{};
  if (cl_.clGetDeviceInfo(choice_.device, CL_DEVICE_PCI_BUS_INFO_KHR, sizeof bus, &bus, nullptr) != CL_SUCCESS)
    return {};
  return fmt::format("{:04x}:{:02x}:{:02x}.{:x}", bus.pci_domain, bus.pci_bus, bus.pci_device, bus.pci_function);
}

void OpenCLBackend::log_failure(cl_int result, std::string_view call, Operation operation) noexcept {
  try {
    devbridge::detail::log().warn("devbridge opencl: {}", make_error(result, call, operation).what());
  } catch (...) {
  }
}

Owned<cl_command_queue> OpenCLBackend::make_queue() {
  cl_int result = CL_SUCCESS;
  Owned<cl_command_queue> queue(cl_.clCreateCommandQueue(context_.get(), choice_.device, 0, &result),
                                {cl_.clReleaseCommandQueue});
  check(result, "clCreateCommandQueue", Operation::Setup);
  return queue;
}

}  // namespace detail

using detail::choose_device;
using detail::describe_device;
using detail::DeviceChoice;
using detail::devices;
using detail::OpenCLBackend;
using detail::parse_device_id;

Probe probe() {
  Probe result;
  result.device_count = static_cast<int>(devices().all.size());
  for (const auto& choice : devices().all) result.has_gpu |= choice.gpu;
  std::string why;
  if (const DeviceChoice* choice = choose_device(devices(), Options{}, why)) {
    result.available = true;
    result.chosen_device = describe_device(detail::api(), *choice);
  } else {
    result.reason = why;
    // With devices present, only $DEVBRIDGE_OPENCL_DEVICE can have missed them.
    result.remedy = devices().all.empty()
                        ? devices().remedy
                        : "unset DEVBRIDGE_OPENCL_DEVICE, or set it to a <platform>:<device> that devbridge info lists";
  }
  return result;
}

std::unique_ptr<Backend> make_opencl_backend(const Options& options) {
  std::string why;
  const DeviceChoice* choice = choose_device(devices(), options, why);
  if (choice == nullptr) throw Error(ErrorKind::Unavailable, "opencl: " + why);
  return std::make_unique<OpenCLBackend>(*choice);
}

std::unique_ptr<Backend> make_opencl_backend(const BackendOptions& options) {
  devbridge::detail::OptionReader reader("opencl", options);
  Options typed;
  if (const auto device = reader.text("device", "<platform>:<device>, as devbridge info lists them");
      device && !parse_device_id(*device, typed))
    reader.refuse("device", *device, "not <platform>:<device> (e.g. 0:1)");
  reader.finish();
  return make_opencl_backend(typed);
}

std::vector<std::string> device_ids() {
  std::vector<std::string> ids;
  for (const auto& choice : devices().all) ids.push_back(fmt::format("{}:{}", choice.platform_index, choice.device_index));
  return ids;
}

bool is_opencl_backend(const Backend& backend) noexcept {
  return dynamic_cast<const OpenCLBackend*>(&backend) != nullptr;
}

}  // namespace devbridge::opencl
