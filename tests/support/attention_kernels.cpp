// The one translation unit of the test programs that compiles the attention kernels; the others
// declare the kernel table only (KVQ_EXTERN_KERNELS, set for every test target).
#include "kvq/kernels/attention/registry.hpp"
