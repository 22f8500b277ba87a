// The copy runs on a thread of its own, a step at a time; the caller's thread
// hashes what has landed behind it (read back from the destination, which
// is in the page cache by then). sha256 is the slower half (about 1.7 GB/s
// with SHA-NI here, the in-kernel copy about 3 GB/s), so a transfer takes
// about one hash pass.
#include "file_copy.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <thread>
#include <vector>

#include "file_transfer_internal.hpp"

namespace cellblock {
using namespace transfer_detail;

namespace {

constexpr std::uint64_t kStep = 8u << 20;      // copied per call, then published
constexpr std::size_t kHashBuffer = 1u << 20;  // read back and hashed per pread
constexpr std::uint64_t kPage = 4096;

// A step the kernel refused, with its errno.
struct StepFailed {
    int err;
};

// What the copying thread reports; `copied` is published after each step.
// `ticks` moves at every report, the last included: the hasher waits on it,
// so an end that copied nothing more (a cancel, a short source, an error)
// still wakes it.
struct CopyState {
    std::atomic<std::uint64_t> copied{0};
    std::atomic<bool> finished{false};
    std::atomic<std::uint32_t> ticks{0};
    int error = 0;  // errno of a failed step, read after `finished`
    bool short_source = false;
};

// One step with the kernel's copy, else (another file system, a kernel that
// cannot) with read and write. Returns the bytes moved, 0 at the source's end.
std::uint64_t copy_step(int src, int dst, std::uint64_t at, std::uint64_t length, bool& in_kernel,
                        std::vector<char>& buffer) {
    while (in_kernel) {
        loff_t in = static_cast<loff_t>(at), out = static_cast<loff_t>(at);
        const ssize_t n = ::copy_file_range(src, &in, dst, &out, length, 0);
        if (n >= 0) return static_cast<std::uint64_t>(n);
        if (errno == EINTR) continue;
        if (errno != EXDEV && errno != EINVAL && errno != EOPNOTSUPP && errno != ENOSYS &&
            errno != EBADF)
            throw StepFailed{errno};
        in_kernel = false;  // EBADF too: an O_APPEND destination; pwrite says if it is worse
    }
    if (buffer.empty()) buffer.resize(kHashBuffer);
    const std::size_t got =
        read_into(src, at, buffer.data(), std::min<std::uint64_t>(length, buffer.size()));
    std::size_t written = 0;
    while (written < got) {
        const ssize_t n =
            ::pwrite(dst, buffer.data() + written, got - written, static_cast<off_t>(at + written));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw StepFailed{errno};
        written += static_cast<std::size_t>(n);
    }
    return got;
}

void copy_all(int src, int dst, std::uint64_t size, CopyControl& control, CopyState& state) {
    bool in_kernel = true;
    std::vector<char> buffer;
    std::uint64_t at = 0;
    try {
        while (at < size && !control.cancel.load(std::memory_order_relaxed)) {
            const std::uint64_t n =
                copy_step(src, dst, at, std::min(kStep, size - at), in_kernel, buffer);
            if (n == 0) {
                state.short_source = true;
                break;
            }
            at += n;
            state.copied.store(at, std::memory_order_release);
            state.ticks.fetch_add(1, std::memory_order_release);
            state.ticks.notify_one();
        }
    } catch (const StepFailed& e) {
        state.error = e.err;
    } catch (const FileRequestError&) {
        state.error = EIO;
    }
    state.finished.store(true, std::memory_order_release);
    state.ticks.fetch_add(1, std::memory_order_release);
    state.ticks.notify_one();
}

}  // namespace

std::string copy_and_hash(int src, int dst, std::uint64_t size, CopyControl& control,
                          const std::function<void()>& on_step, bool dst_is_private) {
    CopyState state;
    Sha256 hash;
    std::uint64_t hashed = 0;
    {
        std::jthread copier([&] { copy_all(src, dst, size, control, state); });
        std::vector<char> buffer(kHashBuffer);
        try {
            while (hashed < size) {
                // Read before what it guards: a report after this load moves it.
                const std::uint32_t tick = state.ticks.load(std::memory_order_acquire);
                const std::uint64_t copied = state.copied.load(std::memory_order_acquire);
                if (copied == hashed) {
                    if (state.finished.load(std::memory_order_acquire)) {
                        if (state.copied.load(std::memory_order_acquire) == hashed) break;
                    } else {
                        state.ticks.wait(tick, std::memory_order_acquire);
                    }
                    continue;
                }
                // At most a step's bytes between reports: the copy runs ahead of
                // the hash, which would otherwise catch up only at the end.
                const std::uint64_t until = std::min(copied, hashed + kStep);
                // The server's own file is hashed where it lies, without a copy
                // into the buffer (a page-aligned window; nobody else can cut
                // the file under the mapping). A client's file is read: a
                // mapping of a file its owner truncates would fault the server.
                if (dst_is_private && hashed % kPage == 0) {
                    const std::size_t length = static_cast<std::size_t>(until - hashed);
                    void* map = ::mmap(nullptr, length, PROT_READ, MAP_SHARED | MAP_POPULATE, dst,
                                       static_cast<off_t>(hashed));
                    if (map != MAP_FAILED) {
                        hash.update(std::string_view(static_cast<const char*>(map), length));
                        ::munmap(map, length);
                        hashed = until;
                    }
                }
                while (hashed < until) {
                    const std::size_t want = static_cast<std::size_t>(
                        std::min<std::uint64_t>(kHashBuffer, until - hashed));
                    const std::size_t got = read_into(dst, hashed, buffer.data(), want);
                    if (got != want)
                        throw FileRequestError(ename::FileError,
                                               "the copy is shorter than it was a moment ago");
                    hash.update(std::string_view(buffer.data(), got));
                    hashed += got;
                }
                control.done.store(hashed, std::memory_order_relaxed);
                if (on_step) on_step();
            }
        } catch (...) {
            control.cancel = true;  // the copier stops at its next step; joined below
            throw;
        }
    }
    if (state.error != 0) {
        const int err = state.error;
        if (err == ENOSPC || err == EDQUOT)
            throw FileRequestError(
                ename::FileTooLarge,
                "the disk filled after " + bytes_text(hashed) + " of " + bytes_text(size));
        throw FileRequestError(ename::FileError,
                               "copy after " + bytes_text(hashed) + ": " + errno_text(err));
    }
    if (control.cancel.load())
        throw FileRequestError(ename::FileError,
                               "cancelled after " + bytes_text(hashed) + " of " + bytes_text(size));
    if (state.short_source || hashed != size)
        throw FileRequestError(ename::FileChanged, "the source ended after " + bytes_text(hashed) +
                                                       " of the " + bytes_text(size) +
                                                       " it had when the copy began");
    return hash.hex();
}

}  // namespace cellblock
