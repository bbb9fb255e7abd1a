#pragma once
// Where the shared model and text live: $KVQ_DATA_DIR, else the folder the build was configured
// with (the KVQ_DATA_DIR macro), else ../shared/data next to the project.

#include <cstdlib>
#include <filesystem>
#include <string>

namespace kvq::llama {

inline std::filesystem::path data_dir() {
  if (const char* env = std::getenv("KVQ_DATA_DIR"); env != nullptr && *env != '\0') return env;
#ifdef KVQ_DATA_DIR
  return KVQ_DATA_DIR;
#else
  return "../shared/data";
#endif
}

inline std::filesystem::path default_model_path() { return data_dir() / "stories260K" / "stories260K.gguf"; }

/// How to obtain the data, for messages where it is missing.
inline std::string data_help() {
  return "model data not found under " + data_dir().string() +
         ": that folder must hold stories260K/stories260K.gguf (ggml-org's GGUF of Karpathy's stories260K, "
         "e.g. testdata/stories260K.gguf in github.com/mutablelogic/go-llama), "
         "stories260K/golden_greedy_256.json and text/tinystories_valid_excerpt.txt; "
         "point the KVQ_DATA_DIR environment variable or CMake cache variable at it";
}

}  // namespace kvq::llama
