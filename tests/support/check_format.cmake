# Every C++ source follows the root .clang-format as clang-format 14 (Debian 12's) writes it;
# other versions break lines differently, so the test asks for that one.
if(NOT CLANG_FORMAT)
  message(FATAL_ERROR "clang-format-14 was not found: cmake/install-deps.sh installs it")
endif()
file(GLOB_RECURSE sources RELATIVE "${ROOT}" "${ROOT}/include/*.hpp" "${ROOT}/include/*.inc" "${ROOT}/examples/*.hpp" "${ROOT}/examples/*.cpp"
     "${ROOT}/tests/*.hpp" "${ROOT}/tests/*.cpp" "${ROOT}/bench/*.hpp" "${ROOT}/bench/*.cpp")
execute_process(COMMAND "${CLANG_FORMAT}" --dry-run -Werror ${sources} WORKING_DIRECTORY "${ROOT}"
                RESULT_VARIABLE status ERROR_VARIABLE complaints)
if(NOT status EQUAL 0)
  string(REGEX MATCHALL "[^\n]*error: code should be clang-formatted[^\n]*" lines "${complaints}")
  list(REMOVE_DUPLICATES lines)
  string(REPLACE ";" "\n" lines "${lines}")
  message(FATAL_ERROR "sources differ from .clang-format (run clang-format-14 -i on them):\n${lines}")
endif()
list(LENGTH sources count)
message(STATUS "${count} sources follow .clang-format")
