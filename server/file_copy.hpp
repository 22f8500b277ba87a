// One file copied into another inside the kernel (copy_file_range, with a
// read/write fallback where the kernel cannot), while a second thread hashes
// the destination behind the copy: the digest is of the bytes that landed,
// and the copy and the hash run on two cores at once. Used by the local file
// socket (local_files.cpp), where a client on this host hands the server a
// descriptor instead of streaming the bytes. No sockets, no session here.
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
// the lowercase sha256 of what `dst` then holds (read back from `dst`, which
// must be open for reading too). `on_step` is called from the calling thread
// after each step (every few MiB). `dst_is_private`: nobody but the caller can
// change `dst` (the server's own partial file), so it is hashed through a
// mapping instead of being read into a buffer. Throws FileRequestError:
// FileChanged when `src` ends before `size` bytes, FileTooLarge when the disk
// fills, FileError when control.cancel is set ("cancelled") or on any other failure.
std::string copy_and_hash(int src, int dst, std::uint64_t size, CopyControl& control,
                          const std::function<void()>& on_step = {}, bool dst_is_private = false);

}  // namespace cellblock
