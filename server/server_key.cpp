#include "server_key.hpp"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cellblock/unique_fd.hpp"

namespace cellblock {
namespace fs = std::filesystem;

namespace {

[[noreturn]] void refuse(const fs::path& path, const std::string& why) {
    throw std::runtime_error("server key " + path.string() + ": " + why);
}

void make_key_file(const fs::path& path) {
    const fs::path dir = path.parent_path();
    std::error_code ec;
    if (!dir.empty() && !dir.parent_path().empty()) fs::create_directories(dir.parent_path(), ec);
    if (!dir.empty() && ::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
        refuse(path, std::string("cannot make its directory: ") + std::strerror(errno));
    }
    // Written whole under a name of this process's, then linked into place:
    // a server starting at the same moment reads the whole key or makes its
    // own first (link(2) never replaces a file).
    const fs::path staging = path.string() + ".new-" + std::to_string(::getpid());
    ::unlink(staging.c_str());
    UniqueFd fd(
        ::open(staging.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd) refuse(path, std::string("cannot create it: ") + std::strerror(errno));
    std::array<unsigned char, SnapshotKey::kBytes> bytes{};
    if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1) {
        ::unlink(staging.c_str());
        refuse(path, "no random bytes");
    }
    const ssize_t n = ::write(fd.get(), bytes.data(), bytes.size());
    OPENSSL_cleanse(bytes.data(), bytes.size());
    if (n != static_cast<ssize_t>(bytes.size()) || ::fsync(fd.get()) != 0) {
        const std::string why = std::strerror(errno);
        ::unlink(staging.c_str());
        refuse(path, "cannot write it: " + why);
    }
    const int linked = ::link(staging.c_str(), path.c_str());
    const int link_errno = errno;
    ::unlink(staging.c_str());
    // EEXIST: another server made it first; this one reads theirs.
    if (linked != 0 && link_errno != EEXIST) {
        refuse(path, std::string("cannot create it: ") + std::strerror(link_errno));
    }
}

}  // namespace

std::unique_ptr<SnapshotKey> load_server_key(const fs::path& path, bool create) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) {
        if (errno != ENOENT || !create) refuse(path, std::strerror(errno));
        make_key_file(path);
    }
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) refuse(path, std::strerror(errno));
    if (::fstat(fd.get(), &st) != 0) refuse(path, std::strerror(errno));
    if (!S_ISREG(st.st_mode)) refuse(path, "not a regular file");
    if (st.st_uid != ::geteuid()) {
        refuse(path, "owned by uid " + std::to_string(st.st_uid) + ", not this server's " +
                         std::to_string(::geteuid()));
    }
    if ((st.st_mode & 077) != 0) {
        char mode[8];
        std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
        refuse(path, std::string("mode ") + mode + " lets others read it; chmod 600 it");
    }
    if (st.st_size != static_cast<off_t>(SnapshotKey::kBytes)) {
        refuse(path,
               std::to_string(st.st_size) + " bytes, not " + std::to_string(SnapshotKey::kBytes));
    }
    std::string bytes(SnapshotKey::kBytes, '\0');
    if (::read(fd.get(), bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size())) {
        refuse(path, "cut short while it was read");
    }
    auto key = std::make_unique<SnapshotKey>(bytes);
    OPENSSL_cleanse(bytes.data(), bytes.size());
    return key;
}

}  // namespace cellblock
