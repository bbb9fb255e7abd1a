// The one translation unit that compiles the attention kernels for the programs linking a
// kvq_add_kernel_library (cmake/KvqWarnings.cmake); their other units declare the table only.
#include "kvq/kernels/attention/registry.hpp"
