#pragma once
// Per-thread scratch the library owns (a call's converted rows, attention's workspace when the
// caller passes none): kept between calls so that hot paths do not allocate once warm, but only
// up to kept_scratch_bytes per vector. Beyond that it is released when the call ends, so one long
// prompt does not pin its size for the thread's life, memory no accounting of the cache sees.

#include <cstddef>
#include <tuple>
#include <vector>

namespace kvq::inline v0 {

/// The most a library-owned scratch vector keeps after a call (a 32K-token chunk's f16 rows,
/// converted, take 128 MiB for 8 KV heads x 128).
inline constexpr std::size_t kept_scratch_bytes = std::size_t(16) << 20;

/// Releases v's memory when it holds more than kept_scratch_bytes.
template <class T, class A>
void trim_scratch(std::vector<T, A>& v) noexcept {
  if (v.capacity() * sizeof(T) > kept_scratch_bytes) std::vector<T, A>().swap(v);
}

/// Trims the scratch vectors it names when the scope ends, returning or throwing.
template <class... Vectors>
class ScratchTrim {
 public:
  explicit ScratchTrim(Vectors&... v) noexcept : vectors_(v...) {}
  ScratchTrim(const ScratchTrim&) = delete;
  ScratchTrim& operator=(const ScratchTrim&) = delete;
  ~ScratchTrim() {
    std::apply([](auto&... v) { (trim_scratch(v), ...); }, vectors_);
  }

 private:
  std::tuple<Vectors&...> vectors_;
};

/// This thread's own T (a workspace), held for one call and trimmed (trim_scratch(T&)) when it
/// ends; a fresh T where a call on this thread already holds it, as when an executor runs other
/// work on a thread that waits for its items, so a nested call neither overwrites nor frees it.
/// `wanted` false (the caller brought its own) leaves the thread's T to other calls.
template <class T>
class OwnScratch {
 public:
  explicit OwnScratch(bool wanted = true) noexcept : held_(!wanted || slot().busy ? nullptr : &slot().value) {
    if (held_ != nullptr) slot().busy = true;
  }
  OwnScratch(const OwnScratch&) = delete;
  OwnScratch& operator=(const OwnScratch&) = delete;
  ~OwnScratch() {
    if (held_ == nullptr) return;
    trim_scratch(*held_);
    slot().busy = false;
  }
  T& get() noexcept { return held_ != nullptr ? *held_ : fresh_; }

 private:
  struct Slot {
    T value;
    bool busy = false;
  };
  static Slot& slot() noexcept {
    thread_local Slot s;
    return s;
  }
  T* held_;
  T fresh_;
};

}  // namespace kvq::inline v0
