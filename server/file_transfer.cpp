#include "file_transfer_internal.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace transfer_detail;

std::string checked_relative_path(std::string path, const std::string& prefix) {
    if (path.rfind(prefix + "/", 0) == 0) path = path.substr(prefix.size() + 1);
    if (path.empty() || path.size() > 4096 || path[0] == '/' ||
        path.find('\0') != std::string::npos) {
        throw FileRequestError(ename::InvalidPath,
                               "path '" + path + "' must be relative to " + prefix);
    }
    std::size_t start = 0;
    while (start <= path.size()) {
        const std::size_t end = std::min(path.find('/', start), path.size());
        const std::string part = path.substr(start, end - start);
        if (part.empty() || part == "." || part == ".." || part.size() > 255) {
            throw FileRequestError(ename::InvalidPath,
                                   "path '" + path + "' leaves " + prefix + " or is not normal");
        }
        start = end + 1;
    }
    return path;
}

FileTransfers::FileTransfers(FileTransferLimits limits) : limits_(limits) {}

FileTransfers::~FileTransfers() {
    std::vector<std::string> ids;
    for (const auto& [id, upload] : uploads_) ids.push_back(id);
    for (const auto& id : ids) drop_upload(id);
}

const std::vector<std::string>& FileTransfers::request_types() {
    static const std::vector<std::string> types = {
        "file_put_request",       "file_get_request",        "file_put_begin_request",
        "file_put_chunk_request", "file_put_commit_request", "file_put_abort_request",
        "file_get_begin_request", "file_get_chunk_request",  "file_get_end_request",
        "file_list_request"};
    return types;
}

FileTransfers::Reply FileTransfers::handle(std::string_view t, const json& c,
                                           const std::vector<std::string>& buffers,
                                           const SessionFiles& s, Clock::time_point now) {
    const std::vector<std::string_view> views(buffers.begin(), buffers.end());
    return handle(t, c, std::span<const std::string_view>(views), s, now);
}

FileTransfers::Reply FileTransfers::handle(std::string_view t, const json& c,
                                           std::span<const std::string_view> buffers,
                                           const SessionFiles& s, Clock::time_point now) {
    if (!c.is_object()) throw FileRequestError(ename::InvalidRequest, "content must be an object");
    if (t == "file_put_request") return put_whole(c, buffers, s);
    if (t == "file_get_request") return get_whole(c, s);
    if (t == "file_put_begin_request") return {put_begin(c, s, now), {}, {}, {}};
    if (t == "file_put_chunk_request") return {put_chunk(c, buffers, s, now), {}, {}, {}};
    if (t == "file_put_commit_request") return put_commit(c, s);
    if (t == "file_put_abort_request") {
        drop_upload(upload_of(c, s).id);
        return {{{"status", "ok"}}, {}, {}, {}};
    }
    if (t == "file_get_begin_request") return {get_begin(c, s, now), {}, {}, {}};
    if (t == "file_get_chunk_request") return get_chunk(c, s, now);
    if (t == "file_get_end_request") {
        const std::string id = download_of(c, s).id;  // a copy: the key dies with the node
        downloads_.erase(id);
        return {{{"status", "ok"}}, {}, {}, {}};
    }
    if (t == "file_list_request") return {list_output_files(s), {}, {}, {}};
    throw FileRequestError(ename::UnknownRequest, "not a file request: " + std::string(t));
}

// ------------------------------------------------------------------ housekeeping

void FileTransfers::expire(Clock::time_point now) {
    std::vector<std::string> stale;
    // A local copy is not idle while its thread runs: it ends with finish_local or abort_local.
    for (const auto& [id, u] : uploads_) {
        if (!u->local && now - u->touched >= limits_.idle_timeout) stale.push_back(id);
    }
    for (const auto& id : stale) drop_upload(id);
    std::erase_if(downloads_, [&](const auto& entry) {
        return !entry.second->local && now - entry.second->touched >= limits_.idle_timeout;
    });
}

void FileTransfers::session_closed(const std::string& session_id) {
    std::vector<std::string> ids;
    for (const auto& [id, u] : uploads_) {
        if (u->session_id == session_id) ids.push_back(id);
    }
    for (const auto& id : ids) drop_upload(id);
    std::erase_if(downloads_,
                  [&](const auto& entry) { return entry.second->session_id == session_id; });
    input_bytes_.erase(session_id);
}

FileTransfers::Reply FileTransfers::finish_local(const std::string& id, const std::string& sha256,
                                                 const SessionFiles& s) {
    if (const auto up = uploads_.find(id); up != uploads_.end() && up->second->local)
        return finish_local_put(*up->second, sha256, s);
    if (const auto down = downloads_.find(id); down != downloads_.end() && down->second->local)
        return finish_local_get(*down->second, sha256);
    throw FileRequestError(ename::TransferNotFound, "the copy " + id + " ended with its session");
}

void FileTransfers::abort_local(const std::string& id) {
    drop_upload(id);
    downloads_.erase(id);
}

std::size_t FileTransfers::open_transfers() const { return uploads_.size() + downloads_.size(); }

std::uint64_t FileTransfers::input_bytes(const std::string& session_id) const {
    const auto it = input_bytes_.find(session_id);
    return it == input_bytes_.end() ? 0 : it->second;
}

}  // namespace cellblock
