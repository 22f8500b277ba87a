#include "snapshot_cipher.hpp"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace cellblock {
namespace {

constexpr char kMagic[8] = {'C', 'B', 'S', 'E', 'A', 'L', '1', '\n'};   // format 1
constexpr char kMagic2[8] = {'C', 'B', 'S', 'E', 'A', 'L', '2', '\n'};  // format 2
constexpr std::size_t kNonce = 12, kTag = kSealTag, kChunk = kSealChunk;
static_assert(kSealHeader == sizeof kMagic2 + kNonce);
// How much a seal writes between two fdatasync()s of its flusher. Here a
// sync_file_range every 32 MiB still left the keeper's fsync 40-65 ms for
// 100 MB (the disk's own cache flushed then, whatever was written back
// before); flushing as it goes left 4 ms (in a toy writing at the seal's
// pace: 100 MB 137 -> 100 ms, 500 MB 750 -> 460 ms; a 500 MB hibernation's
// median 589 -> 469 ms; docs/hibernation.md). Every 32 MiB left 16 ms at
// 500 MB, every 8 no less than 16.
constexpr std::uint64_t kFlushEvery = std::uint64_t{16} << 20;

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

// A buffer whose pages are all made when it is (MAP_POPULATE), not one by
// one as they are first touched: in this host's PVM guest a page's first
// touch cost ~12 us (the seal's 5 MiB of buffers took 9-15 ms of a 100 MB
// hibernation; populated, 6 MiB take ~1.2 ms; docs/field-notes.md). Wiped
// before its pages go back: it held plain content.
class Pages {
  public:
    explicit Pages(std::size_t n) : n_(n) {
        void* at = ::mmap(nullptr, n, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (at == MAP_FAILED) fail(std::string("no memory for a buffer: ") + std::strerror(errno));
        data_ = static_cast<unsigned char*>(at);
    }
    ~Pages() {
        OPENSSL_cleanse(data_, n_);
        ::munmap(data_, n_);
    }
    Pages(const Pages&) = delete;
    Pages& operator=(const Pages&) = delete;
    unsigned char* data() const { return data_; }
    std::size_t size() const { return n_; }

  private:
    const std::size_t n_;
    unsigned char* data_ = nullptr;
};

// Writes a seal's (or an opening's) chunks on a thread of its own, so that
// reading and the cipher's work on the next chunk overlap writing this one:
// here the read, the cipher and the write into the page cache each took
// about a third of a seal (docs/hibernation.md). A file of one chunk is
// written on the caller's thread; no thread is started for it. A failed
// write is thrown by the next take(), queue() or finish().
class WriteBehind {
  public:
    // `flush`: have the disk keep what was written every kFlushEvery bytes,
    // on a thread of its own (the writer never waits for the disk).
    WriteBehind(int out, bool flush) : out_(out), flush_(flush) {
        for (std::size_t i = 0; i < buffers_.size(); ++i) free_.push_back(i);
    }
    ~WriteBehind() {
        {
            const std::lock_guard lock(mutex_);
            abandoned_ = true;
        }
        changed_.notify_all();
        if (thread_.joinable()) thread_.join();
        stop_flusher();
    }
    WriteBehind(const WriteBehind&) = delete;
    WriteBehind& operator=(const WriteBehind&) = delete;

    // A free buffer of kChunk + kTag bytes (waits while every one is queued;
    // made when first taken: a small file needs one).
    unsigned char* take() {
        {
            std::unique_lock lock(mutex_);
            changed_.wait(lock, [this] { return !free_.empty() || failed_; });
            if (failed_) std::rethrow_exception(failed_);
            taken_ = free_.back();
            free_.pop_back();
        }
        // Only the taker touches a buffer until it is queued.
        if (!buffers_[taken_]) buffers_[taken_] = std::make_unique<Pages>(kChunk + kTag);
        return buffers_[taken_]->data();
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
            for (const auto& [i, n] : queued_) write_chunk(buffers_[i]->data(), n);
            queued_.clear();
        }
        stop_flusher();
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
                write_chunk(buffers_[next.first]->data(), next.second);
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
        if (flush_ && written_ - flush_asked_ >= kFlushEvery) {
            flush_asked_ = written_;
            {
                const std::lock_guard lock(mutex_);
                flush_wanted_ = true;
            }
            if (!flusher_.joinable()) flusher_ = std::thread([this] { flush_as_asked(); });
            changed_.notify_all();
        }
    }
    // The flusher: one fdatasync() at a time, as long as more is wanted. Its
    // failure is the seal's (an error fdatasync reported is not reported
    // again to the keeper's fsync).
    void flush_as_asked() {
        for (;;) {
            {
                std::unique_lock lock(mutex_);
                changed_.wait(lock, [this] { return flush_wanted_ || flusher_done_; });
                if (!flush_wanted_) return;
                flush_wanted_ = false;
            }
            const int err = ::fdatasync(out_) == 0 ? 0 : errno;
            // A file that cannot be synced (a pipe): the keeper's fsync says.
            if (err != 0 && err != EINVAL && err != EROFS) {
                const std::lock_guard lock(mutex_);
                if (!failed_) {
                    failed_ = std::make_exception_ptr(
                        std::runtime_error(std::string("flushing: ") + std::strerror(err)));
                }
                changed_.notify_all();
                return;
            }
        }
    }
    void stop_flusher() {
        if (!flusher_.joinable()) return;
        {
            const std::lock_guard lock(mutex_);
            flusher_done_ = true;
            flush_wanted_ = false;
        }
        changed_.notify_all();
        flusher_.join();
    }

    const int out_;
    const bool flush_;
    std::uint64_t written_ = 0, flush_asked_ = 0;  // the writer's alone
    std::array<std::unique_ptr<Pages>, 4> buffers_;
    std::vector<std::size_t> free_;
    std::deque<std::pair<std::size_t, std::size_t>> queued_;  // buffer, bytes
    std::size_t taken_ = 0;
    std::mutex mutex_;
    std::condition_variable changed_;
    bool closing_ = false, abandoned_ = false;
    bool flush_wanted_ = false, flusher_done_ = false;
    std::exception_ptr failed_;
    std::thread thread_, flusher_;
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

// Format 2's chunks: one context per thread, keyed once; each chunk sets
// its own nonce and additional data (see snapshot_cipher.hpp).
class ChunkCipher {
  public:
    ChunkCipher(bool encrypt, const SnapshotKey& key, const unsigned char* nonce,
                const std::string& label)
        : encrypt_(encrypt), ctx_(EVP_CIPHER_CTX_new()), aad_(label.begin(), label.end()) {
        if (!ctx_) fail("no cipher context");
        auto init = encrypt ? EVP_EncryptInit_ex : EVP_DecryptInit_ex;
        if (init(ctx_.get(), EVP_aes_256_gcm(), nullptr, nullptr, nullptr) != 1 ||
            EVP_CIPHER_CTX_ctrl(ctx_.get(), EVP_CTRL_GCM_SET_IVLEN, kNonce, nullptr) != 1 ||
            init(ctx_.get(), nullptr, nullptr, key.bytes(), nullptr) != 1) {
            fail("the cipher did not start");
        }
        std::memcpy(nonce_.data(), nonce, kNonce);
        aad_.push_back('\0');
        aad_.resize(aad_.size() + 9);
    }
    // Seals `n` bytes of `plain` as chunk `i` into `out`: n bytes, then the tag.
    void seal(std::uint64_t i, bool last, const unsigned char* plain, std::size_t n,
              unsigned char* out) {
        begin(i, last);
        int len = 0, end = 0;
        if (EVP_EncryptUpdate(ctx_.get(), out, &len, plain, static_cast<int>(n)) != 1 ||
            EVP_EncryptFinal_ex(ctx_.get(), out + len, &end) != 1 ||
            EVP_CIPHER_CTX_ctrl(ctx_.get(), EVP_CTRL_GCM_GET_TAG, kTag, out + n) != 1) {
            fail("sealing failed");
        }
    }
    // Opens chunk `i` (`n` bytes, then its tag, at `sealed`) into `plain`;
    // false when it fails its check.
    bool open(std::uint64_t i, bool last, const unsigned char* sealed, std::size_t n,
              unsigned char* plain) {
        begin(i, last);
        int len = 0, end = 0;
        unsigned char tag[kTag];
        std::memcpy(tag, sealed + n, kTag);
        return EVP_DecryptUpdate(ctx_.get(), plain, &len, sealed, static_cast<int>(n)) == 1 &&
               EVP_CIPHER_CTX_ctrl(ctx_.get(), EVP_CTRL_GCM_SET_TAG, kTag, tag) == 1 &&
               EVP_DecryptFinal_ex(ctx_.get(), plain + len, &end) == 1;
    }

  private:
    void begin(std::uint64_t i, bool last) {
        std::array<unsigned char, kNonce> nonce = nonce_;
        unsigned char* index = aad_.data() + aad_.size() - 9;
        for (int b = 0; b < 8; ++b) {
            const auto byte = static_cast<unsigned char>(i >> (56 - 8 * b));
            nonce[kNonce - 8 + b] ^= byte;
            index[b] = byte;
        }
        index[8] = last ? 1 : 0;
        auto init = encrypt_ ? EVP_EncryptInit_ex : EVP_DecryptInit_ex;
        auto update = encrypt_ ? EVP_EncryptUpdate : EVP_DecryptUpdate;
        int n = 0;
        if (init(ctx_.get(), nullptr, nullptr, nullptr, nonce.data()) != 1 ||
            update(ctx_.get(), nullptr, &n, aad_.data(), static_cast<int>(aad_.size())) != 1) {
            fail("the cipher refused a chunk");
        }
    }

    const bool encrypt_;
    Cipher ctx_;
    std::array<unsigned char, kNonce> nonce_{};
    std::vector<unsigned char> aad_;
};

void read_at(int fd, unsigned char* data, std::size_t n, off_t at) {
    while (n > 0) {
        const ssize_t r = ::pread(fd, data, n, at);
        if (r < 0) {
            if (errno == EINTR) continue;
            fail(std::string("reading: ") + std::strerror(errno));
        }
        if (r == 0) fail("it was cut short while it was read");
        data += r;
        n -= static_cast<std::size_t>(r);
        at += r;
    }
}

void write_at(int fd, const unsigned char* data, std::size_t n, off_t at) {
    while (n > 0) {
        const ssize_t w = ::pwrite(fd, data, n, at);
        if (w < 0) {
            if (errno == EINTR) continue;
            fail(std::string("writing: ") + std::strerror(errno));
        }
        data += w;
        n -= static_cast<std::size_t>(w);
        at += w;
    }
}

// Format 1: one GCM stream over the whole content (files sealed before
// 2026-12-04), opened in order. `in` is past the magic.
std::uint64_t open_format1(int in, int out, std::uint64_t size, const SnapshotKey& key,
                           const std::string& label) {
    constexpr std::uint64_t overhead = sizeof kMagic + kNonce + kTag;
    if (size < overhead) fail("it is too short to be a sealed snapshot");
    unsigned char nonce[kNonce];
    if (read_some(in, nonce, sizeof nonce) != sizeof nonce) fail("its nonce is missing");
    Cipher ctx = start(false, key, nonce, label);
    Pages sealed(kChunk);
    WriteBehind writer(out, false);
    std::uint64_t left = size - overhead, total = 0;
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

// A format 2 file of `size` bytes: its chunks and its plain bytes.
struct Format2Shape {
    std::uint64_t chunks = 0, plain = 0, last = 0;  // `last`: the last chunk's plain bytes
};
Format2Shape format2_shape(std::uint64_t size) {
    const std::uint64_t body = size - kSealHeader, piece = kChunk + kTag;
    const std::uint64_t rest = body % piece;
    // The last chunk is shorter than a whole one: a file that ends at a
    // chunk's end was cut there, and what is shorter than a tag is no chunk.
    if (rest < kTag) {
        fail(rest == 0 ? "it failed its integrity check (its last chunk is missing)"
                       : "it was cut short inside a chunk");
    }
    const std::uint64_t chunks = body / piece + 1;
    return {chunks, (chunks - 1) * kChunk + rest - kTag, rest - kTag};
}

// Format 2: its chunks opened on up to one thread per core (at most 4), and
// written in order, each at its place in `out` (from where `out` stands):
// what stands in `out` is always a whole prefix of the content, which a
// reader may take while the rest is still being opened (a wake's kernel
// does). One thread when `out` cannot seek (a pipe).
std::uint64_t open_format2(int in, int out, std::uint64_t size, const SnapshotKey& key,
                           const std::string& label) {
    unsigned char nonce[kNonce];
    read_at(in, nonce, kNonce, sizeof kMagic2);
    const std::uint64_t piece = kChunk + kTag;
    const Format2Shape shape = format2_shape(size);
    const std::uint64_t chunks = shape.chunks, total = shape.plain;
    const off_t out_at = ::lseek(out, 0, SEEK_CUR);
    const unsigned cores = std::max(1u, std::min(4u, std::thread::hardware_concurrency()));
    const unsigned threads =
        out_at < 0 ? 1u : static_cast<unsigned>(std::min<std::uint64_t>(cores, chunks));
    std::mutex mutex;
    std::condition_variable turn;  // chunk `written` may be written
    std::uint64_t written = 0;
    std::exception_ptr failed;
    std::atomic<bool> stop{false};
    const auto work = [&](unsigned first) {
        try {
            ChunkCipher cipher(false, key, nonce, label);
            Pages sealed(piece), plain(kChunk);
            for (std::uint64_t i = first; i < chunks && !stop.load(); i += threads) {
                const bool last = i == chunks - 1;
                const std::size_t n = last ? static_cast<std::size_t>(shape.last) : kChunk;
                read_at(in, sealed.data(), n + kTag, static_cast<off_t>(kSealHeader + i * piece));
                if (!cipher.open(i, last, sealed.data(), n, plain.data())) {
                    fail(
                        "it failed its integrity check (changed on disk, or not this "
                        "session's)");
                }
                if (out_at < 0) {
                    write_all(out, plain.data(), n);
                    continue;
                }
                {
                    std::unique_lock lock(mutex);
                    turn.wait(lock, [&] { return written == i || stop.load(); });
                }
                if (stop.load()) break;
                write_at(out, plain.data(), n, out_at + static_cast<off_t>(i * kChunk));
                {
                    const std::lock_guard lock(mutex);
                    written = i + 1;
                }
                turn.notify_all();
            }
        } catch (const std::exception&) {
            stop = true;
            {
                const std::lock_guard lock(mutex);
                if (!failed) failed = std::current_exception();
            }
            turn.notify_all();
        }
    };
    std::vector<std::thread> helpers;
    for (unsigned t = 1; t < threads; ++t) helpers.emplace_back(work, t);
    work(0);
    for (auto& helper : helpers) helper.join();
    if (failed) std::rethrow_exception(failed);
    if (out_at >= 0) ::lseek(out, out_at + static_cast<off_t>(total), SEEK_SET);
    return total;
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
    write_all(out, reinterpret_cast<const unsigned char*>(kMagic2), sizeof kMagic2);
    write_all(out, nonce, sizeof nonce);
    ChunkCipher cipher(true, key, nonce, label);
    Pages plain(kChunk);
    WriteBehind writer(out, true);
    std::uint64_t total = 0;
    for (std::uint64_t i = 0;; ++i) {
        // A chunk shorter than a whole one is the last (empty after a whole
        // number of chunks).
        const std::size_t n = read(plain.data(), plain.size());
        const bool last = n < plain.size();
        cipher.seal(i, last, plain.data(), n, writer.take());
        writer.queue(n + kTag);
        total += n;
        if (last) break;
    }
    writer.finish();
    return total;
}

namespace {

// A sealed file's format (1 or 2) and size, its header read at its start
// (pread: `in` does not move); fails on what is no sealed file.
struct SealedFile {
    int format = 0;
    std::uint64_t size = 0;
};
SealedFile sealed_file(int in) {
    struct stat st {};
    if (::fstat(in, &st) != 0) fail(std::string("stat: ") + std::strerror(errno));
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (size < kSealOverhead) fail("it is too short to be a sealed snapshot");
    unsigned char magic[sizeof kMagic];
    read_at(in, magic, sizeof magic, 0);
    if (std::memcmp(magic, kMagic2, sizeof magic) == 0) return {2, size};
    if (std::memcmp(magic, kMagic, sizeof magic) == 0) return {1, size};
    fail("it is not a sealed snapshot");
}

}  // namespace

std::uint64_t open_sealed_stream(int in, int out, const SnapshotKey& key,
                                 const std::string& label) {
    const SealedFile file = sealed_file(in);
    if (file.format == 2) return open_format2(in, out, file.size, key, label);
    // Format 1 is read in order, from past its magic.
    if (::lseek(in, sizeof kMagic, SEEK_SET) < 0)
        fail(std::string("seek: ") + std::strerror(errno));
    return open_format1(in, out, file.size, key, label);
}

std::optional<std::uint64_t> followable_plain_size(int in) {
    const SealedFile file = sealed_file(in);
    if (file.format == 1) return std::nullopt;
    return format2_shape(file.size).plain;
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
