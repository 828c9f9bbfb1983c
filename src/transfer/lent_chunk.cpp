#include "transfer/lent_chunk.hpp"

#include "devbridge/transfer.hpp"

namespace devbridge {
namespace detail {
namespace {
thread_local const LendingChunk::Keep* t_lending = nullptr;
}  // namespace

LendingChunk::LendingChunk(const Keep& keep) noexcept : keep_(&keep), outer_(t_lending) { t_lending = keep_; }

LendingChunk::~LendingChunk() { t_lending = outer_; }

std::shared_ptr<void> LendingChunk::keep_current() noexcept {
  if (t_lending == nullptr) return nullptr;
  try {
    return (*t_lending)();
  } catch (...) {  // the chunk's memory is gone already (a close, a free): nothing to keep
    return nullptr;
  }
}

}  // namespace detail

std::shared_ptr<void> keep_lent_chunk_memory() { return detail::LendingChunk::keep_current(); }

}  // namespace devbridge
