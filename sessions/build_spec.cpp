// The "build" section of an image.json, parsed and checked. Kept apart from
// the builder so the parser can be fuzzed without the store and the runtime.
#include <cctype>
#include <cstdlib>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>

#include "cellblock/image_builder.hpp"
#include "cellblock/oci_bundle.hpp"

namespace cellblock {
using nlohmann::json;

namespace {

bool is_package_name(const std::string& name) {
    // Debian policy 5.6.1: [a-z0-9][a-z0-9+.-]+; optionally "=version" (apt's syntax).
    const auto eq = name.find('=');
    const std::string pkg = name.substr(0, eq);
    if (pkg.size() < 2 || pkg.size() > 100) return false;
    if (!std::isalnum(static_cast<unsigned char>(pkg[0])) || std::isupper(pkg[0])) return false;
    for (char c : pkg) {
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' || c == '.' ||
              c == '-')) {
            return false;
        }
    }
    if (eq == std::string::npos) return true;
    const std::string version = name.substr(eq + 1);
    if (version.empty() || version.size() > 100) return false;
    for (char c : version) {
        if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '.' || c == '-' ||
              c == '~' || c == ':')) {
            return false;
        }
    }
    return true;
}

bool is_word(const std::string& s) {
    if (s.empty() || s.size() > 64) return false;
    for (char c : s) {
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
    }
    return true;
}

// An absolute path without "..", "." or empty components.
bool is_clean_absolute(const std::string& path) {
    if (path.size() < 2 || path[0] != '/' || path.back() == '/') return false;
    std::stringstream ss(path.substr(1));
    std::string part;
    while (std::getline(ss, part, '/')) {
        if (part.empty() || part == "." || part == "..") return false;
    }
    return true;
}

bool is_clean_relative(const std::string& path) {
    return !path.empty() && path[0] != '/' && is_clean_absolute("/" + path);
}

// Where an extra file would be hidden by a sandbox mount (or be one).
bool under_a_mount(const std::string& path) {
    for (const char* dir :
         {"/proc", "/dev", "/sys", "/tmp", "/run", "/data", kSandboxLibexec, kSandboxHome}) {
        const std::string d = dir;
        if (path == d || path.rfind(d + "/", 0) == 0) return true;
    }
    return false;
}

}  // namespace

BuildSpec BuildSpec::from_json(const json& j) {
    if (!j.is_object()) throw std::runtime_error("build: expected an object");
    static const std::set<std::string> known{"suite",    "mirror", "variant",
                                             "packages", "files",  "strip_docs"};
    for (const auto& [key, value] : j.items()) {
        if (!known.count(key)) throw std::runtime_error("build: unknown field '" + key + "'");
    }
    BuildSpec spec;
    auto text = [&](const char* field, std::string& out) {
        if (!j.contains(field)) return;
        if (!j.at(field).is_string()) {
            throw std::runtime_error(std::string("build: field '") + field + "' must be a string");
        }
        out = j.at(field).get<std::string>();
    };
    text("suite", spec.suite);
    text("mirror", spec.mirror);
    text("variant", spec.variant);
    if (!is_word(spec.suite))
        throw std::runtime_error("build: suite '" + spec.suite + "' is not a suite name");
    if (!is_word(spec.variant)) {
        throw std::runtime_error("build: variant '" + spec.variant +
                                 "' is not an mmdebstrap variant");
    }
    if ((spec.mirror.rfind("http://", 0) != 0 && spec.mirror.rfind("https://", 0) != 0) ||
        spec.mirror.find_first_of(" \t\n\"'") != std::string::npos) {
        throw std::runtime_error("build: mirror '" + spec.mirror + "' is not an http(s) URL");
    }
    if (j.contains("strip_docs")) {
        if (!j.at("strip_docs").is_boolean()) {
            throw std::runtime_error("build: field 'strip_docs' must be true or false");
        }
        spec.strip_docs = j.at("strip_docs").get<bool>();
    }
    if (j.contains("packages")) {
        if (!j.at("packages").is_array()) {
            throw std::runtime_error("build: field 'packages' must be a list of package names");
        }
        for (const auto& p : j.at("packages")) {
            if (!p.is_string() || !is_package_name(p.get<std::string>())) {
                throw std::runtime_error("build: package " + p.dump() +
                                         " is not a Debian package name");
            }
            spec.packages.push_back(p.get<std::string>());
        }
    }
    if (j.contains("files")) {
        if (!j.at("files").is_array())
            throw std::runtime_error("build: field 'files' must be a list");
        std::set<std::string> seen;
        for (const auto& f : j.at("files")) {
            if (!f.is_object() || !f.contains("path") || !f.at("path").is_string()) {
                throw std::runtime_error("build: each file needs a 'path'");
            }
            ExtraFile file;
            file.path = f.at("path").get<std::string>();
            if (!is_clean_absolute(file.path) || under_a_mount(file.path)) {
                throw std::runtime_error("build: file path '" + file.path +
                                         "' must be absolute, without '..', and outside the "
                                         "sandbox's mounts (/proc, /dev, /sys, /tmp, /run, "
                                         "/data, /opt/cellblock, the home directory)");
            }
            if (!seen.insert(file.path).second) {
                throw std::runtime_error("build: file '" + file.path + "' is listed twice");
            }
            const bool has_source = f.contains("source"), has_content = f.contains("content");
            if (has_source == has_content) {
                throw std::runtime_error("build: file '" + file.path +
                                         "' needs exactly one of 'source' and 'content'");
            }
            if (has_source) {
                if (!f.at("source").is_string() || !is_clean_relative(f.at("source"))) {
                    throw std::runtime_error("build: file '" + file.path +
                                             "': source must be a relative path without '..'");
                }
                file.source = f.at("source").get<std::string>();
            } else {
                if (!f.at("content").is_string()) {
                    throw std::runtime_error("build: file '" + file.path +
                                             "': content must be a string");
                }
                file.content = f.at("content").get<std::string>();
            }
            if (f.contains("mode")) {
                const json& m = f.at("mode");
                std::string text_mode = m.is_string() ? m.get<std::string>() : "";
                char* end = nullptr;
                const long mode = text_mode.empty() ? -1 : std::strtol(text_mode.c_str(), &end, 8);
                if (mode < 0 || mode > 0755 || (end && *end)) {
                    throw std::runtime_error("build: file '" + file.path +
                                             "': mode must be an octal string up to \"0755\" "
                                             "(no setuid, setgid or world-writable files)");
                }
                if (mode & 0022) {
                    throw std::runtime_error("build: file '" + file.path +
                                             "': mode must not be group- or world-writable");
                }
                file.mode = static_cast<int>(mode);
            }
            spec.files.push_back(std::move(file));
        }
    }
    return spec;
}

}  // namespace cellblock
