// Moving a copy's bytes where the CPU addresses both sides (the host
// backend's memory, the fake's): one memcpy, or one per row of a pitched
// copy, never touching the bytes between rows.
#pragma once

#include <cstring>

#include "devbridge/backend.hpp"

namespace devbridge::detail {

// `device` is the allocation's address plus the request's device offset.
// Only after the backend checked both spans: nothing here can wrap.
inline void move_request_bytes(const CopyRequest& request, std::byte* device) noexcept {
  const bool up = request.direction == CopyDirection::HostToDevice;
  if (!request.layout.pitched()) {
    if (up)
      std::memcpy(device, request.host, request.len);
    else
      std::memcpy(request.host, device, request.len);
    return;
  }
  const auto& layout = request.layout;
  std::byte* host = request.host;
  for (std::uint64_t row = 0;;) {
    if (up)
      std::memcpy(device, host, layout.row_bytes);
    else
      std::memcpy(host, device, layout.row_bytes);
    // Never past the last row: a single row's pitch may be anything, and a
    // pointer moved beyond the span is undefined even if never read.
    if (++row == layout.rows) break;
    host += layout.host_pitch;
    device += layout.device_pitch;
  }
}

}  // namespace devbridge::detail
