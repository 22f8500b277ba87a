// Snapshots at rest (docs/hibernation.md, "Storage"): every file a
// hibernated session leaves on the host is sealed with AES-256-GCM under a
// key of that session's that only the server's memory holds, so a copied
// state dir reveals nothing and a changed byte is refused, not restored.
//
// A sealed file: "CBSEAL1\n", a 12-byte random nonce, the ciphertext, and
// GCM's 16-byte tag. The additional data names what the file is (the
// session and the file's place in the snapshot), so a sealed file moved to
// another name or session fails its check like a damaged one.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
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

// The bytes a sealed file adds to its content.
inline constexpr std::uint64_t kSealOverhead = 8 + 12 + 16;

// Reads `in` to its end and writes it sealed to `out`; returns the plain
// bytes read. Throws std::runtime_error naming what failed.
std::uint64_t seal_stream(int in, int out, const SnapshotKey& key, const std::string& label);

// Where seal_from() reads: up to `n` bytes into `data`, fewer only at the
// end (a file still being written waits for more; session_snapshots.cpp).
using SealSource = std::function<std::size_t(unsigned char* data, std::size_t n)>;
// seal_stream() from `read`. Either starts the disk writing what it wrote
// every 32 MiB (sync_file_range), so that the keeper's fsync at the end
// finds little left to write.
std::uint64_t seal_from(const SealSource& read, int out, const SnapshotKey& key,
                        const std::string& label);

// Reads a sealed `in` and writes its content to `out`; returns the bytes
// written. Throws std::runtime_error when the file is not sealed, is cut
// short, or fails its check (changed on disk, another key or label); what
// was written to `out` by then must be thrown away by the caller.
std::uint64_t open_sealed_stream(int in, int out, const SnapshotKey& key, const std::string& label);

// The same format in memory: `plain` sealed, and opened again (the
// handover's rows, docs/restarts.md). open_sealed throws as
// open_sealed_stream does.
std::string seal(std::string_view plain, const SnapshotKey& key, const std::string& label);
std::string open_sealed(std::string_view sealed, const SnapshotKey& key, const std::string& label);

}  // namespace cellblock
