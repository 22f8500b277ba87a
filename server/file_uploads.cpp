// Uploads: begun, written chunk by chunk (hashed as they come), committed
// whole (renamed into place) or not at all; resumable by offset.
#include "file_transfer_internal.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace transfer_detail;

void FileTransfers::check_capacity(const std::string& session_id) const {
    std::size_t of_session = 0;
    for (const auto& [id, u] : uploads_) of_session += u->session_id == session_id;
    for (const auto& [id, d] : downloads_) of_session += d->session_id == session_id;
    if (of_session >= limits_.max_session_transfers) {
        throw FileRequestError(ename::TooManyTransfers,
                               "the session has " + std::to_string(of_session) +
                                   " transfers open, its maximum; finish or abort one first");
    }
    if (open_transfers() >= limits_.max_transfers) {
        throw FileRequestError(
            ename::TooManyTransfers,
            "the server has " + std::to_string(open_transfers()) + " transfers open, its maximum");
    }
}

void FileTransfers::check_room(const SessionFiles& s, std::uint64_t size, std::uint64_t replacing,
                               const Upload* resumed) const {
    if (size > limits_.max_file_bytes) {
        throw FileRequestError(ename::FileTooLarge, "the file is " + bytes_text(size) +
                                                        ", over the server's maximum of " +
                                                        bytes_text(limits_.max_file_bytes));
    }
    std::uint64_t pending = 0;
    for (const auto& [id, u] : uploads_) {
        if (u->session_id == s.session_id && u.get() != resumed) pending += u->size;
    }
    const std::uint64_t held =
        input_bytes(s.session_id) - std::min(replacing, input_bytes(s.session_id));
    if (held + pending + size > s.input_cap_bytes) {
        throw FileRequestError(ename::FileTooLarge,
                               "the file is " + bytes_text(size) +
                                   "; the session's input already holds " + bytes_text(held) +
                                   (pending ? " and " + bytes_text(pending) + " in uploads" : "") +
                                   ", and its cap is " + bytes_text(s.input_cap_bytes) +
                                   " (disk_mb " + std::to_string(s.input_cap_bytes >> 20) + ")");
    }
    const std::uint64_t needed = size - (resumed ? resumed->received : 0);
    const std::uint64_t free = free_bytes(s.input_dir);
    if (needed > free) {
        throw FileRequestError(ename::FileTooLarge, "the file needs " + bytes_text(needed) +
                                                        " more, and the disk holding the session's "
                                                        "input has " +
                                                        bytes_text(free) + " free");
    }
}

// The size of the regular file a put to `path` would replace, or 0.
static std::uint64_t size_of_existing(const SessionFiles& s, const std::string& path) {
    const FileDescriptor fd = open_beneath(s.input_dir, path, O_PATH);
    struct stat st {};
    if (!fd || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return 0;
    return static_cast<std::uint64_t>(st.st_size);
}

// A new partial file for upload `id`, read-write (a local copy reads back
// what landed, to hash it), with the declared size reserved: a full disk is
// found here, not at 90 %.
static FileDescriptor create_partial(const SessionFiles& s, const std::string& id,
                                     std::uint64_t size, fs::path& partial) {
    if (::mkdir(s.partial_dir.c_str(), 0700) != 0 && errno != EEXIST)
        throw FileRequestError(ename::FileError, "mkdir for uploads: " + errno_text());
    partial = s.partial_dir / id;
    FileDescriptor fd(::open(partial.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!fd) throw FileRequestError(ename::FileError, "create the upload: " + errno_text());
    if (size > 0 && ::fallocate(fd.get(), FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(size)) != 0) {
        const int err = errno;
        ::unlink(partial.c_str());
        if (err == ENOSPC || err == EDQUOT) {
            throw FileRequestError(ename::FileTooLarge, "the file is " + bytes_text(size) +
                                                            " and the disk holding the session's "
                                                            "input has " +
                                                            bytes_text(free_bytes(s.input_dir)) +
                                                            " free");
        }
        if (err != EOPNOTSUPP)
            throw FileRequestError(ename::FileError,
                                   "reserve " + bytes_text(size) + ": " + errno_text(err));
    }
    return fd;
}

std::unique_ptr<FileTransfers::Upload> FileTransfers::new_upload(const std::string& path,
                                                                 std::uint64_t size,
                                                                 const std::string& sha256,
                                                                 const SessionFiles& s,
                                                                 Clock::time_point now) {
    auto upload = std::make_unique<Upload>();
    upload->id = new_transfer_id();
    upload->session_id = s.session_id;
    upload->path = path;
    upload->size = size;
    upload->sha256 = sha256;
    upload->touched = now;
    upload->fd = create_partial(s, upload->id, size, upload->partial);
    return upload;
}

json FileTransfers::put_begin(const json& c, const SessionFiles& s, Clock::time_point now) {
    const std::string path = checked_relative_path(path_field(c), kSandboxInputDir);
    const std::uint64_t size = count_field(c, "size");
    // The digest may come now or with the commit (a client that hashes as it sends).
    const std::string sha256 = c.contains("sha256") ? sha256_field(c) : std::string();
    // The same file again (a client back after a dropped connection) resumes;
    // another file under the same name restarts cleanly.
    Upload* resumed = nullptr;
    const auto same_path = std::find_if(uploads_.begin(), uploads_.end(), [&](const auto& entry) {
        return entry.second->session_id == s.session_id && entry.second->path == path;
    });
    if (same_path != uploads_.end()) {
        Upload& earlier = *same_path->second;
        if (earlier.size == size &&
            (earlier.sha256 == sha256 || earlier.sha256.empty() || sha256.empty())) {
            if (earlier.sha256.empty()) earlier.sha256 = sha256;
            resumed = &earlier;
        } else {
            drop_upload(std::string(earlier.id));
        }
    }
    if (!resumed) check_capacity(s.session_id);
    check_room(s, size, size_of_existing(s, path), resumed);
    if (resumed) {
        resumed->touched = now;
        return {{"status", "ok"},
                {"upload_id", resumed->id},
                {"offset", resumed->received},
                {"resumed", true},
                {"chunk_bytes", limits_.chunk_bytes}};
    }

    std::unique_ptr<Upload> upload = new_upload(path, size, sha256, s, now);
    const std::string id = upload->id;
    uploads_.emplace(id, std::move(upload));
    return {{"status", "ok"},
            {"upload_id", id},
            {"offset", 0},
            {"resumed", false},
            {"chunk_bytes", limits_.chunk_bytes}};
}

FileTransfers::Upload& FileTransfers::upload_of(const json& c, const SessionFiles& s) {
    const std::string id = string_field(c, "upload_id");
    const auto it = uploads_.find(id);
    if (it == uploads_.end() || it->second->session_id != s.session_id || it->second->local) {
        throw FileRequestError(
            ename::TransferNotFound,
            "no upload " + id + " in this session (finished, aborted, or idle for " +
                std::to_string(limits_.idle_timeout.count()) + " s); begin again");
    }
    return *it->second;
}

json FileTransfers::put_chunk(const json& c, std::span<const std::string_view> buffers,
                              const SessionFiles& s, Clock::time_point now) {
    Upload& u = upload_of(c, s);
    const std::uint64_t offset = count_field(c, "offset");
    if (buffers.size() != 1) {
        throw FileRequestError(ename::InvalidRequest,
                               "file_put_chunk_request carries its bytes as exactly one buffer");
    }
    const std::string_view bytes = buffers[0];
    if (bytes.size() > limits_.max_chunk_bytes) {
        throw FileRequestError(ename::InvalidRequest,
                               "a chunk of " + bytes_text(bytes.size()) + " is over the " +
                                   bytes_text(limits_.max_chunk_bytes) + " a chunk may hold");
    }
    // Chunks arrive in order; the digest runs as they do, so a gap is refused.
    if (offset != u.received) {
        throw FileRequestError(ename::InvalidOffset, "the upload holds " + bytes_text(u.received) +
                                                         "; a chunk at offset " +
                                                         std::to_string(offset) +
                                                         " does not follow");
    }
    if (offset + bytes.size() > u.size) {
        throw FileRequestError(ename::FileTooLarge,
                               "a chunk ending at byte " + std::to_string(offset + bytes.size()) +
                                   " passes the declared size " + bytes_text(u.size));
    }
    // Written and hashed a slice at a time, in one pass: the slice the write
    // just read is still in the CPU's cache when the digest reads it again.
    // A failed write leaves the digest as it was, so the chunk can be sent again.
    constexpr std::size_t kSlice = 256u << 10;
    Sha256 before(u.hash);
    std::size_t written = 0, hashed = 0;
    while (written < bytes.size()) {
        const std::size_t slice = std::min(kSlice, bytes.size() - hashed);
        const ssize_t n = ::pwrite(u.fd.get(), bytes.data() + written, hashed + slice - written,
                                   static_cast<off_t>(offset + written));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            u.hash = std::move(before);
            const int err = errno;
            if (err == ENOSPC || err == EDQUOT) {
                throw FileRequestError(ename::FileTooLarge,
                                       "the disk holding the session's input filled after " +
                                           bytes_text(offset + written) + " of " +
                                           bytes_text(u.size) + " (" +
                                           bytes_text(free_bytes(s.input_dir)) + " free)");
            }
            throw FileRequestError(ename::FileError, "write the upload: " + errno_text(err));
        }
        written += static_cast<std::size_t>(n);
        if (written == hashed + slice) {
            u.hash.update(bytes.substr(hashed, slice));
            hashed = written;
        }
    }
    u.received += bytes.size();
    u.touched = now;
    return {{"status", "ok"}, {"upload_id", u.id}, {"received", u.received}};
}

fs::path FileTransfers::install(const SessionFiles& s, Upload& u) {
    // No fsync: the rename makes the file visible whole or not at all to the
    // sandbox, and nothing of a session outlives a server crash (the next start
    // reaps its directory), so durability would only cost the disk's write time
    // (7 s for 1 GiB here) on the server's one event loop.
    if (::fchmod(u.fd.get(), 0644) != 0)
        throw FileRequestError(ename::FileError, "chmod the upload: " + errno_text());
    // Parent folders, one component at a time; the input dir is the server's
    // alone (read-only in the sandbox), so nothing in it can be a symlink.
    std::size_t slash = 0;
    while ((slash = u.path.find('/', slash)) != std::string::npos) {
        const fs::path dir = s.input_dir / u.path.substr(0, slash);
        if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
            throw FileRequestError(ename::FileError,
                                   "mkdir " + u.path.substr(0, slash) + ": " + errno_text());
        }
        ++slash;
    }
    const auto cut = u.path.rfind('/');
    const std::string parent = cut == std::string::npos ? "." : u.path.substr(0, cut);
    const std::string name = cut == std::string::npos ? u.path : u.path.substr(cut + 1);
    const FileDescriptor parent_fd = open_beneath(s.input_dir, parent, O_RDONLY | O_DIRECTORY);
    if (!parent_fd)
        throw FileRequestError(ename::FileError, "open " + parent + ": " + errno_text());
    struct stat old {};
    const bool replaces = ::fstatat(parent_fd.get(), name.c_str(), &old, AT_SYMLINK_NOFOLLOW) == 0;
    if (replaces && S_ISDIR(old.st_mode)) {
        throw FileRequestError(ename::FileError,
                               std::string(kSandboxInputDir) + "/" + u.path + " is a directory");
    }
    const bool exchange = replaces && S_ISREG(old.st_mode);
    if (::renameat2(AT_FDCWD, u.partial.c_str(), parent_fd.get(), name.c_str(),
                    exchange ? RENAME_EXCHANGE : 0) != 0)
        throw FileRequestError(ename::FileError, "rename into " + u.path + ": " + errno_text());
    std::uint64_t& held = input_bytes_[s.session_id];
    if (exchange) held -= std::min<std::uint64_t>(held, old.st_size);
    held += u.size;
    return exchange ? u.partial : fs::path();
}

FileTransfers::Reply FileTransfers::put_commit(const json& c, const SessionFiles& s) {
    Upload& u = upload_of(c, s);
    const std::string id = u.id;
    if (u.received != u.size) {
        throw FileRequestError(ename::InvalidOffset, "the upload holds " + bytes_text(u.received) +
                                                         " of the declared " + bytes_text(u.size));
    }
    if (c.contains("sha256")) {
        const std::string declared = sha256_field(c);
        if (!u.sha256.empty() && declared != u.sha256) {
            throw FileRequestError(ename::InvalidRequest,
                                   "the commit's sha256 " + declared +
                                       " is not the one declared at begin, " + u.sha256);
        }
        u.sha256 = declared;
    }
    if (u.sha256.empty()) {
        throw FileRequestError(ename::InvalidRequest,
                               "sha256 is required, at file_put_begin_request or at the commit");
    }
    const std::string got = u.hash.hex();
    if (got != u.sha256) {
        const std::string evalue = "the " + bytes_text(u.size) + " received hash to sha256 " + got +
                                   ", not the declared " + u.sha256 + "; the upload is discarded";
        drop_upload(id);  // the digest is spent: the client starts over
        throw FileRequestError(ename::ChecksumMismatch, evalue);
    }
    try {
        if (const fs::path old = install(s, u); !old.empty()) ::unlink(old.c_str());
    } catch (...) {
        drop_upload(id);
        throw;
    }
    Reply reply{{{"status", "ok"},
                 {"path", std::string(kSandboxInputDir) + "/" + u.path},
                 {"size", u.size},
                 {"sha256", got}},
                {},
                std::make_pair(std::string("file_put"), u.path + " (" + bytes_text(u.size) +
                                                            ", sha256 " + got.substr(0, 12) + ")"),
                {}};
    u.fd.reset();
    uploads_.erase(id);
    return reply;
}

FileTransfers::Reply FileTransfers::put_whole(const json& c,
                                              std::span<const std::string_view> buffers,
                                              const SessionFiles& s) {
    const std::string path = checked_relative_path(path_field(c), kSandboxInputDir);
    if (buffers.size() != 1) {
        throw FileRequestError(ename::InvalidRequest,
                               "file_put_request carries the file as exactly one buffer");
    }
    const std::string_view data = buffers[0];
    if (data.size() > limits_.max_inline_bytes) {
        throw FileRequestError(ename::FileTooLarge,
                               bytes_text(data.size()) + " is over the " +
                                   bytes_text(limits_.max_inline_bytes) +
                                   " one message may carry; use file_put_begin_request");
    }
    check_room(s, data.size(), size_of_existing(s, path), nullptr);
    // The same path as a streamed upload: a partial beside the input, then a rename.
    Upload u;
    u.id = new_transfer_id();
    u.session_id = s.session_id;
    u.path = path;
    u.size = u.received = data.size();
    u.fd = create_partial(s, u.id, data.size(), u.partial);
    try {
        if (::write(u.fd.get(), data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
            const int err = errno;
            throw FileRequestError(
                err == ENOSPC || err == EDQUOT ? ename::FileTooLarge : ename::FileError,
                "write " + path + ": " + errno_text(err));
        }
        if (const fs::path old = install(s, u); !old.empty()) ::unlink(old.c_str());
    } catch (...) {
        ::unlink(u.partial.c_str());
        throw;
    }
    return {{{"status", "ok"},
             {"path", std::string(kSandboxInputDir) + "/" + path},
             {"size", data.size()}},
            {},
            std::make_pair(std::string("file_put"), path + " (" + bytes_text(data.size()) + ")"),
            {}};
}

FileTransfers::LocalCopy FileTransfers::begin_local_put(const json& c, int client_file,
                                                        const SessionFiles& s,
                                                        Clock::time_point now) {
    const std::string path = checked_relative_path(path_field(c), kSandboxInputDir);
    const std::string sha256 = c.contains("sha256") ? sha256_field(c) : std::string();
    const std::uint64_t size = passed_file_size(client_file, O_RDONLY);
    check_capacity(s.session_id);
    check_room(s, size, size_of_existing(s, path), nullptr);
    std::unique_ptr<Upload> upload = new_upload(path, size, sha256, s, now);
    upload->local = true;
    LocalCopy copy{upload->id, std::string(kSandboxInputDir) + "/" + path, size,
                   UniqueFd(::fcntl(client_file, F_DUPFD_CLOEXEC, 0)),
                   UniqueFd(::fcntl(upload->fd.get(), F_DUPFD_CLOEXEC, 0))};
    const std::string id = upload->id;
    uploads_.emplace(id, std::move(upload));
    if (!copy.src || !copy.dst) {
        drop_upload(id);
        throw FileRequestError(ename::FileError, "dup: " + errno_text());
    }
    return copy;
}

FileTransfers::Reply FileTransfers::finish_local_put(Upload& u, const std::string& sha256,
                                                     const SessionFiles& s) {
    const std::string id = u.id;
    if (!u.sha256.empty() && sha256 != u.sha256) {
        const std::string evalue = "the " + bytes_text(u.size) + " copied hash to sha256 " +
                                   sha256 + ", not the declared " + u.sha256 +
                                   "; the upload is discarded";
        drop_upload(id);
        throw FileRequestError(ename::ChecksumMismatch, evalue);
    }
    u.received = u.size;
    fs::path displaced;
    try {
        displaced = install(s, u);
    } catch (...) {
        drop_upload(id);
        throw;
    }
    Reply reply{
        {{"status", "ok"},
         {"path", std::string(kSandboxInputDir) + "/" + u.path},
         {"size", u.size},
         {"sha256", sha256},
         {"local", true}},
        {},
        std::make_pair(std::string("file_put"), u.path + " (" + bytes_text(u.size) + ", sha256 " +
                                                    sha256.substr(0, 12) + ", local copy)"),
        displaced};
    u.fd.reset();
    uploads_.erase(id);
    return reply;
}

void FileTransfers::drop_upload(const std::string& id) {
    const auto it = uploads_.find(id);
    if (it == uploads_.end()) return;
    it->second->fd.reset();
    ::unlink(it->second->partial.c_str());
    uploads_.erase(it);
}
}  // namespace cellblock
