#pragma once
// GGUF (v2, v3) reader for the example Llama engine. The whole file is read into memory and
// every read is bounds-checked: a truncated or corrupted file throws kvq::Error(io) naming the
// file and the problem, and no count is trusted for an allocation before it has been checked
// against the bytes that remain. Tensors are converted to float (ggml_blocks.hpp says which types);
// tensor data ranges may not overlap, so the floats made are bounded by the bytes the file holds.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "kvq/error.hpp"
#include "llama/ggml_blocks.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvq::llama {

/// Sizes `buffer` to `n` elements, asking the kernel to back it with 2 MiB pages where it can: a
/// model's gigabytes of weights are first touched here, and on virtual machines each 4 KiB page
/// fault costs microseconds (a 1B-parameter model took 25 s to convert, nearly all of it faults).
template <class T>
void resize_with_huge_pages(std::vector<T>& buffer, std::size_t n) {
  buffer.reserve(n);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t huge = std::uintptr_t{2} << 20;
  const auto begin = (reinterpret_cast<std::uintptr_t>(buffer.data()) + huge - 1) & ~(huge - 1);
  const auto end = (reinterpret_cast<std::uintptr_t>(buffer.data() + n)) & ~(huge - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);  // advice only
#endif
  buffer.resize(n);
}

enum class GgufType : std::uint32_t {
  uint8 = 0,
  int8 = 1,
  uint16 = 2,
  int16 = 3,
  uint32 = 4,
  int32 = 5,
  float32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  uint64 = 10,
  int64 = 11,
  float64 = 12,
};

struct GgufValue;
using GgufArray = std::vector<GgufValue>;

/// One metadata value. Unsigned integers hold uint64, signed ones int64, floats double.
struct GgufValue {
  GgufType type = GgufType::uint8;
  GgufType element_type = GgufType::uint8;  // meaningful when type == array
  std::variant<std::uint64_t, std::int64_t, double, bool, std::string, GgufArray> data;

  bool is_integer() const noexcept {
    return std::holds_alternative<std::uint64_t>(data) || std::holds_alternative<std::int64_t>(data);
  }
};

struct GgufTensor {
  std::string name;
  std::vector<std::uint64_t> dims;  // fastest-varying first: [ne0, ne1] is ne1 rows of ne0
  std::uint32_t type = ggml_type_f32;
  std::uint64_t offset = 0;  // relative to the start of the data section
  std::vector<float> data;   // converted to float

  std::size_t elements() const noexcept {
    std::size_t n = 1;
    for (const auto d : dims) n *= static_cast<std::size_t>(d);
    return n;
  }
};

namespace detail {

inline std::string gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::uint8:
      return "uint8";
    case GgufType::int8:
      return "int8";
    case GgufType::uint16:
      return "uint16";
    case GgufType::int16:
      return "int16";
    case GgufType::uint32:
      return "uint32";
    case GgufType::int32:
      return "int32";
    case GgufType::float32:
      return "float32";
    case GgufType::boolean:
      return "bool";
    case GgufType::string:
      return "string";
    case GgufType::array:
      return "array";
    case GgufType::uint64:
      return "uint64";
    case GgufType::int64:
      return "int64";
    case GgufType::float64:
      return "float64";
  }
  return "type " + std::to_string(static_cast<std::uint32_t>(t));
}

/// Bounds-checked little-endian cursor over the file's bytes.
class GgufReader {
 public:
  GgufReader(std::span<const std::uint8_t> bytes, std::string source) : bytes_(bytes), source_(std::move(source)) {}

  std::size_t position() const noexcept { return pos_; }
  std::size_t remaining() const noexcept { return bytes_.size() - pos_; }
  const std::string& source() const noexcept { return source_; }

  /// What is being read, for error messages ("metadata 'key'", "tensor info 'name'").
  void set_context(std::string context) { context_ = std::move(context); }

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(ErrorCode::io, source_ + ": " + what + (context_.empty() ? "" : " in " + context_) + " (at byte " +
                                   std::to_string(pos_) + " of " + std::to_string(bytes_.size()) + ")");
  }

  void need(std::size_t n, const char* what) const {
    if (n > remaining())
      fail(std::string("file ends inside ") + what + " (needs " + std::to_string(n) + " bytes, " +
           std::to_string(remaining()) + " left)");
  }

  template <class T>
  T read(const char* what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, bytes_.data() + pos_, sizeof(T));  // GGUF is little-endian, as is every target
    pos_ += sizeof(T);
    return value;
  }

  std::string read_string(const char* what) {
    const auto length = read<std::uint64_t>(what);
    if (length > remaining())
      fail(std::string(what) + " claims a length of " + std::to_string(length) + " bytes, beyond the end of the file");
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), static_cast<std::size_t>(length));
    pos_ += static_cast<std::size_t>(length);
    return s;
  }

 private:
  std::span<const std::uint8_t> bytes_;
  std::string source_;
  std::string context_;
  std::size_t pos_ = 0;
};

static_assert(std::endian::native == std::endian::little, "the GGUF reader assumes a little-endian host");

// Fewest bytes one value of a type occupies, so that counts can be checked before allocating.
inline std::size_t gguf_min_size(GgufType t) noexcept {
  switch (t) {
    case GgufType::uint8:
    case GgufType::int8:
    case GgufType::boolean:
      return 1;
    case GgufType::uint16:
    case GgufType::int16:
      return 2;
    case GgufType::uint32:
    case GgufType::int32:
    case GgufType::float32:
      return 4;
    case GgufType::uint64:
    case GgufType::int64:
    case GgufType::float64:
    case GgufType::string:
      return 8;
    case GgufType::array:
      return 12;
  }
  return 1;
}

inline bool gguf_valid_type(std::uint32_t t) noexcept { return t <= 12; }

inline GgufValue read_value(GgufReader& in, GgufType type, const std::string& key, int depth) {
  GgufValue v;
  v.type = type;
  switch (type) {
    case GgufType::uint8:
      v.data = std::uint64_t{in.read<std::uint8_t>("a uint8 value")};
      break;
    case GgufType::int8:
      v.data = std::int64_t{in.read<std::int8_t>("an int8 value")};
      break;
    case GgufType::uint16:
      v.data = std::uint64_t{in.read<std::uint16_t>("a uint16 value")};
      break;
    case GgufType::int16:
      v.data = std::int64_t{in.read<std::int16_t>("an int16 value")};
      break;
    case GgufType::uint32:
      v.data = std::uint64_t{in.read<std::uint32_t>("a uint32 value")};
      break;
    case GgufType::int32:
      v.data = std::int64_t{in.read<std::int32_t>("an int32 value")};
      break;
    case GgufType::uint64:
      v.data = in.read<std::uint64_t>("a uint64 value");
      break;
    case GgufType::int64:
      v.data = in.read<std::int64_t>("an int64 value");
      break;
    case GgufType::float32:
      v.data = double{in.read<float>("a float32 value")};
      break;
    case GgufType::float64:
      v.data = in.read<double>("a float64 value");
      break;
    case GgufType::boolean: {
      const auto b = in.read<std::uint8_t>("a bool value");
      if (b > 1) in.fail("metadata '" + key + "' has bool value " + std::to_string(b) + " (must be 0 or 1)");
      v.data = b == 1;
      break;
    }
    case GgufType::string:
      v.data = in.read_string("a string value");
      break;
    case GgufType::array: {
      if (depth >= 4) in.fail("metadata '" + key + "' nests arrays too deeply");
      const auto raw = in.read<std::uint32_t>("an array's element type");
      if (!gguf_valid_type(raw))
        in.fail("metadata '" + key + "' has an array of unknown value type " + std::to_string(raw));
      v.element_type = static_cast<GgufType>(raw);
      const auto count = in.read<std::uint64_t>("an array's length");
      if (count > in.remaining() / gguf_min_size(v.element_type))
        in.fail("metadata '" + key + "' claims " + std::to_string(count) + " array elements of type " +
                gguf_type_name(v.element_type) + ", more than the rest of the file can hold");
      GgufArray items;
      items.reserve(static_cast<std::size_t>(count));
      for (std::uint64_t i = 0; i < count; ++i) items.push_back(read_value(in, v.element_type, key, depth + 1));
      v.data = std::move(items);
      break;
    }
  }
  return v;
}

}  // namespace detail

/// A parsed GGUF file: metadata, tensor descriptions and float tensor data.
class GgufFile {
 public:
  /// Read and parse a file. Throws kvq::Error(io) naming the file when it cannot be read or is malformed.
  static GgufFile load(const std::filesystem::path& path) {
    // Only a regular file has a size worth trusting: a directory's reads as 2^63-1 through a stream.
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    if (std::filesystem::is_directory(status))
      throw Error(ErrorCode::io, path.string() + ": is a directory, not a GGUF file");
    if (std::filesystem::exists(status) && !std::filesystem::is_regular_file(status))
      throw Error(ErrorCode::io, path.string() + ": is not a regular file (GGUF models are read whole from a file)");
    std::ifstream file(path, std::ios::binary);
    if (!file) throw Error(ErrorCode::io, path.string() + ": cannot open GGUF file");
    const std::uintmax_t size = std::filesystem::file_size(path, ec);
    if (ec || size > std::numeric_limits<std::size_t>::max() / 2)
      throw Error(ErrorCode::io, path.string() + ": cannot determine the file size");
    std::vector<std::uint8_t> bytes;
    resize_with_huge_pages(bytes, static_cast<std::size_t>(size));
    if (size > 0 && !file.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(size)))
      throw Error(ErrorCode::io, path.string() + ": read error");
    return parse(bytes, path.string());
  }

  /// Parse a GGUF image in memory; `source` names it in error messages.
  static GgufFile parse(std::span<const std::uint8_t> bytes, std::string source = "<memory>") {
    detail::GgufReader in(bytes, std::move(source));
    GgufFile f;
    f.source_ = in.source();

    in.need(4, "the magic number");
    if (std::memcmp(bytes.data(), "GGUF", 4) != 0) in.fail("not a GGUF file (bad magic number)");
    (void)in.read<std::uint32_t>("the magic number");
    f.version_ = in.read<std::uint32_t>("the version");
    if (f.version_ != 2 && f.version_ != 3)
      in.fail("unsupported GGUF version " + std::to_string(f.version_) + " (this reader handles 2 and 3)");
    const auto tensor_count = in.read<std::uint64_t>("the tensor count");
    const auto metadata_count = in.read<std::uint64_t>("the metadata count");
    // Smallest key/value: 8-byte key length + 4-byte type + 1-byte value. Smallest tensor info:
    // 8-byte name length + 4-byte n_dims + one 8-byte dim + 4-byte type + 8-byte offset.
    if (metadata_count > in.remaining() / 13)
      in.fail("metadata count " + std::to_string(metadata_count) + " is more than the file can hold");
    if (tensor_count > in.remaining() / 32)
      in.fail("tensor count " + std::to_string(tensor_count) + " is more than the file can hold");

    for (std::uint64_t i = 0; i < metadata_count; ++i) {
      in.set_context("metadata entry " + std::to_string(i));
      std::string key = in.read_string("a metadata key");
      in.set_context("metadata '" + key + "'");
      const auto raw = in.read<std::uint32_t>("a metadata value type");
      if (!detail::gguf_valid_type(raw))
        in.fail("metadata '" + key + "' has unknown value type " + std::to_string(raw));
      GgufValue value = detail::read_value(in, static_cast<GgufType>(raw), key, 0);
      if (f.metadata_.contains(key)) in.fail("metadata key '" + key + "' appears twice");
      f.metadata_.emplace(std::move(key), std::move(value));
    }

    in.set_context("");
    std::uint64_t alignment = 32;
    if (const GgufValue* a = f.find("general.alignment")) {
      if (!a->is_integer()) in.fail("general.alignment is not an integer");
      alignment = f.get_uint("general.alignment");
      if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > (1u << 20))
        in.fail("general.alignment " + std::to_string(alignment) + " is not a power of two up to 1 MiB");
    }

    f.tensors_.reserve(static_cast<std::size_t>(tensor_count));
    for (std::uint64_t i = 0; i < tensor_count; ++i) {
      GgufTensor t;
      in.set_context("tensor info " + std::to_string(i));
      t.name = in.read_string("a tensor name");
      in.set_context("tensor info '" + t.name + "'");
      const auto n_dims = in.read<std::uint32_t>("a tensor's dimension count");
      if (n_dims == 0 || n_dims > 4)
        in.fail("tensor '" + t.name + "' has " + std::to_string(n_dims) + " dimensions (1 to 4 allowed)");
      std::uint64_t elements = 1;
      for (std::uint32_t d = 0; d < n_dims; ++d) {
        const auto dim = in.read<std::uint64_t>("a tensor dimension");
        // Element counts stay below 2^60 so byte sizes cannot overflow; the data bounds check follows.
        if (dim == 0 || dim > kMaxElements || elements > kMaxElements / dim)
          in.fail("tensor '" + t.name + "' has impossible dimension " + std::to_string(dim));
        elements *= dim;
        t.dims.push_back(dim);
      }
      t.type = in.read<std::uint32_t>("a tensor type");
      t.offset = in.read<std::uint64_t>("a tensor offset");
      if (t.offset % alignment != 0)
        in.fail("tensor '" + t.name + "' offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
                std::to_string(alignment));
      if (!f.index_.emplace(t.name, f.tensors_.size()).second) in.fail("tensor name '" + t.name + "' appears twice");
      f.tensors_.push_back(std::move(t));
    }

    in.set_context("");
    const std::size_t data_start = static_cast<std::size_t>((in.position() + alignment - 1) / alignment * alignment);
    if (!f.tensors_.empty() && data_start > bytes.size())
      in.fail("file ends before the tensor data section (starts at byte " + std::to_string(data_start) + ")");
    const std::size_t data_size = bytes.size() - std::min(data_start, bytes.size());

    // Sizes and bounds of every tensor first, then overlaps, and only then any conversion.
    struct Extent {
      std::size_t begin, end;
      const GgufTensor* tensor;
    };
    std::vector<Extent> extents;
    extents.reserve(f.tensors_.size());
    for (const GgufTensor& t : f.tensors_) {
      const GgmlBlockFormat* format = ggml_block_format(t.type);
      const std::string_view name = ggml_type_name(t.type);
      const std::string type =
          "ggml type " + std::to_string(t.type) + (name.empty() ? "" : " (" + std::string(name) + ")");
      if (format == nullptr)
        in.fail("tensor '" + t.name + "' has " + type + ", which this reader does not convert (it converts " +
                ggml_converted_types() + ")");
      if (t.dims[0] % format->elements != 0)
        in.fail("tensor '" + t.name + "' rows of " + std::to_string(t.dims[0]) + " values are not whole blocks of " +
                std::to_string(format->elements) + " (" + type + ")");
      // elements < 2^60 and bytes per block / elements per block <= 4, so no overflow.
      const std::size_t size = t.elements() / format->elements * format->bytes;
      if (t.offset > data_size || size > data_size - static_cast<std::size_t>(t.offset))
        in.fail("tensor '" + t.name + "' data (" + std::to_string(size) + " bytes at data offset " +
                std::to_string(t.offset) + ") lies beyond the end of the file (data section has " +
                std::to_string(data_size) + " bytes)");
      extents.push_back({static_cast<std::size_t>(t.offset), static_cast<std::size_t>(t.offset) + size, &t});
    }
    // Aliased tensors would be converted once per name: two thousand infos over the same bytes
    // would turn a 1 MB file into gigabytes of floats. ggml never writes overlapping tensors.
    std::stable_sort(extents.begin(), extents.end(),
                     [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
    for (std::size_t i = 1; i < extents.size(); ++i)
      if (extents[i].begin < extents[i - 1].end)
        in.fail("tensor '" + extents[i].tensor->name + "' data (data bytes " + std::to_string(extents[i].begin) + ".." +
                std::to_string(extents[i].end) + ") overlaps tensor '" + extents[i - 1].tensor->name +
                "' (data bytes " + std::to_string(extents[i - 1].begin) + ".." + std::to_string(extents[i - 1].end) +
                ")");

    for (GgufTensor& t : f.tensors_) {
      const GgmlBlockFormat& format = *ggml_block_format(t.type);
      resize_with_huge_pages(t.data, t.elements());
      format.dequantize(bytes.data() + data_start + static_cast<std::size_t>(t.offset), t.elements() / format.elements,
                        t.data.data());
    }
    return f;
  }

  const std::string& source() const noexcept { return source_; }
  std::uint32_t version() const noexcept { return version_; }
  const std::map<std::string, GgufValue, std::less<>>& metadata() const noexcept { return metadata_; }
  const std::vector<GgufTensor>& tensors() const noexcept { return tensors_; }

  const GgufValue* find(std::string_view key) const {
    const auto it = metadata_.find(key);
    return it == metadata_.end() ? nullptr : &it->second;
  }

  const GgufValue& at(std::string_view key) const {
    if (const GgufValue* v = find(key)) return *v;
    fail("metadata key '" + std::string(key) + "' is missing");
  }

  /// Integer metadata as uint64 (negative values are an error).
  std::uint64_t get_uint(std::string_view key) const {
    const GgufValue& v = at(key);
    if (const auto* u = std::get_if<std::uint64_t>(&v.data)) return *u;
    if (const auto* i = std::get_if<std::int64_t>(&v.data); i && *i >= 0) return static_cast<std::uint64_t>(*i);
    fail("metadata '" + std::string(key) + "' is " + detail::gguf_type_name(v.type) +
         ", expected a non-negative integer");
  }

  double get_float(std::string_view key) const {
    const GgufValue& v = at(key);
    if (const auto* d = std::get_if<double>(&v.data)) return *d;
    if (const auto* u = std::get_if<std::uint64_t>(&v.data)) return static_cast<double>(*u);
    if (const auto* i = std::get_if<std::int64_t>(&v.data)) return static_cast<double>(*i);
    fail("metadata '" + std::string(key) + "' is " + detail::gguf_type_name(v.type) + ", expected a number");
  }

  const std::string& get_string(std::string_view key) const {
    const GgufValue& v = at(key);
    if (const auto* s = std::get_if<std::string>(&v.data)) return *s;
    fail("metadata '" + std::string(key) + "' is " + detail::gguf_type_name(v.type) + ", expected a string");
  }

  const GgufArray& get_array(std::string_view key, GgufType element_type) const {
    const GgufValue& v = at(key);
    const auto* a = std::get_if<GgufArray>(&v.data);
    if (a == nullptr || v.element_type != element_type)
      fail("metadata '" + std::string(key) + "' is not an array of " + detail::gguf_type_name(element_type));
    return *a;
  }

  const GgufTensor* find_tensor(std::string_view name) const {
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
  }

  const GgufTensor& tensor(std::string_view name) const {
    if (const GgufTensor* t = find_tensor(name)) return *t;
    fail("tensor '" + std::string(name) + "' is missing");
  }

  /// Moves tensor `name`'s converted data out (a model that takes its weights holds them once);
  /// the tensor stays listed, with no data.
  std::vector<float> take_data(std::string_view name) {
    const auto it = index_.find(name);
    if (it == index_.end()) fail("tensor '" + std::string(name) + "' is missing");
    return std::exchange(tensors_[it->second].data, {});
  }

  [[noreturn]] void fail(const std::string& what) const { throw Error(ErrorCode::io, source_ + ": " + what); }

 private:
  static constexpr std::uint64_t kMaxElements = std::uint64_t{1} << 60;

  std::string source_;
  std::uint32_t version_ = 0;
  std::map<std::string, GgufValue, std::less<>> metadata_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;  // name -> position in tensors_
};

}  // namespace kvq::llama
