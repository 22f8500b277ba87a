// Fuzzes image descriptions (images/<name>/image.json) and sandbox limits:
// Image::from_json and SandboxLimits::from_json on the input parsed as JSON
// may throw only std::runtime_error; an accepted image has a name, a kernel
// command and absolute host binds; its limits go through
// ServerPolicy::effective as the server does when it loads images. An accepted
// "build" section names only Debian packages and writes only clean absolute
// paths with modes no wider than 0755 and never group- or world-writable.
// Separate from fuzz_limits so a finding in one does not stop the other.
#include <cstdint>
#include <stdexcept>
#include <string_view>
#include <typeinfo>

#include "cellblock/image.hpp"
#include "cellblock/image_builder.hpp"
#include "cellblock/session_policy.hpp"
#include "fuzz_support.hpp"

namespace cellblock::fuzz {
namespace {

using json = nlohmann::json;

// No "", "." or ".." component in a '/'-separated path (leading '/' skipped).
bool clean_components(std::string_view path) {
    if (!path.empty() && path[0] == '/') path.remove_prefix(1);
    while (true) {
        const auto slash = path.find('/');
        const auto part = path.substr(0, slash);
        if (part.empty() || part == "." || part == "..") return false;
        if (slash == std::string_view::npos) return true;
        path.remove_prefix(slash + 1);
    }
}

template <typename F>
bool only_runtime_error(const char* what, F&& f) {
    try {
        f();
        return true;
    } catch (const std::runtime_error& e) {
        FUZZ_CHECK(e.what()[0] != '\0', "%s: empty error", what);
    } catch (const std::exception& e) {
        FUZZ_CHECK(false, "%s threw %s (not std::runtime_error): %s", what, typeid(e).name(),
                   e.what());
    } catch (...) {
        FUZZ_CHECK(false, "%s threw something that is not a std::exception", what);
    }
    return false;
}

void fuzz(const json& j) {
    SandboxLimits sandbox;
    only_runtime_error("SandboxLimits::from_json",
                       [&] { sandbox = SandboxLimits::from_json(j, SandboxLimits{}); });

    Image image;
    if (!only_runtime_error("Image::from_json", [&] { image = Image::from_json(j); })) return;
    FUZZ_CHECK(!image.name.empty(), "an image without a name");
    FUZZ_CHECK(!image.kernel_argv.empty(), "an image without kernel_argv");
    for (const auto& bind : image.host_binds) {
        FUZZ_CHECK(!bind.empty() && bind[0] == '/' && bind.find("..") == std::string::npos,
                   "host bind '%s' accepted", bind.c_str());
    }
    if (!image.build.is_null()) {
        BuildSpec spec;
        if (only_runtime_error("BuildSpec::from_json",
                               [&] { spec = BuildSpec::from_json(image.build); })) {
            for (const auto& pkg : spec.packages) {
                FUZZ_CHECK(!pkg.empty() && pkg.find_first_of(" \t\n/'\"$`;") == std::string::npos,
                           "package '%s' accepted", pkg.c_str());
            }
            for (const auto& file : spec.files) {
                FUZZ_CHECK(
                    file.path.size() > 1 && file.path[0] == '/' && clean_components(file.path),
                    "file path '%s' accepted", file.path.c_str());
                FUZZ_CHECK(
                    file.source.empty() || (file.source[0] != '/' && clean_components(file.source)),
                    "file source '%s' accepted", file.source.c_str());
                FUZZ_CHECK(file.mode >= 0 && file.mode <= 0755 && !(file.mode & 0022),
                           "file mode %o accepted", static_cast<unsigned>(file.mode));
            }
        }
    }
    // As the server does at start: the image's limits layered on its defaults.
    static const ServerPolicy policy;
    try {
        (void)policy.effective(image.limits_json, json::object());
    } catch (const PolicyError&) {
    } catch (const std::exception& e) {
        FUZZ_CHECK(false, "effective(image limits) threw %s: %s", typeid(e).name(), e.what());
    }
}

}  // namespace
}  // namespace cellblock::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded()) cellblock::fuzz::fuzz(j);
    return 0;
}
