#include "cellblock/wire_message.hpp"

#include <uuid/uuid.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <utility>

#include "cellblock/replay_guard.hpp"
#include "cellblock/signer.hpp"

namespace cellblock {

namespace {

using json = nlohmann::json;

constexpr std::size_t kJsonFrames = 4;  // header, parent_header, metadata, content
constexpr std::array<const char*, kJsonFrames> kJsonFrameNames = {"header", "parent_header",
                                                                  "metadata", "content"};

WireCheck fail_check(std::string error) {
    WireCheck c;
    c.error = std::move(error);
    return c;
}

WireDecode fail_decode(std::string error) {
    WireDecode d;
    d.error = std::move(error);
    return d;
}

// A cheap pass before the real parser. It rejects:
// - nesting deeper than max_depth (counted on brackets outside strings; for
//   valid JSON that is exactly its depth, and on invalid JSON the parser stops
//   at the error no deeper than this count);
// - any NUL byte: nlohmann's lexer takes NUL as end of input, so "{}\0junk"
//   would parse as {} where Python's json (ipykernel, jupyter_client) refuses
//   it. A NUL is never valid anywhere in JSON text.
bool prescan(std::string_view bytes, std::size_t max_depth) {
    std::size_t depth = 0;
    bool in_string = false;
    bool escaped = false;
    for (const char c : bytes) {
        if (c == '\0') return false;
        if (in_string) {
            if (escaped) {
                escaped = false;
            } else if (c == '\\') {
                escaped = true;
            } else if (c == '"') {
                in_string = false;
            }
            continue;
        }
        switch (c) {
            case '"':
                in_string = true;
                break;
            case '{':
            case '[':
                if (++depth > max_depth) return false;
                break;
            case '}':
            case ']':
                if (depth > 0) --depth;
                break;
            default:
                break;
        }
    }
    return true;
}

std::string string_field(const json& object, const char* key) {
    if (!object.is_object()) return {};
    const auto it = object.find(key);
    if (it == object.end() || !it->is_string()) return {};
    return it->get<std::string>();
}

// Compact, as dump() writes it; invalid UTF-8 in a string the server built is
// replaced rather than thrown from the send path.
std::string dump_frame(const json& j) {
    return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

std::string WireMessage::msg_type() const { return string_field(header, "msg_type"); }

std::string WireMessage::msg_id() const { return string_field(header, "msg_id"); }

std::string WireMessage::parent_msg_id() const { return string_field(parent_header, "msg_id"); }

WireCheck check_wire(std::span<const std::string_view> frames, const Signer& signer,
                     ReplayGuard* replay, const WireLimits& limits) {
    if (frames.size() > limits.max_frames) return fail_check("too many frames");

    const auto delimiter = std::find(frames.begin(), frames.end(), kDelimiter);
    if (delimiter == frames.end()) return fail_check("missing delimiter");

    WireCheck check;
    check.layout.delimiter = static_cast<std::size_t>(delimiter - frames.begin());
    const WireLayout& at = check.layout;
    if (at.delimiter > limits.max_identities) return fail_check("too many identities");
    if (frames.size() < at.first_buffer()) return fail_check("too few frames after delimiter");

    for (std::size_t i = at.header(); i <= at.content(); ++i) {
        if (frames[i].size() > limits.max_json_frame_bytes) return fail_check("frame too large");
    }
    std::size_t total = 0;
    for (const std::string_view frame : frames) {
        total += frame.size();
        if (total > limits.max_total_bytes) return fail_check("message too large");
    }

    const std::string_view signature = frames[at.signature()];
    if (!signer.verify(signature, frames[at.header()], frames[at.parent()], frames[at.metadata()],
                       frames[at.content()])) {
        return fail_check("bad signature");
    }
    if (replay != nullptr && !replay->check_and_remember(signature)) {
        return fail_check("replayed message");
    }
    check.ok = true;
    return check;
}

std::optional<json> parse_json_frame(std::string_view bytes, std::size_t max_depth) {
    if (!prescan(bytes, max_depth)) return std::nullopt;
    try {
        json parsed = json::parse(bytes.data(), bytes.data() + bytes.size(), nullptr,
                                  /*allow_exceptions=*/false, /*ignore_comments=*/false);
        if (parsed.is_discarded()) return std::nullopt;
        return parsed;
    } catch (...) {
        // allow_exceptions=false covers parse errors; this catches the rest
        // (bad_alloc on a huge frame) so nothing escapes into the proxy loop.
        return std::nullopt;
    }
}

namespace {

// Why the JSON frame `index` (0: header ... 3: content) was refused.
std::string json_frame_error(const VerifyRules& rules, const WireLayout& at, std::size_t index,
                             bool parsed) {
    if (rules.wording == VerifyRules::Wording::places) {
        return "frame " + std::to_string(at.header() + index - at.delimiter) +
               " is not a JSON object";
    }
    return std::string(kJsonFrameNames[index]) +
           (parsed ? " is not a JSON object" : " is not valid JSON");
}

// Why the header's ids were refused, or nullopt if they pass.
std::optional<std::string> ids_error(const VerifyRules& rules, const json& header) {
    if (rules.ids == VerifyRules::Ids::any) return std::nullopt;
    for (const char* key : {"msg_id", "msg_type"}) {
        const auto it = header.find(key);
        const bool present =
            it != header.end() && it->is_string() &&
            (rules.ids == VerifyRules::Ids::strings || !it->get_ref<const std::string&>().empty());
        if (present) continue;
        if (rules.wording == VerifyRules::Wording::places) {
            return "header lacks msg_id or msg_type";
        }
        return std::string("header has no string ") + key;
    }
    return std::nullopt;
}

WireVerify fail_verify(std::string error) {
    WireVerify v;
    v.error = std::move(error);
    return v;
}

}  // namespace

WireVerify verify(std::span<const std::string_view> frames, const Signer& signer,
                  ReplayGuard* replay, const VerifyRules& rules) {
    // The replay guard is consulted here but only written once the whole
    // message is accepted, so a message that fails to parse is not remembered.
    const WireCheck check = check_wire(frames, signer, nullptr, rules.limits);
    if (!check.ok) return fail_verify(check.error);
    const WireLayout& at = check.layout;
    const std::string_view signature = frames[at.signature()];
    if (replay != nullptr && replay->contains(signature)) return fail_verify("replayed message");

    WireVerify out;
    std::array<json*, kJsonFrames> targets = {&out.header, &out.parent, &out.metadata,
                                              &out.content};
    const std::size_t parsed_frames = rules.parse_all ? kJsonFrames : 2;
    for (std::size_t i = 0; i < parsed_frames; ++i) {
        auto parsed = parse_json_frame(frames[at.header() + i], rules.limits.max_json_depth);
        if (!parsed || !parsed->is_object()) {
            return fail_verify(json_frame_error(rules, at, i, parsed.has_value()));
        }
        *targets[i] = std::move(*parsed);
    }
    if (auto error = ids_error(rules, out.header)) return fail_verify(std::move(*error));

    if (replay != nullptr && !replay->check_and_remember(signature)) {
        return fail_verify("replayed message");
    }
    out.layout = at;
    out.ok = true;
    return out;
}

WireDecode decode(std::span<const std::string_view> frames, const Signer& signer,
                  ReplayGuard* replay, const WireLimits& limits) {
    VerifyRules rules;
    rules.limits = limits;
    WireVerify verified = verify(frames, signer, replay, rules);
    if (!verified.ok) return fail_decode(std::move(verified.error));
    const WireLayout& at = verified.layout;
    WireMessage msg;
    msg.header = std::move(verified.header);
    msg.parent_header = std::move(verified.parent);
    msg.metadata = std::move(verified.metadata);
    msg.content = std::move(verified.content);
    msg.identities.assign(frames.begin(),
                          frames.begin() + static_cast<std::ptrdiff_t>(at.delimiter));
    msg.buffers.assign(frames.begin() + static_cast<std::ptrdiff_t>(at.first_buffer()),
                       frames.end());
    WireDecode out;
    out.message = std::move(msg);
    return out;
}

std::vector<std::string> encode(const WireMessage& msg, const Signer& signer) {
    std::vector<std::string> frames;
    frames.reserve(msg.identities.size() + 6 + msg.buffers.size());
    frames.insert(frames.end(), msg.identities.begin(), msg.identities.end());
    frames.emplace_back(kDelimiter);
    frames.emplace_back();  // signature, filled in below
    const std::size_t signature = frames.size() - 1;
    frames.push_back(dump_frame(msg.header));
    frames.push_back(dump_frame(msg.parent_header));
    frames.push_back(dump_frame(msg.metadata));
    frames.push_back(dump_frame(msg.content));
    frames[signature] = signer.sign(frames[signature + 1], frames[signature + 2],
                                    frames[signature + 3], frames[signature + 4]);
    frames.insert(frames.end(), msg.buffers.begin(), msg.buffers.end());
    return frames;
}

nlohmann::json make_header(std::string_view msg_type, std::string_view session,
                           std::string_view username) {
    return json{
        {"msg_id", make_uuid()},
        {"username", std::string(username)},
        {"session", std::string(session)},
        {"date", iso8601_now()},
        {"msg_type", std::string(msg_type)},
        {"version", std::string(kProtocolVersion)},
    };
}

std::string reply_type(std::string_view request_type) {
    constexpr std::string_view suffix = "_request";
    if (request_type.size() > suffix.size() && request_type.ends_with(suffix)) {
        return std::string(request_type.substr(0, request_type.size() - suffix.size())) + "_reply";
    }
    return "error_reply";
}

WireMessage make_reply(const WireMessage& parent, std::string_view msg_type, nlohmann::json content,
                       std::string_view session) {
    WireMessage reply;
    reply.identities = parent.identities;
    reply.header = make_header(msg_type, session);
    reply.parent_header = parent.header;
    reply.content = std::move(content);
    return reply;
}

std::string make_uuid() {
    uuid_t id;
    uuid_generate_random(id);
    char text[37];
    uuid_unparse_lower(id, text);
    return std::string(text, 36);
}

std::string iso8601_now() {
    using namespace std::chrono;
    const auto since_epoch = duration_cast<microseconds>(system_clock::now().time_since_epoch());
    const auto secs = duration_cast<seconds>(since_epoch);
    const auto micros = static_cast<long>((since_epoch - secs).count());
    const std::time_t t = static_cast<std::time_t>(secs.count());
    std::tm utc{};
    gmtime_r(&t, &utc);
    char text[64];
    const int n =
        std::snprintf(text, sizeof text, "%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ", utc.tm_year + 1900,
                      utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, micros);
    return std::string(text, n > 0 ? static_cast<std::size_t>(n) : 0);
}

namespace {

void put_u32(std::string& out, std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

std::optional<std::uint32_t> take_u32(std::string_view& in) {
    if (in.size() < 4) return std::nullopt;
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i)
        v |= static_cast<std::uint32_t>(static_cast<unsigned char>(in[i])) << (8 * i);
    in.remove_prefix(4);
    return v;
}

}  // namespace

std::string pack_frames(const std::vector<std::string>& frames) {
    std::string out;
    put_u32(out, static_cast<std::uint32_t>(frames.size()));
    for (const auto& f : frames) {
        put_u32(out, static_cast<std::uint32_t>(f.size()));
        out += f;
    }
    return out;
}

std::optional<std::vector<std::string_view>> unpack_frames(std::string_view in,
                                                           std::size_t max_frames) {
    const auto count = take_u32(in);
    if (!count || *count > max_frames) return std::nullopt;
    std::vector<std::string_view> frames;
    for (std::uint32_t i = 0; i < *count; ++i) {
        const auto size = take_u32(in);
        if (!size || *size > in.size()) return std::nullopt;
        frames.push_back(in.substr(0, *size));
        in.remove_prefix(*size);
    }
    if (!in.empty()) return std::nullopt;
    return frames;
}

}  // namespace cellblock
