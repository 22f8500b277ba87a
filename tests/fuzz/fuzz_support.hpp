// Helpers shared by the fuzz targets: invariant checks that abort (so
// libFuzzer saves the input), and the frame encoding of the wire target.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

// An invariant of the code under test; on failure the input is a finding.
#define FUZZ_CHECK(cond, ...)                                                                    \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            std::fprintf(stderr, "  " __VA_ARGS__);                                              \
            std::fprintf(stderr, "\n");                                                          \
            std::abort();                                                                        \
        }                                                                                        \
    } while (0)

namespace cellblock::fuzz {

// Frames as the wire target reads them: each is a 2-byte little-endian length
// followed by that many bytes; a length past the end takes what is left.
// make_seed_corpus.py writes the same encoding.
inline std::vector<std::string> split_frames(const std::uint8_t* data, std::size_t size) {
    std::vector<std::string> frames;
    std::size_t at = 0;
    while (at < size) {
        std::size_t len = data[at];
        if (at + 1 < size) len |= static_cast<std::size_t>(data[at + 1]) << 8;
        at += 2;
        if (at > size) at = size;
        const std::size_t take = len < size - at ? len : size - at;
        frames.emplace_back(reinterpret_cast<const char*>(data + at), take);
        at += take;
    }
    return frames;
}

// Nesting depth counted as the wire parser's cap counts it: a scalar is 0,
// [] and {} are 1. Iterative, so a deep value cannot exhaust the stack here.
inline std::size_t json_depth(const nlohmann::json& root) {
    std::size_t deepest = 0;
    std::vector<std::pair<const nlohmann::json*, std::size_t>> stack{{&root, 0}};
    while (!stack.empty()) {
        const auto [node, depth] = stack.back();
        stack.pop_back();
        if (!node->is_structured()) continue;
        const std::size_t inside = depth + 1;
        if (inside > deepest) deepest = inside;
        for (const auto& child : *node) stack.emplace_back(&child, inside);
    }
    return deepest;
}

}  // namespace cellblock::fuzz
