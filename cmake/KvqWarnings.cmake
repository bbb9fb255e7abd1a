# Warnings, sanitizers and the shared kernel library of the project's own targets (never forced
# on consumers).
option(KVQ_SANITIZE "Build tests and examples with AddressSanitizer and UndefinedBehaviorSanitizer" OFF)
option(KVQ_SANITIZE_THREAD "Build tests and examples with ThreadSanitizer" OFF)
if(KVQ_SANITIZE AND KVQ_SANITIZE_THREAD)
  message(FATAL_ERROR "KVQ_SANITIZE and KVQ_SANITIZE_THREAD exclude each other (ThreadSanitizer cannot run with AddressSanitizer)")
endif()

function(kvq_target_defaults target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion)
  if(KVQ_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
  if(KVQ_SANITIZE_THREAD)
    target_compile_options(${target} PRIVATE -fsanitize=thread -fno-omit-frame-pointer)
    target_link_options(${target} PRIVATE -fsanitize=thread)
  endif()
endfunction()

# The one compiled copy of the attention kernels for the project's programs that link it
# (KVQ_EXTERN_KERNELS, kernels/attention/registry.hpp): otherwise each test and benchmark
# program that runs attention compiles every kernel again (85 s each, GCC -O3).
# ARGN: extra compile options. The examples stay header-only, as a user's program is.
function(kvq_add_kernel_library name)
  add_library(${name} STATIC "${PROJECT_SOURCE_DIR}/tests/support/attention_kernels.cpp")
  target_link_libraries(${name} PUBLIC kvq::kvq)
  target_compile_definitions(${name} PUBLIC KVQ_EXTERN_KERNELS PRIVATE KVQ_KERNELS_IMPLEMENTATION)
  target_compile_options(${name} PRIVATE ${ARGN})
  kvq_target_defaults(${name})
endfunction()
