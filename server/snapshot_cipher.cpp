#include "snapshot_cipher.hpp"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace cellblock {
namespace {

constexpr char kMagic[8] = {'C', 'B', 'S', 'E', 'A', 'L', '1', '\n'};
constexpr std::size_t kNonce = 12, kTag = 16, kChunk = 1 << 20;
// How much a seal writes before it asks the disk to start on it: 8 MiB
// stalled the writer on a full request queue here, 32 did not (a 500 MB
// seal and its fsync: 0.31 s against 0.40-1.38 s without).
constexpr std::uint64_t kWriteBehind = std::uint64_t{32} << 20;

struct CipherDeleter {
    void operator()(EVP_CIPHER_CTX* ctx) const { EVP_CIPHER_CTX_free(ctx); }
};
using Cipher = std::unique_ptr<EVP_CIPHER_CTX, CipherDeleter>;

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what); }

void write_all(int fd, const unsigned char* data, std::size_t n) {
    while (n > 0) {
        const ssize_t w = ::write(fd, data, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            fail(std::string("writing: ") + std::strerror(errno));
        }
        data += w;
        n -= static_cast<std::size_t>(w);
    }
}

// Up to `n` bytes; fewer only at the end of the file.
std::size_t read_some(int fd, unsigned char* data, std::size_t n) {
    std::size_t got = 0;
    while (got < n) {
        const ssize_t r = ::read(fd, data + got, n - got);
        if (r < 0) {
            if (errno == EINTR) continue;
            fail(std::string("reading: ") + std::strerror(errno));
        }
        if (r == 0) break;
        got += static_cast<std::size_t>(r);
    }
    return got;
}

// Writes a seal's (or an opening's) chunks on a thread of its own, so that
// reading and the cipher's work on the next chunk overlap writing this one:
// here the read, the cipher and the write into the page cache each took
// about a third of a seal (docs/hibernation.md). A file of one chunk is
// written on the caller's thread; no thread is started for it. A failed
// write is thrown by the next take(), queue() or finish().
class WriteBehind {
  public:
    // `start_disk`: ask the disk to start writing every kWriteBehind bytes.
    WriteBehind(int out, bool start_disk)
        : out_(out), start_disk_(start_disk), at_(::lseek(out, 0, SEEK_CUR)) {
        for (std::size_t i = 0; i < buffers_.size(); ++i) {
            buffers_[i].resize(kChunk + kTag);
            free_.push_back(i);
        }
    }
    ~WriteBehind() {
        {
            const std::lock_guard lock(mutex_);
            abandoned_ = true;
        }
        changed_.notify_all();
        if (thread_.joinable()) thread_.join();
        // An opening's buffers held plain content.
        for (auto& b : buffers_) OPENSSL_cleanse(b.data(), b.size());
    }
    WriteBehind(const WriteBehind&) = delete;
    WriteBehind& operator=(const WriteBehind&) = delete;

    // A free buffer of kChunk + kTag bytes (waits while every one is queued).
    unsigned char* take() {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [this] { return !free_.empty() || failed_; });
        if (failed_) std::rethrow_exception(failed_);
        taken_ = free_.back();
        free_.pop_back();
        return buffers_[taken_].data();
    }
    // The first `n` bytes of what take() gave, written after all before.
    void queue(std::size_t n) {
        {
            const std::lock_guard lock(mutex_);
            if (failed_) std::rethrow_exception(failed_);
            queued_.emplace_back(taken_, n);
        }
        if (!thread_.joinable() && queued_.size() > 1) thread_ = std::thread([this] { run(); });
        changed_.notify_all();
    }
    // Everything queued written; throws what failed.
    void finish() {
        if (thread_.joinable()) {
            {
                const std::lock_guard lock(mutex_);
                closing_ = true;
            }
            changed_.notify_all();
            thread_.join();
        } else {
            for (const auto& [i, n] : queued_) write_chunk(buffers_[i].data(), n);
            queued_.clear();
        }
        if (failed_) std::rethrow_exception(failed_);
    }

  private:
    void run() {
        for (;;) {
            std::pair<std::size_t, std::size_t> next;
            {
                std::unique_lock lock(mutex_);
                changed_.wait(lock, [this] { return !queued_.empty() || closing_ || abandoned_; });
                if (abandoned_ || queued_.empty()) return;
                next = queued_.front();
            }
            try {
                write_chunk(buffers_[next.first].data(), next.second);
            } catch (const std::exception&) {
                const std::lock_guard lock(mutex_);
                failed_ = std::current_exception();
                changed_.notify_all();
                return;
            }
            {
                const std::lock_guard lock(mutex_);
                queued_.pop_front();
                free_.push_back(next.first);
            }
            changed_.notify_all();
        }
    }
    void write_chunk(const unsigned char* data, std::size_t n) {
        write_all(out_, data, n);
        written_ += n;
        if (start_disk_ && at_ >= 0 && written_ - on_its_way_ >= kWriteBehind) {
            // Not every file system has it (then the fsync does it all).
            ::sync_file_range(out_, at_ + static_cast<off_t>(on_its_way_),
                              static_cast<off_t>(written_ - on_its_way_), SYNC_FILE_RANGE_WRITE);
            on_its_way_ = written_;
        }
    }

    const int out_;
    const bool start_disk_;
    const off_t at_;                              // where the first chunk goes in `out_`
    std::uint64_t written_ = 0, on_its_way_ = 0;  // the writer's alone
    std::array<std::vector<unsigned char>, 4> buffers_;
    std::vector<std::size_t> free_;
    std::deque<std::pair<std::size_t, std::size_t>> queued_;  // buffer, bytes
    std::size_t taken_ = 0;
    std::mutex mutex_;
    std::condition_variable changed_;
    bool closing_ = false, abandoned_ = false;
    std::exception_ptr failed_;
    std::thread thread_;
};

Cipher start(bool encrypt, const SnapshotKey& key, const unsigned char* nonce,
             const std::string& label) {
    Cipher ctx(EVP_CIPHER_CTX_new());
    if (!ctx) fail("no cipher context");
    auto init = encrypt ? EVP_EncryptInit_ex : EVP_DecryptInit_ex;
    if (init(ctx.get(), EVP_aes_256_gcm(), nullptr, nullptr, nullptr) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_IVLEN, kNonce, nullptr) != 1 ||
        init(ctx.get(), nullptr, nullptr, key.bytes(), nonce) != 1) {
        fail("the cipher did not start");
    }
    int n = 0;
    auto update = encrypt ? EVP_EncryptUpdate : EVP_DecryptUpdate;
    if (update(ctx.get(), nullptr, &n, reinterpret_cast<const unsigned char*>(label.data()),
               static_cast<int>(label.size())) != 1) {
        fail("the cipher refused its label");
    }
    return ctx;
}

}  // namespace

SnapshotKey::SnapshotKey() {
    if (RAND_bytes(key_.data(), static_cast<int>(key_.size())) != 1) {
        throw std::runtime_error("no random bytes for a snapshot key");
    }
}

SnapshotKey::SnapshotKey(std::string_view bytes) {
    if (bytes.size() != key_.size()) {
        throw std::invalid_argument("a key is " + std::to_string(key_.size()) + " bytes, not " +
                                    std::to_string(bytes.size()));
    }
    std::memcpy(key_.data(), bytes.data(), key_.size());
}

SnapshotKey::~SnapshotKey() { OPENSSL_cleanse(key_.data(), key_.size()); }

std::uint64_t seal_stream(int in, int out, const SnapshotKey& key, const std::string& label) {
    return seal_from([in](unsigned char* data, std::size_t n) { return read_some(in, data, n); },
                     out, key, label);
}

std::uint64_t seal_from(const SealSource& read, int out, const SnapshotKey& key,
                        const std::string& label) {
    unsigned char nonce[kNonce];
    if (RAND_bytes(nonce, sizeof nonce) != 1) fail("no random bytes for a nonce");
    write_all(out, reinterpret_cast<const unsigned char*>(kMagic), sizeof kMagic);
    write_all(out, nonce, sizeof nonce);
    Cipher ctx = start(true, key, nonce, label);
    std::vector<unsigned char> plain(kChunk);
    WriteBehind writer(out, true);
    std::uint64_t total = 0;
    for (;;) {
        const std::size_t n = read(plain.data(), plain.size());
        if (n == 0) break;
        int len = 0;
        if (EVP_EncryptUpdate(ctx.get(), writer.take(), &len, plain.data(), static_cast<int>(n)) !=
            1) {
            fail("sealing failed");
        }
        writer.queue(static_cast<std::size_t>(len));
        total += n;
        if (n < plain.size()) break;
    }
    OPENSSL_cleanse(plain.data(), plain.size());
    int len = 0;
    unsigned char* last = writer.take();
    if (EVP_EncryptFinal_ex(ctx.get(), last, &len) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, kTag, last + len) != 1) {
        fail("sealing failed at the end");
    }
    writer.queue(static_cast<std::size_t>(len) + kTag);
    writer.finish();
    return total;
}

std::uint64_t open_sealed_stream(int in, int out, const SnapshotKey& key,
                                 const std::string& label) {
    struct stat st {};
    if (::fstat(in, &st) != 0) fail(std::string("stat: ") + std::strerror(errno));
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (size < kSealOverhead) fail("it is too short to be a sealed snapshot");
    unsigned char head[sizeof kMagic + kNonce];
    if (read_some(in, head, sizeof head) != sizeof head ||
        std::memcmp(head, kMagic, sizeof kMagic) != 0) {
        fail("it is not a sealed snapshot");
    }
    Cipher ctx = start(false, key, head + sizeof kMagic, label);
    std::vector<unsigned char> sealed(kChunk);
    WriteBehind writer(out, false);
    std::uint64_t left = size - kSealOverhead, total = 0;
    while (left > 0) {
        const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(left, kChunk));
        const std::size_t n = read_some(in, sealed.data(), want);
        if (n != want) fail("it was cut short while it was read");
        int len = 0;
        if (EVP_DecryptUpdate(ctx.get(), writer.take(), &len, sealed.data(), static_cast<int>(n)) !=
            1) {
            fail("opening failed");
        }
        writer.queue(static_cast<std::size_t>(len));
        total += static_cast<std::uint64_t>(len);
        left -= n;
    }
    unsigned char tag[kTag];
    if (read_some(in, tag, sizeof tag) != sizeof tag) fail("its tag is missing");
    int len = 0;
    if (EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_TAG, kTag, tag) != 1 ||
        EVP_DecryptFinal_ex(ctx.get(), writer.take(), &len) != 1) {
        fail("it failed its integrity check (changed on disk, or not this session's)");
    }
    writer.finish();
    return total;
}

std::string seal(std::string_view plain, const SnapshotKey& key, const std::string& label) {
    unsigned char nonce[kNonce];
    if (RAND_bytes(nonce, sizeof nonce) != 1) fail("no random bytes for a nonce");
    std::string out(sizeof kMagic + kNonce + plain.size() + kTag, '\0');
    auto* at = reinterpret_cast<unsigned char*>(out.data());
    std::memcpy(at, kMagic, sizeof kMagic);
    std::memcpy(at + sizeof kMagic, nonce, kNonce);
    Cipher ctx = start(true, key, nonce, label);
    unsigned char* body = at + sizeof kMagic + kNonce;
    int len = 0, last = 0;
    if (EVP_EncryptUpdate(ctx.get(), body, &len,
                          reinterpret_cast<const unsigned char*>(plain.data()),
                          static_cast<int>(plain.size())) != 1 ||
        EVP_EncryptFinal_ex(ctx.get(), body + len, &last) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_GET_TAG, kTag, body + plain.size()) != 1) {
        fail("sealing failed");
    }
    return out;
}

std::string open_sealed(std::string_view sealed, const SnapshotKey& key, const std::string& label) {
    if (sealed.size() < kSealOverhead) fail("it is too short to be sealed");
    if (std::memcmp(sealed.data(), kMagic, sizeof kMagic) != 0) fail("it is not sealed");
    const auto* at = reinterpret_cast<const unsigned char*>(sealed.data());
    Cipher ctx = start(false, key, at + sizeof kMagic, label);
    const std::size_t n = sealed.size() - kSealOverhead;
    std::string plain(n, '\0');
    int len = 0, last = 0;
    unsigned char tag[kTag];
    std::memcpy(tag, at + sizeof kMagic + kNonce + n, kTag);
    if (EVP_DecryptUpdate(ctx.get(), reinterpret_cast<unsigned char*>(plain.data()), &len,
                          at + sizeof kMagic + kNonce, static_cast<int>(n)) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx.get(), EVP_CTRL_GCM_SET_TAG, kTag, tag) != 1 ||
        EVP_DecryptFinal_ex(ctx.get(), reinterpret_cast<unsigned char*>(plain.data()) + len,
                            &last) != 1) {
        OPENSSL_cleanse(plain.data(), plain.size());
        fail("it failed its integrity check (changed, or sealed under another key)");
    }
    return plain;
}

}  // namespace cellblock
