// GGUF reader: real file, every metadata type, F16/BF16 conversion, and malformed input that
// must always end in kvq::Error (these tests also run under AddressSanitizer).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "llama/gguf.hpp"
#include "llama/llama_test_support.hpp"

namespace kvq::llama {
namespace {

using testing::GgufWriter;
using testing::read_bytes;

template <class T>
std::vector<std::uint8_t> encoded(T value) {
  std::vector<std::uint8_t> v;
  GgufWriter::put(v, value);
  return v;
}

// Parse must throw kvq::Error(io) whose message contains every one of `parts`.
void expect_io_error(std::span<const std::uint8_t> bytes, std::initializer_list<std::string_view> parts) {
  try {
    (void)GgufFile::parse(bytes, "test.gguf");
    ADD_FAILURE() << "parse succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io) << e.what();
    const std::string message = e.what();
    EXPECT_NE(message.find("test.gguf"), std::string::npos) << message;
    for (const auto part : parts)
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
}

TEST(Gguf, ReadsRealModel) {
  KVQ_REQUIRE_LLAMA_DATA();
  const auto f = GgufFile::load(default_model_path());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_uint("llama.embedding_length"), 64u);
  EXPECT_NEAR(f.get_float("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-9);
  EXPECT_EQ(f.get_array("tokenizer.ggml.tokens", GgufType::string).size(), 512u);
  EXPECT_EQ(f.tensors().size(), 48u);
  const GgufTensor& q = f.tensor("blk.0.attn_k.weight");
  EXPECT_EQ(q.dims, (std::vector<std::uint64_t>{64, 32}));
  EXPECT_EQ(q.data.size(), 64u * 32u);
  EXPECT_TRUE(std::all_of(q.data.begin(), q.data.end(), [](float x) { return std::isfinite(x); }));
  EXPECT_EQ(f.find_tensor("nope"), nullptr);
  EXPECT_THROW((void)f.tensor("nope"), Error);
  EXPECT_THROW((void)f.get_string("llama.embedding_length"), Error);
}

TEST(Gguf, MissingFileNamesThePath) {
  try {
    (void)GgufFile::load("/nonexistent/model.gguf");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/model.gguf"), std::string::npos);
  }
}

TEST(Gguf, EveryMetadataType) {
  std::vector<std::uint8_t> nested;  // array of two arrays of uint8
  GgufWriter::put<std::uint32_t>(nested, static_cast<std::uint32_t>(GgufType::array));
  GgufWriter::put<std::uint64_t>(nested, 2);
  for (std::uint8_t n = 1; n <= 2; ++n) {
    GgufWriter::put<std::uint32_t>(nested, static_cast<std::uint32_t>(GgufType::uint8));
    GgufWriter::put<std::uint64_t>(nested, n);
    for (std::uint8_t i = 0; i < n; ++i) nested.push_back(static_cast<std::uint8_t>(10 + i));
  }
  GgufWriter w;
  w.scalar("u8", GgufType::uint8, std::uint8_t{200})
      .scalar("i8", GgufType::int8, std::int8_t{-100})
      .scalar("u16", GgufType::uint16, std::uint16_t{60000})
      .scalar("i16", GgufType::int16, std::int16_t{-30000})
      .scalar("u32", GgufType::uint32, std::uint32_t{4000000000u})
      .scalar("i32", GgufType::int32, std::int32_t{-2000000000})
      .scalar("f32", GgufType::float32, 1.5f)
      .scalar("bool", GgufType::boolean, std::uint8_t{1})
      .str("str", "hello \xE2\x96\x81")
      .scalar("u64", GgufType::uint64, std::uint64_t{1} << 60)
      .scalar("i64", GgufType::int64, -(std::int64_t{1} << 60))
      .scalar("f64", GgufType::float64, -2.25)
      .strings("strings", {"a", "", "ccc"})
      .floats("floats", {0.5f, -1.0f})
      .raw("nested", GgufType::array, nested);
  for (const std::uint32_t version : {2u, 3u}) {
    const auto bytes = w.bytes(version);
    const auto f = GgufFile::parse(bytes);
    EXPECT_EQ(f.version(), version);
    EXPECT_EQ(f.metadata().size(), 15u);
    EXPECT_EQ(f.get_uint("u8"), 200u);
    EXPECT_EQ(std::get<std::int64_t>(f.at("i8").data), -100);
    EXPECT_EQ(f.get_uint("u16"), 60000u);
    EXPECT_EQ(std::get<std::int64_t>(f.at("i16").data), -30000);
    EXPECT_EQ(f.get_uint("u32"), 4000000000u);
    EXPECT_EQ(f.get_float("i32"), -2000000000.0);
    EXPECT_EQ(f.get_float("f32"), 1.5);
    EXPECT_EQ(std::get<bool>(f.at("bool").data), true);
    EXPECT_EQ(f.get_string("str"), "hello \xE2\x96\x81");
    EXPECT_EQ(f.get_uint("u64"), std::uint64_t{1} << 60);
    EXPECT_EQ(std::get<std::int64_t>(f.at("i64").data), -(std::int64_t{1} << 60));
    EXPECT_EQ(f.get_float("f64"), -2.25);
    const auto& strings = f.get_array("strings", GgufType::string);
    ASSERT_EQ(strings.size(), 3u);
    EXPECT_EQ(std::get<std::string>(strings[2].data), "ccc");
    EXPECT_EQ(std::get<std::string>(strings[1].data), "");
    EXPECT_EQ(std::get<double>(f.get_array("floats", GgufType::float32)[1].data), -1.0);
    const auto& outer = f.get_array("nested", GgufType::array);
    ASSERT_EQ(outer.size(), 2u);
    const auto& inner = std::get<GgufArray>(outer[1].data);
    ASSERT_EQ(inner.size(), 2u);
    EXPECT_EQ(std::get<std::uint64_t>(inner[1].data), 11u);
    EXPECT_THROW((void)f.get_uint("i64"), Error);  // negative
    EXPECT_THROW((void)f.get_array("strings", GgufType::float32), Error);
    EXPECT_TRUE(f.tensors().empty());
  }
}

TEST(Gguf, ConvertsF16AndBf16) {
  // F16: 1, -2, 0.5, 65504, smallest subnormal; BF16: 1, -2.5, 3.140625, 0.
  std::vector<std::uint8_t> f16, b16;
  for (const int bits : {0x3C00, 0xC000, 0x3800, 0x7BFF, 0x0001})
    GgufWriter::put(f16, static_cast<std::uint16_t>(bits));
  for (const int bits : {0x3F80, 0xC020, 0x4049, 0x0000}) GgufWriter::put(b16, static_cast<std::uint16_t>(bits));
  GgufWriter w;
  w.alignment(64)
      .tensor("half", {5}, ggml_type_f16, f16)
      .tensor("brain", {2, 2}, ggml_type_bf16, b16)
      .tensor_f32("single", {3}, {1.0f, -0.0f, 7.25f});
  const auto bytes = w.bytes();
  const auto f = GgufFile::parse(bytes);
  EXPECT_EQ(f.tensor("half").data, (std::vector<float>{1.0f, -2.0f, 0.5f, 65504.0f, std::ldexp(1.0f, -24)}));
  EXPECT_EQ(f.tensor("brain").data, (std::vector<float>{1.0f, -2.5f, 3.140625f, 0.0f}));
  EXPECT_EQ(f.tensor("brain").dims, (std::vector<std::uint64_t>{2, 2}));
  EXPECT_EQ(f.tensor("single").data, (std::vector<float>{1.0f, -0.0f, 7.25f}));
  EXPECT_EQ(f.tensor("single").offset % 64, 0u);
}

TEST(Gguf, UnsupportedTensorTypeNamesTensorAndType) {
  const auto with_type = [](std::uint32_t type, std::size_t bytes) {
    GgufWriter w;
    w.tensor("blk.0.attn_q.weight", {256}, type, std::vector<std::uint8_t>(bytes, 0));
    return w.bytes();
  };
  expect_io_error(with_type(16, 66), {"blk.0.attn_q.weight", "type 16 (IQ2_XXS)", "Q4_K"});  // IQ formats: refused
  expect_io_error(with_type(23, 136), {"blk.0.attn_q.weight", "type 23 (IQ4_XS)"});
  expect_io_error(with_type(15, 292), {"type 15 (Q8_K)"});  // ggml's dot-product intermediate, never a weight
  expect_io_error(with_type(9, 288), {"type 9 (Q8_1)"});
  expect_io_error(with_type(4, 256), {"type 4 (Q4_2)"});   // removed from ggml
  expect_io_error(with_type(1000, 1024), {"type 1000,"});  // unknown number
}

// Issue "no allocation a file did not pay for": tensor infos aliasing the same bytes were each
// converted, so 2,000 aliases of a 16 KB tensor made 32 MB of floats (4.7 GB in the reported file).
TEST(Gguf, RefusesOverlappingTensorData) {
  GgufWriter aliases;
  aliases.tensor_f32("w", {64, 64}, std::vector<float>(64 * 64, 1.0f));
  for (int i = 0; i < 2000; ++i) aliases.tensor_info("alias." + std::to_string(i), {64, 64}, ggml_type_f32, 0);
  expect_io_error(aliases.bytes(), {"overlaps", "'w'", "alias."});

  GgufWriter partial;  // 'b' starts inside 'a' (64 bytes from data offset 0), at the next alignment step
  partial.tensor_f32("a", {16}, std::vector<float>(16, 1.0f)).tensor_f32("c", {16}, std::vector<float>(16, 2.0f));
  partial.tensor_info("b", {8}, ggml_type_f32, 32);
  expect_io_error(partial.bytes(), {"'b'", "overlaps tensor 'a'"});

  GgufWriter touching;  // adjacent ranges share no byte
  touching.tensor_f32("a", {8}, std::vector<float>(8, 1.0f)).tensor_f32("b", {8}, std::vector<float>(8, 2.0f));
  const auto f = GgufFile::parse(touching.bytes());
  EXPECT_EQ(f.tensor("b").offset, 32u);
  EXPECT_EQ(f.tensor("b").data, std::vector<float>(8, 2.0f));
}

TEST(Gguf, RefusesDirectoriesAndNonRegularFilesByName) {
  const auto dir = std::filesystem::temp_directory_path();
  for (const auto& [path, words] :
       {std::pair{dir, "is a directory"}, std::pair{std::filesystem::path("/dev/null"), "not a regular file"}}) {
    try {
      (void)GgufFile::load(path);
      ADD_FAILURE() << path << " loaded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::io);
      EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  }
}

TEST(Gguf, MalformedHeaders) {
  GgufWriter w;
  w.u32("x", 1).tensor_f32("t", {2}, {1.0f, 2.0f});
  const auto good = w.bytes();
  ASSERT_NO_THROW((void)GgufFile::parse(good));

  auto bad = good;
  bad[0] = 'X';
  expect_io_error(bad, {"magic"});
  for (const std::uint32_t version : {0u, 1u, 4u, 0xffffffffu}) {
    bad = good;
    std::memcpy(bad.data() + 4, &version, 4);
    expect_io_error(bad, {"version"});
  }
  bad = good;
  const std::uint64_t huge = std::uint64_t{1} << 62;
  std::memcpy(bad.data() + 8, &huge, 8);
  expect_io_error(bad, {"tensor count"});
  bad = good;
  std::memcpy(bad.data() + 16, &huge, 8);
  expect_io_error(bad, {"metadata count"});
  bad = good;
  std::memcpy(bad.data() + 24, &huge, 8);  // first key's length
  expect_io_error(bad, {"length"});
  bad = good;
  const std::uint32_t bad_type = 13;
  std::memcpy(bad.data() + 24 + 8 + 1, &bad_type, 4);
  expect_io_error(bad, {"unknown value type 13"});

  GgufWriter dup;
  dup.u32("x", 1).u32("x", 2);
  expect_io_error(dup.bytes(), {"'x' appears twice"});
  GgufWriter dup_tensor;
  dup_tensor.tensor_f32("t", {1}, {1.0f}).tensor_f32("t", {1}, {1.0f});
  expect_io_error(dup_tensor.bytes(), {"'t' appears twice"});
  GgufWriter boolean;
  boolean.scalar("b", GgufType::boolean, std::uint8_t{7});
  expect_io_error(boolean.bytes(), {"bool"});
  GgufWriter align;
  align.u32("general.alignment", 24);
  expect_io_error(align.bytes(), {"alignment"});
  GgufWriter deep;
  std::vector<std::uint8_t> value;
  for (int i = 0; i < 100; ++i) {
    GgufWriter::put<std::uint32_t>(value, static_cast<std::uint32_t>(GgufType::array));
    GgufWriter::put<std::uint64_t>(value, 1);
  }
  deep.raw("deep", GgufType::array, value);
  expect_io_error(deep.bytes(), {"deep"});
}

TEST(Gguf, MalformedTensorInfos) {
  const auto make = [](std::vector<std::uint64_t> dims, std::uint64_t n_values = 4) {
    GgufWriter w;
    w.tensor_f32("w", dims, std::vector<float>(n_values, 1.0f));
    return w.bytes();
  };
  ASSERT_NO_THROW((void)GgufFile::parse(make({2, 2})));
  expect_io_error(make({2, 4}), {"'w'", "beyond the end"});
  expect_io_error(make({0}), {"'w'", "dimension"});
  expect_io_error(make({std::uint64_t{1} << 33, std::uint64_t{1} << 33}), {"'w'", "dimension"});  // product overflows
  expect_io_error(make({std::uint64_t{1} << 62}), {"'w'", "dimension"});
  expect_io_error(make({1, 1, 1, 1, 1}), {"'w'", "5 dimensions"});

  auto bytes = make({2, 2});
  // Infos follow the 24-byte header: name length, name "w", n_dims, 2 dims, type, offset.
  const std::size_t offset_at = 24 + 8 + 1 + 4 + 16 + 4;
  std::uint64_t offset = 32;
  std::memcpy(bytes.data() + offset_at, &offset, 8);
  expect_io_error(bytes, {"'w'", "beyond the end"});
  offset = 4;
  std::memcpy(bytes.data() + offset_at, &offset, 8);
  expect_io_error(bytes, {"'w'", "alignment"});
  offset = ~std::uint64_t{0} - 31;
  std::memcpy(bytes.data() + offset_at, &offset, 8);
  expect_io_error(bytes, {"'w'", "beyond the end"});
}

// Every prefix of the real file in a sampled set (header, metadata, tensor infos, padding, data)
// must be rejected, and random corruption must either parse or raise kvq::Error.
TEST(Gguf, TruncatedRealFileAlwaysThrows) {
  KVQ_REQUIRE_LLAMA_DATA();
  const auto bytes = read_bytes(default_model_path());
  ASSERT_NO_THROW((void)GgufFile::parse(bytes));
  std::set<std::size_t> lengths;
  for (std::size_t n = 0; n < 160; ++n) lengths.insert(n);                     // header, first keys
  for (std::size_t n = 160; n < 14400; n += 37) lengths.insert(n);             // metadata, infos, padding
  for (std::size_t n = 14140; n < 14200; ++n) lengths.insert(n);               // end of infos, start of data
  for (std::size_t n = 14400; n < bytes.size(); n += 9973) lengths.insert(n);  // data
  for (std::size_t k = 1; k <= 8; ++k) lengths.insert(bytes.size() - k);
  for (const std::size_t n : lengths) {
    const std::span<const std::uint8_t> prefix(bytes.data(), n);
    EXPECT_THROW((void)GgufFile::parse(prefix, "truncated.gguf"), Error) << "prefix of " << n << " bytes";
  }
}

TEST(Gguf, CorruptedRealFileNeverCrashes) {
  KVQ_REQUIRE_LLAMA_DATA();
  const auto original = read_bytes(default_model_path());
  const std::size_t header_end = 14152;  // metadata and tensor infos end here in this file
  std::mt19937_64 rng(42);
  int parsed = 0, rejected = 0;
  for (int trial = 0; trial < 150; ++trial) {
    auto bytes = original;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) {
      const std::size_t at = rng() % header_end;
      // Half the trials overwrite a byte with an extreme value, to build absurd counts and lengths.
      bytes[at] = trial % 2 ? static_cast<std::uint8_t>(rng()) : std::uint8_t{0xff};
    }
    try {
      (void)GgufFile::parse(bytes, "corrupt.gguf");
      ++parsed;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::io);
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 0);
  EXPECT_EQ(parsed + rejected, 150);
}

TEST(Gguf, AbsurdCountsInRealFile) {
  KVQ_REQUIRE_LLAMA_DATA();
  const auto original = read_bytes(default_model_path());
  const auto patch = [&](std::size_t at, auto value) -> std::vector<std::uint8_t> {
    auto bytes = original;
    std::memcpy(bytes.data() + at, &value, sizeof(value));
    return bytes;
  };
  const std::uint64_t huge = 0xffffffffffffff00ull;
  expect_io_error(patch(8, huge), {"tensor count"});
  expect_io_error(patch(16, huge), {"metadata count"});
  expect_io_error(patch(24, huge), {"length"});  // first key length
  // tokenizer.ggml.tokens: key at 24 (8 + 21 bytes), type at 53, element type at 57, count at 61.
  expect_io_error(patch(61, huge), {"tokenizer.ggml.tokens", "array elements"});
  expect_io_error(patch(61, std::uint64_t{600000}), {"tokenizer.ggml.tokens"});
  expect_io_error(patch(69, huge), {"length"});  // first token string length
  expect_io_error(patch(57, std::uint32_t{77}), {"tokenizer.ggml.tokens", "unknown value type 77"});

  // First tensor info: find its name and patch n_dims, a dim, the type and the offset.
  const std::string name = "token_embd.weight";
  const auto it = std::search(original.begin() + 24, original.end(), name.begin(), name.end());
  ASSERT_NE(it, original.end());
  const std::size_t info = static_cast<std::size_t>(it - original.begin()) + name.size();
  expect_io_error(patch(info, std::uint32_t{100}), {name, "100 dimensions"});
  expect_io_error(patch(info + 4, huge), {name, "dimension"});
  expect_io_error(patch(info + 12, std::uint64_t{1} << 40), {name, "beyond the end"});
  expect_io_error(patch(info + 20, std::uint32_t{12}), {name, "type 12 (Q4_K)", "blocks of 256"});  // rows of 64
  expect_io_error(patch(info + 20, std::uint32_t{17}), {name, "type 17 (IQ2_XS)"});
  expect_io_error(patch(info + 24, std::uint64_t{1} << 40), {name, "beyond the end"});
}

}  // namespace
}  // namespace kvq::llama
