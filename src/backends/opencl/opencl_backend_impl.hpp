// The OpenCL backend's class, shared by its source files: opencl_backend.cpp
// (devices, the factory, describe), opencl_memory.cpp (buffers and the
// ring), opencl_import.cpp (registered and adopted host memory),
// opencl_transfers.cpp (copies, completions, quiesce, the hold),
// opencl_fences.cpp (fences and consumer queues), opencl_compute.cpp (the
// compute role). The design notes are at the top of opencl_backend.cpp.
#pragma once

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
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/backend_options.hpp"
#include "backends/opencl/opencl_api.hpp"
#include "backends/opencl/opencl_errors.hpp"
#include "devbridge/backends/opencl.hpp"
#include "devbridge/checked.hpp"

namespace devbridge::opencl::detail {

// ---- OpenCL objects, released exactly once ----
template <class Handle>
struct Releaser {
  cl_int (*release)(Handle) = nullptr;
  void operator()(Handle handle) const noexcept {
    if (handle != nullptr && release != nullptr) release(handle);
  }
};
template <class Handle>
using Owned = std::unique_ptr<std::remove_pointer_t<Handle>, Releaser<Handle>>;

// ---- info queries ----
inline std::string trimmed(std::string text) {
  text.resize(std::strlen(text.c_str()));  // drop the terminating NUL the query counts
  return text;
}

// A string property, from clGetDeviceInfo or clGetPlatformInfo (`query`
// takes their last three arguments); empty when the driver has none.
template <class Query>
inline std::string query_text(Query query) {
  std::size_t size = 0;
  if (query(0, nullptr, &size) != CL_SUCCESS || size == 0) return {};
  std::string text(size, '\0');
  if (query(size, text.data(), nullptr) != CL_SUCCESS) return {};
  return trimmed(std::move(text));
}

inline std::string device_text(const Api& cl, cl_device_id device, cl_device_info what) {
  return query_text([&](std::size_t size, void* out, std::size_t* needed) {
    return cl.clGetDeviceInfo(device, what, size, out, needed);
  });
}

inline std::string platform_text(const Api& cl, cl_platform_id platform, cl_platform_info what) {
  return query_text([&](std::size_t size, void* out, std::size_t* needed) {
    return cl.clGetPlatformInfo(platform, what, size, out, needed);
  });
}

template <class T>
inline T device_value(const Api& cl, cl_device_id device, cl_device_info what) {
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

inline cl_mem as_buffer(const DeviceAllocation& allocation) { return reinterpret_cast<cl_mem>(allocation.token); }
inline cl_event as_event(Fence fence) { return reinterpret_cast<cl_event>(fence.token); }

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

class OpenCLBackend final : public Backend, private TestControls {
 public:
  explicit OpenCLBackend(const DeviceChoice& choice);

  ~OpenCLBackend() override;

  BackendInfo describe() override;

  // "0000:3b:00.0" from cl_khr_pci_bus_info, where the driver has it.
  std::string pci_bus_id() const;

  // `alignment` holds for every buffer: a buffer has no address of its own,
  // views name it by handle with offsets from its start, and its memory is
  // aligned by the driver (to at least CL_DEVICE_MEM_BASE_ADDR_ALIGN).
  DeviceAllocation allocate(std::uint64_t bytes, std::uint64_t /*alignment*/) override;

  void free(const DeviceAllocation& allocation) noexcept override;

  // ---- host memory ----
  HostBlock allocate_host(std::uint64_t bytes) override;

  void free_host(const HostBlock& block) noexcept override;

  // A staging import is a buffer over the caller's memory:
  // CL_MEM_USE_HOST_PTR is how OpenCL lets a driver pin memory it did not
  // allocate (it may also just remember the pointer; OpenCL does not say,
  // so page_locked stays false), CL_MEM_READ_ONLY for a read-only one.
  // Copies keep naming host addresses inside the block, never this buffer:
  // it exists so the driver knows the pages; only an adoption of a
  // read-only region runs commands on it, which read it.
  //
  // An adoption is a read-only region's CL_MEM_USE_HOST_PTR buffer used as
  // an allocation: on a device that shares host memory (PoCL, an integrated
  // GPU) it is the memory itself; elsewhere the driver may keep a copy on
  // the device, which stays right because nothing ever writes the memory.
  // The whole region is its buffer, retained; a range of it a sub-buffer,
  // which OpenCL lets start only at multiples of
  // CL_DEVICE_MEM_BASE_ADDR_ALIGN.
  HostImport import_host(const ImportRequest& request) override;

  // The bridge releases a staging import only once no copy or adoption
  // uses the memory, and no command ever wrote the buffer: the driver has
  // nothing to write back into the caller's memory (and keeps the buffer
  // itself until commands that read it finish).
  void release_import(const HostImport& imported) noexcept override;

  HostBlock register_pages(std::byte* data, std::uint64_t bytes, cl_mem_flags access);
  DeviceAllocation adopt_host(const HostBlock& region, std::uint64_t offset, std::uint64_t bytes);

  // ---- transfers ----
  void submit_copy(const CopyRequest& request) override;
  void write_mapped(std::span<const MappedWrite> ranges,
                    const std::function<void(std::span<const std::span<std::byte>>)>& write) override;

  void drain_completions(std::vector<Completion>& out) override;

  bool wait_for_completions(std::chrono::nanoseconds timeout) override;

  void quiesce() override;

  // ---- compute ----
  Fence launch_axpy(const AxpyLaunch& launch) override;

  // ---- timeline ----
  Fence record_fence(const QueueRef& where) override;

  bool fence_passed(Fence fence) override;

  bool wait_fence(Fence fence, std::chrono::nanoseconds timeout) override;

  void release_fence(Fence fence) noexcept override;

  void order_consumer_queue(std::uintptr_t handle) override;

  // ---- observation and test controls ----
  std::uint64_t live_allocations() const noexcept override { return live_allocations_.load(std::memory_order_relaxed); }
  std::optional<std::uint64_t> live_fences() const noexcept override { return live_fences_.load(std::memory_order_relaxed); }
  std::optional<std::uint64_t> live_registrations() const noexcept override { return live_registrations_.load(std::memory_order_relaxed); }

  bool can_hold_copies() const noexcept override { return true; }
  void hold_copies(bool hold) override;
  TestControls* test_controls() noexcept override { return this; }

 private:
  static void on_command_finished(cl_event event, cl_int /*status*/, void* user);

  // The hold's user event with one reference of ours (null when nothing is
  // held): lifting the hold between this and the enqueue that waits on it
  // then cannot free it under the enqueue.
  Owned<cl_event> hold_gate();

  // Takes over the one reference the enqueue gave us.
  Fence adopt_fence(cl_event event) noexcept;

  // A marker waits for everything enqueued before it on an in-order queue.
  // Flushed, or a driver may never submit it and the fence never passes;
  // a marker that cannot be flushed is given back and the failure thrown
  // (nothing but the marker was enqueued, so nothing goes untracked).
  Fence record_marker(cl_command_queue queue, bool ours, std::string_view where);

  // A consumer's queue, refused unless it lives in our context (an event of
  // ours means nothing to a queue of another context, and its commands could
  // not name our buffers).
  cl_command_queue consumer_queue(std::uintptr_t handle, std::string_view doing);

  // A command behind a fence ended abnormally. A launch has no completion to
  // report it through, so it is logged here; and if it ran on our queue,
  // that queue has no defined state any more: the next quiesce replaces it.
  void note_failed_fence(cl_event event, cl_int status);

  // For failures that must not throw: after work is queued (its fence has to
  // reach the bridge) and in noexcept paths. Building the message may itself
  // fail (out of memory); then only the log line is lost.
  static void log_failure(cl_int result, std::string_view call, Operation operation) noexcept;

  Owned<cl_command_queue> make_queue();

  // The one place sync and async copies differ from 1-D to pitched: every
  // other step (hold gate, event, callback, completion) is shared.
  cl_int enqueue_copy(const CopyRequest& request, cl_bool blocking, const cl_event* wait_for, cl_event* done);

  // What a failed copy's message names: the range, and for a pitched copy
  // its rows and pitches.
  static std::string describe_copy(const CopyRequest& request);

  // A pitched request the driver would refuse, or that would reach past the
  // buffer, is the seam's InvalidRange naming the rows at fault, not a copy
  // failure (the bridge checks the same; this is the backend's own word).
  static void check_pitched(const CopyRequest& request, const char* call);

  bool front_finished();

  // CL_COMPLETE, a negative code for a command that failed, or a positive
  // one (queued, submitted, running) for a command not finished.
  cl_int execution_status(cl_event event, cl_int& status) const;

  void mark_queue_unusable();

  // Built on first use: compiling costs PoCL a noticeable fraction of a
  // second, and most bridges never launch.
  cl_kernel axpy_kernel();

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

}  // namespace devbridge::opencl::detail
