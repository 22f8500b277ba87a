// Remembers the signatures of verified messages so a captured message cannot
// be replayed. Only verified signatures are recorded, so junk cannot flush it.
#pragma once

#include <array>
#include <cstddef>
#include <deque>
#include <string_view>
#include <unordered_set>

namespace cellblock {

class ReplayGuard {
  public:
    // A capacity of 0 is treated as 1: a guard that remembers nothing would
    // silently accept every replay.
    explicit ReplayGuard(std::size_t capacity = 1u << 16);

    // Returns false if this signature was seen before (a replay); otherwise
    // remembers it (evicting the oldest past capacity) and returns true.
    // Call only after the signature has been verified. An empty signature
    // (signing disabled) is always accepted and never remembered.
    // Malformed input (not 64 hex characters) returns false and is not
    // remembered. Hex case is ignored: the digest is stored in binary.
    bool check_and_remember(std::string_view hex_signature);

    // True if this signature is remembered; does not record anything. Lets a
    // caller reject a replay before doing more work, and remember the
    // signature only once the whole message has been accepted.
    bool contains(std::string_view hex_signature) const;

    std::size_t size() const { return order_.size(); }
    std::size_t capacity() const { return capacity_; }

  private:
    struct DigestHash {
        std::size_t operator()(const std::array<unsigned char, 32>& d) const noexcept;
    };
    std::size_t capacity_;
    std::unordered_set<std::array<unsigned char, 32>, DigestHash> seen_;
    std::deque<std::array<unsigned char, 32>> order_;
};

}  // namespace cellblock
