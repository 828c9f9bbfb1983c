// While a fill or sink runs: what keep_lent_chunk_memory() (transfer.hpp)
// keeps of the chunk it was handed, set for this thread by the code that
// lends the chunk (the ring's chunks, the in-place routes).
#pragma once

#include <functional>
#include <memory>

namespace devbridge::detail {

class LendingChunk {
 public:
  using Keep = std::function<std::shared_ptr<void>()>;
  // `keep` makes the owner; it outlives this.
  explicit LendingChunk(const Keep& keep) noexcept;
  ~LendingChunk();
  LendingChunk(const LendingChunk&) = delete;
  LendingChunk& operator=(const LendingChunk&) = delete;

  // The innermost one's owner on this thread, or null (none, or it could not be made).
  static std::shared_ptr<void> keep_current() noexcept;

 private:
  const Keep* keep_;
  const Keep* outer_;
};

}  // namespace devbridge::detail
