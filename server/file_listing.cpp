// file_list_request: what the code left in /data/output, listed without
// following any link it planted and within fixed bounds.
#include <dirent.h>

#include <memory>

#include "file_transfer_internal.hpp"

namespace cellblock {
using nlohmann::json;
using namespace transfer_detail;

namespace {

struct Listing {
    json files = json::array();
    bool truncated = false;
    std::size_t max_files;
    int max_depth;
    dev_t device;  // the output dir's: a mount beneath it is not walked
};

struct CloseDir {
    void operator()(DIR* dir) const { ::closedir(dir); }
};

// Walks the directory `fd` whose path below the output dir is `prefix`.
void walk(FileDescriptor fd, const std::string& prefix, int depth, Listing& out) {
    const std::unique_ptr<DIR, CloseDir> owned(::fdopendir(fd.get()));
    if (!owned) return;
    fd.release();  // the DIR owns it now
    DIR* dir = owned.get();
    while (const dirent* entry = ::readdir(dir)) {
        const std::string name = entry->d_name;
        if (name == "." || name == "..") continue;
        struct stat st {};
        if (::fstatat(::dirfd(dir), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        const std::string path = prefix.empty() ? name : prefix + "/" + name;
        if (S_ISREG(st.st_mode)) {
            if (out.files.size() >= out.max_files) {
                out.truncated = true;
                break;
            }
            out.files.push_back({{"path", path},
                                 {"size", static_cast<std::uint64_t>(st.st_size)},
                                 {"mtime", static_cast<std::int64_t>(st.st_mtime)}});
        } else if (S_ISDIR(st.st_mode) && st.st_dev == out.device) {
            if (depth + 1 >= out.max_depth) {
                out.truncated = true;
                continue;
            }
            FileDescriptor child(::openat(::dirfd(dir), name.c_str(),
                                          O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
            if (child) walk(std::move(child), path, depth + 1, out);
        }
    }
}

}  // namespace

json list_output_files(const SessionFiles& s, std::size_t max_files, int max_depth) {
    Listing listing;
    listing.max_files = max_files;
    listing.max_depth = max_depth;
    FileDescriptor root(
        ::open(s.output_dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    struct stat st {};
    if (!root || ::fstat(root.get(), &st) != 0)
        throw FileRequestError(ename::FileError, "the session's output directory is gone");
    listing.device = st.st_dev;
    walk(std::move(root), "", 0, listing);
    return {
        {"status", "ok"}, {"files", std::move(listing.files)}, {"truncated", listing.truncated}};
}

}  // namespace cellblock
