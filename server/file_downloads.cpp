// Downloads: one version of a file from /data/output, in one message or in
// chunks, with the sha256 of the whole; a file changed underneath is refused.
#include "file_transfer_internal.hpp"

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;
using namespace transfer_detail;

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
        {},
        {}};
    reply.buffers.push_back(std::move(data));
    return reply;
}

std::unique_ptr<FileTransfers::Download> FileTransfers::new_download(const std::string& path,
                                                                     const SessionFiles& s,
                                                                     Clock::time_point now) {
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
    return d;
}

json FileTransfers::get_begin(const json& c, const SessionFiles& s, Clock::time_point now) {
    const std::string path = checked_relative_path(path_field(c), kSandboxOutputDir);
    std::unique_ptr<Download> d = new_download(path, s, now);
    const std::uint64_t size = d->size;
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
    if (it == downloads_.end() || it->second->session_id != s.session_id || it->second->local) {
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
                {},
                {}};
    if (d.hashed == d.size) {
        reply.content["sha256"] = d.hash.hex();
        downloads_.erase(id);  // the last piece is out: nothing stays open
    }
    reply.buffers.push_back(std::move(bytes));
    return reply;
}

FileTransfers::LocalCopy FileTransfers::begin_local_get(const json& c, int client_file,
                                                        const SessionFiles& s,
                                                        Clock::time_point now) {
    const std::string path = checked_relative_path(path_field(c), kSandboxOutputDir);
    passed_file_size(client_file, O_WRONLY);
    std::unique_ptr<Download> d = new_download(path, s, now);
    d->local = true;
    const std::uint64_t size = d->size;
    if (::ftruncate(client_file, 0) != 0)
        throw FileRequestError(ename::FileError,
                               "cut the passed file to length 0: " + errno_text());
    // Its blocks at once, as for a put: the copy then only fills them (best
    // effort; a file system without fallocate just allocates as it goes).
    if (size > 0) ::fallocate(client_file, FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(size));
    LocalCopy copy{d->id, std::string(kSandboxOutputDir) + "/" + path, size,
                   UniqueFd(::fcntl(d->fd.get(), F_DUPFD_CLOEXEC, 0)),
                   UniqueFd(::fcntl(client_file, F_DUPFD_CLOEXEC, 0))};
    if (!copy.src || !copy.dst) throw FileRequestError(ename::FileError, "dup: " + errno_text());
    downloads_.emplace(d->id, std::move(d));
    return copy;
}

FileTransfers::Reply FileTransfers::finish_local_get(Download& d, const std::string& sha256) {
    const std::string id = d.id;
    // The code may have rewritten the file during the copy: one version, or none.
    struct stat st {};
    const bool same = ::fstat(d.fd.get(), &st) == 0 &&
                      static_cast<std::uint64_t>(st.st_size) == d.size &&
                      st.st_mtim.tv_sec == d.mtime.tv_sec && st.st_mtim.tv_nsec == d.mtime.tv_nsec;
    Reply reply{{{"status", "ok"},
                 {"path", std::string(kSandboxOutputDir) + "/" + d.path},
                 {"size", d.size},
                 {"sha256", sha256},
                 {"local", true}},
                {},
                {},
                {}};
    const std::string evalue = std::string(kSandboxOutputDir) + "/" + d.path +
                               " changed while it was copied (" + bytes_text(d.size) + ", now " +
                               bytes_text(static_cast<std::uint64_t>(st.st_size)) +
                               "); get it again";
    downloads_.erase(id);
    if (!same) throw FileRequestError(ename::FileChanged, evalue);
    return reply;
}

}  // namespace cellblock
