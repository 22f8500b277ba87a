// `cellblock image export`: an image as a tarball a container engine imports
// (swarm_backend.hpp, docs/scale-out.md).
#include <unistd.h>

#include <fstream>

#include "cellblock/oci_bundle.hpp"
#include "cellblock/swarm_backend.hpp"
#include "process.hpp"

namespace cellblock {
namespace fs = std::filesystem;

namespace {

// A host image's root: the node binds its own /usr over /usr; the rest is
// what a runc sandbox of the image gets generated (oci_bundle.cpp).
void write_skeleton(const fs::path& root) {
    for (const char* dir : {"etc", "tmp", "run", "proc", "sys", "dev", "usr", "home/sandbox",
                            "data/input", "data/output", "var/tmp", "root"}) {
        fs::create_directories(root / dir);
    }
    for (const char* link : {"bin", "sbin", "lib", "lib64"}) {
        fs::create_symlink(std::string("usr/") + link, root / link);
    }
    const std::string uid = std::to_string(kSandboxUid);
    std::ofstream(root / "etc/passwd")
        << "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        << "sandbox:x:" << uid << ":" << uid << ":sandbox:/home/sandbox:/bin/sh\n"
        << "nobody:x:65534:65534:nobody:/nonexistent:"
           "/usr/sbin/nologin\n";
    std::ofstream(root / "etc/group") << "root:x:0:\nsandbox:x:" << uid << ":\nnogroup:x:65534:\n";
    std::ofstream(root / "etc/hosts") << "127.0.0.1 localhost sandbox\n::1 localhost\n";
    std::ofstream(root / "etc/nsswitch.conf") << "passwd: files\ngroup: files\nhosts: files\n";
    std::ofstream(root / "etc/hostname") << "sandbox\n";
}

void run_tar(const std::vector<std::string>& argv) {
    const ProcessResult r = run_process(argv);
    if (r.exit_code != 0) {
        throw SandboxError("image export: tar failed (" + std::to_string(r.exit_code) +
                           "): " + r.output.substr(0, 1000));
    }
}

}  // namespace

std::string export_engine_image(const Image& image, const fs::path& libexec_dir,
                                const fs::path& output) {
    // The tag names the shim the image carries; this also finds a libexec dir without it.
    SwarmSettings tagged;
    try {
        tagged.libexec_tag = libexec_digest(libexec_dir);
    } catch (const SandboxError& e) {
        throw SandboxError(std::string("image export: ") + e.what() +
                           " (--libexec-dir names the build's libexec/cellblock)");
    }
    const fs::path out = fs::absolute(output);
    const fs::path partial = out.string() + ".partial";
    fs::path skeleton;
    fs::path root;
    if (image.rootfs == "host") {
        skeleton = fs::temp_directory_path() /
                   ("cellblock-export-" + std::to_string(::getpid()) + "-" + image.name);
        fs::remove_all(skeleton);
        fs::create_directories(skeleton);
        root = skeleton;
    } else if (!image.rootfs.empty() && image.rootfs[0] == '/') {
        root = image.rootfs;
    } else {
        throw SandboxError("image export: image " + image.name + " has no root to export (" +
                           image.rootfs + ")");
    }
    try {
        if (!skeleton.empty()) write_skeleton(skeleton);
        const std::vector<std::string> common = {"tar", "--numeric-owner", "--xattrs",
                                                 "--one-file-system"};
        auto argv = common;
        argv.insert(argv.end(), {"-C", root.string(), "-cf", partial.string(), "."});
        run_tar(argv);
        // The shim and the launcher at /opt/cellblock, root's and read-only.
        argv = common;
        argv.insert(argv.end(), {"--owner=0", "--group=0", "--mode=a+rX,go-w",
                                 "--transform=s,^\\.,./opt/cellblock,", "-C", libexec_dir.string(),
                                 "-rf", partial.string(), "."});
        run_tar(argv);
        fs::rename(partial, out);
    } catch (...) {
        std::error_code ec;
        fs::remove(partial, ec);
        if (!skeleton.empty()) fs::remove_all(skeleton, ec);
        throw;
    }
    if (!skeleton.empty()) fs::remove_all(skeleton);
    return swarm_image_ref(tagged, image);
}

}  // namespace cellblock
