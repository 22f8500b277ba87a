// The content-addressed image store: names, versions, hashing, removal and
// the sweep of abandoned builds.
#include "image_builder_internal.hpp"

namespace cellblock {
using namespace image_detail;

// ------------------------------------------------------------------ hashing

std::string image_content_id(const json& definition,
                             const std::map<std::string, std::string>& file_digests,
                             const std::vector<std::string>& packages) {
    std::vector<std::string> sorted = packages;
    std::sort(sorted.begin(), sorted.end());
    // nlohmann's objects keep their keys sorted: dump() is canonical.
    const json hashed = {{"cellblock_image", 1},
                         {"definition", definition},
                         {"files", file_digests},
                         {"packages", sorted}};
    return sha256_hex(hashed.dump());
}

// ------------------------------------------------------------------ the store

ImageStore::ImageStore(fs::path root) : root_(std::move(root)) {}

std::string ImageStore::current_id(const std::string& name) const {
    if (name.empty() || name.find('/') != std::string::npos || name[0] == '.') return "";
    std::error_code ec;
    const fs::path target = fs::read_symlink(root_ / "names" / name, ec);
    if (ec) return "";
    const std::string id = target.filename().string();
    return fs::exists(root_ / "store" / id / "manifest.json") ? id : "";
}

std::optional<StoredImage> ImageStore::current(const std::string& name) const {
    const std::string id = current_id(name);
    if (id.empty()) return std::nullopt;
    return read_stored(root_ / "store" / id);
}

std::vector<StoredImage> ImageStore::versions(const std::string& name) const {
    std::vector<StoredImage> out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root_ / "store", ec)) {
        try {
            StoredImage s = read_stored(entry.path());
            if (s.name == name) out.push_back(std::move(s));
        } catch (const std::exception&) {
        }
    }
    return out;
}

std::vector<std::string> ImageStore::names() const {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root_ / "names", ec)) {
        const std::string name = entry.path().filename().string();
        if (!name.empty() && name[0] != '.' && current(name)) out.push_back(name);
    }
    std::sort(out.begin(), out.end());
    return out;
}

Image ImageStore::image(const StoredImage& stored) const {
    Image image = Image::load(stored.dir / "image.json");
    image.rootfs = stored.rootfs().string();
    image.content_id = stored.content_id;
    image.definition_dir.clear();
    return image;
}

Image resolve_image(const Image& image, const ImageStore& store) {
    if (image.rootfs != "store") return image;
    const auto stored = store.current(image.name);
    if (!stored) {
        throw ImageNotBuilt("image '" + image.name + "' is not built in " + store.root().string() +
                            ": run `cellblock image build " + image.name + "`");
    }
    return store.image(*stored);
}

std::vector<std::string> image_mount_points(const Image& image) {
    SandboxSpec spec;
    spec.image = image;
    spec.rootfs = "/nonexistent";
    const json config = make_oci_config(spec);
    std::vector<std::string> out;
    for (const auto& m : config.at("mounts")) out.push_back(m.at("destination"));
    return out;
}

// ------------------------------------------------------------------ rm, sweep

std::vector<int> processes_using(const StoredImage& stored) {
    // A sandbox's /proc/PID/root reads as "/" from here (it lives in its own
    // mount namespace after pivot_root): compare the directory itself.
    std::vector<int> out;
    struct stat root {};
    if (::stat(stored.rootfs().c_str(), &root) != 0) return out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator("/proc", ec)) {
        const std::string pid = entry.path().filename().string();
        if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) continue;
        struct stat st {};
        if (::stat((entry.path() / "root").c_str(), &st) == 0 && st.st_dev == root.st_dev &&
            st.st_ino == root.st_ino) {
            out.push_back(std::stoi(pid));
        }
    }
    return out;
}

int hold_stored_version(const fs::path& rootfs) {
    const fs::path manifest = rootfs.parent_path() / "manifest.json";
    const std::string id = rootfs.parent_path().filename().string();
    UniqueFd fd(::open(manifest.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!fd) {
        throw std::runtime_error("image version " + id.substr(0, 12) + " is gone from the store (" +
                                 errno_text() + ")");
    }
    if (::flock(fd.get(), LOCK_SH | LOCK_NB) != 0) {
        throw std::runtime_error("image version " + id.substr(0, 12) +
                                 " is being removed (cellblock image rm)");
    }
    return fd.release();
}

std::vector<StoredImage> remove_image(const std::string& name, const ImageStore& store) {
    auto versions = store.versions(name);
    const bool named = store.current(name).has_value();
    if (!named && versions.empty()) {
        throw std::runtime_error("image '" + name + "' is not in the store " +
                                 store.root().string());
    }
    StoreLock lock(store.root());
    std::error_code ec;
    fs::remove(store.root() / "names" / name, ec);
    std::vector<StoredImage> kept;
    for (const auto& v : versions) {
        // In use: a sandbox holds the version (hold_stored_version), from
        // before its runtime starts, or a process runs on its root (a
        // sandbox whose server is gone).
        const UniqueFd fd(
            ::open((v.dir / "manifest.json").c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
        if ((fd && ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) || !processes_using(v).empty()) {
            kept.push_back(v);
            continue;
        }
        remove_tree(v.dir);  // still holding the lock: no sandbox starts on it meanwhile
    }
    return kept;
}

void sweep_abandoned_builds(const ImageStore& store) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(store.root() / "tmp", ec)) {
        const std::string name = entry.path().filename().string();
        const auto dot = name.find('.');
        if (dot == std::string::npos) continue;
        const int pid = std::atoi(name.substr(0, dot).c_str());
        if (pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM)) continue;  // still building
        remove_tree(entry.path());
    }
}

}  // namespace cellblock
