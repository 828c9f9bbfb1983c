// What a process forked from this one starts with. One pthread_atfork hook
// for the module: a bridge made before the fork belongs to the parent (its
// copy threads and device context stayed there), and so do the threads the
// exit gate counted (gil.hpp).
#pragma once

#include <cstdint>

namespace devbridge::python {

// How many times this process was forked into being.
std::uint64_t forks_so_far() noexcept;

// Registers the hook; called once by the module.
void watch_forks();

}  // namespace devbridge::python
