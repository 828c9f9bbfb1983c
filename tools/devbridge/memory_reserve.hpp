// Room kept for the unwinding after an allocation fails. A failed allocation
// deep in a parse (a trace, a checkpoint's header) unwinds through
// destructors that allocate themselves (nlohmann::json's destroys a deep tree
// with a stack of its own), and one that failed in a destructor would end the
// process in std::terminate, the command's error unsaid and its output's
// temporary file left behind.
#pragma once

#include <cstddef>

namespace devbridge::cli {

// From now on, the first allocation that fails gives `bytes` held since back
// before it throws std::bad_alloc, so that what the unwinding allocates
// finds room. Address space only: the pages are never touched.
void keep_memory_for_unwinding(std::size_t bytes);

}  // namespace devbridge::cli
