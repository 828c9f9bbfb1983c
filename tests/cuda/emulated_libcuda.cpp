// An emulated libcuda for tests: the driver entry points the CUDA backend
// loads, implemented on host memory and threads, so the backend's real code
// paths (contexts, streams, events, ordering, kernel launch, faults) run on a
// machine without a GPU. Loaded through DEVBRIDGE_LIBCUDA; never shipped.
//
// It is strict where strictness finds bugs: calls that need a current
// context fail with CUDA_ERROR_INVALID_CONTEXT without one, copies and
// kernels outside allocations fail (a kernel's bad access faults the context
// for good, like the real thing), and every stream runs on its own thread
// with an optional delay per operation (DEVBRIDGE_EMULATED_CUDA_DELAY_US), so
// missing stream-event waits show up as wrong data.
//
// Knobs (environment): DEVBRIDGE_EMULATED_CUDA_DRIVER_VERSION (default 13000;
// PTX newer than that driver is refused with UNSUPPORTED_PTX_VERSION),
// DEVBRIDGE_EMULATED_CUDA_CC (default 90), DEVBRIDGE_EMULATED_CUDA_MEMORY_MIB
// (default 16384), DEVBRIDGE_EMULATED_CUDA_DELAY_US (default 20),
// DEVBRIDGE_EMULATED_CUDA_MAX_PITCH (CU_DEVICE_ATTRIBUTE_MAX_PITCH, default
// 2147483647 as on current GPUs; 2-D copies with a larger pitch are refused),
// DEVBRIDGE_EMULATED_CUDA_DEVICES (default 1, at most 8: devices 0..n-1, each
// with its own primary context and its own memory budget; read once).
//
// Device memory belongs to the context that allocated it. The device-to-
// device copies check it as the driver's address spaces would:
// cuMemcpyDtoDAsync moves bytes within the current context only, and
// cuMemcpyPeerAsync takes each side from the context it names (two devices,
// or two contexts of one device).
//
// Test hooks (extern "C", found with dlsym; a real driver has none, so tests
// that need them skip there): event create/destroy counters, one injected
// cuEventRecord failure, one injected copy submission failure, and the
// number of live host registrations (cuMemHostRegister).
//
// Default streams (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) have no thread
// of their own: work on them runs on the caller, so a wait there blocks the
// caller and a record there completes at once.
//
// Every driver entry point is exported under the versioned symbol the
// backend loads (cuMemAlloc_v2, ...) and checked at the end of this file to
// have exactly the type the backend loads it as (cuda_driver_api.hpp).
#include "backends/cuda/cuda_driver_api.hpp"
#include "cuda_test_entry_points.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#define EXPORT extern "C" __attribute__((visibility("default")))

using namespace devbridge::cuda::detail;

namespace {

using namespace std::chrono_literals;

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::atoi(value) : fallback;
}

int driver_version() { return env_int("DEVBRIDGE_EMULATED_CUDA_DRIVER_VERSION", 13000); }
int compute_capability() { return env_int("DEVBRIDGE_EMULATED_CUDA_CC", 90); }
std::uint64_t total_memory() {
  return static_cast<std::uint64_t>(env_int("DEVBRIDGE_EMULATED_CUDA_MEMORY_MIB", 16384)) << 20;
}
std::uint64_t max_pitch() {
  return static_cast<std::uint64_t>(env_int("DEVBRIDGE_EMULATED_CUDA_MAX_PITCH", 2147483647));
}
constexpr int kMaxDevices = 8;
int device_count() {
  static const int count = std::clamp(env_int("DEVBRIDGE_EMULATED_CUDA_DEVICES", 1), 1, kMaxDevices);
  return count;
}
bool is_device(CUdevice device) { return device >= 0 && device < device_count(); }
void operation_delay() {
  static const int delay = env_int("DEVBRIDGE_EMULATED_CUDA_DELAY_US", 20);
  if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
}

struct Context {
  CUdevice device = 0;
  std::atomic<int> sticky{CUDA_SUCCESS};  // set by a faulting kernel, forever
};

// Device and page-locked host memory both live in the host's address space.
struct Memory {
  std::mutex mutex;
  std::map<std::uintptr_t, std::size_t> device;  // base -> bytes
  std::map<std::uintptr_t, std::size_t> host;        // cuMemHostAlloc: base -> bytes
  std::map<std::uintptr_t, std::size_t> registered;  // cuMemHostRegister: base -> bytes
  std::map<std::uintptr_t, Context*> owner;          // cuMemAlloc: base -> the context that made it
  std::uint64_t device_used[kMaxDevices] = {};

  // Needs `mutex` held. True when [address, address + bytes) meets a block
  // of `blocks` (base -> bytes, none overlapping each other).
  static bool overlaps(const std::map<std::uintptr_t, std::size_t>& blocks, std::uintptr_t address,
                       std::size_t bytes) {
    auto after = blocks.lower_bound(address);
    if (after != blocks.end() && after->first - address < bytes) return true;
    if (after == blocks.begin()) return false;
    auto before = std::prev(after);
    return address - before->first < before->second;
  }

  bool device_range_ok(std::uintptr_t address, std::size_t bytes) { return device_range_in(address, bytes, nullptr); }

  // As device_range_ok, and the allocation is `context`'s (any context's
  // when null).
  bool device_range_in(std::uintptr_t address, std::size_t bytes, const Context* context) {
    std::lock_guard lock(mutex);
    auto it = device.upper_bound(address);
    if (it == device.begin()) return false;
    --it;
    if (!(address >= it->first && bytes <= it->second && address - it->first <= it->second - bytes)) return false;
    if (context == nullptr) return true;
    auto made_by = owner.find(it->first);
    return made_by != owner.end() && made_by->second == context;
  }
};

Memory& memory() {
  static auto* m = new Memory();
  return *m;
}

struct Event {
  Context* context = nullptr;
  std::mutex mutex;
  std::condition_variable changed;
  std::uint64_t recorded = 0;   // records issued
  std::uint64_t completed = 0;  // records the stream has reached
};

// Events are shared with the stream operations that complete them, so a
// destroy never frees one under a running operation.
std::mutex events_mutex;
std::uint64_t events_created = 0;    // guarded by events_mutex
std::uint64_t events_destroyed = 0;  // guarded by events_mutex
// An injected cuEventRecord failure (test hook): after `records_to_pass`
// more records succeed, the next one returns `record_failure` and records
// nothing. Negative: no failure armed.
long long records_to_pass = -1;      // guarded by events_mutex
CUresult record_failure = CUDA_SUCCESS;  // guarded by events_mutex

// Consumes the armed failure when it is this record's turn.
CUresult injected_record_failure() {
  std::lock_guard lock(events_mutex);
  if (records_to_pass < 0) return CUDA_SUCCESS;
  if (records_to_pass-- > 0) return CUDA_SUCCESS;
  return record_failure;
}
std::map<Event*, std::shared_ptr<Event>>& events() {
  static auto* e = new std::map<Event*, std::shared_ptr<Event>>();
  return *e;
}

std::shared_ptr<Event> find_event(CUevent handle) {
  std::lock_guard lock(events_mutex);
  auto it = events().find(reinterpret_cast<Event*>(handle));
  return it == events().end() ? nullptr : it->second;
}

// Waits until `event` has completed its record number `target`, or its
// context (or `also`) faults. Returns the sticky error, or CUDA_SUCCESS.
int wait_event(Event& event, std::uint64_t target, Context* also) {
  std::unique_lock lock(event.mutex);
  for (;;) {
    if (event.completed >= target) return CUDA_SUCCESS;
    if (int sticky = event.context->sticky.load()) return sticky;
    if (also != nullptr) {
      if (int sticky = also->sticky.load()) return sticky;
    }
    event.changed.wait_for(lock, 1ms);
  }
}

class Stream {
 public:
  explicit Stream(Context* context) : context_(context), worker_([this] { run(); }) {}
  ~Stream() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    worker_.join();
  }

  Context* context() const { return context_; }

  void enqueue(std::function<void()> operation) {
    {
      std::lock_guard lock(mutex_);
      operations_.push_back(std::move(operation));
    }
    wake_.notify_all();
  }

  int synchronize() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [this] { return operations_.empty() && !busy_; });
    return context_->sticky.load();
  }

 private:
  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stop_ || !operations_.empty(); });
      if (operations_.empty() && stop_) return;
      auto operation = std::move(operations_.front());
      operations_.pop_front();
      busy_ = true;
      lock.unlock();
      // A faulted context runs nothing more.
      if (context_->sticky.load() == CUDA_SUCCESS) {
        operation_delay();
        operation();
      }
      lock.lock();
      busy_ = false;
      if (operations_.empty()) idle_.notify_all();
    }
  }

  Context* context_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<std::function<void()>> operations_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread worker_;  // last: starts once everything above exists
};

struct Module;

struct Function {
  Module* module = nullptr;
  std::string name;
};

// Functions belong to their module and go with it, as in the driver.
struct Module {
  Context* context = nullptr;
  std::string ptx;
  std::vector<std::unique_ptr<Function>> functions;
};

thread_local std::vector<Context*> context_stack;

Context* current() { return context_stack.empty() ? nullptr : context_stack.back(); }

// The checks every context-bound call makes, in the driver's order.
int require_context() {
  Context* context = current();
  if (context == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  return context->sticky.load();
}

std::atomic<bool> initialised{false};
std::mutex primary_mutex;
Context* primaries[kMaxDevices] = {};      // guarded by primary_mutex; never freed, like the real ones
int primary_references[kMaxDevices] = {};  // guarded by primary_mutex

bool is_primary(const Context* context) {
  std::lock_guard lock(primary_mutex);
  return std::find(std::begin(primaries), std::end(primaries), context) != std::end(primaries);
}

bool is_default_stream(CUstream stream) {
  return stream == nullptr || stream == legacy_default_stream() || stream == per_thread_default_stream();
}

const char* name_of(CUresult result) {
  switch (result) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_PTX: return "CUDA_ERROR_INVALID_PTX";
    case CUDA_ERROR_UNSUPPORTED_PTX_VERSION: return "CUDA_ERROR_UNSUPPORTED_PTX_VERSION";
    case CUDA_ERROR_NO_BINARY_FOR_GPU: return "CUDA_ERROR_NO_BINARY_FOR_GPU";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
    default: return nullptr;
  }
}

// ".version 9.0" -> 90
int ptx_version(const std::string& ptx) {
  auto at = ptx.find("\n.version ");
  if (at == std::string::npos) return 0;
  at += 10;
  return std::atoi(ptx.c_str() + at) * 10 + std::atoi(ptx.c_str() + ptx.find('.', at) + 1);
}

int max_ptx_for(int version) {
  if (version >= 13000) return 90;
  if (version >= 12090) return 88;
  if (version >= 12080) return 87;
  if (version >= 12040) return 84;
  if (version >= 12000) return 80;
  return 78;
}

}  // namespace

// ---- initialisation, errors, devices ----------------------------------------

EXPORT CUresult cuInit(unsigned int flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  initialised = true;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int* version) {
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *version = driver_version();
  return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorName(CUresult error, const char** name) {
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *name = name_of(error);
  return *name == nullptr ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char** text) {
  if (text == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *text = name_of(error) == nullptr ? nullptr : "emulated driver error";
  return *text == nullptr ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int* count) {
  if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
  *count = device_count();
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
  if (!is_device(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char* name, int length, CUdevice device) {
  if (!is_device(device)) return CUDA_ERROR_INVALID_DEVICE;
  if (device == 0)
    std::snprintf(name, static_cast<std::size_t>(length), "devbridge emulated GPU");
  else
    std::snprintf(name, static_cast<std::size_t>(length), "devbridge emulated GPU %d", device);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice device) {
  if (!is_device(device)) return CUDA_ERROR_INVALID_DEVICE;
  switch (attribute) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = compute_capability() / 10; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = compute_capability() % 10; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = 4; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: *value = static_cast<int>(max_pitch()); break;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice device) {
  if (!is_device(device)) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = total_memory();
  return CUDA_SUCCESS;
}

// ---- contexts -----------------------------------------------------------------

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  if (!is_device(device)) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard lock(primary_mutex);
  Context*& primary = primaries[device];
  if (primary == nullptr) {
    primary = new Context();  // lives as long as the process, like the real one
    primary->device = device;
  }
  ++primary_references[device];
  *context = reinterpret_cast<CUcontext>(primary);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
  if (!is_device(device)) return CUDA_ERROR_INVALID_DEVICE;
  std::lock_guard lock(primary_mutex);
  if (primary_references[device] <= 0) return CUDA_ERROR_INVALID_CONTEXT;
  --primary_references[device];
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPushCurrent_v2(CUcontext context) {
  if (context == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  context_stack.push_back(reinterpret_cast<Context*>(context));
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent_v2(CUcontext* context) {
  if (context_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (context != nullptr) *context = reinterpret_cast<CUcontext>(context_stack.back());
  context_stack.pop_back();
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext* context) {
  *context = reinterpret_cast<CUcontext>(current());
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice* device) {
  if (current() == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  *device = current()->device;
  return CUDA_SUCCESS;
}

// The pre-12 form, which tests use to make a context of their own.
EXPORT CUresult cuCtxCreate_v2(CUcontext* context, unsigned int, CUdevice device) {
  if (!is_device(device)) return CUDA_ERROR_INVALID_DEVICE;
  auto* created = new Context();
  created->device = device;
  context_stack.push_back(created);
  *context = reinterpret_cast<CUcontext>(created);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxDestroy_v2(CUcontext context) {
  auto* doomed = reinterpret_cast<Context*>(context);
  if (doomed == nullptr || is_primary(doomed)) return CUDA_ERROR_INVALID_CONTEXT;
  std::erase(context_stack, doomed);
  // Streams and memory of the context are the tests' to have freed; the
  // object itself stays reachable (a stale handle must not crash a late
  // query), so it is parked rather than deleted.
  static std::mutex parked_mutex;
  static auto* parked = new std::vector<Context*>();
  std::lock_guard lock(parked_mutex);
  parked->push_back(doomed);
  return CUDA_SUCCESS;
}

// ---- memory -------------------------------------------------------------------

EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  std::lock_guard lock(memory().mutex);
  *total_bytes = total_memory();
  *free_bytes = total_memory() - memory().device_used[current()->device];
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* pointer, size_t bytes) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  {
    std::lock_guard lock(memory().mutex);
    if (bytes > total_memory() - memory().device_used[current()->device]) return CUDA_ERROR_OUT_OF_MEMORY;
  }
  // bytes <= total_memory() (checked above), so rounding to 256 cannot wrap.
  void* data = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (data == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard lock(memory().mutex);
  memory().device[reinterpret_cast<std::uintptr_t>(data)] = bytes;
  memory().owner[reinterpret_cast<std::uintptr_t>(data)] = current();
  memory().device_used[current()->device] += bytes;
  *pointer = reinterpret_cast<CUdeviceptr>(data);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr pointer) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  std::lock_guard lock(memory().mutex);
  auto it = memory().device.find(static_cast<std::uintptr_t>(pointer));
  if (it == memory().device.end()) return CUDA_ERROR_INVALID_VALUE;
  auto owner = memory().owner.find(it->first);
  memory().device_used[owner->second->device] -= it->second;
  memory().owner.erase(owner);
  memory().device.erase(it);
  std::free(reinterpret_cast<void*>(pointer));
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemHostAlloc(void** pointer, size_t bytes, unsigned int flags) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  if (bytes == 0 || (flags & ~0x7u) != 0) return CUDA_ERROR_INVALID_VALUE;
  // As the real driver: a size that does not fit once rounded to pages is
  // out of memory, never a wrapped small block.
  if (bytes > SIZE_MAX - 4095) return CUDA_ERROR_OUT_OF_MEMORY;
  void* data = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (data == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard lock(memory().mutex);
  memory().host[reinterpret_cast<std::uintptr_t>(data)] = bytes;
  *pointer = data;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFreeHost(void* pointer) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  std::lock_guard lock(memory().mutex);
  if (memory().host.erase(reinterpret_cast<std::uintptr_t>(pointer)) == 0) return CUDA_ERROR_INVALID_VALUE;
  std::free(pointer);
  return CUDA_SUCCESS;
}

// Page-locks memory the caller owns. As the real driver: any overlap with
// memory already page-locked (another registration, a cuMemHostAlloc block)
// is CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, and only the base address a
// registration was made with unregisters it.
EXPORT CUresult cuMemHostRegister_v2(void* pointer, size_t bytes, unsigned int flags) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  const auto address = reinterpret_cast<std::uintptr_t>(pointer);
  if (pointer == nullptr || bytes == 0 || (flags & ~0xfu) != 0 || address > UINTPTR_MAX - bytes)
    return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lock(memory().mutex);
  if (Memory::overlaps(memory().registered, address, bytes) || Memory::overlaps(memory().host, address, bytes))
    return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
  memory().registered[address] = bytes;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuMemHostUnregister(void* pointer) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  std::lock_guard lock(memory().mutex);
  if (memory().registered.erase(reinterpret_cast<std::uintptr_t>(pointer)) == 0)
    return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  return CUDA_SUCCESS;
}

// ---- streams and events ---------------------------------------------------------

EXPORT CUresult cuStreamCreate(CUstream* stream, unsigned int flags) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  if (flags != CU_STREAM_NON_BLOCKING && flags != CU_STREAM_DEFAULT) return CUDA_ERROR_INVALID_VALUE;
  *stream = reinterpret_cast<CUstream>(new Stream(current()));
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream stream) {
  if (stream == nullptr || is_default_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
  delete reinterpret_cast<Stream*>(stream);  // finishes (or, faulted, drops) its work first
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(CUstream stream) {
  if (is_default_stream(stream)) return static_cast<CUresult>(require_context());
  return static_cast<CUresult>(reinterpret_cast<Stream*>(stream)->synchronize());
}

EXPORT CUresult cuEventCreate(CUevent* handle, unsigned int flags) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  if ((flags & ~0xfu) != 0) return CUDA_ERROR_INVALID_VALUE;
  auto event = std::make_shared<Event>();
  event->context = current();
  std::lock_guard lock(events_mutex);
  events()[event.get()] = event;
  ++events_created;
  *handle = reinterpret_cast<CUevent>(event.get());
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventDestroy_v2(CUevent handle) {
  std::lock_guard lock(events_mutex);
  if (events().erase(reinterpret_cast<Event*>(handle)) != 1) return CUDA_ERROR_INVALID_HANDLE;
  ++events_destroyed;
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(CUevent handle, CUstream stream) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  if (CUresult injected = injected_record_failure()) return injected;
  auto event = find_event(handle);
  if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (event->context != current()) return CUDA_ERROR_INVALID_CONTEXT;
  if (is_default_stream(stream)) {
    // Default-stream work runs on its caller here (see cuStreamWaitEvent),
    // so everything before this record has already run: it completes now.
    // Not modelled: the legacy stream's implicit wait for blocking streams
    // (the backend's and the tests' streams are all non-blocking).
    std::lock_guard lock(event->mutex);
    event->completed = ++event->recorded;
    event->changed.notify_all();
    return CUDA_SUCCESS;
  }
  auto* target = reinterpret_cast<Stream*>(stream);
  if (target->context() != current()) return CUDA_ERROR_INVALID_CONTEXT;
  std::uint64_t number = 0;
  {
    std::lock_guard lock(event->mutex);
    number = ++event->recorded;
  }
  target->enqueue([event, number] {
    std::lock_guard lock(event->mutex);
    event->completed = std::max(event->completed, number);
    event->changed.notify_all();
  });
  return CUDA_SUCCESS;
}

EXPORT CUresult cuEventQuery(CUevent handle) {
  auto event = find_event(handle);
  if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (int sticky = event->context->sticky.load()) return static_cast<CUresult>(sticky);
  std::lock_guard lock(event->mutex);
  return event->completed >= event->recorded ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

EXPORT CUresult cuEventSynchronize(CUevent handle) {
  auto event = find_event(handle);
  if (event == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  std::uint64_t target = 0;
  {
    std::lock_guard lock(event->mutex);
    target = event->recorded;
  }
  return static_cast<CUresult>(wait_event(*event, target, nullptr));
}

EXPORT CUresult cuStreamWaitEvent(CUstream stream, CUevent handle, unsigned int flags) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  auto event = find_event(handle);
  if (event == nullptr || flags != 0) return CUDA_ERROR_INVALID_HANDLE;
  std::uint64_t target = 0;
  {
    std::lock_guard lock(event->mutex);
    target = event->recorded;
  }
  if (is_default_stream(stream)) {
    // The emulation runs default-stream work on the caller: waiting here is
    // the strictest reading of "later work in that stream waits".
    return static_cast<CUresult>(wait_event(*event, target, current()));
  }
  auto* waiter = reinterpret_cast<Stream*>(stream);
  if (waiter->context() != current()) return CUDA_ERROR_INVALID_CONTEXT;
  Context* context = waiter->context();
  waiter->enqueue([event, target, context] { wait_event(*event, target, context); });
  return CUDA_SUCCESS;
}

// ---- copies ---------------------------------------------------------------------

namespace {

// An injected copy submission failure (test hook), like the cuEventRecord
// one: after `copies_to_pass` more copy submissions (1-D, 2-D or device to
// device) succeed, the next returns `copy_failure` and queues nothing.
// Negative: none armed.
std::mutex copy_failure_mutex;
long long copies_to_pass = -1;          // guarded by copy_failure_mutex
CUresult copy_failure = CUDA_SUCCESS;   // guarded by copy_failure_mutex

CUresult injected_copy_failure() {
  std::lock_guard lock(copy_failure_mutex);
  if (copies_to_pass < 0) return CUDA_SUCCESS;
  if (copies_to_pass-- > 0) return CUDA_SUCCESS;
  return copy_failure;
}

// The checks every async copy makes before it is queued, in the driver's
// order; the stream it goes to, or null with `result` set.
Stream* copy_stream(CUstream stream, CUresult& result) {
  result = static_cast<CUresult>(require_context());
  if (result != CUDA_SUCCESS) return nullptr;
  result = CUDA_ERROR_INVALID_HANDLE;  // the backend never uses a default stream
  if (is_default_stream(stream)) return nullptr;
  auto* target = reinterpret_cast<Stream*>(stream);
  result = CUDA_ERROR_INVALID_CONTEXT;
  if (target->context() != current()) return nullptr;
  result = injected_copy_failure();
  return result == CUDA_SUCCESS ? target : nullptr;
}

CUresult enqueue_copy(void* destination, const void* source, std::size_t bytes, CUstream stream,
                      std::uintptr_t device_address) {
  CUresult result = CUDA_SUCCESS;
  Stream* target = copy_stream(stream, result);
  if (target == nullptr) return result;
  if (!memory().device_range_ok(device_address, bytes)) return CUDA_ERROR_INVALID_VALUE;
  target->enqueue([destination, source, bytes] { std::memcpy(destination, source, bytes); });
  return CUDA_SUCCESS;
}

// Where one side of a 2-D copy starts (its X and Y offsets applied) and how
// far its rows reach; false when the side is not one the emulation models
// (arrays, unified memory) or its numbers do not fit.
struct CopySide {
  std::uintptr_t start = 0;
  std::size_t pitch = 0;
  std::size_t reach = 0;  // (Height - 1) * pitch + WidthInBytes
  bool device = false;
};

bool copy_side(CUmemorytype type, const void* host, CUdeviceptr device, std::size_t x, std::size_t y,
               std::size_t pitch, std::size_t width, std::size_t height, CopySide& side) {
  if (type != CU_MEMORYTYPE_HOST && type != CU_MEMORYTYPE_DEVICE) return false;
  side.device = type == CU_MEMORYTYPE_DEVICE;
  const auto base = side.device ? static_cast<std::uintptr_t>(device) : reinterpret_cast<std::uintptr_t>(host);
  if (base == 0) return false;
  // As the real driver: a row (with its X offset) must fit in the pitch, and
  // the pitch must not exceed the device's maximum.
  if (pitch < width || pitch - width < x || pitch > max_pitch()) return false;
  std::size_t offset = 0;
  std::size_t before_last = 0;
  if (__builtin_mul_overflow(y, pitch, &offset) || __builtin_add_overflow(offset, x, &offset) ||
      __builtin_mul_overflow(height - 1, pitch, &before_last) ||
      __builtin_add_overflow(before_last, width, &side.reach) || __builtin_add_overflow(base, offset, &side.start) ||
      side.start > UINTPTR_MAX - side.reach)
    return false;
  side.pitch = pitch;
  return true;
}

}  // namespace

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr destination, const void* source, size_t bytes,
                                          CUstream stream) {
  return enqueue_copy(reinterpret_cast<void*>(destination), source, bytes, stream,
                      static_cast<std::uintptr_t>(destination));
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void* destination, CUdeviceptr source, size_t bytes, CUstream stream) {
  return enqueue_copy(destination, reinterpret_cast<const void*>(source), bytes, stream,
                      static_cast<std::uintptr_t>(source));
}

// Device to device, queued on the stream like the copies above (so a hold,
// the per-operation delay, a faulted context and an injected failure apply
// alike). Both ranges must lie inside allocations of `source_context` and
// `destination_context`; the bytes may overlap (memmove), though the driver
// leaves that undefined.
namespace {

CUresult enqueue_device_copy(CUdeviceptr destination, const Context* destination_context, CUdeviceptr source,
                             const Context* source_context, std::size_t bytes, CUstream stream) {
  CUresult result = CUDA_SUCCESS;
  Stream* target = copy_stream(stream, result);
  if (target == nullptr) return result;
  if (bytes == 0) return CUDA_SUCCESS;
  if (!memory().device_range_in(static_cast<std::uintptr_t>(source), bytes, source_context) ||
      !memory().device_range_in(static_cast<std::uintptr_t>(destination), bytes, destination_context))
    return CUDA_ERROR_INVALID_VALUE;
  target->enqueue([destination, source, bytes] {
    std::memmove(reinterpret_cast<void*>(destination), reinterpret_cast<const void*>(source), bytes);
  });
  return CUDA_SUCCESS;
}

}  // namespace

// Within the current context: memory of another context (another device's,
// or a second context's on the same device) is refused, as it is not mapped
// here; that takes cuMemcpyPeerAsync.
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr destination, CUdeviceptr source, size_t bytes,
                                          CUstream stream) {
  return enqueue_device_copy(destination, current(), source, current(), bytes, stream);
}

// Between contexts, each side in the context it names; the stream is the
// current context's. No peer access needs enabling (the driver stages
// through the host where the devices cannot reach each other).
EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr destination, CUcontext destination_context, CUdeviceptr source,
                                          CUcontext source_context, size_t bytes, CUstream stream) {
  if (destination_context == nullptr || source_context == nullptr) {
    if (int error = require_context()) return static_cast<CUresult>(error);
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  for (CUcontext side : {destination_context, source_context}) {
    if (int sticky = reinterpret_cast<Context*>(side)->sticky.load()) return static_cast<CUresult>(sticky);
  }
  return enqueue_device_copy(destination, reinterpret_cast<const Context*>(destination_context), source,
                             reinterpret_cast<const Context*>(source_context), bytes, stream);
}

// A row loop honouring both pitches, queued on the stream like the 1-D
// copies (so a hold, the per-operation delay and a faulted context apply
// alike). The bytes between rows are never touched, on either side. Device
// sides must lie inside one allocation, rows and padding alike.
EXPORT CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D* copy, CUstream stream) {
  if (copy == nullptr) return CUDA_ERROR_INVALID_VALUE;
  CUresult result = CUDA_SUCCESS;
  Stream* target = copy_stream(stream, result);
  if (target == nullptr) return result;
  if (copy->WidthInBytes == 0 || copy->Height == 0) return CUDA_SUCCESS;
  CopySide source;
  CopySide destination;
  if (!copy_side(copy->srcMemoryType, copy->srcHost, copy->srcDevice, copy->srcXInBytes, copy->srcY,
                 copy->srcPitch, copy->WidthInBytes, copy->Height, source) ||
      !copy_side(copy->dstMemoryType, copy->dstHost, copy->dstDevice, copy->dstXInBytes, copy->dstY,
                 copy->dstPitch, copy->WidthInBytes, copy->Height, destination))
    return CUDA_ERROR_INVALID_VALUE;
  for (const CopySide* side : {&source, &destination}) {
    if (side->device && !memory().device_range_ok(side->start, side->reach)) return CUDA_ERROR_INVALID_VALUE;
  }
  const std::size_t width = copy->WidthInBytes;
  const std::size_t height = copy->Height;
  target->enqueue([source, destination, width, height] {
    for (std::size_t row = 0; row < height; ++row) {
      std::memcpy(reinterpret_cast<void*>(destination.start + row * destination.pitch),
                  reinterpret_cast<const void*>(source.start + row * source.pitch), width);
    }
  });
  return CUDA_SUCCESS;
}

// ---- modules and kernels ----------------------------------------------------------

EXPORT CUresult cuModuleLoadDataEx(CUmodule* module, const void* image, unsigned int option_count,
                                           CUjit_option* options, void** values) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  std::string ptx(static_cast<const char*>(image));
  auto log = [&](const std::string& text) {
    for (unsigned i = 0; i < option_count; ++i) {
      if (options[i] != CU_JIT_ERROR_LOG_BUFFER) continue;
      std::size_t size = 0;
      for (unsigned j = 0; j < option_count; ++j) {
        if (options[j] == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES) size = reinterpret_cast<std::uintptr_t>(values[j]);
      }
      if (size > 0) std::snprintf(static_cast<char*>(values[i]), size, "%s", text.c_str());
    }
  };
  if (ptx_version(ptx) > max_ptx_for(driver_version())) {
    log("ptxas: PTX .version newer than this emulated driver supports");
    return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
  }
  const auto target = ptx.find("\n.target sm_");
  if (target == std::string::npos) {
    log("ptxas: no .target");
    return CUDA_ERROR_INVALID_PTX;
  }
  if (std::atoi(ptx.c_str() + target + 12) > compute_capability()) return CUDA_ERROR_NO_BINARY_FOR_GPU;
  *module = reinterpret_cast<CUmodule>(new Module{current(), std::move(ptx)});
  return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleUnload(CUmodule module) {
  delete reinterpret_cast<Module*>(module);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleGetFunction(CUfunction* function, CUmodule module, const char* name) {
  auto* loaded = reinterpret_cast<Module*>(module);
  if (loaded == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (loaded->ptx.find(".entry " + std::string(name) + "(") == std::string::npos) return CUDA_ERROR_NOT_FOUND;
  loaded->functions.push_back(std::make_unique<Function>(Function{loaded, name}));
  *function = reinterpret_cast<CUfunction>(loaded->functions.back().get());
  return CUDA_SUCCESS;
}

// Runs the one kernel the backend has: devbridge_axpy_f32(x, y, count, a, b).
EXPORT CUresult cuLaunchKernel(CUfunction function, unsigned int grid_x, unsigned int grid_y,
                                       unsigned int grid_z, unsigned int block_x, unsigned int block_y,
                                       unsigned int block_z, unsigned int shared_bytes, CUstream stream,
                                       void** parameters, void** extra) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  auto* kernel = reinterpret_cast<Function*>(function);
  if (kernel == nullptr || kernel->name != "devbridge_axpy_f32") return CUDA_ERROR_INVALID_HANDLE;
  if (grid_x == 0 || grid_y != 1 || grid_z != 1 || block_x == 0 || block_x > 1024 || block_y != 1 || block_z != 1 ||
      shared_bytes != 0 || parameters == nullptr || extra != nullptr)
    return CUDA_ERROR_INVALID_VALUE;
  if (is_default_stream(stream)) return CUDA_ERROR_INVALID_HANDLE;
  auto* target = reinterpret_cast<Stream*>(stream);
  if (target->context() != current() || kernel->module->context != current()) return CUDA_ERROR_INVALID_CONTEXT;
  const auto x = *static_cast<CUdeviceptr*>(parameters[0]);
  const auto y = *static_cast<CUdeviceptr*>(parameters[1]);
  const auto count = *static_cast<unsigned long long*>(parameters[2]);
  const float a = *static_cast<float*>(parameters[3]);
  const float b = *static_cast<float*>(parameters[4]);
  Context* context = current();
  target->enqueue([=] {
    const std::size_t bytes = count * sizeof(float);
    if (!memory().device_range_ok(static_cast<std::uintptr_t>(x), bytes) ||
        !memory().device_range_ok(static_cast<std::uintptr_t>(y), bytes)) {
      context->sticky = CUDA_ERROR_ILLEGAL_ADDRESS;  // a fault ends the context
      return;
    }
    const auto* in = reinterpret_cast<const float*>(x);
    auto* out = reinterpret_cast<float*>(y);
    for (unsigned long long i = 0; i < count; ++i) {
      const float product = a * in[i];
      out[i] = product + b;
    }
  });
  return CUDA_SUCCESS;
}

// Runs a host function in stream order (the backend's test-only hold).
EXPORT CUresult cuLaunchHostFunc(CUstream stream, CUhostFn function, void* data) {
  if (int error = require_context()) return static_cast<CUresult>(error);
  if (is_default_stream(stream) || function == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto* target = reinterpret_cast<Stream*>(stream);
  if (target->context() != current()) return CUDA_ERROR_INVALID_CONTEXT;
  target->enqueue([function, data] { function(data); });
  return CUDA_SUCCESS;
}

// ---- test hooks (not driver API) ----------------------------------------------------

// Events created and destroyed since load, so a test can see whether the
// backend recycles its events (dlsym these from the loaded driver).
EXPORT unsigned long long devbridge_emulated_cuda_events_created() {
  std::lock_guard lock(events_mutex);
  return events_created;
}

EXPORT unsigned long long devbridge_emulated_cuda_events_destroyed() {
  std::lock_guard lock(events_mutex);
  return events_destroyed;
}

// Arms one cuEventRecord failure: the next `pass` records succeed, the one
// after returns `result` (a CUresult) without recording.
EXPORT void devbridge_emulated_cuda_fail_event_record(long long pass, int result) {
  std::lock_guard lock(events_mutex);
  records_to_pass = pass;
  record_failure = static_cast<CUresult>(result);
}

// Arms one copy submission failure (cuMemcpyHtoDAsync, cuMemcpyDtoHAsync,
// cuMemcpy2DAsync, cuMemcpyDtoDAsync or cuMemcpyPeerAsync): the next `pass`
// submissions succeed, the one after returns `result` (a CUresult) without
// queueing anything.
EXPORT void devbridge_emulated_cuda_fail_copy(long long pass, int result) {
  std::lock_guard lock(copy_failure_mutex);
  copies_to_pass = pass;
  copy_failure = static_cast<CUresult>(result);
}

// Host ranges registered (cuMemHostRegister) and not yet unregistered, so a
// test can see that every registration was given back.
EXPORT unsigned long long devbridge_emulated_cuda_host_registrations() {
  std::lock_guard lock(memory().mutex);
  return memory().registered.size();
}

// ---- the exported types -------------------------------------------------------

// Exactly the types the backend (and the tests) load these symbols as: a
// drifting signature here would otherwise only show as corrupt arguments.
#define DEVBRIDGE_EMULATED_EXPORTS_AS_LOADED(symbol)                \
  static_assert(std::is_same_v<decltype(&::symbol), PFN_##symbol>, \
                #symbol " is not exported with the type the backend loads it as");
DEVBRIDGE_CUDA_DRIVER_ENTRY_POINTS(DEVBRIDGE_EMULATED_EXPORTS_AS_LOADED)
#undef DEVBRIDGE_EMULATED_EXPORTS_AS_LOADED
static_assert(std::is_same_v<decltype(&::cuCtxCreate_v2), devbridge::cuda::testing::PFN_cuCtxCreate_v2>);
static_assert(std::is_same_v<decltype(&::cuCtxDestroy_v2), devbridge::cuda::testing::PFN_cuCtxDestroy_v2>);
