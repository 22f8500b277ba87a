// Fuzzes image descriptions (images/<name>/image.json) and sandbox limits:
// Image::from_json and SandboxLimits::from_json on the input parsed as JSON
// may throw only std::runtime_error; an accepted image has a name, a kernel
// command and absolute host binds; its limits go through
// ServerPolicy::effective as the server does when it loads images.
// Separate from fuzz_limits so a finding in one does not stop the other.
#include <cstdint>
#include <stdexcept>
#include <string_view>
#include <typeinfo>

#include "cellblock/image.hpp"
#include "cellblock/session_policy.hpp"
#include "fuzz_support.hpp"

namespace cellblock::fuzz {
namespace {

using json = nlohmann::json;

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
