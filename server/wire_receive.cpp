#include "wire_receive.hpp"

#include <cstring>

#include "relay_socket.hpp"

namespace cellblock {
using nlohmann::json;

namespace {

// A cursor over JSON text; every step returns false on malformed input.
struct JsonScan {
    std::string_view s;
    std::size_t i = 0;

    void ws() {
        while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) ++i;
    }
    static int hex(char c) {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        return -1;
    }
    bool u16(unsigned& out) {
        if (s.size() - i < 4) return false;
        out = 0;
        for (int k = 0; k < 4; ++k) {
            const int h = hex(s[i + k]);
            if (h < 0) return false;
            out = out * 16 + static_cast<unsigned>(h);
        }
        i += 4;
        return true;
    }
    // A string at i (its opening quote); its decoded UTF-8 size, and its raw
    // bytes between the quotes when it has no escapes (`plain`).
    bool string(std::size_t& size, std::string_view* plain = nullptr) {
        if (i >= s.size() || s[i] != '"') return false;
        const std::size_t start = ++i;
        bool escaped = false;
        size = 0;
        while (true) {
            // Plain bytes up to the next quote or backslash, found with
            // memchr (a 1 MiB string is two passes of libc's, not a loop of
            // ours). A raw control character in them, which JSON forbids, is
            // not looked for: the message is dropped either way.
            const char* base = s.data() + i;
            const auto* quote = static_cast<const char*>(std::memchr(base, '"', s.size() - i));
            if (!quote) return false;
            const auto* backslash = static_cast<const char*>(
                std::memchr(base, '\\', static_cast<std::size_t>(quote - base)));
            const std::size_t stop =
                static_cast<std::size_t>((backslash ? backslash : quote) - s.data());
            size += stop - i;
            i = stop;
            if (s[i] == '"') break;
            escaped = true;
            if (++i >= s.size()) return false;
            const char e = s[i++];
            if (e != 'u') {
                if (std::string_view("\"\\/bfnrt").find(e) == std::string_view::npos) return false;
                size += 1;
                continue;
            }
            unsigned cp = 0;
            if (!u16(cp)) return false;
            if (cp >= 0xDC00 && cp <= 0xDFFF) return false;  // a lone low surrogate
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned low = 0;
                if (s.size() - i < 2 || s[i] != '\\' || s[i + 1] != 'u') return false;
                i += 2;
                if (!u16(low) || low < 0xDC00 || low > 0xDFFF) return false;
                size += 4;
            } else {
                size += cp < 0x80 ? 1 : cp < 0x800 ? 2 : 3;
            }
        }
        if (plain) *plain = escaped ? std::string_view() : s.substr(start, i - start);
        ++i;  // the closing quote
        return true;
    }
    // Any value at i, skipped.
    bool skip_value(std::size_t depth, std::size_t max_depth) {
        ws();
        if (i >= s.size()) return false;
        const char c = s[i];
        if (c == '"') {
            std::size_t ignored = 0;
            return string(ignored);
        }
        if (c == '{' || c == '[') {
            if (depth >= max_depth) return false;
            const char close = c == '{' ? '}' : ']';
            ++i;
            ws();
            if (i < s.size() && s[i] == close) {
                ++i;
                return true;
            }
            while (true) {
                if (c == '{') {
                    ws();
                    std::size_t ignored = 0;
                    if (!string(ignored)) return false;
                    ws();
                    if (i >= s.size() || s[i++] != ':') return false;
                }
                if (!skip_value(depth + 1, max_depth)) return false;
                ws();
                if (i >= s.size()) return false;
                if (s[i] == ',') {
                    ++i;
                    continue;
                }
                if (s[i] != close) return false;
                ++i;
                return true;
            }
        }
        // A number or a literal: up to the next delimiter (the full parse,
        // if it ever runs, judges it).
        const std::size_t start = i;
        while (i < s.size() && std::string_view(",}] \t\n\r").find(s[i]) == std::string_view::npos)
            ++i;
        return i > start;
    }
};

}  // namespace

std::optional<std::size_t> json_string_member_size(std::string_view json, std::string_view key,
                                                   std::size_t max_depth) {
    JsonScan scan{json};
    scan.ws();
    if (scan.i >= json.size() || json[scan.i] != '{') return std::nullopt;
    ++scan.i;
    std::optional<std::size_t> found;
    scan.ws();
    if (scan.i < json.size() && json[scan.i] == '}') return std::nullopt;
    while (true) {
        scan.ws();
        std::size_t name_size = 0;
        std::string_view name;
        if (!scan.string(name_size, &name)) return std::nullopt;
        scan.ws();
        if (scan.i >= json.size() || json[scan.i++] != ':') return std::nullopt;
        scan.ws();
        if (name == key && name.size() == name_size) {
            if (scan.i >= json.size() || json[scan.i] != '"') return std::nullopt;
            std::size_t size = 0;
            if (!scan.string(size)) return std::nullopt;
            if (found) return std::nullopt;  // a duplicate key: let the parser decide
            found = size;
        } else if (!scan.skip_value(1, max_depth)) {
            return std::nullopt;
        }
        scan.ws();
        if (scan.i >= json.size()) return std::nullopt;
        if (json[scan.i] == ',') {
            ++scan.i;
            continue;
        }
        if (json[scan.i] != '}') return std::nullopt;
        ++scan.i;
        break;
    }
    scan.ws();
    if (scan.i != json.size()) return std::nullopt;
    return found;
}

std::vector<std::string> InboundMessage::identities() const {
    std::vector<std::string> ids;
    ids.reserve(layout.delimiter);
    for (std::size_t i = 0; i < layout.delimiter; ++i) ids.emplace_back(frame(i));
    return ids;
}

std::optional<json> InboundMessage::parsed_content(std::size_t max_depth) const {
    if (content.is_object()) return content;
    auto parsed = parse_json_frame(frame(layout.content()), max_depth);
    if (!parsed || !parsed->is_object()) return std::nullopt;
    return parsed;
}

bool verify_frames(Multipart& in, const ReceiveRules& rules, InboundMessage& out,
                   std::string& why) {
    if (in.dropped_frames > 0) {
        why = "too many frames";
        return false;
    }
    VerifyRules verify_rules;
    verify_rules.limits = rules.limits;
    verify_rules.parse_all = rules.parse_all;
    verify_rules.ids = rules.parse_all ? VerifyRules::Ids::non_empty : VerifyRules::Ids::any;
    verify_rules.wording = VerifyRules::Wording::places;
    WireVerify verified = verify(in.views(), *rules.signer, rules.replay, verify_rules);
    if (!verified.ok) {
        why = std::move(verified.error);
        return false;
    }
    out.msg_id = json_string(verified.header, "msg_id");
    out.msg_type = json_string(verified.header, "msg_type");
    out.parent_id = json_string(verified.parent, "msg_id");
    out.header = std::move(verified.header);
    out.parent = std::move(verified.parent);
    out.metadata = std::move(verified.metadata);
    out.content = std::move(verified.content);
    out.layout = verified.layout;
    out.total_bytes = in.total_bytes;
    out.frames = std::move(in.frames);
    in.frames.clear();
    return true;
}

Received receive_verified(RelaySocket& socket, Multipart& scratch, const ReceiveRules& rules,
                          InboundMessage& out, std::string& why, std::string& sender) {
    if (!socket.receive(scratch, rules.limits.max_frames)) return Received::nothing;
    // A ROUTER's first frame is the identity libzmq put there.
    sender = scratch.frames.empty() ? std::string() : std::string(scratch.view(0));
    return verify_frames(scratch, rules, out, why) ? Received::message : Received::rejected;
}

}  // namespace cellblock
