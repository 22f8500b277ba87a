// HMAC-SHA256 signing of Jupyter wire messages (no ZMQ here).
#pragma once

#include <memory>
#include <string>
#include <string_view>

namespace cellblock {

// Signs and verifies the four JSON frames of a Jupyter message with
// HMAC-SHA256, as lowercase hex. An empty key disables signing, as the
// messaging spec says: sign() returns "" and verify() accepts only "".
class Signer {
  public:
    // Only "hmac-sha256" is supported; anything else throws std::invalid_argument.
    explicit Signer(std::string key, std::string_view scheme = "hmac-sha256");
    ~Signer();
    Signer(Signer&&) noexcept;
    Signer& operator=(Signer&&) noexcept;
    Signer(const Signer&) = delete;
    Signer& operator=(const Signer&) = delete;

    bool enabled() const { return !key_.empty(); }

    // Lowercase hex HMAC over header|parent|metadata|content, "" when disabled.
    std::string sign(std::string_view header, std::string_view parent, std::string_view metadata,
                     std::string_view content) const;

    // The length is checked first (exactly 64 hex characters when enabled),
    // then the digest is compared in constant time.
    bool verify(std::string_view signature, std::string_view header, std::string_view parent,
                std::string_view metadata, std::string_view content) const;

  private:
    struct Impl;
    std::string key_;
    std::unique_ptr<Impl> impl_;
};

// A fresh random key (64 lowercase hex characters from a CSPRNG).
std::string make_random_key();

// Whether two secrets are equal, in a time that does not depend on where
// they differ (only on their length).
bool equal_secrets(std::string_view a, std::string_view b);

// `bytes` as lowercase hex, two digits per byte (what signatures and keys use).
std::string to_lower_hex(std::string_view bytes);

}  // namespace cellblock
