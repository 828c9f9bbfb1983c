// The CUDA row's consumer queue: a non-blocking CUstream of the test's own in
// the backend's context (as torch or tinygrad would make one from
// describe().native_context), blocked by a host function that waits on a gate.
//
// It calls the driver as a consumer would, through the libcuda the process
// has loaded: the backend dlopen()s $DEVBRIDGE_LIBCUDA (else libcuda.so.1),
// and opening the same path again yields the same library, so the stream
// lives in the same driver as the backend's context (the tests run with the
// emulated driver that way). The few entry points are declared here with
// cuda.h's ABI, so this file needs neither cuda.h nor the backend's headers.
#include <dlfcn.h>

#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "backend_drivers.hpp"

namespace devbridge::conformance {
namespace {

// cuda.h: CUresult is an enum, CUcontext and CUstream opaque pointers.
using CUresult = int;
using CUcontext = void*;
using CUstream = void*;
using CUhostFn = void (*)(void*);
constexpr CUresult kSuccess = 0;
constexpr unsigned kStreamNonBlocking = 0x1;  // CU_STREAM_NON_BLOCKING

struct Driver {
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
  CUresult (*stream_destroy)(CUstream) = nullptr;
  CUresult (*stream_synchronize)(CUstream) = nullptr;
  CUresult (*launch_host_func)(CUstream, CUhostFn, void*) = nullptr;
  CUresult (*error_name)(CUresult, const char**) = nullptr;
};

// The path rule of the backend's loader (backends/dynamic_library.cpp).
std::string driver_path() {
  const char* path = std::getenv("DEVBRIDGE_LIBCUDA");
  return path != nullptr && *path != '\0' ? path : "libcuda.so.1";
}

template <typename Function>
void bind(void* library, const char* symbol, Function& out) {
  out = reinterpret_cast<Function>(dlsym(library, symbol));
  if (out == nullptr) throw std::runtime_error(std::string("test consumer queue: the driver lacks ") + symbol);
}

// Loaded once and never closed, like the backend's handle.
const Driver& driver() {
  static const Driver loaded = [] {
    const std::string path = driver_path();
    void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* why = dlerror();
      throw std::runtime_error("test consumer queue: cannot load " + path + ": " + (why != nullptr ? why : "?"));
    }
    Driver d;
    bind(library, "cuCtxPushCurrent_v2", d.ctx_push);
    bind(library, "cuCtxPopCurrent_v2", d.ctx_pop);
    bind(library, "cuStreamCreate", d.stream_create);
    bind(library, "cuStreamDestroy_v2", d.stream_destroy);
    bind(library, "cuStreamSynchronize", d.stream_synchronize);
    bind(library, "cuLaunchHostFunc", d.launch_host_func);
    bind(library, "cuGetErrorName", d.error_name);
    return d;
  }();
  return loaded;
}

void check(CUresult result, const char* call) {
  if (result == kSuccess) return;
  const char* name = nullptr;
  std::string named = driver().error_name(result, &name) == kSuccess && name != nullptr
                          ? std::string(name)
                          : "CUresult " + std::to_string(result);
  throw std::runtime_error(std::string("test consumer queue: ") + call + " failed: " + named);
}

// The backend's context current for one scope, the thread's own restored.
class ContextScope {
 public:
  explicit ContextScope(CUcontext context) { check(driver().ctx_push(context), "cuCtxPushCurrent"); }
  ~ContextScope() {
    CUcontext popped = nullptr;
    driver().ctx_pop(&popped);
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;
};

struct Gate {
  std::mutex mutex;
  std::condition_variable opened;
  bool open = false;
};

void wait_at_gate(void* data) {
  std::unique_ptr<std::shared_ptr<Gate>> holder(static_cast<std::shared_ptr<Gate>*>(data));
  Gate& gate = **holder;
  std::unique_lock lock(gate.mutex);
  gate.opened.wait(lock, [&] { return gate.open; });
}

class CudaConsumerQueue final : public TestConsumerQueue {
 public:
  explicit CudaConsumerQueue(Backend& backend)
      : context_(reinterpret_cast<CUcontext>(backend.describe().native_context)) {
    ContextScope scope(context_);
    check(driver().stream_create(&stream_, kStreamNonBlocking), "cuStreamCreate");
  }

  ~CudaConsumerQueue() override {
    unblock();
    try {
      ContextScope scope(context_);
      driver().stream_synchronize(stream_);
      driver().stream_destroy(stream_);
    } catch (...) {
      // The context cannot be made current: the stream goes with it.
    }
  }

  CudaConsumerQueue(const CudaConsumerQueue&) = delete;
  CudaConsumerQueue& operator=(const CudaConsumerQueue&) = delete;

  std::uintptr_t handle() const override { return reinterpret_cast<std::uintptr_t>(stream_); }

  // A stream runs in order: everything enqueued after the host function
  // waits until it returns, and it returns when the gate opens.
  void block() override {
    std::lock_guard lock(mutex_);
    if (gate_ != nullptr) return;
    auto gate = std::make_shared<Gate>();
    auto holder = std::make_unique<std::shared_ptr<Gate>>(gate);
    ContextScope scope(context_);
    check(driver().launch_host_func(stream_, &wait_at_gate, holder.get()), "cuLaunchHostFunc");
    holder.release();  // the host function owns it now
    gate_ = std::move(gate);
  }

  void unblock() override {
    std::lock_guard lock(mutex_);
    if (gate_ == nullptr) return;
    {
      std::lock_guard gate_lock(gate_->mutex);
      gate_->open = true;
    }
    gate_->opened.notify_all();
    gate_.reset();
  }

 private:
  CUcontext context_;
  CUstream stream_ = nullptr;
  std::mutex mutex_;
  std::shared_ptr<Gate> gate_;
};

}  // namespace

std::unique_ptr<TestConsumerQueue> make_cuda_consumer_queue(Backend& backend) {
  return std::make_unique<CudaConsumerQueue>(backend);
}

}  // namespace devbridge::conformance
