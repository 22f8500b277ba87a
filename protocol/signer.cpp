#include "cellblock/signer.hpp"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <array>
#include <stdexcept>
#include <utility>

namespace cellblock {

namespace {

constexpr std::size_t kDigestBytes = 32;
constexpr std::size_t kHexDigestChars = 2 * kDigestBytes;
using Digest = std::array<unsigned char, kDigestBytes>;

std::string to_lower_hex(const unsigned char* bytes, std::size_t n) {
    return cellblock::to_lower_hex(std::string_view(reinterpret_cast<const char*>(bytes), n));
}

// Lowercase only: the wire format is lowercase hex, and jupyter_client compares
// the hex text, so an uppercase signature is not one it would accept either.
int lower_hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

bool decode_lower_hex_digest(std::string_view hex, Digest& out) {
    if (hex.size() != kHexDigestChars) return false;
    for (std::size_t i = 0; i < kDigestBytes; ++i) {
        const int hi = lower_hex_value(hex[2 * i]);
        const int lo = lower_hex_value(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) return false;
        out[i] = static_cast<unsigned char>((hi << 4) | lo);
    }
    return true;
}

}  // namespace

// Holds a context already keyed with the HMAC key; each message duplicates it,
// so the key schedule (two hashed key blocks) is computed once per Signer.
// The template is only read after construction, so concurrent sign/verify
// calls on one Signer are safe.
struct Signer::Impl {
    EVP_MAC* mac = nullptr;
    EVP_MAC_CTX* keyed = nullptr;  // null when signing is disabled

    Impl() = default;
    Impl(const Impl&) = delete;
    Impl& operator=(const Impl&) = delete;
    ~Impl() {
        EVP_MAC_CTX_free(keyed);
        EVP_MAC_free(mac);
    }

    bool compute(std::string_view header, std::string_view parent, std::string_view metadata,
                 std::string_view content, Digest& out) const {
        EVP_MAC_CTX* ctx = EVP_MAC_CTX_dup(keyed);
        if (ctx == nullptr) return false;
        bool ok = true;
        for (std::string_view part : {header, parent, metadata, content}) {
            if (EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(part.data()),
                               part.size()) != 1) {
                ok = false;
                break;
            }
        }
        std::size_t written = 0;
        ok = ok && EVP_MAC_final(ctx, out.data(), &written, out.size()) == 1 &&
             written == out.size();
        EVP_MAC_CTX_free(ctx);
        return ok;
    }
};

Signer::Signer(std::string key, std::string_view scheme)
    : key_(std::move(key)), impl_(std::make_unique<Impl>()) {
    if (scheme != "hmac-sha256") {
        throw std::invalid_argument("unsupported signature scheme \"" + std::string(scheme) +
                                    "\" (only hmac-sha256)");
    }
    if (key_.empty()) return;

    impl_->mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
    if (impl_->mac == nullptr) throw std::runtime_error("signer: HMAC is not available");
    impl_->keyed = EVP_MAC_CTX_new(impl_->mac);
    if (impl_->keyed == nullptr) throw std::runtime_error("signer: cannot allocate HMAC context");
    char digest_name[] = "SHA256";
    const OSSL_PARAM params[] = {
        OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest_name, 0),
        OSSL_PARAM_construct_end(),
    };
    if (EVP_MAC_init(impl_->keyed, reinterpret_cast<const unsigned char*>(key_.data()), key_.size(),
                     params) != 1) {
        throw std::runtime_error("signer: cannot initialise HMAC-SHA256 with the key");
    }
}

Signer::~Signer() { OPENSSL_cleanse(key_.data(), key_.size()); }

// A moved-from Signer has no Impl: sign() throws and verify() rejects
// everything, so it can never silently become a "signing disabled" signer.
Signer::Signer(Signer&& other) noexcept
    : key_(std::move(other.key_)), impl_(std::move(other.impl_)) {
    other.key_.clear();
}

Signer& Signer::operator=(Signer&& other) noexcept {
    if (this != &other) {
        OPENSSL_cleanse(key_.data(), key_.size());
        key_ = std::move(other.key_);
        impl_ = std::move(other.impl_);
        other.key_.clear();
    }
    return *this;
}

std::string Signer::sign(std::string_view header, std::string_view parent,
                         std::string_view metadata, std::string_view content) const {
    if (!impl_) throw std::logic_error("signer: use of a moved-from Signer");
    if (!enabled()) return {};
    Digest digest{};
    if (!impl_->compute(header, parent, metadata, content, digest)) {
        throw std::runtime_error("signer: HMAC-SHA256 computation failed");
    }
    return to_lower_hex(digest.data(), digest.size());
}

bool Signer::verify(std::string_view signature, std::string_view header, std::string_view parent,
                    std::string_view metadata, std::string_view content) const {
    if (!impl_) return false;
    if (!enabled()) return signature.empty();
    Digest claimed{};
    if (!decode_lower_hex_digest(signature, claimed)) return false;
    Digest expected{};
    if (!impl_->compute(header, parent, metadata, content, expected)) return false;
    return CRYPTO_memcmp(claimed.data(), expected.data(), expected.size()) == 0;
}

std::string to_lower_hex(std::string_view bytes) {
    static constexpr char kHex[] = "0123456789abcdef";
    std::string out(2 * bytes.size(), '\0');
    for (std::size_t i = 0; i < bytes.size(); ++i) {
        const auto byte = static_cast<unsigned char>(bytes[i]);
        out[2 * i] = kHex[byte >> 4];
        out[2 * i + 1] = kHex[byte & 0x0f];
    }
    return out;
}

std::string make_random_key() {
    Digest bytes{};
    if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1) {
        throw std::runtime_error("make_random_key: RAND_bytes failed");
    }
    std::string key = to_lower_hex(bytes.data(), bytes.size());
    OPENSSL_cleanse(bytes.data(), bytes.size());
    return key;
}

bool equal_secrets(std::string_view a, std::string_view b) {
    return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace cellblock
