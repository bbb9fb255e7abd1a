# Warnings and sanitizers for the project's own targets (never forced on consumers).
option(KVQ_SANITIZE "Build tests and examples with AddressSanitizer and UndefinedBehaviorSanitizer" OFF)

function(kvq_target_defaults target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion)
  if(KVQ_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
endfunction()
