#include "boundary.hpp"

#include <exception>
#include <new>
#include <stdexcept>
#include <system_error>

#include "devbridge/types.hpp"

namespace devbridge::c_api {

// The C constants are the vocabulary's kinds in the vocabulary's order, one up
// (0 is success); a kind added to error.hpp must be added to the header too.
static_assert(kErrorKindCount == DEVBRIDGE_ERROR_BROKEN, "every ErrorKind has a DEVBRIDGE_ERROR_ constant");
static_assert(status_of(ErrorKind::AllocationFailed) == DEVBRIDGE_ERROR_ALLOCATION_FAILED);
static_assert(status_of(ErrorKind::DeviceCopyFailed) == DEVBRIDGE_ERROR_DEVICE_COPY_FAILED);
static_assert(status_of(ErrorKind::OutputCopyFailed) == DEVBRIDGE_ERROR_OUTPUT_COPY_FAILED);
static_assert(status_of(ErrorKind::InvalidExtent) == DEVBRIDGE_ERROR_INVALID_EXTENT);
static_assert(status_of(ErrorKind::InvalidAlignment) == DEVBRIDGE_ERROR_INVALID_ALIGNMENT);
static_assert(status_of(ErrorKind::InvalidRange) == DEVBRIDGE_ERROR_INVALID_RANGE);
static_assert(status_of(ErrorKind::UnknownDeviceHandle) == DEVBRIDGE_ERROR_UNKNOWN_DEVICE_HANDLE);
static_assert(status_of(ErrorKind::OldGenerationHandle) == DEVBRIDGE_ERROR_OLD_GENERATION_HANDLE);
static_assert(status_of(ErrorKind::ForeignDomain) == DEVBRIDGE_ERROR_FOREIGN_DOMAIN);
static_assert(status_of(ErrorKind::InvalidViewDType) == DEVBRIDGE_ERROR_INVALID_VIEW_DTYPE);
static_assert(status_of(ErrorKind::InvalidTensorView) == DEVBRIDGE_ERROR_INVALID_TENSOR_VIEW);
static_assert(status_of(ErrorKind::UnsupportedDType) == DEVBRIDGE_ERROR_UNSUPPORTED_DTYPE);
static_assert(status_of(ErrorKind::AllocationStillInUse) == DEVBRIDGE_ERROR_ALLOCATION_STILL_IN_USE);
static_assert(status_of(ErrorKind::Backpressure) == DEVBRIDGE_ERROR_BACKPRESSURE);
static_assert(status_of(ErrorKind::Unavailable) == DEVBRIDGE_ERROR_UNAVAILABLE);
static_assert(status_of(ErrorKind::Unsupported) == DEVBRIDGE_ERROR_UNSUPPORTED);
static_assert(status_of(ErrorKind::Closed) == DEVBRIDGE_ERROR_CLOSED);
static_assert(status_of(ErrorKind::Broken) == DEVBRIDGE_ERROR_BROKEN);

static_assert(kDTypeCount == DEVBRIDGE_DTYPE_COUNT, "every DType has a DEVBRIDGE_DTYPE_ constant");
static_assert(static_cast<int>(DType::Bool) == DEVBRIDGE_DTYPE_BOOL);
static_assert(static_cast<int>(DType::UInt8) == DEVBRIDGE_DTYPE_UINT8);
static_assert(static_cast<int>(DType::Float32) == DEVBRIDGE_DTYPE_FLOAT32);
static_assert(static_cast<int>(DType::Fp8E5M2) == DEVBRIDGE_DTYPE_FP8E5M2);
static_assert(static_cast<int>(ShapeKind::Tensor) == DEVBRIDGE_SHAPE_TENSOR);

namespace {

// A failure's message per thread, as errno is: a caller reads it right after
// the failing call, from the thread that made it.
thread_local std::string last_message;

}  // namespace

devbridge_status fail(ErrorKind kind, std::string_view message) noexcept {
  try {
    last_message.assign(message);
  } catch (...) {
    // No memory for the text: the kind alone must still get through.
    last_message.clear();
  }
  return status_of(kind);
}

devbridge_status translate_current_exception() noexcept {
  try {
    throw;
  } catch (const Error& error) {
    return fail(error.kind(), error.message());
  } catch (const std::bad_alloc&) {
    return fail(ErrorKind::AllocationFailed, "out of host memory");
  } catch (const std::length_error& error) {
    // A container asked for more than it can hold: a size too large to allocate.
    return fail(ErrorKind::AllocationFailed, error.what());
  } catch (const std::invalid_argument& error) {
    // What the test controls throw for an argument they refuse.
    return fail(ErrorKind::InvalidRange, error.what());
  } catch (const std::out_of_range& error) {
    return fail(ErrorKind::InvalidRange, error.what());
  } catch (const std::system_error& error) {
    // The OS refused a resource (a thread, a lock): nothing the caller did.
    return fail(ErrorKind::Unavailable, error.what());
  } catch (const std::exception& error) {
    // Nothing else is thrown by design; whatever this is, the state behind it
    // is not known to be sound, so the caller should restart.
    return fail(ErrorKind::Broken, std::string("unexpected failure inside devbridge: ") + error.what());
  } catch (...) {
    return fail(ErrorKind::Broken, "unexpected failure inside devbridge (not a std::exception)");
  }
}

void invalid_argument(std::string_view message) { throw Error(ErrorKind::InvalidRange, message); }

void require_reserved_zero(std::int64_t value, std::string_view what) {
  if (value != 0) invalid_argument(std::string(what) + " is reserved and must be 0, got " + std::to_string(value));
}

std::string_view text(const char* value, std::string_view what) { return std::string_view(&required(value, what)); }

std::chrono::nanoseconds timeout(std::int64_t nanoseconds, std::string_view what) {
  if (nanoseconds < 0)
    invalid_argument(std::string(what) + " of " + std::to_string(nanoseconds) +
                     " ns is negative; a duration is 0 or more nanoseconds (DEVBRIDGE_WAIT_FOREVER: no limit)");
  return std::chrono::nanoseconds(nanoseconds);
}

DType dtype_from_c(devbridge_dtype dtype, std::string_view what) {
  if (dtype < 0 || dtype >= DEVBRIDGE_DTYPE_COUNT)
    throw Error(ErrorKind::UnsupportedDType,
                std::string(what) + " is " + std::to_string(dtype) + ", which names no dtype (DEVBRIDGE_DTYPE_*)");
  return static_cast<DType>(dtype);
}

// The byte size of `dims` of `dtype`, every product checked.
std::uint64_t tensor_bytes(DType dtype, std::span<const std::int64_t> dims, std::string_view what) {
  if (dims.size() > static_cast<std::size_t>(kMaxRank))
    invalid_argument(std::string(what) + ": rank " + std::to_string(dims.size()) + " is more than " +
                     std::to_string(kMaxRank));
  std::uint64_t total = dtype_size(dtype);
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const std::string dim = std::string(what) + "[" + std::to_string(i) + "]";
    if (dims[i] < 0) invalid_argument(dim + " is " + std::to_string(dims[i]) + ", negative");
    total = checked::mul_or_throw(total, static_cast<std::uint64_t>(dims[i]), ErrorKind::InvalidRange, dim);
  }
  return total;
}

ObjectSpec object_spec_from_c(const devbridge_object_spec* spec) {
  const auto& given = sized(spec, "spec");
  if (given.shape < DEVBRIDGE_SHAPE_SCALAR || given.shape > DEVBRIDGE_SHAPE_TENSOR)
    invalid_argument("spec->shape is " + std::to_string(given.shape) + ", not a DEVBRIDGE_SHAPE_ constant");
  ObjectSpec result;
  result.max_extent = given.max_extent;
  result.alignment = given.alignment;
  result.dtype = given.dtype == DEVBRIDGE_DTYPE_BYTES ? std::nullopt
                                                      : std::optional<DType>(dtype_from_c(given.dtype, "spec->dtype"));
  result.shape = static_cast<ShapeKind>(given.shape);
  return result;
}

}  // namespace devbridge::c_api

extern "C" {

uint32_t devbridge_abi_version(void) { return DEVBRIDGE_ABI_VERSION; }

const char* devbridge_last_error_message(void) { return devbridge::c_api::last_message.c_str(); }

const char* devbridge_status_name(devbridge_status status) {
  if (status == DEVBRIDGE_OK) return "OK";
  if (status < DEVBRIDGE_ERROR_ALLOCATION_FAILED || status > DEVBRIDGE_ERROR_BROKEN) return nullptr;
  // The names are string literals, so their views end in a NUL.
  return devbridge::kind_name(static_cast<devbridge::ErrorKind>(status - 1)).data();
}

const char* devbridge_dtype_name(devbridge_dtype dtype) {
  if (dtype < 0 || dtype >= DEVBRIDGE_DTYPE_COUNT) return nullptr;
  return devbridge::dtype_info(static_cast<devbridge::DType>(dtype)).name.data();
}

uint32_t devbridge_dtype_size(devbridge_dtype dtype) {
  if (dtype < 0 || dtype >= DEVBRIDGE_DTYPE_COUNT) return 0;
  return devbridge::dtype_size(static_cast<devbridge::DType>(dtype));
}

}  // extern "C"
