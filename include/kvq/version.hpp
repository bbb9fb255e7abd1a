#pragma once

#define KVQ_VERSION_MAJOR 0
#define KVQ_VERSION_MINOR 1
#define KVQ_VERSION_PATCH 0

namespace kvq::inline v0 {
inline constexpr int version_major = KVQ_VERSION_MAJOR;
inline constexpr int version_minor = KVQ_VERSION_MINOR;
inline constexpr int version_patch = KVQ_VERSION_PATCH;
}  // namespace kvq::inline v0
