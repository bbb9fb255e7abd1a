# Driver for the packaging tests, run with `cmake -P`. Variables:
#   MODE           find_package | add_subdirectory
#   KVQ_SOURCE_DIR kvq's source tree
#   WORK_DIR       scratch folder (wiped first)
#   CONSUMER_DIR   the consumer project to configure
#   GENERATOR, CXX_COMPILER, BUILD_TYPE  passed through to every configure
cmake_minimum_required(VERSION 3.20)

foreach(_var MODE KVQ_SOURCE_DIR WORK_DIR CONSUMER_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${_var} OR "${${_var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: ${_var} is not set")
  endif()
endforeach()

function(run_step what)
  message(STATUS "packaging: ${what}: ${ARGN}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "packaging: ${what} failed (${_rc})")
  endif()
endfunction()

set(_common -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}")
set(_config)
if(BUILD_TYPE)
  set(_config --config "${BUILD_TYPE}")
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

if(MODE STREQUAL "find_package")
  # A fresh kvq build as a user would install it: only the library and its install rules.
  set(_prefix "${WORK_DIR}/prefix")
  run_step("configure kvq" "${CMAKE_COMMAND}" -S "${KVQ_SOURCE_DIR}" -B "${WORK_DIR}/kvq-build" ${_common}
           -DKVQ_BUILD_TESTS=OFF -DKVQ_BUILD_EXAMPLES=OFF -DKVQ_BUILD_BENCHMARKS=OFF -DKVQ_INSTALL=ON)
  run_step("install kvq" "${CMAKE_COMMAND}" --install "${WORK_DIR}/kvq-build" --prefix "${_prefix}" ${_config})
  foreach(_file include/kvq/kvq.hpp include/kvq/kernels/quantize/reference.hpp)
    if(NOT EXISTS "${_prefix}/${_file}")
      message(FATAL_ERROR "packaging: ${_file} was not installed")
    endif()
  endforeach()
  file(GLOB_RECURSE _configs "${_prefix}/*/kvqConfig.cmake" "${_prefix}/*/kvqConfigVersion.cmake")
  list(LENGTH _configs _n)
  if(NOT _n EQUAL 2)
    message(FATAL_ERROR "packaging: expected kvqConfig.cmake and kvqConfigVersion.cmake, found '${_configs}'")
  endif()
  run_step("configure consumer" "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${WORK_DIR}/consumer-build" ${_common}
           "-DCMAKE_PREFIX_PATH=${_prefix}" -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON)
elseif(MODE STREQUAL "add_subdirectory")
  run_step("configure consumer" "${CMAKE_COMMAND}" -S "${CONSUMER_DIR}" -B "${WORK_DIR}/consumer-build" ${_common}
           "-DKVQ_SOURCE_DIR=${KVQ_SOURCE_DIR}")
else()
  message(FATAL_ERROR "run_consumer.cmake: unknown MODE '${MODE}'")
endif()

run_step("build consumer" "${CMAKE_COMMAND}" --build "${WORK_DIR}/consumer-build" ${_config} --target app)
run_step("run consumer" "${CMAKE_COMMAND}" --build "${WORK_DIR}/consumer-build" ${_config} --target run)
