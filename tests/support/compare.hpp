#pragma once
// Error measures shared by the tests.

#include <cmath>
#include <cstddef>
#include <vector>

namespace kvq::test {

/// ||a - ref|| / ||ref|| in double.
inline double relative_error(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

}  // namespace kvq::test
