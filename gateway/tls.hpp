// TLS for the egress gateway's secrets (docs/network.md): a per-session CA
// that the sandbox trusts, leaf certificates it signs for the hosts that have
// secrets, and the verified client side the gateway uses upstream. The CA's
// private key is made by the server, handed to the gateway, and never written
// where the sandbox can read it; the CA is name-constrained to the session's
// secret hosts, so even its key could vouch for nothing else.
#pragma once

#include <openssl/ssl.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace cellblock::gateway {

struct TlsError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct CaPem {
    std::string key;   // PKCS#8 PEM
    std::string cert;  // X.509 PEM
};

// EC P-256, valid from an hour ago for `lifetime`, CN "cellblock session
// <id>", basicConstraints CA:TRUE pathlen:0, nameConstraints permitting only
// `hosts` (DNS names; an empty list is refused). Throws TlsError.
CaPem make_session_ca(const std::string& session_id, const std::vector<std::string>& hosts,
                      std::chrono::seconds lifetime);

// The most recent OpenSSL error queue, as text, emptied.
std::string openssl_errors();

// The gateway's side facing a session's code: a server context per host,
// its leaf signed by the session's CA (made once per host, then cached).
class SessionTls {
  public:
    explicit SessionTls(const CaPem& ca);  // throws TlsError
    ~SessionTls();
    SessionTls(const SessionTls&) = delete;
    SessionTls& operator=(const SessionTls&) = delete;
    SSL_CTX* server_context(const std::string& host);  // thread-safe; throws TlsError

  private:
    struct Parts;
    std::unique_ptr<Parts> parts_;
    std::mutex mutex_;
    std::map<std::string, SSL_CTX*> contexts_;
};

// The TLS sessions the gateway may resume with the upstreams of one
// cellblock session, one per host:port (the latest the upstream issued). A
// resumed handshake skips the upstream's certificate and signature, which
// were verified, for that host name, when the session was issued; an
// upstream that does not accept it simply gets a full handshake. Kept per
// cellblock session, so two sessions' connections are not linked by a
// shared ticket. Thread-safe.
class UpstreamResumption {
  public:
    UpstreamResumption() = default;
    ~UpstreamResumption();
    UpstreamResumption(const UpstreamResumption&) = delete;
    UpstreamResumption& operator=(const UpstreamResumption&) = delete;
    // Offers what is kept for `key` on `ssl` (made from UpstreamTls's
    // context, not yet connected) and keeps what the upstream issues on it.
    // `ssl` must be freed before this object is destroyed.
    void attach(SSL* ssl, const std::string& key);
    // Takes the caller's reference to `session`.
    void keep(const std::string& key, SSL_SESSION* session);
    std::size_t size();

  private:
    std::mutex mutex_;
    std::map<std::string, SSL_SESSION*> sessions_;
};

// The gateway's client side: the system's trust store plus `extra_ca_pem`
// (the operator's --egress-ca), peer verification and host name checks.
// Sessions the upstreams issue go to the UpstreamResumption a connection's
// SSL was attached to.
class UpstreamTls {
  public:
    explicit UpstreamTls(const std::string& extra_ca_pem);  // throws TlsError
    ~UpstreamTls();
    UpstreamTls(const UpstreamTls&) = delete;
    UpstreamTls& operator=(const UpstreamTls&) = delete;
    SSL_CTX* context() const { return ctx_; }

  private:
    SSL_CTX* ctx_ = nullptr;
};

}  // namespace cellblock::gateway
