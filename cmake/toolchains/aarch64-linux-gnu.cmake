# 64-bit ARM Linux with Debian's cross compiler; executables (tests, test discovery) run under
# qemu-user. `cmake/install-deps.sh --aarch64` installs both. Used by the `aarch64` preset: the
# library's tests on a second architecture, where attention runs on the NEON kernel
# (kernels/ops/neon.hpp) and the reference, with unsigned char and without x86's lenient unaligned
# access in the compiler's assumptions.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)  # GoogleTest's project enables C
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)
# Libraries come from the target's sysroot only; header-only packages (Eigen) and GoogleTest's
# sources come from the build machine (cmake/KvqDependencies.cmake).
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
