// The host (CPU) backend: "device" memory is aligned host memory, the ring is
// an mlock()ed mapping where the system allows, and asynchronous copies run
// on the copy engine (copy_engine.hpp), and so do launches, on a compute lane
// of their own: a launch returns while it runs, and its fence passes when it
// finished, as on a GPU.
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>
#include "core/log.hpp"

#include "backends/backend_options.hpp"
#include "backends/host/copy_engine.hpp"
#include "backends/host/system_info.hpp"
#include "backends/system_memory.hpp"
#include "devbridge/backends/host.hpp"
#include "devbridge/checked.hpp"
#include "devbridge/types.hpp"

namespace devbridge::host {

namespace {

using detail::describe_errno;
using detail::format_bytes;

// Cache-line alignment at least: vector loads and the copy engine's memcpy
// never split a line at the start of an allocation.
constexpr std::uint64_t kMinAlignment = 64;
// From this size up, an allocation starts on a huge-page boundary and asks
// for transparent huge pages (madvise, the kernel's default THP mode, gives
// them only where asked). First touch of fresh memory then faults one 2 MiB
// page instead of 512 small ones: 256 MiB measured 170 ms with small pages
// and 45 ms with huge ones on this project's VM. numpy does the same for
// arrays of 4 MiB and up, so a fresh allocation here costs what a fresh
// numpy array does.
constexpr std::uint64_t kHugePage = 2u << 20;
constexpr std::uint64_t kHugePageFrom = 4u << 20;
// Freed blocks are kept warm by the bridge's caching pool, not here (the
// backend asks for it: caches_allocations): a fresh block costs its page
// faults (256 MiB: 45 ms even in huge pages, twice what copying into it
// costs), a reused one nothing, and a worker allocates the same shapes step
// after step. The pool's default cap bounds what it keeps idle, as this
// backend's own warm cache of 4 blocks once did, and the pool's memory shows
// in memory_stats, goes back with empty_cache() and goes at close.
constexpr std::uint64_t kPoolCapBytes = 512u << 20;
// From this size up, device memory is mapped from the kernel and unmapped
// when freed, so it goes back to the system at once. From the C library's
// heap it would not: after the first large free glibc raises its own mmap
// threshold (to 32 MiB), and blocks it hands out from the heap stay in the
// process after free(), held though memory_stats() rightly says 0.
constexpr std::uint64_t kMapFrom = 256u << 10;

// A hint: where the kernel cannot (THP off, no memory to compact), the memory
// simply stays in small pages.
void advise_huge_pages(void* memory, std::uint64_t bytes) noexcept {
  const std::uint64_t whole = bytes & ~(kHugePage - 1);
  if (whole != 0) (void)madvise(memory, whole, MADV_HUGEPAGE);
}

std::size_t system_page_size() {
  const long size = sysconf(_SC_PAGESIZE);
  if (size <= 0) {
    throw Error(ErrorKind::Unavailable, "host backend: sysconf(_SC_PAGESIZE) failed: " + describe_errno(errno));
  }
  if (!is_power_of_two(static_cast<std::uint64_t>(size))) {
    throw Error(ErrorKind::Unavailable, fmt::format("host backend: page size {} is not a power of two", size));
  }
  return static_cast<std::size_t>(size);
}

std::string memlock_limit() {
  struct rlimit limit {};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return "RLIMIT_MEMLOCK unknown: getrlimit: " + describe_errno(errno);
  if (limit.rlim_cur == RLIM_INFINITY) return "RLIMIT_MEMLOCK=unlimited";
  return "RLIMIT_MEMLOCK=" + format_bytes(limit.rlim_cur);
}

std::string available_memory_text() {
  const auto memory = devbridge::detail::read_memory_info();
  std::string text = memory.problem.empty() ? fmt::format("{} bytes available", memory.available) : memory.problem;
  // An address-space limit refuses a mapping with ENOMEM however much memory
  // is free: name it, or the figure above points at a non-problem.
  rlimit address_space{};
  if (::getrlimit(RLIMIT_AS, &address_space) == 0 && address_space.rlim_cur != RLIM_INFINITY)
    text += fmt::format("; the process's address space is limited to {} bytes (RLIMIT_AS, ulimit -v)",
                        address_space.rlim_cur);
  return text;
}

using checked::range_within;

class HostBackend final : public Backend, private TestControls {
 public:
  explicit HostBackend(const Options& options)
      : cpu_name_(detail::cpu_model_name()),
        page_size_(system_page_size()),
        inline_async_max_bytes_(options.inline_async_max_bytes),
        engine_(options.inline_async_max_bytes) {}

  ~HostBackend() override {
    engine_.stop();
    release_leftovers();
  }

  BackendInfo describe() override {
    BackendInfo info;
    info.name = "host";
    info.vendor = "cpu";
    info.device_name = cpu_name_;
    info.device_kind = DeviceKind::Cpu;
    info.device_ordinal = 0;
    info.device_id = "0";
    // Freed memory is kept by the bridge's pool (kPoolCapBytes above); host
    // memory is addressed linearly: a part is an address inside a block.
    info.caches_allocations = true;
    info.part_alignment = 512;
    info.pool_cap_bytes = kPoolCapBytes;
    info.host_addressable = true;
    info.cheap_registration = true;
    info.adopt = true;
    const auto memory = devbridge::detail::read_memory_info();
    info.total_memory = memory.total;
    info.free_memory = memory.available;
    for (const auto& dtype : all_dtypes()) info.dtypes.push_back(dtype.dtype);

    std::string ring_note;
    {
      std::lock_guard lock(memory_mutex_);
      info.host_memory_page_locked =
          !host_blocks_.empty() &&
          std::all_of(host_blocks_.begin(), host_blocks_.end(), [](const auto& entry) { return entry.second.locked; });
      ring_note = host_blocks_.empty() ? "no host ring allocated yet" : ring_note_;
    }
    info.notes = ring_note + "; copy engine: one thread per direction (H2D, D2H) and one for launches";
    if (inline_async_max_bytes_ > 0) {
      info.notes += fmt::format(", async copies and launches up to {} run on the caller while their engine is idle",
                                format_bytes(inline_async_max_bytes_));
    }
    if (!memory.problem.empty()) info.notes += "; " + memory.problem;
    return info;
  }

  DeviceAllocation allocate(std::uint64_t bytes, std::uint64_t alignment) override {
    if (bytes == 0) throw Error(ErrorKind::InvalidExtent, "host backend: allocate of 0 bytes");
    if (!is_power_of_two(alignment)) {
      throw Error(ErrorKind::InvalidAlignment,
                  fmt::format("host backend: alignment {} is not a power of two (allocate of {} bytes)", alignment, bytes));
    }
    const std::uint64_t effective_alignment = std::max(alignment, bytes >= kHugePageFrom ? kHugePage : kMinAlignment);
    // posix_memalign may pad by up to the alignment; refuse a size for which
    // that padding does not fit in the address space (no object is larger
    // than PTRDIFF_MAX) before the C library, or a sanitizer's, has to.
    if (const auto padded = checked::add(bytes, effective_alignment);
        !padded || *padded > static_cast<std::uint64_t>(std::numeric_limits<std::ptrdiff_t>::max())) {
      throw Error(ErrorKind::AllocationFailed,
                  fmt::format("host backend: allocate of {} bytes (alignment {}): too large for the address space",
                              bytes, effective_alignment));
    }
    devbridge::detail::refuse_more_than_the_machine_has(bytes, "host backend: allocate", bytes);
    const Memory memory = bytes >= kMapFrom ? map_aligned(bytes, effective_alignment)
                                            : allocate_from_heap(bytes, effective_alignment);
    if (bytes >= kHugePageFrom) advise_huge_pages(memory.data, bytes);
    const auto address = reinterpret_cast<std::uintptr_t>(memory.data);
    try {
      std::lock_guard lock(memory_mutex_);
      allocations_.emplace(address, memory);
      live_bytes_ += bytes;
    } catch (const std::bad_alloc&) {
      release(memory);
      throw Error(ErrorKind::AllocationFailed,
                  fmt::format("host backend: out of memory recording an allocation of {} bytes", bytes));
    }
    return DeviceAllocation{address, bytes, address};
  }

  void free(const DeviceAllocation& allocation) noexcept override {
    Memory memory;
    {
      std::lock_guard lock(memory_mutex_);
      const auto it = allocations_.find(allocation.token);
      if (it == allocations_.end()) {
        devbridge::detail::log().error("host backend: free of 0x{:x} ({} bytes), which is not a live allocation; ignored",
                      allocation.address, allocation.bytes);
        return;
      }
      memory = it->second;
      live_bytes_ -= memory.bytes;
      allocations_.erase(it);
    }
    release(memory);
  }

  HostBlock allocate_host(std::uint64_t bytes) override {
    if (bytes == 0) throw Error(ErrorKind::InvalidExtent, "host backend: allocate_host of 0 bytes");
    // Page-aligned and page-sized, so mlock pins exactly this block.
    const auto rounded = checked::align_up(bytes, page_size_);
    if (!rounded) {
      throw Error(ErrorKind::AllocationFailed,
                  fmt::format("host backend: allocate_host of {} bytes: too large (rounded up to a multiple of the "
                              "{}-byte page it does not fit in 64 bits)",
                              bytes, page_size_));
    }
    static_assert(sizeof(std::size_t) == sizeof(std::uint64_t), "the host backend assumes a 64-bit address space");
    const std::size_t mapped = static_cast<std::size_t>(*rounded);
    // mlock below touches every page at once: a ring past the machine's memory would be killed there.
    devbridge::detail::refuse_more_than_the_machine_has(mapped, "host backend: allocate_host (a host ring)", bytes);
    void* memory = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) {
      const int error = errno;  // before reading /proc for the message
      throw Error(ErrorKind::AllocationFailed,
                  fmt::format("host backend: mmap of {} bytes for a host ring of {} bytes failed: {}; {}", mapped,
                              bytes, describe_errno(error), available_memory_text()));
    }

    // Page-locking is an optimisation: without it the ring still works, only
    // the kernel may page it out. So a refusal is reported, not thrown.
    RingBlock block{mapped, true};
    std::string note;
    if (mlock(memory, mapped) == 0) {
      note = fmt::format("ring page-locked with mlock ({})", format_bytes(mapped));
    } else {
      const int error = errno;
      block.locked = false;
      note = fmt::format("mlock failed: {} ({}); the {} ring is pageable", describe_errno(error), memlock_limit(),
                         format_bytes(mapped));
      devbridge::detail::log().warn("host backend: {}", note);
    }

    try {
      std::lock_guard lock(memory_mutex_);
      host_blocks_.emplace(static_cast<std::byte*>(memory), block);
      ring_note_ = std::move(note);
    } catch (const std::bad_alloc&) {
      unmap(static_cast<std::byte*>(memory), block);
      throw Error(ErrorKind::AllocationFailed, "host backend: out of memory recording the host ring block");
    }
    return HostBlock{static_cast<std::byte*>(memory), bytes, block.locked, 0};
  }

  void free_host(const HostBlock& host_block) noexcept override {
    RingBlock block;
    {
      std::lock_guard lock(memory_mutex_);
      const auto it = host_blocks_.find(host_block.data);
      if (it == host_blocks_.end()) {
        devbridge::detail::log().error("host backend: free_host of {} ({} bytes), which is not a live host block; ignored",
                      static_cast<const void*>(host_block.data), host_block.bytes);
        return;
      }
      block = it->second;
      host_blocks_.erase(it);
    }
    unmap(host_block.data, block);
  }

  void submit_copy(const CopyRequest& request) override {
    if (request.host == nullptr || request.device.address == 0) {
      throw Error(ErrorKind::InvalidRange, fmt::format("host backend: copy of {} bytes with a null {} pointer",
                                                       request.len, request.host == nullptr ? "host" : "device"));
    }
    if (!range_within(request.device_offset, request_device_span(request), request.device.bytes)) {
      throw Error(ErrorKind::InvalidRange,
                  fmt::format("host backend: copy reaching {} bytes at device offset {} exceeds the allocation at "
                              "0x{:x} ({} bytes)",
                              request_device_span(request), request.device_offset, request.device.address,
                              request.device.bytes));
    }
    if (request.mode == CopyMode::Async) {
      try {
        engine_.submit(request);
      } catch (const std::bad_alloc&) {
        // The seam speaks only Error; the bridge then keeps the host range
        // with the caller, as for any failed submit.
        throw Error(ErrorKind::DeviceCopyFailed,
                    fmt::format("host backend: out of memory queueing an async copy of {} bytes", request.len));
      }
      return;
    }
    // A sync copy runs here, after any earlier queued copy touching its bytes.
    engine_.wait_for_conflicts(detail::access_of(request));
    detail::copy_bytes(request);
  }

  void drain_completions(std::vector<Completion>& out) override { engine_.drain_completions(out); }

  bool wait_for_completions(std::chrono::nanoseconds timeout) override {
    return engine_.wait_for_completions(timeout);
  }

  void quiesce() override { engine_.quiesce(); }
  void stop_queues() noexcept override { engine_.stop(); }

  Fence launch_axpy(const AxpyLaunch& launch) override {
    const auto counted = checked::mul(launch.count, sizeof(float));
    if (!counted) {
      throw Error(ErrorKind::InvalidRange, fmt::format("host backend: axpy over {} elements overflows", launch.count));
    }
    const std::uint64_t bytes = *counted;
    if (!range_within(launch.x_offset, bytes, launch.x.bytes) || !range_within(launch.y_offset, bytes, launch.y.bytes)) {
      throw Error(ErrorKind::InvalidRange,
                  fmt::format("host backend: axpy over {} floats at x offset {} (allocation {} bytes), y offset {} "
                              "(allocation {} bytes) is out of bounds",
                              launch.count, launch.x_offset, launch.x.bytes, launch.y_offset, launch.y.bytes));
    }
    const detail::AxpyJob job{reinterpret_cast<const std::byte*>(launch.x.address) + launch.x_offset,
                              reinterpret_cast<std::byte*>(launch.y.address) + launch.y_offset, launch.count,
                              launch.a, launch.b};
    try {
      return engine_.launch(job);
    } catch (const std::bad_alloc&) {
      // Nothing was queued, so no kernel is left untracked.
      throw Error(ErrorKind::Unavailable,
                  fmt::format("host backend: out of memory queueing an axpy over {} floats", launch.count));
    }
  }

  Fence record_fence(const QueueRef& where) override {
    switch (where.queue) {
      case Queue::CopyUp:
      case Queue::CopyDown:
      case Queue::Compute:
        return engine_.record(where.queue);
      case Queue::Consumer:
        throw Error(ErrorKind::Unsupported,
                    "host backend: a CPU consumer has no queue to record a fence on: its work is done when its call "
                    "returns (DLPack: host views take stream None)");
    }
    throw Error(ErrorKind::Unsupported,
                fmt::format("host backend: no queue {} to record a fence on", static_cast<int>(where.queue)));
  }

  bool fence_passed(Fence fence) override { return engine_.passed(fence); }

  bool wait_fence(Fence fence, std::chrono::nanoseconds timeout) override { return engine_.wait(fence, timeout); }

  // A fence is a lane's sequence number: nothing to give back.
  void release_fence(Fence /*fence*/) noexcept override {}

  // Host memory needs nothing to be a staging source: it is used as it is.
  // Device memory is host memory here: an adopted region is used as it is,
  // and nothing is freed when the bridge lets go (token 0 is no allocation
  // of ours, so a free of it by mistake is caught and logged).
  HostImport import_host(const ImportRequest& request) override {
    if (request.use != ImportUse::Adopt) return Backend::import_host(request);
    const auto address = reinterpret_cast<std::uintptr_t>(request.region.data) + request.offset;
    return HostImport{.device = DeviceAllocation{address, request.bytes, 0}, .adopted = true};
  }

  std::uint64_t live_allocations() const override {
    std::lock_guard lock(memory_mutex_);
    return allocations_.size();
  }

  std::optional<std::uint64_t> live_bytes() const override {
    std::lock_guard lock(memory_mutex_);
    return live_bytes_;
  }

  std::optional<std::uint64_t> live_host_blocks() const override {
    std::lock_guard lock(memory_mutex_);
    return host_blocks_.size();
  }

  bool can_hold_copies() const noexcept override { return true; }
  void hold_copies(bool hold) override { engine_.set_held(hold); }
  TestControls* test_controls() noexcept override { return this; }

 private:
  struct RingBlock {
    std::size_t mapped = 0;
    bool locked = false;
  };

  // A device allocation: `mapped` bytes of its own mapping, or (0) a block
  // of the C library's heap.
  struct Memory {
    std::byte* data = nullptr;
    std::uint64_t bytes = 0;
    std::size_t mapped = 0;
  };

  static Memory allocate_from_heap(std::uint64_t bytes, std::uint64_t alignment) {
    void* memory = nullptr;
    if (const int rc = posix_memalign(&memory, alignment, bytes); rc != 0) {
      throw Error(ErrorKind::AllocationFailed,
                  fmt::format("host backend: posix_memalign of {} bytes (alignment {}) failed: {}; {}", bytes,
                              alignment, describe_errno(rc), available_memory_text()));
    }
    return Memory{static_cast<std::byte*>(memory), bytes, 0};
  }

  // A mapping of `bytes` (whole pages) starting on an `alignment` boundary:
  // mapped with the alignment's slack, the slack on either side unmapped.
  Memory map_aligned(std::uint64_t bytes, std::uint64_t alignment) const {
    const std::uint64_t slack = alignment > page_size_ ? alignment - page_size_ : 0;
    const auto pages = checked::align_up(bytes, page_size_);
    const auto reserved = pages ? checked::add(*pages, slack) : std::nullopt;
    if (!reserved) {
      throw Error(ErrorKind::AllocationFailed,
                  fmt::format("host backend: allocate of {} bytes (alignment {}): too large for the address space",
                              bytes, alignment));
    }
    void* base = mmap(nullptr, static_cast<std::size_t>(*reserved), PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      const int error = errno;  // before reading /proc for the message
      throw Error(ErrorKind::AllocationFailed,
                  fmt::format("host backend: allocate of {} bytes (alignment {}): mmap of {} bytes failed: {}; {}",
                              bytes, alignment, *reserved, describe_errno(error), available_memory_text()));
    }
    auto* const start = static_cast<std::byte*>(base);
    auto* const data = start + (alignment - reinterpret_cast<std::uintptr_t>(base) % alignment) % alignment;
    auto* const end = start + *reserved;
    unmap_slack(start, static_cast<std::size_t>(data - start));
    unmap_slack(data + *pages, static_cast<std::size_t>(end - (data + *pages)));
    return Memory{data, bytes, static_cast<std::size_t>(*pages)};
  }

  static void unmap_slack(std::byte* data, std::size_t bytes) noexcept {
    if (bytes != 0 && munmap(data, bytes) != 0) {
      devbridge::detail::log().error("host backend: munmap of {} bytes of alignment slack at {} failed: {}", bytes,
                                     static_cast<const void*>(data), describe_errno(errno));
    }
  }

  static void release(const Memory& memory) noexcept {
    if (memory.mapped == 0) return std::free(memory.data);
    if (munmap(memory.data, memory.mapped) != 0) {
      devbridge::detail::log().error("host backend: munmap of the {}-byte allocation at {} failed: {}", memory.mapped,
                                     static_cast<const void*>(memory.data), describe_errno(errno));
    }
  }

  static void unmap(std::byte* data, const RingBlock& block) noexcept {
    if (block.locked && munlock(data, block.mapped) != 0) {
      devbridge::detail::log().error("host backend: munlock of the {}-byte host block at {} failed: {}", block.mapped,
                    static_cast<const void*>(data), describe_errno(errno));
    }
    if (munmap(data, block.mapped) != 0) {
      devbridge::detail::log().error("host backend: munmap of the {}-byte host block at {} failed: {}", block.mapped,
                    static_cast<const void*>(data), describe_errno(errno));
    }
  }

  // An owner that forgot to free (the bridge frees everything on close)
  // still leaks nothing; the engine has stopped, so nothing touches them.
  void release_leftovers() noexcept {
    std::lock_guard lock(memory_mutex_);
    if (!allocations_.empty() || !host_blocks_.empty()) {
      devbridge::detail::log().warn("host backend destroyed with {} live allocations and {} host blocks; freeing them",
                   allocations_.size(), host_blocks_.size());
    }
    for (const auto& [address, memory] : allocations_) release(memory);
    allocations_.clear();
    live_bytes_ = 0;
    for (const auto& [data, block] : host_blocks_) unmap(data, block);
    host_blocks_.clear();
  }

  const std::string cpu_name_;
  const std::size_t page_size_;
  const std::uint64_t inline_async_max_bytes_;

  mutable std::mutex memory_mutex_;
  std::unordered_map<std::uintptr_t, Memory> allocations_;  // device allocations by address
  std::uint64_t live_bytes_ = 0;  // their sum
  std::unordered_map<std::byte*, RingBlock> host_blocks_;
  std::string ring_note_;  // mlock outcome of the latest host block

  detail::CopyEngine engine_;
};


}  // namespace

std::unique_ptr<Backend> make_host_backend(const Options& options) { return std::make_unique<HostBackend>(options); }

std::unique_ptr<Backend> make_host_backend(const BackendOptions& options) {
  devbridge::detail::OptionReader reader("host", options);
  reader.single_device();
  Options typed;
  if (const auto bytes = reader.unsigned_integer(
          "inline_async_max_bytes", "async copies and launches up to this many bytes run on the submitting thread"))
    typed.inline_async_max_bytes = *bytes;
  reader.finish();
  return make_host_backend(typed);
}

}  // namespace devbridge::host
