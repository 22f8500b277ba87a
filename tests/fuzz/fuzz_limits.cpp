// Fuzzes session limits and output shaping:
// - SessionLimits::from_json and ServerPolicy::effective on the input parsed
//   as JSON (as one layer, as both layers, and as [image, request]): only
//   PolicyError may escape, and what is accepted is positive, within the
//   server's maxima and survives to_json/from_json;
// - utf8_safe_prefix on the raw input at every cut point: the result is at
//   most the cut, backs up only over continuation bytes (at most 3), and on
//   valid UTF-8 ends on a character boundary;
// - SessionGovernor::on_stream on the input in chunks: never keeps more than
//   output_bytes, one marker, nothing kept after the first drop.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <typeinfo>

#include "cellblock/session_policy.hpp"
#include "fuzz_support.hpp"

namespace cellblock::fuzz {
namespace {

using json = nlohmann::json;

const ServerPolicy& policy() {
    static const ServerPolicy p;
    return p;
}

// Runs f; returns its value, nullopt on PolicyError, aborts on anything else.
std::optional<SessionLimits> expect_policy(const char* what,
                                           const std::function<SessionLimits()>& f) {
    try {
        return f();
    } catch (const PolicyError& e) {
        FUZZ_CHECK(e.ename() == "InvalidLimits" || e.ename() == "LimitAboveMaximum",
                   "%s: unexpected ename %s", what, e.ename().c_str());
        FUZZ_CHECK(e.what()[0] != '\0', "%s: PolicyError without evalue", what);
    } catch (const std::exception& e) {
        FUZZ_CHECK(false, "%s threw %s (not PolicyError): %s", what, typeid(e).name(), e.what());
    } catch (...) {
        FUZZ_CHECK(false, "%s threw something that is not a std::exception", what);
    }
    return std::nullopt;
}

void check_positive_and_round_trip(const SessionLimits& l, const char* what) {
    const json fields = l.to_json();
    for (const auto& [name, value] : fields.items()) {
        if (name == "network") {
            // The one object: a mode, lists, and positive caps.
            FUZZ_CHECK(value.is_object() &&
                           (value["mode"] == "none" || value["mode"] == "gateway") &&
                           value["allow"].is_array() && value["secrets"].is_array(),
                       "%s: network is %s", what, value.dump().c_str());
            for (const char* cap : {"max_bytes", "max_connections", "request_timeout_s"}) {
                FUZZ_CHECK(value[cap].is_number() && value[cap].get<double>() > 0,
                           "%s: network.%s is %s", what, cap, value[cap].dump().c_str());
            }
            continue;
        }
        FUZZ_CHECK(value.is_number() && value.get<double>() > 0, "%s: %s is %s", what, name.c_str(),
                   value.dump().c_str());
    }
    const auto again = expect_policy("from_json(to_json())", [&] {
        return SessionLimits::from_json(l.to_json(), SessionLimits{});
    });
    FUZZ_CHECK(again && again->to_json() == l.to_json(), "%s: to_json/from_json round trip", what);
}

void check_within_maxima(const SessionLimits& l, const char* what) {
    check_positive_and_round_trip(l, what);
    ServerPolicy p = policy();
    p.defaults = l;  // validate(): positive and not above the maxima
    try {
        p.validate();
    } catch (const std::exception& e) {
        FUZZ_CHECK(false, "%s accepted limits the policy calls invalid: %s", what, e.what());
    }
}

void fuzz_limits(const json& j) {
    if (auto l = expect_policy("SessionLimits::from_json",
                               [&] { return SessionLimits::from_json(j, SessionLimits{}); })) {
        check_positive_and_round_trip(*l, "from_json");
    }
    const json empty = json::object();
    const std::pair<const json*, const json*> layers[] = {{&j, &empty}, {&empty, &j}, {&j, &j}};
    for (const auto& layer : layers) {
        if (auto l = expect_policy("ServerPolicy::effective", [&] {
                return policy().effective(*layer.first, *layer.second);
            })) {
            check_within_maxima(*l, "effective");
        }
    }
    if (j.is_array() && j.size() == 2) {
        if (auto l = expect_policy("ServerPolicy::effective([image, request])",
                                   [&] { return policy().effective(j[0], j[1]); })) {
            check_within_maxima(*l, "effective([image, request])");
        }
    }
}

bool continuation(unsigned char c) { return (c & 0xC0) == 0x80; }

// Strict UTF-8 (no overlongs, no surrogates, at most U+10FFFF).
bool valid_utf8(std::string_view s) {
    std::size_t i = 0;
    while (i < s.size()) {
        const auto c = static_cast<unsigned char>(s[i]);
        std::size_t n = 0;
        std::uint32_t cp = 0;
        if (c < 0x80) {
            ++i;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            n = 1, cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            n = 2, cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            n = 3, cp = c & 0x07;
        } else {
            return false;
        }
        if (i + n >= s.size()) return false;  // truncated sequence
        for (std::size_t k = 1; k <= n; ++k) {
            const auto cc = static_cast<unsigned char>(s[i + k]);
            if (!continuation(cc)) return false;
            cp = (cp << 6) | (cc & 0x3F);
        }
        const std::uint32_t min[] = {0, 0x80, 0x800, 0x10000};
        if (cp < min[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        i += n + 1;
    }
    return true;
}

void fuzz_utf8(std::string_view text) {
    const bool valid = valid_utf8(text);
    for (std::size_t max = 0; max <= text.size() + 1; ++max) {
        const std::size_t r = utf8_safe_prefix(text, max);
        if (max >= text.size()) {
            FUZZ_CHECK(r == text.size(), "max %zu >= size %zu but kept %zu", max, text.size(), r);
            continue;
        }
        FUZZ_CHECK(r <= max, "kept %zu of at most %zu", r, max);
        FUZZ_CHECK(max - r <= 3, "backed up %zu bytes", max - r);
        for (std::size_t k = r + 1; k <= max; ++k) {
            FUZZ_CHECK(continuation(static_cast<unsigned char>(text[k])),
                       "backed up over a byte that is not a continuation (cut %zu, kept %zu)", max,
                       r);
        }
        if (r < max) {
            FUZZ_CHECK(!continuation(static_cast<unsigned char>(text[r])),
                       "cut %zu: prefix of %zu ends inside a character", max, r);
        }
        if (valid) {
            // On valid UTF-8 a non-continuation byte starts a character.
            FUZZ_CHECK(!continuation(static_cast<unsigned char>(text[r])),
                       "valid UTF-8 cut mid-character: cut %zu, kept %zu", max, r);
        }
    }
}

void fuzz_stream(const std::uint8_t* data, std::size_t size) {
    if (size < 2) return;
    SessionLimits limits;
    limits.output_bytes = 1 + data[0];  // small, so the cut is reached
    const std::size_t chunk = 1 + data[1] % 64;
    SessionGovernor governor(limits, policy(), Clock::now());
    governor.on_execute_request(Clock::now(), std::nullopt);
    std::string_view rest(reinterpret_cast<const char*>(data + 2), size - 2);
    std::uint64_t kept = 0;
    int markers = 0;
    bool dropped = false;
    while (!rest.empty()) {
        const std::string_view piece = rest.substr(0, chunk);
        rest.remove_prefix(piece.size());
        const auto decision = governor.on_stream(piece);
        FUZZ_CHECK(decision.keep <= piece.size(), "kept more than the message");
        if (dropped) FUZZ_CHECK(decision.keep == 0, "output resumed after the marker");
        kept += decision.keep;
        markers += decision.add_marker ? 1 : 0;
        dropped = dropped || decision.keep < piece.size();
    }
    FUZZ_CHECK(kept <= static_cast<std::uint64_t>(limits.output_bytes), "kept %llu of %lld",
               static_cast<unsigned long long>(kept), static_cast<long long>(limits.output_bytes));
    FUZZ_CHECK(markers == (dropped ? 1 : 0), "%d markers", markers);
    FUZZ_CHECK(governor.truncated() == dropped, "truncated() disagrees");
}

}  // namespace
}  // namespace cellblock::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    using namespace cellblock::fuzz;
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!j.is_discarded()) fuzz_limits(j);
    fuzz_utf8(text);
    fuzz_stream(data, size);
    return 0;
}
