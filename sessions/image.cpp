#include "cellblock/image.hpp"

#include "cellblock/image_builder.hpp"
#include "cellblock/session_policy.hpp"

#include <climits>
#include <cstdint>
#include <fstream>
#include <stdexcept>

namespace cellblock {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A dotted Python module name: identifiers of [A-Za-z_][A-Za-z0-9_]* joined by '.'.
bool is_module_name(const std::string& name) {
    if (name.empty() || name.size() > 200) return false;
    bool start = true;
    for (char c : name) {
        const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
        const bool digit = c >= '0' && c <= '9';
        if (c == '.') {
            if (start) return false;
            start = true;
        } else if (alpha || (digit && !start)) {
            start = false;
        } else {
            return false;
        }
    }
    return !start;
}

template <typename T>
void read_field(const json& j, const char* name, T& out, const std::string& where) {
    if (!j.contains(name)) return;
    try {
        out = j.at(name).get<T>();
    } catch (const json::exception&) {
        throw std::runtime_error(where + ": field '" + name + "' has the wrong type");
    }
}

using Complaint = std::optional<std::string>;

Complaint check_kernel_argv(const Image& image) {
    if (image.kernel_argv.empty()) return "missing field 'kernel_argv'";
    return std::nullopt;
}

Complaint check_rootfs(const Image& image) {
    if (image.rootfs == "host" || image.rootfs == "store") return std::nullopt;
    if (!image.rootfs.empty() && image.rootfs[0] == '/') return std::nullopt;
    return "rootfs '" + image.rootfs + "' is not host, store or an absolute path";
}

Complaint check_host_binds(const Image& image) {
    if (image.rootfs == "store" && !image.host_binds.empty()) {
        return std::string(
            "host_binds are for the host image only (a built image carries its own files)");
    }
    for (const auto& path : image.host_binds) {
        if (path.empty() || path[0] != '/' || path.find("..") != std::string::npos) {
            return "host bind '" + path + "' is not an absolute path";
        }
    }
    return std::nullopt;
}

Complaint check_build(const Image& image) {
    if (!image.build.is_null() && image.rootfs != "store") {
        return std::string("a build section needs rootfs 'store'");
    }
    return std::nullopt;
}

Complaint check_preload(const Image& image) {
    for (const auto& module : image.preload) {
        if (!is_module_name(module)) return "preload '" + module + "' is not a module name";
    }
    return std::nullopt;
}

Complaint check_warm_imports(const Image& image) {
    for (const auto& module : image.warm_imports) {
        if (!is_module_name(module)) return "warm_imports '" + module + "' is not a module name";
    }
    return std::nullopt;
}

Complaint check_zygote(const Image& image) {
    if (!image.zygote) return std::nullopt;
    if (image.runtime != "runc") {
        return "zygote sessions need the runc runtime, not " + image.runtime;
    }
    const bool launcher = image.kernel_argv.size() >= 2 &&
                          image.kernel_argv[1] == "/opt/cellblock/cellblock_ipykernel.py";
    if (!launcher) {
        return std::string(
            "zygote sessions fork cellblock's ipykernel launcher: kernel_argv must be "
            "[python, /opt/cellblock/cellblock_ipykernel.py, ...]");
    }
    return std::nullopt;
}

Complaint check_hibernate_level(const Image& image) {
    if (image.hibernate_level == "namespace") return std::nullopt;
    if (image.hibernate_level != "exact") {
        return "hibernate_level '" + image.hibernate_level + "' is neither 'namespace' nor 'exact'";
    }
    if (image.runtime != "runsc") {
        return "hibernate_level 'exact' needs the runsc runtime (runc has no checkpoint here: "
               "CRIU fails on this kernel), not " +
               image.runtime;
    }
    return std::nullopt;
}

}  // namespace

const std::vector<ImageCheck>& image_checks() {
    static const std::vector<ImageCheck> checks = {
        {"kernel_argv", check_kernel_argv}, {"rootfs", check_rootfs},
        {"host_binds", check_host_binds},   {"build", check_build},
        {"preload", check_preload},         {"warm_imports", check_warm_imports},
        {"zygote", check_zygote},           {"hibernate_level", check_hibernate_level},
    };
    return checks;
}

json SandboxLimits::to_json() const {
    return {{"memory_mb", memory_mb}, {"pids", pids}, {"disk_mb", disk_mb}, {"shm_mb", shm_mb},
            {"output_mb", output_mb}, {"cpus", cpus}, {"nofile", nofile}};
}

Image Image::from_json(const json& j) {
    if (!j.is_object()) throw std::runtime_error("image: expected an object");
    Image image;
    const std::string where = "image";
    read_field(j, "name", image.name, where);
    read_field(j, "display_name", image.display_name, where);
    read_field(j, "language", image.language, where);
    read_field(j, "runtime", image.runtime, where);
    read_field(j, "rootfs", image.rootfs, where);
    read_field(j, "host_binds", image.host_binds, where);
    read_field(j, "hidden_paths", image.hidden_paths, where);
    read_field(j, "kernel_argv", image.kernel_argv, where);
    read_field(j, "env", image.env, where);
    read_field(j, "preload", image.preload, where);
    read_field(j, "warm_imports", image.warm_imports, where);
    read_field(j, "zygote", image.zygote, where);
    read_field(j, "hibernate_level", image.hibernate_level, where);
    image.definition = j;
    if (j.contains("build")) {
        image.build = j.at("build");
        try {
            BuildSpec::from_json(image.build);
        } catch (const std::exception& e) {
            throw std::runtime_error("image " + image.name + ": " + e.what());
        }
        if (!j.contains("rootfs")) image.rootfs = "store";
    }
    if (j.contains("limits")) {
        image.limits_json = j.at("limits");
        // Checked by the one limits parser (session_policy.cpp) that layers
        // them again at each create, under the server's maxima; the sandbox's
        // fields are kept here for the pool's warm sandboxes.
        SessionLimits layered;
        layered.sandbox = image.limits;
        try {
            image.limits = SessionLimits::from_json(image.limits_json, layered).sandbox;
        } catch (const PolicyError& e) {
            throw std::runtime_error("image " + image.name + ": " + e.what());
        }
    }
    if (image.name.empty()) throw std::runtime_error("image: missing field 'name'");
    for (const auto& check : image_checks()) {
        if (auto complaint = check.check(image)) {
            throw std::runtime_error("image " + image.name + ": " + *complaint + " (check " +
                                     std::string(check.name) + ")");
        }
    }
    return image;
}

Image Image::load(const fs::path& image_json) {
    std::ifstream in(image_json);
    if (!in) throw std::runtime_error("image file " + image_json.string() + ": cannot open");
    json j = json::parse(in, nullptr, false);
    if (j.is_discarded())
        throw std::runtime_error("image file " + image_json.string() + ": not JSON");
    try {
        Image image = from_json(j);
        image.definition_dir = image_json.parent_path();
        return image;
    } catch (const std::exception& e) {
        throw std::runtime_error("image file " + image_json.string() + ": " + e.what());
    }
}

Image find_image(const std::string& name, const std::vector<fs::path>& image_dirs) {
    if (name.empty() || name.find('/') != std::string::npos ||
        name.find("..") != std::string::npos) {
        throw std::runtime_error("image '" + name + "': not a valid image name");
    }
    std::string searched;
    for (const auto& dir : image_dirs) {
        const fs::path candidate = dir / name / "image.json";
        if (fs::exists(candidate)) return Image::load(candidate);
        searched += (searched.empty() ? "" : ", ") + dir.string();
    }
    throw std::runtime_error("image '" + name + "': not found in " + searched);
}

}  // namespace cellblock
