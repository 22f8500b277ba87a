#include "file_transfer.hpp"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <openssl/evp.h>

#include "cellblock/error_names.hpp"
#include "cellblock/oci_bundle.hpp"
#include "cellblock/wire_message.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// An owned descriptor.
class FileDescriptor {
  public:
    FileDescriptor() = default;
    explicit FileDescriptor(int fd) : fd_(fd) {}
    FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
    FileDescriptor& operator=(FileDescriptor&& other) noexcept {
        if (this != &other) {
            reset();
            fd_ = std::exchange(other.fd_, -1);
        }
        return *this;
    }
    FileDescriptor(const FileDescriptor&) = delete;
    FileDescriptor& operator=(const FileDescriptor&) = delete;
    ~FileDescriptor() { reset(); }
    int get() const { return fd_; }
    explicit operator bool() const { return fd_ >= 0; }
    void reset() {
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }

  private:
    int fd_ = -1;
};

// A running SHA-256.
class Sha256 {
  public:
    Sha256() : ctx_(EVP_MD_CTX_new()) {
        if (!ctx_ || EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1)
            throw std::runtime_error("sha256: cannot initialise a digest");
    }
    Sha256(const Sha256& other) : ctx_(EVP_MD_CTX_new()) {
        if (!ctx_ || EVP_MD_CTX_copy_ex(ctx_.get(), other.ctx_.get()) != 1)
            throw std::runtime_error("sha256: cannot copy a digest");
    }
    Sha256& operator=(Sha256&& other) noexcept = default;
    Sha256(Sha256&&) noexcept = default;
    void update(std::string_view bytes) {
        EVP_DigestUpdate(ctx_.get(), bytes.data(), bytes.size());
    }
    std::string hex() {
        unsigned char md[EVP_MAX_MD_SIZE];
        unsigned int len = 0;
        EVP_DigestFinal_ex(ctx_.get(), md, &len);
        static const char* digits = "0123456789abcdef";
        std::string out;
        for (unsigned int i = 0; i < len; ++i) {
            out += digits[md[i] >> 4];
            out += digits[md[i] & 15];
        }
        return out;
    }

  private:
    struct Free {
        void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
    };
    std::unique_ptr<EVP_MD_CTX, Free> ctx_;
};

std::string errno_text(int err = errno) { return std::strerror(err); }

std::string bytes_text(std::uint64_t n) { return std::to_string(n) + " bytes"; }

// Opens `relative` under `dir` without following any symlink and without
// leaving `dir` (the sandbox writes /data/output: everything in it is hostile).
FileDescriptor open_beneath(const fs::path& dir, const std::string& relative, int flags,
                            mode_t mode = 0) {
    const FileDescriptor dirfd(::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!dirfd) throw FileRequestError(ename::FileError, "the session's directory is gone");
    open_how how{};
    how.flags = static_cast<std::uint64_t>(flags | O_CLOEXEC | O_NOFOLLOW);
    how.mode = (flags & O_CREAT) ? mode : 0;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;
    return FileDescriptor(
        static_cast<int>(::syscall(SYS_openat2, dirfd.get(), relative.c_str(), &how, sizeof how)));
}

const json& field(const json& c, const char* name) {
    static const json null;
    const auto it = c.find(name);
    return it == c.end() ? null : *it;
}

std::string string_field(const json& c, const char* name) {
    const json& v = field(c, name);
    if (!v.is_string() || v.get<std::string>().empty())
        throw FileRequestError(ename::InvalidRequest,
                               std::string(name) + " (a string) is required");
    return v.get<std::string>();
}

// A path as sent; checked_relative_path judges it (an empty one is InvalidPath).
std::string path_field(const json& c) {
    const json& v = field(c, "path");
    if (!v.is_string())
        throw FileRequestError(ename::InvalidRequest, "path (a string) is required");
    return v.get<std::string>();
}

std::uint64_t count_field(const json& c, const char* name) {
    const json& v = field(c, name);
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<std::int64_t>() >= 0))
        throw FileRequestError(ename::InvalidRequest,
                               std::string(name) + " (a non-negative integer) is required");
    return v.get<std::uint64_t>();
}

std::string sha256_field(const json& c) {
    std::string hex = string_field(c, "sha256");
    std::transform(hex.begin(), hex.end(), hex.begin(),
                   [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    if (hex.size() != 64 || hex.find_first_not_of("0123456789abcdef") != std::string::npos)
        throw FileRequestError(ename::InvalidRequest, "sha256 must be 64 hex digits");
    return hex;
}

std::string new_transfer_id() {
    std::string id = make_uuid();
    id.erase(std::remove(id.begin(), id.end(), '-'), id.end());
    return id;
}

// Reads exactly `length` bytes at `offset` into `dst`, or fewer at end of
// file; returns how many.
std::size_t read_into(int fd, std::uint64_t offset, char* dst, std::size_t length) {
    std::size_t got = 0;
    while (got < length) {
        const ssize_t n = ::pread(fd, dst + got, length - got, static_cast<off_t>(offset + got));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw FileRequestError(ename::FileError, "read: " + errno_text());
        if (n == 0) break;
        got += static_cast<std::size_t>(n);
    }
    return got;
}

std::string read_at(int fd, std::uint64_t offset, std::size_t length) {
    std::string data(length, '\0');
    data.resize(read_into(fd, offset, data.data(), length));
    return data;
}

std::uint64_t free_bytes(const fs::path& dir) {
    struct statvfs vfs {};
    if (::statvfs(dir.c_str(), &vfs) != 0) return UINT64_MAX;
    return static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

}  // namespace

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

struct FileTransfers::Upload {
    std::string id, session_id, path, sha256;
    std::uint64_t size = 0, received = 0;
    fs::path partial;
    FileDescriptor fd;
    Sha256 hash;
    Clock::time_point touched;
};

struct FileTransfers::Download {
    std::string id, session_id, path;
    std::uint64_t size = 0, hashed = 0;
    struct timespec mtime {};
    ino_t inode = 0;
    FileDescriptor fd;
    Sha256 hash;
    Clock::time_point touched;
};

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
        "file_get_begin_request", "file_get_chunk_request",  "file_get_end_request"};
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
    if (t == "file_put_begin_request") return {put_begin(c, s, now), {}, {}};
    if (t == "file_put_chunk_request") return {put_chunk(c, buffers, s, now), {}, {}};
    if (t == "file_put_commit_request") return put_commit(c, s);
    if (t == "file_put_abort_request") {
        drop_upload(upload_of(c, s).id);
        return {{{"status", "ok"}}, {}, {}};
    }
    if (t == "file_get_begin_request") return {get_begin(c, s, now), {}, {}};
    if (t == "file_get_chunk_request") return get_chunk(c, s, now);
    if (t == "file_get_end_request") {
        const std::string id = download_of(c, s).id;  // a copy: the key dies with the node
        downloads_.erase(id);
        return {{{"status", "ok"}}, {}, {}};
    }
    throw FileRequestError(ename::UnknownRequest, "not a file request: " + std::string(t));
}

// ------------------------------------------------------------------ uploads

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

    auto upload = std::make_unique<Upload>();
    upload->id = new_transfer_id();
    upload->session_id = s.session_id;
    upload->path = path;
    upload->size = size;
    upload->sha256 = sha256;
    upload->touched = now;
    if (::mkdir(s.partial_dir.c_str(), 0700) != 0 && errno != EEXIST)
        throw FileRequestError(ename::FileError, "mkdir for uploads: " + errno_text());
    upload->partial = s.partial_dir / upload->id;
    upload->fd = FileDescriptor(
        ::open(upload->partial.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!upload->fd) throw FileRequestError(ename::FileError, "create the upload: " + errno_text());
    // Reserve the declared size now: a full disk is found here, not at 90 %.
    if (size > 0 &&
        ::fallocate(upload->fd.get(), FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(size)) != 0) {
        const int err = errno;
        ::unlink(upload->partial.c_str());
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
    if (it == uploads_.end() || it->second->session_id != s.session_id) {
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

void FileTransfers::install(const SessionFiles& s, Upload& u) {
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
    if (::renameat(AT_FDCWD, u.partial.c_str(), parent_fd.get(), name.c_str()) != 0)
        throw FileRequestError(ename::FileError, "rename into " + u.path + ": " + errno_text());
    std::uint64_t& held = input_bytes_[s.session_id];
    if (replaces && S_ISREG(old.st_mode)) held -= std::min<std::uint64_t>(held, old.st_size);
    held += u.size;
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
        install(s, u);
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
                                                            ", sha256 " + got.substr(0, 12) + ")")};
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
    if (::mkdir(s.partial_dir.c_str(), 0700) != 0 && errno != EEXIST)
        throw FileRequestError(ename::FileError, "mkdir for uploads: " + errno_text());
    u.partial = s.partial_dir / u.id;
    u.fd = FileDescriptor(::open(u.partial.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!u.fd) throw FileRequestError(ename::FileError, "create " + path + ": " + errno_text());
    try {
        if (::write(u.fd.get(), data.data(), data.size()) != static_cast<ssize_t>(data.size())) {
            const int err = errno;
            throw FileRequestError(
                err == ENOSPC || err == EDQUOT ? ename::FileTooLarge : ename::FileError,
                "write " + path + ": " + errno_text(err));
        }
        install(s, u);
    } catch (...) {
        ::unlink(u.partial.c_str());
        throw;
    }
    return {{{"status", "ok"},
             {"path", std::string(kSandboxInputDir) + "/" + path},
             {"size", data.size()}},
            {},
            std::make_pair(std::string("file_put"), path + " (" + bytes_text(data.size()) + ")")};
}

void FileTransfers::drop_upload(const std::string& id) {
    const auto it = uploads_.find(id);
    if (it == uploads_.end()) return;
    it->second->fd.reset();
    ::unlink(it->second->partial.c_str());
    uploads_.erase(it);
}

// ------------------------------------------------------------------ downloads

namespace {

struct OpenedOutput {
    FileDescriptor fd;
    struct stat st {};
};

OpenedOutput open_output(const SessionFiles& s, const std::string& path) {
    OpenedOutput out;
    // O_NONBLOCK: a FIFO the code planted must not block the server.
    out.fd = open_beneath(s.output_dir, path, O_RDONLY | O_NONBLOCK);
    if (!out.fd) {
        const int err = errno;
        throw FileRequestError(
            err == ENOENT ? ename::FileNotFound : ename::FileError,
            std::string(kSandboxOutputDir) + "/" + path + ": " + errno_text(err));
    }
    if (::fstat(out.fd.get(), &out.st) != 0 || !S_ISREG(out.st.st_mode))
        throw FileRequestError(ename::FileError, path + " is not a regular file");
    return out;
}

}  // namespace

FileTransfers::Reply FileTransfers::get_whole(const json& c, const SessionFiles& s) {
    const std::string path = checked_relative_path(path_field(c), kSandboxOutputDir);
    OpenedOutput file = open_output(s, path);
    const auto size = static_cast<std::uint64_t>(file.st.st_size);
    if (size > limits_.max_inline_bytes) {
        throw FileRequestError(ename::FileTooLarge,
                               path + " is " + bytes_text(size) + ", over the " +
                                   bytes_text(limits_.max_inline_bytes) +
                                   " one message may carry; use file_get_begin_request");
    }
    std::string data = read_at(file.fd.get(), 0, size);
    const std::size_t got = data.size();
    Reply reply{
        {{"status", "ok"}, {"path", std::string(kSandboxOutputDir) + "/" + path}, {"size", got}},
        {},
        {}};
    reply.buffers.push_back(std::move(data));
    return reply;
}

json FileTransfers::get_begin(const json& c, const SessionFiles& s, Clock::time_point now) {
    const std::string path = checked_relative_path(path_field(c), kSandboxOutputDir);
    OpenedOutput file = open_output(s, path);
    const auto size = static_cast<std::uint64_t>(file.st.st_size);
    if (size > limits_.max_file_bytes) {
        throw FileRequestError(ename::FileTooLarge, path + " is " + bytes_text(size) +
                                                        ", over the server's maximum of " +
                                                        bytes_text(limits_.max_file_bytes));
    }
    check_capacity(s.session_id);
    auto d = std::make_unique<Download>();
    d->id = new_transfer_id();
    d->session_id = s.session_id;
    d->path = path;
    d->size = size;
    d->mtime = file.st.st_mtim;
    d->inode = file.st.st_ino;
    d->fd = std::move(file.fd);
    d->touched = now;
    json reply = {{"status", "ok"},
                  {"download_id", d->id},
                  {"path", std::string(kSandboxOutputDir) + "/" + path},
                  {"size", size},
                  {"chunk_bytes", limits_.chunk_bytes}};
    if (size == 0) {
        reply["sha256"] = d->hash.hex();
        return reply;  // nothing to fetch, nothing kept open
    }
    downloads_.emplace(d->id, std::move(d));
    return reply;
}

FileTransfers::Download& FileTransfers::download_of(const json& c, const SessionFiles& s) {
    const std::string id = string_field(c, "download_id");
    const auto it = downloads_.find(id);
    if (it == downloads_.end() || it->second->session_id != s.session_id) {
        throw FileRequestError(
            ename::TransferNotFound,
            "no download " + id + " in this session (finished, ended, or idle for " +
                std::to_string(limits_.idle_timeout.count()) + " s); begin again");
    }
    return *it->second;
}

FileTransfers::Reply FileTransfers::get_chunk(const json& c, const SessionFiles& s,
                                              Clock::time_point now) {
    Download& d = download_of(c, s);
    const std::string id = d.id;
    const std::uint64_t offset = count_field(c, "offset");
    std::uint64_t length = limits_.chunk_bytes;
    if (c.contains("length")) length = count_field(c, "length");
    length = std::min<std::uint64_t>(length, limits_.max_chunk_bytes);
    if (offset > d.size) {
        throw FileRequestError(ename::InvalidOffset, "offset " + std::to_string(offset) +
                                                         " is past the end of the " +
                                                         bytes_text(d.size) + " file");
    }
    // The code may rewrite the file meanwhile: what is sent must be one version.
    struct stat st {};
    if (::fstat(d.fd.get(), &st) != 0 || static_cast<std::uint64_t>(st.st_size) != d.size ||
        st.st_mtim.tv_sec != d.mtime.tv_sec || st.st_mtim.tv_nsec != d.mtime.tv_nsec) {
        // The message is made before the erase: `d` is gone with it.
        const std::string evalue = std::string(kSandboxOutputDir) + "/" + d.path +
                                   " changed while it was read (" + bytes_text(d.size) + ", now " +
                                   bytes_text(static_cast<std::uint64_t>(st.st_size)) +
                                   "); get it again";
        downloads_.erase(id);
        throw FileRequestError(ename::FileChanged, evalue);
    }
    // A download resumed past the start hashes the bytes it skipped, once.
    while (d.hashed < offset) {
        const std::string gap =
            read_at(d.fd.get(), d.hashed,
                    std::min<std::uint64_t>(offset - d.hashed, limits_.max_chunk_bytes));
        if (gap.empty()) break;
        d.hash.update(gap);
        d.hashed += gap.size();
    }
    // Read and hashed a slice at a time, in one pass: the digest reads what
    // the read just brought into the CPU's cache.
    std::string bytes(std::min(length, d.size - offset), '\0');
    const bool in_order = offset == d.hashed;
    std::size_t got = 0;
    while (got < bytes.size()) {
        const std::size_t want = std::min<std::size_t>(256u << 10, bytes.size() - got);
        const std::size_t n = read_into(d.fd.get(), offset + got, bytes.data() + got, want);
        if (in_order) d.hash.update(std::string_view(bytes).substr(got, n));
        got += n;
        if (n < want) break;
    }
    bytes.resize(got);
    if (in_order) d.hashed += got;
    d.touched = now;
    Reply reply{{{"status", "ok"},
                 {"download_id", id},
                 {"offset", offset},
                 {"length", bytes.size()},
                 {"size", d.size}},
                {},
                {}};
    if (d.hashed == d.size) {
        reply.content["sha256"] = d.hash.hex();
        downloads_.erase(id);  // the last piece is out: nothing stays open
    }
    reply.buffers.push_back(std::move(bytes));
    return reply;
}

// ------------------------------------------------------------------ housekeeping

void FileTransfers::expire(Clock::time_point now) {
    std::vector<std::string> stale;
    for (const auto& [id, u] : uploads_) {
        if (now - u->touched >= limits_.idle_timeout) stale.push_back(id);
    }
    for (const auto& id : stale) drop_upload(id);
    std::erase_if(downloads_, [&](const auto& entry) {
        return now - entry.second->touched >= limits_.idle_timeout;
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

std::size_t FileTransfers::open_transfers() const { return uploads_.size() + downloads_.size(); }

std::uint64_t FileTransfers::input_bytes(const std::string& session_id) const {
    const auto it = input_bytes_.find(session_id);
    return it == input_bytes_.end() ? 0 : it->second;
}

}  // namespace cellblock
