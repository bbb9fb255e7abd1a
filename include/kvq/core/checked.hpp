#pragma once
// Size arithmetic that cannot wrap. Shapes, capacities and groups come from users and files; a
// product that wraps would allocate too little and let later writes run past the end, so every
// size the library derives from them goes through these and fails with the field's name.

#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "kvq/error.hpp"

namespace kvq::inline v0 {

/// a * b, or kvq::Error naming `what` when the product does not fit a size_t.
inline std::size_t checked_mul(std::size_t a, std::size_t b, std::string_view what) {
  std::size_t out = 0;
  if (__builtin_mul_overflow(a, b, &out))
    throw Error(ErrorCode::invalid_argument,
                std::string(what) + ": " + std::to_string(a) + " x " + std::to_string(b) + " overflows the size type");
  return out;
}

/// a + b, or SIZE_MAX when the sum does not fit: for "never" thresholds such as a window of SIZE_MAX.
constexpr std::size_t saturating_add(std::size_t a, std::size_t b) noexcept {
  return a > std::size_t(-1) - b ? std::size_t(-1) : a + b;
}

/// a * b, or SIZE_MAX when the product does not fit: for bounds compared against a limit.
constexpr std::size_t saturating_mul(std::size_t a, std::size_t b) noexcept {
  std::size_t out = 0;
  return __builtin_mul_overflow(a, b, &out) ? std::size_t(-1) : out;
}

/// Throws kvq::Error naming `what` unless value <= limit.
inline void check_limit(std::size_t value, std::size_t limit, std::string_view what) {
  if (value > limit)
    throw Error(ErrorCode::invalid_argument,
                std::string(what) + " of " + std::to_string(value) + " exceeds the limit of " + std::to_string(limit));
}

/// v.resize(n), or kvq::Error (out_of_memory) naming `what` when the memory is refused: workspaces
/// sized by a call's arguments fail as the library's own allocations do, not with std::bad_alloc.
template <class Vector>
void checked_resize(Vector& v, std::size_t n, std::string_view what) {
  try {
    v.resize(n);
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::out_of_memory, std::string(what) + ": " + std::to_string(n) + " elements of " +
                                              std::to_string(sizeof(typename Vector::value_type)) +
                                              " bytes could not be allocated");
  } catch (const std::length_error&) {
    throw Error(ErrorCode::out_of_memory,
                std::string(what) + ": " + std::to_string(n) + " elements exceed what a vector holds");
  }
}

/// f(), with std::bad_alloc or std::length_error from it turned into kvq::Error (out_of_memory)
/// naming `what`: for calls whose bookkeeping (per-request lists, hash maps) allocates on the way.
template <class F>
decltype(auto) with_memory_errors(std::string_view what, F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::out_of_memory, std::string(what) + ": memory for its bookkeeping was refused");
  } catch (const std::length_error&) {
    throw Error(ErrorCode::out_of_memory, std::string(what) + ": its bookkeeping exceeds what a container holds");
  }
}

}  // namespace kvq::inline v0
