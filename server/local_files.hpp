// The local file socket, STATE_DIR/files.sock: a client on this host puts or
// gets a file by passing its descriptor (SCM_RIGHTS) with one signed request
// instead of streaming the bytes through the manager socket. The bytes then
// move inside the kernel (file_copy.hpp) on a thread of their own, hashed once,
// while the loop goes on. What is here: its limits and the per-connection
// record (the datagram packing is wire_message.hpp's); the handling is
// Server's (local_files.cpp).
//
// A connection carries one request, in one SOCK_SEQPACKET datagram: the
// manager message's frames (the delimiter first, no identities), packed as
// [u32 count][u32 size, bytes]... (little-endian), and one descriptor. The
// server answers with signed messages in the same packing: file_progress
// {done, size} as the copy goes, then the reply; then it closes.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cellblock/unique_fd.hpp"
#include "cellblock/wire_message.hpp"
#include "event_loop.hpp"
#include "file_copy.hpp"
#include "file_transfer.hpp"

namespace cellblock {

inline constexpr std::size_t kLocalRequestBytes = 64u << 10;  // one request datagram, at most
inline constexpr std::size_t kLocalMaxClients = 64;
inline constexpr auto kLocalRequestWait = std::chrono::seconds(10);  // connect to request
inline constexpr std::uint64_t kLocalProgressBytes = 64u << 20;      // between progress messages

inline std::filesystem::path local_files_socket(const std::filesystem::path& state_dir) {
    return state_dir / "files.sock";
}

// One copy under way: its thread, and what it left when it ended.
struct LocalCopyJob {
    FileTransfers::LocalCopy copy;
    std::string session_id;
    CopyControl control;
    std::atomic<bool> finished{false};
    std::string sha256;          // when it ended well
    std::string ename, evalue;   // when it did not
    std::uint64_t reported = 0;  // bytes the last progress message said
    std::jthread thread;         // last: joined before the rest goes

    // Starts the thread; it writes 1 to `wake` (an eventfd) after each step and at the end.
    void start(int wake);
    ~LocalCopyJob();
};

struct LocalClient {
    UniqueFd socket;
    EventLoop::WatchId watch = 0;
    EventLoop::Clock::time_point opened;
    std::optional<WireMessage> request;  // once it came
    std::unique_ptr<LocalCopyJob> job;   // once it started
    bool gone = false;                   // the client hung up mid-copy
};

}  // namespace cellblock
