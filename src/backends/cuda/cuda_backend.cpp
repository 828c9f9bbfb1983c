// The CUDA backend: device memory from cuMemAlloc, the ring from
// cuMemHostAlloc (and the caller's memory pinned with cuMemHostRegister),
// copies on two non-blocking streams (one per direction, so uploads and
// downloads overlap; a pitched copy is one cuMemcpy2DAsync), one pooled
// event per asynchronous copy, and the compute role on a third stream
// ordered by stream-event waits.
//
// Ordering between the three streams (all on the device, never a host wait):
//   - copies in one direction run in submission order (one stream each);
//   - a copy waits for the newest earlier copy of the other direction whose
//     device or host bytes overlap its own (read-after-write, write-after-
//     read, write-after-write); copies of unrelated bytes never wait for each
//     other, which is what lets uploads and downloads overlap (duplex);
//   - a launch waits for every upload and download submitted before it
//     (so it reads uploaded bytes and never overwrites bytes still being
//     downloaded);
//   - a copy submitted after a launch returns waits for that launch (so a
//     download reads the result, and an upload never overwrites an input the
//     kernel is still reading).
//
// Fences (the seam's Queue/Fence) are CUevents, and a fence's token is its
// CUevent. They come from a pool of their own, apart from the copies' events:
// a fence is the bridge's until release_fence, so its event can never be
// recycled under a copy that still waits on it, nor the other way round.
// kernel_done_ stays a separate event for the copies' ordering for the same
// reason (the bridge may release a launch's fence before a later copy is
// submitted).
//
// Device-to-device copies into another CUDA backend's allocation
// (copy_to_peer) run on a fourth stream, made on first use: after an event
// recorded on each of the six streams of both backends (a stream-event wait,
// never a host wait on their work), then cuMemcpyDtoDAsync within one
// context or cuMemcpyPeerAsync between two, then a host wait for that copy
// alone.
//
// Locks: hold_mutex_ before compute_mutex_ before the lanes' mutexes; a
// submission holds both lanes' mutexes (std::scoped_lock), everything else
// one at a time. peer_mutex_ is only ever held alone.
// Every driver call runs with the backend's context pushed (ContextGuard) and
// popped again before returning, so another library's current context is
// never disturbed.
#include "backends/cuda/cuda_backend_impl.hpp"

namespace devbridge::cuda {
namespace detail {
namespace {

// Fence events kept for reuse: enough for every fence a busy bridge holds at
// once in steady state; a burst beyond it costs a create and a destroy each.
constexpr std::size_t kFreeFenceEvents = 256;

}  // namespace

CudaBackend::CudaBackend(const Driver& driver, const Options& options)
    : driver_(driver), events_(driver), fences_(driver, kFreeFenceEvents) {
  upload_.direction = CopyDirection::HostToDevice;
  upload_.call = "cuMemcpyHtoDAsync";
  upload_.operation = Operation::Upload;
  upload_.failure_kind = ErrorKind::DeviceCopyFailed;
  download_.direction = CopyDirection::DeviceToHost;
  download_.call = "cuMemcpyDtoHAsync";
  download_.operation = Operation::Download;
  download_.failure_kind = ErrorKind::OutputCopyFailed;
  try {
    set_up(options);
  } catch (...) {
    tear_down();
    throw;
  }
}

BackendInfo CudaBackend::describe() {
  BackendInfo info;
  info.name = "cuda";
  info.vendor = "nvidia";
  info.device_name = device_name_;
  info.device_kind = DeviceKind::Cuda;
  info.device_ordinal = ordinal_;
  info.device_id = std::to_string(ordinal_);
  info.pci_bus_id = pci_bus_id_;
  info.capabilities.push_back(fmt::format("compute capability {}.{}", compute_capability_ / 10, compute_capability_ % 10));
  info.total_memory = total_memory_;
  for (const DTypeInfo& dtype : all_dtypes()) info.dtypes.push_back(dtype.dtype);
  info.host_memory_page_locked = true;
  info.caches_allocations = true;
  info.part_alignment = 512;
  info.peer_copy = true;
  info.consumer_queues = true;
  info.native_context = reinterpret_cast<std::uintptr_t>(context_);
  info.notes = notes_;
  try {
    ContextGuard guard(driver_, context_, Operation::Query);
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    CUresult result = driver_.cuMemGetInfo_v2(&free_bytes, &total_bytes);
    if (result == CUDA_SUCCESS) {
      info.free_memory = free_bytes;
    } else {
      info.notes += "; cuMemGetInfo failed: " + driver_.error_name(result);
    }
  } catch (const Error& error) {
    info.notes += "; ";
    info.notes += error.what();
  }
  return info;
}

void CudaBackend::set_up(const Options& options) {
  if (options.context != nullptr) {
    context_ = static_cast<CUcontext>(options.context);
    ContextGuard guard(driver_, context_, Operation::Setup);
    check(driver_, driver_.cuCtxGetDevice(&device_), "cuCtxGetDevice(caller's context)", Operation::Setup);
    ordinal_ = ordinal_of(device_);
  } else {
    check(driver_, driver_.cuDeviceGet(&device_, options.ordinal),
          "cuDeviceGet(" + std::to_string(options.ordinal) + ")", Operation::Setup);
    ordinal_ = options.ordinal;
    check(driver_, driver_.cuDevicePrimaryCtxRetain(&context_, device_), "cuDevicePrimaryCtxRetain",
          Operation::Setup);
    owns_primary_context_ = true;
  }
  device_string_ = "CUDA:" + std::to_string(ordinal_);

  char name[256] = {};
  if (driver_.cuDeviceGetName(name, sizeof name - 1, device_) == CUDA_SUCCESS) device_name_ = name;
  std::size_t total = 0;
  if (driver_.cuDeviceTotalMem_v2(&total, device_) == CUDA_SUCCESS) total_memory_ = total;
  int major = 0;
  int minor = 0;
  check(driver_, driver_.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device_),
        "cuDeviceGetAttribute(compute capability)", Operation::Setup);
  check(driver_, driver_.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device_),
        "cuDeviceGetAttribute(compute capability)", Operation::Setup);
  if (driver_.cuDeviceGetAttribute(&multiprocessors_, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device_) !=
          CUDA_SUCCESS ||
      multiprocessors_ <= 0)
    multiprocessors_ = 16;
  int max_pitch = 0;
  if (driver_.cuDeviceGetAttribute(&max_pitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH, device_) == CUDA_SUCCESS && max_pitch > 0)
    max_pitch_ = static_cast<std::uint64_t>(max_pitch);
  compute_capability_ = major * 10 + minor;
  // The bus id, where the driver reports it (an emulated one may not: then
  // none is shown, and nothing else depends on it).
  int domain = 0, bus = 0, slot = 0;
  if (driver_.cuDeviceGetAttribute(&domain, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, device_) == CUDA_SUCCESS &&
      driver_.cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, device_) == CUDA_SUCCESS &&
      driver_.cuDeviceGetAttribute(&slot, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, device_) == CUDA_SUCCESS)
    pci_bus_id_ = fmt::format("{:04x}:{:02x}:{:02x}.0", domain, bus, slot);

  ContextGuard guard(driver_, context_, Operation::Setup);
  check(driver_, driver_.cuStreamCreate(&upload_.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate(upload)",
        Operation::Setup);
  check(driver_, driver_.cuStreamCreate(&download_.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate(download)",
        Operation::Setup);
  check(driver_, driver_.cuStreamCreate(&compute_, CU_STREAM_NON_BLOCKING), "cuStreamCreate(compute)",
        Operation::Setup);
  for (CUevent* event : {&kernel_done_, &upload_marker_, &download_marker_}) {
    check(driver_, driver_.cuEventCreate(event, CU_EVENT_DISABLE_TIMING), "cuEventCreate", Operation::Setup);
  }
  std::string kernel_note = load_kernel();

  notes_ = "driver " + std::to_string(driver_.driver_version / 1000) + "." +
           std::to_string(driver_.driver_version % 1000 / 10) + " (" + driver_.path + "), compute capability " +
           std::to_string(major) + "." + std::to_string(minor) + ", " + std::to_string(multiprocessors_) +
           " SMs, " + kernel_note + ", " +
           (owns_primary_context_ ? "primary context" : "caller's context");
}

int CudaBackend::ordinal_of(CUdevice device) const {
  int count = 0;
  if (driver_.cuDeviceGetCount(&count) == CUDA_SUCCESS) {
    for (int ordinal = 0; ordinal < count; ++ordinal) {
      CUdevice candidate = 0;
      if (driver_.cuDeviceGet(&candidate, ordinal) == CUDA_SUCCESS && candidate == device) return ordinal;
    }
  }
  return static_cast<int>(device);
}

void CudaBackend::tear_down() noexcept {
  if (context_ == nullptr) return;
  try {
    hold(false);
  } catch (...) {
  }
  CUcontext popped = nullptr;
  if (driver_.cuCtxPushCurrent_v2(context_) == CUDA_SUCCESS) {
    // Nothing may still run on memory the owner is about to free.
    for (CUstream stream : {compute_, upload_.stream, download_.stream, peer_}) {
      if (stream != nullptr) driver_.cuStreamSynchronize(stream);
    }
    for (CopyStream* lane : {&upload_, &download_}) lane->pending.clear();
    // The pools destroy their events still out too (pending copies'; fences
    // the bridge never gave back, which it must not ask about any more).
    if (const std::uint64_t registered = live_registrations_.load(std::memory_order_relaxed))
      devbridge::detail::log().warn("devbridge cuda: {} host registration(s) never unregistered", registered);
    if (const std::size_t unreleased = fences_.out())
      devbridge::detail::log().warn("devbridge cuda: {} fence(s) never released; destroyed with the backend",
                                    unreleased);
    events_.destroy_all();
    fences_.destroy_all();
    for (CUevent event : {kernel_done_, upload_marker_, download_marker_}) {
      if (event != nullptr) driver_.cuEventDestroy_v2(event);
    }
    for (CUstream stream : {compute_, upload_.stream, download_.stream, peer_}) {
      if (stream != nullptr) driver_.cuStreamDestroy_v2(stream);
    }
    if (module_ != nullptr) driver_.cuModuleUnload(module_);
    driver_.cuCtxPopCurrent_v2(&popped);
  }
  kernel_done_ = upload_marker_ = download_marker_ = nullptr;
  compute_ = upload_.stream = download_.stream = peer_ = nullptr;
  module_ = nullptr;
  if (owns_primary_context_) driver_.cuDevicePrimaryCtxRelease_v2(device_);
  owns_primary_context_ = false;
  context_ = nullptr;
}

CudaBackend& as_cuda(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  if (cuda == nullptr) throw Error(ErrorKind::Unsupported, "not a CUDA backend");
  return *cuda;
}

const CudaBackend& as_cuda(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  if (cuda == nullptr) throw Error(ErrorKind::Unsupported, "not a CUDA backend");
  return *cuda;
}

}  // namespace detail

using detail::as_cuda;
using detail::CUDA_SUCCESS;
using detail::CudaBackend;
using detail::CUresult;
using detail::CUstream;
using detail::Driver;

std::unique_ptr<Backend> make_cuda_backend(const Options& options) {
  Probe found = probe();
  if (!found.available) throw Error(ErrorKind::Unavailable, "CUDA: " + found.reason);
  if (options.context == nullptr && (options.ordinal < 0 || options.ordinal >= found.device_count))
    throw Error(ErrorKind::Unavailable, "CUDA: no device with ordinal " + std::to_string(options.ordinal) + " (" +
                                            std::to_string(found.device_count) + " present)");
  return std::make_unique<CudaBackend>(detail::driver(), options);
}

std::unique_ptr<Backend> make_cuda_backend(const BackendOptions& options) {
  devbridge::detail::OptionReader reader("cuda", options);
  Options typed;
  if (const auto ordinal = reader.unsigned_integer("device", "the device ordinal, as devbridge info lists them")) {
    if (*ordinal > static_cast<std::uint64_t>(std::numeric_limits<int>::max()))
      reader.refuse("device", std::to_string(*ordinal), "not a device ordinal");
    typed.ordinal = static_cast<int>(*ordinal);
  }
  if (const auto context = reader.unsigned_integer(
          "context", "a CUcontext the caller owns, as an integer (e.g. tinygrad's); pointers are valid in it"))
    typed.context = reinterpret_cast<void*>(static_cast<std::uintptr_t>(*context));
  reader.finish();
  return make_cuda_backend(typed);
}

std::vector<std::string> device_ids() {
  std::vector<std::string> ids;
  for (int ordinal = 0; ordinal < probe().device_count; ++ordinal) ids.push_back(std::to_string(ordinal));
  return ids;
}

bool is_cuda_backend(const Backend& backend) noexcept {
  return dynamic_cast<const CudaBackend*>(&backend) != nullptr;
}

void* context_of(const Backend& backend) {
  return as_cuda(backend).context();
}

void order_stream_after_submitted_work(Backend& backend, std::uintptr_t stream) {
  as_cuda(backend).order_stream(reinterpret_cast<CUstream>(stream));
}

}  // namespace devbridge::cuda
