#include "cellblock/replay_guard.hpp"

#include <algorithm>
#include <cstring>
#include <optional>

namespace cellblock {

namespace {

using Digest = std::array<unsigned char, 32>;

int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

std::optional<Digest> decode_digest(std::string_view hex) {
    Digest d{};
    if (hex.size() != 2 * d.size()) return std::nullopt;
    for (std::size_t i = 0; i < d.size(); ++i) {
        const int hi = hex_value(hex[2 * i]);
        const int lo = hex_value(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) return std::nullopt;
        d[i] = static_cast<unsigned char>((hi << 4) | lo);
    }
    return d;
}

}  // namespace

// Digests reach the guard only after HMAC verification, so their bytes are
// uniformly distributed and cannot be chosen by a client: any 8 of them make
// a good hash.
std::size_t ReplayGuard::DigestHash::operator()(const Digest& d) const noexcept {
    std::size_t h = 0;
    std::memcpy(&h, d.data(), std::min(sizeof h, d.size()));
    return h;
}

ReplayGuard::ReplayGuard(std::size_t capacity) : capacity_(std::max<std::size_t>(capacity, 1)) {}

bool ReplayGuard::check_and_remember(std::string_view hex_signature) {
    if (hex_signature.empty()) return true;
    const auto digest = decode_digest(hex_signature);
    if (!digest) return false;
    if (!seen_.insert(*digest).second) return false;
    order_.push_back(*digest);
    while (order_.size() > capacity_) {
        seen_.erase(order_.front());
        order_.pop_front();
    }
    return true;
}

bool ReplayGuard::contains(std::string_view hex_signature) const {
    if (hex_signature.empty()) return false;
    const auto digest = decode_digest(hex_signature);
    return digest && seen_.count(*digest) != 0;
}

}  // namespace cellblock
