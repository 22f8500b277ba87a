// Two threads and a ring of small buffers: the copier moves a slot's worth of
// the source to the destination (in the kernel, copy_file_range) and reads
// what landed back into the slot; the caller's thread hashes the slot right
// after, while it is still in the cache, and frees it. Where the kernel
// cannot copy (another file system, an O_APPEND or write-only destination)
// the copier reads the source into the slot and writes it from there, and
// the digest is of the bytes written. sha256 is the slower half (about 1.8
// GB/s with SHA-NI here; the copy and the read-back several times that), so
// a transfer takes about one hash pass over data in the cache: 1.40-1.71
// GB/s (1.6 typical) against 1.24-1.45 for a whole step copied and then
// hashed back from the page cache (docs/performance.md).
#include "file_copy.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <thread>
#include <vector>

#include "file_transfer_internal.hpp"

namespace cellblock {
using namespace transfer_detail;

namespace {

// A slot small enough that the copier's write and the hasher's read find it
// in the cache (1 MiB slots ran at 1.2 GB/s here, 64-256 KiB at 1.65-1.73).
constexpr std::size_t kSlot = 256u << 10;
constexpr std::size_t kSlots = 8;
constexpr std::uint64_t kStepBytes = 8u << 20;  // between on_step calls

// A copy, read-back or write the kernel refused, with its errno.
struct StepFailed {
    int err;
};

void write_at(int fd, const char* data, std::size_t length, std::uint64_t offset) {
    std::size_t written = 0;
    while (written < length) {
        const ssize_t n =
            ::pwrite(fd, data + written, length - written, static_cast<off_t>(offset + written));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throw StepFailed{n < 0 ? errno : EIO};
        written += static_cast<std::size_t>(n);
    }
}

// One slot's bytes at `at`: copied in the kernel and read back into `slot`
// while `in_kernel`, else read into `slot` and written from it. Returns how
// many (fewer than `length` only at the source's end).
std::size_t move_slot(int src, int dst, std::uint64_t at, char* slot, std::size_t length,
                      bool& in_kernel) {
    if (in_kernel) {
        loff_t in = static_cast<loff_t>(at), out = static_cast<loff_t>(at);
        std::size_t moved = 0;
        while (in_kernel && moved < length) {
            const ssize_t n = ::copy_file_range(src, &in, dst, &out, length - moved, 0);
            if (n < 0 && errno == EINTR) continue;
            if (n == 0) break;  // the source's end
            if (n > 0) {
                moved += static_cast<std::size_t>(n);
            } else if (moved == 0 && (errno == EXDEV || errno == EINVAL || errno == EOPNOTSUPP ||
                                      errno == ENOSYS || errno == EBADF)) {
                in_kernel = false;  // EBADF too: an O_APPEND destination
            } else {
                throw StepFailed{errno};
            }
        }
        if (in_kernel) {
            if (read_into(dst, at, slot, moved) != moved) throw StepFailed{EIO};
            return moved;
        }
    }
    const std::size_t got = read_into(src, at, slot, length);
    write_at(dst, slot, got, at);
    return got;
}

// What the two threads share. `filled` counts the slots written (the copier
// publishes each), `hashed` the slots hashed and free again. Each side waits
// on a ticket the other moves whenever it publishes, and once more when it
// ends, so that an end which publishes nothing still wakes the waiter.
struct Ring {
    std::vector<char> bytes = std::vector<char>(kSlot * kSlots);
    std::array<std::size_t, kSlots> sizes{};
    std::atomic<std::uint64_t> filled{0}, hashed{0};
    std::atomic<std::uint32_t> filled_ticket{0}, hashed_ticket{0};
    std::atomic<bool> finished{false};  // the copier is done; its results below
    int error = 0;                      // errno of a failed write or read
    bool short_source = false;

    char* slot(std::uint64_t k) { return bytes.data() + (k % kSlots) * kSlot; }
    static void tick(std::atomic<std::uint32_t>& ticket) {
        ticket.fetch_add(1, std::memory_order_release);
        ticket.notify_one();
    }
};

void copy_all(int src, int dst, std::uint64_t size, CopyControl& control, Ring& ring) {
    std::uint64_t at = 0, k = 0;
    // The kernel's copy needs the destination read back: open for reading too.
    const int flags = ::fcntl(dst, F_GETFL);
    bool in_kernel = flags >= 0 && (flags & O_ACCMODE) == O_RDWR && !(flags & O_APPEND);
    try {
        while (at < size && !control.cancel.load(std::memory_order_relaxed)) {
            // A free slot: at most kSlots ahead of the hash.
            const std::uint32_t ticket = ring.hashed_ticket.load(std::memory_order_acquire);
            if (k - ring.hashed.load(std::memory_order_acquire) >= kSlots) {
                ring.hashed_ticket.wait(ticket, std::memory_order_acquire);
                continue;
            }
            char* slot = ring.slot(k);
            const std::size_t want =
                static_cast<std::size_t>(std::min<std::uint64_t>(kSlot, size - at));
            const std::size_t got = move_slot(src, dst, at, slot, want, in_kernel);
            if (got > 0) {
                ring.sizes[k % kSlots] = got;
                at += got;
                ++k;
                ring.filled.store(k, std::memory_order_release);
                Ring::tick(ring.filled_ticket);
            }
            if (got < want) {
                ring.short_source = true;
                break;
            }
        }
    } catch (const StepFailed& e) {
        ring.error = e.err;
    } catch (const FileRequestError&) {
        ring.error = EIO;
    }
    ring.finished.store(true, std::memory_order_release);
    Ring::tick(ring.filled_ticket);
}

}  // namespace

std::string copy_and_hash(int src, int dst, std::uint64_t size, CopyControl& control,
                          const std::function<void()>& on_step) {
    Ring ring;
    Sha256 hash;
    std::uint64_t hashed_bytes = 0, k = 0, reported = 0;
    {
        std::jthread copier([&] { copy_all(src, dst, size, control, ring); });
        // Before the copier is joined, whatever happens here: it may wait for
        // a slot, so it is woken (and told to stop, unless the hash is done).
        struct Release {
            Ring& ring;
            CopyControl& control;
            bool done = false;
            ~Release() {
                if (!done) control.cancel = true;
                Ring::tick(ring.hashed_ticket);
            }
        } release{ring, control};
        for (;;) {
            // Read the ticket before what it guards: a publish after this load moves it.
            const std::uint32_t ticket = ring.filled_ticket.load(std::memory_order_acquire);
            if (ring.filled.load(std::memory_order_acquire) == k) {
                if (ring.finished.load(std::memory_order_acquire)) {
                    if (ring.filled.load(std::memory_order_acquire) == k) break;
                } else {
                    ring.filled_ticket.wait(ticket, std::memory_order_acquire);
                }
                continue;
            }
            const std::size_t n = ring.sizes[k % kSlots];
            hash.update(std::string_view(ring.slot(k), n));
            hashed_bytes += n;
            ++k;
            ring.hashed.store(k, std::memory_order_release);
            Ring::tick(ring.hashed_ticket);
            control.done.store(hashed_bytes, std::memory_order_relaxed);
            if (on_step && (hashed_bytes - reported >= kStepBytes || hashed_bytes == size)) {
                reported = hashed_bytes;
                on_step();
            }
        }
        release.done = true;
    }
    if (ring.error != 0) {
        const int err = ring.error;
        if (err == ENOSPC || err == EDQUOT)
            throw FileRequestError(
                ename::FileTooLarge,
                "the disk filled after " + bytes_text(hashed_bytes) + " of " + bytes_text(size));
        throw FileRequestError(ename::FileError,
                               "copy after " + bytes_text(hashed_bytes) + ": " + errno_text(err));
    }
    if (control.cancel.load())
        throw FileRequestError(ename::FileError, "cancelled after " + bytes_text(hashed_bytes) +
                                                     " of " + bytes_text(size));
    if (ring.short_source || hashed_bytes != size)
        throw FileRequestError(ename::FileChanged,
                               "the source ended after " + bytes_text(hashed_bytes) + " of the " +
                                   bytes_text(size) + " it had when the copy began");
    return hash.hex();
}

}  // namespace cellblock
