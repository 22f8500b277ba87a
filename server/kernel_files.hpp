// Files of a session whose sandbox has no directory on this host (a Swarm
// task on another node, docs/scale-out.md): the front keeps each file it
// moves in a staging copy of its own (the SessionFiles FileTransfers works
// on, so caps, resumption and progress are the local ones), and moves the
// bytes between that copy and the kernel over the kernel's control channel,
// one chunk per request and reply (kernel-shim/cellblock_ipykernel.py,
// KernelFiles). That channel is the one the front already speaks to the
// kernel, signed with the inner key and, on Swarm, CurveZMQ: no new port, no
// client key on a node. No ZMQ here: a request goes out through AskKernel.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "file_transfer.hpp"

namespace cellblock {

// The kernel's message types (kernel-shim/README.md, "Files over control").
inline constexpr const char* kKernelFileWrite = "cellblock_file_write_request";
inline constexpr const char* kKernelFileRead = "cellblock_file_read_request";
inline constexpr const char* kKernelFileList = "cellblock_file_list_request";
inline constexpr const char* kKernelFileAbort = "cellblock_file_abort_request";

// A reply of the kernel to one of them.
struct KernelAnswer {
    nlohmann::json content;
    std::vector<std::string> buffers;
};
// What becomes of a request: its reply, or null when none will come (the
// session closed, its kernel is gone, or it did not answer in time).
using KernelAnswered = std::function<void(const KernelAnswer* answer)>;
// Sends one request on the kernel's control channel; false when it could not
// be sent (no kernel attached): then `answered` is never called.
using AskKernel = std::function<bool(const std::string& msg_type, nlohmann::json content,
                                     std::vector<std::string> buffers, KernelAnswered answered)>;

// How a move ended: nullopt, or why not (the client's ename and evalue).
using KernelFilesDone = std::function<void(std::optional<FileRequestError> error)>;

// A piece of a file per request (the kernel's control socket takes frames up
// to the relay's 64 MiB), and at most kKernelFileWindow of them in flight per
// move: the kernel's side, the wire and the front's side work at once, while
// what waits in the kernel's sockets for one move stays at 16 MiB.
inline constexpr std::size_t kKernelFileChunk = 4u << 20;
inline constexpr int kKernelFileWindow = 4;

// Copies `local` (a staged upload) to `path` beneath the kernel's
// /data/input; done once the kernel renamed it into place and its sha256 of
// what it wrote is the front's of what it sent.
void push_to_kernel(AskKernel ask, std::filesystem::path local, std::string path,
                    KernelFilesDone done);

// Copies `path` beneath the kernel's /data/output to `local` (written beside
// it as `local` + ".pull-<transfer>", renamed when whole and its sha256 is the kernel's
// of what it read); FileTooLarge, and nothing kept, past `max_bytes`
// (`over_what` names that limit for the client).
void pull_from_kernel(AskKernel ask, std::string path, std::filesystem::path local,
                      std::uint64_t max_bytes, std::string over_what, KernelFilesDone done);

// The kernel's listing of its /data/output, checked: file_list_request's
// reply ({"status": "ok", "files": [{path, size, mtime}], "truncated"}), or
// the error.
void list_kernel_files(
    AskKernel ask,
    std::function<void(nlohmann::json reply, std::optional<FileRequestError> error)> done);

}  // namespace cellblock
