// libFuzzer target: GGUF files through the reader and the model loader. Every input must end in
// a model or a kvq::Error; nothing may crash, leak, hit undefined behaviour or allocate more than
// the fuzzer's limit (-rss_limit_mb) for bytes the file does not hold.
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvq/error.hpp"
#include "llama/gguf.hpp"
#include "llama/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const kvq::llama::GgufFile file = kvq::llama::GgufFile::parse(std::span(data, size), "fuzz.gguf");
    (void)kvq::llama::Model(file);
  } catch (const kvq::Error&) {
  }
  return 0;
}
