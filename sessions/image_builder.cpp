#include "cellblock/image_builder.hpp"

// Building (mmdebstrap) and importing (a tarball) images into the store.
#include "image_builder_internal.hpp"

namespace cellblock {
using namespace image_detail;

// ------------------------------------------------------------------ build, import

StoredImage build_image(const Image& definition, const ImageStore& store, std::ostream& progress) {
    if (definition.build.is_null()) {
        throw std::runtime_error("image '" + definition.name +
                                 "' has no build section: nothing to build");
    }
    const BuildSpec spec = BuildSpec::from_json(definition.build);
    const auto started = Clock::now();
    StopSignals signals;
    make_store_dirs(store);
    sweep_abandoned_builds(store);

    // Extra files first: a missing source fails before a minute of mmdebstrap.
    std::map<std::string, std::string> file_data, file_digests;
    for (const auto& f : spec.files) {
        const std::string data =
            f.source.empty() ? f.content : read_file_bytes(definition.definition_dir / f.source);
        file_digests[f.path] = sha256_hex(data);
        file_data[f.path] = data;
    }

    TempDir tmp(make_temp_dir(store, definition.name));
    const fs::path rootfs = tmp.path() / "rootfs";
    progress << "building image " << definition.name << " (Debian " << spec.suite << ", "
             << spec.packages.size() << " package(s) and their dependencies) in "
             << tmp.path().string() << "\n"
             << std::flush;
    progress << "[1/5] mmdebstrap\n" << std::flush;
    const auto argv = mmdebstrap_argv(spec, rootfs, store.root() / "cache" / "apt");
    const Finished r = run_child(argv, &progress, tool_env(), {}, started);
    check_stop("mmdebstrap");
    if (r.exit_code != 0) {
        throw std::runtime_error("mmdebstrap exited with " + std::to_string(r.exit_code) +
                                 "; its last lines:\n" + r.output);
    }

    progress << "[2/5] extra files and the sandbox's skeleton (mount points, /etc/passwd)\n"
             << std::flush;
    for (const auto& f : spec.files) {
        const fs::path target = rootfs / f.path.substr(1);
        std::error_code ec;
        fs::create_directories(target.parent_path(), ec);
        if (ec)
            throw std::runtime_error("mkdir " + target.parent_path().string() + ": " +
                                     ec.message());
        write_file_bytes(target, file_data[f.path], static_cast<mode_t>(f.mode));
    }
    prepare_stored_root(definition, rootfs);
    check_stop("prepare");

    progress << "[3/5] checking the kernel\n" << std::flush;
    check_kernel(definition, rootfs, progress);
    prepare_stored_root(definition, rootfs);  // clears what the check left in /tmp
    check_stop("check kernel");

    progress << "[4/5] content id\n" << std::flush;
    const auto packages = installed_packages(rootfs);
    const json def = stored_definition(definition);
    const std::string id = image_content_id(def, file_digests, packages);
    const std::uint64_t size = tree_size(rootfs);
    const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
    json manifest = {{"name", definition.name}, {"content_id", id},
                     {"source", "build"},       {"suite", spec.suite},
                     {"mirror", spec.mirror},   {"variant", spec.variant},
                     {"built_at", unix_now()},  {"build_seconds", seconds},
                     {"size_bytes", size},      {"package_count", packages.size()},
                     {"packages", packages},    {"files", file_digests}};
    write_file_bytes(tmp.path() / "manifest.json", manifest.dump(2) + "\n", 0444);
    write_file_bytes(tmp.path() / "image.json", def.dump(2) + "\n", 0444);
    progress << seal_root(rootfs, rootfs / "tmp") << std::flush;
    check_stop("read-only");

    progress << "[5/5] into place\n" << std::flush;
    StoredImage stored = commit_version(store, tmp, definition.name, id, progress);
    progress << "image " << definition.name << ": " << id << "\n  " << format_size(size) << ", "
             << packages.size() << " packages, built in " << std::fixed << std::setprecision(1)
             << seconds << " s\n  " << stored.rootfs().string() << " (read-only)\n"
             << std::flush;
    return stored;
}

Image default_import_definition(const std::string& name) {
    json j = {
        {"name", name},
        {"display_name", "Python 3 (" + name + ")"},
        {"language", "python"},
        {"runtime", "runc"},
        {"rootfs", "store"},
        {"kernel_argv",
         {"/usr/bin/python3", "/opt/cellblock/cellblock_ipykernel.py", "-f", "{connection_file}"}},
        {"env",
         {{"MPLBACKEND", "module://matplotlib_inline.backend_inline"},
          {"PYDEVD_DISABLE_FILE_VALIDATION", "1"},
          {"PYTHONDONTWRITEBYTECODE", "1"}}}};
    return Image::from_json(j);
}

StoredImage import_image(const Image& definition, const fs::path& tarball, const ImageStore& store,
                         std::ostream& progress) {
    if (definition.rootfs != "store") {
        throw std::runtime_error("image '" + definition.name +
                                 "': only an image whose rootfs is 'store' can be imported");
    }
    const auto started = Clock::now();
    StopSignals signals;
    make_store_dirs(store);
    sweep_abandoned_builds(store);
    progress << "[1/4] hashing " << tarball.string() << "\n" << std::flush;
    const Finished digest =
        run_child({"sha256sum", "--", fs::absolute(tarball).string()}, nullptr, tool_env());
    if (digest.exit_code != 0 || digest.output.size() < 64) {
        throw std::runtime_error("read " + tarball.string() + ": " + digest.output);
    }
    const std::string tar_digest = digest.output.substr(0, 64);
    check_stop("hash");

    TempDir tmp(make_temp_dir(store, definition.name));
    const fs::path rootfs = tmp.path() / "rootfs";
    fs::create_directory(rootfs);
    ::chmod(rootfs.c_str(), 0755);
    progress << "[2/4] unpacking into " << rootfs.string() << "\n" << std::flush;
    const Finished r =
        run_child({"tar", "--extract", "--file", fs::absolute(tarball).string(), "--directory",
                   rootfs.string(), "--numeric-owner", "--same-permissions", "--no-overwrite-dir"},
                  &progress, tool_env(), {}, started);
    check_stop("unpack");
    if (r.exit_code != 0)
        throw std::runtime_error("tar exited with " + std::to_string(r.exit_code) + ":\n" +
                                 r.output);
    ::chmod(rootfs.c_str(), 0755);

    progress << "[3/4] the sandbox's skeleton and a kernel check\n" << std::flush;
    prepare_stored_root(definition, rootfs);
    check_kernel(definition, rootfs, progress);
    prepare_stored_root(definition, rootfs);
    check_stop("check kernel");
    std::vector<std::string> packages;
    // A dpkg database reached through a symlink could be the host's: not read.
    if (reached_without_symlinks(rootfs, "var/lib/dpkg/status")) {
        packages = installed_packages(rootfs);
    }
    const json def = stored_definition(definition);
    const std::string id = image_content_id(def, {{"rootfs.tar", tar_digest}}, packages);
    const std::uint64_t size = tree_size(rootfs);
    const json manifest = {
        {"name", definition.name},      {"content_id", id},
        {"source", "import"},           {"tarball", fs::absolute(tarball).string()},
        {"tarball_sha256", tar_digest}, {"built_at", unix_now()},
        {"size_bytes", size},           {"package_count", packages.size()},
        {"packages", packages}};
    write_file_bytes(tmp.path() / "manifest.json", manifest.dump(2) + "\n", 0444);
    write_file_bytes(tmp.path() / "image.json", def.dump(2) + "\n", 0444);
    progress << seal_root(rootfs, rootfs / "tmp") << std::flush;

    progress << "[4/4] into place\n" << std::flush;
    StoredImage stored = commit_version(store, tmp, definition.name, id, progress);
    progress << "image " << definition.name << ": " << id << "\n  " << format_size(size)
             << " imported\n"
             << std::flush;
    return stored;
}

}  // namespace cellblock
