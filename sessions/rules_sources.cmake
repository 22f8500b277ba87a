# The pure library, cellblock_rules: session limits and the policy, image
# definitions and their named checks, build specs, the egress allowlist's
# patterns and reserved addresses, all as values (no sandbox, no ZMQ, no
# SQLite, no clock, no DNS of their own). sessions/CMakeLists.txt builds it
# as a target; tests/fuzz compiles the same list with the fuzzer's flags.
set(CELLBLOCK_RULES_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/session_policy.cpp
  ${CMAKE_CURRENT_LIST_DIR}/image.cpp
  ${CMAKE_CURRENT_LIST_DIR}/build_spec.cpp
  ${CMAKE_CURRENT_LIST_DIR}/egress_rules.cpp)
