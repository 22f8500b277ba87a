// SHA-256 through OpenSSL, as lowercase hex: a running digest for what
// arrives in pieces (Sha256), one call for what is whole (sha256_hex).
#pragma once

#include <openssl/evp.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cellblock {

class Sha256 {
  public:
    Sha256() : ctx_(EVP_MD_CTX_new()) {
        if (!ctx_ || EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1)
            throw std::runtime_error("sha256: cannot initialise a digest");
    }
    Sha256(const Sha256& other) : ctx_(EVP_MD_CTX_new()) {
        if (!ctx_ || EVP_MD_CTX_copy_ex(ctx_.get(), other.ctx_.get()) != 1)
            throw std::runtime_error("sha256: cannot copy a digest");
    }
    Sha256& operator=(Sha256&& other) noexcept = default;
    Sha256(Sha256&&) noexcept = default;
    void update(std::string_view bytes) {
        if (EVP_DigestUpdate(ctx_.get(), bytes.data(), bytes.size()) != 1)
            throw std::runtime_error("sha256: digest failed");
    }
    // The digest of everything given so far; the object is spent after it.
    std::string hex() {
        unsigned char md[EVP_MAX_MD_SIZE];
        unsigned int len = 0;
        if (EVP_DigestFinal_ex(ctx_.get(), md, &len) != 1)
            throw std::runtime_error("sha256: digest failed");
        static constexpr std::string_view kDigits = "0123456789abcdef";
        std::string out;
        out.reserve(2 * std::size_t{len});
        for (unsigned int i = 0; i < len; ++i) {
            out += kDigits[md[i] >> 4];
            out += kDigits[md[i] & 15];
        }
        return out;
    }

  private:
    struct Free {
        void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
    };
    std::unique_ptr<EVP_MD_CTX, Free> ctx_;
};

inline std::string sha256_hex(std::string_view data) {
    Sha256 hash;
    hash.update(data);
    return hash.hex();
}

}  // namespace cellblock
