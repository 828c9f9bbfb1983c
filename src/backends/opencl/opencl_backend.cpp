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
#include <fmt/format.h>
#include "core/log.hpp"
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/backend_options.hpp"
#include "backends/opencl/opencl_api.hpp"  // before cl_ext.h: it sets the OpenCL version
#include <CL/cl_ext.h>
#include "backends/opencl/opencl_controls.hpp"
#include "backends/opencl/opencl_errors.hpp"
#include "devbridge/backends/opencl.hpp"
#include "devbridge/checked.hpp"

namespace devbridge::opencl {
namespace {

using detail::Api;
using detail::check;
using detail::make_error;
using detail::Operation;

// How long quiesce waits for the driver's callbacks after clFinish returned.
constexpr std::chrono::seconds kCallbackDrainLimit{30};

// wait_fence polls (clWaitForEvents has no timeout): a few status reads
// catch a fence that is about to pass without a sleep's latency, then sleeps
// that double up to a cap bound both the latency and the cost of a poll.
constexpr int kFenceSpins = 64;
constexpr std::chrono::microseconds kFirstFenceSleep{2};
constexpr std::chrono::microseconds kFenceSleepCap{1000};

// The multiply and the add are rounded separately (no contraction into a
// fused multiply-add, which PoCL does by default), so every element is
// bit-identical to the host and CUDA backends' and the worker can verify
// results exactly. x and y may be the same buffer, hence no restrict.
constexpr char kAxpySource[] = R"CLC(
#pragma OPENCL FP_CONTRACT OFF
kernel void devbridge_axpy(global const float* x, ulong x_offset, global float* y, ulong y_offset,
                           float a, float b, ulong count) {
  const size_t i = get_global_id(0);
  if (i < count) y[y_offset + i] = a * x[x_offset + i] + b;
}
)CLC";

// ---- OpenCL objects, released exactly once ----
template <class Handle>
struct Releaser {
  cl_int(CL_API_CALL* release)(Handle) = nullptr;
  void operator()(Handle handle) const noexcept {
    if (handle != nullptr && release != nullptr) release(handle);
  }
};
template <class Handle>
using Owned = std::unique_ptr<std::remove_pointer_t<Handle>, Releaser<Handle>>;

// ---- info queries ----
std::string trimmed(std::string text) {
  text.resize(std::strlen(text.c_str()));  // drop the terminating NUL the query counts
  return text;
}

// A string property, from clGetDeviceInfo or clGetPlatformInfo (`query`
// takes their last three arguments); empty when the driver has none.
template <class Query>
std::string query_text(Query query) {
  std::size_t size = 0;
  if (query(0, nullptr, &size) != CL_SUCCESS || size == 0) return {};
  std::string text(size, '\0');
  if (query(size, text.data(), nullptr) != CL_SUCCESS) return {};
  return trimmed(std::move(text));
}

std::string device_text(const Api& cl, cl_device_id device, cl_device_info what) {
  return query_text([&](std::size_t size, void* out, std::size_t* needed) {
    return cl.clGetDeviceInfo(device, what, size, out, needed);
  });
}

std::string platform_text(const Api& cl, cl_platform_id platform, cl_platform_info what) {
  return query_text([&](std::size_t size, void* out, std::size_t* needed) {
    return cl.clGetPlatformInfo(platform, what, size, out, needed);
  });
}

template <class T>
T device_value(const Api& cl, cl_device_id device, cl_device_info what) {
  T value{};
  if (cl.clGetDeviceInfo(device, what, sizeof value, &value, nullptr) != CL_SUCCESS) return T{};
  return value;
}

// ---- devices ----
struct DeviceChoice {
  cl_platform_id platform = nullptr;
  cl_device_id device = nullptr;
  int platform_index = 0;
  int device_index = 0;
  bool gpu = false;  // GPU or accelerator
};

struct Devices {
  std::vector<DeviceChoice> all;  // platform by platform, device by device
  std::string unavailable;        // why there are none
};

Devices enumerate_devices() {
  Devices found;
  const Api& cl = detail::api();
  if (!cl.loaded()) {
    found.unavailable = "no OpenCL ICD loader (" + cl.load_error + ")";
    return found;
  }
  cl_uint platform_count = 0;
  const cl_int listed = cl.clGetPlatformIDs(0, nullptr, &platform_count);
  if (listed == CL_PLATFORM_NOT_FOUND_KHR || (listed == CL_SUCCESS && platform_count == 0)) {
    found.unavailable = "no OpenCL platform (no driver registered in /etc/OpenCL/vendors; Debian: pocl-opencl-icd)";
    return found;
  }
  if (listed != CL_SUCCESS) {
    found.unavailable = make_error(listed, "clGetPlatformIDs", Operation::Setup).what();
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
  if (found.all.empty()) found.unavailable = fmt::format("{} OpenCL platform(s), but no device", platform_count);
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
  int platform = -1, device = -1;
  char tail = 0;
  if (std::sscanf(text.c_str(), "%d:%d%c", &platform, &device, &tail) != 2 || platform < 0 || device < 0) return false;
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

cl_mem as_buffer(const DeviceAllocation& allocation) { return reinterpret_cast<cl_mem>(allocation.token); }
cl_event as_event(Fence fence) { return reinterpret_cast<cl_event>(fence.token); }

// The ring's buffer and where it is mapped; HostBlock::token points at it.
struct HostMapping {
  cl_mem buffer = nullptr;
  void* mapped = nullptr;
};

// An async copy the queue has not yet reported.
struct PendingCopy {
  CopyEvent event;
  Operation operation = Operation::Upload;
  cl_event done = nullptr;  // owned: one reference, released when reported
};

class OpenCLBackend final : public Backend {
 public:
  explicit OpenCLBackend(const DeviceChoice& choice)
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

  ~OpenCLBackend() override {
    quiesce();
    std::lock_guard lock(mutex_);
    for (auto& copy : pending_) cl_.clReleaseEvent(copy.done);
    // Not fatal (each event keeps the context alive), but a fence nobody
    // gave back is a leak in the caller's bookkeeping.
    if (const auto left = live_fences_.load(std::memory_order_relaxed); left != 0)
      devbridge::detail::log().warn("devbridge opencl: {} fence(s) never released when the backend closed", left);
  }

  // The bridge caches freed buffers: clCreateBuffer and clReleaseMemObject cost a driver round trip each.
  bool caches_allocations() const override { return true; }

  BackendInfo describe() override {
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
    info.host_memory_page_locked = false;
    // A CL_MEM_USE_HOST_PTR buffer over memory the device shares is the
    // memory itself: registering costs next to nothing.
    info.cheap_registration = device_value<cl_bool>(cl_, choice_.device, CL_DEVICE_HOST_UNIFIED_MEMORY) == CL_TRUE;
    info.notes = fmt::format(
        "platform {} ({}), device {}:{}; buffers at most {} bytes each; one in-order queue; the ring is a mapped "
        "CL_MEM_ALLOC_HOST_PTR buffer (OpenCL does not say whether it is page-locked)",
        platform_text(cl_, choice_.platform, CL_PLATFORM_NAME), device_text(cl_, choice_.device, CL_DEVICE_VERSION),
        choice_.platform_index, choice_.device_index, max_buffer_bytes_);
    return info;
  }

  // "0000:3b:00.0" from cl_khr_pci_bus_info, where the driver has it.
  std::string pci_bus_id() const {
    cl_device_pci_bus_info_khr bus{};
    if (cl_.clGetDeviceInfo(choice_.device, CL_DEVICE_PCI_BUS_INFO_KHR, sizeof bus, &bus, nullptr) != CL_SUCCESS)
      return {};
    return fmt::format("{:04x}:{:02x}:{:02x}.{:x}", bus.pci_domain, bus.pci_bus, bus.pci_device, bus.pci_function);
  }

  // `alignment` holds for every buffer: a buffer has no address of its own,
  // views name it by handle with offsets from its start, and its memory is
  // aligned by the driver (to at least CL_DEVICE_MEM_BASE_ADDR_ALIGN).
  DeviceAllocation allocate(std::uint64_t bytes, std::uint64_t /*alignment*/) override {
    if (bytes > max_buffer_bytes_) {
      throw Error(ErrorKind::AllocationFailed,
                  fmt::format("opencl: {} bytes asked; {} holds at most {} bytes per buffer "
                              "(CL_DEVICE_MAX_MEM_ALLOC_SIZE) of {} bytes of memory",
                              bytes, device_name_, max_buffer_bytes_, total_memory_));
    }
    cl_int result = CL_SUCCESS;
    cl_mem buffer = cl_.clCreateBuffer(context_.get(), CL_MEM_READ_WRITE, bytes, nullptr, &result);
    if (result != CL_SUCCESS) {
      throw make_error(result, "clCreateBuffer", Operation::Allocate,
                       fmt::format("{} bytes asked of {} bytes of device memory (OpenCL reports no free figure)", bytes,
                                   total_memory_));
    }
    live_allocations_.fetch_add(1, std::memory_order_relaxed);
    const auto handle = reinterpret_cast<std::uintptr_t>(buffer);
    return DeviceAllocation{handle, bytes, handle};
  }

  void free(const DeviceAllocation& allocation) noexcept override {
    // The driver keeps the buffer until queued commands that use it finish.
    if (const cl_int result = cl_.clReleaseMemObject(as_buffer(allocation)); result != CL_SUCCESS)
      devbridge::detail::log().warn("devbridge opencl: {}", make_error(result, "clReleaseMemObject", Operation::Release).what());
    live_allocations_.fetch_sub(1, std::memory_order_relaxed);
  }

  HostBlock allocate_host(std::uint64_t bytes) override {
    // One page more than asked, so the block can start on a page boundary
    // (the ring hands out reservations aligned up to 4096). A size within a
    // page of 2^64 would wrap into a tiny buffer the ring then overruns.
    const auto padded = checked::add(bytes, page_size_);
    if (!padded || (max_buffer_bytes_ != 0 && *padded > max_buffer_bytes_)) {
      throw Error(ErrorKind::AllocationFailed,
                  fmt::format("opencl: a host ring of {} bytes (one {}-byte page more, for alignment) is more than {} "
                              "holds in one buffer ({} bytes, CL_DEVICE_MAX_MEM_ALLOC_SIZE)",
                              bytes, page_size_, device_name_, max_buffer_bytes_));
    }
    const std::uint64_t mapped_bytes = *padded;
    cl_int result = CL_SUCCESS;
    Owned<cl_mem> buffer(
        cl_.clCreateBuffer(context_.get(), CL_MEM_READ_WRITE | CL_MEM_ALLOC_HOST_PTR, mapped_bytes, nullptr, &result),
        {cl_.clReleaseMemObject});
    if (result != CL_SUCCESS)
      throw make_error(result, "clCreateBuffer(CL_MEM_ALLOC_HOST_PTR)", Operation::Allocate,
                       fmt::format("{} bytes for a host ring of {} bytes", mapped_bytes, bytes));
    void* mapped = cl_.clEnqueueMapBuffer(queue_.get(), buffer.get(), CL_TRUE, CL_MAP_READ | CL_MAP_WRITE, 0,
                                          mapped_bytes, 0, nullptr, nullptr, &result);
    if (result != CL_SUCCESS)
      throw make_error(result, "clEnqueueMapBuffer", Operation::Allocate,
                       fmt::format("{} bytes for a host ring of {} bytes", mapped_bytes, bytes));
    auto mapping = std::make_unique<HostMapping>(HostMapping{buffer.release(), mapped});
    // Cannot wrap: the mapping is at least a page long, so the next page
    // boundary at or after it lies inside it.
    const auto start = (reinterpret_cast<std::uintptr_t>(mapped) + page_size_ - 1) & ~(page_size_ - 1);
    return HostBlock{reinterpret_cast<std::byte*>(start), bytes, false,
                     reinterpret_cast<std::uintptr_t>(mapping.release())};
  }

  void free_host(const HostBlock& block) noexcept override {
    std::unique_ptr<HostMapping> mapping(reinterpret_cast<HostMapping*>(block.token));
    if (!mapping) return;
    if (const cl_int result =
            cl_.clEnqueueUnmapMemObject(queue_.get(), mapping->buffer, mapping->mapped, 0, nullptr, nullptr);
        result != CL_SUCCESS)
      devbridge::detail::log().warn("devbridge opencl: {}", make_error(result, "clEnqueueUnmapMemObject", Operation::Release).what());
    cl_.clReleaseMemObject(mapping->buffer);
  }

  // A buffer over the caller's memory: CL_MEM_USE_HOST_PTR is how OpenCL
  // lets a driver pin memory it did not allocate (it may also just remember
  // the pointer; OpenCL does not say, so page_locked stays false). Copies
  // keep naming host addresses inside the block, never this buffer: it
  // exists so the driver knows the pages; only an adoption of a read-only
  // region (adopt_host) runs commands on it, which read it.
  HostBlock register_host(std::byte* data, std::uint64_t bytes) override {
    return register_pages(data, bytes, CL_MEM_READ_WRITE);
  }
  HostBlock register_host_read_only(const std::byte* data, std::uint64_t bytes) override {
    return register_pages(const_cast<std::byte*>(data), bytes, CL_MEM_READ_ONLY);
  }

  HostBlock register_pages(std::byte* data, std::uint64_t bytes, cl_mem_flags access) {
    const auto where = [&] {
      return fmt::format("registering {} bytes of host memory at {}", bytes, static_cast<const void*>(data));
    };
    // Refused before the driver sees it, in the words it would use: OpenCL
    // has no empty buffer and none past the device's per-buffer limit.
    if (bytes == 0 || (max_buffer_bytes_ != 0 && bytes > max_buffer_bytes_))
      throw Error(ErrorKind::InvalidExtent,
                  fmt::format("opencl: {}: {} holds buffers of 1 to {} bytes (CL_DEVICE_MAX_MEM_ALLOC_SIZE)", where(),
                              device_name_, max_buffer_bytes_));
    cl_int result = CL_SUCCESS;
    cl_mem buffer = cl_.clCreateBuffer(context_.get(), access | CL_MEM_USE_HOST_PTR, bytes, data, &result);
    if (result != CL_SUCCESS) {
      const std::string failure = fmt::format("clCreateBuffer(CL_MEM_USE_HOST_PTR): {} ({}); {}",
                                              detail::error_name(result), result, where());
      switch (result) {
        case CL_INVALID_BUFFER_SIZE:
          throw Error(ErrorKind::InvalidExtent,
                      fmt::format("{} ({} holds buffers of at most {} bytes, CL_DEVICE_MAX_MEM_ALLOC_SIZE)", failure,
                                  device_name_, max_buffer_bytes_));
        // The driver could not pin or track this much: the registration
        // fails, the device does not (unlike a queue's CL_OUT_OF_RESOURCES,
        // nothing was enqueued that could be left half done).
        case CL_MEM_OBJECT_ALLOCATION_FAILURE:
        case CL_OUT_OF_RESOURCES:
        case CL_OUT_OF_HOST_MEMORY:
          throw Error(ErrorKind::AllocationFailed, failure);
        default:
          throw make_error(result, "clCreateBuffer(CL_MEM_USE_HOST_PTR)", Operation::Allocate, where());
      }
    }
    live_registrations_.fetch_add(1, std::memory_order_relaxed);
    return HostBlock{data, bytes, false, reinterpret_cast<std::uintptr_t>(buffer)};
  }

  // The bridge unregisters only once no copy or adoption uses the memory,
  // and no command ever wrote the buffer: the driver has nothing to write
  // back into the caller's memory (and keeps the buffer itself until
  // commands that read it finish).
  void unregister_host(const HostBlock& block) noexcept override {
    if (block.token == 0) return;
    if (const cl_int result = cl_.clReleaseMemObject(reinterpret_cast<cl_mem>(block.token)); result != CL_SUCCESS)
      log_failure(result, "clReleaseMemObject(registered host memory)", Operation::Release);
    live_registrations_.fetch_sub(1, std::memory_order_relaxed);
  }

  // A read-only region's CL_MEM_USE_HOST_PTR buffer used as an allocation:
  // on a device that shares host memory (PoCL, an integrated GPU) it is the
  // memory itself; elsewhere the driver may keep a copy on the device, which
  // stays right because nothing ever writes the memory. The whole region is
  // its buffer, retained; a range of it a sub-buffer, which OpenCL lets
  // start only at multiples of CL_DEVICE_MEM_BASE_ADDR_ALIGN.
  DeviceAllocation adopt_host(const HostBlock& region, std::uint64_t offset, std::uint64_t bytes) override {
    const auto whole = reinterpret_cast<cl_mem>(region.token);
    const auto where = [&] {
      return fmt::format("adopting bytes [{}, +{}) of host memory registered at {}", offset, bytes,
                         static_cast<const void*>(region.data));
    };
    cl_mem buffer = whole;
    if (offset == 0 && bytes == region.bytes) {
      check(cl_.clRetainMemObject(whole), "clRetainMemObject", Operation::Allocate);
    } else {
      const auto align_bits = device_value<cl_uint>(cl_, choice_.device, CL_DEVICE_MEM_BASE_ADDR_ALIGN);
      const std::uint64_t align = std::max<std::uint64_t>(align_bits / 8, 1);
      if (offset % align != 0)
        throw Error(ErrorKind::InvalidAlignment,
                    fmt::format("opencl: {}: a part of a buffer must start at a multiple of {} bytes on {} "
                                "(CL_DEVICE_MEM_BASE_ADDR_ALIGN)",
                                where(), align, device_name_));
      const cl_buffer_region part{offset, bytes};
      cl_int result = CL_SUCCESS;
      buffer = cl_.clCreateSubBuffer(whole, CL_MEM_READ_ONLY, CL_BUFFER_CREATE_TYPE_REGION, &part, &result);
      if (result != CL_SUCCESS) throw make_error(result, "clCreateSubBuffer", Operation::Allocate, where());
    }
    const auto handle = reinterpret_cast<std::uintptr_t>(buffer);
    return DeviceAllocation{handle, bytes, handle};
  }

  void release_adopted(const DeviceAllocation& adopted) noexcept override {
    if (const cl_int result = cl_.clReleaseMemObject(as_buffer(adopted)); result != CL_SUCCESS)
      log_failure(result, "clReleaseMemObject(adopted host memory)", Operation::Release);
  }

  void submit_copy(const CopyRequest& request) override {
    const bool upload = request.direction == CopyDirection::HostToDevice;
    const Operation operation = upload ? Operation::Upload : Operation::Download;
    const bool pitched = request.layout.pitched();
    const char* call = pitched ? (upload ? "clEnqueueWriteBufferRect" : "clEnqueueReadBufferRect")
                               : (upload ? "clEnqueueWriteBuffer" : "clEnqueueReadBuffer");
    const auto fail = [&](cl_int result) -> Error {
      Error error = make_error(result, call, operation, describe_copy(request));
      if (error.fatal()) mark_queue_unusable();
      return error;
    };

    // The bridge has checked the range; a range that slips through is refused
    // here as the seam's InvalidRange rather than as a driver error.
    if (pitched) {
      check_pitched(request, call);
    } else if (!checked::range_within(request.device_offset, request.len, request.device.bytes)) {
      throw Error(ErrorKind::InvalidRange,
                  fmt::format("opencl {}: device range [{}, +{}) outside a buffer of {} bytes", call,
                              request.device_offset, request.len, request.device.bytes));
    }

    if (request.mode == CopyMode::Sync) {
      if (const cl_int result = enqueue_copy(request, CL_TRUE, nullptr, nullptr); result != CL_SUCCESS)
        throw fail(result);
      return;
    }

    Owned<cl_event> gate = hold_gate();
    cl_event gate_event = gate.get();
    cl_event done = nullptr;
    if (const cl_int result = enqueue_copy(request, CL_FALSE, gate_event ? &gate_event : nullptr, &done);
        result != CL_SUCCESS)
      throw fail(result);
    try {
      std::lock_guard lock(mutex_);
      pending_.push_back(PendingCopy{request.event, operation, done});
    } catch (const std::bad_alloc&) {
      // Untracked, the copy would outlive the bridge's record of it: finish
      // it before reporting the failure, so its host range is free to reuse.
      cl_.clWaitForEvents(1, &done);
      cl_.clReleaseEvent(done);
      throw Error(backends::operation_kind(operation), "opencl: out of host memory to track an async copy");
    }
    // The callback only wakes waiters; it holds its own event reference.
    bool callback_set = false;
    if (cl_.clRetainEvent(done) == CL_SUCCESS) {
      callbacks_outstanding_.fetch_add(1, std::memory_order_relaxed);
      if (cl_.clSetEventCallback(done, CL_COMPLETE, &OpenCLBackend::on_command_finished, this) == CL_SUCCESS) {
        callback_set = true;
      } else {
        callbacks_outstanding_.fetch_sub(1, std::memory_order_relaxed);
        cl_.clReleaseEvent(done);
      }
    }
    if (const cl_int result = cl_.clFlush(queue_.get()); result != CL_SUCCESS)
      devbridge::detail::log().warn("devbridge opencl: {}", make_error(result, "clFlush", operation).what());
    // Without a callback nobody would wake a waiter: finish the copy here
    // (it is still reported through drain_completions like any other).
    if (!callback_set) cl_.clWaitForEvents(1, &done);
  }

  void drain_completions(std::vector<Completion>& out) override {
    std::lock_guard lock(mutex_);
    while (!pending_.empty()) {
      const PendingCopy& copy = pending_.front();
      cl_int status = CL_QUEUED;
      const cl_int queried = execution_status(copy.done, status);
      if (queried == CL_SUCCESS && status > CL_COMPLETE) break;  // still queued, submitted or running
      Completion completion;
      completion.event = copy.event;
      if (queried != CL_SUCCESS || status != CL_COMPLETE) {
        const cl_int code = queried != CL_SUCCESS ? queried : status;
        const Error error =
            make_error(code, copy.operation == Operation::Upload ? "async upload" : "async download", copy.operation);
        completion.ok = false;
        completion.error = error.kind();
        completion.message = error.what();
        completion.fatal = error.fatal();
        if (error.fatal()) queue_unusable_ = true;
      }
      out.push_back(std::move(completion));
      cl_.clReleaseEvent(copy.done);
      pending_.pop_front();
    }
  }

  bool wait_for_completions(std::chrono::nanoseconds timeout) override {
    // wait_for would add a huge timeout to now() and wrap (returning at
    // once); the deadline saturates instead and "never" waits until done.
    const auto deadline = checked::deadline_after(timeout);
    const auto seen = finished_signals_.load(std::memory_order_acquire);
    if (front_finished()) return true;
    std::unique_lock lock(signal_mutex_);
    const auto signalled = [&] { return finished_signals_.load(std::memory_order_acquire) != seen; };
    if (deadline == checked::Clock::time_point::max()) {
      signal_cv_.wait(lock, signalled);
      return true;
    }
    return signal_cv_.wait_until(lock, deadline, signalled);
  }

  void quiesce() override {
    hold_copies(false);
    // Unlike a faulted CUDA context, a queue whose clFinish failed gives no
    // promise that its commands stopped, and the fences on it may never
    // pass: the quiesce fails, so the bridge frees nothing the device may still touch,
    // and a later restart retries it.
    if (const cl_int result = cl_.clFinish(queue_.get()); result != CL_SUCCESS) {
      mark_queue_unusable();
      const Error error = make_error(result, "clFinish", Operation::Release, "quiesce");
      throw Error(error.kind(), error.message(), /*fatal=*/true);
    }
    // clFinish returns when the commands are done; their callbacks may still
    // be running on the driver's threads, and they point at this backend.
    {
      std::unique_lock lock(signal_mutex_);
      if (!signal_cv_.wait_for(lock, kCallbackDrainLimit,
                               [&] { return callbacks_outstanding_.load(std::memory_order_acquire) == 0; }))
        throw Error(ErrorKind::Unavailable,
                    fmt::format("opencl quiesce: {} event callbacks have not run yet; they point at this backend",
                                callbacks_outstanding_.load()),
                    /*fatal=*/true);
    }
    // After a fatal failure the in-order queue has no defined state: start a
    // new one (the bridge calls quiesce from restart, with no other call in
    // flight), so a restart recovers.
    bool replace;
    {
      std::lock_guard lock(mutex_);
      replace = std::exchange(queue_unusable_, false);
    }
    if (replace) {
      try {
        queue_ = make_queue();
      } catch (const Error& e) {
        devbridge::detail::log().error("devbridge opencl: a new queue after a fatal failure: {}", e.what());
      }
    }
  }

  Fence launch_axpy(const AxpyLaunch& launch) override {
    // Whole float32 elements inside each buffer (the kernel indexes by element).
    const auto bytes = checked::mul(launch.count, sizeof(float));
    for (const auto& [buffer, offset] : {std::pair{launch.x, launch.x_offset}, std::pair{launch.y, launch.y_offset}}) {
      if (!bytes || offset % sizeof(float) != 0 || !checked::range_within(offset, *bytes, buffer.bytes))
        throw Error(ErrorKind::InvalidRange,
                    fmt::format("opencl axpy: {} float32 at byte offset {} do not fit a buffer of {} bytes",
                                launch.count, offset, buffer.bytes));
    }
    if (launch.count == 0) return Fence{};  // nothing runs; OpenCL refuses an empty NDRange anyway
    Owned<cl_event> gate = hold_gate();
    cl_event gate_event = gate.get();
    std::lock_guard guard(launch_mutex_);  // clSetKernelArg is not thread-safe on one kernel
    cl_kernel kernel = axpy_kernel();
    cl_mem x = as_buffer(launch.x);
    cl_mem y = as_buffer(launch.y);
    const cl_ulong x_offset = launch.x_offset / sizeof(float);
    const cl_ulong y_offset = launch.y_offset / sizeof(float);
    const cl_ulong count = launch.count;
    const auto set = [&](cl_uint index, std::size_t size, const void* value) {
      check(cl_.clSetKernelArg(kernel, index, size, value), "clSetKernelArg", Operation::Launch);
    };
    set(0, sizeof x, &x);
    set(1, sizeof x_offset, &x_offset);
    set(2, sizeof y, &y);
    set(3, sizeof y_offset, &y_offset);
    set(4, sizeof launch.a, &launch.a);
    set(5, sizeof launch.b, &launch.b);
    set(6, sizeof count, &count);
    const std::size_t global = static_cast<std::size_t>(launch.count);
    // The kernel's own event is the fence: it is created by the enqueue
    // itself, so there is no moment where the kernel runs untracked.
    cl_event done = nullptr;
    if (const cl_int result = cl_.clEnqueueNDRangeKernel(queue_.get(), kernel, 1, nullptr, &global, nullptr,
                                                         gate_event != nullptr ? 1 : 0,
                                                         gate_event != nullptr ? &gate_event : nullptr, &done);
        result != CL_SUCCESS) {
      Error error = make_error(result, "clEnqueueNDRangeKernel", Operation::Launch,
                               fmt::format("axpy over {} elements", launch.count));
      if (error.fatal()) mark_queue_unusable();
      throw error;
    }
    const Fence fence = adopt_fence(done);
    // The launch is queued whatever happens now, and its fence must reach the
    // bridge: a failed flush is logged, not thrown (the next flush or
    // quiesce's clFinish submits it).
    if (const cl_int result = cl_.clFlush(queue_.get()); result != CL_SUCCESS)
      log_failure(result, "clFlush", Operation::Launch);
    return fence;
  }

  // ---- fences ----
  Fence record_fence(const QueueRef& where) override {
    switch (where.queue) {
      case Queue::CopyUp:
      case Queue::CopyDown:
      case Queue::Compute:
        return record_marker(queue_.get(), /*ours=*/true, "the bridge's queue");
      case Queue::Consumer: {
        cl_command_queue consumer = consumer_queue(where.consumer, "record a fence on");
        return record_marker(consumer, /*ours=*/false, fmt::format("consumer queue {:#x}", where.consumer));
      }
    }
    throw Error(ErrorKind::Unsupported,
                fmt::format("opencl record_fence: no queue {}", static_cast<unsigned>(where.queue)));
  }

  bool fence_passed(Fence fence) override {
    if (!fence.pending()) return true;
    cl_event event = as_event(fence);
    cl_int status = CL_QUEUED;
    if (const cl_int queried = execution_status(event, status); queried != CL_SUCCESS)
      throw make_error(queried, "clGetEventInfo(CL_EVENT_COMMAND_EXECUTION_STATUS)", Operation::Query,
                       "testing a fence");
    if (status > CL_COMPLETE) return false;  // queued, submitted or running
    // A negative status: the command was terminated abnormally and nothing
    // of it runs any more, so whatever the fence holds may go.
    if (status < 0) note_failed_fence(event, status);
    return true;
  }

  bool wait_fence(Fence fence, std::chrono::nanoseconds timeout) override {
    const auto deadline = checked::deadline_after(timeout);
    std::chrono::nanoseconds pause = kFirstFenceSleep;
    for (int polls = 0;; ++polls) {
      if (fence_passed(fence)) return true;
      const auto now = checked::Clock::now();
      if (now >= deadline) return false;
      if (polls < kFenceSpins) {
        std::this_thread::yield();
        continue;
      }
      // deadline - now is positive here, and representable even when the
      // deadline is the clock's end of time.
      std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(pause, deadline - now));
      pause = std::min<std::chrono::nanoseconds>(pause * 2, kFenceSleepCap);
    }
  }

  void release_fence(Fence fence) noexcept override {
    if (!fence.pending()) return;
    if (const cl_int result = cl_.clReleaseEvent(as_event(fence)); result != CL_SUCCESS)
      log_failure(result, "clReleaseEvent(fence)", Operation::Release);
    live_fences_.fetch_sub(1, std::memory_order_relaxed);
  }

  // ---- capabilities ----
  // A consumer (pyopencl, tinygrad) needs the context to make a queue that
  // may wait on our events and read our buffers.
  std::uintptr_t native_context() override { return reinterpret_cast<std::uintptr_t>(context_.get()); }

  void order_consumer_queue(std::uintptr_t handle) override {
    cl_command_queue consumer = consumer_queue(handle, "order");
    const Fence marker = record_marker(queue_.get(), /*ours=*/true, "the bridge's queue, to order a consumer after");
    cl_event after = as_event(marker);
    const cl_int result = cl_.clEnqueueBarrierWithWaitList(consumer, 1, &after, nullptr);
    // The barrier keeps what it waits for alive on its own: our reference can go.
    release_fence(marker);
    if (result != CL_SUCCESS)
      throw make_error(result, "clEnqueueBarrierWithWaitList", Operation::Query,
                       fmt::format("ordering consumer queue {:#x} after the bridge's work", handle));
    // Their queue's later commands would submit the barrier too; flushing
    // now lets it start waiting at once.
    if (const cl_int flushed = cl_.clFlush(consumer); flushed != CL_SUCCESS)
      log_failure(flushed, "clFlush(consumer queue)", Operation::Query);
  }

  // ---- observation and test controls ----
  std::uint64_t live_allocations() const noexcept override { return live_allocations_.load(std::memory_order_relaxed); }
  std::uint64_t live_fences() const noexcept { return live_fences_.load(std::memory_order_relaxed); }
  std::uint64_t live_registrations() const noexcept { return live_registrations_.load(std::memory_order_relaxed); }

  void hold_copies(bool hold) override {
    if (hold) {
      std::lock_guard lock(mutex_);
      if (hold_ != nullptr) return;
      cl_int result = CL_SUCCESS;
      hold_ = cl_.clCreateUserEvent(context_.get(), &result);
      check(result, "clCreateUserEvent", Operation::Setup);
      return;
    }
    cl_event released;
    {
      std::lock_guard lock(mutex_);
      released = std::exchange(hold_, nullptr);
    }
    if (released == nullptr) return;
    cl_.clSetUserEventStatus(released, CL_COMPLETE);
    cl_.clReleaseEvent(released);
    cl_.clFlush(queue_.get());
  }

 private:
  static void CL_CALLBACK on_command_finished(cl_event event, cl_int /*status*/, void* user) {
    auto* self = static_cast<OpenCLBackend*>(user);
    self->cl_.clReleaseEvent(event);  // the reference submit_copy took for this callback
    // Under signal_mutex_ so that quiesce, once it sees no callback
    // outstanding, knows none touches the backend any more.
    std::lock_guard lock(self->signal_mutex_);
    self->finished_signals_.fetch_add(1, std::memory_order_release);
    self->callbacks_outstanding_.fetch_sub(1, std::memory_order_release);
    self->signal_cv_.notify_all();
  }

  // The hold's user event with one reference of ours (null when nothing is
  // held): lifting the hold between this and the enqueue that waits on it
  // then cannot free it under the enqueue.
  Owned<cl_event> hold_gate() {
    Owned<cl_event> gate(nullptr, {cl_.clReleaseEvent});
    std::lock_guard lock(mutex_);
    if (hold_ != nullptr && cl_.clRetainEvent(hold_) == CL_SUCCESS) gate.reset(hold_);
    return gate;
  }

  // Takes over the one reference the enqueue gave us.
  Fence adopt_fence(cl_event event) noexcept {
    live_fences_.fetch_add(1, std::memory_order_relaxed);
    return Fence{reinterpret_cast<std::uintptr_t>(event)};
  }

  // A marker waits for everything enqueued before it on an in-order queue.
  // Flushed, or a driver may never submit it and the fence never passes;
  // a marker that cannot be flushed is given back and the failure thrown
  // (nothing but the marker was enqueued, so nothing goes untracked).
  Fence record_marker(cl_command_queue queue, bool ours, std::string_view where) {
    cl_event marker = nullptr;
    if (const cl_int result = cl_.clEnqueueMarkerWithWaitList(queue, 0, nullptr, &marker); result != CL_SUCCESS) {
      Error error = make_error(result, "clEnqueueMarkerWithWaitList", Operation::Query, where);
      if (error.fatal() && ours) mark_queue_unusable();
      throw error;
    }
    Owned<cl_event> owned(marker, {cl_.clReleaseEvent});
    if (const cl_int result = cl_.clFlush(queue); result != CL_SUCCESS) {
      Error error = make_error(result, "clFlush", Operation::Query, where);
      if (error.fatal() && ours) mark_queue_unusable();
      throw error;
    }
    return adopt_fence(owned.release());
  }

  // A consumer's queue, refused unless it lives in our context (an event of
  // ours means nothing to a queue of another context, and its commands could
  // not name our buffers).
  cl_command_queue consumer_queue(std::uintptr_t handle, std::string_view doing) {
    if (handle == 0)
      throw Error(ErrorKind::Unsupported,
                  fmt::format("opencl: cannot {} consumer queue 0: OpenCL has no default queue; pass a "
                              "cl_command_queue made on this bridge's context (native_context)",
                              doing));
    auto* queue = reinterpret_cast<cl_command_queue>(handle);
    cl_context context = nullptr;
    if (const cl_int result =
            cl_.clGetCommandQueueInfo(queue, CL_QUEUE_CONTEXT, sizeof context, &context, nullptr);
        result != CL_SUCCESS)
      throw make_error(result, "clGetCommandQueueInfo(CL_QUEUE_CONTEXT)", Operation::Query,
                       fmt::format("consumer queue {:#x} is not a usable cl_command_queue", handle));
    if (context != context_.get())
      throw Error(ErrorKind::ForeignDomain,
                  fmt::format("opencl: cannot {} consumer queue {:#x}: it belongs to OpenCL context {}, not to this "
                              "bridge's context {} (make the queue on native_context())",
                              doing, handle, static_cast<const void*>(context),
                              static_cast<const void*>(context_.get())));
    return queue;
  }

  // A command behind a fence ended abnormally. A launch has no completion to
  // report it through, so it is logged here; and if it ran on our queue,
  // that queue has no defined state any more: the next quiesce replaces it.
  void note_failed_fence(cl_event event, cl_int status) {
    cl_command_queue queue = nullptr;
    const bool ours = cl_.clGetEventInfo(event, CL_EVENT_COMMAND_QUEUE, sizeof queue, &queue, nullptr) == CL_SUCCESS &&
                      queue != nullptr && queue == queue_.get();
    const bool poisoned = ours && detail::classify(status, Operation::Launch).fatal;
    if (poisoned) mark_queue_unusable();
    try {
      devbridge::detail::log().warn("devbridge opencl: a command before a fence on {} ended abnormally: {} ({}){}",
                                    ours ? "the bridge's queue" : "another queue", detail::error_name(status), status,
                                    poisoned ? "; the queue is replaced at the next restart" : "");
    } catch (...) {
      // Logging is best effort; the fence has passed either way.
    }
  }

  // For failures that must not throw: after work is queued (its fence has to
  // reach the bridge) and in noexcept paths. Building the message may itself
  // fail (out of memory); then only the log line is lost.
  static void log_failure(cl_int result, std::string_view call, Operation operation) noexcept {
    try {
      devbridge::detail::log().warn("devbridge opencl: {}", make_error(result, call, operation).what());
    } catch (...) {
    }
  }

  Owned<cl_command_queue> make_queue() {
    cl_int result = CL_SUCCESS;
    Owned<cl_command_queue> queue(cl_.clCreateCommandQueue(context_.get(), choice_.device, 0, &result),
                                  {cl_.clReleaseCommandQueue});
    check(result, "clCreateCommandQueue", Operation::Setup);
    return queue;
  }

  // The one place sync and async copies differ from 1-D to pitched: every
  // other step (hold gate, event, callback, completion) is shared.
  cl_int enqueue_copy(const CopyRequest& request, cl_bool blocking, const cl_event* wait_for, cl_event* done) {
    cl_mem buffer = as_buffer(request.device);
    const cl_uint waits = wait_for != nullptr ? 1 : 0;
    const bool upload = request.direction == CopyDirection::HostToDevice;
    if (request.layout.pitched()) {
      const CopyLayout& layout = request.layout;
      // OpenCL refuses a row pitch shorter than region[0] even when there is
      // no second row to step to; one row spans exactly its own bytes.
      // (check_pitched made sure every value fits a size_t.)
      const auto size = [](std::uint64_t value) { return static_cast<std::size_t>(value); };
      const std::size_t device_pitch = size(layout.rows == 1 ? layout.row_bytes : layout.device_pitch);
      const std::size_t host_pitch = size(layout.rows == 1 ? layout.row_bytes : layout.host_pitch);
      const std::size_t buffer_origin[3] = {size(request.device_offset), 0, 0};
      const std::size_t host_origin[3] = {0, 0, 0};
      const std::size_t region[3] = {size(layout.row_bytes), size(layout.rows), 1};
      // Slice pitches 0: one slice, so OpenCL derives them and never steps them.
      if (upload)
        return cl_.clEnqueueWriteBufferRect(queue_.get(), buffer, blocking, buffer_origin, host_origin, region,
                                            device_pitch, 0, host_pitch, 0, request.host, waits, wait_for, done);
      return cl_.clEnqueueReadBufferRect(queue_.get(), buffer, blocking, buffer_origin, host_origin, region,
                                         device_pitch, 0, host_pitch, 0, request.host, waits, wait_for, done);
    }
    if (upload)
      return cl_.clEnqueueWriteBuffer(queue_.get(), buffer, blocking, request.device_offset, request.len, request.host,
                                      waits, wait_for, done);
    return cl_.clEnqueueReadBuffer(queue_.get(), buffer, blocking, request.device_offset, request.len, request.host,
                                   waits, wait_for, done);
  }

  // What a failed copy's message names: the range, and for a pitched copy
  // its rows and pitches.
  static std::string describe_copy(const CopyRequest& request) {
    if (!request.layout.pitched())
      return fmt::format("{} bytes at device offset {}", request.len, request.device_offset);
    const CopyLayout& layout = request.layout;
    return fmt::format("{} rows of {} bytes at device offset {} (device pitch {}, host pitch {}, host {})",
                       layout.rows, layout.row_bytes, request.device_offset, layout.device_pitch, layout.host_pitch,
                       static_cast<const void*>(request.host));
  }

  // A pitched request the driver would refuse, or that would reach past the
  // buffer, is the seam's InvalidRange naming the rows at fault, not a copy
  // failure (the bridge checks the same; this is the backend's own word).
  static void check_pitched(const CopyRequest& request, const char* call) {
    const CopyLayout& layout = request.layout;
    if (layout.row_bytes == 0)
      throw Error(ErrorKind::InvalidRange,
                  fmt::format("opencl {}: {} rows of 0 bytes move nothing (OpenCL refuses an empty region)", call,
                              layout.rows));
    // Both throw InvalidRange naming the pitch when rows would overlap or
    // the span does not fit in 64 bits.
    const std::uint64_t device_span = layout_device_span(layout);
    (void)layout_host_span(layout);
    if (const auto moved = checked::mul(layout.rows, layout.row_bytes); !moved || *moved != request.len)
      throw Error(ErrorKind::InvalidRange,
                  fmt::format("opencl {}: a copy of {} bytes does not match its {} rows of {} bytes", call,
                              request.len, layout.rows, layout.row_bytes));
    if (!checked::range_within(request.device_offset, device_span, request.device.bytes))
      throw Error(ErrorKind::InvalidRange,
                  fmt::format("opencl {}: device range [{}, +{}) ({} rows of {} bytes at a pitch of {}) outside a "
                              "buffer of {} bytes",
                              call, request.device_offset, device_span, layout.rows, layout.row_bytes,
                              layout.device_pitch, request.device.bytes));
    // size_t is what the driver takes; on a 32-bit host a span past it would wrap.
    if constexpr (sizeof(std::size_t) < sizeof(std::uint64_t)) {
      constexpr std::uint64_t kMax = static_cast<std::size_t>(-1);
      if (request.device_offset > kMax || device_span > kMax - request.device_offset ||
          layout.device_pitch > kMax || layout.host_pitch > kMax)
        throw Error(ErrorKind::InvalidRange,
                    fmt::format("opencl {}: device range [{}, +{}) or its pitches do not fit this host's size_t",
                                call, request.device_offset, device_span));
    }
  }

  bool front_finished() {
    std::lock_guard lock(mutex_);
    if (pending_.empty()) return false;
    cl_int status = CL_QUEUED;
    return execution_status(pending_.front().done, status) != CL_SUCCESS || status <= CL_COMPLETE;
  }

  // CL_COMPLETE, a negative code for a command that failed, or a positive
  // one (queued, submitted, running) for a command not finished.
  cl_int execution_status(cl_event event, cl_int& status) const {
    return cl_.clGetEventInfo(event, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, nullptr);
  }

  void mark_queue_unusable() {
    std::lock_guard lock(mutex_);
    queue_unusable_ = true;
  }

  // Built on first use: compiling costs PoCL a noticeable fraction of a
  // second, and most bridges never launch.
  cl_kernel axpy_kernel() {
    if (axpy_) return axpy_.get();
    cl_int result = CL_SUCCESS;
    const char* source = kAxpySource;
    const std::size_t length = sizeof kAxpySource - 1;
    Owned<cl_program> program(cl_.clCreateProgramWithSource(context_.get(), 1, &source, &length, &result),
                              {cl_.clReleaseProgram});
    check(result, "clCreateProgramWithSource", Operation::Launch);
    if (const cl_int built = cl_.clBuildProgram(program.get(), 1, &choice_.device, "", nullptr, nullptr);
        built != CL_SUCCESS) {
      std::string log(4096, '\0');
      std::size_t log_size = 0;
      cl_.clGetProgramBuildInfo(program.get(), choice_.device, CL_PROGRAM_BUILD_LOG, log.size(), log.data(), &log_size);
      throw make_error(built, "clBuildProgram", Operation::Launch, "axpy kernel: " + trimmed(std::move(log)));
    }
    Owned<cl_kernel> kernel(cl_.clCreateKernel(program.get(), "devbridge_axpy", &result), {cl_.clReleaseKernel});
    check(result, "clCreateKernel", Operation::Launch);
    program_ = std::move(program);
    axpy_ = std::move(kernel);
    return axpy_.get();
  }

  const Api& cl_;
  const DeviceChoice choice_;
  const std::string device_name_;
  // Declared first, destroyed last: everything below lives in it.
  Owned<cl_context> context_{nullptr, {}};
  Owned<cl_command_queue> queue_{nullptr, {}};
  std::uint64_t max_buffer_bytes_ = 0;
  std::uint64_t total_memory_ = 0;
  std::uint64_t page_size_ = 4096;

  std::mutex launch_mutex_;  // guards the kernel and its arguments
  Owned<cl_program> program_{nullptr, {}};
  Owned<cl_kernel> axpy_{nullptr, {}};

  std::mutex mutex_;  // guards pending_, hold_ and queue_unusable_; held around OpenCL queries, never in a callback
  std::deque<PendingCopy> pending_;
  cl_event hold_ = nullptr;  // the user event held copies wait for
  bool queue_unusable_ = false;

  std::mutex signal_mutex_;  // only for the callbacks' wake-ups; never held around an OpenCL call
  std::condition_variable signal_cv_;
  std::atomic<std::uint64_t> finished_signals_{0};
  std::atomic<std::uint64_t> callbacks_outstanding_{0};

  std::atomic<std::uint64_t> live_allocations_{0};     // device buffers only, not registrations
  std::atomic<std::uint64_t> live_registrations_{0};   // host memory under a CL_MEM_USE_HOST_PTR buffer
  std::atomic<std::uint64_t> live_fences_{0};  // fences handed out and not yet released
};

OpenCLBackend& as_opencl(Backend& backend) {
  if (auto* opencl = dynamic_cast<OpenCLBackend*>(&backend)) return *opencl;
  throw Error(ErrorKind::Unsupported, "not an OpenCL backend");
}

}  // namespace

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

std::uint64_t live_allocations(const Backend& backend) {
  if (const auto* opencl = dynamic_cast<const OpenCLBackend*>(&backend)) return opencl->live_allocations();
  throw Error(ErrorKind::Unsupported, "not an OpenCL backend");
}

void hold_copies(Backend& backend, bool hold) { as_opencl(backend).hold_copies(hold); }

std::uint64_t live_fences(const Backend& backend) {
  if (const auto* opencl = dynamic_cast<const OpenCLBackend*>(&backend)) return opencl->live_fences();
  throw Error(ErrorKind::Unsupported, "not an OpenCL backend");
}

std::uint64_t detail::live_registrations(const Backend& backend) {
  if (const auto* opencl = dynamic_cast<const OpenCLBackend*>(&backend)) return opencl->live_registrations();
  throw Error(ErrorKind::Unsupported, "not an OpenCL backend");
}

}  // namespace devbridge::opencl
