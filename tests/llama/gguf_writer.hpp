#pragma once
// A writer of GGUF images in memory, for synthetic models and targeted corruption in the tests
// and benchmarks.

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "llama/gguf.hpp"

namespace kvq::llama::testing {

/// Writes a GGUF image in memory, for synthetic files and targeted corruption.
class GgufWriter {
 public:
  template <class T>
  static void put(std::vector<std::uint8_t>& out, T value) {
    std::uint8_t b[sizeof(T)];
    std::memcpy(b, &value, sizeof(T));
    out.insert(out.end(), b, b + sizeof(T));
  }
  static void put_string(std::vector<std::uint8_t>& out, std::string_view s) {
    put<std::uint64_t>(out, s.size());
    out.insert(out.end(), s.begin(), s.end());
  }

  /// A key/value whose value bytes the caller already encoded.
  GgufWriter& raw(std::string_view key, GgufType type, const std::vector<std::uint8_t>& value) {
    put_string(meta_, key);
    put<std::uint32_t>(meta_, static_cast<std::uint32_t>(type));
    meta_.insert(meta_.end(), value.begin(), value.end());
    ++metadata_count_;
    return *this;
  }
  template <class T>
  GgufWriter& scalar(std::string_view key, GgufType type, T value) {
    std::vector<std::uint8_t> v;
    put(v, value);
    return raw(key, type, v);
  }
  GgufWriter& u32(std::string_view key, std::uint32_t v) { return scalar(key, GgufType::uint32, v); }
  GgufWriter& f32(std::string_view key, float v) { return scalar(key, GgufType::float32, v); }
  GgufWriter& str(std::string_view key, std::string_view s) {
    std::vector<std::uint8_t> v;
    put_string(v, s);
    return raw(key, GgufType::string, v);
  }
  GgufWriter& strings(std::string_view key, const std::vector<std::string>& items) {
    std::vector<std::uint8_t> v;
    put<std::uint32_t>(v, static_cast<std::uint32_t>(GgufType::string));
    put<std::uint64_t>(v, items.size());
    for (const auto& s : items) put_string(v, s);
    return raw(key, GgufType::array, v);
  }
  GgufWriter& int32s(std::string_view key, const std::vector<std::int32_t>& items) {
    std::vector<std::uint8_t> v;
    put<std::uint32_t>(v, static_cast<std::uint32_t>(GgufType::int32));
    put<std::uint64_t>(v, items.size());
    for (const std::int32_t i : items) put(v, i);
    return raw(key, GgufType::array, v);
  }
  GgufWriter& floats(std::string_view key, const std::vector<float>& items) {
    std::vector<std::uint8_t> v;
    put<std::uint32_t>(v, static_cast<std::uint32_t>(GgufType::float32));
    put<std::uint64_t>(v, items.size());
    for (const float f : items) put(v, f);
    return raw(key, GgufType::array, v);
  }

  /// A tensor with raw data bytes of ggml type `type`.
  GgufWriter& tensor(std::string_view name, const std::vector<std::uint64_t>& dims, std::uint32_t type,
                     const std::vector<std::uint8_t>& data) {
    while (data_.size() % alignment_ != 0) data_.push_back(0);
    put_string(infos_, name);
    put<std::uint32_t>(infos_, static_cast<std::uint32_t>(dims.size()));
    for (const auto d : dims) put<std::uint64_t>(infos_, d);
    put<std::uint32_t>(infos_, type);
    put<std::uint64_t>(infos_, data_.size());
    data_.insert(data_.end(), data.begin(), data.end());
    ++tensor_count_;
    return *this;
  }
  /// A tensor info pointing at data offset `offset` without adding data (aliases, overlaps).
  GgufWriter& tensor_info(std::string_view name, const std::vector<std::uint64_t>& dims, std::uint32_t type,
                          std::uint64_t offset) {
    put_string(infos_, name);
    put<std::uint32_t>(infos_, static_cast<std::uint32_t>(dims.size()));
    for (const auto d : dims) put<std::uint64_t>(infos_, d);
    put<std::uint32_t>(infos_, type);
    put<std::uint64_t>(infos_, offset);
    ++tensor_count_;
    return *this;
  }
  GgufWriter& tensor_f32(std::string_view name, const std::vector<std::uint64_t>& dims,
                         const std::vector<float>& values) {
    std::vector<std::uint8_t> bytes;
    for (const float f : values) put(bytes, f);
    return tensor(name, dims, 0, bytes);
  }

  /// Data alignment for tensors added from now on; also written as general.alignment.
  GgufWriter& alignment(std::uint32_t a) {
    alignment_ = a;
    return u32("general.alignment", a);
  }

  std::vector<std::uint8_t> bytes(std::uint32_t version = 3) const {
    std::vector<std::uint8_t> out{'G', 'G', 'U', 'F'};
    put<std::uint32_t>(out, version);
    put<std::uint64_t>(out, tensor_count_);
    put<std::uint64_t>(out, metadata_count_);
    out.insert(out.end(), meta_.begin(), meta_.end());
    out.insert(out.end(), infos_.begin(), infos_.end());
    while (out.size() % alignment_ != 0) out.push_back(0);
    out.insert(out.end(), data_.begin(), data_.end());
    return out;
  }

 private:
  std::vector<std::uint8_t> meta_, infos_, data_;
  std::uint64_t metadata_count_ = 0, tensor_count_ = 0;
  std::uint32_t alignment_ = 32;
};

}  // namespace kvq::llama::testing
