// Files in and out of a session, in bounded chunks: an upload lands in
// /data/input whole or not at all (sha256 checked, renamed into place), a download reads
// /data/output piece by piece. No ZMQ here: the manager hands requests in as JSON and bytes, and
// sends back what this returns.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "cellblock/unique_fd.hpp"

namespace cellblock {

// A refused file request: a stable ename and an evalue with the numbers.
class FileRequestError : public std::runtime_error {
  public:
    FileRequestError(std::string ename, const std::string& evalue)
        : std::runtime_error(evalue), ename_(std::move(ename)) {}
    const std::string& ename() const { return ename_; }

  private:
    std::string ename_;
};

struct FileTransferLimits {
    std::uint64_t max_file_bytes = 16ull << 30;    // one file, streamed (the server's maximum)
    std::uint64_t max_inline_bytes = 64ull << 20;  // one file in one message (file_put/file_get)
    std::size_t chunk_bytes = 4u << 20;            // offered to clients
    std::size_t max_chunk_bytes = 8u << 20;        // the largest chunk accepted or sent
    std::size_t max_transfers = 16;                // open uploads + downloads, server-wide
    std::size_t max_session_transfers = 4;         // of them, per session
    std::chrono::seconds idle_timeout{120};        // an untouched transfer is dropped
};

// What a transfer needs to know of its session.
struct SessionFiles {
    std::string session_id;
    std::filesystem::path input_dir;    // mounted read-only at /data/input
    std::filesystem::path output_dir;   // mounted at /data/output (hostile: the code writes it)
    std::filesystem::path partial_dir;  // beside them, never mounted: uploads in progress
    std::uint64_t input_cap_bytes = 0;  // disk_mb: all files put in /data/input together
};

// A relative path inside `prefix` (/data/input or /data/output), checked as
// text: no absolute path, no "..", no empty or "." components, no NUL. A
// leading "<prefix>/" is taken off. Throws FileRequestError("InvalidPath").
std::string checked_relative_path(std::string path, const std::string& prefix);

// file_list_request: the regular files beneath the output dir, walked
// without following a symlink (the code writes it: everything is hostile),
// at most `max_files` of them and `max_depth` directories deep:
// {"status": "ok", "files": [{"path", "size", "mtime"}], "truncated"}.
nlohmann::json list_output_files(const SessionFiles& session, std::size_t max_files = 1000,
                                 int max_depth = 8);

class FileTransfers {
  public:
    using Clock = std::chrono::steady_clock;

    explicit FileTransfers(FileTransferLimits limits = {});
    ~FileTransfers();
    FileTransfers(const FileTransfers&) = delete;
    FileTransfers& operator=(const FileTransfers&) = delete;

    // The answer to one manager request: the reply's content and buffers,
    // and an audit event (kind, detail) when a file was put.
    struct Reply {
        nlohmann::json content;
        std::vector<std::string> buffers;
        std::optional<std::pair<std::string, std::string>> event;
        // A file the put replaced, to unlink once the reply is out (local copies).
        std::filesystem::path discard;
    };
    // The msg_types handled here (file_put_request, file_put_begin_request, ...).
    static const std::vector<std::string>& request_types();
    // Handles one request of a live session; throws FileRequestError.
    // `buffers` are views of the received frames (written from, never copied).
    Reply handle(std::string_view msg_type, const nlohmann::json& content,
                 std::span<const std::string_view> buffers, const SessionFiles& session,
                 Clock::time_point now);
    Reply handle(std::string_view msg_type, const nlohmann::json& content,
                 const std::vector<std::string>& buffers, const SessionFiles& session,
                 Clock::time_point now);

    // A copy the local file socket makes (local_files.cpp) from or into a
    // descriptor a client on this host passed: checked and counted against
    // the caps like a streamed transfer, and its bytes moved by another
    // thread with these descriptors (its own duplicates).
    struct LocalCopy {
        std::string id;
        std::string sandbox_path;  // /data/input/... or /data/output/...
        std::uint64_t size = 0;
        UniqueFd src, dst;
    };
    // file_put_local_request: `client_file` is read from offset 0 to its
    // current end into a new partial file beneath the session's input.
    LocalCopy begin_local_put(const nlohmann::json& content, int client_file,
                              const SessionFiles& session, Clock::time_point now);
    // file_get_local_request: the session's output file is written into
    // `client_file` (cut to length 0 first), which must be open for writing.
    LocalCopy begin_local_get(const nlohmann::json& content, int client_file,
                              const SessionFiles& session, Clock::time_point now);
    // The copy `id` landed and its bytes hash to `sha256`: an upload is
    // checked against the digest the client declared, if any, and renamed
    // into place; a download is checked to be one version of its file.
    // Throws FileRequestError; the transfer is gone either way.
    Reply finish_local(const std::string& id, const std::string& sha256, const SessionFiles& s);
    // The copy failed or was cancelled: its reservation (and partial) goes.
    void abort_local(const std::string& id);

    // Drops transfers untouched for idle_timeout (an upload's partial is removed).
    void expire(Clock::time_point now);
    // The session is gone: its transfers end, its input count is forgotten.
    void session_closed(const std::string& session_id);

    std::size_t open_transfers() const;
    std::uint64_t input_bytes(const std::string& session_id) const;
    const FileTransferLimits& limits() const { return limits_; }

  private:
    struct Upload;
    struct Download;

    nlohmann::json put_begin(const nlohmann::json& c, const SessionFiles& s, Clock::time_point now);
    nlohmann::json put_chunk(const nlohmann::json& c, std::span<const std::string_view> buffers,
                             const SessionFiles& s, Clock::time_point now);
    Reply put_commit(const nlohmann::json& c, const SessionFiles& s);
    Reply put_whole(const nlohmann::json& c, std::span<const std::string_view> buffers,
                    const SessionFiles& s);
    nlohmann::json get_begin(const nlohmann::json& c, const SessionFiles& s, Clock::time_point now);
    Reply get_chunk(const nlohmann::json& c, const SessionFiles& s, Clock::time_point now);
    Reply get_whole(const nlohmann::json& c, const SessionFiles& s);

    void check_room(const SessionFiles& s, std::uint64_t size, std::uint64_t replacing,
                    const Upload* resumed) const;
    void check_capacity(const std::string& session_id) const;
    // The record of a new upload of `path`, with its partial file created and
    // the size reserved (not yet in uploads_).
    std::unique_ptr<Upload> new_upload(const std::string& path, std::uint64_t size,
                                       const std::string& sha256, const SessionFiles& s,
                                       Clock::time_point now);
    // The record of a new download of the output `path`, opened beneath the
    // output dir and checked against the caps (not yet in downloads_).
    std::unique_ptr<Download> new_download(const std::string& path, const SessionFiles& s,
                                           Clock::time_point now);
    Upload& upload_of(const nlohmann::json& c, const SessionFiles& s);
    Download& download_of(const nlohmann::json& c, const SessionFiles& s);
    // Moves a complete partial into place beneath the input dir. A file it
    // replaces is swapped out whole (RENAME_EXCHANGE) to the partial's path,
    // which is returned (empty when nothing was replaced) for the caller to
    // unlink: freeing a GiB file takes ~65 ms, better paid after the reply.
    std::filesystem::path install(const SessionFiles& s, Upload& upload);
    void drop_upload(const std::string& id);
    Reply finish_local_put(Upload& upload, const std::string& sha256, const SessionFiles& s);
    Reply finish_local_get(Download& download, const std::string& sha256);

    FileTransferLimits limits_;
    std::map<std::string, std::unique_ptr<Upload>> uploads_;
    std::map<std::string, std::unique_ptr<Download>> downloads_;
    std::map<std::string, std::uint64_t> input_bytes_;  // committed, per session
};

}  // namespace cellblock
