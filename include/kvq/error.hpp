#pragma once
// kvq::Error: the one exception type of the library. Every message names what was wrong and
// where (layer, head, position, group), so an engine can log it and fall back.

#include <stdexcept>
#include <string>

namespace kvq::inline v0 {

enum class ErrorCode {
  invalid_argument,   // a parameter outside its documented range
  shape_mismatch,     // a buffer whose size does not match the declared shape
  non_finite_input,   // NaN or Inf in data to be stored
  unrepresentable,    // a scale or zero point that overflows its storage type
  capacity_exceeded,  // appending past the cache's capacity
  out_of_order,       // a position that does not continue the sequence
  unsupported,        // a configuration the library does not implement
  io,                 // a file that cannot be read or is malformed
  out_of_memory,      // an allocation the system refused (the message says how many bytes)
};

constexpr const char* to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::invalid_argument:
      return "invalid argument";
    case ErrorCode::shape_mismatch:
      return "shape mismatch";
    case ErrorCode::non_finite_input:
      return "non-finite input";
    case ErrorCode::unrepresentable:
      return "unrepresentable parameter";
    case ErrorCode::capacity_exceeded:
      return "capacity exceeded";
    case ErrorCode::out_of_order:
      return "position out of order";
    case ErrorCode::unsupported:
      return "unsupported";
    case ErrorCode::io:
      return "i/o";
    case ErrorCode::out_of_memory:
      return "out of memory";
  }
  return "unknown";
}

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(std::string("kvq: ") + to_string(code) + ": " + message), code_(code), message_(message) {}

  ErrorCode code() const noexcept { return code_; }
  /// The message without the "kvq: <code>: " prefix, to wrap in more context.
  const std::string& message() const noexcept { return message_; }

 private:
  ErrorCode code_;
  std::string message_;
};

}  // namespace kvq::inline v0
