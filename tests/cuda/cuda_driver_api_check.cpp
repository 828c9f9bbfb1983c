// cuda_driver_api.hpp against the toolkit's cuda.h, where one is installed:
// every enumerator, constant, handle, structure member and entry point its
// lists declare. Only compiled, never run: a difference fails the build.
//
// Our header comes first, so that cuda.h's macros (cuMemAlloc ->
// cuMemAlloc_v2, CU_STREAM_LEGACY, ...) cannot rewrite its declarations.
#include "backends/cuda/cuda_driver_api.hpp"
#include "cuda_test_entry_points.hpp"

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace {

namespace ours = devbridge::cuda::detail;

// ---- our types, spelled in cuda.h's --------------------------------------------
// Our enums, handles and structs are distinct types from cuda.h's (another
// namespace), so a signature is compared after mapping each of ours to the
// cuda.h type of the same name; everything else maps to itself.

template <typename T>
struct InCudaH {
  using type = T;
};
template <typename T>
using in_cuda_h = typename InCudaH<T>::type;

template <typename T>
struct InCudaH<const T> {
  using type = const in_cuda_h<T>;
};
template <typename T>
struct InCudaH<T*> {
  using type = in_cuda_h<T>*;
};
template <typename Result, typename... Parameters>
struct InCudaH<Result(Parameters...)> {
  using type = in_cuda_h<Result>(in_cuda_h<Parameters>...);
};

// Each enumeration, handle tag and struct of ours stands for cuda.h's of the same name.
#define DEVBRIDGE_MAP_TO_CUDA_H(name) \
  template <>                         \
  struct InCudaH<ours::name> {        \
    using type = ::name;              \
  };
#define DEVBRIDGE_MAP_NAMED_FIRST(name, ...) DEVBRIDGE_MAP_TO_CUDA_H(name)
#define DEVBRIDGE_MAP_HANDLE_TAG(handle, tag) DEVBRIDGE_MAP_TO_CUDA_H(tag)
DEVBRIDGE_CUDA_ENUMS(DEVBRIDGE_MAP_NAMED_FIRST)
DEVBRIDGE_CUDA_HANDLES(DEVBRIDGE_MAP_HANDLE_TAG)
DEVBRIDGE_CUDA_STRUCTS(DEVBRIDGE_MAP_NAMED_FIRST)
#undef DEVBRIDGE_MAP_HANDLE_TAG
#undef DEVBRIDGE_MAP_NAMED_FIRST
#undef DEVBRIDGE_MAP_TO_CUDA_H

// ---- the shape of a signature -------------------------------------------------
// What the calling convention sees of each parameter and of the result: its
// size and whether it is a pointer.

template <typename Ours, typename Theirs>
constexpr bool same_slot() {
  if constexpr (std::is_void_v<Ours> || std::is_void_v<Theirs>) {
    return std::is_void_v<Ours> && std::is_void_v<Theirs>;
  } else {
    return sizeof(Ours) == sizeof(Theirs) && std::is_pointer_v<Ours> == std::is_pointer_v<Theirs>;
  }
}

template <typename... Types>
struct TypeList {};

template <typename... Ours, typename... Theirs>
constexpr bool same_slots(TypeList<Ours...>, TypeList<Theirs...>) {
  if constexpr (sizeof...(Ours) != sizeof...(Theirs)) {
    return false;
  } else {
    return (same_slot<Ours, Theirs>() && ... && true);
  }
}

template <typename Ours, typename Theirs>
struct SameShape : std::false_type {};
template <typename OurResult, typename... OurParameters, typename TheirResult, typename... TheirParameters>
struct SameShape<OurResult (*)(OurParameters...), TheirResult (*)(TheirParameters...)>
    : std::bool_constant<same_slot<OurResult, TheirResult>() &&
                         same_slots(TypeList<OurParameters...>{}, TypeList<TheirParameters...>{})> {};

// ---- macros that cast an integer to a handle ----------------------------------

#define DEVBRIDGE_EXPANDED_TEXT(...) DEVBRIDGE_TEXT(__VA_ARGS__)
#define DEVBRIDGE_TEXT(...) #__VA_ARGS__

// The integer in a macro spelled "((CUstream)<integer>)", or -1 for any
// other spelling (which then fails the check rather than passing unread).
constexpr long long stream_cast_value(std::string_view text) {
  constexpr std::string_view kCast = "(CUstream)";
  const std::size_t at = text.find(kCast);
  if (at == std::string_view::npos) return -1;
  text.remove_prefix(at + kCast.size());
  int base = 10;
  if (text.starts_with("0x") || text.starts_with("0X")) {
    base = 16;
    text.remove_prefix(2);
  }
  long long value = 0;
  std::size_t digits = 0;
  for (; digits < text.size(); ++digits) {
    const char c = text[digits];
    const int digit = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                             : base;
    if (digit >= base) break;
    value = value * base + digit;
  }
  if (digits == 0) return -1;
  for (char c : text.substr(digits)) {
    if (c != ')' && c != ' ') return -1;
  }
  return value;
}

// ---- the checks -----------------------------------------------------------------

#define DEVBRIDGE_CHECK_ENUMERATOR(name, value)                                                           \
  static_assert(static_cast<long long>(ours::name) == static_cast<long long>(::name),                    \
                #name " has another value in cuda.h");                                                   \
  static_assert(std::is_same_v<in_cuda_h<decltype(ours::name)>, decltype(::name)>,                       \
                #name " belongs to another enumeration in cuda.h");
#define DEVBRIDGE_CHECK_ENUM(name, enumerators)                                                           \
  static_assert(sizeof(ours::name) == sizeof(::name) && alignof(ours::name) == alignof(::name),          \
                #name " has another size or alignment in cuda.h");                                       \
  enumerators(DEVBRIDGE_CHECK_ENUMERATOR)
DEVBRIDGE_CUDA_ENUMS(DEVBRIDGE_CHECK_ENUM)
#undef DEVBRIDGE_CHECK_ENUM
#undef DEVBRIDGE_CHECK_ENUMERATOR

#define DEVBRIDGE_CHECK_FLAG(name, cuda_h_macro, value) \
  static_assert(ours::name == (cuda_h_macro), #name " differs from cuda.h's " #cuda_h_macro);
DEVBRIDGE_CUDA_FLAG_CONSTANTS(DEVBRIDGE_CHECK_FLAG)
#undef DEVBRIDGE_CHECK_FLAG

#define DEVBRIDGE_CHECK_STREAM_HANDLE(function, cuda_h_macro, value)                  \
  static_assert(stream_cast_value(DEVBRIDGE_EXPANDED_TEXT(cuda_h_macro)) == (value), \
                #function "() differs from cuda.h's " #cuda_h_macro);
DEVBRIDGE_CUDA_STREAM_HANDLE_CONSTANTS(DEVBRIDGE_CHECK_STREAM_HANDLE)
#undef DEVBRIDGE_CHECK_STREAM_HANDLE

#define DEVBRIDGE_CHECK_HANDLE(handle, tag)                                                        \
  static_assert(std::is_same_v<in_cuda_h<ours::handle>, ::handle>, #handle " differs from cuda.h's"); \
  static_assert(sizeof(ours::handle) == sizeof(::handle), #handle " has another size in cuda.h");
DEVBRIDGE_CUDA_HANDLES(DEVBRIDGE_CHECK_HANDLE)
#undef DEVBRIDGE_CHECK_HANDLE

static_assert(std::is_same_v<ours::CUdevice, ::CUdevice>, "CUdevice differs from cuda.h's");
static_assert(std::is_same_v<ours::CUdeviceptr, ::CUdeviceptr>, "CUdeviceptr differs from cuda.h's");
static_assert(std::is_same_v<in_cuda_h<ours::CUhostFn>, ::CUhostFn>, "CUhostFn differs from cuda.h's");

// A struct per checked structure, so its members' checks can name it.
#define DEVBRIDGE_CHECK_MEMBER(type, member)                                                               \
  static_assert(offsetof(Ours, member) == offsetof(Theirs, member), #member " sits elsewhere in cuda.h"); \
  static_assert(std::is_same_v<in_cuda_h<decltype(Ours::member)>, decltype(Theirs::member)>,             \
                #member " has another type in cuda.h");
#define DEVBRIDGE_CHECK_STRUCT(name, members)                                                          \
  static_assert(sizeof(ours::name) == sizeof(::name) && alignof(ours::name) == alignof(::name),       \
                #name " has another size or alignment in cuda.h");                                    \
  struct name##_layout {                                                                              \
    using Ours = ours::name;                                                                          \
    using Theirs = ::name;                                                                            \
    members(DEVBRIDGE_CHECK_MEMBER)                                                                   \
  };
DEVBRIDGE_CUDA_STRUCTS(DEVBRIDGE_CHECK_STRUCT)
#undef DEVBRIDGE_CHECK_STRUCT
#undef DEVBRIDGE_CHECK_MEMBER

// The shape is what a mismatch would corrupt at run time; the exact types
// also catch two same-sized parameters swapped (a context for a stream).
#define DEVBRIDGE_CHECK_ENTRY_POINT(symbol)                                                              \
  static_assert(SameShape<ours::PFN_##symbol, decltype(&::symbol)>::value,                             \
                #symbol ": the arity, or a parameter's or the result's size or pointer-ness, differs "  \
                "from cuda.h");                                                                         \
  static_assert(std::is_same_v<in_cuda_h<ours::PFN_##symbol>, decltype(&::symbol)>,                    \
                #symbol ": a parameter's or the result's type differs from cuda.h");
DEVBRIDGE_CUDA_DRIVER_ENTRY_POINTS(DEVBRIDGE_CHECK_ENTRY_POINT)
#undef DEVBRIDGE_CHECK_ENTRY_POINT

// The tests' own entry point (cuCtxCreate_v2 has no declaration in cuda.h 13).
static_assert(std::is_same_v<in_cuda_h<devbridge::cuda::testing::PFN_cuCtxDestroy_v2>, decltype(&::cuCtxDestroy_v2)>,
              "cuCtxDestroy_v2 differs from cuda.h");

}  // namespace
