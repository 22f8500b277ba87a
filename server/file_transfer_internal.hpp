// What file_transfer.cpp, file_uploads.cpp, file_downloads.cpp and
// file_copy.cpp share: an owned descriptor, the one-pass sha256, the request field readers and the
// transfers' own records. Private to server/.
#pragma once

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

#include "cellblock/sha256.hpp"

#include "cellblock/errno_text.hpp"
#include "cellblock/error_names.hpp"
#include "cellblock/oci_bundle.hpp"
#include "cellblock/unique_fd.hpp"
#include "cellblock/wire_message.hpp"

namespace cellblock::transfer_detail {
namespace fs = std::filesystem;
using nlohmann::json;

// An owned descriptor (the server's one type for it).
using FileDescriptor = UniqueFd;

inline std::string bytes_text(std::uint64_t n) { return std::to_string(n) + " bytes"; }

// Opens `relative` under `dir` without following any symlink and without
// leaving `dir` (the sandbox writes /data/output: everything in it is hostile).
inline FileDescriptor open_beneath(const fs::path& dir, const std::string& relative, int flags,
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

inline const json& field(const json& c, const char* name) {
    static const json null;
    const auto it = c.find(name);
    return it == c.end() ? null : *it;
}

inline std::string string_field(const json& c, const char* name) {
    const json& v = field(c, name);
    if (!v.is_string() || v.get<std::string>().empty())
        throw FileRequestError(ename::InvalidRequest,
                               std::string(name) + " (a string) is required");
    return v.get<std::string>();
}

// A path as sent; checked_relative_path judges it (an empty one is InvalidPath).
inline std::string path_field(const json& c) {
    const json& v = field(c, "path");
    if (!v.is_string())
        throw FileRequestError(ename::InvalidRequest, "path (a string) is required");
    return v.get<std::string>();
}

inline std::uint64_t count_field(const json& c, const char* name) {
    const json& v = field(c, name);
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<std::int64_t>() >= 0))
        throw FileRequestError(ename::InvalidRequest,
                               std::string(name) + " (a non-negative integer) is required");
    return v.get<std::uint64_t>();
}

inline std::string sha256_field(const json& c) {
    std::string hex = string_field(c, "sha256");
    std::transform(hex.begin(), hex.end(), hex.begin(),
                   [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    if (hex.size() != 64 || hex.find_first_not_of("0123456789abcdef") != std::string::npos)
        throw FileRequestError(ename::InvalidRequest, "sha256 must be 64 hex digits");
    return hex;
}

inline std::string new_transfer_id() {
    std::string id = make_uuid();
    id.erase(std::remove(id.begin(), id.end(), '-'), id.end());
    return id;
}

// Reads exactly `length` bytes at `offset` into `dst`, or fewer at end of
// file; returns how many.
inline std::size_t read_into(int fd, std::uint64_t offset, char* dst, std::size_t length) {
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

inline std::string read_at(int fd, std::uint64_t offset, std::size_t length) {
    std::string data(length, '\0');
    data.resize(read_into(fd, offset, data.data(), length));
    return data;
}

// The size of a descriptor a client passed, which must be a regular file
// open for `access`, O_RDONLY or O_WRONLY (O_RDWR does for either). Throws
// FileError.
inline std::uint64_t passed_file_size(int fd, int access) {
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        throw FileRequestError(ename::FileError, "the descriptor passed is not a regular file");
    const int flags = ::fcntl(fd, F_GETFL);
    const int mode = flags & O_ACCMODE;
    const bool ok = flags >= 0 && !(flags & O_PATH) && (mode == access || mode == O_RDWR);
    if (!ok)
        throw FileRequestError(
            ename::FileError, access == O_WRONLY ? "the descriptor passed is not open for writing"
                                                 : "the descriptor passed is not open for reading");
    return static_cast<std::uint64_t>(st.st_size);
}

inline std::uint64_t free_bytes(const fs::path& dir) {
    struct statvfs vfs {};
    if (::statvfs(dir.c_str(), &vfs) != 0) return UINT64_MAX;
    return static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

}  // namespace cellblock::transfer_detail

namespace cellblock {

struct FileTransfers::Upload {
    std::string id, session_id, path, sha256;
    std::uint64_t size = 0, received = 0;
    bool local = false;  // a copy by the local file socket: no chunks, no idle expiry
    std::filesystem::path partial;
    transfer_detail::FileDescriptor fd;
    Sha256 hash;
    Clock::time_point touched;
};

struct FileTransfers::Download {
    std::string id, session_id, path;
    std::uint64_t size = 0, hashed = 0;
    bool local = false;  // as Upload::local
    struct timespec mtime {};
    ino_t inode = 0;
    transfer_detail::FileDescriptor fd;
    Sha256 hash;
    Clock::time_point touched;
};

}  // namespace cellblock
