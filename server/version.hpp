// cellblock's version: CMake's `project(cellblock VERSION ...)`, the one
// definition (server_info, the metrics' build info, the kernel_info a
// refused request answers). tests/python/test_version.py checks that the
// Python client's package says the same.
#pragma once

namespace cellblock {

#ifndef CELLBLOCK_VERSION
#error "CELLBLOCK_VERSION comes from CMakeLists.txt's project() (server/CMakeLists.txt)"
#endif
inline constexpr const char* kVersion = CELLBLOCK_VERSION;

}  // namespace cellblock
