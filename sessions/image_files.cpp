// File operations on an image root: removing a tree under its mounts,
// sealing, sizes, stored versions, preparing a root without following its
// symlinks, checking its kernel.
#include "image_builder_internal.hpp"

namespace cellblock::image_detail {

void remove_tree(const fs::path& dir) {
    const std::string prefix = dir.string();
    std::vector<std::string> mounts;
    {
        std::ifstream info("/proc/self/mountinfo");
        std::string line;
        while (std::getline(info, line)) {
            std::istringstream ss(line);
            std::string id, parent, devs, root, point;
            ss >> id >> parent >> devs >> root >> point;
            if (point == prefix || point.rfind(prefix + "/", 0) == 0) mounts.push_back(point);
        }
    }
    std::sort(mounts.begin(), mounts.end(),
              [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
    for (const auto& point : mounts) ::umount2(point.c_str(), MNT_DETACH);
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (ec) throw std::runtime_error("remove " + dir.string() + ": " + ec.message());
}

void make_store_dirs(const ImageStore& store) {
    for (const char* sub : {"", "store", "names", "tmp", "cache", "cache/apt"}) {
        const fs::path dir = store.root() / sub;
        std::error_code ec;
        fs::create_directories(dir, ec);
        if (ec) throw std::runtime_error("mkdir " + dir.string() + ": " + ec.message());
    }
    // The sandbox's mapped root must reach store/<id>/rootfs; nothing else.
    ::chmod(store.root().c_str(), 0711);
    ::chmod((store.root() / "store").c_str(), 0711);
    ::chmod((store.root() / "names").c_str(), 0755);
    ::chmod((store.root() / "tmp").c_str(), 0700);
    ::chmod((store.root() / "cache").c_str(), 0700);
}

std::uint64_t tree_size(const fs::path& dir) {
    std::uint64_t total = 0;
    std::set<std::pair<dev_t, ino_t>> seen;
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::none, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        struct stat st {};
        if (::lstat(it->path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
        if (st.st_nlink > 1 && !seen.insert({st.st_dev, st.st_ino}).second) continue;
        total += static_cast<std::uint64_t>(st.st_size);
    }
    return total;
}

Sealed seal_root(const fs::path& dir, const fs::path& keep) {
    std::error_code ec;
    std::vector<fs::path> paths{dir};
    for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::none, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
        paths.push_back(it->path());
    }
    if (ec) throw std::runtime_error("walk " + dir.string() + ": " + ec.message());
    Sealed sealed;
    for (const auto& path : paths) {
        struct stat st {};
        if (::lstat(path.c_str(), &st) != 0 || S_ISLNK(st.st_mode)) continue;
        if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) {
            if (::unlink(path.c_str()) != 0) {
                throw std::runtime_error("remove device node " + path.string() + ": " +
                                         errno_text());
            }
            ++sealed.device_nodes;
            continue;
        }
        mode_t mode = st.st_mode & 07777;
        if (mode & (S_ISUID | S_ISGID)) ++sealed.set_id_files;
        mode &= ~static_cast<mode_t>(S_ISUID | S_ISGID);
        if (path != keep) mode &= ~static_cast<mode_t>(0222);
        if (mode != (st.st_mode & 07777) && ::chmod(path.c_str(), mode) != 0) {
            throw std::runtime_error("chmod " + path.string() + ": " + errno_text());
        }
    }
    return sealed;
}

std::ostream& operator<<(std::ostream& out, const Sealed& sealed) {
    return out << "  sealed read-only: " << sealed.device_nodes << " device node(s) removed, "
               << sealed.set_id_files << " setuid/setgid bit(s) cleared\n";
}

std::string format_size(std::uint64_t bytes) {
    std::ostringstream out;
    out << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / (1 << 20) << " MB";
    return out.str();
}

fs::path make_temp_dir(const ImageStore& store, const std::string& name) {
    std::string templ =
        (store.root() / "tmp" / (std::to_string(::getpid()) + "." + name + ".XXXXXX")).string();
    if (!::mkdtemp(templ.data()))
        throw std::runtime_error("mkdtemp " + templ + ": " + errno_text());
    ::chmod(templ.c_str(), 0755);
    return templ;
}

StoredImage read_stored(const fs::path& dir) {
    StoredImage s;
    s.dir = dir;
    std::ifstream in(dir / "manifest.json");
    json m = json::parse(in, nullptr, false);
    if (m.is_discarded() || !m.is_object()) {
        throw std::runtime_error("image store: " + (dir / "manifest.json").string() +
                                 " is missing or not JSON");
    }
    s.manifest = m;
    s.name = m.value("name", "");
    s.content_id = m.value("content_id", "");
    return s;
}

std::vector<std::string> installed_packages(const fs::path& root) {
    const Finished r =
        run_child({"dpkg-query", "--admindir=" + (root / "var/lib/dpkg").string(), "-W",
                   "-f=${db:Status-Abbrev}${Package}:${Architecture}=${Version}\\n"},
                  nullptr, tool_env());
    if (r.exit_code != 0)
        throw std::runtime_error("dpkg-query in " + root.string() + ": " + r.output);
    std::vector<std::string> out;
    std::istringstream lines(r.output);
    std::string line;
    while (std::getline(lines, line)) {
        if (line.rfind("ii ", 0) == 0) out.push_back(line.substr(3));
    }
    std::sort(out.begin(), out.end());
    return out;
}

void make_real_dirs(const fs::path& root, const fs::path& rel) {
    fs::path at = root;
    for (const auto& part : rel.relative_path()) {
        if (part.empty() || part == "." || part == "..") {
            throw std::runtime_error("image root: bad path " + rel.string());
        }
        at /= part;
        struct stat st {};
        if (::lstat(at.c_str(), &st) == 0) {
            if (S_ISDIR(st.st_mode)) continue;
            if (::unlink(at.c_str()) != 0) {
                throw std::runtime_error("image root: remove " + at.string() + ": " + errno_text());
            }
        } else if (errno != ENOENT) {
            throw std::runtime_error("image root: " + at.string() + ": " + errno_text());
        }
        if (::mkdir(at.c_str(), 0755) != 0) {
            throw std::runtime_error("image root: mkdir " + at.string() + ": " + errno_text());
        }
    }
}

bool reached_without_symlinks(const fs::path& root, const fs::path& rel) {
    fs::path at = root;
    for (const auto& part : rel.relative_path()) {
        at /= part;
        struct stat st {};
        if (::lstat(at.c_str(), &st) != 0 || S_ISLNK(st.st_mode)) return false;
    }
    return true;
}

void prepare_stored_root(const Image& image, const fs::path& root) {
    SandboxSpec spec;
    spec.image = image;
    spec.image.rootfs = root.string();
    spec.rootfs = root;
    spec.ipc_dir = spec.input_dir = spec.output_dir = spec.libexec_dir = "/nonexistent";
    const json config = make_oci_config(spec);
    for (const char* dir :
         {"usr", "etc", "proc", "dev", "dev/shm", "sys", "run", "opt", "data", "tmp", "home"}) {
        make_real_dirs(root, dir);
    }
    for (const auto& mount : config.at("mounts")) {
        const fs::path destination = mount.at("destination").get<std::string>();
        make_real_dirs(root, destination.parent_path());
        struct stat st {};
        const fs::path target = root / destination.relative_path();
        if (::lstat(target.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) ::unlink(target.c_str());
    }
    for (const char* file : {"etc/passwd", "etc/group", "etc/hosts", "etc/hostname",
                             "etc/nsswitch.conf", "etc/resolv.conf"}) {
        std::error_code ec;
        fs::remove(root / file, ec);  // a symlink is replaced, never followed
    }
    prepare_host_rootfs(spec, config);
    write_file_bytes(root / "etc/resolv.conf", "", 0644);
    // Whatever the packages left in /tmp (remove_all does not follow symlinks).
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root / "tmp", ec)) fs::remove_all(entry, ec);
    ::chmod((root / "tmp").c_str(), 01777);
}

void dev_null_mount_point(const fs::path& root) {
    struct stat st {};
    if (::lstat((root / "dev").c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        throw std::runtime_error("check kernel: the image's /dev is not a directory");
    }
    const fs::path null = root / "dev" / "null";
    if (::lstat(null.c_str(), &st) == 0) {
        if (S_ISREG(st.st_mode) || S_ISCHR(st.st_mode)) return;
        throw std::runtime_error(
            "check kernel: the image's /dev/null is neither a file nor a "
            "device node");
    }
    write_file_bytes(null, "", 0644);
}

void check_kernel(const Image& image, const fs::path& root, std::ostream& progress) {
    const std::string& interpreter = image.kernel_argv.at(0);
    struct stat st {};
    if (::lstat((root / interpreter.substr(interpreter[0] == '/' ? 1 : 0)).c_str(), &st) != 0) {
        throw std::runtime_error("check kernel: " + interpreter +
                                 " does not exist in the image (is it in the packages?)");
    }
    const bool python_launcher = std::any_of(
        image.kernel_argv.begin(), image.kernel_argv.end(),
        [](const std::string& a) { return a.find("cellblock_ipykernel.py") != std::string::npos; });
    if (!python_launcher) return;
    dev_null_mount_point(root);
    std::string code = "import ipykernel.kernelapp";
    for (const auto& module : image.preload) code += "; import " + module;
    progress << "checking the kernel: " << interpreter << " -c '" << code << "'\n" << std::flush;
    const Finished r = run_child({interpreter, "-c", code}, nullptr,
                                 {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/nonexistent",
                                  "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1", "MPLBACKEND=agg"},
                                 root);
    if (r.exit_code != 0) {
        throw std::runtime_error("check kernel: `" + code + "` failed in the image (exit " +
                                 std::to_string(r.exit_code) + "): " + r.output);
    }
}

StoredImage commit_version(const ImageStore& store, TempDir& tmp, const std::string& name,
                           const std::string& id, std::ostream& progress) {
    StoreLock lock(store.root());
    const fs::path final_dir = store.root() / "store" / id;
    if (fs::exists(final_dir / "manifest.json")) {
        progress << "version " << id.substr(0, 12)
                 << " is already stored (same definition, same packages): kept as it is\n";
        remove_tree(tmp.path());
        tmp.release();
    } else {
        if (fs::exists(final_dir)) remove_tree(final_dir);  // a half-removed version
        ::chmod(tmp.path().c_str(), 0555);
        if (::rename(tmp.path().c_str(), final_dir.c_str()) != 0) {
            throw std::runtime_error("rename " + tmp.path().string() + " to " + final_dir.string() +
                                     ": " + errno_text());
        }
        tmp.release();
    }
    const fs::path link = store.root() / "names" / name;
    const fs::path new_link =
        store.root() / "names" / ("." + name + ".new." + std::to_string(::getpid()));
    std::error_code ec;
    fs::remove(new_link, ec);
    fs::create_symlink(fs::path("..") / "store" / id, new_link, ec);
    if (ec) throw std::runtime_error("symlink " + new_link.string() + ": " + ec.message());
    if (::rename(new_link.c_str(), link.c_str()) != 0) {
        throw std::runtime_error("rename " + new_link.string() + ": " + errno_text());
    }
    return read_stored(final_dir);
}

std::vector<std::string> mmdebstrap_argv(const BuildSpec& spec, const fs::path& rootfs,
                                         const fs::path& cache) {
    std::vector<std::string> argv{"mmdebstrap", "--mode=root", "--variant=" + spec.variant,
                                  "--format=directory"};
    if (!spec.packages.empty()) {
        std::string include = "--include=";
        for (std::size_t i = 0; i < spec.packages.size(); ++i) {
            include += (i ? "," : "") + spec.packages[i];
        }
        argv.push_back(include);
    }
    // Downloaded packages are kept for the next build (mmdebstrap's own recipe).
    argv.push_back("--skip=essential/unlink");
    argv.push_back("--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives/");
    argv.push_back("--setup-hook=sync-in " + cache.string() + " /var/cache/apt/archives/");
    argv.push_back("--customize-hook=sync-out /var/cache/apt/archives " + cache.string());
    if (spec.strip_docs) {
        for (const char* opt :
             {"path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
              "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/info/*",
              "path-exclude=/usr/share/locale/*", "path-include=/usr/share/locale/locale.alias"}) {
            argv.push_back(std::string("--dpkgopt=") + opt);
        }
    }
    argv.push_back(spec.suite);
    argv.push_back(rootfs.string());
    argv.push_back(spec.mirror);
    return argv;
}

json stored_definition(const Image& image) {
    json def = image.definition.is_object() && !image.definition.empty()
                   ? image.definition
                   : json{{"name", image.name}, {"kernel_argv", image.kernel_argv}};
    def["name"] = image.name;
    return def;
}

}  // namespace cellblock::image_detail
