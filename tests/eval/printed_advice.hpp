#pragma once
// kvq-eval --advise prints the per-layer configuration it advises as its last line, indented;
// the tests load that line as the library would.

#include <cstddef>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"

namespace kvq::test {

inline std::vector<CacheConfig> printed_advice(std::string out, std::size_t layers) {
  out.erase(out.find_last_not_of('\n') + 1);
  return parse_layer_configs(out.substr(out.find_first_not_of(' ', out.rfind('\n') + 1)), layers);
}

}  // namespace kvq::test
