# Dependencies come from the distribution (cmake/install-deps.sh installs them on Debian).
include(GNUInstallDirs)
find_package(Threads REQUIRED)

# Eigen's config file rejects version requests across majors; check the version ourselves.
find_package(Eigen3 REQUIRED NO_MODULE)
if(Eigen3_VERSION VERSION_LESS 3.4)
  message(FATAL_ERROR "kvq needs Eigen 3.4 or newer, found ${Eigen3_VERSION}")
endif()

if(KVQ_BUILD_TESTS OR KVQ_BUILD_EXAMPLES OR KVQ_BUILD_BENCHMARKS)
  find_package(fmt REQUIRED)
endif()
if(KVQ_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(KVQ_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()
