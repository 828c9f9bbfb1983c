// Chunks of memory lent to a Python callback for one call (lent_views.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <nanobind/nanobind.h>

namespace devbridge::python {

// Memoryviews over memory lent to a Python callback for one call (a sink's
// or fill's chunk: a ring range, or, where device memory is host memory, an
// allocation's own bytes). Each is a view of a LentChunk (lent_views.cpp), a
// buffer exporter that counts its exports and refuses new ones once the
// call returned. A callback that kept the memoryview then reads "released
// memoryview" rather than memory the bridge has reused or freed since; one
// that kept anything else over the bytes (numpy.frombuffer(chunk), a slice
// or cast of it), which cannot be taken back, makes a call that returned
// fail with BufferError. Made, ended and destroyed with the GIL held.
class LentViews {
 public:
  explicit LentViews(bool writable) : writable_(writable) {}
  LentViews(const LentViews&) = delete;
  LentViews& operator=(const LentViews&) = delete;
  // Ends what end() did not (the call raised: its error wins over a buffer still held).
  ~LentViews();

  nanobind::object lend(std::span<const std::byte> chunk);
  // After the call returned: every loan ended, or BufferError naming
  // `callback` and the bytes (from byte `at` of its stream, when it has one).
  void end(const char* callback, std::optional<std::uint64_t> at = std::nullopt);

 private:
  struct Loan {
    nanobind::object chunk, view;  // the LentChunk, and the memoryview of it the callback was handed
  };
  // The loan's memoryview released and its chunk closed to new exports:
  // whether nothing else still holds a buffer over the bytes.
  static bool close(const Loan& loan) noexcept;

  bool writable_;
  std::vector<Loan> loans_;
};
// callback(at, chunk) with `chunk` lent for the call (a sink's or fill's),
// then ended: BufferError naming `name` where it kept the bytes.
void lend_for_call(nanobind::handle callback, const char* name, std::uint64_t at, std::span<const std::byte> chunk,
                   bool writable);

}  // namespace devbridge::python
