// kvq-eval: measures every cache configuration on a real model; see `kvq-eval --help`.
#include <iostream>
#include <string>
#include <vector>

#include "eval/cli.hpp"

int main(int argc, char** argv) {
  return kvq::eval::run_eval(std::vector<std::string>(argv + 1, argv + argc), std::cout, std::cerr);
}
