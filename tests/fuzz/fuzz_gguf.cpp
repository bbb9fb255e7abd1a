// libFuzzer target: GGUF files through the reader, the model loader and the embedded tokenizer.
// Every input must end in a model and tokens or a kvq::Error; nothing may crash, leak, hit
// undefined behaviour or allocate more than the fuzzer's limit (-rss_limit_mb) for bytes the file
// does not hold.
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvq/error.hpp"
#include "llama/gguf.hpp"
#include "llama/model.hpp"
#include "llama/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const kvq::llama::GgufFile file = kvq::llama::GgufFile::parse(std::span(data, size), "fuzz.gguf");
    try {
      (void)kvq::llama::Model(file);
    } catch (const kvq::Error&) {
    }
    // The embedded tokenizer, loaded and run on text that reaches every pre-tokenizer branch.
    const kvq::llama::Tokenizer tokenizer(file);
    (void)tokenizer.decode(tokenizer.encode("Hi, it's 2024!\n\n  caf\xC3\xA9 \xE4\xB8\xAD\xFF <s>", false, true));
  } catch (const kvq::Error&) {
  }
  return 0;
}
