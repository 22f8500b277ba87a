#include "tls.hpp"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

namespace cellblock::gateway {

namespace {

template <typename T, void (*Free)(T*)>
struct Deleter {
    void operator()(T* p) const { Free(p); }
};
using Key = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using Cert = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using Bio = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;

[[noreturn]] void fail(const std::string& what) { throw TlsError(what + ": " + openssl_errors()); }

Key new_key() {
    Key key(EVP_EC_gen("P-256"));
    if (!key) fail("EC key");
    return key;
}

void add_extension(X509* cert, X509* issuer, int nid, const std::string& value) {
    X509V3_CTX ctx;
    X509V3_set_ctx_nodb(&ctx);
    X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
    if (!ext) fail("extension " + value);
    const int ok = X509_add_ext(cert, ext, -1);
    X509_EXTENSION_free(ext);
    if (!ok) fail("add extension " + value);
}

Cert new_cert(EVP_PKEY* key, const std::string& common_name, std::chrono::seconds lifetime) {
    Cert cert(X509_new());
    if (!cert) fail("X509_new");
    X509_set_version(cert.get(), 2);
    unsigned char serial[16];
    if (RAND_bytes(serial, sizeof serial) != 1) fail("serial");
    serial[0] &= 0x7f;  // positive
    BIGNUM* bn = BN_bin2bn(serial, sizeof serial, nullptr);
    if (!bn || !BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get()))) {
        BN_free(bn);
        fail("serial");
    }
    BN_free(bn);
    X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
    X509_gmtime_adj(X509_getm_notAfter(cert.get()), static_cast<long>(lifetime.count()));
    X509_set_pubkey(cert.get(), key);
    X509_NAME* name = X509_get_subject_name(cert.get());
    X509_NAME_add_entry_by_txt(name, "O", MBSTRING_UTF8,
                               reinterpret_cast<const unsigned char*>("cellblock"), -1, -1, 0);
    X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8,
                               reinterpret_cast<const unsigned char*>(common_name.c_str()), -1, -1,
                               0);
    return cert;
}

std::string to_pem(X509* cert) {
    Bio bio(BIO_new(BIO_s_mem()));
    if (!bio || !PEM_write_bio_X509(bio.get(), cert)) fail("PEM cert");
    char* data = nullptr;
    const long n = BIO_get_mem_data(bio.get(), &data);
    return std::string(data, static_cast<std::size_t>(n));
}

std::string to_pem(EVP_PKEY* key) {
    Bio bio(BIO_new(BIO_s_mem()));
    if (!bio || !PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr))
        fail("PEM key");
    char* data = nullptr;
    const long n = BIO_get_mem_data(bio.get(), &data);
    return std::string(data, static_cast<std::size_t>(n));
}

SSL_CTX* new_context(const SSL_METHOD* method) {
    SSL_CTX* ctx = SSL_CTX_new(method);
    if (!ctx) fail("SSL_CTX_new");
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    // The relay polls the sockets itself: an SSL_read that only consumed a
    // handshake record (a TLS 1.3 ticket) must return, not wait for data.
    SSL_CTX_clear_mode(ctx, SSL_MODE_AUTO_RETRY);
    return ctx;
}

}  // namespace

std::string openssl_errors() {
    std::string out;
    while (const unsigned long e = ERR_get_error()) {
        char text[256];
        ERR_error_string_n(e, text, sizeof text);
        if (!out.empty()) out += "; ";
        out += text;
    }
    return out.empty() ? "no OpenSSL error" : out;
}

CaPem make_session_ca(const std::string& session_id, const std::vector<std::string>& hosts,
                      std::chrono::seconds lifetime) {
    if (hosts.empty()) throw TlsError("a session CA needs at least one host");
    Key key = new_key();
    Cert cert = new_cert(key.get(), "cellblock session " + session_id, lifetime);
    X509_set_issuer_name(cert.get(), X509_get_subject_name(cert.get()));
    add_extension(cert.get(), cert.get(), NID_basic_constraints, "critical,CA:TRUE,pathlen:0");
    add_extension(cert.get(), cert.get(), NID_key_usage, "critical,keyCertSign,cRLSign");
    add_extension(cert.get(), cert.get(), NID_subject_key_identifier, "hash");
    std::string permitted = "critical";
    for (const auto& host : hosts) permitted += ",permitted;DNS:" + host;
    add_extension(cert.get(), cert.get(), NID_name_constraints, permitted);
    if (!X509_sign(cert.get(), key.get(), EVP_sha256())) fail("sign CA");
    return {to_pem(key.get()), to_pem(cert.get())};
}

struct SessionTls::Parts {
    Key ca_key, leaf_key;
    Cert ca_cert;
};

SessionTls::SessionTls(const CaPem& ca) : parts_(std::make_unique<Parts>()) {
    Bio key_bio(BIO_new_mem_buf(ca.key.data(), static_cast<int>(ca.key.size())));
    Bio cert_bio(BIO_new_mem_buf(ca.cert.data(), static_cast<int>(ca.cert.size())));
    parts_->ca_key.reset(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
    parts_->ca_cert.reset(PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr));
    if (!parts_->ca_key || !parts_->ca_cert) fail("session CA");
    parts_->leaf_key = new_key();
}

SessionTls::~SessionTls() {
    for (auto& [host, ctx] : contexts_) SSL_CTX_free(ctx);
}

SSL_CTX* SessionTls::server_context(const std::string& host) {
    std::lock_guard lock(mutex_);
    if (auto it = contexts_.find(host); it != contexts_.end()) return it->second;
    // The leaf lives no longer than its CA.
    const ASN1_TIME* ca_end = X509_get0_notAfter(parts_->ca_cert.get());
    int days = 0, seconds = 0;
    ASN1_TIME_diff(&days, &seconds, nullptr, ca_end);
    const auto left = std::chrono::seconds(std::max(60L, days * 86400L + seconds));
    Cert leaf = new_cert(parts_->leaf_key.get(), host, left);
    X509_set_issuer_name(leaf.get(), X509_get_subject_name(parts_->ca_cert.get()));
    add_extension(leaf.get(), parts_->ca_cert.get(), NID_basic_constraints, "critical,CA:FALSE");
    add_extension(leaf.get(), parts_->ca_cert.get(), NID_key_usage, "critical,digitalSignature");
    add_extension(leaf.get(), parts_->ca_cert.get(), NID_ext_key_usage, "serverAuth");
    add_extension(leaf.get(), parts_->ca_cert.get(), NID_subject_alt_name, "DNS:" + host);
    add_extension(leaf.get(), parts_->ca_cert.get(), NID_authority_key_identifier, "keyid");
    if (!X509_sign(leaf.get(), parts_->ca_key.get(), EVP_sha256())) fail("sign leaf");
    SSL_CTX* ctx = new_context(TLS_server_method());
    SSL_CTX_set_num_tickets(ctx, 0);
    if (SSL_CTX_use_certificate(ctx, leaf.get()) != 1 ||
        SSL_CTX_use_PrivateKey(ctx, parts_->leaf_key.get()) != 1 ||
        SSL_CTX_add1_chain_cert(ctx, parts_->ca_cert.get()) != 1) {
        SSL_CTX_free(ctx);
        fail("server context for " + host);
    }
    contexts_[host] = ctx;
    return ctx;
}

namespace {

// Where a connection's new upstream sessions go (the SSL's ex_data).
struct ResumptionSlot {
    UpstreamResumption* owner;
    std::string key;
};

void free_slot(void*, void* ptr, CRYPTO_EX_DATA*, int, long, void*) {
    delete static_cast<ResumptionSlot*>(ptr);
}

int slot_index() {
    static const int index = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, free_slot);
    return index;
}

int on_new_session(SSL* ssl, SSL_SESSION* session) {
    auto* slot = static_cast<ResumptionSlot*>(SSL_get_ex_data(ssl, slot_index()));
    // A copy: the connection's own session object is marked not resumable
    // when the connection ends without a close_notify, as a relayed one may.
    SSL_SESSION* copy = slot ? SSL_SESSION_dup(session) : nullptr;
    if (copy) slot->owner->keep(slot->key, copy);
    return 0;  // OpenSSL keeps (and frees) its own reference
}

}  // namespace

UpstreamResumption::~UpstreamResumption() {
    for (auto& [key, session] : sessions_) SSL_SESSION_free(session);
}

void UpstreamResumption::attach(SSL* ssl, const std::string& key) {
    if (SSL_set_ex_data(ssl, slot_index(), new ResumptionSlot{this, key}) != 1) {
        fail("SSL_set_ex_data");
    }
    std::lock_guard lock(mutex_);
    const auto it = sessions_.find(key);
    if (it != sessions_.end() && SSL_SESSION_is_resumable(it->second)) {
        SSL_set_session(ssl, it->second);  // adds its own reference
    }
}

void UpstreamResumption::keep(const std::string& key, SSL_SESSION* session) {
    std::lock_guard lock(mutex_);
    SSL_SESSION*& slot = sessions_[key];
    if (slot) SSL_SESSION_free(slot);
    slot = session;
}

std::size_t UpstreamResumption::size() {
    std::lock_guard lock(mutex_);
    return sessions_.size();
}

UpstreamTls::UpstreamTls(const std::string& extra_ca_pem) {
    ctx_ = new_context(TLS_client_method());
    // The client side keeps nothing itself: each connection's new sessions go
    // to its cellblock session's UpstreamResumption.
    SSL_CTX_set_session_cache_mode(ctx_, SSL_SESS_CACHE_CLIENT | SSL_SESS_CACHE_NO_INTERNAL_STORE);
    SSL_CTX_sess_set_new_cb(ctx_, on_new_session);
    SSL_CTX_set_verify(ctx_, SSL_VERIFY_PEER, nullptr);
    if (SSL_CTX_set_default_verify_paths(ctx_) != 1) fail("system trust store");
    if (!extra_ca_pem.empty()) {
        Bio bio(BIO_new_mem_buf(extra_ca_pem.data(), static_cast<int>(extra_ca_pem.size())));
        STACK_OF(X509_INFO)* infos = PEM_X509_INFO_read_bio(bio.get(), nullptr, nullptr, nullptr);
        if (!infos) fail("--egress-ca");
        X509_STORE* store = SSL_CTX_get_cert_store(ctx_);
        int added = 0;
        for (int i = 0; i < sk_X509_INFO_num(infos); ++i) {
            X509_INFO* info = sk_X509_INFO_value(infos, i);
            if (info->x509 && X509_STORE_add_cert(store, info->x509) == 1) ++added;
        }
        sk_X509_INFO_pop_free(infos, X509_INFO_free);
        if (added == 0) throw TlsError("--egress-ca holds no certificate");
    }
}

UpstreamTls::~UpstreamTls() { SSL_CTX_free(ctx_); }

}  // namespace cellblock::gateway
