#include "cellblock/image.hpp"

#include "cellblock/image_builder.hpp"

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

// A limit that must be a positive whole number that fits an int: nlohmann's
// get<int>() would cast 1e10 or 1.9 without a range check (undefined behaviour).
void read_field(const json& j, const char* name, int& out, const std::string& where) {
    if (!j.contains(name)) return;
    const json& v = j.at(name);
    if (!v.is_number_integer()) {
        throw std::runtime_error(where + ": field '" + name + "' must be a whole number");
    }
    const bool fits = v.is_number_unsigned()
                          ? v.get<std::uint64_t>() <= static_cast<std::uint64_t>(INT_MAX)
                          : v.get<std::int64_t>() >= 1 && v.get<std::int64_t>() <= INT_MAX;
    if (!fits || v.get<std::int64_t>() < 1) {
        throw std::runtime_error(where + ": field '" + name + "' must be between 1 and " +
                                 std::to_string(INT_MAX));
    }
    out = static_cast<int>(v.get<std::int64_t>());
}

void read_field(const json& j, const char* name, double& out, const std::string& where) {
    if (!j.contains(name)) return;
    const json& v = j.at(name);
    if (!v.is_number() || !(v.get<double>() > 0) || v.get<double>() > 1e6) {
        throw std::runtime_error(where + ": field '" + name + "' must be a positive number");
    }
    out = v.get<double>();
}

}  // namespace

json SandboxLimits::to_json() const {
    return {{"memory_mb", memory_mb}, {"pids", pids}, {"disk_mb", disk_mb}, {"shm_mb", shm_mb},
            {"output_mb", output_mb}, {"cpus", cpus}, {"nofile", nofile}};
}

SandboxLimits SandboxLimits::from_json(const json& j, const SandboxLimits& base) {
    if (!j.is_object()) throw std::runtime_error("limits: expected an object");
    SandboxLimits out = base;
    const std::string where = "limits";
    read_field(j, "memory_mb", out.memory_mb, where);
    read_field(j, "pids", out.pids, where);
    read_field(j, "disk_mb", out.disk_mb, where);
    read_field(j, "shm_mb", out.shm_mb, where);
    read_field(j, "output_mb", out.output_mb, where);
    read_field(j, "cpus", out.cpus, where);
    read_field(j, "nofile", out.nofile, where);
    return out;
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
        // Session-level fields (max_executions, ...) are layered by the server's policy.
        nlohmann::json sandbox_fields = nlohmann::json::object();
        for (const auto& [key, value] : image.limits_json.items()) {
            if (SandboxLimits{}.to_json().contains(key)) sandbox_fields[key] = value;
        }
        image.limits = SandboxLimits::from_json(sandbox_fields, image.limits);
    }
    if (image.name.empty()) throw std::runtime_error("image: missing field 'name'");
    if (image.kernel_argv.empty()) {
        throw std::runtime_error("image " + image.name + ": missing field 'kernel_argv'");
    }
    if (image.rootfs != "host" && image.rootfs != "store" &&
        (image.rootfs.empty() || image.rootfs[0] != '/')) {
        throw std::runtime_error("image " + image.name + ": rootfs '" + image.rootfs +
                                 "' is not host, store or an absolute path");
    }
    if (image.rootfs == "store" && !image.host_binds.empty()) {
        throw std::runtime_error("image " + image.name +
                                 ": host_binds are for the host image only (a built image "
                                 "carries its own files)");
    }
    if (!image.build.is_null() && image.rootfs != "store") {
        throw std::runtime_error("image " + image.name + ": a build section needs rootfs 'store'");
    }
    for (const auto& path : image.host_binds) {
        if (path.empty() || path[0] != '/' || path.find("..") != std::string::npos) {
            throw std::runtime_error("image " + image.name + ": host bind '" + path +
                                     "' is not an absolute path");
        }
    }
    for (const auto& module : image.preload) {
        if (!is_module_name(module)) {
            throw std::runtime_error("image " + image.name + ": preload '" + module +
                                     "' is not a module name");
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
