// The Stager: the transfer planner with its route fixed to ring chunks.
#include "devbridge/stager.hpp"

#include <utility>

namespace devbridge {

namespace {

TransferOptions ring_chunks_only(StagerOptions options) {
  TransferOptions transfer;
  transfer.chunk_bytes = options.chunk_bytes;
  transfer.max_chunks_in_flight = options.max_chunks_in_flight;
  transfer.cleanup_timeout = options.cleanup_timeout;
  transfer.progress = std::move(options.progress);
  transfer.route = Route::RingChunks;
  return transfer;
}

}  // namespace

Stager::Stager(Bridge& bridge, StagerOptions options) : planner_(bridge, ring_chunks_only(std::move(options))) {}

Stager::~Stager() = default;

DeviceHandle Stager::upload(std::span<const std::byte> bytes, const ObjectSpec& spec, std::uint64_t extent) {
  return planner_.upload(bytes, spec, extent);
}

void Stager::upload_into(DeviceHandle handle, std::uint64_t device_offset, std::span<const std::byte> bytes) {
  planner_.upload_into(handle, device_offset, bytes);
}

void Stager::download(DeviceHandle handle, std::uint64_t device_offset, std::span<std::byte> out) {
  planner_.download(handle, device_offset, out);
}

}  // namespace devbridge
