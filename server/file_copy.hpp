// One file copied into another while it is hashed: a thread copies a slot at
// a time (in the kernel, reading what landed back into the slot; or read and
// written through the slot where the kernel cannot), the caller's thread
// hashes each slot right after, while it is in the cache. The digest is of
// what landed, and the copy and the hash run on two cores at once. Used by the
// local file socket (local_files.cpp), where a client on this host hands the
// server a descriptor instead of streaming the bytes. No sockets, no session here.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

namespace cellblock {

struct CopyControl {
    std::atomic<bool> cancel{false};     // set by anyone: the copy stops at its next step
    std::atomic<std::uint64_t> done{0};  // bytes copied and hashed so far
};

// Copies `size` bytes from offset 0 of `src` to offset 0 of `dst` and returns
// the lowercase sha256 of what `dst` then holds (read back when `dst` is open
// for reading too, else of the bytes written to it). `on_step` is called from the
// calling thread after every few MiB and at the end. Throws FileRequestError:
// FileChanged when `src` ends before `size` bytes, FileTooLarge when the disk
// fills, FileError when control.cancel is set ("cancelled") or on any other failure.
std::string copy_and_hash(int src, int dst, std::uint64_t size, CopyControl& control,
                          const std::function<void()>& on_step = {});

}  // namespace cellblock
