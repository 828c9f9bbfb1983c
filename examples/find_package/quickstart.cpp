// The README's C++ example, runnable: upload, view, download, verify.
#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

#include <devbridge/backends.hpp>
#include <devbridge/bridge.hpp>

int main() {
  using namespace devbridge;
  Bridge bridge(make_backend("host"), {.generation = 1, .ring_bytes = 1 << 20});
  const auto h = bridge.alloc_device({.max_extent = 1 << 20, .alignment = 256, .dtype = DType::Float32}, 4096);

  std::vector<float> input(1024);
  std::iota(input.begin(), input.end(), 1.0f);
  const auto r = bridge.reserve(4096);
  std::memcpy(bridge.host_bytes(r).data(), input.data(), 4096);
  const auto up = bridge.host_to_device(r, {h, 0, 4096}, CopyMode::Async);
  bridge.wait(up);  // now r is safe to release
  bridge.release_host(r);

  {
    auto view = bridge.view(h, {.dtype = DType::Float32, .shape = {32, 32}});
    const auto* data = reinterpret_cast<const float*>(view->data);  // host backend: a CPU address
    std::printf("view on %.*s, shape %lldx%lld, first %g\n", static_cast<int>(view->device.size()), view->device.data(),
                static_cast<long long>(view->shape[0]), static_cast<long long>(view->shape[1]), data[0]);
  }

  const auto out = bridge.reserve(4096);
  bridge.wait(bridge.device_to_host({h, 0, 4096}, out, CopyMode::Async));
  const bool same = std::memcmp(bridge.host_bytes(out).data(), input.data(), 4096) == 0;
  bridge.release_host(out);
  bridge.free_device(h);
  std::printf("round trip %s\n", same ? "exact" : "WRONG");
  return same ? 0 : 1;
}
