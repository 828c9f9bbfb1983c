#include "memory_reserve.hpp"

#include <cstdlib>
#include <new>

namespace devbridge::cli {
namespace {

void* g_reserve = nullptr;

void give_back_reserve_and_fail() {
  std::free(g_reserve);
  g_reserve = nullptr;
  std::set_new_handler(nullptr);  // a failure after this one fails as usual
  throw std::bad_alloc();
}

}  // namespace

void keep_memory_for_unwinding(std::size_t bytes) {
  std::free(g_reserve);
  g_reserve = std::malloc(bytes);
  std::set_new_handler(g_reserve != nullptr ? &give_back_reserve_and_fail : nullptr);
}

}  // namespace devbridge::cli
