# Dependencies come from the distribution (cmake/install-deps.sh installs them on Debian).
include(GNUInstallDirs)
find_package(Threads REQUIRED)

# Eigen's config file rejects version requests across majors; check the version ourselves.
find_package(Eigen3 REQUIRED NO_MODULE)
if(Eigen3_VERSION VERSION_LESS 3.4)
  message(FATAL_ERROR "kvq needs Eigen 3.4 or newer, found ${Eigen3_VERSION}")
endif()

if(CMAKE_CROSSCOMPILING)
  # The build machine's fmt and GoogleTest libraries are for its own architecture: fmt is used
  # header-only (its headers alone, not the rest of /usr/include), GoogleTest built from the
  # sources libgtest-dev ships.
  if(KVQ_BUILD_TESTS OR KVQ_BUILD_EXAMPLES OR KVQ_BUILD_BENCHMARKS)
    find_path(KVQ_FMT_INCLUDE fmt/format.h PATHS /usr/include NO_CMAKE_FIND_ROOT_PATH REQUIRED)
    file(MAKE_DIRECTORY "${CMAKE_BINARY_DIR}/cross-include")
    file(CREATE_LINK "${KVQ_FMT_INCLUDE}/fmt" "${CMAKE_BINARY_DIR}/cross-include/fmt" SYMBOLIC)
    add_library(kvq_fmt_header_only INTERFACE)
    target_include_directories(kvq_fmt_header_only SYSTEM INTERFACE "${CMAKE_BINARY_DIR}/cross-include")
    target_compile_definitions(kvq_fmt_header_only INTERFACE FMT_HEADER_ONLY=1)
    add_library(fmt::fmt ALIAS kvq_fmt_header_only)
  endif()
  if(KVQ_BUILD_TESTS)
    set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
    set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
    add_subdirectory(/usr/src/googletest "${CMAKE_BINARY_DIR}/googletest" EXCLUDE_FROM_ALL)
    if(NOT TARGET GTest::gtest_main)  # GoogleTest 1.11 and later define it
      add_library(GTest::gtest_main ALIAS gtest_main)
    endif()
  endif()
else()
  if(KVQ_BUILD_TESTS OR KVQ_BUILD_EXAMPLES OR KVQ_BUILD_BENCHMARKS)
    find_package(fmt REQUIRED)
  endif()
  if(KVQ_BUILD_TESTS)
    find_package(GTest REQUIRED)
  endif()
endif()
if(KVQ_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()
