// Snapshots at rest (docs/hibernation.md, "Storage"): every file a
// hibernated session leaves on the host is sealed with AES-256-GCM under a
// key of that session's that only the server's memory holds, so a copied
// state dir reveals nothing and a changed byte is refused, not restored.
//
// A sealed file (format 2, written since 2026-12-04): "CBSEAL2\n", a
// 12-byte random nonce, then the content in chunks of 1 MiB, each sealed on
// its own with GCM's 16-byte tag after it; the last chunk is shorter than
// 1 MiB (empty when the content is a whole number of chunks). Chunk i's
// nonce is the file's with its last 8 bytes xored with i, and its
// additional data names what the file is (the session and the file's place
// in the snapshot), then i and whether it is the last: a sealed file moved
// to another name or session, chunks swapped, or a file cut at a chunk's
// end all fail their check like a damaged one. Chunks open on several
// threads at once (a wake waits on the opening). Format 1 ("CBSEAL1\n", a
// nonce, one GCM stream over the whole content, its tag) is still opened:
// a session hibernated by an earlier server wakes under this one; seal()
// and open_sealed() (in memory) keep to it.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace cellblock {

class SnapshotKey {
  public:
    SnapshotKey();  // fresh random bytes (RAND_bytes)
    // These 32 bytes (a key kept elsewhere: the server key, a wrapped one);
    // std::invalid_argument for any other length.
    explicit SnapshotKey(std::string_view bytes);
    ~SnapshotKey();  // wiped (OPENSSL_cleanse)
    SnapshotKey(const SnapshotKey&) = delete;
    SnapshotKey& operator=(const SnapshotKey&) = delete;
    const unsigned char* bytes() const { return key_.data(); }
    static constexpr std::size_t kBytes = 32;

  private:
    std::array<unsigned char, 32> key_{};
};

// A sealed file's chunk (of content), header and tag.
inline constexpr std::uint64_t kSealChunk = 1 << 20, kSealHeader = 8 + 12, kSealTag = 16;
// The least a sealed file adds to its content: its header and its last
// chunk's tag (each whole chunk before that adds a tag more: sealed_size).
inline constexpr std::uint64_t kSealOverhead = kSealHeader + kSealTag;
// The size of `plain` bytes sealed by seal_stream() or seal_from().
constexpr std::uint64_t sealed_size(std::uint64_t plain) {
    return kSealHeader + plain + (plain / kSealChunk + 1) * kSealTag;
}

// Reads `in` to its end and writes it sealed to `out`; returns the plain
// bytes read. Throws std::runtime_error naming what failed.
std::uint64_t seal_stream(int in, int out, const SnapshotKey& key, const std::string& label);

// Where seal_from() reads: up to `n` bytes into `data`, fewer only at the
// end (a file still being written waits for more; session_snapshots.cpp).
using SealSource = std::function<std::size_t(unsigned char* data, std::size_t n)>;
// seal_stream() from `read`. Either has the disk keep what it wrote every
// 16 MiB (fdatasync on a thread of its own), so that the keeper's fsync at
// the end finds little left to write or flush.
std::uint64_t seal_from(const SealSource& read, int out, const SnapshotKey& key,
                        const std::string& label);

// Reads a sealed `in` (the whole file from its start, formats 1 and 2) and writes its
// content to `out`; returns the bytes written. A format 2 file into a
// seekable `out` is opened by as many threads as the host has cores (at
// most 4), each writing its chunks at their place, in order: `out` holds a
// whole prefix of the content at any time, each chunk checked before it is
// written (a reader may follow it). Throws std::runtime_error when the file is not
// sealed, is cut short, or fails its check (changed on disk, another key or
// label); what was written to `out` by then must be thrown away by the
// caller.
std::uint64_t open_sealed_stream(int in, int out, const SnapshotKey& key, const std::string& label);

// The content's size of the sealed file `in` when it is of format 2, whose
// opening a reader may follow (above); std::nullopt for format 1, whose one
// tag is checked only at its end. Reads the header at the file's start (pread:
// `in` does not move). Throws as open_sealed_stream does when `in` is no
// sealed file or was cut inside a chunk.
std::optional<std::uint64_t> followable_plain_size(int in);

// The same format in memory: `plain` sealed, and opened again (the
// handover's rows, docs/restarts.md). open_sealed throws as
// open_sealed_stream does.
std::string seal(std::string_view plain, const SnapshotKey& key, const std::string& label);
std::string open_sealed(std::string_view sealed, const SnapshotKey& key, const std::string& label);

}  // namespace cellblock
