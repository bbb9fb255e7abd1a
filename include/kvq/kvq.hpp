#pragma once
// kvq: header-only KV-cache quantization. Everything public.

#include "kvq/version.hpp"
#include "kvq/config.hpp"
#include "kvq/error.hpp"
#include "kvq/isa.hpp"
#include "kvq/core/half.hpp"
#include "kvq/core/aligned_buffer.hpp"
#include "kvq/pack/bitpack.hpp"
#include "kvq/quant/spec.hpp"
#include "kvq/quant/policies.hpp"
#include "kvq/quant/kv_policy.hpp"
#include "kvq/rope/rope.hpp"
#include "kvq/cache/cache_config.hpp"
#include "kvq/cache/kv_cache.hpp"
#include "kvq/cache/memory.hpp"
#include "kvq/attention/reference.hpp"
#include "kvq/metrics/attention_error.hpp"
